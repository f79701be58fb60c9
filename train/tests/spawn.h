// Running zinf-train from a test: a child process with its arguments, its stdout and stderr
// captured, ZINF_CRASH_AT armed when asked, one BLAS thread (results must not depend on the
// machine's core count).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;

namespace zinf::testing {

struct Outcome {
  bool killed = false;     // ended by SIGKILL
  bool timed_out = false;  // it did not end in time and the test killed it
  int exit_code = -1;      // when it exited
  std::string stdout_text, stderr_text;
};

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs zinf-train with `args` (after the binary), stdout and stderr into files under `work`;
// `crash` arms ZINF_CRASH_AT; `as_limit_kib` (when not 0) is the address-space limit it runs
// under (ulimit -v, through /bin/sh).
inline Outcome Spawn(const std::string& work, std::vector<std::string> args,
                     const std::string& crash, uint64_t as_limit_kib = 0) {
  args.insert(args.begin(), ZINF_TRAIN_BIN);
  if (as_limit_kib != 0) {
    args.insert(
        args.begin(),
        {"/bin/sh", "-c", "ulimit -v " + std::to_string(as_limit_kib) + " && exec \"$0\" \"$@\""});
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_store;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::string(*e).rfind("ZINF_CRASH_AT=", 0) != 0) env_store.emplace_back(*e);
  }
  if (!crash.empty()) env_store.push_back("ZINF_CRASH_AT=" + crash);
  // One BLAS thread: the result must not depend on how many the machine has.
  env_store.push_back("OPENBLAS_NUM_THREADS=1");
  std::vector<char*> envp;
  for (std::string& e : env_store) envp.push_back(e.data());
  envp.push_back(nullptr);

  const std::string out_path = work + "/stdout", err_path = work + "/stderr";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_addopen(&fa, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  pid_t pid;
  Outcome o;
  int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    o.stderr_text = "posix_spawn failed: " + std::string(strerror(rc));
    return o;
  }
  // Bounded: a child that hangs (a read that never ends) is killed after kTimeoutSeconds and
  // the outcome says so, so a test fails instead of waiting for ctest's limit.
  constexpr int64_t kTimeoutMicros = int64_t{300} * 1000 * 1000;
  int status = 0;
  int64_t waited = 0;
  for (useconds_t pause = 1000;; pause = std::min<useconds_t>(2 * pause, 50000)) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid || (r < 0 && errno != EINTR)) break;
    if (waited >= kTimeoutMicros) {
      kill(pid, SIGKILL);  // our own child, by its pid
      o.timed_out = true;
      while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      break;
    }
    usleep(pause);
    waited += pause;
  }
  o.killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL && !o.timed_out;
  if (WIFEXITED(status)) o.exit_code = WEXITSTATUS(status);
  o.stdout_text = ReadFile(out_path);
  o.stderr_text = ReadFile(err_path);
  return o;
}

// The "param_checksum" of the final JSON line.
inline std::string Checksum(const std::string& out) {
  const std::string key = "\"param_checksum\":\"";
  size_t at = out.rfind(key);
  if (at == std::string::npos) return "";
  return out.substr(at + key.size(), 16);
}

}  // namespace zinf::testing
