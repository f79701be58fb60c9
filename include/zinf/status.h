// Status and Result<T>: how every fallible zinf call reports failure.
//
// A Status is OK or carries a code, a message that says what failed, where (file, offset,
// tensor) and what the user can do, and the errno that caused it when there was one.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace zinf {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,
  kNotFound,
  kAlreadyExists,
  kFailedPrecondition,
  kResourceExhausted,  // a budget, a capacity or the disk is full
  kIoError,
  kCorruption,  // data read back does not match what was written (checksum, torn write)
  kNotSupported,
  kInternal,
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message, int sys_errno = 0)
      : code_(code), sys_errno_(sys_errno), message_(std::move(message)) {}

  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string m) {
    return {StatusCode::kInvalidArgument, std::move(m)};
  }
  static Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status AlreadyExists(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
  static Status FailedPrecondition(std::string m) {
    return {StatusCode::kFailedPrecondition, std::move(m)};
  }
  static Status ResourceExhausted(std::string m) {
    return {StatusCode::kResourceExhausted, std::move(m)};
  }
  static Status IoError(std::string m, int sys_errno = 0) {
    return {StatusCode::kIoError, std::move(m), sys_errno};
  }
  static Status Corruption(std::string m) { return {StatusCode::kCorruption, std::move(m)}; }
  static Status NotSupported(std::string m) { return {StatusCode::kNotSupported, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  // The errno behind the failure, 0 when there was none.
  int sys_errno() const { return sys_errno_; }
  const std::string& message() const { return message_; }
  // "IoError: <message>" or "OK".
  std::string ToString() const;
  // A copy whose message starts with `context`: "context: message". OK stays OK. The key
  // and errno stay.
  Status WithContext(std::string_view context) const;
  // Keeps the first failure of several: takes `other` only while this is OK.
  void Update(const Status& other) {
    if (ok() && !other.ok()) *this = other;
  }
  // The configuration key the failure is about, when there is one ("zinf.pinned_budget_bytes"):
  // a front end names its own flag for it without reading the message. "" when none.
  const std::string& key() const { return key_; }
  // A copy naming `key` (see key()). OK stays OK.
  Status WithKey(std::string key) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  int sys_errno_ = 0;
  std::string message_;
  std::string key_;
};

// The one place where an errno value becomes a Status. `what` names the operation and its
// object ("pwrite /mnt/nvme/zinf-swap-0.bin offset 4096 length 1048576"); the result reads
// "<what>: <strerror> (errno N)" with a code chosen from the errno (ENOSPC -> kResourceExhausted,
// EINVAL -> kInvalidArgument, ENOENT -> kNotFound, EEXIST -> kAlreadyExists, else kIoError).
Status ErrnoToStatus(int err, std::string_view what);

[[noreturn]] void CheckFailed(const char* file, int line, const char* cond, const char* msg);
// Prints "zinf: Result::value() on an error: <status>" to stderr and aborts.
[[noreturn]] void ResultValueOnError(const Status& status);

// Result<T>: a value or a non-OK Status.
// value(), operator* and operator-> REQUIRE ok(): on an error they abort, printing the status
// (in release builds too), since reading a value that is not there is a programmer error.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT: implicit on purpose
  Result(Status status) : status_(std::move(status)) {  // NOLINT
    if (status_.ok()) status_ = Status::Internal("Result constructed from an OK Status");
  }
  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return Checked(); }
  const T& value() const& { return Checked(); }
  T&& value() && { return std::move(Checked()); }
  T* operator->() { return &Checked(); }
  const T* operator->() const { return &Checked(); }
  T& operator*() & { return Checked(); }
  const T& operator*() const& { return Checked(); }

 private:
  T& Checked() {
    if (!value_.has_value()) ResultValueOnError(status_);
    return *value_;
  }
  const T& Checked() const {
    if (!value_.has_value()) ResultValueOnError(status_);
    return *value_;
  }

  std::optional<T> value_;
  Status status_;
};

}  // namespace zinf

// For programmer errors only (on in release builds). Never for I/O or user input.
#define ZINF_CHECK(cond)                                                  \
  do {                                                                    \
    if (!(cond)) ::zinf::CheckFailed(__FILE__, __LINE__, #cond, nullptr); \
  } while (0)
#define ZINF_CHECK_MSG(cond, msg)                                       \
  do {                                                                  \
    if (!(cond)) ::zinf::CheckFailed(__FILE__, __LINE__, #cond, (msg)); \
  } while (0)

#define ZINF_CONCAT_INNER_(a, b) a##b
#define ZINF_CONCAT_(a, b) ZINF_CONCAT_INNER_(a, b)

#define ZINF_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::zinf::Status zinf_status_ = (expr);        \
    if (!zinf_status_.ok()) return zinf_status_; \
  } while (0)

#define ZINF_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()

#define ZINF_ASSIGN_OR_RETURN(lhs, expr) \
  ZINF_ASSIGN_OR_RETURN_IMPL_(ZINF_CONCAT_(zinf_result_, __LINE__), lhs, expr)
