// Diagnostics: warnings and information lines, to stderr by default.
#pragma once

#include <functional>
#include <string>

namespace zinf {

enum class LogLevel { kInfo, kWarning, kError };

// Receives every log line. Thread-safe to call; the sink itself must be thread-safe.
using LogSink = std::function<void(LogLevel level, const std::string& line)>;

// Replaces the sink (nullptr restores the stderr sink); returns the previous one. Tests use it
// to assert on warnings.
LogSink SetLogSink(LogSink sink);

void Log(LogLevel level, const std::string& line);
inline void LogWarning(const std::string& line) { Log(LogLevel::kWarning, line); }
// "1.5 GiB", "12.0 MiB", "4096 bytes": sizes in messages.
std::string FormatBytes(unsigned long long bytes);

inline void LogInfo(const std::string& line) { Log(LogLevel::kInfo, line); }

}  // namespace zinf
