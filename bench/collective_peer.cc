// See collective_peer.h.
#include "bench/collective_peer.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "bench/bench_util.h"
#include "common/thread_annotations.h"

namespace zinf::bench {

class CollectiveTrace {
 public:
  // Appends a span for a collective about to be issued; its index.
  size_t Add(CollectiveSpan s) {
    MutexLock lock(&mu_);
    s.step = step_;
    spans_.push_back(s);
    return spans_.size() - 1;
  }
  void Stamp(size_t index, bool start) {
    const int64_t now = NowNs();
    MutexLock lock(&mu_);
    (start ? spans_[index].start_ns : spans_[index].end_ns) = now;
  }
  // Left out of the figures (a stamp could not be queued).
  void Untimed(size_t index) {
    MutexLock lock(&mu_);
    spans_[index].step = -1;
  }
  void SetStep(int step) {
    MutexLock lock(&mu_);
    step_ = step;
  }
  std::vector<CollectiveSpan> Spans() const {
    MutexLock lock(&mu_);
    return {spans_.begin(), spans_.end()};
  }
  static int64_t NowNs() {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
  }

 private:
  mutable Mutex mu_;
  std::deque<CollectiveSpan> spans_ GUARDED_BY(mu_);  // a deque: indices stay valid
  int step_ GUARDED_BY(mu_) = -1;
};

std::shared_ptr<CollectiveTrace> NewCollectiveTrace() {
  return std::make_shared<CollectiveTrace>();
}
void SetTraceStep(CollectiveTrace& trace, int step) { trace.SetStep(step); }

namespace {

constexpr int kMaxSplits = 64;  // per communicator, for the sub-groups' ids

class TracingComm final : public Communicator {
 public:
  TracingComm(Communicator* inner, std::unique_ptr<Communicator> owned, Device* device,
              std::shared_ptr<CollectiveTrace> trace, int group, int color)
      : inner_(inner),
        owned_(std::move(owned)),
        device_(device),
        trace_(std::move(trace)),
        group_(group),
        color_(color) {}

  CommCounters Counters() const override { return inner_->Counters(); }
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }

  Status AllGather(const void* send, void* recv, size_t bytes, Stream* s) override {
    return Traced(CollectiveKind::kAllGather, bytes, 0, s,
                  [&] { return inner_->AllGather(send, recv, bytes, s); });
  }
  Status ReduceScatterSum(const float* send, float* recv, size_t count, Stream* s) override {
    return Traced(CollectiveKind::kReduceScatterSum, count, 0, s,
                  [&] { return inner_->ReduceScatterSum(send, recv, count, s); });
  }
  Status AllToAll(const void* send, void* recv, size_t bytes, Stream* s) override {
    return Traced(CollectiveKind::kAllToAll, bytes, 0, s,
                  [&] { return inner_->AllToAll(send, recv, bytes, s); });
  }
  Status AllReduceSum(float* buf, size_t count, Stream* s) override {
    return Traced(CollectiveKind::kAllReduceSum, count, 0, s,
                  [&] { return inner_->AllReduceSum(buf, count, s); });
  }
  Status Broadcast(void* buf, size_t bytes, int root, Stream* s) override {
    return Traced(CollectiveKind::kBroadcast, bytes, root, s,
                  [&] { return inner_->Broadcast(buf, bytes, root, s); });
  }
  Status Barrier() override {
    const size_t i = trace_->Add(Span(CollectiveKind::kBarrier, 0, 0));
    trace_->Stamp(i, true);
    ZINF_RETURN_IF_ERROR(inner_->Barrier());
    trace_->Stamp(i, false);
    return Status::OK();
  }
  Result<std::unique_ptr<Communicator>> Split(int color, Stream* stream) override {
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> sub, inner_->Split(color, stream));
    Communicator* raw = sub.get();
    // The same id on every member: the parent's and the place of this Split among its own.
    const int id = group_ * kMaxSplits + ++splits_;
    return std::unique_ptr<Communicator>(
        new TracingComm(raw, std::move(sub), device_, trace_, id, color));
  }

 private:
  CollectiveSpan Span(CollectiveKind kind, uint64_t size, int root) {
    CollectiveSpan s;
    s.group = group_;
    s.color = color_;
    s.group_rank = inner_->rank();
    s.group_size = inner_->world_size();
    s.seq = seq_++;
    s.kind = kind;
    s.root = root;
    s.size = size;
    return s;
  }

  // Host functions on `stream` around the collective stamp its start and end.
  template <typename Op>
  Status Traced(CollectiveKind kind, uint64_t size, int root, Stream* stream, Op op) {
    if (stream == nullptr) return op();  // the communicator's own error
    const size_t i = trace_->Add(Span(kind, size, root));
    std::shared_ptr<CollectiveTrace> t = trace_;
    // A stamp that cannot be queued leaves the span untimed (it is then left out); the
    // collective itself is issued and reported as without the trace.
    Status stamped = device_->LaunchHostFunc(stream, [t, i] { t->Stamp(i, true); });
    if (!stamped.ok()) trace_->Untimed(i);
    ZINF_RETURN_IF_ERROR(op());
    stamped = device_->LaunchHostFunc(stream, [t, i] { t->Stamp(i, false); });
    if (!stamped.ok()) trace_->Untimed(i);
    return Status::OK();
  }

  Communicator* const inner_;
  const std::unique_ptr<Communicator> owned_;  // a sub-group's (null for the job's)
  Device* const device_;
  const std::shared_ptr<CollectiveTrace> trace_;
  const int group_;
  const int color_;
  uint64_t seq_ = 0;
  int splits_ = 0;
};

using Key = std::tuple<int32_t, int32_t, uint64_t>;  // group, color, seq
Key KeyOf(const CollectiveSpan& s) { return {s.group, s.color, s.seq}; }

std::string SpanFile(const std::string& folder, int rank) {
  return folder + "/bench-collective-spans." + std::to_string(rank);
}

Status WriteSpans(const std::string& path, const std::vector<CollectiveSpan>& spans) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return Status::IoError(path + ": " + std::strerror(errno));
  const size_t n = spans.size();
  const bool ok = std::fwrite(spans.data(), sizeof(CollectiveSpan), n, f) == n;
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed) return Status::IoError(path + ": short write");
  return Status::OK();
}

Result<std::vector<CollectiveSpan>> ReadSpans(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return Status::IoError(path + ": " + std::strerror(errno));
  std::vector<CollectiveSpan> spans;
  CollectiveSpan s;
  while (std::fread(&s, sizeof(s), 1, f) == 1) spans.push_back(s);
  const bool error = std::ferror(f) != 0;
  std::fclose(f);  // read-only: nothing to lose on close
  if (error) return Status::IoError(path + ": read failed");
  return spans;
}

// What this rank sends in `s`, as GlooComm counts it (CommCounters::bytes_sent).
uint64_t SentBytes(const CollectiveSpan& s) {
  const uint64_t n = static_cast<uint64_t>(s.group_size);
  switch (s.kind) {
    case CollectiveKind::kAllGather:
    case CollectiveKind::kAllToAll:
      return s.size * (n - 1);
    case CollectiveKind::kReduceScatterSum:
      return s.size * sizeof(float) * (n - 1);
    case CollectiveKind::kAllReduceSum:
      return 2 * ((s.size + n - 1) / n) * sizeof(float) * (n - 1);
    case CollectiveKind::kBroadcast:
      return s.group_rank == s.root ? s.size * (n - 1) : 0;
    case CollectiveKind::kBarrier:
      return 0;
  }
  return 0;
}

// The union's length of [from, to) intervals.
double UnionSeconds(std::vector<std::pair<int64_t, int64_t>> v) {
  std::sort(v.begin(), v.end());
  int64_t total = 0, lo = 0, hi = 0;
  bool open = false;
  for (const auto& [a, b] : v) {
    if (b <= a) continue;
    if (open && a <= hi) {
      hi = std::max(hi, b);
      continue;
    }
    if (open) total += hi - lo;
    lo = a;
    hi = b;
    open = true;
  }
  if (open) total += hi - lo;
  return static_cast<double>(total) / 1e9;
}

// gloo contexts for the replay: the job's and one per (group, color) this rank replays in,
// connected in increasing group order (each only among its members, so no rank waits on a
// connection its peers make later).
class PeerContexts {
 public:
  Status Connect(const std::string& folder, int rank, int world,
                 const std::vector<CollectiveSpan>& ops) {
    try {
      gloo::transport::tcp::attr attr;
      attr.hostname = "127.0.0.1";
      device_ = gloo::transport::tcp::CreateDevice(attr);
      gloo::rendezvous::FileStore base(folder);
      std::map<std::pair<int32_t, int32_t>, std::pair<int, int>> groups;  // -> rank, size
      groups[{0, 0}] = {rank, world};
      for (const CollectiveSpan& s : ops) groups[{s.group, s.color}] = {s.group_rank, s.group_size};
      for (const auto& [g, rs] : groups) {
        gloo::rendezvous::PrefixStore store(
            "bench-peer-" + std::to_string(g.first) + "-" + std::to_string(g.second), base);
        auto ctx = std::make_shared<gloo::rendezvous::Context>(rs.first, rs.second);
        ctx->connectFullMesh(store, device_);
        contexts_[g] = ctx;
      }
    } catch (const std::exception& e) {
      return Status::Internal(std::string("gloo peer: connecting: ") + e.what());
    }
    return Status::OK();
  }
  const std::shared_ptr<gloo::Context>& Get(const CollectiveSpan& s) {
    return contexts_.at({s.group, s.color});
  }
  const std::shared_ptr<gloo::Context>& Job() { return contexts_.at({0, 0}); }

 private:
  std::shared_ptr<gloo::transport::Device> device_;
  std::map<std::pair<int32_t, int32_t>, std::shared_ptr<gloo::Context>> contexts_;
};

// One collective, gloo alone, on `buf` (large enough for any of the step's).
void ReplayOne(const CollectiveSpan& s, const std::shared_ptr<gloo::Context>& ctx, uint32_t tag,
               char* buf, char* out) {
  const size_t n = static_cast<size_t>(s.group_size);
  switch (s.kind) {
    case CollectiveKind::kAllGather: {
      gloo::AllgatherOptions o(ctx);  // in place: this rank's block is already there
      o.setOutput(buf, s.size * n);
      o.setTag(tag);
      gloo::allgather(o);
      return;
    }
    case CollectiveKind::kAllToAll: {
      gloo::AlltoallOptions o(ctx);
      o.setInput(buf, s.size * n);
      o.setOutput(out, s.size * n);
      o.setTag(tag);
      gloo::alltoall(o);
      return;
    }
    case CollectiveKind::kReduceScatterSum: {
      // gloo's alltoall, then the sum of the received chunks. (gloo's own reduce-scatter,
      // ReduceScatterHalvingDoubling, took 150 ms per 16 MB here: no peer to measure against.)
      gloo::AlltoallOptions o(ctx);
      o.setInput(reinterpret_cast<float*>(buf), s.size * n);
      o.setOutput(reinterpret_cast<float*>(out), s.size * n);
      o.setTag(tag);
      gloo::alltoall(o);
      float* sum = reinterpret_cast<float*>(buf);
      const float* parts = reinterpret_cast<const float*>(out);
      std::memcpy(sum, parts, s.size * sizeof(float));
      for (size_t r = 1; r < n; ++r) {
        for (size_t i = 0; i < s.size; ++i) sum[i] += parts[r * s.size + i];
      }
      return;
    }
    case CollectiveKind::kAllReduceSum: {
      gloo::AllreduceOptions o(ctx);
      o.setOutput(reinterpret_cast<float*>(buf), s.size);
      o.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      o.setTag(tag);
      gloo::allreduce(o);
      return;
    }
    case CollectiveKind::kBroadcast: {
      gloo::BroadcastOptions o(ctx);
      o.setOutput(buf, s.size);
      o.setRoot(s.root);
      o.setTag(tag);
      gloo::broadcast(o);
      return;
    }
    case CollectiveKind::kBarrier: {
      gloo::BarrierOptions o(ctx);
      o.setTag(tag);
      gloo::barrier(o);
      return;
    }
  }
}

uint64_t BufferBytes(const CollectiveSpan& s) {
  const bool floats =
      s.kind == CollectiveKind::kReduceScatterSum || s.kind == CollectiveKind::kAllReduceSum;
  return s.size * (floats ? sizeof(float) : 1) * static_cast<uint64_t>(s.group_size);
}

constexpr int kReplays = 7;

// The median of kReplays timed replays of `ops` (in order), each after a barrier of the job.
Result<double> Replay(PeerContexts& peers, const std::vector<CollectiveSpan>& ops) {
  uint64_t most = 64;
  for (const CollectiveSpan& s : ops) most = std::max(most, BufferBytes(s));
  std::vector<char> buf(most, 0), out(most, 0);  // zeros: finite sums
  std::map<std::pair<int32_t, int32_t>, uint32_t> tags;
  std::vector<double> secs;
  try {
    for (int rep = 0; rep < kReplays; ++rep) {
      gloo::BarrierOptions b(peers.Job());
      b.setTag(tags[{0, 0}]++);
      gloo::barrier(b);
      const int64_t t0 = CollectiveTrace::NowNs();
      for (const CollectiveSpan& s : ops) {
        ReplayOne(s, peers.Get(s), tags[{s.group, s.color}]++, buf.data(), out.data());
      }
      secs.push_back(static_cast<double>(CollectiveTrace::NowNs() - t0) / 1e9);
    }
  } catch (const std::exception& e) {
    return Status::Internal(std::string("gloo peer: replaying: ") + e.what());
  }
  return Median(secs);
}

}  // namespace

std::unique_ptr<Communicator> TraceCollectives(Communicator* inner, Device* device,
                                               std::shared_ptr<CollectiveTrace> trace) {
  return std::make_unique<TracingComm>(inner, nullptr, device, std::move(trace), 0, 0);
}

Result<CollectiveFigures> CompareWithGloo(const CollectiveTrace& trace, Communicator* comm,
                                          int first_step, int last_step) {
  const char* folder = std::getenv("ZINF_STORE_FOLDER");
  if (folder == nullptr) {
    return Status::NotSupported("the gloo peer needs the --nproc launcher's store folder");
  }
  const int rank = comm->rank(), world = comm->world_size();
  const std::vector<CollectiveSpan> mine = trace.Spans();
  ZINF_RETURN_IF_ERROR(WriteSpans(SpanFile(folder, rank), mine));
  ZINF_RETURN_IF_ERROR(comm->Barrier());
  // Every collective's last arrival, over the ranks that ran it.
  std::map<Key, int64_t> last;
  for (int r = 0; r < world; ++r) {
    ZINF_ASSIGN_OR_RETURN(std::vector<CollectiveSpan> theirs, ReadSpans(SpanFile(folder, r)));
    for (const CollectiveSpan& s : theirs) {
      int64_t& t = last[KeyOf(s)];
      t = std::max(t, s.start_ns);
    }
  }
  CollectiveFigures fig;
  std::vector<double> with_waits, own, sent;
  for (int step = first_step; step <= last_step; ++step) {
    std::vector<std::pair<int64_t, int64_t>> from_mine, from_last;
    double bytes = 0;
    for (const CollectiveSpan& s : mine) {
      if (s.step != step || s.end_ns == 0) continue;
      bytes += static_cast<double>(SentBytes(s));
      from_mine.emplace_back(s.start_ns, s.end_ns);
      from_last.emplace_back(last[KeyOf(s)], s.end_ns);
    }
    with_waits.push_back(UnionSeconds(from_mine));
    own.push_back(UnionSeconds(from_last));
    sent.push_back(bytes);
  }
  fig.bytes_per_step = Median(sent);
  fig.engine_seconds_with_waits = Median(with_waits);
  fig.engine_seconds = Median(own);
  // The replay: last_step's collectives in the order of their last arrivals (the same order
  // on every rank of a group).
  std::vector<CollectiveSpan> ops;
  for (const CollectiveSpan& s : mine) {
    if (s.step == last_step && s.kind != CollectiveKind::kBarrier) ops.push_back(s);
  }
  std::sort(ops.begin(), ops.end(), [&](const CollectiveSpan& a, const CollectiveSpan& b) {
    return std::make_pair(last[KeyOf(a)], KeyOf(a)) < std::make_pair(last[KeyOf(b)], KeyOf(b));
  });
  fig.collectives_per_step = ops.size();
  PeerContexts peers;
  ZINF_RETURN_IF_ERROR(peers.Connect(folder, rank, world, ops));
  ZINF_ASSIGN_OR_RETURN(fig.peer_seconds, Replay(peers, ops));
  return fig;
}

}  // namespace zinf::bench
