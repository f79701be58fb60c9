#include "zinf/status.h"

#include <cerrno>
#include <cstring>

namespace zinf {

const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kAlreadyExists:
      return "AlreadyExists";
    case StatusCode::kFailedPrecondition:
      return "FailedPrecondition";
    case StatusCode::kResourceExhausted:
      return "ResourceExhausted";
    case StatusCode::kIoError:
      return "IoError";
    case StatusCode::kCorruption:
      return "Corruption";
    case StatusCode::kNotSupported:
      return "NotSupported";
    case StatusCode::kInternal:
      return "Internal";
  }
  return "Unknown";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(StatusCodeName(code_)) + ": " + message_;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  Status s(code_, std::string(context) + ": " + message_, sys_errno_);
  s.key_ = key_;
  return s;
}

Status Status::WithKey(std::string key) const {
  if (ok()) return *this;
  Status s = *this;
  s.key_ = std::move(key);
  return s;
}

Status ErrnoToStatus(int err, std::string_view what) {
  char buf[128];
  // GNU strerror_r returns the message pointer (maybe not buf).
  const char* text = strerror_r(err, buf, sizeof(buf));
  std::string msg = std::string(what) + ": " + text + " (errno " + std::to_string(err) + ")";
  StatusCode code = StatusCode::kIoError;
  switch (err) {
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
      code = StatusCode::kResourceExhausted;
      break;
    case EINVAL:
      code = StatusCode::kInvalidArgument;
      break;
    case ENOENT:
      code = StatusCode::kNotFound;
      break;
    case EEXIST:
      code = StatusCode::kAlreadyExists;
      break;
    case EOPNOTSUPP:
    case ENOSYS:
      code = StatusCode::kNotSupported;
      break;
    default:
      break;
  }
  return Status(code, std::move(msg), err);
}

void CheckFailed(const char* file, int line, const char* cond, const char* msg) {
  std::fprintf(stderr, "zinf: internal check failed at %s:%d: %s%s%s\n", file, line, cond,
               msg ? ": " : "", msg ? msg : "");
  std::fflush(stderr);
  std::abort();
}

void ResultValueOnError(const Status& status) {
  std::fprintf(stderr, "zinf: Result::value() on an error: %s\n", status.ToString().c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace zinf
