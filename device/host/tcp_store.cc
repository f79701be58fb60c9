// The rendezvous stores of zinf/comm.h: a TCP key-value store served by rank 0 (what
// MASTER_ADDR:MASTER_PORT name) and a folder store. Only addresses and ids pass through them,
// a few hundred bytes per rank, once per group: simplicity over speed.
//
// Wire format (host byte order: every rank of a group runs the same build):
//   request  SET: u8 1, u32 key length, key, u32 value length, value   -> reply u8 1
//   request  GET: u8 2, u32 key length, key                            -> reply u32 length, value
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

constexpr uint8_t kSet = 1;
constexpr uint8_t kGet = 2;
constexpr uint32_t kMaxField = 1u << 20;  // keys and values are addresses and ids

std::string Where(const std::string& host, int port) {
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" +
         std::to_string(port);
}

Status SysError(const std::string& what) { return ErrnoToStatus(errno, what); }

// Writes all of `data`, retrying short writes and EINTR.
Status WriteAll(int fd, const void* data, size_t n, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
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
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return Status::FailedPrecondition(what + ": timed out");
    pollfd pfd{fd, POLLIN, 0};
    const int ready = poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return SysError(what + ": poll");
    if (ready == 0) continue;
    const ssize_t r = recv(fd, p, n, 0);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
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

  Status Start(const std::string& host, int port) {
    ZINF_ASSIGN_OR_RETURN(addrinfo * res, Resolve(host, port, false));
    // Listen on every interface of the resolved family: the ranks reach this process by
    // MASTER_ADDR, which may name any of its interfaces.
    const int family = res->ai_family;
    freeaddrinfo(res);
    listen_fd_ = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listen_fd_ < 0) return SysError("rendezvous store: socket");
    const int one = 1;
    if (setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0) {
      return SysError("rendezvous store: SO_REUSEADDR");
    }
    sockaddr_storage addr{};
    socklen_t len = 0;
    if (family == AF_INET6) {
      auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
      a->sin6_family = AF_INET6;
      a->sin6_addr = in6addr_any;
      a->sin6_port = htons(static_cast<uint16_t>(port));
      len = sizeof(*a);
    } else {
      auto* a = reinterpret_cast<sockaddr_in*>(&addr);
      a->sin_family = AF_INET;
      a->sin_addr.s_addr = htonl(INADDR_ANY);
      a->sin_port = htons(static_cast<uint16_t>(port));
      len = sizeof(*a);
    }
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      const int err = errno;
      return Status::FailedPrecondition(
          "rank 0 cannot serve the rendezvous store on port " + std::to_string(port) + ": " +
          std::strerror(err) +
          (err == EADDRINUSE ? " (another program, or an earlier job, holds it: pick another "
                               "MASTER_PORT)"
                             : ""));
    }
    if (listen(listen_fd_, 1024) != 0) return SysError("rendezvous store: listen");
    if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) return SysError("rendezvous store: pipe");
    thread_ = std::thread([this] { Serve(); });
    return Status::OK();
  }

 private:
  struct Client {
    std::string in;  // bytes received, not yet a whole request
  };

  void Serve() {
    for (;;) {
      std::vector<pollfd> fds;
      fds.push_back({wake_[0], POLLIN, 0});
      fds.push_back({listen_fd_, POLLIN, 0});
      for (auto& [fd, client] : clients_) fds.push_back({fd, POLLIN, 0});
      const int ready = poll(fds.data(), fds.size(), -1);
      if (ready < 0 && errno == EINTR) continue;
      if (ready < 0) {
        LogWarning(std::string("rendezvous store: poll failed: ") + std::strerror(errno) +
                   "; the store stops serving");
        return;
      }
      if (fds[0].revents != 0) return;
      if (fds[1].revents & POLLIN) {
        const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) {
          clients_[fd] = Client{};
        } else if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED) {
          LogWarning(std::string("rendezvous store: accept failed: ") + std::strerror(errno));
        }
      }
      for (size_t i = 2; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        if (!Receive(fds[i].fd)) Drop(fds[i].fd);
      }
    }
  }

  // Reads what is there and answers whole requests; false when the client is gone or broke
  // the protocol.
  bool Receive(int fd) {
    char buf[4096];
    const ssize_t r = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) return true;
    if (r <= 0) return false;
    std::string& in = clients_[fd].in;
    in.append(buf, static_cast<size_t>(r));
    for (;;) {
      size_t pos = 0;
      std::string key;
      std::string value;
      if (in.size() < 1) return true;
      const uint8_t op = static_cast<uint8_t>(in[0]);
      pos = 1;
      if (op != kSet && op != kGet) return false;
      if (!Field(in, &pos, &key)) return pos != 0;  // pos 0: malformed
      if (op == kSet && !Field(in, &pos, &value)) return pos != 0;
      in.erase(0, pos);
      if (op == kSet) {
        const uint8_t ok = 1;
        if (!WriteAll(fd, &ok, 1, "store reply").ok()) return false;
        auto waiting = waiting_.find(key);
        if (waiting != waiting_.end()) {
          for (int w : waiting->second) {
            if (clients_.count(w) != 0) (void)!Answer(w, value);  // a dead waiter is dropped later
          }
          waiting_.erase(waiting);
        }
        values_[key] = std::move(value);
      } else {
        auto found = values_.find(key);
        if (found != values_.end()) {
          if (!Answer(fd, found->second)) return false;
        } else {
          waiting_[key].push_back(fd);
        }
      }
    }
  }

  // Parses a u32-length-prefixed field at *pos. false with *pos unchanged when incomplete,
  // false with *pos = 0 when malformed.
  static bool Field(const std::string& in, size_t* pos, std::string* out) {
    uint32_t n = 0;
    if (in.size() < *pos + sizeof(n)) return false;
    std::memcpy(&n, in.data() + *pos, sizeof(n));
    if (n > kMaxField) {
      *pos = 0;
      return false;
    }
    if (in.size() < *pos + sizeof(n) + n) return false;
    out->assign(in.data() + *pos + sizeof(n), n);
    *pos += sizeof(n) + n;
    return true;
  }

  static bool Answer(int fd, const std::string& value) {
    const uint32_t n = static_cast<uint32_t>(value.size());
    return WriteAll(fd, &n, sizeof(n), "store reply").ok() &&
           WriteAll(fd, value.data(), n, "store reply").ok();
  }

  void Drop(int fd) {
    close(fd);
    clients_.erase(fd);
    for (auto& [key, fds] : waiting_) {
      fds.erase(std::remove(fds.begin(), fds.end(), fd), fds.end());
    }
  }

  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  std::thread thread_;
  // Touched only by the server thread (and by the destructor after joining it).
  std::map<int, Client> clients_;
  std::map<std::string, std::string> values_;
  std::map<std::string, std::vector<int>> waiting_;
};

// ---- The client ------------------------------------------------------------------------------

class TcpStore final : public KeyValueStore {
 public:
  TcpStore(std::string host, int port, std::chrono::milliseconds timeout)
      : host_(std::move(host)), port_(port), timeout_(timeout) {}
  ~TcpStore() override {
    MutexLock lock(&mu_);
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

  Status StartServer() { return server_.Start(host_, port_); }

  Status Set(const std::string& key, const std::string& value) override {
    MutexLock lock(&mu_);
    const Clock::time_point deadline = Clock::now() + timeout_;
    Status s = Connect(deadline);
    if (s.ok()) s = Send(kSet, key, &value);
    uint8_t ok = 0;
    if (s.ok()) s = ReadAll(fd_, &ok, 1, deadline, "rendezvous store " + Where(host_, port_));
    if (!s.ok()) Reset();
    return s.WithContext("setting '" + key + "'");
  }

  Result<std::string> Get(const std::string& key, std::chrono::milliseconds timeout) override {
    MutexLock lock(&mu_);
    const Clock::time_point deadline = Clock::now() + timeout;
    const std::string what = "rendezvous store " + Where(host_, port_) + ": waiting " +
                             std::to_string(timeout.count() / 1000.0) + " s for '" + key +
                             "' (is every rank of the group started?)";
    Status s = Connect(deadline);
    if (s.ok()) s = Send(kGet, key, nullptr);
    uint32_t n = 0;
    if (s.ok()) s = ReadAll(fd_, &n, sizeof(n), deadline, what);
    if (s.ok() && n > kMaxField)
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
  Status Connect(Clock::time_point deadline) REQUIRES(mu_) {
    if (fd_ >= 0) return Status::OK();
    std::string last = "no attempt";
    while (Clock::now() < deadline) {
      Result<addrinfo*> res = Resolve(host_, port_, false);
      if (!res.ok()) return res.status();
      for (addrinfo* ai = *res; ai != nullptr; ai = ai->ai_next) {
        const int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) continue;
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
          const int one = 1;
          // Small requests: do not wait to coalesce them. Best effort.
          (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          fd_ = fd;
          freeaddrinfo(*res);
          return Status::OK();
        }
        last = std::strerror(errno);
        close(fd);
      }
      freeaddrinfo(*res);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // rank 0 may not listen yet
    }
    return Status::FailedPrecondition("cannot reach the rendezvous store at " +
                                      Where(host_, port_) + " (" + last +
                                      "): is rank 0 running, and MASTER_ADDR / MASTER_PORT the "
                                      "same on every rank?");
  }

  Status Send(uint8_t op, const std::string& key, const std::string* value) REQUIRES(mu_) {
    std::string req(1, static_cast<char>(op));
    auto field = [&req](const std::string& f) {
      const uint32_t n = static_cast<uint32_t>(f.size());
      req.append(reinterpret_cast<const char*>(&n), sizeof(n));
      req += f;
    };
    if (key.size() > kMaxField || (value != nullptr && value->size() > kMaxField)) {
      return Status::InvalidArgument("rendezvous store: a key or value over 1 MiB");
    }
    field(key);
    if (value != nullptr) field(*value);
    return WriteAll(fd_, req.data(), req.size(), "rendezvous store " + Where(host_, port_));
  }

  void Reset() REQUIRES(mu_) {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

  const std::string host_;
  const int port_;
  const std::chrono::milliseconds timeout_;
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

Result<std::shared_ptr<KeyValueStore>> NewTcpStore(const std::string& host, int port, bool serve,
                                                   std::chrono::milliseconds timeout) {
  if (port <= 0 || port > 65535) {
    return Status::InvalidArgument("the rendezvous port " + std::to_string(port) +
                                   " is not a TCP port (1-65535); check MASTER_PORT");
  }
  if (host.empty()) {
    return Status::InvalidArgument("the rendezvous needs a host; set MASTER_ADDR");
  }
  auto store = std::make_shared<TcpStore>(host, port, timeout);
  if (serve) ZINF_RETURN_IF_ERROR(store->StartServer());
  return std::shared_ptr<KeyValueStore>(std::move(store));
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
