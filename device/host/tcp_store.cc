// The rendezvous stores of zinf/comm.h: a TCP key-value store served by rank 0 (what
// MASTER_ADDR:MASTER_PORT name) and a folder store. Only addresses and ids pass through them,
// a few hundred bytes per rank, once per group: simplicity over speed, but nothing trusted.
//
// The TCP store answers only its own job. Every connection opens with a handshake naming the
// job (TcpStoreOptions::job_id); until it has passed, the server reads at most the handshake's
// bytes and answers nothing else, and a connection that does not complete it within
// kHandshakeWindow is closed. The server never blocks: its sockets are non-blocking, replies
// wait in a bounded per-client buffer (a client that stops reading is dropped, not waited
// for), connections, keys and values are bounded in number and size, and garbage drops the
// connection that sent it. Keys are written once: a second SET of a key with another value is
// refused (two processes claiming one rank, e.g. two jobs on one port without job ids).
//
// Wire format (host byte order: every rank of a group runs the same build):
//   hello  : "ZINFKV02", u32 job id length, job id          -> reply u8 status
//   SET    : u8 1, u32 key length, key, u32 value length, value -> reply u8 status
//   GET    : u8 2, u32 key length, key                     -> reply u8 1, u32 length, value
// status: 1 ok, 2 another job's store, 3 the key holds another value, 4 the store is full.
// A GET of a key not yet set is answered when some client sets it.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/thread_annotations.h"
#include "zinf/comm.h"
#include "zinf/log.h"

namespace zinf {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kMagic[8] = {'Z', 'I', 'N', 'F', 'K', 'V', '0', '2'};
constexpr uint8_t kSet = 1;
constexpr uint8_t kGet = 2;
constexpr uint8_t kReplyOk = 1;
constexpr uint8_t kReplyOtherJob = 2;
constexpr uint8_t kReplyAlreadySet = 3;
constexpr uint8_t kReplyFull = 4;
constexpr uint32_t kMaxJobId = 256;
constexpr uint32_t kMaxKey = 4096;
constexpr uint32_t kMaxValue = 1u << 20;  // values are addresses and ids
// What the server holds at most: every value of the store, the unanswered replies of one
// client, connections that have not passed the handshake (each holds at most its bytes).
constexpr size_t kMaxStoreBytes = size_t{64} << 20;
constexpr size_t kMaxPendingReply = size_t{4} << 20;
constexpr int kMaxStrangers = 64;
constexpr auto kHandshakeWindow = std::chrono::seconds(10);

std::string Where(const std::string& host, int port) {
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" +
         std::to_string(port);
}

Status SysError(const std::string& what) { return ErrnoToStatus(errno, what); }

int64_t MillisLeft(Clock::time_point deadline) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
}

// Waits until `fd` is ready for `events` or `deadline` passes (false, errno ETIMEDOUT).
bool WaitReady(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    const int64_t left = MillisLeft(deadline);
    if (left <= 0) {
      errno = ETIMEDOUT;
      return false;
    }
    pollfd pfd{fd, events, 0};
    const int ready = poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return false;
    if (ready > 0) return true;
  }
}

// Writes all of `data` to a non-blocking socket before `deadline`, retrying short writes.
Status WriteAll(int fd, const void* data, size_t n, Clock::time_point deadline,
                const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!WaitReady(fd, POLLOUT, deadline)) {
        if (errno == ETIMEDOUT) return Status::FailedPrecondition(what + ": timed out sending");
        return SysError(what + ": poll");
      }
      continue;
    }
    if (w <= 0) return SysError(what);
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::OK();
}

// Reads exactly n bytes before `deadline`; a closed connection is an IoError.
Status ReadAll(int fd, void* data, size_t n, Clock::time_point deadline, const std::string& what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    if (!WaitReady(fd, POLLIN, deadline)) {
      if (errno == ETIMEDOUT) return Status::FailedPrecondition(what + ": timed out");
      return SysError(what + ": poll");
    }
    const ssize_t r = recv(fd, p, n, MSG_DONTWAIT);
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (r < 0) return SysError(what);
    if (r == 0) return Status::IoError(what + ": the store closed the connection");
    p += r;
    n -= static_cast<size_t>(r);
  }
  return Status::OK();
}

Result<addrinfo*> Resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    return Status::InvalidArgument("the rendezvous address " + Where(host, port) +
                                   " does not resolve (" + gai_strerror(rc) +
                                   "); check MASTER_ADDR");
  }
  return res;
}

void AppendField(std::string* out, const std::string& f) {
  const uint32_t n = static_cast<uint32_t>(f.size());
  out->append(reinterpret_cast<const char*>(&n), sizeof(n));
  *out += f;
}

// Parses a u32-length-prefixed field of at most `max` bytes at *pos. 1: parsed (*pos past
// it); 0: incomplete; -1: malformed.
int Field(const std::string& in, size_t* pos, uint32_t max, std::string* out) {
  uint32_t n = 0;
  if (in.size() < *pos + sizeof(n)) return 0;
  std::memcpy(&n, in.data() + *pos, sizeof(n));
  if (n > max) return -1;
  if (in.size() < *pos + sizeof(n) + n) return 0;
  out->assign(in.data() + *pos + sizeof(n), n);
  *pos += sizeof(n) + n;
  return 1;
}

// Equal without an early exit on the first differing byte (the job id is a shared secret).
bool SameSecret(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

// ---- The server ------------------------------------------------------------------------------

class StoreServer {
 public:
  ~StoreServer() {
    if (wake_[1] >= 0) {
      const char c = 0;
      // Best effort: if the pipe is full the thread is already awake.
      (void)!write(wake_[1], &c, 1);
    }
    if (thread_.joinable()) thread_.join();
    for (auto& [fd, client] : clients_) close(fd);
    for (int fd : {listen_fd_, wake_[0], wake_[1]}) {
      if (fd >= 0) close(fd);
    }
  }

  Status Start(const TcpStoreOptions& o) {
    job_id_ = o.job_id;
    max_members_ = std::max(1, o.max_clients);
    // Listen on the address MASTER_ADDR names (the ranks reach this process by it), not on
    // every interface: "0.0.0.0" or "::" as listen_addr asks for that.
    const std::string listen_host = o.listen_addr.empty() ? o.host : o.listen_addr;
    ZINF_ASSIGN_OR_RETURN(addrinfo * res, Resolve(listen_host, o.port, false));
    sockaddr_storage addr{};
    std::memcpy(&addr, res->ai_addr, std::min<size_t>(res->ai_addrlen, sizeof(addr)));
    const socklen_t len = res->ai_addrlen;
    const int family = res->ai_family;
    freeaddrinfo(res);
    listen_fd_ = socket(family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (listen_fd_ < 0) return SysError("rendezvous store: socket");
    const int one = 1;
    if (setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0) {
      return SysError("rendezvous store: SO_REUSEADDR");
    }
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      const int err = errno;
      std::string why = std::strerror(err);
      if (err == EADDRINUSE) {
        why +=
            " (another job's rendezvous, or another program, holds it: give each job its "
            "own MASTER_PORT)";
      } else if (err == EADDRNOTAVAIL) {
        why += " (" + listen_host +
               " is not an address of this machine: set ZINF_STORE_LISTEN_ADDR to one, or to "
               "0.0.0.0 to listen on every interface)";
      }
      return Status::FailedPrecondition("rank 0 cannot serve the rendezvous store on " +
                                        Where(listen_host, o.port) + ": " + why +
                                        "; check MASTER_ADDR / MASTER_PORT");
    }
    if (listen(listen_fd_, 1024) != 0) return SysError("rendezvous store: listen");
    if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) return SysError("rendezvous store: pipe");
    thread_ = std::thread([this] { Serve(); });
    return Status::OK();
  }

 private:
  struct Client {
    bool member = false;   // passed the handshake
    bool closing = false;  // dropped once `out` is sent
    Clock::time_point handshake_deadline;
    std::string in;   // bytes received, not yet a whole request
    std::string out;  // replies not yet sent
  };

  void Serve() {
    for (;;) {
      std::vector<pollfd> fds;
      fds.push_back({wake_[0], POLLIN, 0});
      fds.push_back({listen_fd_, POLLIN, 0});
      int64_t wait_ms = -1;
      const Clock::time_point now = Clock::now();
      for (auto& [fd, c] : clients_) {
        fds.push_back({fd, static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
        if (!c.member) {
          const int64_t left = std::max<int64_t>(
              0, std::chrono::duration_cast<std::chrono::milliseconds>(c.handshake_deadline - now)
                     .count());
          wait_ms = wait_ms < 0 ? left : std::min(wait_ms, left);
        }
      }
      // After an accept failure (out of descriptors or memory) the listening socket stays
      // readable: it is left out of the poll for a while instead of spinning on it.
      if (Clock::now() < accept_paused_until_) {
        fds[1].fd = -1;  // poll ignores a negative descriptor
        const int64_t pause = std::chrono::duration_cast<std::chrono::milliseconds>(
                                  accept_paused_until_ - Clock::now())
                                  .count() +
                              1;
        wait_ms = wait_ms < 0 ? pause : std::min(wait_ms, pause);
      }
      const int ready = poll(fds.data(), fds.size(), static_cast<int>(wait_ms));
      if (ready < 0 && errno == EINTR) continue;
      if (ready < 0) {
        LogWarning(std::string("rendezvous store: poll failed: ") + std::strerror(errno) +
                   "; the store stops serving");
        return;
      }
      if (fds[0].revents != 0) return;
      std::vector<int> doomed;
      for (size_t i = 2; i < fds.size(); ++i) {
        const int fd = fds[i].fd;
        if (fds[i].revents == 0) continue;
        bool keep = true;
        if (fds[i].revents & POLLOUT) keep = Flush(fd);
        if (keep && (fds[i].revents & (POLLIN | POLLHUP | POLLERR))) keep = Receive(fd, &doomed);
        if (!keep) doomed.push_back(fd);
      }
      const Clock::time_point after = Clock::now();
      for (auto& [fd, c] : clients_) {
        if (!c.member && after >= c.handshake_deadline) doomed.push_back(fd);
      }
      for (int fd : doomed) Drop(fd);
      if (fds[1].revents & POLLIN) Accept();
    }
  }

  void Accept() {
    for (;;) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK && errno != ECONNABORTED) {
          const Clock::time_point now = Clock::now();
          accept_paused_until_ = now + std::chrono::milliseconds(100);
          if (now >= next_accept_warning_) {  // at most one warning in 10 s
            next_accept_warning_ = now + std::chrono::seconds(10);
            LogWarning(std::string("rendezvous store: accept failed: ") + std::strerror(errno) +
                       "; retrying in 100 ms");
          }
        }
        return;
      }
      int strangers = 0;
      int oldest = -1;  // the stranger that has waited longest
      for (auto& [other, c] : clients_) {
        if (c.member) continue;
        ++strangers;
        if (oldest < 0 || c.handshake_deadline < clients_[oldest].handshake_deadline) {
          oldest = other;
        }
      }
      // At the bound of connections that have not said who they are, the one that has waited
      // longest goes once it has had a moment to say hello (a rank says it as soon as it
      // connects): a flood of silent connections cannot keep the job's ranks out. A flood
      // faster than that closes the newcomers unread; a rank's client then connects again.
      if (strangers >= kMaxStrangers) {
        const auto waited = kHandshakeWindow - (clients_[oldest].handshake_deadline - Clock::now());
        if (waited < std::chrono::milliseconds(50)) {
          close(fd);
          continue;
        }
        Drop(oldest);
      }
      Client c;
      c.handshake_deadline = Clock::now() + kHandshakeWindow;
      clients_[fd] = std::move(c);
    }
  }

  // Sends what `fd` has waiting; false when the client is gone. A client that is closing is
  // dropped once its last reply is out.
  bool Flush(int fd) {
    Client& c = clients_[fd];
    while (!c.out.empty()) {
      const ssize_t w = send(fd, c.out.data(), c.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (w <= 0) return false;
      c.out.erase(0, static_cast<size_t>(w));
    }
    if (c.out.size() > kMaxPendingReply) return false;  // it stopped reading
    return !(c.closing && c.out.empty());
  }

  // Queues a reply and sends what the socket takes now.
  bool Reply(int fd, const std::string& bytes) {
    clients_[fd].out += bytes;
    return Flush(fd);
  }

  // Reads what is there and answers whole requests; false when the client is gone or broke
  // the protocol. Waiters answered here whose connection failed go to `doomed`.
  bool Receive(int fd, std::vector<int>* doomed) {
    Client& c = clients_[fd];
    char buf[65536];
    const ssize_t r = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (r <= 0) return false;
    if (c.closing) return true;  // nothing more is read from it
    c.in.append(buf, static_cast<size_t>(r));
    for (;;) {
      if (!c.member) {
        // The handshake: nothing else is read, and nothing but its status sent, before it.
        if (c.in.size() < sizeof(kMagic)) return true;
        if (std::memcmp(c.in.data(), kMagic, sizeof(kMagic)) != 0) return false;
        size_t pos = sizeof(kMagic);
        std::string job;
        const int f = Field(c.in, &pos, kMaxJobId, &job);
        if (f < 0) return false;
        if (f == 0) return true;
        c.in.erase(0, pos);
        if (!SameSecret(job, job_id_)) {
          c.closing = true;
          c.in.clear();
          return Reply(fd, std::string(1, static_cast<char>(kReplyOtherJob)));
        }
        int members = 0;
        for (auto& [other, o] : clients_) members += o.member ? 1 : 0;
        if (members >= max_members_) return false;
        c.member = true;
        if (!Reply(fd, std::string(1, static_cast<char>(kReplyOk)))) return false;
        continue;
      }
      if (c.in.empty()) return true;
      const uint8_t op = static_cast<uint8_t>(c.in[0]);
      if (op != kSet && op != kGet) return false;
      size_t pos = 1;
      std::string key;
      std::string value;
      int f = Field(c.in, &pos, kMaxKey, &key);
      if (f <= 0) return f == 0;
      if (op == kSet) {
        f = Field(c.in, &pos, kMaxValue, &value);
        if (f <= 0) return f == 0;
      }
      c.in.erase(0, pos);
      if (op == kSet) {
        if (!Set(fd, key, std::move(value), doomed)) return false;
      } else {
        auto found = values_.find(key);
        if (found != values_.end()) {
          std::string reply(1, static_cast<char>(kReplyOk));
          AppendField(&reply, found->second);
          if (!Reply(fd, reply)) return false;
        } else {
          waiting_[key].push_back(fd);
        }
      }
      if (c.closing) return Flush(fd);
    }
  }

  bool Set(int fd, const std::string& key, std::string value, std::vector<int>* doomed) {
    auto found = values_.find(key);
    if (found != values_.end()) {
      // Written once: the same value again is a harmless retry; another is a second process
      // claiming what one already holds.
      const uint8_t status = found->second == value ? kReplyOk : kReplyAlreadySet;
      return Reply(fd, std::string(1, static_cast<char>(status)));
    }
    if (stored_bytes_ + key.size() + value.size() > kMaxStoreBytes) {
      clients_[fd].closing = true;
      return Reply(fd, std::string(1, static_cast<char>(kReplyFull)));
    }
    if (!Reply(fd, std::string(1, static_cast<char>(kReplyOk)))) return false;
    auto waiting = waiting_.find(key);
    if (waiting != waiting_.end()) {
      std::string reply(1, static_cast<char>(kReplyOk));
      AppendField(&reply, value);
      for (int w : waiting->second) {
        if (clients_.count(w) != 0 && !Reply(w, reply)) doomed->push_back(w);
      }
      waiting_.erase(waiting);
    }
    stored_bytes_ += key.size() + value.size();
    values_[key] = std::move(value);
    return true;
  }

  void Drop(int fd) {
    if (clients_.erase(fd) == 0) return;  // listed twice
    close(fd);
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      auto& fds = it->second;
      fds.erase(std::remove(fds.begin(), fds.end(), fd), fds.end());
      it = fds.empty() ? waiting_.erase(it) : std::next(it);
    }
  }

  std::string job_id_;
  int max_members_ = 1;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  std::thread thread_;
  // Touched only by the server thread (and by the destructor after joining it).
  std::map<int, Client> clients_;
  std::map<std::string, std::string> values_;
  size_t stored_bytes_ = 0;
  std::map<std::string, std::vector<int>> waiting_;
  Clock::time_point accept_paused_until_{};
  Clock::time_point next_accept_warning_{};
};

// ---- The client ------------------------------------------------------------------------------

class TcpStore final : public KeyValueStore {
 public:
  explicit TcpStore(TcpStoreOptions o) : o_(std::move(o)) {}
  ~TcpStore() override {
    MutexLock lock(&mu_);
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

  Status StartServer() { return server_.Start(o_); }

  Status Set(const std::string& key, const std::string& value) override {
    MutexLock lock(&mu_);
    const Clock::time_point deadline = Clock::now() + o_.timeout;
    const std::string what = "rendezvous store " + Where(o_.host, o_.port);
    Status s = Connect(deadline);
    if (s.ok()) s = Send(kSet, key, &value, deadline);
    uint8_t status = 0;
    if (s.ok()) s = ReadAll(fd_, &status, 1, deadline, what);
    if (s.ok() && status == kReplyAlreadySet) {
      s = Status::FailedPrecondition(
          what +
          " already holds another value for it: another process joined this job as the "
          "same rank (a rank started twice, or two jobs on one MASTER_PORT: give each job "
          "its own port, or set ZINF_JOB_ID to a value of its own on every rank of a job)");
    } else if (s.ok() && status == kReplyFull) {
      s = Status::ResourceExhausted(what + " is full (" + std::to_string(kMaxStoreBytes >> 20) +
                                    " MiB of keys and values)");
    } else if (s.ok() && status != kReplyOk) {
      s = Status::Corruption(what + ": an unknown reply " + std::to_string(status));
    }
    if (!s.ok()) Reset();
    return s.WithContext("setting '" + key + "'");
  }

  Result<std::string> Get(const std::string& key, std::chrono::milliseconds timeout) override {
    MutexLock lock(&mu_);
    const Clock::time_point deadline = Clock::now() + timeout;
    const std::string what = "rendezvous store " + Where(o_.host, o_.port) + ": waiting " +
                             std::to_string(timeout.count() / 1000.0) + " s for '" + key +
                             "' (is every rank of the group started?)";
    Status s = Connect(deadline);
    if (s.ok()) s = Send(kGet, key, nullptr, deadline);
    uint8_t status = 0;
    if (s.ok()) s = ReadAll(fd_, &status, 1, deadline, what);
    if (s.ok() && status != kReplyOk) {
      s = Status::Corruption(what + ": an unknown reply " + std::to_string(status));
    }
    uint32_t n = 0;
    if (s.ok()) s = ReadAll(fd_, &n, sizeof(n), deadline, what);
    if (s.ok() && n > kMaxValue)
      s = Status::Corruption(what + ": a value of " + std::to_string(n) + " bytes");
    std::string value(s.ok() ? n : 0, '\0');
    if (s.ok() && n > 0) s = ReadAll(fd_, value.data(), n, deadline, what);
    if (!s.ok()) {
      Reset();  // a late answer must not be read as the reply of the next request
      return s;
    }
    return value;
  }

 private:
  // Connects and passes the handshake before `deadline`, retrying while rank 0 starts.
  Status Connect(Clock::time_point deadline) REQUIRES(mu_) {
    if (fd_ >= 0) return Status::OK();
    const std::string where = Where(o_.host, o_.port);
    std::string last = "no attempt";
    while (Clock::now() < deadline) {
      Result<addrinfo*> res = Resolve(o_.host, o_.port, false);
      if (!res.ok()) return res.status();
      for (addrinfo* ai = *res; ai != nullptr && fd_ < 0; ai = ai->ai_next) {
        const int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) {
          last = std::strerror(errno);
          continue;
        }
        int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (rc != 0 && errno == EINPROGRESS) {
          int err = 0;
          socklen_t len = sizeof(err);
          if (!WaitReady(fd, POLLOUT, deadline)) {
            err = errno;
          } else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
            err = errno;
          }
          rc = err == 0 ? 0 : -1;
          errno = err;
        }
        if (rc != 0) {
          last = std::strerror(errno);
          close(fd);
          continue;
        }
        const int one = 1;
        // Small requests: do not wait to coalesce them. Best effort.
        (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        fd_ = fd;
      }
      freeaddrinfo(*res);
      if (fd_ >= 0) {
        Status s = Handshake(deadline);
        if (s.ok()) return s;
        Reset();
        if (s.code() == StatusCode::kFailedPrecondition) return s;  // another job's store
        last = s.message();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // rank 0 may not listen yet
    }
    return Status::FailedPrecondition("cannot reach the rendezvous store at " + where + " (" +
                                      last +
                                      "): is rank 0 running, and MASTER_ADDR / MASTER_PORT the "
                                      "same on every rank?");
  }

  Status Handshake(Clock::time_point deadline) REQUIRES(mu_) {
    const std::string where = Where(o_.host, o_.port);
    std::string hello(kMagic, sizeof(kMagic));
    AppendField(&hello, o_.job_id);
    ZINF_RETURN_IF_ERROR(WriteAll(fd_, hello.data(), hello.size(), deadline, where));
    uint8_t status = 0;
    ZINF_RETURN_IF_ERROR(ReadAll(fd_, &status, 1, deadline, where));
    if (status == kReplyOtherJob) {
      return Status::FailedPrecondition(
          "the rendezvous store at " + where +
          " belongs to another job (its job id is not this rank's" +
          (o_.job_id.empty() ? std::string(", which is unset") : std::string()) +
          "): two jobs were started on one MASTER_PORT; give each job its own MASTER_PORT, and "
          "every rank of one job the same ZINF_JOB_ID");
    }
    if (status != kReplyOk) {
      return Status::Corruption("the rendezvous store at " + where +
                                " answered the handshake with " + std::to_string(status) +
                                ": is MASTER_PORT another program's?");
    }
    return Status::OK();
  }

  Status Send(uint8_t op, const std::string& key, const std::string* value,
              Clock::time_point deadline) REQUIRES(mu_) {
    if (key.size() > kMaxKey || (value != nullptr && value->size() > kMaxValue)) {
      return Status::InvalidArgument("rendezvous store: a key over 4 KiB or a value over 1 MiB");
    }
    std::string req(1, static_cast<char>(op));
    AppendField(&req, key);
    if (value != nullptr) AppendField(&req, *value);
    return WriteAll(fd_, req.data(), req.size(), deadline,
                    "rendezvous store " + Where(o_.host, o_.port));
  }

  void Reset() REQUIRES(mu_) {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

  const TcpStoreOptions o_;
  StoreServer server_;  // serving only on rank 0
  Mutex mu_;
  int fd_ GUARDED_BY(mu_) = -1;
};

// ---- The folder store ------------------------------------------------------------------------

class FileStore final : public KeyValueStore {
 public:
  explicit FileStore(std::string folder) : folder_(std::move(folder)) {}

  Status Set(const std::string& key, const std::string& value) override {
    const std::string path = PathOf(key);
    const std::string tmp = path + ".tmp." + std::to_string(getpid());
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out.write(value.data(), static_cast<std::streamsize>(value.size()));
      out.close();
      if (!out) return Status::IoError("store folder: writing " + tmp);
    }
    if (rename(tmp.c_str(), path.c_str()) != 0) return SysError("store folder: renaming " + tmp);
    return Status::OK();
  }

  Result<std::string> Get(const std::string& key, std::chrono::milliseconds timeout) override {
    const std::string path = PathOf(key);
    const Clock::time_point deadline = Clock::now() + timeout;
    for (;;) {
      std::ifstream in(path, std::ios::binary);
      if (in) {
        std::ostringstream all;
        all << in.rdbuf();
        return all.str();
      }
      if (Clock::now() >= deadline) {
        return Status::FailedPrecondition("store folder " + folder_ + ": waited " +
                                          std::to_string(timeout.count() / 1000.0) + " s for '" +
                                          key + "' (is every rank of the group started?)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

 private:
  // Keys hold '/' (prefixes): a flat, reversible file name.
  std::string PathOf(const std::string& key) const {
    std::string name;
    for (char c : key) {
      if (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.') {
        name += c;
      } else {
        char hex[4];
        std::snprintf(hex, sizeof(hex), "%%%02x", static_cast<unsigned char>(c));
        name += hex;
      }
    }
    return folder_ + "/" + name;
  }

  const std::string folder_;
};

}  // namespace

Result<std::shared_ptr<KeyValueStore>> NewTcpStore(const TcpStoreOptions& options) {
  if (options.port <= 0 || options.port > 65535) {
    return Status::InvalidArgument("the rendezvous port " + std::to_string(options.port) +
                                   " is not a TCP port (1-65535); check MASTER_PORT");
  }
  if (options.host.empty()) {
    return Status::InvalidArgument("the rendezvous needs a host; set MASTER_ADDR");
  }
  if (options.job_id.size() > kMaxJobId) {
    return Status::InvalidArgument("the job id (ZINF_JOB_ID) is " +
                                   std::to_string(options.job_id.size()) + " bytes; at most " +
                                   std::to_string(kMaxJobId));
  }
  if (options.timeout.count() <= 0) {
    return Status::InvalidArgument("the rendezvous timeout must be positive");
  }
  auto store = std::make_shared<TcpStore>(options);
  if (options.serve) ZINF_RETURN_IF_ERROR(store->StartServer());
  return std::shared_ptr<KeyValueStore>(std::move(store));
}

Result<std::shared_ptr<KeyValueStore>> NewTcpStore(const std::string& host, int port, bool serve,
                                                   std::chrono::milliseconds timeout) {
  TcpStoreOptions o;
  o.host = host;
  o.port = port;
  o.serve = serve;
  o.timeout = timeout;
  return NewTcpStore(o);
}

Result<std::shared_ptr<KeyValueStore>> NewFileStore(const std::string& folder) {
  struct stat st {};
  if (stat(folder.c_str(), &st) != 0) return SysError("store folder " + folder);
  if (!S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument("store folder " + folder + " is not a folder");
  }
  return std::shared_ptr<KeyValueStore>(std::make_shared<FileStore>(folder));
}

}  // namespace zinf
