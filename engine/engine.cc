// The engine: placement, fetch and prefetch, the gradient path and the optimizer pipeline.
//
// Threads and what they own:
// - the trainer's thread calls every public method; it alone decides which fetches and
//   collectives are issued, in program order, so all ranks issue them in the same order;
// - the device's streams (copy, comm, update) run copies, collectives and host callbacks;
// - the optimizer thread steps sub-groups as their gradients complete and writes results back;
// - the swap store's I/O thread.
// `mu_` guards the state shared with callbacks and the optimizer thread (marked below).
#include "zinf/engine.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>
#include <unordered_map>

#include "common/file_io.h"
#include "common/folder_lock.h"
#include "common/utf8.h"
#include "engine/checkpoint_folder.h"
#include "engine/checkpoint_format.h"
#include "zinf/cpu_adam.h"
#include "zinf/crash_point.h"
#include "zinf/io.h"
#include "zinf/log.h"
#include "zinf/swap.h"

namespace zinf {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Partition slices start at multiples of this many elements inside optimizer buffers, so that
// both their fp32 and bf16 images are 4 KiB aligned for direct I/O.
constexpr size_t kSliceAlign = 2048;
// Partitions are padded to a multiple of this many elements per rank.
constexpr size_t kPartitionAlign = 16;

size_t RoundUpSize(size_t n, size_t a) { return (n + a - 1) / a * a; }

// ---- Checkpoint file helpers ----

// A 4 KiB-aligned heap buffer (direct I/O through the swap store needs the alignment).
struct AlignedBuffer {
  void* data = nullptr;
  size_t bytes = 0;
  explicit AlignedBuffer(size_t n) : bytes(RoundUpSize(std::max<size_t>(n, 1), 4096)) {
    data = std::aligned_alloc(4096, bytes);
  }
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
};

const char* OptimizerTypeName(OptimizerType t) {
  switch (t) {
    case OptimizerType::kAdam:
      return "adam";
    case OptimizerType::kAdamW:
      return "adamw";
    case OptimizerType::kAdagrad:
      return "adagrad";
    case OptimizerType::kLion:
      return "lion";
  }
  return "?";
}

// Host memory for optimizer states on the CPU tier: page aligned, huge pages when possible.
struct HostArray {
  float* data = nullptr;
  size_t bytes = 0;
  HostArray() = default;
  HostArray(HostArray&& o) noexcept : data(o.data), bytes(o.bytes) { o.data = nullptr; }
  HostArray& operator=(HostArray&&) = delete;
  HostArray(const HostArray&) = delete;
  HostArray& operator=(const HostArray&) = delete;
  ~HostArray() {
    if (data != nullptr) munmap(data, bytes);
  }
  Status Allocate(size_t count, const std::string& what) {
    bytes = RoundUpSize(std::max<size_t>(count, 1) * sizeof(float), 4096);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      data = nullptr;
      return ErrnoToStatus(errno,
                           "allocating " + FormatBytes(bytes) + " of host memory for " + what);
    }
    madvise(p, bytes, MADV_HUGEPAGE);
    data = static_cast<float*>(p);
    return Status::OK();
  }
};

class BlockPool;

// A block of a BlockPool; returns itself on destruction. Move-only, like PinnedBuffer.
class PooledBlock {
 public:
  PooledBlock() = default;
  PooledBlock(BlockPool* pool, void* data, size_t capacity)
      : pool_(pool), data_(data), capacity_(capacity) {}
  ~PooledBlock() { Reset(); }
  PooledBlock(PooledBlock&& o) noexcept { *this = std::move(o); }
  PooledBlock& operator=(PooledBlock&& o) noexcept {
    if (this != &o) {
      Reset();
      std::swap(pool_, o.pool_);
      std::swap(data_, o.data_);
      std::swap(capacity_, o.capacity_);
    }
    return *this;
  }
  PooledBlock(const PooledBlock&) = delete;
  PooledBlock& operator=(const PooledBlock&) = delete;
  void* data() const { return data_; }
  size_t capacity() const { return capacity_; }
  inline void Reset();

 private:
  BlockPool* pool_ = nullptr;
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

// Fixed-size blocks carved from one pinned range taken at placement, for the engine's large
// buffers of one size (optimizer state buffers, their bf16 copies, streaming gradient
// accumulators). They never come from the arena's remainder, so the variable-size staging
// there cannot fragment them: a block is free or taken, never "there but not contiguous".
// Thread-safe.
class BlockPool {
 public:
  Status Init(PinnedArena* arena, size_t block_bytes, size_t count, const std::string& what) {
    block_bytes_ = RoundUpSize(std::max<size_t>(block_bytes, 1), 4096);
    count = std::max<size_t>(count, 1);
    ZINF_ASSIGN_OR_RETURN(region_, arena->Allocate(block_bytes_ * count));
    char* base = static_cast<char*>(region_.data());
    for (size_t i = count; i-- > 0;) free_.push_back(base + i * block_bytes_);
    what_ = what;
    return Status::OK();
  }
  bool initialized() const { return region_.data() != nullptr; }
  // A free block, or an empty one when every block is taken.
  PooledBlock TryTake() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) return PooledBlock();
    void* p = free_.back();
    free_.pop_back();
    return PooledBlock(this, p, block_bytes_);
  }
  // REQUIRES: the caller never holds more blocks than the pool has (checked: Internal).
  Result<PooledBlock> Take() {
    PooledBlock b = TryTake();
    if (b.data() == nullptr) {
      return Status::Internal("the pool of " + what_ +
                              " is exhausted (a bug: more taken than "
                              "planned)");
    }
    return b;
  }
  void Give(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(p);
  }
  size_t block_bytes() const { return block_bytes_; }
  size_t free_blocks() const {
    std::lock_guard<std::mutex> lock(mu_);
    return free_.size();
  }

 private:
  PinnedBuffer region_;
  size_t block_bytes_ = 0;
  std::string what_;
  mutable std::mutex mu_;
  std::vector<void*> free_;  // guarded by mu_
};

void PooledBlock::Reset() {
  if (pool_ != nullptr) pool_->Give(data_);
  pool_ = nullptr;
  data_ = nullptr;
  capacity_ = 0;
}

}  // namespace

struct Engine::Impl {
  enum class FetchState { kAbsent, kFetching, kResident };

  struct Param {
    ParamInfo info;
    std::function<void(float*, size_t)> init;
    size_t padded_numel = 0;  // partition_numel * world
    // This rank's partition in the parameter store (storage dtype). With the delayed update
    // the store has two buffers: version v of the parameters lives in buffer v % 2 (see
    // Impl::Buf), so the optimizer writes step s's parameters while the trainer reads s - 1's.
    void* device_part[2] = {nullptr, nullptr};  // Tier::kDevice
    PinnedBuffer host_part[2];                  // Tier::kCpu
    std::string swap_key[2];                    // Tier::kNvme
    // Device cache of the full parameter.
    void* device_full = nullptr;
    bool aliased = false;  // device_full is device_part (one rank, device tier)
    FetchState state = FetchState::kAbsent;
    std::unique_ptr<Event> ready;
    // The version whose fetch was issued into device_full (kNotFetched while it holds none:
    // Acquire takes the buffer for the parameter's value only when this matches).
    uint64_t fetched_version = kNotFetched;
    int acquired = 0;
    Status fetch_status;  // guarded by mu_: set by the fetch's stream callback
    bool grad_reduced_this_micro = false;
    bool grad_seen_this_window = false;
    size_t slice_offset = 0;    // element offset inside its sub-group's state arrays
    size_t index_in_group = 0;  // position in its sub-group's `params`
    // Optimizer updates applied so far (torch's state["step"]): the optimizer thread changes it
    // while it steps the sub-group; others read it between optimizer steps.
    int64_t updates = 0;
  };

  struct SubGroup {
    std::vector<ParamId> params;
    size_t numel = 0;  // state elements (slices aligned)
    // Tier::kCpu / kDevice states: three arrays of `numel` floats.
    HostArray master;  // [master | exp_avg | exp_avg_sq], one mapping
    // Kept on the device (offload_optimizer.device none, or beyond offload_optimizer.ratio):
    // device_states holds [master|m|v] in device memory.
    bool on_device = false;
    float* device_states = nullptr;
    std::string swap_key;  // Tier::kNvme: [master|m|v] in one tensor
    int pending = 0;       // guarded by mu: trainable params whose grad has not landed
    int trainable = 0;     // its trainable parameters
    // Guarded by mu: per parameter of the group (index_in_group), whether it got a gradient in
    // the window being accumulated. Set by ReduceGradient; taken (and cleared) by the optimizer
    // when it steps the group, before the next window's gradients may come in.
    std::vector<uint8_t> has_grad;
    // Guarded by mu: the optimizer step whose gradients are complete in the accumulators, and
    // the last step the optimizer has finished with this sub-group (its accumulators are free
    // for the next window's gradients from then on).
    int64_t ready_step = 0;
    int64_t stepped_step = 0;
    // Gradient accumulators of the group's partitions (pinned fp32, sliced like the states):
    // `grad_data`. Streaming mode takes a block of grad_pool at the group's first gradient of a
    // window (`grad_block`) and gives it back once the group is stepped; otherwise `grads` is
    // allocated at placement and lives as long as the engine.
    PinnedBuffer grads;
    PooledBlock grad_block;
    float* grad_data = nullptr;
  };

  // Work queued for the optimizer thread.
  struct Epoch {
    int64_t step = 0;
    bool clip = false;
    float lr = 0;
  };

  EngineConfig config;
  Device* device = nullptr;
  Communicator* comm = nullptr;
  EngineHooks hooks;
  int rank = 0;
  int world = 1;
  size_t elem_size = 4;
  ParamCopyType copy_type = ParamCopyType::kNone;

  std::vector<Param> params;
  std::set<std::string> names;  // registered parameter names
  std::vector<SubGroup> groups;
  bool registered = false;
  // Streaming gradient accumulators (no accumulation, no clipping): only the sub-groups between
  // the trainer's backward and the optimizer hold pinned gradient memory, a block of grad_pool
  // each.
  bool stream_grads = false;
  uint64_t grad_releases = 0;  // guarded by mu: accumulators freed so far (progress)
  // Guarded by mu: the sub-group whose gradients the optimizer waits for (SIZE_MAX: none),
  // and for which step.
  size_t waiting_group = SIZE_MAX;
  int64_t waiting_step = 0;

  std::unique_ptr<PinnedArena> arena;
  // Blocks of the arena (declared after it: destroyed before it).
  BlockPool grad_pool;   // streaming accumulators, one block per sub-group
  BlockPool state_pool;  // [master | m | v] of one sub-group (NVMe states; initialisation)
  BlockPool copy_pool;   // the bf16 parameter copy of one sub-group
  std::unique_ptr<SwapStore> swap;
  std::unique_ptr<CpuOptimizer> optimizer;
  Stream* copy_stream = nullptr;
  Stream* comm_stream = nullptr;
  Stream* update_stream = nullptr;
  Stream* grad_stream = nullptr;  // gradient partitions device -> host, then accumulation
  std::unique_ptr<Event> compute_done;
  std::unique_ptr<Event> copy_done;
  std::unique_ptr<Event> comm_done;
  std::vector<float> zeros;  // padding source for gradient scratch

  // Trace: the acquire sequence of one micro-step.
  std::vector<ParamId> trace;
  bool trace_recording = true;
  bool trace_valid = false;
  size_t trace_pos = 0;  // next expected position this micro-step

  // Device accounting (engine-side budget), guarded by mu_.
  uint64_t device_bytes = 0;
  uint64_t device_peak = 0;
  uint64_t live_elems = 0;  // trainer thread only: full params resident or fetching
  // Trainer thread only: device bytes as the trainer's program order sees them. Decisions
  // that issue collectives (fetch, prefetch, evict) look only at this, never at device_bytes,
  // which frees on stream threads change at times that differ between ranks.
  uint64_t plan_bytes = 0;
  std::vector<uint64_t> pending_scratch;  // trainer thread only: gradient scratch in flight

  int64_t step = 0;
  int64_t micro = 0;  // micro-steps taken
  // One-step delayed update (zinf.delayed_update): the optimizer step for window s runs while
  // the trainer computes window s + 1, which reads the parameters of step s - 1.
  bool delayed = false;
  // Trainer thread: the version (optimizer step) of the parameters Acquire returns. Equal to
  // `step` without the delayed update; `step - 1` with it (or `step` after a checkpoint).
  int64_t visible = 0;
  // The parameter store buffer that holds version v.
  int Buf(int64_t v) const { return delayed ? static_cast<int>(v & 1) : 0; }
  // Whether the optimizer step of window s runs delayed (zinf.delayed_update_after: the first
  // steps do not). Undelayed steps use the two buffers too: step s writes buffer s % 2 while
  // the trainer reads s - 1's, and Step() waits for it.
  bool DelayedStep(int64_t s) const {
    return delayed && s > static_cast<int64_t>(config.delayed_update_after);
  }

  // Shared with the optimizer thread and callbacks.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Epoch> epochs;  // guarded by mu: queued or running, oldest first
  int64_t done_step = 0;     // guarded by mu: the last epoch the optimizer finished
  Status optimizer_status;   // guarded by mu: the first failure of any epoch (sticky)
  Status async_status;       // guarded by mu: first failure in a stream callback
  // Guarded by mu: the clipping coefficient of each epoch whose global norm is known.
  std::map<int64_t, float> clip_coefs;
  bool stopping = false;  // guarded by mu
  std::thread optimizer_thread;
  Status broken;  // trainer thread: once set, every call fails with it

  // Statistics of the current micro-step.
  struct Counters {
    uint64_t h2d = 0, d2h = 0;
    double copy_busy = 0, optimizer_busy = 0, acquire_wait = 0, optimizer_wait = 0;
    uint64_t hits = 0, misses = 0;
  } counters;  // guarded by mu
  SwapStoreStats swap_base;
  Clock::time_point step_start = Clock::now();
  uint64_t pinned_peak_base = 0;

  ~Impl() {
    {
      std::unique_lock<std::mutex> lock(mu);
      // Delayed update: the last step's optimizer may still run; between micro-steps it needs
      // nothing more from the trainer, so let it finish and report a failure nobody saw.
      if (delayed && registered && !in_micro && broken.ok() && optimizer_thread.joinable()) {
        cv.wait(lock, [&] { return done_step >= step; });
        if (!optimizer_status.ok()) {
          LogWarning("the last optimizer step failed and was not reported: " +
                     optimizer_status.ToString());
        }
      }
      stopping = true;
    }
    cv.notify_all();
    if (optimizer_thread.joinable()) optimizer_thread.join();
    if (copy_stream) (void)device->SynchronizeStream(copy_stream);
    if (comm_stream) (void)device->SynchronizeStream(comm_stream);
    if (update_stream) (void)device->SynchronizeStream(update_stream);
    if (grad_stream) (void)device->SynchronizeStream(grad_stream);
    for (Param& p : params) {
      if (p.device_full != nullptr && !p.aliased) device->Free(p.device_full);
      for (void* part : p.device_part) {
        if (part != nullptr) device->Free(part);
      }
    }
    for (SubGroup& g : groups) {
      if (g.device_states != nullptr) device->Free(g.device_states);
    }
    if (small_scratch != nullptr) device->Free(small_scratch);
    if (device_grads != nullptr) device->Free(device_grads);
    if (arena) (void)device->UnregisterHostMemory(arena->region().base);
    // Their pinned buffers go back to the arena, which must still exist.
    params.clear();
    groups.clear();
  }

  // ---- Device memory under the engine's budget ----

  Result<void*> DevAlloc(size_t bytes, const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (config.device_budget_bytes != 0 && device_bytes + bytes > config.device_budget_bytes) {
        return Status::ResourceExhausted(
            "device budget exhausted allocating " + FormatBytes(bytes) + " for " + what +
            " (budget " + FormatBytes(config.device_budget_bytes) + ", in use " +
            FormatBytes(device_bytes) + "); raise zinf.device_budget_bytes");
      }
      device_bytes += bytes;
      device_peak = std::max(device_peak, device_bytes);
    }
    Result<void*> p = device->Alloc(bytes);
    if (!p.ok()) {
      std::lock_guard<std::mutex> lock(mu);
      device_bytes -= bytes;
      return p.status().WithContext("allocating device memory for " + what);
    }
    return p;
  }

  void DevFree(void* ptr, size_t bytes) {
    device->Free(ptr);
    std::lock_guard<std::mutex> lock(mu);
    device_bytes -= bytes;
  }

  size_t FullBytes(const Param& p) const { return p.padded_numel * elem_size; }
  size_t PartBytes(const Param& p) const { return p.info.partition_numel * elem_size; }

  void SetAsyncError(const Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    if (async_status.ok()) async_status = s;
  }

  Status TakeAsyncError() {
    std::lock_guard<std::mutex> lock(mu);
    return async_status;
  }

  // Host callback on `stream` that adds the time between two points to a busy counter.
  void TimeCopy(Stream* stream, std::function<Status()> issue) {
    auto t0 = std::make_shared<Clock::time_point>();
    (void)device->LaunchHostFunc(stream, [t0] { *t0 = Clock::now(); });
    Status s = issue();
    if (!s.ok()) SetAsyncError(s);
    (void)device->LaunchHostFunc(stream, [this, t0] {
      double d = Since(*t0);
      std::lock_guard<std::mutex> lock(mu);
      counters.copy_busy += d;
    });
  }

  // ---- Registration ----

  Status Place();
  Status InitStores();
  // Durable mode: the commit description (step and layout) and its check at resume.
  // `at_visible`: the parameter version the micro-step after that step reads (one behind
  // with the delayed update).
  std::string StoreMeta(int64_t at_step, int64_t at_visible) const;
  // `param_keys`: the commit holds NVMe parameter stores (written from its masters).
  // `updates` (optional): each parameter's update count at that commit.
  Status CheckStoreMeta(const std::string& meta, int64_t* step, int64_t* visible, bool* param_keys,
                        uint64_t* lineage = nullptr, std::vector<int64_t>* updates = nullptr) const;
  // Called by the trainer thread at Step() (or between steps), or, for a delayed step, by
  // the optimizer thread once the step's update is written (the next one has not begun).
  Status CommitStore(int64_t at_step, int64_t at_visible) {
    if (!config.durable) return Status::OK();
    return swap->Commit(StoreMeta(at_step, at_visible))
        .WithContext("committing the durable swap store at step " + std::to_string(at_step));
  }
  bool resume_store = false;  // ResumeFromStore: InitStores reopens instead of initialising
  // Durable: which history the commits belong to. 0 for a fresh start; every LoadCheckpoint
  // derives a new one (the same on every rank), so that a resume never mixes a rank's commit
  // from before a load with another's from after it at the same step.
  uint64_t lineage = 0;
  // ResumeFromStore: the commit every rank reopens at. Each rank's store holds its last commit
  // and, with more than one rank, the one before; ranks commit at most one step apart, so the
  // earliest last commit is held by all. Returns whether this rank reopens at its previous one.
  Result<bool> AgreeOnCommit(const std::string& first_path);
  Status CheckNvmePaths(const std::vector<std::string>& paths) const;

  // ---- Fetch / evict ----

  static constexpr uint64_t kNotFetched = UINT64_MAX;
  // Fetches parameter `id` into device memory (asynchronously: p.ready). `prefetch`: give up
  // at once when no pinned staging is free (a demand fetch waits for the copies in flight to
  // hand theirs back). On failure the parameter holds no device memory.
  Status Fetch(ParamId id, bool prefetch = false);
  // Fetch's work once the buffers are there: the read, copy and gather on the streams.
  Status IssueFetch(ParamId id, const std::shared_ptr<PinnedBuffer>& staging);
  // Gives back the device copy of `p` (nothing may still use or write it) and its accounting.
  void DropDeviceCopy(Param& p);
  Status MakeRoom(uint64_t elems, uint64_t bytes, ParamId for_id);
  // Waits for the gradient reductions in flight; their scratch memory is free afterwards.
  Status ReclaimScratch() {
    ZINF_RETURN_IF_ERROR(device->SynchronizeStream(comm_stream));
    ZINF_RETURN_IF_ERROR(device->SynchronizeStream(copy_stream));
    ZINF_RETURN_IF_ERROR(device->SynchronizeStream(grad_stream));
    for (uint64_t b : pending_scratch) plan_bytes -= b;
    pending_scratch.clear();
    return Status::OK();
  }
  void Evict(ParamId id);
  // Elements of trace between the cursor and the next use of `id` (SIZE_MAX: none).
  uint64_t ReuseDistance(ParamId id) const;
  void Prefetch();
  void TraceCheck(ParamId id);

  // ---- Optimizer ----

  void OptimizerLoop();
  Status RunEpoch(const Epoch& e);
  OptimizerHyperParams HyperParams(const Epoch& e, float coef) const;
  // A sub-group kept on the device, with its parameters on the device: stepped by
  // Device::OptimizerStep on the update stream, the parameters written into their device
  // stores by the step itself (bf16) or a device copy (fp32).
  // `with_grad[j]`: whether the group's j-th parameter got a gradient in the window; the others
  // are not updated (their parameter stores are still written, as their buffer may be stale).
  Status StepGroupOnDevice(size_t gi, const Epoch& e, float coef,
                           const std::vector<uint8_t>& with_grad);
  // Refuses a gradient that holds inf or NaN before the optimizer uses it: a non-finite master
  // is never written (the step fails; the engine must be recreated from a checkpoint or the
  // durable store, whose last commit predates the step).
  Status CheckFinite(const Param& p, int64_t step) {
    Result<GradStats> gs =
        optimizer->GradSumSquares(groups[p.info.sub_group].grad_data + p.slice_offset,
                                  GradType::kF32, p.info.partition_numel);
    ZINF_RETURN_IF_ERROR(gs.status());
    if (gs->has_inf_or_nan) {
      return Status::FailedPrecondition(
          "the gradient of '" + p.info.name + "' in step " + std::to_string(step) +
          " holds inf or NaN: the optimizer stopped before writing it; lower the learning rate "
          "or look at the loss, then resume from the last checkpoint");
    }
    return Status::OK();
  }
  Status StepGroup(size_t g, float* master, float* m, float* v, uint16_t* copy_out, const Epoch& e,
                   float coef, const std::vector<uint8_t>& with_grad, std::vector<Ticket>* writes);
  // The optimizer's view of parameter p's partition inside its sub-group's master and state
  // buffers (m and v: exp_avg / exp_avg_sq, or the Adagrad sum in v), with fp32 gradients at
  // `grad`; no parameter copy.
  OptimizerTensors PartTensors(const Param& p, const OptimizerHyperParams& hp, float* master,
                               float* m, float* v, const float* grad) const {
    OptimizerTensors t;
    t.param = master + p.slice_offset;
    t.grad = grad;
    t.grad_type = GradType::kF32;
    t.n = p.info.partition_numel;
    if (hp.kind == OptimizerKind::kAdagrad) {
      t.sum = v + p.slice_offset;
    } else {
      t.exp_avg = m + p.slice_offset;
      if (hp.kind != OptimizerKind::kLion) t.exp_avg_sq = v + p.slice_offset;
    }
    return t;
  }
  // Writes sub-group g's parameters (from the masters, or their storage-dtype copy) into
  // parameter store buffer `buf`. With `writes` (the optimizer's pipeline) the NVMe writes'
  // tickets go there and device copies are left in flight on update_stream; without, it
  // returns when everything is written.
  Status WriteParamStore(size_t g, const float* master, const uint16_t* copy_out, int buf,
                         std::vector<Ticket>* writes);
  size_t GroupStateBytes(const SubGroup& g) const { return g.numel * 3 * sizeof(float); }
  // ---- Checkpoints ----
  // Every rank learns whether every rank succeeded (a collective: all ranks call it).
  Status Agree(const Status& local, const std::string& what);
  // Collectives on host values, staged through device memory (NCCL needs device buffers):
  // small_scratch when they fit (trainer thread only), else an allocation.
  static constexpr size_t kSmallScratchBytes = 16384;
  void* small_scratch = nullptr;
  // Gradients of the sub-group StepGroupOnDevice is stepping (optimizer thread only), sized
  // for the largest sub-group kept on the device.
  void* device_grads = nullptr;
  Status AllReduceHost(float* values, size_t count, Stream* stream, const std::string& what);
  Status AllGatherHost(const void* send, void* recv, size_t bytes_per_rank,
                       const std::string& what);
  // Host memory for one sub-group's states between optimizer steps: from the pinned arena
  // (whose optimizer buffers are idle then) when it has room, else from the heap.
  struct HostStates {
    PinnedBuffer pinned;
    std::unique_ptr<AlignedBuffer> heap;
    void* data() const { return heap ? heap->data : pinned.data(); }
  };
  Status AllocateHostStates(size_t bytes, HostStates* out) {
    if (arena) {
      Result<PinnedBuffer> b = arena->Allocate(bytes);
      if (b.ok()) {
        out->pinned = std::move(b).value();
        return Status::OK();
      }
    }
    out->heap = std::make_unique<AlignedBuffer>(bytes);
    if (out->heap->data == nullptr) {
      out->heap.reset();
      return Status::ResourceExhausted("allocating " + FormatBytes(bytes) +
                                       " of host memory for a sub-group's optimizer states");
    }
    return Status::OK();
  }
  // Copies sub-group `gi`'s [master | exp_avg | exp_avg_sq] into / out of `buf` (host).
  Status ReadGroupStates(size_t gi, void* buf);
  // ... and rebuilds the group's parameter store buffer `buf_index` from the masters.
  Status WriteGroupStates(size_t gi, const void* buf, int buf_index);
  Status CheckBetweenSteps(const char* what) const;
  // Checkpoint folders this engine saved to or loaded from, locked for its lifetime (rank 0).
  std::map<std::string, std::unique_ptr<FolderLock>> checkpoint_locks;
  // Rank 0: locks `dir` (with `create`: creates it 0700 and checks it is writable first).
  Status LockCheckpointDir(const std::string& dir, bool create);
  Status ValidateCheckpoint(const std::string& folder, RankManifest* man, int* fd,
                            std::string* states_path, AlignedBuffer* buf);
  size_t GroupGradBytes(const SubGroup& g) const { return g.numel * sizeof(float); }
  float* GradAcc(const Param& p) { return groups[p.info.sub_group].grad_data + p.slice_offset; }
  // Streaming mode: gives sub-group `g` its accumulators, waiting (bounded) for the optimizer
  // to free a block when all are taken. No-op when it has them.
  Status EnsureGradBuffer(SubGroup& g);
  // Streaming mode: returns the accumulators of a stepped sub-group.
  void ReleaseGradBuffer(SubGroup& g);
  std::vector<size_t> GroupOrder() const {  // backward order: last registered first
    std::vector<size_t> order(groups.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = order.size() - 1 - i;
    return order;
  }
  // A parameter's gradient of this micro-step is in its accumulator; `ready` is the
  // optimizer step this micro-step completes (0: not a boundary).
  void GradLanded(ParamId id, int64_t ready);
  void LandLocked(SubGroup& g, int64_t ready);
  // Delayed update: waits until the previous window's optimizer step is done with sub-group
  // `g`, whose accumulators the trainer is about to write. No-op otherwise.
  Status WaitStepped(SubGroup& g);
  // Waits until the optimizer has finished every epoch up to `target`; returns the first
  // optimizer failure.
  Status WaitDone(int64_t target);
  // Between steps: waits for the optimizer step still running (delayed update) and makes its
  // parameters the ones the next micro-step reads, as a checkpoint resume would.
  Status FinishPendingUpdate() {
    ZINF_RETURN_IF_ERROR(WaitDone(step));
    if (visible != step) {
      visible = step;
      gather_states.reset();
      // Durable: a resume must read what the next micro-step reads (the optimizer is idle).
      return CommitStore(step, visible);
    }
    return Status::OK();
  }
  // At the start of a micro-step: resets the gradient counts and, when the micro-step ends an
  // accumulation window, hands the optimizer thread its epoch so sub-groups are stepped as
  // soon as their gradients land (during backward).
  void BeginMicroStep();
  // Hands the optimizer thread the epoch of a boundary micro-step, at the micro-step's first
  // Acquire, ReduceGradient or Step (so that between steps the optimizer is idle and a
  // checkpoint can be saved or loaded). Its read-ahead of NVMe states overlaps the forward.
  void KickEpoch();
  bool epoch_due = false;           // trainer thread only
  bool reduced_this_micro = false;  // trainer thread only: some ReduceGradient this micro-step
  bool boundary_micro = false;      // trainer thread only: this micro-step ends a window
  float lr = 0;                     // trainer thread only: the learning rate of the next epoch
  bool in_micro = false;            // trainer thread only: the micro-step has started (KickEpoch)
  // GatherMasterParameter's copy of one sub-group's states (trainer thread only).
  std::unique_ptr<AlignedBuffer> gather_states;
  size_t gather_group = 0;
};

void Engine::Impl::BeginMicroStep() {
  const bool boundary = (micro + 1) % std::max(1, config.gradient_accumulation_steps) == 0;
  for (Param& p : params) p.grad_reduced_this_micro = false;
  reduced_this_micro = false;
  std::lock_guard<std::mutex> lock(mu);
  for (SubGroup& g : groups) {
    // Frozen parameters never hand in a gradient: a sub-group of only those is complete at once.
    g.pending = g.trainable;
    if (boundary && g.pending == 0) g.ready_step = step + 1;
  }
  epoch_due = boundary;
  boundary_micro = boundary;
}

void Engine::Impl::KickEpoch() {
  in_micro = true;
  gather_states.reset();
  if (!epoch_due) return;
  epoch_due = false;
  std::lock_guard<std::mutex> lock(mu);
  epochs.push_back({step + 1, config.gradient_clipping > 0, lr});
  cv.notify_all();
}

void Engine::Impl::LandLocked(SubGroup& g, int64_t ready) {
  if (--g.pending == 0 && ready > 0) {
    g.ready_step = ready;
    cv.notify_all();
  }
}

Status Engine::Impl::WaitStepped(SubGroup& g) {
  if (!delayed) return Status::OK();
  auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(mu);
  if (g.stepped_step >= step) return Status::OK();
  cv.wait(lock, [&] { return stopping || g.stepped_step >= step; });
  counters.optimizer_wait += Since(t0);
  if (stopping) return Status::FailedPrecondition("engine shutting down");
  return Status::OK();
}

Status Engine::Impl::WaitDone(int64_t target) {
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return stopping || done_step >= target; });
  if (!optimizer_status.ok()) return optimizer_status;
  if (done_step < target) return Status::FailedPrecondition("engine shutting down");
  return Status::OK();
}

// ---- Creation and registration ---------------------------------------------------------------

Result<std::unique_ptr<Engine>> Engine::Create(const EngineConfig& config, Device* device,
                                               Communicator* comm, const EngineHooks& hooks) {
  if (device == nullptr || comm == nullptr) {
    return Status::InvalidArgument("Engine::Create: device and communicator are required");
  }
  if (config.zero_stage != 3) {
    return Status::InvalidArgument("zero_optimization.stage: zinf implements stage 3 only");
  }
  for (const OffloadConfig* o : {&config.offload_param, &config.offload_optimizer}) {
    if (o->tier == Tier::kNvme && o->nvme_paths.empty()) {
      return Status::InvalidArgument(
          std::string(o == &config.offload_param ? "offload_param" : "offload_optimizer") +
          ": device is nvme but no nvme_path is set; add \"nvme_path\" or zinf.nvme_paths");
    }
  }
  // Sub-groups stepped on the device: all of them (offload_optimizer.device none) or those
  // beyond offload_optimizer.ratio.
  const bool device_optimizer =
      config.offload_optimizer.tier == Tier::kDevice || config.offload_optimizer.ratio < 1;
  if (device_optimizer && !device->IsHost()) {
    const char* what = config.offload_optimizer.tier == Tier::kDevice
                           ? "offload_optimizer.device none (the optimizer on the GPU)"
                           : "offload_optimizer.ratio below 1 (part of the optimizer on the GPU)";
    if (config.offload_param.tier != Tier::kDevice) {
      return Status::NotSupported(
          std::string(what) +
          " needs offload_param.device none: the GPU writes the updated parameters straight "
          "into their device stores; set offload_optimizer.ratio 1 and device cpu or nvme");
    }
    if (config.optimizer.type != OptimizerType::kAdam &&
        config.optimizer.type != OptimizerType::kAdamW) {
      return Status::NotSupported(std::string(what) + ": the GPU kernel runs Adam and AdamW, not " +
                                  OptimizerTypeName(config.optimizer.type) +
                                  "; step it on the CPU (ratio 1, device cpu or nvme)");
    }
  }
  if (config.durable) {
    if (config.offload_optimizer.tier != Tier::kNvme || config.offload_optimizer.ratio < 1) {
      return Status::InvalidArgument(
          "zinf.durable needs offload_optimizer.device nvme and offload_optimizer.ratio 1 (the "
          "states to resume from live in the swap store)");
    }
    if (config.delayed_update && comm->world_size() > 1) {
      return Status::NotSupported(
          "zinf.durable with zinf.delayed_update and more than one rank is not supported: each "
          "rank's optimizer commits on its own, so ranks can end up more than the one retained "
          "commit apart; turn one off");
    }
    if (config.delayed_update && config.offload_param.tier != Tier::kNvme) {
      return Status::InvalidArgument(
          "zinf.durable with zinf.delayed_update needs offload_param.device nvme: a resume "
          "needs the parameters one step behind the states, which only the NVMe parameter "
          "store keeps");
    }
  }
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.config = config;
  m.lr = config.optimizer.lr;
  m.delayed = config.delayed_update;
  m.device = device;
  m.comm = comm;
  m.hooks = hooks;
  m.rank = comm->rank();
  m.world = comm->world_size();
  // NVMe paths: folders, inside zinf.allowed_nvme_roots when set (again at placement, when
  // the swap store opens).
  for (const OffloadConfig* o : {&config.offload_param, &config.offload_optimizer}) {
    if (o->tier == Tier::kNvme) ZINF_RETURN_IF_ERROR(m.CheckNvmePaths(o->nvme_paths));
  }
  if (config.bf16) {
    m.elem_size = 2;
    m.copy_type = ParamCopyType::kBf16;
  }
  CpuOptimizer::Options oo;
  oo.num_threads = config.optimizer_threads;
  ZINF_ASSIGN_OR_RETURN(m.optimizer, CpuOptimizer::Create(oo));
  ZINF_ASSIGN_OR_RETURN(m.copy_stream, device->CreateStream("zinf-copy"));
  ZINF_ASSIGN_OR_RETURN(m.comm_stream, device->CreateStream("zinf-comm"));
  ZINF_ASSIGN_OR_RETURN(m.update_stream, device->CreateStream("zinf-update"));
  ZINF_ASSIGN_OR_RETURN(m.grad_stream, device->CreateStream("zinf-grad"));
  ZINF_ASSIGN_OR_RETURN(m.compute_done, device->CreateEvent());
  ZINF_ASSIGN_OR_RETURN(m.copy_done, device->CreateEvent());
  ZINF_ASSIGN_OR_RETURN(m.comm_done, device->CreateEvent());
  m.zeros.assign(kPartitionAlign * static_cast<size_t>(m.world), 0.0f);
  // Device memory for the small host-value collectives, reserved once so that they never
  // fail to allocate on one rank while the others wait in them.
  ZINF_ASSIGN_OR_RETURN(m.small_scratch, m.DevAlloc(Impl::kSmallScratchBytes, "small collectives"));
  m.plan_bytes += Impl::kSmallScratchBytes;
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

Result<ParamId> Engine::RegisterParameter(const ParamSpec& spec) {
  Impl& m = *impl_;
  if (m.registered) {
    return Status::FailedPrecondition("RegisterParameter('" + spec.name +
                                      "') after registration ended (first Acquire)");
  }
  size_t numel = 1;
  for (int64_t d : spec.shape) {
    if (d <= 0) {
      return Status::InvalidArgument("parameter '" + spec.name +
                                     "': every dimension must be positive");
    }
    // At most 2^48 elements (1 PiB of fp32): far beyond any tier, and no size computed from
    // it below can overflow.
    if (__builtin_mul_overflow(numel, static_cast<size_t>(d), &numel) ||
        numel > (size_t{1} << 48)) {
      return Status::InvalidArgument("parameter '" + spec.name +
                                     "': its shape has more than 2^48 elements");
    }
  }
  if (spec.shape.empty() || !spec.init) {
    return Status::InvalidArgument("parameter '" + spec.name + "': needs a shape and an init");
  }
  if (spec.name.empty() || !IsValidUtf8(spec.name)) {
    return Status::InvalidArgument(
        "parameter name '" + spec.name +
        "' is empty or not valid UTF-8 (names go into swap keys and JSON manifests)");
  }
  if (!m.names.insert(spec.name).second) {
    return Status::InvalidArgument("parameter name '" + spec.name +
                                   "' is registered twice; names must be unique (they key "
                                   "the swap store and the checkpoints)");
  }
  Impl::Param p;
  p.info.name = spec.name;
  p.info.shape = spec.shape;
  p.info.numel = numel;
  p.info.partition_numel = RoundUpSize((numel + m.world - 1) / m.world, kPartitionAlign);
  p.padded_numel = p.info.partition_numel * m.world;
  p.info.persistent = numel <= m.config.param_persistence_threshold;
  p.info.trainable = spec.trainable;
  p.init = spec.init;
  // The largest layer must fit the device budget together with its gradient scratch.
  uint64_t need =
      m.FullBytes(p) + p.padded_numel * sizeof(float) + p.info.partition_numel * sizeof(float);
  if (m.config.device_budget_bytes != 0 && need > m.config.device_budget_bytes) {
    return Status::ResourceExhausted(
        "parameter '" + spec.name + "' (" + FormatBytes(m.FullBytes(p)) +
        " gathered, plus its gradient) does not fit the device budget of " +
        FormatBytes(m.config.device_budget_bytes) +
        "; raise zinf.device_budget_bytes to at "
        "least " +
        FormatBytes(need));
  }
  if (need > m.device->MemoryInfo().budget) {
    return Status::ResourceExhausted("parameter '" + spec.name + "' needs " + FormatBytes(need) +
                                     " of device memory but the device budget is " +
                                     FormatBytes(m.device->MemoryInfo().budget));
  }
  m.params.push_back(std::move(p));
  return static_cast<ParamId>(m.params.size() - 1);
}

Status Engine::FinishRegistration() {
  Impl& m = *impl_;
  if (m.registered) return Status::OK();
  if (m.params.empty()) return Status::FailedPrecondition("no parameters registered");
  ZINF_RETURN_IF_ERROR(m.Place());
  Status init = m.InitStores();
  // The initial values are in the stores (or init failed): the callbacks, and whatever they
  // hold (a spill file of the values, the trainer's buffers), are not needed any more.
  for (Impl::Param& p : m.params) p.init = nullptr;
  ZINF_RETURN_IF_ERROR(init);
  m.registered = true;
  m.optimizer_thread = std::thread([&m] { m.OptimizerLoop(); });
  m.BeginMicroStep();
  m.swap_base = m.swap ? m.swap->stats() : SwapStoreStats{};
  m.step_start = Clock::now();
  return Status::OK();
}

Status Engine::Impl::Place() {
  // Sub-groups: consecutive parameters up to sub_group_size partition elements.
  for (ParamId id = 0; id < params.size(); ++id) {
    Param& p = params[id];
    size_t slice = RoundUpSize(p.info.partition_numel, kSliceAlign);
    if (groups.empty() ||
        (groups.back().numel + slice > config.sub_group_size && !groups.back().params.empty())) {
      groups.emplace_back();
    }
    SubGroup& g = groups.back();
    p.info.sub_group = groups.size() - 1;
    p.slice_offset = g.numel;
    p.index_in_group = g.params.size();
    g.params.push_back(id);
    if (p.info.trainable) ++g.trainable;
    g.numel += slice;
  }
  for (SubGroup& g : groups) g.has_grad.assign(g.params.size(), 0);

  // offload_optimizer.ratio: the share of sub-groups whose states are offloaded (cpu or nvme)
  // and stepped by the CPU. The others stay in device memory and are stepped there: the
  // first registered ones, whose gradients complete last in backward (a CPU step of them
  // would overlap least with the backward).
  const size_t offloaded =
      config.offload_optimizer.tier == Tier::kDevice
          ? 0
          : static_cast<size_t>(std::llround(config.offload_optimizer.ratio * groups.size()));
  for (size_t gi = 0; gi + offloaded < groups.size(); ++gi) groups[gi].on_device = true;
  if (config.offload_optimizer.tier != Tier::kDevice && config.offload_optimizer.ratio < 1 &&
      rank == 0) {
    // The split is by whole sub-groups: say what the ratio became.
    char ratio[32];
    std::snprintf(ratio, sizeof(ratio), "%g", config.offload_optimizer.ratio);
    LogInfo("offload_optimizer.ratio " + std::string(ratio) + ": " + std::to_string(offloaded) +
            " of " + std::to_string(groups.size()) + " optimizer sub-groups offloaded, " +
            std::to_string(groups.size() - offloaded) +
            " kept and stepped on the device (lower sub_group_size for a finer split)");
  }

  // Pinned memory: cpu-tier partitions, gradient accumulators, staging for nvme reads and
  // optimizer buffers. All of it must fit the pinned budget.
  uint64_t pinned = 0;
  uint64_t max_part = 0, max_group = 0;
  for (const Param& p : params) {
    uint64_t part = RoundUp(PartBytes(p), 4096);
    if (config.offload_param.tier == Tier::kCpu) pinned += delayed ? 2 * part : part;
    max_part = std::max<uint64_t>(max_part, RoundUp(p.info.partition_numel * sizeof(float), 4096));
  }
  uint64_t grads_all = 0, max_group_grads = 0;
  for (const SubGroup& g : groups) {
    max_group = std::max<uint64_t>(max_group, g.numel);
    grads_all += RoundUp(GroupGradBytes(g), 4096);
    max_group_grads = std::max<uint64_t>(max_group_grads, RoundUp(GroupGradBytes(g), 4096));
  }
  uint64_t buffers = std::max<uint32_t>(config.offload_optimizer.buffer_count, 3);
  if (config.offload_optimizer.tier == Tier::kNvme) {
    pinned += buffers * RoundUp(max_group * 3 * sizeof(float), 4096);
  } else if (offloaded < groups.size() && !device->IsHost()) {
    pinned += RoundUp(max_group * 3 * sizeof(float), 4096);  // initialising device states
  }
  pinned += buffers * RoundUp(max_group * (copy_type == ParamCopyType::kNone ? 0 : 2), 4096);
  // Staging for nvme parameter reads and gradient landing: a few partitions at a time.
  uint64_t total_part = 0;
  for (const Param& p : params) total_part += p.info.partition_numel;
  uint64_t staging =
      4 * max_part +
      RoundUp(std::min<uint64_t>(config.prefetch_bucket_size / std::max(world, 1), total_part) *
                  elem_size,
              4096);
  pinned += staging;
  // Gradient accumulators. Without accumulation and clipping they stream: a sub-group holds
  // them from its first gradient until the optimizer has stepped it, so two sub-groups' worth
  // is enough (the one the backward fills and the one being stepped); whatever the budget has
  // left goes to them, so backward can run ahead of the optimizer.
  stream_grads = config.gradient_accumulation_steps <= 1 && config.gradient_clipping <= 0;
  const uint64_t grads_min =
      stream_grads ? std::min<uint64_t>(groups.size(), 2) * max_group_grads : grads_all;
  if (pinned + grads_min > config.pinned_budget_bytes) {
    return Status::ResourceExhausted(
        "the pinned host budget of " + FormatBytes(config.pinned_budget_bytes) +
        " is too small: this model needs about " + FormatBytes(pinned + grads_min) +
        " (gradient partitions, cpu-tier parameters, optimizer swap buffers and staging); "
        "raise zinf.pinned_budget_bytes or lower sub_group_size");
  }
  PinnedArenaOptions ao;
  ao.bytes = config.pinned_budget_bytes;
  ao.lock_memory = config.offload_param.pin_memory || config.offload_optimizer.pin_memory;
  ZINF_ASSIGN_OR_RETURN(arena, PinnedArena::Create(ao));
  ZINF_RETURN_IF_ERROR(device->RegisterHostMemory(arena->region().base, arena->capacity()));
  // The fixed-size buffers first, as pools (see BlockPool); the rest of the arena is staging.
  const uint64_t state_bytes = RoundUp(max_group * 3 * sizeof(float), 4096);
  if (config.offload_optimizer.tier == Tier::kNvme) {
    ZINF_RETURN_IF_ERROR(state_pool.Init(arena.get(), state_bytes, buffers, "optimizer buffers"));
  } else if (offloaded < groups.size() && !device->IsHost()) {
    ZINF_RETURN_IF_ERROR(state_pool.Init(arena.get(), state_bytes, 1, "optimizer buffers"));
  }
  if (copy_type != ParamCopyType::kNone) {
    ZINF_RETURN_IF_ERROR(
        copy_pool.Init(arena.get(), max_group * 2, buffers, "parameter copy buffers"));
  }
  if (stream_grads) {
    // Whatever the budget has left beyond the plan goes to gradient blocks (at least two),
    // so that the backward can run ahead of the optimizer.
    const uint64_t spare = config.pinned_budget_bytes - pinned;
    const uint64_t blocks = std::min<uint64_t>(
        groups.size(),
        std::max<uint64_t>(spare / max_group_grads, std::min<size_t>(groups.size(), 2)));
    ZINF_RETURN_IF_ERROR(
        grad_pool.Init(arena.get(), max_group_grads, blocks, "gradient accumulators"));
  }

  bool need_swap =
      config.offload_param.tier == Tier::kNvme || config.offload_optimizer.tier == Tier::kNvme;
  if (need_swap) {
    SwapStoreOptions so;
    so.paths = config.offload_optimizer.tier == Tier::kNvme ? config.offload_optimizer.nvme_paths
                                                            : config.offload_param.nvme_paths;
    for (const std::string& extra : config.offload_param.nvme_paths) {
      if (config.offload_param.tier == Tier::kNvme &&
          std::find(so.paths.begin(), so.paths.end(), extra) == so.paths.end()) {
        so.paths.push_back(extra);
      }
    }
    ZINF_RETURN_IF_ERROR(CheckNvmePaths(so.paths));
    if (world > 1) {
      // Each rank keeps its own swap files: a subfolder per rank.
      for (std::string& path : so.paths) {
        path += "/rank" + std::to_string(rank);
        if (mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
          return ErrnoToStatus(errno, "creating swap folder " + path);
        }
      }
    }
    Result<IoBackendKind> kind = ParseIoBackendKind(config.aio.backend);
    if (!kind.ok()) return kind.status().WithContext("aio.backend");
    so.backend = kind.value();
    so.backend_options.queue_depth = config.aio.queue_depth;
    so.block_size = config.aio.block_size;
    // One request per stripe chunk: chunks as large as the aio block size, so that
    // aio.block_size really is the request size (1 MiB chunks would cap it).
    so.chunk_size = std::max<uint64_t>(RoundUp(config.aio.block_size, 4096), 4096);
    // A durable store is meant to survive the process: its chunks are always checksummed, so
    // that a resume never trusts a flipped byte.
    so.checksums = config.checksums || config.durable;
    so.max_capacity_per_path = config.nvme_capacity_bytes;
    so.registered_regions = {arena->region()};
    so.fault_plan = hooks.fault_plan;
    so.durable = config.durable;
    // A store only a durable engine reopens: otherwise its files go when the engine does.
    so.remove_on_close = !config.durable;
    so.reserve_bytes = config.nvme_reserve_bytes;
    so.retained_commits = world > 1 ? 2 : 1;
    so.reopen = resume_store;
    if (resume_store) {
      ZINF_ASSIGN_OR_RETURN(so.reopen_previous, AgreeOnCommit(so.paths[0]));
    } else if (config.durable && !config.durable_overwrite) {
      // A fresh durable store would replace one that holds committed steps: refused unless
      // asked for (the commits are what a resume needs).
      Result<std::vector<std::string>> commits = SwapStore::ListCommits(so.paths[0]);
      if (commits.ok() && !commits->empty()) {
        nlohmann::json j = nlohmann::json::parse(commits->front(), nullptr, false);
        const std::string step =
            j.is_object() && j.contains("step") ? j["step"].dump() : std::string("?");
        return Status::FailedPrecondition(
            "the swap folder " + so.paths[0] + " holds a durable store committed at step " + step +
            ": resume it (Engine::ResumeFromStore; zinf-train --resume) or allow "
            "replacing it (zinf.durable_overwrite; zinf-train --overwrite)");
      }
    }
    Result<std::unique_ptr<SwapStore>> opened = SwapStore::Open(so);
    if (!opened.ok() && resume_store) {
      return opened.status().WithContext("ResumeFromStore: reopening the swap store in " +
                                         so.paths[0]);
    }
    ZINF_ASSIGN_OR_RETURN(swap, std::move(opened));
  }
  return Status::OK();
}

// Every NVMe path must be a folder and, when zinf.allowed_nvme_roots is set, inside one of
// them after resolving symbolic links.
Status Engine::Impl::CheckNvmePaths(const std::vector<std::string>& paths) const {
  std::vector<std::string> roots;
  for (const std::string& r : config.allowed_nvme_roots) {
    char* real = realpath(r.c_str(), nullptr);
    if (real == nullptr) {
      return ErrnoToStatus(errno, "zinf.allowed_nvme_roots: cannot resolve " + r);
    }
    roots.emplace_back(real);
    std::free(real);
  }
  for (const std::string& p : paths) {
    char* real = realpath(p.c_str(), nullptr);
    if (real == nullptr) {
      return ErrnoToStatus(errno, "nvme_path " + p + " (create the folder, or fix the path)");
    }
    std::string resolved(real);
    std::free(real);
    struct stat st {};
    if (stat(resolved.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return Status::InvalidArgument("nvme_path " + p + " is not a folder");
    }
    if (access(resolved.c_str(), W_OK | X_OK) != 0) {
      return ErrnoToStatus(errno, "nvme_path " + p +
                                      " is not writable (the swap files go there); pick a "
                                      "writable folder");
    }
    if (roots.empty()) continue;
    bool inside = false;
    for (const std::string& r : roots) {
      if (resolved == r || resolved.rfind(r == "/" ? r : r + "/", 0) == 0) inside = true;
    }
    if (!inside) {
      std::string list;
      for (const std::string& r : config.allowed_nvme_roots) list += (list.empty() ? "" : ", ") + r;
      return Status::InvalidArgument(
          "nvme_path " + p + " (" + resolved +
          ") is outside the allowed folders (zinf.allowed_nvme_roots: " + list + ")");
    }
  }
  return Status::OK();
}

Status Engine::Impl::InitStores() {
  std::vector<float> full;
  std::vector<Ticket> tickets;
  // Resuming a durable store: the states come from it, and so do NVMe parameter stores
  // written in the same dtype; everything else is rebuilt from the masters.
  int64_t resumed_step = 0;
  int64_t resumed_visible = 0;
  bool stored_params = false;
  if (resume_store) {
    std::vector<int64_t> updates;
    ZINF_RETURN_IF_ERROR(CheckStoreMeta(swap->committed_meta(), &resumed_step, &resumed_visible,
                                        &stored_params, &lineage, &updates));
    for (size_t i = 0; i < params.size(); ++i) params[i].updates = updates[i];
    if (config.offload_param.tier != Tier::kNvme) {
      // Parameter stores of an earlier run with NVMe parameters: stale from now on (this run
      // keeps its parameters elsewhere); drop them so no later resume can trust them.
      for (const std::string& key : swap->Keys()) {
        if (key.rfind("param/", 0) == 0) ZINF_RETURN_IF_ERROR(swap->Remove(key));
      }
    }
  }
  // Sub-groups the device steps (StepGroupOnDevice): one gradient buffer for them, planned
  // with the rest of the device memory.
  if (config.offload_param.tier == Tier::kDevice) {
    size_t largest = 0;
    for (const SubGroup& g : groups) {
      if (g.on_device) largest = std::max(largest, GroupGradBytes(g));
    }
    if (largest > 0) {
      ZINF_ASSIGN_OR_RETURN(device_grads, DevAlloc(largest, "device optimizer gradients"));
      plan_bytes += largest;
    }
  }
  // Optimizer states per sub-group, parameters per store.
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    SubGroup& g = groups[gi];
    float* master;
    PooledBlock staging;
    if (g.on_device) {
      ZINF_ASSIGN_OR_RETURN(void* d, DevAlloc(GroupStateBytes(g), "optimizer states"));
      plan_bytes += GroupStateBytes(g);
      g.device_states = static_cast<float*>(d);
      if (device->IsHost()) {
        master = g.device_states;
      } else {  // initialised on the host, then copied
        ZINF_ASSIGN_OR_RETURN(staging, state_pool.Take());
        master = static_cast<float*>(staging.data());
      }
    } else if (config.offload_optimizer.tier == Tier::kNvme) {
      ZINF_ASSIGN_OR_RETURN(staging, state_pool.Take());
      master = static_cast<float*>(staging.data());
      g.swap_key = "opt/" + std::to_string(gi);
    } else {
      ZINF_RETURN_IF_ERROR(g.master.Allocate(g.numel * 3, "optimizer states"));
      master = g.master.data;
    }
    if (resume_store) {  // durable mode: states on NVMe (checked at Create)
      Result<uint64_t> size = swap->Size(g.swap_key);
      if (!size.ok() || *size != GroupStateBytes(g)) {
        return Status::FailedPrecondition("ResumeFromStore: the store's optimizer states '" +
                                          g.swap_key + "' do not match this model's sub-group " +
                                          std::to_string(gi));
      }
      ZINF_ASSIGN_OR_RETURN(Ticket t, swap->Read(g.swap_key, master, staging.capacity()));
      ZINF_RETURN_IF_ERROR(swap->Wait(t).WithContext("ResumeFromStore"));
    } else {
      std::memset(master, 0, GroupStateBytes(g));  // exp_avg and exp_avg_sq start at zero
    }
    for (ParamId id : g.params) {
      Param& p = params[id];
      const float* part = master + p.slice_offset;
      if (!resume_store) {
        full.assign(p.padded_numel, 0.0f);
        p.init(full.data(), p.info.numel);
        std::memcpy(master + p.slice_offset,
                    full.data() + static_cast<size_t>(rank) * p.info.partition_numel,
                    p.info.partition_numel * sizeof(float));
      }
      // The parameter store, in storage dtype.
      PinnedBuffer image;
      ZINF_ASSIGN_OR_RETURN(image, arena->Allocate(PartBytes(p)));
      if (copy_type == ParamCopyType::kBf16) {
        ZINF_RETURN_IF_ERROR(
            optimizer->ConvertParams(part, image.data(), copy_type, p.info.partition_numel));
      } else {
        std::memcpy(image.data(), part, PartBytes(p));
      }
      // Version 0 goes to buffer 0. The delayed update's second buffer is written by the
      // first optimizer step (or a checkpoint load) before anything reads it; the in-memory
      // tiers get a copy anyway so that it never holds garbage.
      const int buffers = delayed ? 2 : 1;
      switch (config.offload_param.tier) {
        case Tier::kDevice: {
          for (int b = 0; b < buffers; ++b) {
            ZINF_ASSIGN_OR_RETURN(p.device_part[b],
                                  DevAlloc(PartBytes(p), "parameter '" + p.info.name + "'"));
            plan_bytes += PartBytes(p);
            ZINF_RETURN_IF_ERROR(device->CopyHostToDevice(p.device_part[b], image.data(),
                                                          PartBytes(p), copy_stream));
          }
          ZINF_RETURN_IF_ERROR(device->SynchronizeStream(copy_stream));
          break;
        }
        case Tier::kCpu:
          if (delayed) {
            ZINF_ASSIGN_OR_RETURN(p.host_part[1], arena->Allocate(PartBytes(p)));
            std::memcpy(p.host_part[1].data(), image.data(), PartBytes(p));
          }
          p.host_part[0] = std::move(image);
          break;
        case Tier::kNvme: {
          p.swap_key[0] = "param/" + p.info.name;
          if (delayed) p.swap_key[1] = "param/" + p.info.name + "#1";
          if (resume_store && stored_params) {
            // The committed parameter stores were written from these masters in this dtype
            // (the layout check compared the dtype); a size mismatch means another model.
            // With the delayed update the next micro-step reads the version before them.
            bool stored = true;
            for (int64_t v : {resumed_step, resumed_visible}) {
              Result<uint64_t> size = swap->Size(p.swap_key[Buf(v)]);
              stored = stored && size.ok() && *size == PartBytes(p);
            }
            if (stored) break;
          }
          if (resume_store && resumed_visible != resumed_step) {
            return Status::FailedPrecondition(
                "ResumeFromStore: the store lacks parameter '" + p.info.name + "' at step " +
                std::to_string(resumed_visible) + ", which the delayed update reads next");
          }
          // Version 0, or at a resume the masters' version.
          const std::string& key = p.swap_key[Buf(resume_store ? resumed_step : 0)];
          ZINF_ASSIGN_OR_RETURN(Ticket t,
                                swap->Write(key, image.data(), PartBytes(p), image.capacity()));
          ZINF_RETURN_IF_ERROR(swap->Wait(t));
          break;
        }
      }
      // Persistent with one rank on the device tier: the partition is the full parameter
      // (the buffer of the visible version; Fetch points it there).
      if (world == 1 && config.offload_param.tier == Tier::kDevice) {
        p.device_full = p.device_part[0];
        p.aliased = true;
      }
    }
    if (!g.swap_key.empty() && !resume_store) {
      ZINF_ASSIGN_OR_RETURN(Ticket t, swap->Write(g.swap_key, staging.data(), GroupStateBytes(g),
                                                  staging.capacity()));
      ZINF_RETURN_IF_ERROR(swap->Wait(t));
    }
    if (g.on_device && !device->IsHost()) {
      ZINF_RETURN_IF_ERROR(device->CopyHostToDevice(g.device_states, staging.data(),
                                                    GroupStateBytes(g), copy_stream));
      ZINF_RETURN_IF_ERROR(device->SynchronizeStream(copy_stream));
    }
    if (!stream_grads) {
      ZINF_ASSIGN_OR_RETURN(g.grads, arena->Allocate(GroupGradBytes(g)));
      std::memset(g.grads.data(), 0, g.grads.capacity());
      g.grad_data = static_cast<float*>(g.grads.data());
    }
  }
  if (resume_store) {
    step = resumed_step;
    visible = resumed_visible;
    micro = resumed_step * std::max(1, config.gradient_accumulation_steps);
    std::lock_guard<std::mutex> lock(mu);
    done_step = resumed_step;
    for (SubGroup& g : groups) g.ready_step = g.stepped_step = resumed_step;
    return Status::OK();
  }
  // Durable: the initial state is the first commit (a crash in step 1 resumes at step 0).
  return CommitStore(0, 0);
}

std::string Engine::Impl::StoreMeta(int64_t at_step, int64_t at_visible) const {
  nlohmann::json j;
  j["format"] = "zinf-durable-1";
  j["step"] = at_step;
  j["visible"] = at_visible;
  j["delayed"] = delayed;
  j["lineage"] = lineage;
  j["world"] = world;
  j["optimizer"] = OptimizerTypeName(config.optimizer.type);
  j["storage"] = copy_type == ParamCopyType::kBf16 ? "bf16" : "fp32";
  j["param_tier"] = config.offload_param.tier == Tier::kNvme ? "nvme" : "memory";
  nlohmann::json ps = nlohmann::json::array();
  for (const Param& p : params) {
    ps.push_back({p.info.name, p.info.numel, p.info.partition_numel, p.info.sub_group,
                  p.slice_offset, p.updates});
  }
  j["params"] = ps;
  return j.dump();
}

Status Engine::Impl::CheckStoreMeta(const std::string& meta, int64_t* out_step,
                                    int64_t* out_visible, bool* param_keys, uint64_t* out_lineage,
                                    std::vector<int64_t>* out_updates) const {
  if (meta.empty()) {
    return Status::NotFound("ResumeFromStore: the swap store has no commit to resume from");
  }
  auto mismatch = [](const std::string& what) {
    return Status::FailedPrecondition(
        "ResumeFromStore: the swap store was written by a different model or configuration: " +
        what);
  };
  nlohmann::json j = nlohmann::json::parse(meta, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::Corruption("ResumeFromStore: the store's commit record is not valid JSON");
  }
  try {
    if (j.at("format").get<std::string>() != "zinf-durable-1") return mismatch("unknown format");
    if (j.at("world").get<int>() != world) return mismatch("another number of ranks");
    if (j.value("delayed", false) != delayed) {
      return mismatch(std::string("zinf.delayed_update was ") + (delayed ? "off" : "on") +
                      " (the parameter stores are laid out per setting)");
    }
    const std::string opt = j.at("optimizer").get<std::string>();
    if (opt != OptimizerTypeName(config.optimizer.type)) {
      return mismatch("optimizer " + opt + ", this engine runs " +
                      OptimizerTypeName(config.optimizer.type));
    }
    const std::string storage = j.at("storage").get<std::string>();
    if (storage != (copy_type == ParamCopyType::kBf16 ? "bf16" : "fp32")) {
      return mismatch("parameters stored as " + storage + " (the bf16 setting differs)");
    }
    const auto& ps = j.at("params");
    if (ps.size() != params.size()) {
      return mismatch(std::to_string(ps.size()) + " parameters, this model registers " +
                      std::to_string(params.size()));
    }
    for (size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i];
      if (ps[i].at(0).get<std::string>() != p.info.name ||
          ps[i].at(1).get<size_t>() != p.info.numel ||
          ps[i].at(2).get<size_t>() != p.info.partition_numel ||
          ps[i].at(3).get<size_t>() != p.info.sub_group ||
          ps[i].at(4).get<size_t>() != p.slice_offset) {
        return mismatch(
            "parameter " + std::to_string(i) + " is '" + ps[i].at(0).get<std::string>() +
            "' with " + std::to_string(ps[i].at(1).get<size_t>()) + " elements, this model has '" +
            p.info.name + "' with " + std::to_string(p.info.numel) + " (same sub_group_size?)");
      }
    }
    *out_step = j.at("step").get<int64_t>();
    *out_visible = j.value("visible", *out_step);
    if (out_lineage != nullptr) *out_lineage = j.value("lineage", uint64_t{0});
    *param_keys = j.at("param_tier").get<std::string>() == "nvme";
    if (*out_step < 0) return mismatch("negative step");
    if (*out_visible > *out_step || *out_visible < *out_step - 1 || *out_visible < 0) {
      return mismatch("parameter version " + std::to_string(*out_visible) + " at step " +
                      std::to_string(*out_step));
    }
    if (out_updates != nullptr) {
      out_updates->assign(params.size(), *out_step);
      for (size_t i = 0; i < params.size(); ++i) {
        if (ps[i].size() < 6) continue;  // a commit from before per-parameter counts
        const int64_t u = ps[i].at(5).get<int64_t>();
        if (u < 0 || u > *out_step) {
          return mismatch("parameter '" + params[i].info.name + "' has " + std::to_string(u) +
                          " updates at step " + std::to_string(*out_step));
        }
        (*out_updates)[i] = u;
      }
    }
  } catch (const nlohmann::json::exception& ex) {
    return Status::Corruption(std::string("ResumeFromStore: the store's commit record is "
                                          "missing a field (") +
                              ex.what() + ")");
  }
  return Status::OK();
}

Result<bool> Engine::Impl::AgreeOnCommit(const std::string& first_path) {
  // This rank's last and previous commits as (step, lineage); step -1: none; a step below
  // -100 encodes the StatusCode of a store this rank cannot read.
  int64_t mine[4] = {-1, 0, -1, 0};
  Status local;
  Result<std::vector<std::string>> metas = SwapStore::ListCommits(first_path);
  if (!metas.ok()) local = metas.status();
  for (size_t i = 0; local.ok() && i < std::min<size_t>(2, metas->size()); ++i) {
    bool param_keys = false;
    int64_t visible = 0;
    uint64_t commit_lineage = 0;
    local = CheckStoreMeta((*metas)[i], &mine[2 * i], &visible, &param_keys, &commit_lineage);
    mine[2 * i + 1] = static_cast<int64_t>(commit_lineage);
  }
  if (!local.ok()) mine[0] = mine[2] = -100 - static_cast<int64_t>(local.code());
  std::vector<int64_t> all(4 * static_cast<size_t>(world));
  if (world == 1) {
    std::copy(mine, mine + 4, all.begin());
  } else {
    // Every rank takes part, a failed one too, so that none waits for it.
    ZINF_RETURN_IF_ERROR(AllGatherHost(mine, all.data(), sizeof(mine),
                                       "ResumeFromStore: agreeing on a commit with the other "
                                       "ranks"));
  }
  ZINF_RETURN_IF_ERROR(local.WithContext("ResumeFromStore: the swap store in " + first_path));
  for (int r = 0; r < world; ++r) {
    if (all[4 * r] <= -100) {  // every rank reports the failed rank's code
      return Status(static_cast<StatusCode>(-100 - all[4 * r]),
                    "ResumeFromStore: rank " + std::to_string(r) +
                        " cannot resume from its swap store (its error names the cause)");
    }
  }
  // The commit every rank holds (as its last or previous one), the latest such. Ranks commit
  // at most one step apart, so there is one unless the stores come from different runs (or
  // different histories: a checkpoint load one rank committed and another did not).
  auto holds = [&](int r, int64_t step, int64_t lin) {
    return (all[4 * r] == step && all[4 * r + 1] == lin) ||
           (all[4 * r + 2] == step && all[4 * r + 3] == lin);
  };
  int64_t agreed = -1, agreed_lineage = 0;
  for (int r = 0; r < world; ++r) {
    for (int k = 0; k < 2; ++k) {
      const int64_t step = all[4 * r + 2 * k], lin = all[4 * r + 2 * k + 1];
      if (step < 0 || step <= agreed) continue;
      bool everyone = true;
      for (int q = 0; q < world && everyone; ++q) everyone = holds(q, step, lin);
      if (everyone) {
        agreed = step;
        agreed_lineage = lin;
      }
    }
  }
  if (agreed < 0) {
    std::string held;
    for (int r = 0; r < world; ++r) {
      held += (r ? "; rank " : "rank ") + std::to_string(r) + " at step " +
              std::to_string(all[4 * r]) +
              (all[4 * r + 2] >= 0 ? " (previous " + std::to_string(all[4 * r + 2]) + ")" : "");
    }
    return Status::FailedPrecondition(
        "ResumeFromStore: the ranks' swap stores have no commit in common (" + held +
        "); they come from different runs or histories: resume from a checkpoint or start "
        "afresh");
  }
  const bool previous = !(all[4 * rank] == agreed && all[4 * rank + 1] == agreed_lineage);
  if (previous) {
    LogInfo("rank " + std::to_string(rank) + ": resuming at step " + std::to_string(agreed) +
            ", the commit before its last (step " + std::to_string(all[4 * rank]) +
            "), which every rank holds");
  }
  return previous;
}

Status Engine::ResumeFromStore() {
  Impl& m = *impl_;
  if (!m.config.durable) {
    return Status::FailedPrecondition(
        "ResumeFromStore needs zinf.durable (a store that commits every step)");
  }
  if (m.registered) {
    return Status::FailedPrecondition(
        "ResumeFromStore must come after registering the parameters and before the first "
        "Acquire, Step or FinishRegistration");
  }
  m.resume_store = true;
  Status s = FinishRegistration();
  m.resume_store = false;
  if (!s.ok()) {
    m.broken = Status::FailedPrecondition("ResumeFromStore failed (" + s.message() +
                                          "); recreate the engine");
  }
  return s;
}

Status Engine::SetAcquireOrder(const std::vector<ParamId>& order) {
  Impl& m = *impl_;
  for (ParamId id : order) {
    if (id >= m.params.size()) {
      return Status::InvalidArgument("SetAcquireOrder: unknown parameter id " + std::to_string(id));
    }
  }
  m.trace = order;
  m.trace_recording = false;
  m.trace_valid = !order.empty();
  return Status::OK();
}

// ---- Fetch, prefetch, eviction ---------------------------------------------------------------

uint64_t Engine::Impl::ReuseDistance(ParamId id) const {
  if (!trace_valid) return UINT64_MAX;
  uint64_t dist = 0;
  for (size_t i = trace_pos; i < trace.size(); ++i) {
    if (trace[i] == id) return dist;
    dist += params[trace[i]].info.numel;
  }
  return UINT64_MAX;
}

void Engine::Impl::Evict(ParamId id) {
  Param& p = params[id];
  if (p.aliased || p.device_full == nullptr) return;
  // The compute that used it has finished (host compute is synchronous; for a real device
  // the buffer is freed after the compute stream's event).
  (void)device->RecordEvent(compute_done.get(), device->ComputeStream());
  (void)device->SynchronizeEvent(compute_done.get());
  if (p.state == FetchState::kFetching) (void)device->SynchronizeEvent(p.ready.get());
  DropDeviceCopy(p);
}

void Engine::Impl::DropDeviceCopy(Param& p) {
  DevFree(p.device_full, FullBytes(p));
  p.device_full = nullptr;
  p.fetched_version = kNotFetched;
  p.state = FetchState::kAbsent;
  live_elems -= p.padded_numel;
  plan_bytes -= FullBytes(p);
}

Status Engine::Impl::MakeRoom(uint64_t elems, uint64_t bytes, ParamId for_id) {
  const uint64_t grad_room =
      (params[for_id].padded_numel + params[for_id].info.partition_numel) * sizeof(float);
  auto fits = [&] {
    bool bytes_ok = config.device_budget_bytes == 0 ||
                    plan_bytes + bytes + grad_room <= config.device_budget_bytes;
    return bytes_ok && live_elems + elems <= config.max_live_parameters;
  };
  while (!fits()) {
    if (!pending_scratch.empty()) {
      ZINF_RETURN_IF_ERROR(ReclaimScratch());
      continue;
    }
    // Evict the released parameter whose next use is farthest away.
    ParamId victim = UINT32_MAX;
    uint64_t best = 0;
    for (ParamId id = 0; id < params.size(); ++id) {
      const Param& p = params[id];
      if (p.acquired > 0 || p.aliased || p.device_full == nullptr || id == for_id) continue;
      uint64_t d = ReuseDistance(id);
      if (victim == UINT32_MAX || d > best) {
        victim = id;
        best = d;
      }
    }
    if (victim == UINT32_MAX) {
      return Status::ResourceExhausted(
          "device budget too small to fetch parameter '" + params[for_id].info.name +
          "' while the acquired ones stay resident (budget " +
          FormatBytes(config.device_budget_bytes) + ", max_live_parameters " +
          std::to_string(config.max_live_parameters) +
          "); raise zinf.device_budget_bytes / stage3_max_live_parameters or acquire fewer "
          "parameters at once");
    }
    Evict(victim);
  }
  return Status::OK();
}

Status Engine::Impl::Fetch(ParamId id, bool prefetch) {
  Param& p = params[id];
  if (p.aliased) {
    p.device_full = p.device_part[Buf(visible)];
    p.state = FetchState::kResident;
    p.fetched_version = static_cast<uint64_t>(visible);
    return Status::OK();
  }
  if (p.device_full != nullptr) Evict(id);  // stale copy
  // NVMe: the pinned staging block first, so that a fetch that cannot have one leaves nothing
  // behind. Prefetches issued in earlier calls may hold it all while their reads are slow.
  std::shared_ptr<PinnedBuffer> staging;
  if (config.offload_param.tier == Tier::kNvme) {
    Result<PinnedBuffer> buf = arena->Allocate(PartBytes(p));
    if (!buf.ok() && !prefetch) {
      // Wait for the copies in flight: each hands its staging back once copied (fetches on
      // the copy stream, gradient partitions on the gradient stream).
      ZINF_RETURN_IF_ERROR(device->SynchronizeStream(copy_stream));
      ZINF_RETURN_IF_ERROR(device->SynchronizeStream(grad_stream));
      buf = arena->Allocate(PartBytes(p));
    }
    if (!buf.ok()) return buf.status().WithContext("staging parameter '" + p.info.name + "'");
    staging = std::make_shared<PinnedBuffer>(std::move(buf).value());
  }
  ZINF_RETURN_IF_ERROR(MakeRoom(p.padded_numel, FullBytes(p), id));
  ZINF_ASSIGN_OR_RETURN(p.device_full, DevAlloc(FullBytes(p), "parameter '" + p.info.name + "'"));
  live_elems += p.padded_numel;
  plan_bytes += FullBytes(p);
  Status s = IssueFetch(id, staging);
  if (!s.ok()) {
    // A buffer without a complete fetch issued into it must not stay: an Acquire would take
    // whatever that memory held for the parameter. Nothing may still write into it when it
    // goes back (the streams' own errors are the fetch's, reported by `s`).
    (void)device->SynchronizeStream(copy_stream);  // safe: only waits; `s` is the error
    (void)device->SynchronizeStream(comm_stream);  // safe: only waits; `s` is the error
    DropDeviceCopy(p);
    return s;
  }
  p.state = FetchState::kFetching;
  p.fetched_version = static_cast<uint64_t>(visible);
  return Status::OK();
}

Status Engine::Impl::IssueFetch(ParamId id, const std::shared_ptr<PinnedBuffer>& staging) {
  Param& p = params[id];
  if (!p.ready) {
    ZINF_ASSIGN_OR_RETURN(p.ready, device->CreateEvent());
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    p.fetch_status = Status::OK();
  }
  char* slot = static_cast<char*>(p.device_full) + static_cast<size_t>(rank) * PartBytes(p);
  const size_t part = PartBytes(p);
  switch (config.offload_param.tier) {
    case Tier::kNvme: {
      // Urgent: the trainer waits on parameters; optimizer read-ahead and write-backs can wait.
      ZINF_ASSIGN_OR_RETURN(
          Ticket t, swap->Read(p.swap_key[Buf(visible)], staging->data(), staging->capacity(),
                               /*urgent=*/true));
      // The copy stream waits for the read, then copies; the staging block returns after.
      (void)device->LaunchHostFunc(copy_stream, [this, t, id] {
        Status s = swap->Wait(t);
        if (!s.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          params[id].fetch_status = s;
        }
      });
      TimeCopy(copy_stream,
               [&] { return device->CopyHostToDevice(slot, staging->data(), part, copy_stream); });
      (void)device->LaunchHostFunc(copy_stream, [staging] { staging->Reset(); });
      {
        std::lock_guard<std::mutex> lock(mu);
        counters.h2d += part;
      }
      break;
    }
    case Tier::kCpu:
      TimeCopy(copy_stream, [&] {
        return device->CopyHostToDevice(slot, p.host_part[Buf(visible)].data(), part, copy_stream);
      });
      {
        std::lock_guard<std::mutex> lock(mu);
        counters.h2d += part;
      }
      break;
    case Tier::kDevice:
      ZINF_RETURN_IF_ERROR(
          device->CopyDeviceToDevice(slot, p.device_part[Buf(visible)], part, copy_stream));
      break;
  }
  ZINF_RETURN_IF_ERROR(device->RecordEvent(copy_done.get(), copy_stream));
  ZINF_RETURN_IF_ERROR(device->StreamWaitEvent(comm_stream, copy_done.get()));
  ZINF_RETURN_IF_ERROR(comm->AllGather(slot, p.device_full, part, comm_stream));
  return device->RecordEvent(p.ready.get(), comm_stream);
}

void Engine::Impl::TraceCheck(ParamId id) {
  if (trace_recording) {
    trace.push_back(id);
    return;
  }
  if (!trace_valid) return;
  if (trace_pos < trace.size() && trace[trace_pos] == id) {
    ++trace_pos;
    return;
  }
  std::string expected = trace_pos < trace.size() ? "'" + params[trace[trace_pos]].info.name + "'"
                                                  : "the end of the step";
  LogWarning("prefetch trace invalidated: acquire #" + std::to_string(trace_pos) + " was '" +
             params[id].info.name + "', the recorded trace expected " + expected +
             "; prefetching stops and parameters are fetched on demand");
  trace_valid = false;
}

void Engine::Impl::Prefetch() {
  if (!trace_valid) return;
  uint64_t inflight = 0;
  for (size_t i = trace_pos; i < trace.size(); ++i) {
    ParamId id = trace[i];
    Param& p = params[id];
    bool fresh = p.device_full != nullptr && p.fetched_version == static_cast<uint64_t>(visible);
    if (fresh) continue;
    // Still acquired from an older version (the trainer holds it): its memory must not move.
    if (p.acquired > 0) continue;
    // Delayed update: a parameter whose gradient this boundary micro-step has reduced may be
    // being rewritten by the optimizer (Acquire refuses it too).
    if (delayed && boundary_micro && p.grad_reduced_this_micro) continue;
    if (inflight + p.padded_numel > config.prefetch_bucket_size && inflight > 0) return;
    // Only prefetch into free budget: never evict for a prefetch.
    uint64_t grad_room = (p.padded_numel + p.info.partition_numel) * sizeof(float);
    if (config.device_budget_bytes != 0 &&
        plan_bytes + FullBytes(p) + grad_room > config.device_budget_bytes) {
      return;
    }
    if (live_elems + p.padded_numel > config.max_live_parameters) return;
    if (p.aliased) continue;
    Status s = Fetch(id, /*prefetch=*/true);
    if (!s.ok()) return;  // a prefetch failure resurfaces on demand
    inflight += p.padded_numel;
  }
}

Result<std::vector<void*>> Engine::Acquire(const std::vector<ParamId>& ids, AcquireMode mode) {
  Impl& m = *impl_;
  if (!m.broken.ok()) return m.broken;
  if (!m.registered) ZINF_RETURN_IF_ERROR(FinishRegistration());
  const bool training = mode == AcquireMode::kTraining;
  for (ParamId id : ids) {
    if (id >= m.params.size()) {
      return Status::InvalidArgument("Acquire: unknown parameter id " + std::to_string(id));
    }
    const Impl::Param& p = m.params[id];
    if (p.acquired > 0 &&
        !(p.device_full != nullptr && p.fetched_version == static_cast<uint64_t>(m.visible))) {
      return Status::FailedPrecondition(
          "Acquire('" + p.info.name +
          "'): it is still acquired from before the optimizer step "
          "that changed it (its memory holds the old values); release it first");
    }
  }
  if (!training && m.boundary_micro && m.reduced_this_micro) {
    // The optimizer may be rewriting the parameter stores of sub-groups whose gradients are
    // complete: an inference fetch now could read a half-written buffer.
    return Status::FailedPrecondition(
        "an inference Acquire between ReduceGradient and Step at an accumulation boundary: the "
        "optimizer may be rewriting the parameters; evaluate between optimizer steps");
  }
  if (training) m.KickEpoch();
  std::vector<void*> out;
  out.reserve(ids.size());
  // On failure no acquisition of this call stays counted.
  size_t counted = 0;
  auto undo = [&] {
    for (size_t k = 0; k < counted; ++k) --m.params[ids[k]].acquired;
  };
  for (ParamId id : ids) {
    if (training) m.TraceCheck(id);
    Impl::Param& p = m.params[id];
    if (training && m.delayed && m.boundary_micro && p.grad_reduced_this_micro) {
      undo();
      return Status::FailedPrecondition(
          "Acquire('" + p.info.name +
          "') after its ReduceGradient in the same micro-step: with zinf.delayed_update the "
          "optimizer may already be rewriting it; acquire a parameter for the last time before "
          "reducing its gradient");
    }
    bool fresh = p.device_full != nullptr && p.fetched_version == static_cast<uint64_t>(m.visible);
    if (training) {  // prefetch follows the training trace: inference acquires are not its
      std::lock_guard<std::mutex> lock(m.mu);
      (fresh ? m.counters.hits : m.counters.misses) += 1;
    }
    if (!fresh) {
      Status s = m.Fetch(id);
      if (!s.ok()) {
        undo();
        return s;
      }
    }
    ++p.acquired;
    ++counted;
  }
  m.Prefetch();
  auto t0 = Clock::now();
  for (ParamId id : ids) {
    Impl::Param& p = m.params[id];
    if (p.state == Impl::FetchState::kFetching) {
      Status w = m.device->StreamWaitEvent(m.device->ComputeStream(), p.ready.get());
      if (!w.ok()) {
        undo();
        return w;
      }
      if (m.device->IsHost()) p.state = Impl::FetchState::kResident;
    }
    Status s;
    {
      std::lock_guard<std::mutex> lock(m.mu);
      s = p.fetch_status;
    }
    if (!s.ok()) {
      undo();
      // A failed fetch is no cached copy: drop it so a later Acquire fetches again.
      m.Evict(id);
      {
        std::lock_guard<std::mutex> lock(m.mu);
        p.fetch_status = Status::OK();
      }
      return s.WithContext("fetching parameter '" + p.info.name + "'");
    }
    out.push_back(p.device_full);
  }
  std::lock_guard<std::mutex> lock(m.mu);
  m.counters.acquire_wait += Since(t0);
  return out;
}

Status Engine::Release(const std::vector<ParamId>& ids) {
  Impl& m = *impl_;
  for (ParamId id : ids) {
    if (id >= m.params.size() || m.params[id].acquired == 0) {
      return Status::FailedPrecondition("Release of parameter " + std::to_string(id) +
                                        " that is not acquired");
    }
    Impl::Param& p = m.params[id];
    if (--p.acquired > 0) continue;
    if (p.info.persistent || p.aliased) continue;
    if (m.ReuseDistance(id) <= m.config.max_reuse_distance) continue;
    m.Evict(id);
  }
  m.Prefetch();
  return Status::OK();
}

// ---- Gradients -------------------------------------------------------------------------------

Status Engine::ReduceGradient(ParamId id, const float* grad) {
  Impl& m = *impl_;
  if (!m.broken.ok()) return m.broken;
  if (id >= m.params.size()) {
    return Status::InvalidArgument("ReduceGradient: unknown parameter id " + std::to_string(id));
  }
  if (!m.registered) return Status::FailedPrecondition("ReduceGradient before any Acquire");
  m.KickEpoch();
  Impl::Param& p = m.params[id];
  if (!p.info.trainable) {
    return Status::FailedPrecondition("ReduceGradient('" + p.info.name +
                                      "'): the parameter is frozen (registered with trainable "
                                      "false); it takes no gradient");
  }
  if (p.grad_reduced_this_micro) {
    return Status::FailedPrecondition("ReduceGradient('" + p.info.name +
                                      "') twice in one micro-step");
  }
  const size_t full_bytes = p.padded_numel * sizeof(float);
  const size_t part = p.info.partition_numel;
  // The optimizer step this micro-step completes (0: none); the sub-group's accumulators must
  // be free of the previous window's step (delayed update) before this gradient goes in.
  const int64_t ready = m.boundary_micro ? m.step + 1 : 0;
  ZINF_RETURN_IF_ERROR(m.WaitStepped(m.groups[p.info.sub_group]));
  // Once its copy is queued: the parameter has a gradient in this window (the optimizer steps
  // it), and this micro-step has reduced one (inference acquires must wait for the step).
  auto mark_reduced = [&m, &p] {
    p.grad_seen_this_window = true;
    p.grad_reduced_this_micro = true;
    m.reduced_this_micro = true;
    std::lock_guard<std::mutex> lock(m.mu);
    m.groups[p.info.sub_group].has_grad[p.index_in_group] = 1;
  };
  if (m.world == 1 && !p.grad_seen_this_window) {
    // One rank, first gradient of the window: the reduction is the identity, so the
    // gradient goes straight into its accumulator (one copy instead of three, and no device
    // scratch). The copy is ordered on the compute stream, so the caller may reuse `grad`
    // as soon as this returns.
    ZINF_RETURN_IF_ERROR(m.EnsureGradBuffer(m.groups[p.info.sub_group])
                             .WithContext("gradient of '" + p.info.name + "'"));
    Stream* compute = m.device->ComputeStream();
    float* acc = m.GradAcc(p);
    m.TimeCopy(compute, [&] {
      return m.device->CopyDeviceToHost(acc, grad, p.info.numel * sizeof(float), compute);
    });
    mark_reduced();
    if (part > p.info.numel) {
      std::memset(acc + p.info.numel, 0, (part - p.info.numel) * sizeof(float));
    }
    ZINF_RETURN_IF_ERROR(m.device->RecordEvent(m.compute_done.get(), compute));
    ZINF_RETURN_IF_ERROR(m.device->StreamWaitEvent(m.grad_stream, m.compute_done.get()));
    ZINF_RETURN_IF_ERROR(
        m.device->LaunchHostFunc(m.grad_stream, [&m, id, ready] { m.GradLanded(id, ready); }));
    std::lock_guard<std::mutex> lock(m.mu);
    m.counters.d2h += p.info.numel * sizeof(float);
    return Status::OK();
  }
  ZINF_RETURN_IF_ERROR(m.MakeRoom(0, 0, id));
  ZINF_ASSIGN_OR_RETURN(void* scratch, m.DevAlloc(full_bytes + part * sizeof(float),
                                                  "gradient of '" + p.info.name + "'"));
  m.plan_bytes += full_bytes + part * sizeof(float);
  m.pending_scratch.push_back(full_bytes + part * sizeof(float));
  float* full = static_cast<float*>(scratch);
  float* mine = full + p.padded_numel;
  Stream* compute = m.device->ComputeStream();
  ZINF_RETURN_IF_ERROR(
      m.device->CopyDeviceToDevice(full, grad, p.info.numel * sizeof(float), compute));
  if (p.padded_numel > p.info.numel) {
    ZINF_RETURN_IF_ERROR(m.device->CopyHostToDevice(full + p.info.numel, m.zeros.data(),
                                                    (p.padded_numel - p.info.numel) * sizeof(float),
                                                    compute));
  }
  ZINF_RETURN_IF_ERROR(m.device->RecordEvent(m.compute_done.get(), compute));
  ZINF_RETURN_IF_ERROR(m.device->StreamWaitEvent(m.comm_stream, m.compute_done.get()));
  ZINF_RETURN_IF_ERROR(m.comm->ReduceScatterSum(full, mine, part, m.comm_stream));
  ZINF_RETURN_IF_ERROR(m.device->RecordEvent(m.comm_done.get(), m.comm_stream));
  ZINF_RETURN_IF_ERROR(m.device->StreamWaitEvent(m.grad_stream, m.comm_done.get()));
  const bool first = !p.grad_seen_this_window;
  ZINF_RETURN_IF_ERROR(m.EnsureGradBuffer(m.groups[p.info.sub_group])
                           .WithContext("gradient of '" + p.info.name + "'"));
  if (first) {
    m.TimeCopy(m.grad_stream, [&] {
      return m.device->CopyDeviceToHost(m.GradAcc(p), mine, part * sizeof(float), m.grad_stream);
    });
    mark_reduced();
    (void)m.device->LaunchHostFunc(m.grad_stream, [&m, scratch, full_bytes, part, id, ready] {
      m.DevFree(scratch, full_bytes + part * sizeof(float));
      m.GradLanded(id, ready);
    });
  } else {
    Result<PinnedBuffer> buf = m.arena->Allocate(part * sizeof(float));
    if (!buf.ok()) return buf.status().WithContext("staging gradient of '" + p.info.name + "'");
    auto staging = std::make_shared<PinnedBuffer>(std::move(buf).value());
    m.TimeCopy(m.grad_stream, [&] {
      return m.device->CopyDeviceToHost(staging->data(), mine, part * sizeof(float), m.grad_stream);
    });
    mark_reduced();
    (void)m.device->LaunchHostFunc(m.grad_stream,
                                   [&m, scratch, full_bytes, part, id, staging, ready] {
                                     float* acc = m.GradAcc(m.params[id]);
                                     const float* add = static_cast<const float*>(staging->data());
                                     for (size_t i = 0; i < part; ++i) acc[i] += add[i];
                                     staging->Reset();
                                     m.DevFree(scratch, full_bytes + part * sizeof(float));
                                     m.GradLanded(id, ready);
                                   });
  }
  std::lock_guard<std::mutex> lock(m.mu);
  m.counters.d2h += part * sizeof(float);
  return Status::OK();
}

Status Engine::Impl::EnsureGradBuffer(SubGroup& g) {
  if (g.grad_data != nullptr) return Status::OK();
  if (!stream_grads) return Status::Internal("gradient accumulators missing");
  // Wait for a free block; give up when the optimizer failed (it frees no more) or makes no
  // progress for a long time (it frees a sub-group's block after each step, so a stall means
  // it is stuck).
  constexpr auto kNoProgress = std::chrono::seconds(300);
  std::unique_lock<std::mutex> lock(mu);
  uint64_t seen = grad_releases;
  auto deadline = Clock::now() + kNoProgress;
  for (;;) {
    PooledBlock block = grad_pool.TryTake();
    if (block.data() != nullptr) {
      g.grad_block = std::move(block);
      g.grad_data = static_cast<float*>(g.grad_block.data());
      return Status::OK();
    }
    if (stopping) return Status::FailedPrecondition("engine shutting down");
    if (!optimizer_status.ok()) {
      return optimizer_status.WithContext(
          "no gradient accumulators are freed after an optimizer failure");
    }
    if (epochs.empty()) {
      return Status::Internal("every gradient block is taken with no optimizer step to free one");
    }
    // Blocks are freed only by stepping sub-groups, in order. When the optimizer waits for a
    // sub-group with a parameter the trainer has not reduced yet in this micro-step (it comes
    // after this gradient in program order, or lands only at Step), no block will come.
    // Gradients already reduced but still landing do not count: they complete the sub-group.
    std::string missing;
    if (waiting_group != SIZE_MAX && groups[waiting_group].ready_step < waiting_step) {
      for (ParamId q : groups[waiting_group].params) {
        if (params[q].info.trainable && !params[q].grad_reduced_this_micro) {
          missing = params[q].info.name;
          break;
        }
      }
    }
    if (!missing.empty()) {
      return Status::ResourceExhausted(
          "every streaming gradient block (" + FormatBytes(grad_pool.block_bytes()) +
          " each) is taken by sub-groups the optimizer reaches only after sub-group " +
          std::to_string(waiting_group) + ", which still waits for the gradient of '" + missing +
          "'; the optimizer steps sub-groups in reverse registration order. Raise "
          "zinf.pinned_budget_bytes (more blocks), lower sub_group_size, or register "
          "parameters so that their gradients come in reverse registration order");
    }
    if (cv.wait_until(lock, deadline) == std::cv_status::timeout) {
      if (grad_releases == seen) {
        return Status::ResourceExhausted(
            "waited " + std::to_string(kNoProgress.count()) +
            " s for the optimizer to free gradient accumulators (every block of " +
            FormatBytes(grad_pool.block_bytes()) +
            " is taken); is the backward order far from the registration order? raise "
            "zinf.pinned_budget_bytes or lower sub_group_size");
      }
      seen = grad_releases;
      deadline = Clock::now() + kNoProgress;
    }
  }
}

void Engine::Impl::ReleaseGradBuffer(SubGroup& g) {
  if (g.grad_block.data() == nullptr) return;
  g.grad_data = nullptr;
  g.grad_block.Reset();
  std::lock_guard<std::mutex> lock(mu);
  ++grad_releases;
  cv.notify_all();
}

// Runs on the gradient stream: a parameter's gradient is in its accumulator.
void Engine::Impl::GradLanded(ParamId id, int64_t ready) {
  std::lock_guard<std::mutex> lock(mu);
  LandLocked(groups[params[id].info.sub_group], ready);
}

// ---- Optimizer -------------------------------------------------------------------------------

void Engine::Impl::OptimizerLoop() {
  for (;;) {
    Epoch e;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stopping || !epochs.empty(); });
      if (epochs.empty()) return;
      e = epochs.front();
    }
    Status s = RunEpoch(e);
    // A delayed step's commit: its writes are complete and the next epoch's have not begun.
    // The micro-step after it reads the version before it. Never after a failed epoch: the
    // states it left (sub-groups not stepped) must not be published by a later one.
    bool earlier_failure;
    {
      std::lock_guard<std::mutex> lock(mu);
      earlier_failure = !optimizer_status.ok();
    }
    if (s.ok() && config.durable && DelayedStep(e.step)) {
      s = earlier_failure ? Status::FailedPrecondition(
                                "not committing step " + std::to_string(e.step) +
                                " of the durable store: an earlier optimizer step failed")
                          : CommitStore(e.step, e.step - 1);
    }
    std::lock_guard<std::mutex> lock(mu);
    epochs.pop_front();
    if (!s.ok() && optimizer_status.ok()) optimizer_status = s;
    done_step = e.step;
    // Sub-groups a failed epoch did not reach: their accumulators are not needed any more.
    for (SubGroup& g : groups) g.stepped_step = std::max(g.stepped_step, e.step);
    clip_coefs.erase(clip_coefs.begin(), clip_coefs.upper_bound(e.step));
    cv.notify_all();
  }
}

Status Engine::Impl::RunEpoch(const Epoch& e) {
  const std::vector<size_t> order = GroupOrder();
  const size_t buffers = std::max<uint32_t>(config.offload_optimizer.buffer_count, 3);
  // Pipeline (NVMe states): reads run ahead up to `buffers - 1` sub-groups; each sub-group's
  // write-back is waited for only when its buffer is needed again.
  struct Slot {
    PooledBlock states;
    Ticket read = 0;
    bool reading = false;
    std::vector<Ticket> writes;
  };
  std::deque<Slot> window;
  size_t next_read = 0;
  Status first;
  // Buffers whose write-back is in flight, oldest first.
  struct Retiring {
    PooledBlock states, copy;
    std::vector<Ticket> writes;
  };
  std::deque<Retiring> retiring;

  auto issue_reads = [&]() -> Status {
    while (next_read < order.size() && window.size() + retiring.size() < buffers) {
      const SubGroup& g = groups[order[next_read]];
      if (g.swap_key.empty()) {  // states not on NVMe: nothing to read ahead
        ++next_read;
        continue;
      }
      Slot slot;
      ZINF_ASSIGN_OR_RETURN(slot.states, state_pool.Take());
      ZINF_ASSIGN_OR_RETURN(slot.read,
                            swap->Read(g.swap_key, slot.states.data(), slot.states.capacity()));
      slot.reading = true;
      window.push_back(std::move(slot));
      ++next_read;
    }
    return Status::OK();
  };
  const bool device_params = config.offload_param.tier == Tier::kDevice;
  // Device copies of the updated parameters read from the retiring buffers (and, for fp32
  // parameters with CPU states, from the states themselves): wait for them before reuse.
  auto sync_updates = [&] {
    if (!device_params) return;
    Status s = device->SynchronizeStream(update_stream);
    if (!s.ok() && first.ok()) first = s.WithContext("copying updated parameters to the device");
  };
  auto retire_oldest = [&] {
    sync_updates();
    for (Ticket t : retiring.front().writes) {
      Status s = swap->Wait(t);
      if (!s.ok() && first.ok()) first = s;
    }
    retiring.pop_front();
  };
  // However this returns, no copy or I/O may still use the buffers it frees: write-backs
  // finish, device copies finish, reads issued ahead for sub-groups never reached (after a
  // failure) complete.
  struct Finally {
    std::function<void()> fn;
    void Run() {
      if (fn) fn();
      fn = nullptr;
    }
    ~Finally() { Run(); }
  } drain{[&] {
    while (!retiring.empty()) retire_oldest();
    sync_updates();
    for (Slot& slot : window) {
      if (slot.reading) (void)swap->Wait(slot.read);
    }
    window.clear();
  }};
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t gi = order[k];
    SubGroup& g = groups[gi];
    while (!retiring.empty() && window.size() + retiring.size() >= buffers) retire_oldest();
    const bool nvme = !g.swap_key.empty();
    {
      Status s = issue_reads();
      if (!s.ok()) return s;
    }
    // Wait for this sub-group's gradients (and, with clipping, the global norm).
    float coef = 1.0f;
    std::vector<uint8_t> with_grad;  // the parameters this step updates (the others skip it)
    {
      std::unique_lock<std::mutex> lock(mu);
      waiting_group = gi;
      waiting_step = e.step;
      cv.notify_all();  // a trainer waiting for a gradient block re-checks for a deadlock
      cv.wait(lock, [&] {
        return stopping || (g.ready_step >= e.step && (!e.clip || clip_coefs.count(e.step) != 0));
      });
      waiting_group = SIZE_MAX;
      if (stopping) return Status::FailedPrecondition("engine shutting down");
      if (e.clip) coef = clip_coefs[e.step];
      with_grad.swap(g.has_grad);
      g.has_grad.assign(g.params.size(), 0);
    }
    // Done with sub-group gi (stepped, or failed and left as it was): the trainer may put
    // the next window's gradients into its accumulators.
    auto mark_stepped = [&] {
      if (stream_grads) ReleaseGradBuffer(g);
      std::lock_guard<std::mutex> lock(mu);
      g.stepped_step = e.step;
      cv.notify_all();
    };
    if (g.on_device && config.offload_param.tier == Tier::kDevice) {
      // The device steps it and writes the parameters straight into their device stores.
      Status s = StepGroupOnDevice(gi, e, coef, with_grad);
      if (!s.ok() && first.ok()) first = s;
      mark_stepped();
      CrashPoint("optimizer.group");
      continue;
    }
    Retiring done;
    float* master;
    if (nvme) {
      Slot slot = std::move(window.front());
      window.pop_front();
      Status s = swap->Wait(slot.read);
      if (!s.ok()) {
        if (first.ok()) {
          first = s.WithContext("reading optimizer states of sub-group " + std::to_string(gi));
        }
        mark_stepped();
        continue;  // this sub-group keeps its old values; the step reports the failure
      }
      done.states = std::move(slot.states);
      master = static_cast<float*>(done.states.data());
    } else if (g.device_states != nullptr) {
      master = g.device_states;
    } else {
      master = g.master.data;
    }
    if (copy_type != ParamCopyType::kNone) {
      Result<PooledBlock> b = copy_pool.Take();
      if (!b.ok()) return b.status().WithContext("bf16 parameter buffer");
      done.copy = std::move(b).value();
    }
    Status s =
        StepGroup(gi, master, master + g.numel, master + 2 * g.numel,
                  static_cast<uint16_t*>(done.copy.data()), e, coef, with_grad, &done.writes);
    if (!s.ok() && first.ok()) first = s;
    // Every gradient of the sub-group has landed and been used: its accumulators can go.
    mark_stepped();
    CrashPoint("optimizer.group");
    if (nvme && s.ok()) {
      Result<Ticket> w =
          swap->Write(g.swap_key, done.states.data(), GroupStateBytes(g), done.states.capacity());
      if (w.ok()) {
        done.writes.push_back(*w);
      } else if (first.ok()) {
        first = w.status();
      }
    }
    retiring.push_back(std::move(done));
  }
  drain.Run();
  return first;
}

OptimizerHyperParams Engine::Impl::HyperParams(const Epoch& e, float coef) const {
  OptimizerHyperParams hp;
  switch (config.optimizer.type) {
    case OptimizerType::kAdam:
      hp.kind = OptimizerKind::kAdam;
      break;
    case OptimizerType::kAdamW:
      hp.kind = OptimizerKind::kAdamW;
      break;
    case OptimizerType::kAdagrad:
      hp.kind = OptimizerKind::kAdagrad;
      break;
    case OptimizerType::kLion:
      hp.kind = OptimizerKind::kLion;
      break;
  }
  hp.step = e.step;
  hp.lr = e.lr;
  hp.beta1 = config.optimizer.beta1;
  hp.beta2 = config.optimizer.beta2;
  hp.eps = config.optimizer.eps;
  hp.weight_decay = config.optimizer.weight_decay;
  hp.grad_scale = coef;
  return hp;
}

Status Engine::Impl::StepGroupOnDevice(size_t gi, const Epoch& e, float coef,
                                       const std::vector<uint8_t>& with_grad) {
  SubGroup& g = groups[gi];
  OptimizerHyperParams hp = HyperParams(e, coef);
  const int buf = Buf(e.step);
  const size_t grad_bytes = GroupGradBytes(g);
  auto t0 = Clock::now();
  // The gradients come from the host accumulators (the trainer's partitions land there).
  void* dev_grads = device_grads;
  float* master = g.device_states;
  float* m = master + g.numel;
  float* v = m + g.numel;
  for (ParamId id : g.params) {
    if (with_grad[params[id].index_in_group] && !e.clip) {
      ZINF_RETURN_IF_ERROR(CheckFinite(params[id], e.step));
    }
  }
  // No accumulators (streaming, no gradient in the group this window): nothing is stepped.
  Status s = g.grad_data == nullptr
                 ? Status::OK()
                 : device->CopyHostToDevice(dev_grads, g.grad_data, grad_bytes, update_stream);
  for (ParamId id : g.params) {
    if (!s.ok()) break;
    Param& p = params[id];
    OptimizerTensors t =
        PartTensors(p, hp, master, m, v, static_cast<const float*>(dev_grads) + p.slice_offset);
    if (!with_grad[p.index_in_group]) {
      // Not updated. Its store buffer for this version must still hold its values: the
      // masters' (fp32), or the previous version's buffer (bf16; the same buffer without the
      // delayed update).
      if (copy_type == ParamCopyType::kNone) {
        s = device->CopyDeviceToDevice(p.device_part[buf], t.param, PartBytes(p), update_stream);
      } else if (p.device_part[1 - buf] != nullptr &&
                 p.device_part[1 - buf] != p.device_part[buf]) {
        s = device->CopyDeviceToDevice(p.device_part[buf], p.device_part[1 - buf], PartBytes(p),
                                       update_stream);
      }
      continue;
    }
    hp.step = p.updates + 1;
    if (copy_type != ParamCopyType::kNone) {
      t.param_copy = p.device_part[buf];
      t.param_copy_type = copy_type;
    }
    s = device->OptimizerStep(hp, t, update_stream)
            .WithContext("device optimizer step of '" + p.info.name + "'");
    if (s.ok()) ++p.updates;
    if (s.ok() && copy_type == ParamCopyType::kNone) {
      s = device->CopyDeviceToDevice(p.device_part[buf], t.param, PartBytes(p), update_stream);
    }
  }
  // Whatever was queued finishes before the gradients' buffer is reused.
  Status synced = device->SynchronizeStream(update_stream);
  {
    std::lock_guard<std::mutex> lock(mu);
    counters.optimizer_busy += Since(t0);
    counters.h2d += grad_bytes;
  }
  ZINF_RETURN_IF_ERROR(s);
  return synced.WithContext("device optimizer step of sub-group " + std::to_string(gi));
}

Status Engine::Impl::StepGroup(size_t gi, float* master, float* m, float* v, uint16_t* copy_out,
                               const Epoch& e, float coef, const std::vector<uint8_t>& with_grad,
                               std::vector<Ticket>* writes) {
  SubGroup& g = groups[gi];
  OptimizerHyperParams hp = HyperParams(e, coef);
  auto t0 = Clock::now();
  for (ParamId id : g.params) {
    Param& p = params[id];
    if (!with_grad[p.index_in_group]) {
      // Not updated (no gradient in the window); its store is rewritten from the masters.
      if (copy_out != nullptr) {
        Status s = optimizer->ConvertParams(master + p.slice_offset, copy_out + p.slice_offset,
                                            copy_type, p.info.partition_numel);
        if (!s.ok()) return s.WithContext("converting '" + p.info.name + "'");
      }
      continue;
    }
    if (!e.clip) ZINF_RETURN_IF_ERROR(CheckFinite(p, e.step));  // (clipping checked the norm)
    OptimizerTensors t = PartTensors(p, hp, master, m, v, GradAcc(p));
    if (copy_out != nullptr) {
      t.param_copy = copy_out + p.slice_offset;
      t.param_copy_type = copy_type;
    }
    hp.step = p.updates + 1;
    Status s = optimizer->Step(hp, t);
    if (!s.ok()) return s.WithContext("optimizer step of '" + p.info.name + "'");
    ++p.updates;
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    counters.optimizer_busy += Since(t0);
  }
  return WriteParamStore(gi, master, copy_out, Buf(e.step), writes);
}

Status Engine::Impl::WriteParamStore(size_t gi, const float* master, const uint16_t* copy_out,
                                     int buf, std::vector<Ticket>* writes) {
  SubGroup& g = groups[gi];
  for (ParamId id : g.params) {
    Param& p = params[id];
    const void* src = copy_out != nullptr ? static_cast<const void*>(copy_out + p.slice_offset)
                                          : static_cast<const void*>(master + p.slice_offset);
    const size_t bytes = PartBytes(p);
    switch (config.offload_param.tier) {
      case Tier::kDevice:
        TimeCopy(update_stream, [&] {
          return device->CopyHostToDevice(p.device_part[buf], src, bytes, update_stream);
        });
        {
          std::lock_guard<std::mutex> lock(mu);
          counters.h2d += bytes;
        }
        break;
      case Tier::kCpu:
        std::memcpy(p.host_part[buf].data(), src, bytes);
        break;
      case Tier::kNvme: {
        // Slices are 4 KiB aligned and padded inside the sub-group buffer.
        ZINF_ASSIGN_OR_RETURN(Ticket t,
                              swap->Write(p.swap_key[buf], src, bytes, RoundUp(bytes, 4096)));
        writes->push_back(t);
        break;
      }
    }
  }
  // Device tier: the copies run on the update stream while the optimizer steps the next
  // sub-groups; RunEpoch synchronizes it before a source buffer is reused and at its end.
  if (config.offload_param.tier == Tier::kDevice && writes == nullptr) {
    ZINF_RETURN_IF_ERROR(device->SynchronizeStream(update_stream));
  }
  return Status::OK();
}

Result<StepStats> Engine::Step() {
  Impl& m = *impl_;
  if (!m.broken.ok()) return m.broken;
  if (!m.registered) ZINF_RETURN_IF_ERROR(FinishRegistration());
  m.KickEpoch();
  const bool boundary = (m.micro + 1) % std::max(1, m.config.gradient_accumulation_steps) == 0;
  // Gradients of this micro-step must have landed before the next one starts.
  Status s = m.ReclaimScratch();
  if (s.ok()) s = m.TakeAsyncError();
  if (!s.ok()) {
    m.broken = Status::FailedPrecondition(
        "the engine stopped after an error in a previous "
        "step (" +
        s.message() +
        "); recreate it (from a "
        "checkpoint) to continue");
    return s;
  }
  StepStats st;
  auto wait0 = Clock::now();
  // A boundary Step that fails part-way has landed some gradients and left the optimizer
  // waiting for the rest: it cannot be retried.
  auto fail_boundary = [&m](const Status& err) {
    m.broken = Status::FailedPrecondition(
        "the engine stopped: a Step at an accumulation boundary failed (" + err.message() +
        "); recreate it (from a checkpoint) to continue");
    return err;
  };
  if (boundary) {
    // Parameters that got no gradient in the whole window: the optimizer skips them (their
    // has_grad flag is unset); their accumulators are zeroed so that the clipping norm and a
    // device step's gradient copy read zeros, not the last window's values.
    // The optimizer thread has this epoch since the micro-step began and may have stepped the
    // sub-groups whose gradients are complete. Parameters not reduced in this last micro-step
    // have final accumulators already: count them as landed.
    // (Streaming accumulators: a sub-group none of whose parameters has a gradient holds no
    // block, and nothing reads its accumulators, so there is nothing to zero.)
    for (Impl::Param& p : m.params) {
      if (p.grad_reduced_this_micro || !p.info.trainable) continue;
      Impl::SubGroup& g = m.groups[p.info.sub_group];
      if (!p.grad_seen_this_window) {
        s = m.WaitStepped(g);
        if (!s.ok()) return fail_boundary(s.WithContext("zero gradient of '" + p.info.name + "'"));
        if (g.grad_data != nullptr) {
          std::memset(m.GradAcc(p), 0, p.info.partition_numel * sizeof(float));
        }
      }
      std::lock_guard<std::mutex> lock(m.mu);
      m.LandLocked(g, m.step + 1);
    }
    const bool clip = m.config.gradient_clipping > 0;
    if (clip) {
      // Wait-for-norm: every sub-group waits for the global norm, computed here once all
      // gradients have landed (they have: the copy stream was synchronized above).
      double local = 0;
      for (Impl::Param& p : m.params) {
        Result<GradStats> gs =
            m.optimizer->GradSumSquares(m.GradAcc(p), GradType::kF32, p.info.partition_numel);
        if (!gs.ok()) return fail_boundary(gs.status());
        local += gs->sum_squares;
      }
      float total = static_cast<float>(local);
      s = m.AllReduceHost(&total, 1, m.device->ComputeStream(), "gradient norm");
      if (!s.ok()) return fail_boundary(s);
      double norm = std::sqrt(static_cast<double>(total));
      st.grad_norm = norm;
      if (!std::isfinite(norm)) {
        // No sub-group has been stepped (they wait for the norm): nothing non-finite is
        // written, and the step is refused as a whole.
        return fail_boundary(Status::FailedPrecondition(
            "the gradient norm of step " + std::to_string(m.step + 1) +
            " is not finite (a gradient holds inf or NaN): no parameter was updated; lower the "
            "learning rate or look at the loss, then resume from the last checkpoint"));
      }
      float coef = 1.0f;
      if (norm > m.config.gradient_clipping) {
        coef = static_cast<float>(m.config.gradient_clipping / (norm + 1e-6));
      }
      std::lock_guard<std::mutex> lock(m.mu);
      m.clip_coefs[m.step + 1] = coef;
      m.cv.notify_all();
    }
    // Without the delayed update, this window's optimizer step must be done: the next
    // micro-step reads its parameters. With it, the next micro-step reads the previous step's
    // (version m.step), and this one runs on while the trainer goes on.
    Status opt = m.WaitDone(m.DelayedStep(m.step + 1) ? m.step : m.step + 1);
    if (!opt.ok()) {
      m.broken = Status::FailedPrecondition(
          "the optimizer failed (" + opt.message() +
          "); parameters may be partly updated: recreate the engine from a checkpoint");
      return opt;
    }
    ++m.step;
    m.visible = m.DelayedStep(m.step) ? std::max(m.visible, m.step - 1) : m.step;
    for (Impl::Param& p : m.params) p.grad_seen_this_window = false;
    st.optimizer_ran = true;
    // Durable: the step's writes are complete (the optimizer waited for them): publish them.
    // A delayed step is committed by the optimizer thread once its update is written.
    s = m.DelayedStep(m.step) ? Status::OK() : m.CommitStore(m.step, m.visible);
    if (!s.ok()) {
      m.broken = Status::FailedPrecondition("the durable swap store could not commit step " +
                                            std::to_string(m.step) + " (" + s.message() +
                                            "); resume from its last commit");
      return s;
    }
  }
  double opt_wait = Since(wait0);
  ++m.micro;
  m.BeginMicroStep();
  m.in_micro = false;
  if (m.trace_recording && !m.trace.empty()) {
    m.trace_recording = false;
    m.trace_valid = true;
  }
  m.trace_pos = 0;
  // The updated parameters are in their stores: start fetching the next micro-step's first
  // ones now, while the trainer prepares its next batch.
  m.Prefetch();

  // Statistics.
  st.step = m.step;
  st.step_seconds = Since(m.step_start);
  st.trace_valid = m.trace_valid;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    Impl::Counters& c = m.counters;
    st.h2d_bytes = c.h2d;
    st.d2h_bytes = c.d2h;
    st.copy_busy_seconds = c.copy_busy;
    st.optimizer_busy_seconds = c.optimizer_busy;
    st.acquire_wait_seconds = c.acquire_wait;
    st.optimizer_wait_seconds = opt_wait + c.optimizer_wait;
    st.prefetch_hits = c.hits;
    st.prefetch_misses = c.misses;
    st.peak_device_bytes = m.device_peak;
    c = Impl::Counters();
    m.device_peak = m.device_bytes;
  }
  if (m.swap) {
    SwapStoreStats now = m.swap->stats();
    st.nvme_read_bytes = now.bytes_read - m.swap_base.bytes_read;
    st.nvme_write_bytes = now.bytes_written - m.swap_base.bytes_written;
    st.nvme_busy_seconds = now.busy_seconds - m.swap_base.busy_seconds;
    st.nvme_bytes = now.file_bytes;
    m.swap_base = now;
  }
  st.peak_pinned_bytes = m.arena ? m.arena->peak_used() : 0;
  double compute = st.step_seconds - st.acquire_wait_seconds - st.optimizer_wait_seconds;
  double busiest = std::max({st.nvme_busy_seconds, st.copy_busy_seconds, st.optimizer_busy_seconds,
                             std::max(compute, 0.0)});
  st.overlap_efficiency = st.step_seconds > 0 ? std::min(1.0, busiest / st.step_seconds) : 0;
  m.step_start = Clock::now();
  return st;
}

// ---- Checkpoints -----------------------------------------------------------------------------

Status Engine::Impl::AllReduceHost(float* values, size_t count, Stream* stream,
                                   const std::string& what) {
  const size_t bytes = count * sizeof(float);
  const bool small = bytes <= kSmallScratchBytes;
  void* dev = small_scratch;
  if (!small) {
    ZINF_ASSIGN_OR_RETURN(dev, DevAlloc(bytes, what));
  }
  Status st = device->CopyHostToDevice(dev, values, bytes, stream);
  if (st.ok()) st = comm->AllReduceSum(static_cast<float*>(dev), count, stream);
  if (st.ok()) st = device->CopyDeviceToHost(values, dev, bytes, stream);
  if (st.ok()) st = device->SynchronizeStream(stream);
  if (!small) DevFree(dev, bytes);
  return st.WithContext(what);
}

Status Engine::Impl::AllGatherHost(const void* send, void* recv, size_t bytes_per_rank,
                                   const std::string& what) {
  const size_t all = bytes_per_rank * static_cast<size_t>(world);
  const bool small = all + bytes_per_rank <= kSmallScratchBytes;
  void* dev = small_scratch;
  if (!small) {
    ZINF_ASSIGN_OR_RETURN(dev, DevAlloc(all + bytes_per_rank, what));
  }
  char* full = static_cast<char*>(dev);
  char* slot = full + all;
  Stream* s = comm_stream;
  Status st = device->CopyHostToDevice(slot, send, bytes_per_rank, s);
  if (st.ok()) st = comm->AllGather(slot, full, bytes_per_rank, s);
  if (st.ok()) st = device->CopyDeviceToHost(recv, full, all, s);
  if (st.ok()) st = device->SynchronizeStream(s);
  if (!small) DevFree(dev, all + bytes_per_rank);
  return st.WithContext(what);
}

Status Engine::Impl::Agree(const Status& local, const std::string& what) {
  float failed = local.ok() ? 0.0f : 1.0f;
  Status st = AllReduceHost(&failed, 1, device->ComputeStream(), what);
  if (!st.ok()) return st;
  if (!local.ok()) return local;
  if (failed > 0) {
    return Status::FailedPrecondition(what + ": another rank failed (its error names the cause)");
  }
  return Status::OK();
}

Status Engine::Impl::CheckBetweenSteps(const char* what) const {
  if (!broken.ok()) return broken;
  if (in_micro || micro % std::max(1, config.gradient_accumulation_steps) != 0) {
    return Status::FailedPrecondition(std::string(what) +
                                      " must be called between optimizer steps (after Step() at "
                                      "an accumulation boundary, before the next Acquire)");
  }
  for (const Param& p : params) {
    if (p.acquired > 0) {
      return Status::FailedPrecondition(std::string(what) + ": parameter '" + p.info.name +
                                        "' is still acquired");
    }
  }
  return Status::OK();
}

Status Engine::Impl::ReadGroupStates(size_t gi, void* buf) {
  SubGroup& g = groups[gi];
  const size_t bytes = GroupStateBytes(g);
  if (!g.swap_key.empty()) {
    ZINF_ASSIGN_OR_RETURN(Ticket t, swap->Read(g.swap_key, buf, RoundUp(bytes, 4096)));
    return swap->Wait(t);
  }
  if (g.device_states != nullptr) {
    ZINF_RETURN_IF_ERROR(device->CopyDeviceToHost(buf, g.device_states, bytes, update_stream));
    return device->SynchronizeStream(update_stream);
  }
  std::memcpy(buf, g.master.data, bytes);
  return Status::OK();
}

Status Engine::Impl::WriteGroupStates(size_t gi, const void* buf, int buf_index) {
  SubGroup& g = groups[gi];
  const size_t bytes = GroupStateBytes(g);
  if (!g.swap_key.empty()) {
    ZINF_ASSIGN_OR_RETURN(Ticket t, swap->Write(g.swap_key, buf, bytes, RoundUp(bytes, 4096)));
    ZINF_RETURN_IF_ERROR(swap->Wait(t));
  } else if (g.device_states != nullptr) {
    ZINF_RETURN_IF_ERROR(device->CopyHostToDevice(g.device_states, buf, bytes, update_stream));
    ZINF_RETURN_IF_ERROR(device->SynchronizeStream(update_stream));
  } else {
    std::memcpy(g.master.data, buf, bytes);
  }
  // The parameter store: the masters in the storage dtype.
  const float* master = static_cast<const float*>(buf);
  std::unique_ptr<AlignedBuffer> copy;
  if (copy_type != ParamCopyType::kNone) {
    copy = std::make_unique<AlignedBuffer>(g.numel * 2);
    for (ParamId id : g.params) {
      const Param& p = params[id];
      ZINF_RETURN_IF_ERROR(optimizer->ConvertParams(
          master + p.slice_offset, static_cast<uint16_t*>(copy->data) + p.slice_offset, copy_type,
          p.info.partition_numel));
    }
  }
  if (config.offload_param.tier != Tier::kNvme) {
    return WriteParamStore(gi, master, copy ? static_cast<const uint16_t*>(copy->data) : nullptr,
                           buf_index, nullptr);
  }
  std::vector<Ticket> writes;
  Status s = WriteParamStore(gi, master, copy ? static_cast<const uint16_t*>(copy->data) : nullptr,
                             buf_index, &writes);
  for (Ticket t : writes) {
    Status w = swap->Wait(t);
    if (s.ok()) s = w;
  }
  return s;
}

Status Engine::PrepareCheckpointDir(const std::string& dir) {
  Impl& m = *impl_;
  Status local;
  if (m.rank == 0) local = m.LockCheckpointDir(dir, /*create=*/true);
  return m.Agree(local, "PrepareCheckpointDir");
}

Status Engine::Impl::LockCheckpointDir(const std::string& dir, bool create) {
  if (dir.empty() || !IsValidUtf8(dir)) {
    return Status::InvalidArgument("checkpoint folder '" + dir +
                                   "': give a non-empty path in valid UTF-8");
  }
  std::unique_ptr<FolderLock>& lock = checkpoint_locks[dir];
  if (create) {  // about to write: exclusive
    if (lock != nullptr) ZINF_RETURN_IF_ERROR(lock->MakeExclusive());
    return checkpoint_folder::Prepare(dir, &lock);
  }
  struct stat st {};
  if (lock == nullptr && stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    // Reading: shared with other readers, not with a run writing there.
    ZINF_ASSIGN_OR_RETURN(lock, FolderLock::Acquire(dir, checkpoint_folder::kLockName,
                                                    "checkpoint folder", /*shared=*/true));
  }
  return Status::OK();
}

namespace {

// Whether `folder` holds a checkpoint whose rank-0 manifest reads back intact and whose
// states file has the size it lists (for pruning: the newest such one before the new
// checkpoint is kept; the tensors' checksums are the load's business).
bool ReadableCheckpoint(const std::string& folder) {
  Result<std::string> text = ReadSmallFile(folder + "/rank0.json", 1 << 30);
  if (!text.ok()) return false;
  Result<RankManifest> man = ParseRankManifest(*text, folder + "/rank0.json");
  struct stat st {};
  return man.ok() && stat((folder + "/" + man->states_file).c_str(), &st) == 0 &&
         S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_size) == man->file_bytes;
}

}  // namespace

Status Engine::SaveCheckpoint(const std::string& dir, const std::string& user_data) {
  Impl& m = *impl_;
  if (!m.registered) ZINF_RETURN_IF_ERROR(FinishRegistration());
  ZINF_RETURN_IF_ERROR(m.CheckBetweenSteps("SaveCheckpoint"));
  if (!IsValidUtf8(user_data)) {
    return Status::InvalidArgument(
        "SaveCheckpoint: the user data is not valid UTF-8 (it goes "
        "into the JSON manifest); encode it, e.g. as base64");
  }
  ZINF_RETURN_IF_ERROR(m.ReclaimScratch());
  ZINF_RETURN_IF_ERROR(m.Agree(m.FinishPendingUpdate(), "SaveCheckpoint"));
  namespace fs = std::filesystem;
  const std::string incoming = dir + "/" + checkpoint_folder::kIncoming;
  // Rank 0 makes sure of the folder (created 0700, writable, locked) and prepares an empty
  // staging folder.
  Status local;
  if (m.rank == 0) {
    local = m.LockCheckpointDir(dir, /*create=*/true);
    std::error_code ec;
    if (local.ok()) fs::remove_all(incoming, ec);
    if (local.ok() && !ec && mkdir(incoming.c_str(), 0700) != 0) {
      local = ErrnoToStatus(errno, "creating " + incoming);
    }
    if (local.ok() && ec) {
      local = Status::IoError("preparing checkpoint folder " + incoming + ": " + ec.message());
    }
  }
  ZINF_RETURN_IF_ERROR(m.Agree(local, "SaveCheckpoint"));

  // Every rank writes its states file and manifest.
  RankManifest man;
  man.rank = m.rank;
  man.world = m.world;
  man.step = m.step;
  man.optimizer = OptimizerTypeName(m.config.optimizer.type);
  man.states_file = "rank" + std::to_string(m.rank) + ".states";
  man.user_data = user_data;
  const std::string states_path = incoming + "/" + man.states_file;
  local = [&]() -> Status {
    size_t max_bytes = 0;
    for (const Impl::SubGroup& g : m.groups) max_bytes = std::max(max_bytes, m.GroupStateBytes(g));
    AlignedBuffer buf(max_bytes);
    if (buf.data == nullptr) return Status::ResourceExhausted("checkpoint staging buffer");
    ZINF_ASSIGN_OR_RETURN(int fd, CreateExclusive(states_path));
    uint64_t offset = 0;
    Status s;
    man.tensors.resize(m.params.size());
    for (size_t gi = 0; gi < m.groups.size() && s.ok(); ++gi) {
      const Impl::SubGroup& g = m.groups[gi];
      s = m.ReadGroupStates(gi, buf.data);
      if (!s.ok()) {
        s = s.WithContext("reading optimizer states of sub-group " + std::to_string(gi));
        break;
      }
      const float* f = static_cast<const float*>(buf.data);
      for (ParamId id : g.params) {
        const Impl::Param& p = m.params[id];
        CheckpointTensor& t = man.tensors[id];
        t.name = p.info.name;
        t.numel = p.info.numel;
        t.partition_numel = p.info.partition_numel;
        t.sub_group = gi;
        t.slice_offset = p.slice_offset;
        t.updates = p.updates;
        for (int k = 0; k < 3; ++k) {
          t.hash[k] =
              XXH3_64bits(f + k * g.numel + p.slice_offset, p.info.partition_numel * sizeof(float));
        }
      }
      s = PwriteAll(fd, buf.data, m.GroupStateBytes(g), offset, states_path);
      man.groups.push_back({g.numel, offset});
      offset += m.GroupStateBytes(g);
    }
    if (s.ok() && fsync(fd) != 0) s = ErrnoToStatus(errno, "fsync of " + states_path);
    close(fd);
    ZINF_RETURN_IF_ERROR(s);
    man.file_bytes = offset;
    const std::string man_path = incoming + "/rank" + std::to_string(m.rank) + ".json";
    const std::string text = SerializeRankManifest(man);  // names and user data are UTF-8
    ZINF_ASSIGN_OR_RETURN(int mfd, CreateExclusive(man_path));
    s = PwriteAll(mfd, text.data(), text.size(), 0, man_path);
    if (s.ok() && fsync(mfd) != 0) s = ErrnoToStatus(errno, "fsync of " + man_path);
    close(mfd);
    return s;
  }();
  ZINF_RETURN_IF_ERROR(m.Agree(local, "SaveCheckpoint"));
  CrashPoint("checkpoint.files");

  // Rank 0 commits: the staging folder gets its final name, then `latest` names it; then the
  // checkpoints older than the newest readable one before it go.
  if (m.rank == 0) {
    Result<std::string> name = checkpoint_folder::Commit(dir, m.step);
    local = name.status();
    if (name.ok()) checkpoint_folder::Prune(dir, *name, &ReadableCheckpoint);
  }
  return m.Agree(local, "SaveCheckpoint");
}

// Pass 1 of a load: parse, match the layout and verify every checksum of `folder`; nothing
// changes. Leaves the manifest in *man and the open states file in *fd.
Status Engine::Impl::ValidateCheckpoint(const std::string& folder, RankManifest* man, int* fd,
                                        std::string* states_path, AlignedBuffer* buf) {
  const std::string man_path = folder + "/rank" + std::to_string(rank) + ".json";
  ZINF_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(man_path, 1 << 30));
  ZINF_ASSIGN_OR_RETURN(*man, ParseRankManifest(text, man_path));
  auto mismatch = [&](const std::string& what) {
    return Status::FailedPrecondition(man_path +
                                      ": the checkpoint does not match this model: " + what);
  };
  if (man->world != world || man->rank != rank) {
    return mismatch("saved by rank " + std::to_string(man->rank) + " of " +
                    std::to_string(man->world) + ", loading as rank " + std::to_string(rank) +
                    " of " + std::to_string(world));
  }
  if (man->optimizer != OptimizerTypeName(config.optimizer.type)) {
    return mismatch("optimizer " + man->optimizer + ", this engine runs " +
                    OptimizerTypeName(config.optimizer.type));
  }
  if (man->tensors.size() != params.size() || man->groups.size() != groups.size()) {
    return mismatch(std::to_string(man->tensors.size()) + " tensors in " +
                    std::to_string(man->groups.size()) + " sub-groups, this engine has " +
                    std::to_string(params.size()) + " in " + std::to_string(groups.size()) +
                    " (same sub_group_size?)");
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    const CheckpointTensor& t = man->tensors[i];
    if (t.name != p.info.name || t.numel != p.info.numel ||
        t.partition_numel != p.info.partition_numel || t.sub_group != p.info.sub_group ||
        t.slice_offset != p.slice_offset) {
      return mismatch("tensor " + std::to_string(i) + " is '" + t.name + "' with " +
                      std::to_string(t.numel) + " elements, this engine has '" + p.info.name +
                      "' with " + std::to_string(p.info.numel));
    }
  }
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    if (man->groups[gi].numel != groups[gi].numel) {
      return mismatch("sub-group " + std::to_string(gi) + " size differs");
    }
  }
  *states_path = folder + "/" + man->states_file;
  *fd = open(states_path->c_str(), O_RDONLY | O_CLOEXEC);
  if (*fd < 0) return ErrnoToStatus(errno, "opening " + *states_path);
  struct stat st {};
  if (fstat(*fd, &st) != 0) return ErrnoToStatus(errno, "stat of " + *states_path);
  if (static_cast<uint64_t>(st.st_size) != man->file_bytes) {
    return Status::Corruption(*states_path + " has " + std::to_string(st.st_size) +
                              " bytes, its manifest says " + std::to_string(man->file_bytes) +
                              " (a torn checkpoint)");
  }
  if (buf->data == nullptr) return Status::ResourceExhausted("checkpoint buffer");
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const SubGroup& g = groups[gi];
    ZINF_RETURN_IF_ERROR(PreadAll(*fd, buf->data, GroupStateBytes(g), man->groups[gi].offset,
                                  *states_path, "a torn checkpoint"));
    const float* f = static_cast<const float*>(buf->data);
    static const char* const kState[] = {"master weights", "exp_avg", "exp_avg_sq"};
    for (size_t j = 0; j < g.params.size(); ++j) {
      const Param& p = params[g.params[j]];
      const CheckpointTensor& t = man->tensors[g.params[j]];
      for (int k = 0; k < 3; ++k) {
        if (XXH3_64bits(f + k * g.numel + p.slice_offset, p.info.partition_numel * 4) !=
            t.hash[k]) {
          return Status::Corruption("checkpoint tensor '" + p.info.name + "' (" + kState[k] +
                                    ") in " + *states_path + " does not match its checksum");
        }
      }
    }
  }
  return Status::OK();
}

Status Engine::LoadCheckpoint(const std::string& dir, std::string* user_data,
                              bool fall_back_to_older) {
  Impl& m = *impl_;
  if (!m.registered) ZINF_RETURN_IF_ERROR(FinishRegistration());
  ZINF_RETURN_IF_ERROR(m.CheckBetweenSteps("LoadCheckpoint"));
  ZINF_RETURN_IF_ERROR(m.ReclaimScratch());
  ZINF_RETURN_IF_ERROR(m.Agree(m.FinishPendingUpdate(), "LoadCheckpoint"));
  Status local = m.rank == 0 ? m.LockCheckpointDir(dir, /*create=*/false) : Status::OK();
  ZINF_RETURN_IF_ERROR(m.Agree(local, "LoadCheckpoint"));
  // Which checkpoints there are: "none yet" only for a folder that holds none at all; a
  // `latest` that cannot be read, or step folders without one, is damage.
  ZINF_ASSIGN_OR_RETURN(checkpoint_folder::Listing listing, checkpoint_folder::List(dir));
  if (!listing.exists || listing.Empty()) {
    return Status::NotFound("no checkpoint in " + dir + " (the folder " +
                            (listing.exists ? "holds none" : "does not exist") + ")");
  }
  // A step folder gets its name only once complete, so the newest one is a committed
  // checkpoint even when `latest` (a pointer written right after) is missing or unreadable:
  // that is then said, not fatal. The candidate chosen must validate in full; a damaged one is
  // an error unless falling back is allowed.
  std::vector<std::string> candidates = checkpoint_folder::Candidates(dir, listing);
  std::string damage;
  if (!listing.latest_status.ok()) {
    damage = listing.latest_status.message();
  } else if (listing.latest.empty() && !listing.single) {
    damage = dir + "/latest is missing";
  }
  size_t max_bytes = 0;
  for (const Impl::SubGroup& g : m.groups) max_bytes = std::max(max_bytes, m.GroupStateBytes(g));
  AlignedBuffer buf(max_bytes);
  RankManifest man;
  int fd = -1;
  struct FdCloser {
    int* fd;
    ~FdCloser() {
      if (*fd >= 0) close(*fd);
    }
  } closer{&fd};
  std::string states_path, used;
  std::vector<std::string> tried;
  for (const std::string& folder : candidates) {
    if (fd >= 0) {
      close(fd);
      fd = -1;
    }
    local = m.ValidateCheckpoint(folder, &man, &fd, &states_path, &buf);
    Status agreed = m.Agree(local, "LoadCheckpoint");
    if (agreed.ok()) {
      used = folder;
      break;
    }
    // A checkpoint of another model is no damage: an older one would not fit either.
    if (agreed.code() == StatusCode::kFailedPrecondition && !local.ok()) return agreed;
    tried.push_back(folder + " (" + agreed.message() + ")");
    if (!fall_back_to_older) {
      return Status::Corruption("the newest checkpoint " + folder +
                                " is damaged: " + agreed.message() +
                                "; load the one before (LoadCheckpoint's fall_back_to_older; "
                                "zinf-train --resume --fallback) or repair it");
    }
  }
  if (used.empty()) {
    std::string list;
    for (const std::string& t : tried) list += (list.empty() ? "" : "; ") + t;
    return Status::Corruption("no readable checkpoint in " + dir + ": " + list);
  }
  if (!tried.empty()) {
    std::string list;
    for (const std::string& t : tried) list += (list.empty() ? "" : "; ") + t;
    LogWarning("loading " + used + ", not the newest checkpoint, which is damaged: " + list);
  } else if (!damage.empty()) {
    LogWarning(damage + "; loading " + used + ", the newest complete checkpoint");
  }

  // Pass 2: install. Fetched parameter copies are stale from here on.
  m.gather_states.reset();
  for (Impl::Param& p : m.params) m.Evict(static_cast<ParamId>(&p - m.params.data()));
  for (size_t gi = 0; gi < m.groups.size() && local.ok(); ++gi) {
    local = PreadAll(fd, buf.data, m.GroupStateBytes(m.groups[gi]), man.groups[gi].offset,
                     states_path, "a torn checkpoint");
    if (local.ok()) local = m.WriteGroupStates(gi, buf.data, m.Buf(man.step));
  }
  if (!local.ok()) {
    m.broken = Status::FailedPrecondition("LoadCheckpoint failed while installing states (" +
                                          local.message() + "); recreate the engine");
  }
  ZINF_RETURN_IF_ERROR(m.Agree(local, "LoadCheckpoint"));
  m.step = man.step;
  m.visible = man.step;
  for (size_t i = 0; i < m.params.size(); ++i) {
    m.params[i].updates = man.tensors[i].updates >= 0 ? man.tensors[i].updates : man.step;
  }
  {
    // A new history (the same value on every rank: they load the same checkpoint).
    const uint64_t parts[2] = {m.lineage, static_cast<uint64_t>(man.step)};
    m.lineage = XXH3_64bits_withSeed(parts, sizeof(parts), 0x7a696e66) | 1;
  }
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.done_step = man.step;
    for (Impl::SubGroup& g : m.groups) g.ready_step = g.stepped_step = man.step;
  }
  m.micro = man.step * std::max(1, m.config.gradient_accumulation_steps);
  m.BeginMicroStep();
  if (user_data != nullptr) *user_data = man.user_data;
  return Status::OK();
}

// ---- Inspection ------------------------------------------------------------------------------

Status Engine::GatherMasterParameter(ParamId id, float* out) {
  Impl& m = *impl_;
  if (!m.registered) ZINF_RETURN_IF_ERROR(FinishRegistration());
  if (id >= m.params.size() || out == nullptr) {
    return Status::InvalidArgument("GatherMasterParameter: bad id or null output");
  }
  // The optimizer steps of finished windows (delayed update: the last one may still run).
  ZINF_RETURN_IF_ERROR(m.WaitDone(m.step));
  Impl::Param& p = m.params[id];
  Impl::SubGroup& g = m.groups[p.info.sub_group];
  const size_t part = p.info.partition_numel;
  if (m.world == 1 && g.master.data != nullptr) {  // the partition is the tensor
    std::memcpy(out, g.master.data + p.slice_offset, p.info.numel * sizeof(float));
    return Status::OK();
  }
  std::vector<float> mine(part);
  if (g.master.data != nullptr) {
    std::memcpy(mine.data(), g.master.data + p.slice_offset, part * 4);
  } else {
    // NVMe or device states: read the sub-group once for the consecutive parameters of a
    // full gather (the cache is dropped when the next micro-step starts or a checkpoint loads).
    if (m.gather_group != p.info.sub_group || m.gather_states == nullptr) {
      // One buffer, as large as the largest sub-group, reused from group to group.
      if (m.gather_states == nullptr) {
        size_t largest = 0;
        for (const Impl::SubGroup& sg : m.groups)
          largest = std::max(largest, m.GroupStateBytes(sg));
        m.gather_states = std::make_unique<AlignedBuffer>(largest);
        if (m.gather_states->data == nullptr) {
          m.gather_states.reset();
          return Status::ResourceExhausted("gather buffer of " + FormatBytes(largest));
        }
      }
      Status s = m.ReadGroupStates(p.info.sub_group, m.gather_states->data);
      if (!s.ok()) {
        m.gather_states.reset();
        return s;
      }
      m.gather_group = p.info.sub_group;
    }
    const float* src = static_cast<const float*>(m.gather_states->data) + p.slice_offset;
    if (m.world == 1) {
      std::memcpy(out, src, p.info.numel * sizeof(float));
      return Status::OK();
    }
    std::memcpy(mine.data(), src, part * 4);
  }
  std::vector<float> host(p.padded_numel);
  ZINF_RETURN_IF_ERROR(
      m.AllGatherHost(mine.data(), host.data(), part * 4, "gathering '" + p.info.name + "'"));
  std::memcpy(out, host.data(), p.info.numel * sizeof(float));
  return Status::OK();
}

Status Engine::SetParameterValues(const std::vector<ParamId>& ids,
                                  const std::function<Status(ParamId, float*)>& fill) {
  Impl& m = *impl_;
  if (!fill) return Status::InvalidArgument("SetParameterValues: no fill function");
  std::vector<uint8_t> wanted(m.params.size(), 0);
  for (ParamId id : ids) {
    if (id >= m.params.size()) {
      return Status::InvalidArgument("SetParameterValues: unknown parameter id " +
                                     std::to_string(id));
    }
    if (wanted[id]) {
      return Status::InvalidArgument("SetParameterValues: parameter '" + m.params[id].info.name +
                                     "' is listed twice");
    }
    wanted[id] = 1;
  }
  if (!m.registered) ZINF_RETURN_IF_ERROR(FinishRegistration());
  ZINF_RETURN_IF_ERROR(m.CheckBetweenSteps("SetParameterValues"));
  ZINF_RETURN_IF_ERROR(m.ReclaimScratch());
  ZINF_RETURN_IF_ERROR(m.Agree(m.FinishPendingUpdate(), "SetParameterValues"));
  m.gather_states.reset();
  size_t group_bytes = 0, full_numel = 0;
  for (ParamId id = 0; id < m.params.size(); ++id) {
    if (!wanted[id]) continue;
    const Impl::Param& p = m.params[id];
    group_bytes = std::max(group_bytes, m.GroupStateBytes(m.groups[p.info.sub_group]));
    full_numel = std::max(full_numel, p.padded_numel);
    m.Evict(id);  // a fetched copy holds the old values
  }
  Status local;
  bool changed = false;  // some sub-group was written
  if (group_bytes > 0) {
    Impl::HostStates states;
    local = m.AllocateHostStates(group_bytes, &states);
    std::vector<float> full;
    for (size_t gi = 0; gi < m.groups.size() && local.ok(); ++gi) {
      const Impl::SubGroup& g = m.groups[gi];
      if (std::none_of(g.params.begin(), g.params.end(), [&](ParamId id) { return wanted[id]; })) {
        continue;
      }
      float* master = static_cast<float*>(states.data());
      local = m.ReadGroupStates(gi, master);
      for (size_t j = 0; j < g.params.size() && local.ok(); ++j) {
        const Impl::Param& p = m.params[g.params[j]];
        if (!wanted[g.params[j]]) continue;
        full.assign(p.padded_numel, 0.0f);
        local = fill(g.params[j], full.data()).WithContext("values of '" + p.info.name + "'");
        if (local.ok()) {
          std::memcpy(master + p.slice_offset,
                      full.data() + static_cast<size_t>(m.rank) * p.info.partition_numel,
                      p.info.partition_numel * sizeof(float));
        }
      }
      if (local.ok()) {
        changed = true;
        local = m.WriteGroupStates(gi, master, m.Buf(m.visible));
      }
    }
  }
  Status agreed = m.Agree(local, "SetParameterValues");
  if (!agreed.ok()) {
    // Some rank may hold new values in part of its sub-groups: the model is neither the old
    // one nor the new one.
    if (changed || m.world > 1) {
      m.broken =
          Status::FailedPrecondition("SetParameterValues failed part-way (" + agreed.message() +
                                     "); recreate the engine and load again");
    }
    return agreed;
  }
  // Durable: the new values are a new history, committed at once.
  const uint64_t parts[2] = {m.lineage, static_cast<uint64_t>(m.step)};
  m.lineage = XXH3_64bits_withSeed(parts, sizeof(parts), 0x7a696e66) | 1;
  Status committed = m.CommitStore(m.step, m.visible);
  if (!committed.ok()) {
    m.broken = Status::FailedPrecondition(
        "the durable swap store could not commit the loaded "
        "values (" +
        committed.message() + "); resume from its last commit");
  }
  return committed;
}

int64_t Engine::param_updates(ParamId id) const {
  // The optimizer thread counts the updates of a step still running (delayed update): wait
  // for it. A failed step's count is what it reached; that failure is reported by the calls
  // that run steps, so it is not repeated here.
  if (impl_->registered) (void)impl_->WaitDone(impl_->step);
  return impl_->params.at(id).updates;
}

Status Engine::SetLearningRate(float lr) {
  if (!std::isfinite(lr) || lr < 0) {
    return Status::InvalidArgument("SetLearningRate: the learning rate must be finite and >= 0");
  }
  impl_->lr = lr;
  return Status::OK();
}

int64_t Engine::global_step() const { return impl_->step; }
int Engine::rank() const { return impl_->rank; }
int Engine::world_size() const { return impl_->world; }
size_t Engine::num_params() const { return impl_->params.size(); }
const ParamInfo& Engine::param(ParamId id) const { return impl_->params.at(id).info; }
const EngineConfig& Engine::config() const { return impl_->config; }

}  // namespace zinf
