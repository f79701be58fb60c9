#include "device/host/local_comm.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <utility>

#include "common/thread_annotations.h"
#include "device/host/host_device.h"

namespace zinf {
namespace {

enum class CollectiveKind {
  kAllGather,
  kReduceScatterSum,
  kAllReduceSum,
  kBroadcast,
  kBarrier,
  kAllToAll
};

const char* KindName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather:
      return "AllGather";
    case CollectiveKind::kReduceScatterSum:
      return "ReduceScatterSum";
    case CollectiveKind::kAllReduceSum:
      return "AllReduceSum";
    case CollectiveKind::kBroadcast:
      return "Broadcast";
    case CollectiveKind::kBarrier:
      return "Barrier";
    case CollectiveKind::kAllToAll:
      return "AllToAll";
  }
  return "?";
}

// What a rank called; every rank must make the same call under one sequence number.
struct Call {
  CollectiveKind kind = CollectiveKind::kBarrier;
  size_t size = 0;  // bytes_per_rank, count_per_rank, count or bytes, by kind
  int root = -1;    // Broadcast only

  bool operator==(const Call& o) const {
    return kind == o.kind && size == o.size && root == o.root;
  }
  std::string ToString() const {
    std::string s = KindName(kind);
    switch (kind) {
      case CollectiveKind::kAllGather:
      case CollectiveKind::kAllToAll:
        s += " of " + std::to_string(size) + " bytes per rank";
        break;
      case CollectiveKind::kReduceScatterSum:
        s += " of " + std::to_string(size) + " floats per rank";
        break;
      case CollectiveKind::kAllReduceSum:
        s += " of " + std::to_string(size) + " floats";
        break;
      case CollectiveKind::kBroadcast:
        s += " of " + std::to_string(size) + " bytes from root " + std::to_string(root);
        break;
      case CollectiveKind::kBarrier:
        break;
    }
    return s;
  }
};

// One rank's buffers for a collective.
struct Posted {
  const void* send = nullptr;
  void* recv = nullptr;
};

// A step of a collective: runs between two barriers, with every rank's buffers visible.
using Step = std::function<void(int step, const std::vector<Posted>& all)>;

// The rendezvous point of the ranks. Thread-safe.
class Hub {
 public:
  Hub(int world_size, std::chrono::milliseconds timeout)
      : world_size_(world_size), timeout_(timeout) {}

  int world_size() const { return world_size_; }

  // Runs collective number `seq` for `rank`: posts `posted`, waits for every rank, then
  // runs step(0, all), barrier, step(1, all), barrier, ... for `steps` steps.
  Status Run(uint64_t seq, int rank, const Call& call, Posted posted, int steps, const Step& step) {
    Slot* slot = nullptr;
    Status s = Join(seq, rank, call, posted, &slot);
    for (int i = 0; s.ok() && i < steps; ++i) {
      step(i, slot->posted);  // read-only after the join barrier: no lock needed
      s = Barrier(seq, rank, *slot, i + 1);
    }
    if (slot != nullptr) Leave(seq, *slot);
    return s;
  }

  // The hub of the sub-group `color` made by the Split whose color exchange was collective
  // `seq`: the first member to ask makes it, the last (of `members`) takes it out of the map.
  std::shared_ptr<Hub> SubHub(uint64_t seq, int color, int members) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    SubHubEntry& e = sub_hubs_[{seq, color}];
    if (e.hub == nullptr) e.hub = std::make_shared<Hub>(members, timeout_);
    std::shared_ptr<Hub> hub = e.hub;
    if (++e.taken == members) sub_hubs_.erase({seq, color});
    return hub;
  }

  // Called instead of Run by a rank that rejected its arguments: collective `seq` fails on
  // every rank at once (instead of the peers timing out), and the group stays usable.
  void Abandon(uint64_t seq, int rank, const Call& call, const Status& why) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (!broken_.ok()) return;
    Slot& slot = GetSlot(seq, call, rank);
    slot.abandoned = Status::FailedPrecondition(
        "LocalComm: " + call.ToString() + " #" + std::to_string(seq) + " was abandoned by rank " +
        std::to_string(rank) + ", which rejected its arguments: " + why.ToString());
    cv_.NotifyAll();
    LeaveLocked(seq, slot);
  }

 private:
  struct Slot {
    Call call;
    int first_rank = 0;  // the rank whose call created the slot
    std::vector<Posted> posted;
    std::vector<int> reached;  // per rank: how many rendezvous points it has reached
    int arrived = 0;           // ranks at the current rendezvous point
    int completed = 0;         // rendezvous points every rank has passed
    int left = 0;              // ranks done with the slot
    Status abandoned;
  };

  Slot& GetSlot(uint64_t seq, const Call& call, int rank) REQUIRES(mu_) {
    auto [it, inserted] = slots_.try_emplace(seq);
    Slot& slot = it->second;
    if (inserted) {
      slot.call = call;
      slot.first_rank = rank;
      slot.posted.resize(world_size_);
      slot.reached.assign(world_size_, 0);
    }
    return slot;
  }

  Status Join(uint64_t seq, int rank, const Call& call, Posted posted, Slot** out) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (!broken_.ok()) return broken_;
    // std::map nodes do not move: the pointer stays valid until the slot is erased, which
    // waits for this rank's Leave.
    Slot& slot = GetSlot(seq, call, rank);
    *out = &slot;
    // Checked before the match: the abandoning rank's call may differ (a bad root).
    if (!slot.abandoned.ok()) return slot.abandoned;
    if (!(slot.call == call)) {
      broken_ = Status::FailedPrecondition(
          "LocalComm: collective #" + std::to_string(seq) + " mismatch: rank " +
          std::to_string(slot.first_rank) + " issued " + slot.call.ToString() + ", rank " +
          std::to_string(rank) + " issued " + call.ToString() +
          "; every rank must issue the same collectives in the same order. The group is "
          "unusable.");
      cv_.NotifyAll();
      return broken_;
    }
    slot.posted[rank] = posted;
    return Rendezvous(seq, rank, slot, 0);
  }

  Status Barrier(uint64_t seq, int rank, Slot& slot, int point) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return Rendezvous(seq, rank, slot, point);
  }

  // A generation-counted barrier: waits until every rank has reached rendezvous point
  // `point` of the slot, the slot is abandoned, the group breaks, or the timeout expires
  // (which breaks the group).
  Status Rendezvous(uint64_t seq, int rank, Slot& slot, int point) REQUIRES(mu_) {
    if (!broken_.ok()) return broken_;
    if (!slot.abandoned.ok()) return slot.abandoned;
    slot.reached[rank] = point + 1;
    if (++slot.arrived == world_size_) {
      slot.arrived = 0;
      slot.completed = point + 1;
      cv_.NotifyAll();
      return Status::OK();
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      if (slot.completed > point) return Status::OK();
      if (!broken_.ok()) return broken_;
      if (!slot.abandoned.ok()) return slot.abandoned;
      if (!cv_.WaitUntil(&mu_, deadline) && slot.completed <= point && broken_.ok() &&
          slot.abandoned.ok()) {
        broken_ = TimeoutStatus(seq, rank, slot, point);
        cv_.NotifyAll();
        return broken_;
      }
    }
  }

  Status TimeoutStatus(uint64_t seq, int rank, const Slot& slot, int point) const {
    std::string missing;
    for (int r = 0; r < world_size_; ++r) {
      if (slot.reached[r] > point) continue;
      if (!missing.empty()) missing += ", ";
      missing += std::to_string(r);
    }
    char seconds[32];
    std::snprintf(seconds, sizeof(seconds), "%.3g",
                  std::chrono::duration<double>(timeout_).count());
    return Status::FailedPrecondition(
        "LocalComm: " + slot.call.ToString() + " #" + std::to_string(seq) + " timed out after " +
        seconds + " s on rank " + std::to_string(rank) + " (world size " +
        std::to_string(world_size_) + ", rendezvous point " + std::to_string(point) +
        ") waiting for rank(s) " + missing +
        "; a rank stopped issuing collectives or issued them in a different order. The group "
        "is unusable.");
  }

  void Leave(uint64_t seq, Slot& slot) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    LeaveLocked(seq, slot);
  }
  void LeaveLocked(uint64_t seq, Slot& slot) REQUIRES(mu_) {
    // After a failure some ranks never come: the slot stays until the hub goes, which is
    // harmless since a failed group is not used further (or, when abandoned, only leaks
    // while a rank that never arrives is missing).
    if (++slot.left == world_size_) slots_.erase(seq);
  }

  struct SubHubEntry {
    std::shared_ptr<Hub> hub;
    int taken = 0;
  };

  const int world_size_;
  const std::chrono::milliseconds timeout_;
  Mutex mu_;
  // One condition variable for every slot: collectives in flight at once are few, and a
  // spurious wake-up only re-checks a predicate.
  CondVar cv_;
  std::map<uint64_t, Slot> slots_ GUARDED_BY(mu_);  // collectives some rank has joined
  Status broken_ GUARDED_BY(mu_);                   // once set, every collective fails with it
  // Sub-groups being made: (the Split's sequence number, color) -> their hub.
  std::map<std::pair<uint64_t, int>, SubHubEntry> sub_hubs_ GUARDED_BY(mu_);
};

// out[i] = ((in[0][i] + in[1][i]) + in[2][i]) + ... in float, for i < n. Works through a
// small block on the stack, so `out` may alias one of the inputs exactly.
void OrderedSum(const std::vector<const float*>& in, float* out, size_t n) {
  constexpr size_t kBlock = 1024;
  float acc[kBlock];
  for (size_t begin = 0; begin < n; begin += kBlock) {
    const size_t len = std::min(kBlock, n - begin);
    std::memcpy(acc, in[0] + begin, len * sizeof(float));
    for (size_t r = 1; r < in.size(); ++r) {
      const float* src = in[r] + begin;
      for (size_t i = 0; i < len; ++i) acc[i] += src[i];
    }
    std::memcpy(out + begin, acc, len * sizeof(float));
  }
}

// Rank r's share of an n-element AllReduce: [ChunkBegin(r), ChunkBegin(r + 1)).
size_t ChunkBegin(size_t n, int rank, int world_size) {
  return static_cast<size_t>((static_cast<unsigned __int128>(n) * rank) / world_size);
}

class LocalComm final : public Communicator {
 public:
  LocalComm(std::shared_ptr<Hub> hub, int rank, HostDevice* device)
      : hub_(std::move(hub)), rank_(rank), device_(device) {}

  int rank() const override { return rank_; }
  int world_size() const override { return hub_->world_size(); }

  Status AllGather(const void* send, void* recv, size_t bytes_per_rank, Stream* stream) override {
    const Call call{CollectiveKind::kAllGather, bytes_per_rank, -1};
    Status args = CheckBuffers(call, bytes_per_rank > 0, send != nullptr, recv != nullptr);
    const int n = world_size();
    auto* out = static_cast<unsigned char*>(recv);
    return Issue(stream, call, args, Posted{send, recv}, /*steps=*/1,
                 [out, bytes_per_rank, n](int, const std::vector<Posted>& all) {
                   if (bytes_per_rank == 0) return;  // the pointers may be null
                   for (int r = 0; r < n; ++r) {
                     unsigned char* dst = out + r * bytes_per_rank;
                     // In place (send == recv + rank * bytes_per_rank): already there.
                     if (dst != all[r].send) std::memcpy(dst, all[r].send, bytes_per_rank);
                   }
                 });
  }

  Status AllToAll(const void* send, void* recv, size_t bytes_per_rank, Stream* stream) override {
    const Call call{CollectiveKind::kAllToAll, bytes_per_rank, -1};
    Status args = CheckBuffers(call, bytes_per_rank > 0, send != nullptr, recv != nullptr);
    const int rank = rank_;
    auto* out = static_cast<unsigned char*>(recv);
    return Issue(stream, call, args, Posted{send, recv}, /*steps=*/1,
                 [out, bytes_per_rank, rank](int, const std::vector<Posted>& all) {
                   if (bytes_per_rank == 0) return;  // the pointers may be null
                   for (size_t r = 0; r < all.size(); ++r) {
                     const auto* from = static_cast<const unsigned char*>(all[r].send);
                     std::memcpy(out + r * bytes_per_rank, from + rank * bytes_per_rank,
                                 bytes_per_rank);
                   }
                 });
  }

  Status ReduceScatterSum(const float* send, float* recv, size_t count_per_rank,
                          Stream* stream) override {
    const Call call{CollectiveKind::kReduceScatterSum, count_per_rank, -1};
    Status args = CheckBuffers(call, count_per_rank > 0, send != nullptr, recv != nullptr);
    const int rank = rank_;
    return Issue(stream, call, args, Posted{send, recv}, /*steps=*/1,
                 [recv, count_per_rank, rank](int, const std::vector<Posted>& all) {
                   std::vector<const float*> in;
                   in.reserve(all.size());
                   for (const Posted& p : all) {
                     in.push_back(static_cast<const float*>(p.send) + rank * count_per_rank);
                   }
                   OrderedSum(in, recv, count_per_rank);
                 });
  }

  Status AllReduceSum(float* buf, size_t count, Stream* stream) override {
    const Call call{CollectiveKind::kAllReduceSum, count, -1};
    Status args = CheckBuffers(call, count > 0, buf != nullptr, buf != nullptr);
    const int rank = rank_;
    const int n = world_size();
    // Step 0: each rank sums its own chunk of every rank's buffer into its own buffer (no one
    // else reads that chunk of it). Step 1: each rank copies the other chunks from their
    // owners. The barrier after step 1 keeps every buffer until all have copied.
    return Issue(stream, call, args, Posted{buf, buf}, /*steps=*/2,
                 [buf, count, rank, n](int step, const std::vector<Posted>& all) {
                   if (step == 0) {
                     const size_t begin = ChunkBegin(count, rank, n);
                     const size_t len = ChunkBegin(count, rank + 1, n) - begin;
                     std::vector<const float*> in;
                     in.reserve(all.size());
                     for (const Posted& p : all) in.push_back(static_cast<float*>(p.recv) + begin);
                     OrderedSum(in, buf + begin, len);
                     return;
                   }
                   for (int r = 0; r < n; ++r) {
                     const size_t begin = ChunkBegin(count, r, n);
                     const size_t len = ChunkBegin(count, r + 1, n) - begin;
                     if (r == rank || len == 0) continue;
                     std::memcpy(buf + begin, static_cast<const float*>(all[r].recv) + begin,
                                 len * sizeof(float));
                   }
                 });
  }

  Status Broadcast(void* buf, size_t bytes, int root, Stream* stream) override {
    const Call call{CollectiveKind::kBroadcast, bytes, root};
    Status args = CheckBuffers(call, bytes > 0, buf != nullptr, buf != nullptr);
    if (args.ok() && (root < 0 || root >= world_size())) {
      args = Status::InvalidArgument("LocalComm rank " + std::to_string(rank_) + ": " +
                                     call.ToString() + ": root is not a rank of a world of " +
                                     std::to_string(world_size()));
    }
    const int rank = rank_;
    return Issue(stream, call, args, Posted{buf, buf}, /*steps=*/1,
                 [buf, bytes, root, rank](int, const std::vector<Posted>& all) {
                   if (rank != root && bytes > 0) std::memcpy(buf, all[root].recv, bytes);
                 });
  }

  Status Barrier() override {
    const uint64_t seq = next_seq_++;
    return hub_->Run(seq, rank_, Call{}, Posted{}, /*steps=*/0, nullptr);
  }

  // The colors go round with an AllGather; each sub-group gets a hub of its own, found in
  // this hub under the AllGather's sequence number.
  Result<std::unique_ptr<Communicator>> Split(int color, Stream* stream) override {
    const int n = world_size();
    std::vector<int32_t> colors(n);
    const int32_t mine = color;
    const uint64_t seq = next_seq_;  // the AllGather's
    ZINF_RETURN_IF_ERROR(AllGather(&mine, colors.data(), sizeof(mine), stream));
    ZINF_RETURN_IF_ERROR(device_->SynchronizeStream(stream));
    ZINF_ASSIGN_OR_RETURN(std::vector<int> members,
                          SplitMembers(colors, rank_, "LocalComm rank " + std::to_string(rank_)));
    const int index =
        static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    std::shared_ptr<Hub> sub = hub_->SubHub(seq, color, static_cast<int>(members.size()));
    return std::unique_ptr<Communicator>(std::make_unique<LocalComm>(sub, index, device_));
  }

 private:
  Status CheckBuffers(const Call& call, bool nonempty, bool send_ok, bool recv_ok) const {
    if (!nonempty || (send_ok && recv_ok)) return Status::OK();
    return Status::InvalidArgument("LocalComm rank " + std::to_string(rank_) + ": " +
                                   call.ToString() + ": " +
                                   (send_ok ? "receive buffer" : "send buffer") + " is null");
  }

  // Takes the next sequence number and queues the collective on `stream`, or, when the
  // arguments (or the stream) are rejected, abandons that sequence number so that the peers
  // fail fast and stay in step.
  Status Issue(Stream* stream, const Call& call, Status args, Posted posted, int steps, Step step) {
    const uint64_t seq = next_seq_++;
    if (args.ok() && stream == nullptr) {
      args = Status::InvalidArgument("LocalComm rank " + std::to_string(rank_) + ": " +
                                     call.ToString() + ": stream is null");
    }
    if (!args.ok()) {
      hub_->Abandon(seq, rank_, call, args);
      return args;
    }
    auto started = std::make_shared<std::atomic<bool>>(false);
    Status s = device_->LaunchHostTask(stream, [hub = hub_, seq, rank = rank_, call, posted, steps,
                                                step = std::move(step), started] {
      started->store(true);
      return hub->Run(seq, rank, call, posted, steps, step);
    });
    // An error before the task started is a rejected stream: abandon, as for bad arguments.
    if (!s.ok() && !started->load()) hub_->Abandon(seq, rank_, call, s);
    return s;
  }

  const std::shared_ptr<Hub> hub_;
  const int rank_;
  HostDevice* const device_;
  // Touched only by the rank's issuing thread (one thread at a time, per the contract).
  uint64_t next_seq_ = 0;
};

}  // namespace

Result<std::vector<std::unique_ptr<Communicator>>> NewLocalComms(
    const std::vector<Device*>& devices, const LocalCommOptions& options) {
  if (devices.empty()) return Status::InvalidArgument("NewLocalComms: no devices (world size 0)");
  if (options.timeout.count() <= 0) {
    return Status::InvalidArgument("NewLocalComms: the timeout must be positive");
  }
  std::vector<HostDevice*> host_devices;
  for (size_t r = 0; r < devices.size(); ++r) {
    auto* hd = dynamic_cast<HostDevice*>(devices[r]);
    if (hd == nullptr) {
      return Status::InvalidArgument(
          "NewLocalComms: devices[" + std::to_string(r) + "] " +
          (devices[r] == nullptr ? std::string("is null")
                                 : "('" + devices[r]->Name() + "') is not a HostDevice") +
          "; LocalComm runs collectives as HostDevice stream tasks on host memory");
    }
    host_devices.push_back(hd);
  }
  auto hub = std::make_shared<Hub>(static_cast<int>(devices.size()), options.timeout);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (size_t r = 0; r < devices.size(); ++r) {
    comms.push_back(std::make_unique<LocalComm>(hub, static_cast<int>(r), host_devices[r]));
  }
  return comms;
}

Result<std::vector<std::unique_ptr<Communicator>>> NewLocalComms(
    const std::vector<Device*>& devices) {
  return NewLocalComms(devices, LocalCommOptions{});
}

}  // namespace zinf
