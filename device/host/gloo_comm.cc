// GlooComm: the Communicator seam for ranks that are processes (zinf/comm.h, NewGlooComm).
//
// gloo moves the bytes (TCP transport, full mesh); this file adds nothing to the wire. The
// sums are this rank's, in rank order, so that every rank, every run and LocalComm give the
// same bits:
//   ReduceScatterSum: alltoall (rank r receives every rank's chunk r), then an ordered sum;
//   AllReduceSum: the same on chunks padded to a multiple of the world size, then allgather;
//   AllGather, Broadcast, Barrier: gloo's own.
// Each collective is a HostDevice stream task, like LocalComm's, tagged with its sequence
// number (the order the rank issued it), so collectives of different streams run at once and
// still pair with the right peer operation.
#include <arpa/inet.h>
#include <gloo/allgather.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/address.h>
#include <gloo/transport/context.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/device.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/thread_annotations.h"
#include "device/host/host_device.h"
#include "zinf/comm.h"
#include "zinf/log.h"

namespace zinf {
namespace {

// gloo's view of a KeyValueStore, under this group's prefix. gloo reports store failures by
// exception; they are caught where the group is created.
class GlooStore final : public gloo::rendezvous::Store {
 public:
  // Every wait ends by `deadline`: the join as a whole takes at most the timeout, however
  // many keys gloo waits for.
  GlooStore(KeyValueStore* store, std::string prefix,
            std::chrono::steady_clock::time_point deadline)
      : store_(store), prefix_(std::move(prefix)), deadline_(deadline) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Status s = store_->Set(prefix_ + "/" + key, std::string(data.begin(), data.end()));
    if (!s.ok()) throw std::runtime_error(s.ToString());
  }
  std::vector<char> get(const std::string& key) override {
    Result<std::string> v = store_->Get(prefix_ + "/" + key, Left());
    if (!v.ok()) throw std::runtime_error(v.status().ToString());
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, Left()); }
  // gloo passes its context's timeout, which is shortened during the mesh (see NewGlooComm):
  // a wait for a peer's key takes what the join's deadline leaves instead.
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& /*gloo's*/) override {
    for (const std::string& key : keys) {
      Result<std::string> v = store_->Get(prefix_ + "/" + key, Left());
      if (!v.ok()) throw std::runtime_error(v.status().ToString());
    }
  }

 private:
  std::chrono::milliseconds Left() const {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline_ - std::chrono::steady_clock::now()));
  }

  KeyValueStore* const store_;
  const std::string prefix_;
  const std::chrono::steady_clock::time_point deadline_;
};

// out[i] = ((in[0][i] + in[1][i]) + in[2][i]) + ..., as LocalComm's OrderedSum.
void OrderedSum(const float* in, size_t stride, int ranks, float* out, size_t n) {
  std::memcpy(out, in, n * sizeof(float));
  for (int r = 1; r < ranks; ++r) {
    const float* src = in + static_cast<size_t>(r) * stride;
    for (size_t i = 0; i < n; ++i) out[i] += src[i];
  }
}

// The address of this machine's interface that routes to `host`: a UDP socket "connected"
// there sends nothing but gets a source address.
Result<std::string> RouteAddress(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port > 0 ? port : 9);
  const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    return Status::InvalidArgument("MASTER_ADDR '" + host + "' does not resolve (" +
                                   gai_strerror(rc) + ")");
  }
  std::string found;
  int err = 0;
  for (addrinfo* ai = res; ai != nullptr && found.empty(); ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      err = errno;
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char text[INET6_ADDRSTRLEN] = {0};
      const void* a =
          local.ss_family == AF_INET6
              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
              : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
      if (inet_ntop(local.ss_family, a, text, sizeof(text)) != nullptr) found = text;
    } else {
      err = errno;
    }
    close(fd);
  }
  freeaddrinfo(res);
  if (found.empty()) {
    return ErrnoToStatus(err, "finding the interface that routes to MASTER_ADDR " + host +
                                  " (set ZINF_LISTEN_ADDR or GLOO_SOCKET_IFNAME)");
  }
  return found;
}

enum class Kind { kAllGather, kReduceScatterSum, kAllReduceSum, kBroadcast, kBarrier, kAllToAll };

std::string Describe(Kind kind, size_t size, int root) {
  switch (kind) {
    case Kind::kAllGather:
      return "AllGather of " + std::to_string(size) + " bytes per rank";
    case Kind::kAllToAll:
      return "AllToAll of " + std::to_string(size) + " bytes per rank";
    case Kind::kReduceScatterSum:
      return "ReduceScatterSum of " + std::to_string(size) + " floats per rank";
    case Kind::kAllReduceSum:
      return "AllReduceSum of " + std::to_string(size) + " floats";
    case Kind::kBroadcast:
      return "Broadcast of " + std::to_string(size) + " bytes from root " + std::to_string(root);
    case Kind::kBarrier:
      return "Barrier";
  }
  return "?";
}

// The reduce-scatters' receive buffers (world x count floats), kept between collectives: a
// fresh one per call is an mmap, a zero-filled page per 4 KiB and a munmap, about as long as
// moving it over loopback. At most kKeepBytes stay; collectives on different streams each take
// their own.
class ScratchPool {
 public:
  std::vector<float> Take(size_t floats) {
    std::vector<float> v;
    {
      MutexLock lock(&mu_);
      if (!free_.empty()) {
        v = std::move(free_.back());
        free_.pop_back();
        kept_ -= v.capacity() * sizeof(float);
      }
    }
    if (v.size() < floats) v.resize(floats);  // every float is written before it is read
    return v;
  }
  void Give(std::vector<float> v) {
    const size_t bytes = v.capacity() * sizeof(float);
    MutexLock lock(&mu_);
    if (kept_ + bytes > kKeepBytes) return;  // freed here
    kept_ += bytes;
    free_.push_back(std::move(v));
  }

 private:
  static constexpr size_t kKeepBytes = size_t{256} << 20;
  Mutex mu_;
  std::vector<std::vector<float>> free_ GUARDED_BY(mu_);
  size_t kept_ GUARDED_BY(mu_) = 0;
};

// What a queued collective uses: shared with the tasks, so an endpoint may be destroyed while
// its collectives are still queued (as LocalComm's).
struct Group {
  ProcessGroupOptions options;
  std::shared_ptr<gloo::Context> context;
  std::shared_ptr<KeyValueStore> store;  // rank 0 serves the TCP store from it
  std::vector<std::string> members;      // per rank: "host pid"
  Mutex mu;
  Status broken GUARDED_BY(mu);  // once set, every collective fails with it
  CommCounters counters GUARDED_BY(mu);
  ScratchPool scratch;
};

class GlooComm final : public Communicator {
 public:
  GlooComm(HostDevice* device, std::shared_ptr<Group> group)
      : device_(device), group_(std::move(group)), options_(group_->options) {}

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  CommCounters Counters() const override {
    MutexLock lock(&group_->mu);
    return group_->counters;
  }

  Status AllGather(const void* send, void* recv, size_t bytes_per_rank, Stream* stream) override {
    if (bytes_per_rank == 0) return Status::OK();
    const std::string what = Describe(Kind::kAllGather, bytes_per_rank, -1);
    if (Status bad = CheckBuffers(what, send, recv); !bad.ok()) return Refuse(bad);
    auto* out = static_cast<uint8_t*>(recv);
    const bool in_place = out + options_.rank * bytes_per_rank == send;
    const int n = world_size();
    const uint64_t sent = bytes_per_rank * (n - 1);  // gloo's ring: N - 1 blocks out
    return Issue(what, stream, sent, [=](const std::shared_ptr<gloo::Context>& ctx, uint32_t tag) {
      gloo::AllgatherOptions o(ctx);
      if (!in_place) o.setInput(static_cast<uint8_t*>(const_cast<void*>(send)), bytes_per_rank);
      o.setOutput(out, bytes_per_rank * n);
      o.setTag(tag);
      gloo::allgather(o);
    });
  }

  Status AllToAll(const void* send, void* recv, size_t bytes_per_rank, Stream* stream) override {
    if (bytes_per_rank == 0) return Status::OK();
    const std::string what = Describe(Kind::kAllToAll, bytes_per_rank, -1);
    if (Status bad = CheckBuffers(what, send, recv); !bad.ok()) return Refuse(bad);
    const int n = world_size();
    const uint64_t sent = bytes_per_rank * (n - 1);  // one block to each peer
    return Issue(what, stream, sent, [=](const std::shared_ptr<gloo::Context>& ctx, uint32_t tag) {
      if (n == 1) {
        std::memcpy(recv, send, bytes_per_rank);
        return;
      }
      gloo::AlltoallOptions o(ctx);
      o.setInput(static_cast<uint8_t*>(const_cast<void*>(send)), bytes_per_rank * n);
      o.setOutput(static_cast<uint8_t*>(recv), bytes_per_rank * n);
      o.setTag(tag);
      gloo::alltoall(o);
    });
  }

  Status ReduceScatterSum(const float* send, float* recv, size_t count_per_rank,
                          Stream* stream) override {
    if (count_per_rank == 0) return Status::OK();
    const std::string what = Describe(Kind::kReduceScatterSum, count_per_rank, -1);
    if (Status bad = CheckBuffers(what, send, recv); !bad.ok()) return Refuse(bad);
    const int n = world_size();
    const uint64_t sent = count_per_rank * sizeof(float) * (n - 1);  // one chunk to each peer
    Group* const g = group_.get();  // the task holds the group (Issue)
    return Issue(what, stream, sent, [=](const std::shared_ptr<gloo::Context>& ctx, uint32_t tag) {
      if (n == 1) {
        std::memcpy(recv, send, count_per_rank * sizeof(float));
        return;
      }
      const size_t floats = count_per_rank * n;
      std::vector<float> mine = g->scratch.Take(floats);
      Alltoall(ctx, tag, const_cast<float*>(send), mine.data(), floats);
      OrderedSum(mine.data(), count_per_rank, n, recv, count_per_rank);
      g->scratch.Give(std::move(mine));
    });
  }

  Status AllReduceSum(float* buf, size_t count, Stream* stream) override {
    if (count == 0) return Status::OK();
    const std::string what = Describe(Kind::kAllReduceSum, count, -1);
    if (Status bad = CheckBuffers(what, buf, buf); !bad.ok()) return Refuse(bad);
    const int n = world_size();
    const int rank = options_.rank;
    // The alltoall's chunks, then the allgather's ring.
    const uint64_t sent = 2 * ((count + n - 1) / n) * sizeof(float) * (n - 1);
    return Issue(what, stream, sent, [=](const std::shared_ptr<gloo::Context>& ctx, uint32_t tag) {
      if (n == 1) return;
      // Chunks of `chunk` floats, one per rank; the tail of the last is zero padding, which
      // the sum never writes back.
      const size_t chunk = (count + n - 1) / n;
      std::vector<float> padded(chunk * n, 0.0f);
      std::memcpy(padded.data(), buf, count * sizeof(float));
      std::vector<float> parts(chunk * n);
      Alltoall(ctx, tag, padded.data(), parts.data(), parts.size());
      std::vector<float> sums(chunk * n);
      OrderedSum(parts.data(), chunk, n, sums.data() + rank * chunk, chunk);
      gloo::AllgatherOptions o(ctx);
      o.setOutput(sums.data(), sums.size());
      o.setTag(tag);
      gloo::allgather(o);
      std::memcpy(buf, sums.data(), count * sizeof(float));
    });
  }

  Status Broadcast(void* buf, size_t bytes, int root, Stream* stream) override {
    if (bytes == 0) return Status::OK();
    const std::string what = Describe(Kind::kBroadcast, bytes, root);
    if (Status bad = CheckBuffers(what, buf, buf); !bad.ok()) return Refuse(bad);
    if (root < 0 || root >= world_size()) {
      return Refuse(Status::InvalidArgument(
          Prefix() + what + ": root is not a rank of a world of " + std::to_string(world_size())));
    }
    const uint64_t sent = options_.rank == root ? bytes * (world_size() - 1) : 0;
    return Issue(what, stream, sent, [=](const std::shared_ptr<gloo::Context>& ctx, uint32_t tag) {
      gloo::BroadcastOptions o(ctx);
      o.setOutput(static_cast<uint8_t*>(buf), bytes);
      o.setRoot(root);
      o.setTag(tag);
      gloo::broadcast(o);
    });
  }

  Result<std::unique_ptr<Communicator>> Split(int color, Stream* stream) override;

  Status Barrier() override {
    const uint32_t tag = next_tag_++;
    return Run(*group_, Describe(Kind::kBarrier, 0, -1), tag, 0,
               [](const std::shared_ptr<gloo::Context>& ctx, uint32_t t) {
                 gloo::BarrierOptions o(ctx);
                 o.setTag(t);
                 gloo::barrier(o);
               });
  }

 private:
  using Op = std::function<void(const std::shared_ptr<gloo::Context>&, uint32_t tag)>;

  std::string Prefix() const { return Prefix(options_); }
  static std::string Prefix(const ProcessGroupOptions& o) {
    return "GlooComm rank " + std::to_string(o.rank) + ": ";
  }

  Status CheckBuffers(const std::string& what, const void* send, const void* recv) const {
    if (send != nullptr && recv != nullptr) return Status::OK();
    return Status::InvalidArgument(
        Prefix() + what + ": " + (send == nullptr ? "send buffer" : "receive buffer") + " is null");
  }

  static void Alltoall(const std::shared_ptr<gloo::Context>& ctx, uint32_t tag, float* in,
                       float* out, size_t elements) {
    gloo::AlltoallOptions o(ctx);
    o.setInput(in, elements);
    o.setOutput(out, elements);
    o.setTag(tag);
    gloo::alltoall(o);
  }

  // Queues `op` on `stream` under the next tag.
  Status Issue(const std::string& what, Stream* stream, uint64_t sent, Op op) {
    if (stream == nullptr) {
      return Refuse(Status::InvalidArgument(Prefix() + what + ": stream is null"));
    }
    const uint32_t tag = next_tag_++;
    auto started = std::make_shared<std::atomic<bool>>(false);
    Status s = device_->LaunchHostTask(
        stream, [group = group_, what, tag, sent, op = std::move(op), started] {
          started->store(true);
          return Run(*group, what, tag, sent, op);
        });
    // Not queued (a rejected stream): this rank will never run collective `tag`.
    if (!s.ok() && !started->load()) Break(*group_, s);
    return s;
  }

  // A collective this rank refuses before issuing it (bad arguments): the peers would wait in
  // theirs, and this rank's later collectives would pair with the wrong ones. The group breaks:
  // its connections close, so the peers fail at once, and every later call fails here.
  Status Refuse(const Status& why) {
    ++next_tag_;
    Break(*group_, why);
    return why;
  }

  // Marks the group unusable with `why` (the first reason stays) and closes its connections,
  // so that peers blocked in a collective with this rank fail now instead of at the timeout.
  static void Break(Group& g, const Status& why) {
    {
      MutexLock lock(&g.mu);
      if (!g.broken.ok()) return;
      g.broken = why;
    }
    try {
      g.context->closeConnections();
    } catch (const std::exception& e) {
      // Best effort: the peers then fail at their timeout instead.
      LogWarning(std::string("GlooComm: closing the group's connections: ") + e.what());
    }
  }

  static Status Run(Group& g, const std::string& what, uint32_t tag, uint64_t sent, const Op& op) {
    {
      MutexLock lock(&g.mu);
      if (!g.broken.ok()) return g.broken;
    }
    std::string error;
    const auto start = std::chrono::steady_clock::now();
    try {
      op(g.context, tag);
      const double took =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      MutexLock lock(&g.mu);
      g.counters.collectives += 1;
      g.counters.bytes_sent += sent;
      g.counters.seconds += took;
      return Status::OK();
    } catch (const std::exception& e) {
      error = e.what();
    }
    {
      // A failure that follows this rank's own break (its connections closed) says that.
      MutexLock lock(&g.mu);
      if (!g.broken.ok()) return g.broken;
    }
    Status failed = Status::FailedPrecondition(
        Prefix(g.options) + what + " (collective #" + std::to_string(tag) + ") failed: " + error +
        ". " + Gone(g, error) + "Every rank of the group stops; the group is unusable.");
    Break(g, failed);
    MutexLock lock(&g.mu);
    return g.broken;
  }

  // The peers known to have stopped: those on this machine whose process is gone (or a
  // zombie). A peer on another machine is named by gloo's message (its address) only. A peer
  // killed a moment ago may still be exiting: looked at again for up to 300 ms.
  static std::string Gone(const Group& g, const std::string& error) {
    char host[256] = {0};
    std::string gone;
    const bool local = gethostname(host, sizeof(host) - 1) == 0;
    for (int attempt = 0; local && gone.empty() && attempt < 7; ++attempt) {
      if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      for (int r = 0; r < static_cast<int>(g.members.size()); ++r) {
        const std::string& m = g.members[r];  // "host pid"
        const size_t space = m.rfind(' ');
        if (r == g.options.rank || space == std::string::npos || m.substr(0, space) != host) {
          continue;
        }
        const pid_t pid = static_cast<pid_t>(std::strtol(m.c_str() + space + 1, nullptr, 10));
        if (pid > 0 && !Alive(pid)) {
          gone +=
              (gone.empty() ? "" : ", ") + std::to_string(r) + " (pid " + std::to_string(pid) + ")";
        }
      }
    }
    if (!gone.empty()) {
      return (gone.find(',') == std::string::npos ? "Rank " + gone + " is"
                                                  : "Ranks " + gone + " are") +
             " no longer running. ";
    }
    if (error.find("Timed out") != std::string::npos) {
      return "A peer rank did not reach this collective within " +
             std::to_string(g.options.timeout.count() / 1000) +
             " s (zinf.collective_timeout_seconds): it stalled, or the ranks issued different "
             "collectives. ";
    }
    return "A peer rank stopped or the network between ranks failed. ";
  }

  // Whether `pid` is a live process: not gone, not a zombie.
  static bool Alive(pid_t pid) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return false;
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return true;  // cannot tell: say nothing
    const size_t paren = line.rfind(')');
    if (paren == std::string::npos || paren + 2 >= line.size()) return true;
    const char state = line[paren + 2];
    return state != 'Z' && state != 'X';
  }

  HostDevice* const device_;
  const std::shared_ptr<Group> group_;
  const ProcessGroupOptions& options_;
  // Touched only by the rank's issuing thread (one thread at a time, per the contract).
  uint32_t next_tag_ = 0;
};

// Split's address exchange: per member slot, the length (kAddressFailed: this rank failed) and
// the bytes of this rank's address for its pair with that member.
constexpr size_t kAddressMax = gloo::transport::Address::kMaxByteSize;
constexpr uint32_t kAddressFailed = UINT32_MAX;
constexpr size_t kAddressSlot = sizeof(uint32_t) + kAddressMax;

// This rank's part of the exchange: `slots` slots of `mine`, or the failure marker in every
// slot (the others look at slot 0) when *error is set or an address is too long (then said
// in *error).
std::vector<char> EncodeAddresses(const std::vector<std::vector<char>>& mine, size_t slots,
                                  std::string* error) {
  for (const std::vector<char>& a : mine) {
    if (a.size() > kAddressMax && error->empty()) {
      *error = "a gloo address of " + std::to_string(a.size()) + " bytes";
    }
  }
  std::vector<char> out(kAddressSlot * slots, 0);
  for (size_t i = 0; i < slots; ++i) {
    const bool bad = !error->empty();
    const uint32_t len = bad               ? kAddressFailed
                         : i < mine.size() ? static_cast<uint32_t>(mine[i].size())
                                           : 0;
    std::memcpy(out.data() + i * kAddressSlot, &len, sizeof(len));
    if (!bad && len > 0) {
      std::memcpy(out.data() + i * kAddressSlot + sizeof(len), mine[i].data(), len);
    }
  }
  return out;
}

// A gloo context whose full mesh is connected with addresses that a collective of the parent
// group exchanges (Split), instead of through a rendezvous store: the store may be gone by then.
class MeshContext final : public gloo::Context {
 public:
  MeshContext(int rank, int size) : gloo::Context(rank, size) {}

  // This rank's pairs on `dev` (listening); returns mine[i], its address for its pair with
  // rank i (empty for itself). Throws gloo's exceptions.
  std::vector<std::vector<char>> CreatePairs(const std::shared_ptr<gloo::transport::Device>& dev) {
    tc_ = dev->createContext(rank, size);
    tc_->setTimeout(getTimeout());
    std::vector<std::vector<char>> mine(size);
    for (int i = 0; i < size; ++i) {
      if (i != rank) mine[i] = tc_->createPair(i)->address().bytes();
    }
    device_ = dev;
    return mine;
  }
  // Connects every pair: all[j][i] is rank j's address for its pair with rank i. Throws.
  void Connect(const std::vector<std::vector<std::vector<char>>>& all) {
    for (int i = 0; i < size; ++i) {
      if (i != rank) tc_->getPair(i)->connect(all[i][rank]);
    }
    transportContext_ = std::move(tc_);
  }

 private:
  std::shared_ptr<gloo::transport::Context> tc_;
};

// The colors go round with an AllGather of this group, then the addresses of the new group's
// pairs with another (each rank's slot i: its address for the member of index i, with its
// length; slots for the largest group), so a sub-group needs no store. Every rank takes part
// in the exchanges whatever happens locally: a rank that could not make its pairs sends a
// marker instead, and every rank fails at once naming it; so does one that could not connect
// them (a third exchange, of that outcome). The new group listens where this
// one does (the same gloo device, hence the same socket and event loop). While the pairs
// connect, gloo's timeout is a fifth of the collectives' (it waits five times it for a pair's
// first connect), as at the join.
Result<std::unique_ptr<Communicator>> GlooComm::Split(int color, Stream* stream) {
  const int n = world_size();
  const std::string who = "GlooComm rank " + std::to_string(options_.rank);
  std::vector<int32_t> colors(n);
  const int32_t my_color = color;
  ZINF_RETURN_IF_ERROR(AllGather(&my_color, colors.data(), sizeof(my_color), stream));
  ZINF_RETURN_IF_ERROR(device_->SynchronizeStream(stream));
  ZINF_ASSIGN_OR_RETURN(const std::vector<int> members, SplitMembers(colors, options_.rank, who));
  const int size = static_cast<int>(members.size());
  const int index =
      static_cast<int>(std::find(members.begin(), members.end(), options_.rank) - members.begin());
  size_t largest = 1;
  for (int32_t c : colors) {
    largest = std::max<size_t>(largest, std::count(colors.begin(), colors.end(), c));
  }
  const size_t blob = kAddressSlot * largest;
  auto context = std::make_shared<MeshContext>(index, size);
  context->setTimeout(std::max(std::chrono::milliseconds(1), options_.timeout / 5));
  std::vector<std::vector<char>> mine;
  std::string local_error;
  try {
    mine = context->CreatePairs(group_->context->getDevice());
  } catch (const std::exception& e) {
    local_error = e.what();
  }
  const std::vector<char> out = EncodeAddresses(mine, largest, &local_error);
  std::vector<char> gathered(blob * n);
  ZINF_RETURN_IF_ERROR(AllGather(out.data(), gathered.data(), blob, stream));
  ZINF_RETURN_IF_ERROR(device_->SynchronizeStream(stream));
  auto len_at = [&](int rank, size_t slot) {
    uint32_t len = 0;
    std::memcpy(&len, gathered.data() + static_cast<size_t>(rank) * blob + slot * kAddressSlot,
                sizeof(len));
    return len;
  };
  for (int r = 0; r < n; ++r) {
    if (len_at(r, 0) == kAddressFailed) {
      return Status::FailedPrecondition(
          who + ": Split: rank " + std::to_string(r) +
          " could not make its connections of the sub-group" +
          (r == options_.rank && !local_error.empty() ? " (" + local_error + ")" : "") +
          "; no sub-group was made");
    }
  }
  std::vector<std::vector<std::vector<char>>> all(size, std::vector<std::vector<char>>(size));
  for (int j = 0; j < size; ++j) {
    const char* from = gathered.data() + static_cast<size_t>(members[j]) * blob;
    for (int i = 0; i < size; ++i) {
      const uint32_t len = std::min<uint32_t>(len_at(members[j], i), kAddressMax);
      all[j][i].assign(from + i * kAddressSlot + sizeof(len),
                       from + i * kAddressSlot + sizeof(len) + len);
    }
  }
  std::string connect_error;
  try {
    context->Connect(all);
  } catch (const std::exception& e) {
    connect_error = e.what();
  }
  // Every rank learns whether every rank connected (through the parent, whose connections
  // stand), so that none waits in the sub-group's first collective for one that gave up.
  const int32_t connected = connect_error.empty() ? 1 : 0;
  std::vector<int32_t> everyone(n);
  ZINF_RETURN_IF_ERROR(AllGather(&connected, everyone.data(), sizeof(connected), stream));
  ZINF_RETURN_IF_ERROR(device_->SynchronizeStream(stream));
  for (int r = 0; r < n; ++r) {
    if (everyone[r] == 1) continue;
    return Status::FailedPrecondition(
        who + ": Split: rank " + std::to_string(r) + " could not connect its sub-group" +
        (r == options_.rank ? " (color " + std::to_string(color) + ", " + std::to_string(size) +
                                  " ranks: " + connect_error + ")"
                            : std::string()) +
        "; no sub-group was made");
  }
  context->setTimeout(options_.timeout);
  auto group = std::make_shared<Group>();
  group->options = options_;
  group->options.rank = index;
  group->options.world_size = size;
  group->options.store.reset();
  for (int m : members) group->members.push_back(group_->members[m]);
  group->context = std::move(context);
  auto comm = std::make_unique<GlooComm>(device_, std::move(group));
  ZINF_RETURN_IF_ERROR(comm->Barrier().WithContext(who + ": joining the sub-group of color " +
                                                   std::to_string(color)));
  return std::unique_ptr<Communicator>(std::move(comm));
}

// Every rank says who it is ("host pid", for the message when a peer dies) and waits until
// all the others have, each wait within what `left()` says the join's deadline leaves.
Result<std::vector<std::string>> ExchangeMembers(
    KeyValueStore* store, const ProcessGroupOptions& options,
    const std::function<std::chrono::milliseconds()>& left) {
  char host_name[256] = {0};
  if (gethostname(host_name, sizeof(host_name) - 1) != 0) {
    return ErrnoToStatus(errno, "NewGlooComm: gethostname");
  }
  const std::string me = std::string(host_name) + " " + std::to_string(getpid());
  ZINF_RETURN_IF_ERROR(store->Set(options.prefix + "/member/" + std::to_string(options.rank), me));
  std::vector<std::string> members(options.world_size);
  for (int r = 0; r < options.world_size; ++r) {
    ZINF_ASSIGN_OR_RETURN(members[r],
                          store->Get(options.prefix + "/member/" + std::to_string(r), left()));
  }
  return members;
}

// The device as the HostDevice gloo needs (it moves host memory), or why it is not one.
Result<HostDevice*> GlooHostDevice(Device* device) {
  auto* host = dynamic_cast<HostDevice*>(device);
  if (host == nullptr) {
    return Status::InvalidArgument("NewGlooComm: the device " +
                                   (device == nullptr
                                        ? std::string("is null")
                                        : "'" + device->Name() + "' is not a HostDevice") +
                                   "; gloo moves host memory (GPU ranks use NewNcclComm)");
  }
  return host;
}

// The options name a rank of the world and a positive timeout.
Status CheckGroupOptions(const ProcessGroupOptions& options) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return Status::InvalidArgument("NewGlooComm: rank " + std::to_string(options.rank) +
                                   " is not a rank of a world of " +
                                   std::to_string(options.world_size));
  }
  if (options.timeout.count() <= 0) {
    return Status::InvalidArgument("NewGlooComm: the timeout must be positive");
  }
  return Status::OK();
}

// gloo writes to its sockets with writev, which raises SIGPIPE when a peer has died: with
// the default action that would kill this rank instead of failing the collective. Ignored
// (as Python does at startup) unless the program installed a handler of its own.
void IgnoreDefaultSigpipe() {
  struct sigaction old {};
  if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL &&
      (old.sa_flags & SA_SIGINFO) == 0) {
    signal(SIGPIPE, SIG_IGN);
  }
}

// Where this rank listens: ZINF_LISTEN_ADDR, else GLOO_SOCKET_IFNAME's interface, else the
// address that routes to MASTER_ADDR, else loopback; refused when that is a loopback address
// that ranks on other machines would have to reach.
Result<gloo::transport::tcp::attr> ListenAttr(const ProcessGroupOptions& options) {
  gloo::transport::tcp::attr attr;
  if (!options.listen_addr.empty()) {
    attr.hostname = options.listen_addr;
  } else if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME"); iface != nullptr && *iface) {
    attr.iface = iface;
  } else if (!options.master_addr.empty()) {
    ZINF_ASSIGN_OR_RETURN(attr.hostname, RouteAddress(options.master_addr, options.master_port));
  } else {
    attr.hostname = "127.0.0.1";
  }
  // Ranks on other machines cannot reach a loopback address: e.g. MASTER_ADDR a host name that
  // resolves to 127.0.1.1 on the master itself (Debian's /etc/hosts).
  const bool loopback =
      attr.hostname.rfind("127.", 0) == 0 || attr.hostname == "::1" || attr.hostname == "localhost";
  if (loopback && attr.iface.empty() && !options.master_addr.empty() &&
      options.listen_addr.empty() && options.local_world_size > 0 &&
      options.local_world_size < options.world_size) {
    return Status::InvalidArgument(
        "rank " + std::to_string(options.rank) + " would listen on " + attr.hostname +
        " (the address that routes to MASTER_ADDR " + options.master_addr +
        " from here), which "
        "the ranks on the other machines (LOCAL_WORLD_SIZE " +
        std::to_string(options.local_world_size) + " of WORLD_SIZE " +
        std::to_string(options.world_size) +
        ") cannot reach: set ZINF_LISTEN_ADDR to this "
        "machine's address on their network, or GLOO_SOCKET_IFNAME to its interface, or give "
        "MASTER_ADDR as an address");
  }
  return attr;
}

// The group as the join's errors name it: its size, this rank and where it listens.
std::string GroupDescription(const ProcessGroupOptions& options,
                             const gloo::transport::tcp::attr& attr) {
  return "the group of " + std::to_string(options.world_size) + " processes (rank " +
         std::to_string(options.rank) + ", listening on " +
         (attr.iface.empty() ? attr.hostname : "interface " + attr.iface) + ")";
}

// What is left until `deadline`, at least 1 ms.
std::chrono::milliseconds TimeLeft(std::chrono::steady_clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(
                      deadline - std::chrono::steady_clock::now()));
}

// Connects this rank to every other (gloo's full mesh, addresses exchanged through `store`)
// by `deadline`; returns the context with the collectives' timeout set. `where` names the
// group in the error.
Result<std::shared_ptr<gloo::rendezvous::Context>> ConnectFullMesh(
    KeyValueStore* store, const ProcessGroupOptions& options,
    const gloo::transport::tcp::attr& attr, std::chrono::steady_clock::time_point deadline,
    const std::string& where) {
  std::shared_ptr<gloo::rendezvous::Context> context;
  try {
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.world_size);
    // gloo waits five times the context's timeout for a pair's first connect: during the
    // mesh the timeout is a fifth of what the deadline leaves, then the collectives' own.
    context->setTimeout(std::max(std::chrono::milliseconds(1), TimeLeft(deadline) / 5));
    GlooStore gs(store, options.prefix, deadline);
    context->connectFullMesh(gs, dev);
    context->setTimeout(options.timeout);
  } catch (const std::exception& e) {
    return Status::FailedPrecondition("joining " + where + " failed: " + e.what());
  }
  return context;
}

// Once joined, nothing needs the store: a client's goes now (a Python store and its GIL with
// it) rather than with the last queued collective, on whatever thread that is. Rank 0 keeps
// serving the TCP store it made while the group lives, so that the port stays this job's: a
// second job started on it fails at once (the port is in use), where a free port would let
// its rank 0 serve the late ranks of this one.
void ReleaseRendezvousStore(Group& group, const ProcessGroupOptions& options) {
  const bool own_server =
      options.rank == 0 && options.store == nullptr && options.store_folder.empty();
  MutexLock lock(&group.mu);
  if (!own_server) group.store.reset();
  group.options.store.reset();
}

}  // namespace

Result<std::unique_ptr<Communicator>> NewGlooComm(Device* device,
                                                  const ProcessGroupOptions& options) {
  ZINF_ASSIGN_OR_RETURN(HostDevice* const host, GlooHostDevice(device));
  ZINF_RETURN_IF_ERROR(CheckGroupOptions(options));
  IgnoreDefaultSigpipe();
  ZINF_ASSIGN_OR_RETURN(std::shared_ptr<KeyValueStore> store, RendezvousStore(options));
  ZINF_ASSIGN_OR_RETURN(const gloo::transport::tcp::attr attr, ListenAttr(options));
  const std::string where = GroupDescription(options, attr);
  std::shared_ptr<gloo::rendezvous::Context> context;
  std::vector<std::string> members(options.world_size);
  // The join as a whole waits at most the timeout. Every rank first says who it is and waits
  // for all the others to have said so: a rank that never came, or stopped, is found here,
  // within the deadline, before gloo connects pairs (whose first connect waits five times the
  // timeout for a peer that published its address and then stopped).
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  auto left = [&deadline] { return TimeLeft(deadline); };
  Result<std::vector<std::string>> joined = ExchangeMembers(store.get(), options, left);
  if (!joined.ok()) return joined.status().WithContext("joining " + where);
  members = std::move(joined).value();
  ZINF_ASSIGN_OR_RETURN(context, ConnectFullMesh(store.get(), options, attr, deadline, where));
  auto group = std::make_shared<Group>();
  group->options = options;
  group->context = std::move(context);
  group->store = std::move(store);
  group->members = std::move(members);
  Group* const group_ptr = group.get();
  auto comm = std::make_unique<GlooComm>(host, std::move(group));
  ZINF_RETURN_IF_ERROR(comm->Barrier().WithContext("joining " + where));
  ReleaseRendezvousStore(*group_ptr, options);
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace zinf
