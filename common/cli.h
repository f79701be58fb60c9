// The command-line convention of zinf's programs (zinf-train and the benches): one exit-status
// rule, stated at the end of every --help, and one way to parse.
#pragma once

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdlib>
#include <string>

namespace zinf {

inline constexpr int kExitOk = 0;
// The run started and failed: I/O, space, damaged state, a non-finite loss, a device error.
inline constexpr int kExitFailure = 1;
// Nothing ran: a flag, the configuration, a folder or the environment was refused.
inline constexpr int kExitUsage = 2;

inline constexpr const char* kExitStatusHelp =
    "Exit status: 0 done; 1 the run failed (I/O, space, damaged state, non-finite values, a "
    "device error: the message says what and where); 2 nothing ran: a flag, the "
    "configuration, a folder or the environment was refused (the message says which and why).";

// Parses argv into `app` (with the exit-status footer). Returns -1 to go on, else the status
// to exit with: 0 after --help, kExitUsage on a usage error (CLI11 prints it).
inline int ParseCommandLine(CLI::App& app, int argc, char** argv) {
  app.footer(kExitStatusHelp);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? kExitOk : kExitUsage;
  }
  return -1;
}

// A validator for floating-point flags: a range alone lets "nan" through (every comparison
// with NaN is false).
inline const CLI::Validator& FiniteNumber() {
  static const CLI::Validator v(
      [](std::string& s) {
        char* end = nullptr;
        const double x = std::strtod(s.c_str(), &end);
        return std::isfinite(x) && end != s.c_str() && *end == '\0'
                   ? std::string()
                   : "'" + s + "' is not a finite number";
      },
      "FINITE");
  return v;
}

}  // namespace zinf
