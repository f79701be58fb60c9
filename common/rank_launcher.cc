// --nproc N of zinf-train and zinf-engine-bench: the command as N rank processes of one group
// on this machine, supervised (common/rank_launcher.h).
#include "common/rank_launcher.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace zinf {
namespace {

std::atomic<int> g_signal{0};

void OnSignal(int sig) { g_signal.store(sig); }

// argv without --nproc N / --nproc=N.
std::vector<std::string> ChildArgs(int argc, char** argv) {
  std::vector<std::string> args;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--nproc") {
      ++i;  // and its value
      continue;
    }
    if (a.rfind("--nproc=", 0) == 0) continue;
    args.push_back(a);
  }
  return args;
}

std::string Describe(int status) {
  if (WIFSIGNALED(status)) {
    return std::string("was ended by signal ") + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  }
  return "exited with code " + std::to_string(WEXITSTATUS(status));
}

int ExitCodeOf(int status) {
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

// The job's identity for its ranks: the caller's ZINF_JOB_ID, else a fresh 32-hex one.
std::string JobIdForRanks() {
  if (const char* given = std::getenv("ZINF_JOB_ID"); given != nullptr && *given != '\0') {
    return given;
  }
  uint32_t words[4] = {0, 0, 0, 0};
  try {
    std::random_device random;
    for (uint32_t& w : words) w = random();
  } catch (const std::exception&) {
    // No entropy source: the time and this process's id still tell jobs apart.
    const uint64_t now =
        static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    words[0] = static_cast<uint32_t>(now);
    words[1] = static_cast<uint32_t>(now >> 32);
    words[2] = static_cast<uint32_t>(getpid());
    words[3] = static_cast<uint32_t>(std::time(nullptr));
  }
  char hex[33];
  std::snprintf(hex, sizeof(hex), "%08x%08x%08x%08x", words[0], words[1], words[2], words[3]);
  return hex;
}

// The program itself, by its real path: exec of /proc/self/exe would name the ranks "exe" in
// ps and top. Unreadable, or replaced while running (a rebuild: the path names the new file
// or "... (deleted)"): /proc/self/exe, still the running program's own inode.
std::string ProgramPath() {
  std::error_code ec;
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  return !ec && access(exe.c_str(), X_OK) == 0 ? exe : "/proc/self/exe";
}

// Makes the ranks' rendezvous folder under the temporary folder and returns its path; empty
// (after saying why on stderr) when it cannot be made.
std::string MakeRendezvousFolder(const char* program) {
  std::string store_template =
      (std::filesystem::temp_directory_path() / "zinf-ranks-XXXXXX").string();
  if (mkdtemp(store_template.data()) == nullptr) {
    std::fprintf(stderr, "%s: creating the ranks' rendezvous folder %s: %s\n", program,
                 store_template.c_str(), std::strerror(errno));
    return "";
  }
  return store_template;
}

// The dispositions of SIGINT, SIGTERM and SIGCHLD before the supervisor installed its own.
struct SavedDispositions {
  struct sigaction int_action {};
  struct sigaction term_action {};
  struct sigaction chld_action {};
};

// SIGCHLD at its default, or waitpid would not see the ranks' exits (an inherited SIG_IGN
// reaps them unseen); SIGINT / SIGTERM are caught to be passed on. False (errno set) when one
// could not be installed.
bool InstallSupervisorHandlers(SavedDispositions* saved) {
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  return sigaction(SIGCHLD, &dfl, &saved->chld_action) == 0 &&
         sigaction(SIGINT, &sa, &saved->int_action) == 0 &&
         sigaction(SIGTERM, &sa, &saved->term_action) == 0;
}

// Puts back the dispositions `saved`. Async-signal-safe (a forked rank calls it). Failures
// are ignored: with these arguments sigaction cannot fail, and each caller is about to exec
// or exit.
void RestoreDispositions(const SavedDispositions& saved) {
  (void)sigaction(SIGINT, &saved.int_action, nullptr);
  (void)sigaction(SIGTERM, &saved.term_action, nullptr);
  (void)sigaction(SIGCHLD, &saved.chld_action, nullptr);
}

// What each rank execs: the program, its arguments and its environment, as strings and as the
// null-terminated arrays execve takes (pointing into the strings). Built before forking: the
// child only calls async-signal-safe functions and exec.
struct RankExec {
  std::string exe;
  std::vector<std::string> args;
  std::vector<std::vector<std::string>> envs;  // one per rank
  std::vector<char*> argv;
  std::vector<std::vector<char*>> envps;  // one per rank
};

// Fills `exec` for `nproc` ranks running `args`: each rank's environment is this one's with
// its rank, the world size, the rendezvous folder `store` and the job's id set.
void BuildRankExec(const std::vector<std::string>& args, int nproc, const std::string& store,
                   RankExec* exec) {
  const std::string job_id = JobIdForRanks();
  exec->exe = ProgramPath();
  exec->args = args;
  exec->envs.resize(nproc);
  for (int r = 0; r < nproc; ++r) {
    std::vector<std::string>& env = exec->envs[r];
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string kv = *e;
      const std::string key = kv.substr(0, kv.find('='));
      if (key == "RANK" || key == "LOCAL_RANK" || key == "WORLD_SIZE" ||
          key == "LOCAL_WORLD_SIZE" || key == "ZINF_STORE_FOLDER" || key == "ZINF_JOB_ID") {
        continue;
      }
      env.push_back(kv);
    }
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("LOCAL_RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(nproc));
    env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(nproc));
    env.push_back("ZINF_STORE_FOLDER=" + store);
    env.push_back("ZINF_JOB_ID=" + job_id);
  }
  for (const std::string& a : exec->args) exec->argv.push_back(const_cast<char*>(a.c_str()));
  exec->argv.push_back(nullptr);
  exec->envps.resize(nproc);
  for (int r = 0; r < nproc; ++r) {
    for (const std::string& kv : exec->envs[r]) {
      exec->envps[r].push_back(const_cast<char*>(kv.c_str()));
    }
    exec->envps[r].push_back(nullptr);
  }
}

// In the forked child: becomes rank `r` (exec), or exits 1 when its supervisor is already
// gone and 127 when exec fails. Async-signal-safe only.
[[noreturn]] void ExecRank(const RankExec& exec, int r, pid_t supervisor,
                           const SavedDispositions& saved) {
  // A rank never outlives its supervisor (no orphan keeps the group's ports or folders).
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != supervisor) _exit(1);
  // The program's own dispositions back (failures leave the supervisor's handler, which
  // only records a signal: harmless in the rank).
  RestoreDispositions(saved);
  execve(exec.exe.c_str(), exec.argv.data(), exec.envps[r].data());
  static const char kMsg[] = "rank launcher: exec of the program failed\n";
  (void)!write(2, kMsg, sizeof(kMsg) - 1);
  _exit(127);
}

// Forks the ranks into `pids` (one per rank, -1 for those not started). 0, or 1 when a fork
// failed (the ranks after it are not started).
int StartRanks(const char* program, const RankExec& exec, const SavedDispositions& saved, int nproc,
               std::vector<pid_t>* pids) {
  const pid_t supervisor = getpid();
  pids->assign(nproc, -1);
  for (int r = 0; r < nproc; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::fprintf(stderr, "%s: starting rank %d: %s\n", program, r, std::strerror(errno));
      return 1;
    }
    if (pid == 0) ExecRank(exec, r, supervisor, saved);
    (*pids)[r] = pid;
  }
  return 0;
}

// Sends `sig` to every rank still running.
void SignalRanks(const std::vector<pid_t>& pids, int sig) {
  for (pid_t p : pids) {
    if (p > 0) kill(p, sig);
  }
}

// Ends (SIGKILL) every rank still running, naming each on stderr.
void EndStragglers(const char* program, const std::vector<pid_t>& pids) {
  for (size_t r = 0; r < pids.size(); ++r) {
    if (pids[r] <= 0) continue;
    std::fprintf(stderr,
                 "%s: rank %d (pid %d) still running 30 s after the run "
                 "failed: ending it\n",
                 program, static_cast<int>(r), static_cast<int>(pids[r]));
    kill(pids[r], SIGKILL);
  }
}

// Waits for the ranks `pids` until none is left and returns the run's exit code, `result`
// when that is already a failure (a failed start). The first failure is the run's; the others
// get 30 s to fail by themselves (their collectives see the closed connections at once) before
// they are ended. A caught SIGINT / SIGTERM is passed on to the ranks once.
int SuperviseRanks(const char* program, std::vector<pid_t> pids, int result) {
  using Clock = std::chrono::steady_clock;
  int running = 0;
  for (pid_t p : pids) running += p > 0;
  if (result != 0) SignalRanks(pids, SIGTERM);
  // A failed start: the ranks already started were asked to stop; ended after 30 s.
  Clock::time_point kill_at =
      result != 0 ? Clock::now() + std::chrono::seconds(30) : Clock::time_point::max();
  bool forwarded = false;
  while (running > 0) {
    if (const int sig = g_signal.load(); sig != 0 && !forwarded) {
      forwarded = true;
      SignalRanks(pids, sig);
      kill_at = std::min(kill_at, Clock::now() + std::chrono::seconds(30));
      if (result == 0) result = 128 + sig;
    }
    int status = 0;
    const pid_t done = waitpid(-1, &status, WNOHANG);
    if (done > 0) {
      for (size_t r = 0; r < pids.size(); ++r) {
        if (pids[r] != done) continue;
        pids[r] = -1;
        --running;
        if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
          std::fprintf(stderr, "%s: rank %d (pid %d) %s\n", program, static_cast<int>(r),
                       static_cast<int>(done), Describe(status).c_str());
          if (result == 0) {
            result = ExitCodeOf(status);
            kill_at = Clock::now() + std::chrono::seconds(30);
          }
        }
      }
      continue;
    }
    if (done < 0 && errno != EINTR) break;  // ECHILD: nothing left to wait for
    if (Clock::now() >= kill_at) {
      EndStragglers(program, pids);
      kill_at = Clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return result;
}

}  // namespace

int LaunchRanks(const char* program, int argc, char** argv, int nproc) {
  if (std::getenv("RANK") != nullptr || std::getenv("OMPI_COMM_WORLD_RANK") != nullptr) {
    std::fprintf(stderr,
                 "%s: --nproc under a launcher that already set RANK: give one of them (%s "
                 "--nproc N, or the launcher without --nproc)\n",
                 program, program);
    return 2;
  }
  const std::string store = MakeRendezvousFolder(program);
  if (store.empty()) return 1;
  const std::vector<std::string> args = ChildArgs(argc, argv);
  SavedDispositions saved;
  if (!InstallSupervisorHandlers(&saved)) {
    std::fprintf(stderr, "%s: installing the supervisor's signal handlers: %s\n", program,
                 std::strerror(errno));
    std::error_code ec;
    std::filesystem::remove_all(store, ec);  // best effort: nothing was started
    return 1;
  }
  RankExec exec;
  BuildRankExec(args, nproc, store, &exec);
  std::vector<pid_t> pids;
  const int start_code = StartRanks(program, exec, saved, nproc, &pids);
  const int result = SuperviseRanks(program, std::move(pids), start_code);
  std::error_code ec;
  std::filesystem::remove_all(store, ec);  // best effort: a leftover folder holds a few bytes
  // The caller's dispositions back (the program is about to exit with the run's code).
  RestoreDispositions(saved);
  return result;
}

}  // namespace zinf
