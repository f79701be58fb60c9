// Ranks as processes for tests: fork N children, each runs `body(rank)` and reports its Status
// (and any bytes it wants the parent to check) through a pipe; the parent waits with a hard
// deadline and kills, by pid, the children it started that are still running then.
//
// REQUIRES: the calling process has one thread (fork copies only the caller; a lock held by
// another thread would stay locked in the child). Checked: RunProcessRanks fails otherwise.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "zinf/status.h"

namespace zinf {
namespace test {

struct RankExit {
  bool finished = false;  // the child exited by itself before the deadline
  int exit_code = -1;     // its exit code, when it exited
  int signal = 0;         // the signal that ended it, when one did
  std::string report;     // what it wrote to its pipe: "OK" or the Status, then output
  double seconds = 0;     // from the start until it ended (or the deadline)
};

// The threads of this process (/proc/self/status).
inline int ThreadCount() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

// A TCP port nobody listens on now (bound and released; a small race with other programs).
inline int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 0;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  if (fd >= 0) close(fd);
  return port;
}

// What a child body gives back: its Status and free-form output for the parent.
struct ChildResult {
  Status status;
  std::string output;
};

// Runs body(rank) in `n` child processes; returns each child's exit. A child's report is
// "OK\n" + output, or "ERR " + status + "\n" + output. A child exits 0 when its body returned
// OK, 1 otherwise; a body may also end its process itself (a crash test).
inline std::vector<RankExit> RunProcessRanks(int n, std::chrono::seconds deadline,
                                             const std::function<ChildResult(int rank)>& body) {
  std::vector<RankExit> exits(n);
  if (ThreadCount() != 1) {
    for (RankExit& e : exits) {
      e.report = "ERR RunProcessRanks: the test process has " + std::to_string(ThreadCount()) +
                 " threads; fork needs exactly one";
    }
    return exits;
  }
  std::vector<pid_t> pids(n, -1);
  std::vector<int> fds(n, -1);
  const pid_t parent = getpid();
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < n; ++r) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) {
      exits[r].report = "ERR pipe failed";
      continue;
    }
    const pid_t pid = fork();
    if (pid == 0) {
      // A rank never outlives the test (a parent killed by ctest's timeout takes it along).
      if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(3);
      close(p[0]);
      for (int q = 0; q < r; ++q) {
        if (fds[q] >= 0) close(fds[q]);
      }
      ChildResult res = body(r);
      std::string out = (res.status.ok() ? std::string("OK") : "ERR " + res.status.ToString()) +
                        "\n" + res.output;
      const char* d = out.data();
      size_t left = out.size();
      while (left > 0) {
        const ssize_t w = write(p[1], d, left);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;
        d += w;
        left -= static_cast<size_t>(w);
      }
      _exit(res.status.ok() ? 0 : 1);
    }
    close(p[1]);
    // Read without blocking: the deadline is checked between polls, whatever a child does.
    if (fcntl(p[0], F_SETFL, O_NONBLOCK) != 0) {
      exits[r].report = "ERR fcntl(O_NONBLOCK) failed";
    }
    pids[r] = pid;
    fds[r] = p[0];
  }
  // Read every pipe (so a child never blocks on a full pipe) until every child has ended or
  // the deadline passes.
  int running = 0;
  for (pid_t pid : pids) running += pid > 0;
  while (running > 0) {
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed > deadline.count()) break;
    std::vector<pollfd> pfds;
    for (int r = 0; r < n; ++r) {
      if (fds[r] >= 0) pfds.push_back({fds[r], POLLIN, 0});
    }
    if (!pfds.empty()) (void)poll(pfds.data(), pfds.size(), 20);  // a timeout is fine
    for (int r = 0; r < n; ++r) {
      if (fds[r] < 0) continue;
      char buf[65536];
      const ssize_t got = read(fds[r], buf, sizeof(buf));
      if (got > 0) exits[r].report.append(buf, static_cast<size_t>(got));
      if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {
        close(fds[r]);
        fds[r] = -1;
      }
    }
    for (int r = 0; r < n; ++r) {
      if (pids[r] <= 0 || exits[r].finished) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        exits[r].finished = true;
        exits[r].seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (WIFEXITED(status)) exits[r].exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) exits[r].signal = WTERMSIG(status);
        --running;
      }
    }
    if (pfds.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < n; ++r) {
    if (pids[r] > 0 && !exits[r].finished) {
      kill(pids[r], SIGKILL);
      int status = 0;
      (void)waitpid(pids[r], &status, 0);  // reaped; it was killed
      exits[r].seconds = deadline.count();
      exits[r].signal = SIGKILL;
    }
    // The child is gone: read what it wrote up to the end of its pipe.
    while (fds[r] >= 0) {
      char buf[65536];
      const ssize_t got = read(fds[r], buf, sizeof(buf));
      if (got < 0 && errno == EINTR) continue;
      // got < 0 with EAGAIN: a grandchild may hold the pipe open; what is there has been read.
      if (got > 0) {
        exits[r].report.append(buf, static_cast<size_t>(got));
        continue;
      }
      close(fds[r]);
      fds[r] = -1;
    }
  }
  return exits;
}

}  // namespace test
}  // namespace zinf
