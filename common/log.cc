#include "zinf/log.h"

#include <cstdio>
#include <mutex>

namespace zinf {
namespace {

std::mutex g_log_mu;
LogSink g_sink;  // guarded by g_log_mu; empty means stderr

const char* LevelPrefix(LogLevel level) {
  switch (level) {
    case LogLevel::kInfo:
      return "zinf: ";
    case LogLevel::kWarning:
      return "zinf: warning: ";
    case LogLevel::kError:
      return "zinf: error: ";
  }
  return "zinf: ";
}

}  // namespace

LogSink SetLogSink(LogSink sink) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  LogSink previous = std::move(g_sink);
  g_sink = std::move(sink);
  return previous;
}

void Log(LogLevel level, const std::string& line) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  if (g_sink) {
    g_sink(level, line);
    return;
  }
  std::fprintf(stderr, "%s%s\n", LevelPrefix(level), line.c_str());
}

std::string FormatBytes(unsigned long long n) {
  char buf[64];
  if (n >= (1ull << 30)) {
    std::snprintf(buf, sizeof(buf), "%.1f GiB", n / double(1ull << 30));
  } else if (n >= (1ull << 20)) {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", n / double(1ull << 20));
  } else if (n >= (1ull << 10)) {
    std::snprintf(buf, sizeof(buf), "%.1f KiB", n / double(1ull << 10));
  } else {
    std::snprintf(buf, sizeof(buf), "%llu bytes", n);
  }
  return buf;
}

}  // namespace zinf
