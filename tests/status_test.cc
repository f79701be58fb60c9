#include "zinf/status.h"

#include <gtest/gtest.h>

#include <cerrno>

namespace zinf {
namespace {

TEST(StatusTest, ErrnoBecomesStatusWithCodeAndText) {
  Status s = ErrnoToStatus(ENOSPC, "pwrite /x offset 4096");
  EXPECT_EQ(StatusCode::kResourceExhausted, s.code());
  EXPECT_EQ(ENOSPC, s.sys_errno());
  EXPECT_EQ("pwrite /x offset 4096: No space left on device (errno 28)", s.message());
  EXPECT_EQ(StatusCode::kIoError, ErrnoToStatus(EIO, "r").code());
  EXPECT_EQ(StatusCode::kNotFound, ErrnoToStatus(ENOENT, "r").code());
  EXPECT_EQ(StatusCode::kInvalidArgument, ErrnoToStatus(EINVAL, "r").code());
  EXPECT_EQ("IoError: ctx: r: Input/output error (errno 5)",
            ErrnoToStatus(EIO, "r").WithContext("ctx").ToString());
  EXPECT_TRUE(Status::OK().WithContext("x").ok());
}

Result<int> Half(int x) {
  if (x % 2) return Status::InvalidArgument("odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  ZINF_ASSIGN_OR_RETURN(int h, Half(x));
  return Half(h);
}

TEST(StatusTest, ResultCarriesValueOrStatus) {
  EXPECT_EQ(2, Quarter(8).value());
  EXPECT_EQ("odd", Quarter(6).status().message());
  Result<int> from_ok_status = Status::OK();
  EXPECT_FALSE(from_ok_status.ok());
  EXPECT_EQ(StatusCode::kInternal, from_ok_status.status().code());
}

// Reading the value of an error is a programmer error: it aborts with the status (in release
// builds too), instead of handing out an empty optional's storage.
TEST(StatusDeathTest, ValueOfAnErrorAbortsNamingTheStatus) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const char* expected = "zinf: Result::value\\(\\) on an error: InvalidArgument: odd";
  EXPECT_DEATH((void)Quarter(6).value(), expected);
  Result<std::string> error = Status::NotFound("no such tensor 'w'");
  EXPECT_DEATH((void)error.value().size(), "on an error: NotFound: no such tensor 'w'");
  EXPECT_DEATH((void)error->size(), "on an error: NotFound: no such tensor 'w'");
  EXPECT_DEATH((void)(*error).size(), "on an error: NotFound: no such tensor 'w'");
  const Result<std::string>& const_error = error;
  EXPECT_DEATH((void)const_error.value().size(), "on an error: NotFound");
  EXPECT_DEATH((void)std::move(error).value(), "on an error: NotFound");
}

}  // namespace
}  // namespace zinf
