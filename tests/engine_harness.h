// The harness of the engine's end-to-end tests (engine_*_test.cc, one executable): the
// training problem (a deep MLP, tests/engine_test_model.h), a rank's trainer on the public API,
// whole runs on 1, 2 and 4 in-process ranks (HostDevice + LocalComm, or CudaDevice + NcclComm
// in engine_cuda_test), the test's own simulation of the same training, comparisons, and a
// watchdog that turns a hang into a failure.
//
// trained data-parallel on 1, 2 and 4 in-process ranks (HostDevice + LocalComm), with every
// parameter and optimizer placement, gradient accumulation, clipping, budgets, a trace
// mismatch mid-run and an injected I/O error.
//
// What ties the tests together: the model's kernels are deterministic, so for a given rank
// count every placement must give bit-identical parameters to the all-in-memory run, and that
// run must agree with the test's own simulation of the same training (same kernels, the
// gradients summed in rank order as LocalComm does, the reference scalar AdamW kernel).
//
// Gradient convention (the trainer's side of the contract): every rank hands ReduceGradient
// the gradient of its own rows of the loss mean(over the whole global batch) of (y - t)^2, so
// the reduce-scatter (a sum over ranks) yields the gradient of the global mean. With gradient
// accumulation the global batch is split over the micro-steps as well and the engine sums the
// micro-steps' gradients, like it sums the ranks'.
#pragma once

#include <errno.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "device/host/local_comm.h"
#include "tests/engine_test_model.h"
#include "tests/strict_device.h"
#include "tests/test_util.h"
#include "zinf/comm.h"
#include "zinf/config.h"
#include "zinf/cpu_adam.h"
#include "zinf/engine.h"
#include "zinf/swap.h"
#ifdef ZINF_ENGINE_TEST_CUDA
#include "zinf/cuda.h"
#endif
#include "zinf/device.h"
#include "zinf/io.h"
#include "zinf/log.h"

namespace zinf {

// Readable test parameters ("nvme", not "4-byte object <02-00 00-00>"); found by ADL.
inline void PrintTo(Tier tier, std::ostream* os) {
  *os << (tier == Tier::kDevice ? "device" : tier == Tier::kCpu ? "cpu" : "nvme");
}

namespace engine_test {

using testing::Batch;
using testing::MlpShape;
using testing::MlpWorkspace;
using testing::NewTestHostDevice;
using testing::StrictDevice;
using testing::TempDir;

// ---- The training problem -------------------------------------------------------------------

// 45,040 parameters in 12 tensors: with sub_group_size 20,000 the optimizer has several
// sub-groups, and with param_persistence_threshold 100 the biases (96 and 16 elements) persist
// while the weights (>= 1,536 elements) are fetched on every use.
inline const MlpShape& Shape() {
  static const MlpShape shape{{64, 96, 96, 96, 96, 96, 16}};
  return shape;
}

constexpr int kGlobalBatch = 16;  // split over up to 4 ranks x 2 micro-steps
constexpr uint64_t kBatchSeed = 0x5EED;
constexpr int kSteps = 4;  // optimizer steps per run
constexpr uint64_t kSubGroupSize = 20000;
constexpr uint64_t kPersistenceThreshold = 100;
constexpr float kLr = 1e-2f;
constexpr float kWeightDecay = 0.01f;
// RunOptions::param_groups: the biases' parameter group (1), every value unlike the config's
// (group 0), as Hugging Face's no-decay group for biases and norms.
inline ParamGroupHyper BiasGroup() { return ParamGroupHyper{3e-2f, 0.8f, 0.99f, 1e-6f, 0.0f}; }
constexpr float kBeta1 = 0.9f;
constexpr float kBeta2 = 0.999f;
constexpr float kEps = 1e-8f;
constexpr double kClip = 0.05;  // below every step's gradient norm here (0.14 to 0.47)
// The model needs ~1.5 MiB pinned; each rank's arena is allocated (and mlocked) whole.
constexpr uint64_t kPinnedBudget = 4ull << 20;
constexpr size_t kHostDeviceMemory = 64ull << 20;
constexpr size_t kTestPoolChunk = 4096;  // HostDeviceOptions::pool_chunk

inline const Batch& TheBatch() {
  static const Batch batch = testing::MakeBatch(Shape(), kGlobalBatch, kBatchSeed);
  return batch;
}

// The loss is mean over the global batch and the outputs: 1/256, a power of two, so scaling
// is exact.
inline float LossScale() { return 1.0f / static_cast<float>(kGlobalBatch * Shape().widths.back()); }

inline std::string ParamName(int p) {
  return "mlp.layer" + std::to_string(MlpShape::layer_of(p)) +
         (MlpShape::is_weight(p) ? ".weight" : ".bias");
}

inline const char* TierLabel(Tier t) {
  switch (t) {
    case Tier::kDevice:
      return "Device";
    case Tier::kCpu:
      return "Cpu";
    case Tier::kNvme:
      return "Nvme";
  }
  return "?";
}

#ifdef ZINF_ENGINE_TEST_CUDA
// The GPU build of this test (engine_cuda_test, label gpu) runs the one-rank placements on a
// CudaDevice with an NcclComm against the host device's all-in-memory run; without a visible
// CUDA device every test is skipped, with the reason.
// Why the CUDA runs cannot happen here ("" when a device is usable), probed once.
// Only "no device visible" skips: a visible device that cannot be opened (a bad budget, a
// broken driver) is the test's failure, reported by the run that opens it.
inline const std::string& CudaSkipReason() {
  static const std::string reason =
      CudaDeviceCount() == 0
          ? std::string("no CUDA device visible (built without CUDA, no driver, or no GPU)")
          : std::string();
  return reason;
}
#define ZINF_SKIP_WITHOUT_CUDA()                                     \
  do {                                                               \
    if (!CudaSkipReason().empty()) GTEST_SKIP() << CudaSkipReason(); \
  } while (0)
#else
#define ZINF_SKIP_WITHOUT_CUDA() \
  do {                           \
  } while (0)
#endif

// ---- Running with a timeout -----------------------------------------------------------------

// Runs fn on its own thread and waits at most `limit`. An engine that hangs (a collective
// never matched, a wait never signalled) must fail the test, not stall the suite; the hung
// threads reference this frame, so the only safe way out is to end the process.
inline void RunGuarded(const std::string& what, std::chrono::seconds limit,
                       std::function<void()> fn,
                       const std::function<std::string()>& describe_progress = nullptr) {
  std::packaged_task<void()> task(std::move(fn));
  std::future<void> done = task.get_future();
  std::thread thread(std::move(task));
  if (done.wait_for(limit) == std::future_status::timeout) {
    std::string progress = describe_progress ? describe_progress() : std::string();
    std::fprintf(stderr,
                 "FATAL: %s did not finish within %lld s: the engine hangs. %s\n"
                 "Ending the process (the hung rank threads cannot be joined).\n",
                 what.c_str(), static_cast<long long>(limit.count()), progress.c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
  thread.join();
  done.get();
}

// ---- One rank's trainer ---------------------------------------------------------------------

// Drives one rank's Engine through micro-steps of the MLP, layer by layer, as a trainer does.
class RankTrainer {
 public:
  // `device`: the engine's device. When it is not the host device (CudaDevice), or is the
  // strict host device (asynchronous compute stream), the trainer works as a GPU trainer does:
  // parameters are copied to host memory on the compute stream for the test's CPU kernels, and
  // gradients back to device memory on it.
  explicit RankTrainer(Engine* engine, Device* device = nullptr)
      : engine_(engine),
        device_(device != nullptr && (!device->IsHost() || StrictDevice().on) ? device : nullptr) {
    // The gradient buffer is allocated up front and kept, so that the device's peak is the
    // engine's plus exactly device_bytes() (RunResult::device_peaks subtracts it).
    if (device_ != nullptr) {
      Result<void*> buf = device_->Alloc(Shape().largest_layer_bytes());
      if (buf.ok()) {
        grad_dev_ = *buf;
        grad_dev_bytes_ = Shape().largest_layer_bytes();
      } else {
        setup_ = buf.status().WithContext("the trainer's device gradient buffer");
      }
    }
  }
  ~RankTrainer() {
    if (grad_dev_ == nullptr) return;
    // Queued copies into it must have run (a failed wait: nothing more can be done here).
    (void)device_->SynchronizeStream(device_->ComputeStream());  // safe: see the line above
    device_->Free(grad_dev_);
  }
  RankTrainer(const RankTrainer&) = delete;
  RankTrainer& operator=(const RankTrainer&) = delete;

  // Registers W0, b0, W1, b1, ... in layer order, then ends registration.
  // `finish`: end registration (else the caller does, e.g. by Engine::ResumeFromStore).
  // `groups`: the biases in parameter group 1 (BiasGroup()).
  Status Register(bool finish = true, bool groups = false) {
    ZINF_RETURN_IF_ERROR(setup_);
    if (groups) ZINF_RETURN_IF_ERROR(engine_->SetParamGroup(1, BiasGroup()));
    const MlpShape& shape = Shape();
    for (int p = 0; p < shape.num_params(); ++p) {
      ParamSpec spec;
      spec.param_group = groups && p % 2 == 1 ? 1 : 0;
      spec.name = ParamName(p);
      spec.shape = shape.param_shape(p);
      spec.init = [p](float* data, size_t numel) { testing::InitParam(Shape(), p, data, numel); };
      Result<ParamId> id = engine_->RegisterParameter(spec);
      if (!id.ok()) return id.status().WithContext("RegisterParameter " + spec.name);
      ids_.push_back(*id);
    }
    if (!finish) return Status::OK();
    return engine_->FinishRegistration().WithContext("FinishRegistration");
  }

  ParamId id(int p) const { return ids_[p]; }
  // Device memory the trainer itself holds (its gradient buffer), allocated before Register.
  size_t device_bytes() const { return grad_dev_bytes_; }
  // ReduceGradient calls that succeeded in the last micro-step.
  int gradients_reduced() const { return gradients_reduced_; }
  // Parameter p's gradient is not handed to the engine in the next micro-steps (-1: every
  // one is).
  void set_skip_gradient(int p) { skip_gradient_ = p; }

  // One micro-step over rows [row_begin, row_begin + rows) of the batch: forward layer by
  // layer, backward in reverse with ReduceGradient for every parameter, then Step().
  // With `swap_first_two`, the forward acquires layer 1 before layer 0 (a different Acquire
  // sequence, the same arithmetic). On failure, releases what it holds and returns the first
  // error, naming the call.
  Status MicroStep(int row_begin, int rows, bool swap_first_two, double* loss, StepStats* stats) {
    gradients_reduced_ = 0;
    return StepAfter(ForwardBackward(row_begin, rows, swap_first_two, loss), stats);
  }

  // zinf.schedule layer-major: a whole window of micro-batches (row_begins[j], `rows` rows
  // each) in one Step: each layer's forward for every micro-batch before the next layer's,
  // then the backward from the top, each layer for every micro-batch with ReduceGradient(id,
  // grad, j). `skip_after_first`: that parameter's gradient in micro-batch 0 only (-1: none).
  // losses: one per micro-batch.
  Status LayerMajorWindow(const std::vector<int>& row_begins, int rows, int skip_after_first,
                          std::vector<double>* losses, StepStats* stats) {
    gradients_reduced_ = 0;
    return StepAfter(LayerMajorPasses(row_begins, rows, skip_after_first, losses), stats);
  }

  // The end of a micro-step whose passes returned `s`: on failure, releases what is held and
  // returns s; else Engine::Step into *stats.
  Status StepAfter(const Status& s, StepStats* stats) {
    if (!s.ok()) {
      for (int l : held_) (void)engine_->Release(LayerIds(l));  // safe: the first error is s
      held_.clear();
      (void)EndOfMicroStep();  // safe: s is the error to report
      return s;
    }
    Result<StepStats> st = engine_->Step();
    Status ended = EndOfMicroStep();
    if (!st.ok()) return st.status().WithContext("Step");
    ZINF_RETURN_IF_ERROR(ended);
    *stats = *st;
    return Status::OK();
  }

  // Collective: every parameter's fp32 master, gathered.
  Status GatherAll(std::vector<std::vector<float>>* out) {
    const MlpShape& shape = Shape();
    out->assign(shape.num_params(), {});
    for (int p = 0; p < shape.num_params(); ++p) {
      (*out)[p].assign(shape.numel(p), std::nanf(""));
      ZINF_RETURN_IF_ERROR(engine_->GatherMasterParameter(ids_[p], (*out)[p].data())
                               .WithContext("GatherMasterParameter " + ParamName(p)));
    }
    return Status::OK();
  }

 private:
  struct LayerPtrs {
    const float* w = nullptr;
    const float* b = nullptr;
  };

  std::vector<ParamId> LayerIds(int l) const { return {ids_[2 * l], ids_[2 * l + 1]}; }

  Result<LayerPtrs> AcquireLayer(int l, const char* phase) {
    Result<std::vector<void*>> ptrs = engine_->Acquire(LayerIds(l));
    std::string what = std::string(phase) + " Acquire layer " + std::to_string(l);
    if (!ptrs.ok()) return ptrs.status().WithContext(what);
    held_.push_back(l);
    if (ptrs->size() != 2 || (*ptrs)[0] == nullptr || (*ptrs)[1] == nullptr) {
      return Status::Internal(what + ": expected two non-null pointers");
    }
    if (device_ == nullptr) {
      return LayerPtrs{static_cast<const float*>((*ptrs)[0]),
                       static_cast<const float*>((*ptrs)[1])};
    }
    // Device memory: host copies for the CPU kernels (after the compute stream, which the
    // engine made wait for the fetch).
    std::vector<float>& w = host_w_[l];
    std::vector<float>& b = host_b_[l];
    w.resize(Shape().numel(2 * l));
    b.resize(Shape().numel(2 * l + 1));
    Stream* compute = device_->ComputeStream();
    ZINF_RETURN_IF_ERROR(
        device_->CopyDeviceToHost(w.data(), (*ptrs)[0], w.size() * sizeof(float), compute));
    ZINF_RETURN_IF_ERROR(
        device_->CopyDeviceToHost(b.data(), (*ptrs)[1], b.size() * sizeof(float), compute));
    ZINF_RETURN_IF_ERROR(device_->SynchronizeStream(compute).WithContext(what));
    return LayerPtrs{w.data(), b.data()};
  }

  // Hands a host gradient to the engine (through device memory when the device is not the
  // host: the copy is ordered on the compute stream, which the engine's reduction follows).
  // `micro_batch` >= 0: ReduceGradient's form naming it.
  Status Reduce(int p, const std::vector<float>& grad, int micro_batch = -1) {
    if (p == skip_gradient_) return Status::OK();
    const float* src = grad.data();
    if (device_ != nullptr) {
      const size_t bytes = grad.size() * sizeof(float);
      if (bytes > grad_dev_bytes_)
        return Status::Internal("gradient larger than the largest layer");
      // No wait here, as a GPU trainer does not wait: the copy reads a host copy of the
      // gradient kept until the micro-step's end (the caller reuses `grad`), and the next
      // gradient's copy into the same device buffer is ordered after the engine's read of it
      // on the compute stream. Evictions and landings run with the compute stream behind.
      host_in_flight_.push_back(grad);
      ZINF_RETURN_IF_ERROR(device_->CopyHostToDevice(grad_dev_, host_in_flight_.back().data(),
                                                     bytes, device_->ComputeStream()));
      src = static_cast<const float*>(grad_dev_);
    }
    Status reduced = micro_batch < 0 ? engine_->ReduceGradient(ids_[p], src)
                                     : engine_->ReduceGradient(ids_[p], src, micro_batch);
    ZINF_RETURN_IF_ERROR(reduced.WithContext("ReduceGradient " + ParamName(p)));
    ++gradients_reduced_;
    return Status::OK();
  }

  // The compute stream's copies out of the kept host gradients are done: they go.
  Status EndOfMicroStep() {
    Status s;
    if (device_ != nullptr) s = device_->SynchronizeStream(device_->ComputeStream());
    host_in_flight_.clear();
    return s.WithContext("synchronising the compute stream after the micro-step");
  }

  Status ReleaseLayer(int l, const char* phase) {
    held_.erase(std::find(held_.begin(), held_.end(), l));
    return engine_->Release(LayerIds(l))
        .WithContext(std::string(phase) + " Release layer " + std::to_string(l));
  }

  Status ForwardBackward(int row_begin, int rows, bool swap_first_two, double* loss) {
    const MlpShape& shape = Shape();
    const int layers = shape.layers();
    testing::StartForward(shape, TheBatch(), row_begin, rows, &ws_);
    int first = 0;
    if (swap_first_two) {
      Result<LayerPtrs> l1 = AcquireLayer(1, "forward");
      if (!l1.ok()) return l1.status();
      Result<LayerPtrs> l0 = AcquireLayer(0, "forward");
      if (!l0.ok()) return l0.status();
      testing::ForwardLayer(shape, 0, rows, l0->w, l0->b, &ws_);
      ZINF_RETURN_IF_ERROR(ReleaseLayer(0, "forward"));
      testing::ForwardLayer(shape, 1, rows, l1->w, l1->b, &ws_);
      ZINF_RETURN_IF_ERROR(ReleaseLayer(1, "forward"));
      first = 2;
    }
    for (int l = first; l < layers; ++l) {
      Result<LayerPtrs> p = AcquireLayer(l, "forward");
      if (!p.ok()) return p.status();
      testing::ForwardLayer(shape, l, rows, p->w, p->b, &ws_);
      ZINF_RETURN_IF_ERROR(ReleaseLayer(l, "forward"));
    }
    *loss = testing::FinishForward(shape, TheBatch(), row_begin, rows, LossScale(), &ws_);
    for (int l = layers - 1; l >= 0; --l) {
      Result<LayerPtrs> p = AcquireLayer(l, "backward");
      if (!p.ok()) return p.status();
      dw_.assign(shape.numel(2 * l), 0.0f);
      db_.assign(shape.numel(2 * l + 1), 0.0f);
      testing::BackwardLayer(shape, l, rows, p->w, dw_.data(), db_.data(), &ws_);
      ZINF_RETURN_IF_ERROR(Reduce(2 * l, dw_));
      ZINF_RETURN_IF_ERROR(Reduce(2 * l + 1, db_));
      ZINF_RETURN_IF_ERROR(ReleaseLayer(l, "backward"));
    }
    return Status::OK();
  }

  Status LayerMajorPasses(const std::vector<int>& row_begins, int rows, int skip_after_first,
                          std::vector<double>* losses) {
    const MlpShape& shape = Shape();
    const int layers = shape.layers();
    const int k = static_cast<int>(row_begins.size());
    window_ws_.resize(k);
    for (int j = 0; j < k; ++j) {
      testing::StartForward(shape, TheBatch(), row_begins[j], rows, &window_ws_[j]);
    }
    for (int l = 0; l < layers; ++l) {
      Result<LayerPtrs> p = AcquireLayer(l, "forward");
      if (!p.ok()) return p.status();
      for (int j = 0; j < k; ++j) testing::ForwardLayer(shape, l, rows, p->w, p->b, &window_ws_[j]);
      ZINF_RETURN_IF_ERROR(ReleaseLayer(l, "forward"));
    }
    losses->clear();
    for (int j = 0; j < k; ++j) {
      losses->push_back(testing::FinishForward(shape, TheBatch(), row_begins[j], rows, LossScale(),
                                               &window_ws_[j]));
    }
    for (int l = layers - 1; l >= 0; --l) {
      Result<LayerPtrs> p = AcquireLayer(l, "backward");
      if (!p.ok()) return p.status();
      for (int j = 0; j < k; ++j) {
        dw_.assign(shape.numel(2 * l), 0.0f);
        db_.assign(shape.numel(2 * l + 1), 0.0f);
        testing::BackwardLayer(shape, l, rows, p->w, dw_.data(), db_.data(), &window_ws_[j]);
        for (int q : {2 * l, 2 * l + 1}) {
          if (j > 0 && q == skip_after_first) continue;
          ZINF_RETURN_IF_ERROR(Reduce(q, q == 2 * l ? dw_ : db_, j));
        }
      }
      ZINF_RETURN_IF_ERROR(ReleaseLayer(l, "backward"));
    }
    return Status::OK();
  }

  Engine* engine_;
  Device* device_ = nullptr;  // set only for a device that is not the host
  int skip_gradient_ = -1;
  std::map<int, std::vector<float>> host_w_, host_b_;
  Status setup_;  // the constructor's failure, returned by Register
  std::deque<std::vector<float>> host_in_flight_;  // gradients the compute stream copies
  void* grad_dev_ = nullptr;
  size_t grad_dev_bytes_ = 0;
  std::vector<ParamId> ids_;
  std::vector<int> held_;  // layers acquired and not yet released
  int gradients_reduced_ = 0;
  MlpWorkspace ws_;
  std::vector<MlpWorkspace> window_ws_;  // LayerMajorWindow's, one per micro-batch
  std::vector<float> dw_, db_;
};

// ---- Whole runs -----------------------------------------------------------------------------

struct RunOptions {
  int ranks = 1;
  Tier param_tier = Tier::kDevice;
  Tier optimizer_tier = Tier::kDevice;
  int steps = kSteps;  // optimizer steps
  int grad_accum = 1;  // micro-steps per optimizer step
  double clipping = 0.0;
  bool delayed = false;   // zinf.delayed_update
  int delayed_after = 0;  // zinf.delayed_update_after
  bool durable = false;   // zinf.durable
  double ratio = 1.0;     // offload_optimizer.ratio
  bool host = false;      // the GPU build of this test: run on the host device anyway
  uint64_t device_budget_bytes = 0;
  uint64_t pinned_budget_bytes = kPinnedBudget;
  uint64_t sub_group_size = kSubGroupSize;
  int swapped_micro_step = -1;  // this micro-step's forward acquires layer 1 before layer 0
  // zinf.schedule layer-major: each window in one Step (RankTrainer::LayerMajorWindow); the
  // losses and stats are the micro-batches' (each window's stats k times).
  bool layer_major = false;
  bool bf16_transfer = false;  // zinf.gradient_transfer_dtype bf16
  // Checkpoints: save after this many optimizer steps (-1: never) into checkpoint_dir; or load
  // from it before the first micro-step and start at micro-step first_micro.
  std::string checkpoint_dir;
  int save_after_step = -1;
  bool load_first = false;
  int first_micro = 0;
  StateType state_type = StateType::kF32;                // zinf.optimizer_state_dtype
  SpeculativeStep speculative = SpeculativeStep::kAuto;  // zinf.speculative_step
  OptimizerType optimizer = OptimizerType::kAdamW;       // Simulate: AdamW only
  bool param_groups = false;  // the biases in parameter group 1 (BiasGroup())
  // Simulate only: the states were kept as `states_before` until this optimizer step (a
  // checkpoint saved then, loaded by an engine keeping state_type: converted on load).
  int switch_states_at = -1;
  StateType states_before = StateType::kF32;
  int stage = 3;  // zero_optimization.stage
  // This parameter's gradient is reduced in the first micro-step of each window only (-1:
  // every parameter's in every micro-step).
  int first_micro_only = -1;
  // offload_states: after each optimizer step but the last, this many OffloadStates /
  // ReloadStates cycles (odd ones non-blocking; the last cycle's reload is left to the next
  // Acquire), moving `offload_include`.
  int offload_cycles = 0;
  uint32_t offload_include = Engine::kOffloadAll;
  Tier offload_device = Tier::kCpu;  // OffloadStatesOptions::device
  // With offload_device kNvme: cycle 1 is a failed NVMe write and a failed read back (on
  // one rank's request; every rank's call fails), each done again once the fault has passed.
  bool nvme_faults = false;
  std::shared_ptr<FaultPlan> fault_plan;  // EngineHooks::fault_plan, every rank's
  // The first cycle's reload runs once with the device memory taken but for half of what it
  // needs (the trainer's own allocation, as torch's in generation), then again once it is
  // freed.
  bool block_first_reload = false;
  // The first cycle's inference Acquire finds this rank's device memory all taken (the
  // other ranks' free): it fails on every rank, and succeeds on every rank once freed (the
  // ranks' states differ in between: the retry's collectives must still pair).
  int block_acquire_rank = -1;
  bool quantized_weights = false;    // zero_optimization.zero_quantized_weights
  bool quantized_gradients = false;  // zero_optimization.zero_quantized_gradients
  uint32_t gradient_bits = 8;        // zinf.quantized_gradient_bits
  uint32_t hpz = 1;                  // zero_optimization.zero_hpz_partition_size
  std::chrono::seconds timeout{120};

  std::string Describe() const {
    std::ostringstream os;
    if (stage != 3) os << "stage " << stage << ", ";
    if (first_micro_only >= 0) {
      os << ParamName(first_micro_only) << "'s gradient in the first micro-step only, ";
    }
    os << ranks << " rank(s), params " << TierLabel(param_tier) << ", optimizer "
       << TierLabel(optimizer_tier) << ", accumulation " << grad_accum << ", clipping " << clipping
       << ", device budget " << device_budget_bytes;
    if (delayed) os << ", delayed update";
    if (quantized_weights) os << ", quantized weight gathers";
    if (quantized_gradients) os << ", quantized gradient reduction (int" << gradient_bits << ")";
    if (hpz > 1) os << ", hpZ nodes of " << hpz;
    if (ratio < 1) os << ", optimizer ratio " << ratio;
    if (param_groups) os << ", biases in their own parameter group";
    if (swapped_micro_step >= 0) os << ", swapped acquire order at " << swapped_micro_step;
    if (state_type != StateType::kF32) os << ", " << StateTypeName(state_type) << " states";
    if (speculative != SpeculativeStep::kAuto) {
      os << ", speculative step " << (speculative == SpeculativeStep::kOn ? "on" : "off");
    }
    return os.str();
  }
};

inline EngineConfig MakeConfig(const RunOptions& o, const std::string& nvme_dir) {
  EngineConfig c;
  c.offload_param.tier = o.param_tier;
  c.offload_optimizer.tier = o.optimizer_tier;
  // All ranks get the same config, as they would from one JSON file: one shared nvme folder.
  if (o.param_tier == Tier::kNvme) c.offload_param.nvme_paths = {nvme_dir};
  if (o.optimizer_tier == Tier::kNvme || o.offload_device == Tier::kNvme) {
    c.offload_optimizer.nvme_paths = {nvme_dir};  // (offload_states' folder too)
  }
  // Swap buffers sized for this model (elements; the largest tensor is 9,216), not 100M.
  c.offload_param.buffer_size = 1 << 16;
  c.offload_optimizer.buffer_size = 1 << 16;
  c.sub_group_size = o.sub_group_size;
  // Prefetch up to ~4 layers ahead (elements), sized for this model like the buffers above.
  c.prefetch_bucket_size = 40000;
  c.param_persistence_threshold = kPersistenceThreshold;
  c.optimizer.type = o.optimizer;
  c.optimizer.lr = kLr;
  c.optimizer.beta1 = kBeta1;
  c.optimizer.beta2 = kBeta2;
  c.optimizer.eps = kEps;
  c.optimizer.weight_decay = kWeightDecay;
  c.gradient_clipping = o.clipping;
  c.delayed_update = o.delayed;
  c.delayed_update_after = o.delayed_after;
  c.durable = o.durable;
  c.offload_optimizer.ratio = o.ratio;
  c.gradient_accumulation_steps = o.grad_accum;
  c.device_budget_bytes = o.device_budget_bytes;
  c.pinned_budget_bytes = o.pinned_budget_bytes;
  c.optimizer_threads = 1;  // 2-core machines run up to 4 ranks
  c.optimizer_state_type = o.state_type;
  c.speculative_step = o.speculative;
  c.zero_stage = o.stage;
  c.quantized_weights = o.quantized_weights;
  c.quantized_gradients = o.quantized_gradients;
  c.quantized_gradient_bits = o.gradient_bits;
  c.hpz_partition_size = o.hpz;
  c.layer_major = o.layer_major;
  c.gradient_transfer_bf16 = o.bf16_transfer;
  return c;
}

// How many collectives of each kind a rank's engine issued (CountingComm).
struct CollectiveCounts {
  int all_gather = 0, reduce_scatter = 0, all_reduce = 0, broadcast = 0, barrier = 0;
  int all_to_all = 0;
  uint64_t all_to_all_bytes = 0;         // bytes_per_rank each
  uint64_t reduce_scatter_floats = 0;    // count_per_rank each
  uint64_t all_gather_bytes = 0;         // what this rank sent in them (bytes_per_rank each)
  std::vector<size_t> all_gather_sizes;  // bytes_per_rank of each, in order
  // The all-gathers of sub-groups split from the communicator (hpZ's node).
  int node_all_gather = 0;
  uint64_t node_all_gather_bytes = 0;
  // The all-to-alls of every sub-group (qgZ's two hops), bytes_per_rank each.
  int sub_all_to_all = 0;
  uint64_t sub_all_to_all_bytes = 0;
};

// A rank's communicator, counting the collectives it is asked for (the engine's trainer
// thread is the only caller: plain counters).
class CountingComm final : public Communicator {
 public:
  explicit CountingComm(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  // A sub-group counts its all-gathers into this one's node_all_gather (its other collectives
  // into its own counts).
  Result<std::unique_ptr<Communicator>> Split(int color, Stream* stream) override {
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> sub, inner_->Split(color, stream));
    auto wrapped = std::make_unique<CountingComm>(std::move(sub));
    wrapped->parent_ = &counts_;
    return std::unique_ptr<Communicator>(std::move(wrapped));
  }
  Status AllGather(const void* send, void* recv, size_t bytes, Stream* stream) override {
    if (parent_ != nullptr) {
      ++parent_->node_all_gather;
      parent_->node_all_gather_bytes += bytes;
    }
    ++counts_.all_gather;
    counts_.all_gather_bytes += bytes;
    counts_.all_gather_sizes.push_back(bytes);
    return inner_->AllGather(send, recv, bytes, stream);
  }
  Status AllToAll(const void* send, void* recv, size_t bytes, Stream* stream) override {
    if (parent_ != nullptr) {
      ++parent_->sub_all_to_all;
      parent_->sub_all_to_all_bytes += bytes;
    }
    ++counts_.all_to_all;
    counts_.all_to_all_bytes += bytes;
    return inner_->AllToAll(send, recv, bytes, stream);
  }
  Status ReduceScatterSum(const float* send, float* recv, size_t count, Stream* stream) override {
    ++counts_.reduce_scatter;
    counts_.reduce_scatter_floats += count;
    return inner_->ReduceScatterSum(send, recv, count, stream);
  }
  Status AllReduceSum(float* buf, size_t count, Stream* stream) override {
    ++counts_.all_reduce;
    return inner_->AllReduceSum(buf, count, stream);
  }
  Status Broadcast(void* buf, size_t bytes, int root, Stream* stream) override {
    ++counts_.broadcast;
    return inner_->Broadcast(buf, bytes, root, stream);
  }
  Status Barrier() override {
    ++counts_.barrier;
    return inner_->Barrier();
  }
  CommCounters Counters() const override { return inner_->Counters(); }
  const CollectiveCounts& counts() const { return counts_; }

 private:
  std::unique_ptr<Communicator> inner_;
  CollectiveCounts counts_;
  CollectiveCounts* parent_ = nullptr;  // a sub-group's: the communicator it was split from
};

struct RankOutput {
  Status status;
  std::vector<double> losses;    // per micro-step, this rank's rows
  std::vector<StepStats> stats;  // per micro-step
  std::vector<ParamInfo> infos;
  std::vector<std::vector<float>> params;  // gathered masters
  // Where the rank is, for the report when a run hangs.
  enum Phase { kStarting, kTraining, kGathering, kDestroying, kFinished };
  std::atomic<int> phase{kStarting};
  std::atomic<int> micro_steps_done{0};
  Status mid_window_save;  // SaveCheckpoint inside an accumulation window (must fail)
  // offload_states: the most device memory in use after a blocking offload, less the
  // trainer's own (SIZE_MAX: no offload ran).
  size_t offloaded_device_bytes = SIZE_MAX;
  size_t device_bytes_before_offload = 0;  // at the same point, before the offload
  // The most device memory still backed (MemoryInfo().committed) after a blocking
  // offload_states, beyond what is allocated then (trainer's included): what TrimMemory left.
  size_t offloaded_committed_excess = 0;
  // block_first_reload: the reload that failed, and the device memory backed around it.
  Status blocked_reload;
  size_t committed_before_blocked_reload = 0;
  size_t committed_after_blocked_reload = 0;
  size_t device_bytes_after_inference = 0;  // after the first offload and an inference Acquire
  // The pinned arena's resident bytes: the most before an offload, the most while offloaded.
  size_t pinned_resident_before_offload = 0;
  size_t offloaded_pinned_resident = 0;
  size_t trainer_device_bytes = 0;  // RankTrainer::device_bytes()
};

struct RunResult {
  Status status;                              // the first failing rank's error ("rank r: ...")
  std::vector<std::vector<float>> params;     // rank 0's gathered masters, per parameter
  bool ranks_agree = true;                    // every rank gathered the same bits
  std::vector<double> losses;                 // per micro-step, summed over ranks in rank order
  std::vector<std::vector<StepStats>> stats;  // [rank][micro-step]
  std::vector<ParamInfo> infos;               // rank 0's
  // Per rank: the HostDevice's own peak allocation, less what the test's trainer held there
  // (its gradient buffer under the strict device).
  std::vector<size_t> device_peaks;
  std::vector<Status> mid_window_saves;        // per rank
  std::vector<CollectiveCounts> collectives;   // per rank, the whole run's
  std::vector<size_t> offloaded_device_bytes;  // per rank (RankOutput's)
  std::vector<size_t> device_bytes_before_offload;
  std::vector<size_t> device_bytes_after_inference;
  std::vector<size_t> offloaded_committed_excess;
  // The pinned arena's resident bytes: the most before an offload, the most while offloaded.
  std::vector<std::pair<size_t, size_t>> pinned_resident;
  std::vector<Status> blocked_reloads;                                     // per rank
  std::vector<std::pair<size_t, size_t>> committed_around_blocked_reload;  // before, after
};

// The micro-step's rows for `rank`: the global batch is split over the micro-steps of an
// optimizer step, and each micro-batch over the ranks.
inline int RowBegin(const RunOptions& o, int micro, int rank) {
  int micro_rows = kGlobalBatch / o.grad_accum;
  return (micro % o.grad_accum) * micro_rows + rank * (micro_rows / o.ranks);
}
inline int RowsPerRank(const RunOptions& o) { return kGlobalBatch / (o.grad_accum * o.ranks); }

// offload_states cycle `c` after an optimizer step (RunOptions::offload_cycles): offloads,
// checks what stays and that a second offload moves nothing, the first cycle's inference
// Acquire and blocked reload, then reloads (all but the last cycle).
// RunOptions::nvme_faults' cycle: a write that fails leaves the states in host memory (the
// pinned memory resident); a read back that fails leaves them on NVMe; each succeeds when
// called again. `plan` is every rank's; rank 0 adds the faults (one request each: a rank's
// failure fails every rank's call).
inline Status NvmeFaultCycle(int rank, Engine* engine, FaultPlan* plan) {
  Engine::OffloadStatesOptions opt;
  opt.device = Tier::kNvme;
  auto expect_failure = [](const Status& s, const char* what, const char* says) {
    if (s.ok()) return Status::Internal(std::string(what) + " did not fail");
    if (s.message().find(says) == std::string::npos) {
      return Status::Internal(std::string(what) + " failed without saying \"" + says +
                              "\": " + s.ToString());
    }
    return Status::OK();
  };
  IoFault fault;
  fault.any_op = false;
  fault.op = IoOp::kWrite;
  if (rank == 0) plan->AddAhead(fault, 0);
  ZINF_RETURN_IF_ERROR(expect_failure(engine->OffloadStates(opt), "an NVMe write with EIO",
                                      "the states stay in host memory"));
  if (!engine->states_offloaded()) return Status::Internal("a failed NVMe write reloaded");
  ZINF_ASSIGN_OR_RETURN(Engine::PinnedMemoryInfo pinned, engine->pinned_memory());
  if (pinned.resident == 0) return Status::Internal("a failed NVMe write released the memory");
  ZINF_RETURN_IF_ERROR(engine->OffloadStates(opt).WithContext("offload_states after a fault"));
  ZINF_ASSIGN_OR_RETURN(pinned, engine->pinned_memory());
  if (pinned.resident != 0) return Status::Internal("the pinned memory stayed resident");
  fault.op = IoOp::kRead;
  if (rank == 0) plan->AddAhead(fault, 0);
  ZINF_RETURN_IF_ERROR(
      expect_failure(engine->ReloadStates(false), "an NVMe read with EIO", "they stay there"));
  if (!engine->states_offloaded()) return Status::Internal("a failed NVMe read reloaded");
  // Offloading again while they are there: nothing to write, the memory released again.
  ZINF_RETURN_IF_ERROR(
      engine->OffloadStates(opt).WithContext("offload_states after a failed read"));
  ZINF_ASSIGN_OR_RETURN(pinned, engine->pinned_memory());
  if (pinned.resident != 0) return Status::Internal("a failed read left the memory resident");
  return engine->ReloadStates(false).WithContext("reload_states after a fault");
}

// RunOptions::block_acquire_rank's part of the first cycle.
inline Status BlockedAcquire(const RunOptions& o, int rank, Engine* engine, RankTrainer& trainer,
                             Device* device) {
  std::vector<void*> blockers;  // every free range, whatever the pool's fragmentation
  if (rank == o.block_acquire_rank) {
    const DeviceMemoryInfo now = device->MemoryInfo();
    for (size_t size = now.budget - now.used; size >= 4096;) {
      Result<void*> b = device->Alloc(size);
      if (b.ok()) {
        blockers.push_back(*b);
      } else {
        size /= 2;
      }
    }
  }
  Result<std::vector<void*>> p = engine->Acquire({trainer.id(0)}, AcquireMode::kInference);
  for (void* b : blockers) device->Free(b);
  if (p.ok()) return Status::Internal("an Acquire without device memory on one rank succeeded");
  p = engine->Acquire({trainer.id(0)}, AcquireMode::kInference);
  if (!p.ok()) return p.status().WithContext("the Acquire once the memory is free");
  return engine->Release({trainer.id(0)});
}

inline Status OffloadCycle(const RunOptions& o, int rank, int c, Engine* engine,
                           RankTrainer& trainer, Device* device, RankOutput* out) {
  Engine::OffloadStatesOptions opt;
  opt.include = o.offload_include;
  opt.device = o.offload_device;
  ZINF_ASSIGN_OR_RETURN(const Engine::PinnedMemoryInfo pinned_before, engine->pinned_memory());
  out->pinned_resident_before_offload =
      std::max(out->pinned_resident_before_offload, pinned_before.resident);
  const size_t before = device->MemoryInfo().used - out->trainer_device_bytes;
  opt.non_blocking = c % 2 == 1;
  opt.pin_memory = c % 3 != 2;
  ZINF_RETURN_IF_ERROR(engine->OffloadStates(opt).WithContext("OffloadStates"));
  if (!engine->states_offloaded()) return Status::Internal("OffloadStates left nothing offloaded");
  ZINF_ASSIGN_OR_RETURN(const Engine::PinnedMemoryInfo pinned, engine->pinned_memory());
  out->offloaded_pinned_resident = std::max(out->offloaded_pinned_resident, pinned.resident);
  if (!opt.non_blocking) {
    const size_t used = device->MemoryInfo().used - out->trainer_device_bytes;
    out->device_bytes_before_offload = std::max(out->device_bytes_before_offload, before);
    out->offloaded_device_bytes = out->offloaded_device_bytes == SIZE_MAX
                                      ? used
                                      : std::max(out->offloaded_device_bytes, used);
  }
  // A second offload moves nothing; a blocking one after a non-blocking one waits for
  // its copies and gives the device memory back.
  const size_t once = device->MemoryInfo().used;
  if (opt.non_blocking) {
    ZINF_RETURN_IF_ERROR(engine->OffloadStates(opt).WithContext("OffloadStates again"));
    if (!engine->states_offloaded()) return Status::Internal("a second offload reloaded");
  }
  Engine::OffloadStatesOptions again = opt;
  again.non_blocking = false;
  ZINF_RETURN_IF_ERROR(engine->OffloadStates(again).WithContext("OffloadStates again"));
  const DeviceMemoryInfo info = device->MemoryInfo();
  if (!opt.non_blocking && info.used != once) {
    return Status::Internal("a second OffloadStates changed the device memory in use");
  }
  out->offloaded_committed_excess =
      std::max(out->offloaded_committed_excess, info.committed - info.used);
  // An inference Acquire (generation) reloads the parameters only: the device memory it
  // takes back is at most theirs, and the other states stay offloaded.
  if (c == 0 && !opt.non_blocking) {
    Result<std::vector<void*>> p = engine->Acquire({trainer.id(0)}, AcquireMode::kInference);
    if (!p.ok()) return p.status().WithContext("inference Acquire while offloaded");
    ZINF_RETURN_IF_ERROR(engine->Release({trainer.id(0)}));
    out->device_bytes_after_inference = device->MemoryInfo().used - out->trainer_device_bytes;
    // What it reloaded goes out again with the rest (the union, in one host copy).
    ZINF_RETURN_IF_ERROR(
        engine->OffloadStates(opt).WithContext("OffloadStates again after "
                                               "an inference Acquire"));
    if (device->MemoryInfo().used != once) {
      return Status::Internal("offloading again after an inference Acquire left " +
                              std::to_string(device->MemoryInfo().used) + " bytes, not " +
                              std::to_string(once));
    }
  }
  if (c == 0 && o.block_acquire_rank >= 0) {
    ZINF_RETURN_IF_ERROR(BlockedAcquire(o, rank, engine, trainer, device));
  }
  if (c == 0 && o.block_first_reload) {
    const DeviceMemoryInfo now = device->MemoryInfo();
    const size_t need = out->device_bytes_before_offload - (now.used - out->trainer_device_bytes);
    Result<void*> blocker = device->Alloc(now.budget - now.used - need / 2);
    if (!blocker.ok()) return blocker.status().WithContext("the reload's blocker");
    out->committed_before_blocked_reload = device->MemoryInfo().committed;
    out->blocked_reload = engine->ReloadStates(false);
    out->committed_after_blocked_reload = device->MemoryInfo().committed;
    device->Free(*blocker);
    if (!engine->states_offloaded()) {
      return Status::Internal("a failed ReloadStates left the states not offloaded");
    }
  }
  if (c + 1 < o.offload_cycles) {
    ZINF_RETURN_IF_ERROR(engine->ReloadStates(c % 2 == 0).WithContext("ReloadStates"));
    if (engine->states_offloaded()) return Status::Internal("ReloadStates left it offloaded");
  }
  return Status::OK();
}

// Whether the model registers (FinishRegistration succeeds) under the options' budgets.
inline Status RegisterOnly(const RunOptions& o, const std::string& nvme_dir) {
  std::unique_ptr<Device> device = NewTestHostDevice();
  auto comms = NewLocalComms({device.get()});
  if (!comms.ok()) return comms.status();
  Result<std::unique_ptr<Engine>> engine =
      Engine::Create(MakeConfig(o, nvme_dir), device.get(), (*comms)[0].get());
  if (!engine.ok()) return engine.status();
  RankTrainer trainer(engine->get(), device.get());
  ZINF_RETURN_IF_ERROR(trainer.Register());
  return (*engine)->FinishRegistration();
}

// The smallest pinned budget (to 4 KiB) under which the model registers.
inline uint64_t SmallestPinnedBudget(RunOptions o, const std::string& nvme_dir) {
  uint64_t lo = 4096, hi = kPinnedBudget;  // registers at hi, not at lo
  EXPECT_TRUE(RegisterOnly(o, nvme_dir).ok());
  while (hi - lo > 4096) {
    o.pinned_budget_bytes = (lo + hi) / 2 / 4096 * 4096;
    (RegisterOnly(o, nvme_dir).ok() ? hi : lo) = o.pinned_budget_bytes;
  }
  return hi;
}

// RankMain's training with RunOptions::layer_major (no checkpoints or offload cycles).
inline Status LayerMajorRun(const RunOptions& o, int rank, Engine* engine, RankTrainer* trainer,
                            RankOutput* out) {
  for (int w = 0; w < o.steps; ++w) {
    std::vector<int> row_begins;
    for (int j = 0; j < o.grad_accum; ++j) {
      row_begins.push_back(RowBegin(o, w * o.grad_accum + j, rank));
    }
    std::vector<double> losses;
    StepStats stats;
    ZINF_RETURN_IF_ERROR(
        trainer->LayerMajorWindow(row_begins, RowsPerRank(o), o.first_micro_only, &losses, &stats)
            .WithContext("window " + std::to_string(w)));
    for (double loss : losses) {
      out->losses.push_back(loss);
      out->stats.push_back(stats);
    }
    out->micro_steps_done.store((w + 1) * o.grad_accum);
  }
  out->phase.store(RankOutput::kGathering);
  Status gathered = trainer->GatherAll(&out->params);
  out->phase.store(RankOutput::kDestroying);
  return gathered;
}

inline Status RankMain(const RunOptions& o, int rank, Device* device, Communicator* comm,
                       const std::string& nvme_dir, RankOutput* out) {
  EngineHooks hooks;
  hooks.fault_plan = o.fault_plan;
  Result<std::unique_ptr<Engine>> created =
      Engine::Create(MakeConfig(o, nvme_dir), device, comm, hooks);
  if (!created.ok()) return created.status().WithContext("Engine::Create");
  std::unique_ptr<Engine> engine = std::move(*created);
  RankTrainer trainer(engine.get(), device);
  out->trainer_device_bytes = trainer.device_bytes();
  ZINF_RETURN_IF_ERROR(trainer.Register(/*finish=*/true, o.param_groups));
  for (int p = 0; p < Shape().num_params(); ++p) {
    out->infos.push_back(engine->param(trainer.id(p)));
  }
  out->phase.store(RankOutput::kTraining);
  if (o.load_first) {
    ZINF_RETURN_IF_ERROR(engine->LoadCheckpoint(o.checkpoint_dir).WithContext("LoadCheckpoint"));
  }
  const int micro_steps = o.steps * o.grad_accum;
  if (o.layer_major) return LayerMajorRun(o, rank, engine.get(), &trainer, out);
  for (int m = o.first_micro; m < micro_steps; ++m) {
    double loss = 0;
    StepStats stats;
    trainer.set_skip_gradient(m % o.grad_accum != 0 ? o.first_micro_only : -1);
    ZINF_RETURN_IF_ERROR(trainer
                             .MicroStep(RowBegin(o, m, rank), RowsPerRank(o),
                                        m == o.swapped_micro_step, &loss, &stats)
                             .WithContext("micro-step " + std::to_string(m)));
    out->losses.push_back(loss);
    out->stats.push_back(stats);
    out->micro_steps_done.store(m + 1);
    if (!o.checkpoint_dir.empty() && o.grad_accum > 1 && m % o.grad_accum == 0) {
      out->mid_window_save = engine->SaveCheckpoint(o.checkpoint_dir + "/never");
    }
    const bool boundary = (m + 1) % o.grad_accum == 0;
    for (int c = 0; boundary && m + 1 < micro_steps && c < o.offload_cycles; ++c) {
      if (o.nvme_faults && c == 1) {
        ZINF_RETURN_IF_ERROR(NvmeFaultCycle(rank, engine.get(), o.fault_plan.get()));
        continue;
      }
      ZINF_RETURN_IF_ERROR(OffloadCycle(o, rank, c, engine.get(), trainer, device, out));
    }
    if ((m + 1) % o.grad_accum == 0 && (m + 1) / o.grad_accum == o.save_after_step) {
      ZINF_RETURN_IF_ERROR(engine->SaveCheckpoint(o.checkpoint_dir).WithContext("SaveCheckpoint"));
    }
  }
  out->phase.store(RankOutput::kGathering);
  Status gathered = trainer.GatherAll(&out->params);
  out->phase.store(RankOutput::kDestroying);
  engine.reset();
  return gathered;
}

// RunTraining's devices and communicators: host devices and local communicators, one per
// rank (the GPU build of the test: one rank on CUDA device 0 with NCCL, unless o.host).
inline Status MakeRankDevices(const RunOptions& o, std::vector<std::unique_ptr<Device>>* devices,
                              std::vector<std::unique_ptr<Communicator>>* comms) {
#ifdef ZINF_ENGINE_TEST_CUDA
  if (!o.host) {
    if (o.ranks != 1) return Status::NotSupported("the CUDA engine test runs one rank");
    CudaDeviceOptions copt;
    copt.memory_budget = kHostDeviceMemory;
    Result<std::unique_ptr<Device>> cuda = NewCudaDevice(copt);
    if (!cuda.ok()) return cuda.status().WithContext("NewCudaDevice");
    devices->push_back(std::move(cuda).value());
    Result<std::unique_ptr<Communicator>> nccl =
        NewNcclComm((*devices)[0].get(), NcclCommOptions{});
    if (!nccl.ok()) return nccl.status().WithContext("NewNcclComm");
    comms->push_back(std::move(nccl).value());
    return Status::OK();
  }
#endif
  std::vector<Device*> raw_devices;
  for (int r = 0; r < o.ranks; ++r) {
    HostDeviceOptions dopt;
    dopt.memory_budget = kHostDeviceMemory;
    dopt.pool_chunk = kTestPoolChunk;  // what offload_states' trim leaves, to the page
    devices->push_back(NewTestHostDevice(dopt));
    raw_devices.push_back(devices->back().get());
  }
  Result<std::vector<std::unique_ptr<Communicator>>> local = NewLocalComms(raw_devices);
  if (!local.ok()) return local.status().WithContext("NewLocalComms");
  *comms = std::move(local).value();
  return Status::OK();
}

inline RunResult RunTraining(const RunOptions& o) {
  RunResult res;
  TempDir nvme_dir;
  if (!nvme_dir.ok()) {
    res.status = Status::IoError("mkdtemp under $ZINF_TEST_DIR or /var/tmp failed");
    return res;
  }
  std::vector<std::unique_ptr<Device>> devices;
  Result<std::vector<std::unique_ptr<Communicator>>> comms =
      std::vector<std::unique_ptr<Communicator>>{};
  res.status = MakeRankDevices(o, &devices, &*comms);
  if (!res.status.ok()) return res;
  // Every rank's communicator counts its collectives.
  std::vector<CountingComm*> counting;
  for (std::unique_ptr<Communicator>& c : *comms) {
    auto wrapped = std::make_unique<CountingComm>(std::move(c));
    counting.push_back(wrapped.get());
    c = std::move(wrapped);
  }
  std::vector<RankOutput> outs(o.ranks);
  auto progress = [&outs] {
    std::string s;
    for (size_t r = 0; r < outs.size(); ++r) {
      static const char* const kPhases[] = {"creating the engine or registering", "training",
                                            "in GatherMasterParameter", "destroying the engine",
                                            "finished"};
      s += "rank " + std::to_string(r) + ": " + kPhases[outs[r].phase.load()] + " (" +
           std::to_string(outs[r].micro_steps_done.load()) + " micro-steps done); ";
    }
    return s;
  };
  RunGuarded(
      "training (" + o.Describe() + ")", o.timeout,
      [&] {
        std::vector<std::thread> threads;
        for (int r = 0; r < o.ranks; ++r) {
          threads.emplace_back([&, r] {
            outs[r].status =
                RankMain(o, r, devices[r].get(), (*comms)[r].get(), nvme_dir.path(), &outs[r]);
            outs[r].phase.store(RankOutput::kFinished);
          });
        }
        for (std::thread& t : threads) t.join();
      },
      progress);

  // The first failing rank's status, with the others' appended: when one rank fails, the
  // others usually fail in the collective it left, and both halves of the story matter.
  for (int r = 0; r < o.ranks; ++r) {
    if (!outs[r].status.ok()) {
      std::string line = "rank " + std::to_string(r) + ": " + outs[r].status.message();
      res.status = res.status.ok() ? Status(outs[r].status.code(), line)
                                   : Status(res.status.code(), res.status.message() + " | " + line);
    }
    res.stats.push_back(outs[r].stats);
    res.mid_window_saves.push_back(outs[r].mid_window_save);
    res.device_peaks.push_back(devices[r]->MemoryInfo().peak - outs[r].trainer_device_bytes);
    res.collectives.push_back(counting[r]->counts());
    res.offloaded_device_bytes.push_back(outs[r].offloaded_device_bytes);
    res.offloaded_committed_excess.push_back(outs[r].offloaded_committed_excess);
    res.pinned_resident.push_back(
        {outs[r].pinned_resident_before_offload, outs[r].offloaded_pinned_resident});
    res.blocked_reloads.push_back(outs[r].blocked_reload);
    res.committed_around_blocked_reload.push_back(
        {outs[r].committed_before_blocked_reload, outs[r].committed_after_blocked_reload});
    res.device_bytes_before_offload.push_back(outs[r].device_bytes_before_offload);
    res.device_bytes_after_inference.push_back(outs[r].device_bytes_after_inference);
  }
  if (!res.status.ok()) return res;
  res.params = outs[0].params;
  res.infos = outs[0].infos;
  for (int r = 1; r < o.ranks; ++r) {
    for (size_t p = 0; p < res.params.size(); ++p) {
      if (outs[r].params[p].size() != res.params[p].size() ||
          std::memcmp(outs[r].params[p].data(), res.params[p].data(),
                      res.params[p].size() * sizeof(float)) != 0) {
        res.ranks_agree = false;
      }
    }
  }
  res.losses.assign(outs[0].losses.size(), 0.0);
  for (int r = 0; r < o.ranks; ++r) {
    for (size_t m = 0; m < res.losses.size(); ++m) res.losses[m] += outs[r].losses[m];
  }
  return res;
}

// Loss per optimizer step (the micro-steps' losses summed).
inline std::vector<double> StepLosses(const std::vector<double>& micro_losses, int grad_accum) {
  std::vector<double> out(micro_losses.size() / grad_accum, 0.0);
  for (size_t m = 0; m < micro_losses.size(); ++m) out[m / grad_accum] += micro_losses[m];
  return out;
}

// The all-in-memory run for `ranks` (with or without the delayed update), computed once per
// process.
inline const RunResult& Reference(int ranks, bool delayed = false) {
  static std::mutex mu;
  static std::map<std::pair<int, bool>, RunResult> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find({ranks, delayed});
  if (it == cache.end()) {
    RunOptions o;
    o.ranks = ranks;
    o.delayed = delayed;
    o.host = true;  // the GPU build compares its runs with the host device's
    it = cache.emplace(std::make_pair(ranks, delayed), RunTraining(o)).first;
  }
  return it->second;
}

// ---- The test's own simulation of the same training -----------------------------------------

struct SimResult {
  std::vector<std::vector<float>> params;
  std::vector<double> losses;      // per micro-step, summed over ranks in rank order
  std::vector<double> grad_norms;  // per optimizer step, before clipping
};

// Simulate's states converted from `from` to `to` (RunOptions::switch_states_at).
inline void ConvertSimulatedStates(StateType from, StateType to,
                                   std::vector<std::vector<uint8_t>>* s1,
                                   std::vector<std::vector<uint8_t>>* s2) {
  const MlpShape& shape = Shape();
  for (int p = 0; p < shape.num_params(); ++p) {
    for (auto [buf, role] : {std::pair{&(*s1)[p], StateRole::kSigned},
                             std::pair{&(*s2)[p], StateRole::kNonNegative}}) {
      std::vector<uint8_t> converted(buf->size(), 0);
      Status s =
          ConvertOptimizerState(from, buf->data(), to, converted.data(), shape.numel(p), role);
      ZINF_CHECK_MSG(s.ok(), s.ToString().c_str());
      *buf = std::move(converted);
    }
  }
}

// Simulate's optimizer step `step` (0-based): AdamW on the window's gradients `acc`, clipped by
// `coef`, with the states s1, s2 (of type `states`).
inline void SimulatedUpdate(const RunOptions& o, int step, float coef, StateType states,
                            const std::vector<std::vector<float>>& acc,
                            std::vector<std::vector<uint8_t>>* s1_all,
                            std::vector<std::vector<uint8_t>>* s2_all, SimResult* out) {
  SimResult& sim = *out;
  std::vector<std::vector<uint8_t>>& s1 = *s1_all;
  std::vector<std::vector<uint8_t>>& s2 = *s2_all;
  const int np = static_cast<int>(acc.size());
  OptimizerHyperParams hp;
  hp.kind = OptimizerKind::kAdamW;
  hp.step = step + 1;
  hp.lr = kLr;
  hp.beta1 = kBeta1;
  hp.beta2 = kBeta2;
  hp.eps = kEps;
  hp.weight_decay = kWeightDecay;
  hp.grad_scale = coef;
  for (int p = 0; p < np; ++p) {
    if (o.param_groups) {
      const ParamGroupHyper g =
          p % 2 == 1 ? BiasGroup() : ParamGroupHyper{kLr, kBeta1, kBeta2, kEps, kWeightDecay};
      hp.lr = g.lr;
      hp.beta1 = g.beta1;
      hp.beta2 = g.beta2;
      hp.eps = g.eps;
      hp.weight_decay = g.weight_decay;
    }
    OptimizerTensors t;
    t.param = sim.params[p].data();
    t.grad = acc[p].data();
    t.grad_type = GradType::kF32;
    if (states != StateType::kF32) {
      t.state_type = states;
      t.state1 = s1[p].data();
      t.state2 = s2[p].data();
    } else {
      t.exp_avg = reinterpret_cast<float*>(s1[p].data());
      t.exp_avg_sq = reinterpret_cast<float*>(s2[p].data());
    }
    t.n = acc[p].size();
    Status s = OptimizerStep(hp, t, CpuIsa::kScalar);
    ZINF_CHECK_MSG(s.ok(), s.ToString().c_str());
  }
}

// Mirrors what the engine must compute: per micro-step, each rank's gradient of its rows,
// summed over ranks in rank order (LocalComm's ReduceScatterSum), accumulated over the
// micro-steps, clipped by the global norm (coefficient clip / (norm + 1e-6), DeepSpeed's),
// then one AdamW step with the scalar reference kernel. With the delayed update, optimizer
// step s's gradients are computed on the parameters after step s - 2 (steps 1 and 2 both on
// the initial values): the update of step s - 1 is still running while step s computes. A
// checkpoint saved after step D finishes that update first, so steps D + 1 and D + 2 both
// run on the parameters after step D.
inline SimResult Simulate(const RunOptions& o) {
  const MlpShape& shape = Shape();
  const int np = shape.num_params();
  SimResult sim;
  sim.params.resize(np);
  std::vector<std::vector<float>> acc(np);
  // The states, in any StateType (room for fp32, the largest). Compressed ones are simulated
  // for one rank: a parameter's blocks start at its first element, as in the engine's
  // sub-group, where every slice starts a block.
  std::vector<std::vector<uint8_t>> s1(np), s2(np);
  ZINF_CHECK_MSG(o.optimizer == OptimizerType::kAdamW, "the simulation runs AdamW");
  StateType states = o.switch_states_at > 0 ? o.states_before : o.state_type;
  ZINF_CHECK_MSG((states == StateType::kF32 && o.state_type == StateType::kF32) || o.ranks == 1,
                 "compressed states are simulated for one rank");
  for (int p = 0; p < np; ++p) {
    sim.params[p].resize(shape.numel(p));
    testing::InitParam(shape, p, sim.params[p].data(), shape.numel(p));
    const size_t room = std::max(StateBytes(StateType::kF32, shape.numel(p)),
                                 StateBytes(StateType::kInt8, shape.numel(p)));
    s1[p].assign(room, 0);
    s2[p].assign(room, 0);
  }
  std::vector<std::vector<std::vector<float>>> history = {sim.params};  // after 0, 1, ... steps
  for (int step = 0; step < o.steps; ++step) {
    if (step == o.switch_states_at && states != o.state_type) {
      ConvertSimulatedStates(states, o.state_type, &s1, &s2);
      states = o.state_type;
    }
    // Delayed: the parameters after step s - 2, or s - 1 while the delay has not started
    // (the update of window w is delayed when w > delayed_after).
    int version = step > o.delayed_after ? std::max(step - 1, 0) : step;
    if (o.save_after_step >= 0 && step >= o.save_after_step) {
      version = std::max(version, o.save_after_step);
    }
    const std::vector<std::vector<float>>& used = o.delayed ? history[version] : sim.params;
    for (int p = 0; p < np; ++p) acc[p].assign(shape.numel(p), 0.0f);
    // Stages 0 and 1 with accumulation: each rank sums its micro-steps first, then the ranks'
    // sums are added in rank order (one reduction per window).
    const bool local_sums = o.stage <= 1 && o.grad_accum > 1;
    std::vector<std::vector<std::vector<float>>> rank_acc(o.ranks, acc);
    for (int micro = step * o.grad_accum; micro < (step + 1) * o.grad_accum; ++micro) {
      std::vector<std::vector<float>> sum;
      double loss = 0.0;
      for (int r = 0; r < o.ranks; ++r) {
        std::vector<std::vector<float>> g;
        loss += testing::MlpGradients(shape, TheBatch(), RowBegin(o, micro, r), RowsPerRank(o),
                                      LossScale(), used, &g);
        if (o.first_micro_only >= 0 && micro % o.grad_accum != 0) {
          std::fill(g[o.first_micro_only].begin(), g[o.first_micro_only].end(), 0.0f);
        }
        if (local_sums) {
          for (int p = 0; p < np; ++p) {
            for (size_t i = 0; i < g[p].size(); ++i) rank_acc[r][p][i] += g[p][i];
          }
          continue;
        }
        if (r == 0) {
          sum = std::move(g);
        } else {
          for (int p = 0; p < np; ++p) {
            for (size_t i = 0; i < sum[p].size(); ++i) sum[p][i] += g[p][i];
          }
        }
      }
      sim.losses.push_back(loss);
      if (local_sums) continue;
      for (int p = 0; p < np; ++p) {
        for (size_t i = 0; i < acc[p].size(); ++i) acc[p][i] += sum[p][i];
      }
    }
    if (local_sums) {
      std::vector<std::vector<float>> sum = rank_acc[0];
      for (int r = 1; r < o.ranks; ++r) {
        for (int p = 0; p < np; ++p) {
          for (size_t i = 0; i < sum[p].size(); ++i) sum[p][i] += rank_acc[r][p][i];
        }
      }
      for (int p = 0; p < np; ++p) {
        for (size_t i = 0; i < acc[p].size(); ++i) acc[p][i] += sum[p][i];
      }
    }
    double sq = 0.0;
    for (int p = 0; p < np; ++p) {
      for (float g : acc[p]) sq += static_cast<double>(g) * g;
    }
    const double norm = std::sqrt(sq);
    sim.grad_norms.push_back(norm);
    float coef = 1.0f;
    if (o.clipping > 0 && norm > o.clipping) {
      coef = static_cast<float>(o.clipping / (norm + 1e-6));
    }
    SimulatedUpdate(o, step, coef, states, acc, &s1, &s2, &sim);
    history.push_back(sim.params);
  }
  return sim;
}

// ---- Comparisons ----------------------------------------------------------------------------

// "" when a and b hold the same bits; else the first differing element and how many differ.
inline std::string FirstBitDifference(const std::vector<std::vector<float>>& a,
                                      const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return "different parameter counts";
  std::string first;
  size_t differing = 0;
  for (size_t p = 0; p < a.size(); ++p) {
    if (a[p].size() != b[p].size()) return ParamName(p) + ": different sizes";
    for (size_t i = 0; i < a[p].size(); ++i) {
      if (std::memcmp(&a[p][i], &b[p][i], sizeof(float)) == 0) continue;
      if (differing++ == 0) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "%s[%zu]: %.9g vs %.9g", ParamName(p).c_str(), i, a[p][i],
                      b[p][i]);
        first = buf;
      }
    }
  }
  if (differing == 0) return "";
  return "first difference at " + first + " (" + std::to_string(differing) + " of " +
         std::to_string(Shape().total_numel()) + " elements differ)";
}

struct Diff {
  double max_abs = 0;
  double rms = 0;
  std::string where;  // the element with the largest difference
};

inline Diff Compare(const std::vector<std::vector<float>>& a,
                    const std::vector<std::vector<float>>& b) {
  Diff d;
  double sq = 0;
  size_t n = 0;
  for (size_t p = 0; p < a.size() && p < b.size(); ++p) {
    for (size_t i = 0; i < a[p].size() && i < b[p].size(); ++i) {
      double e = std::fabs(static_cast<double>(a[p][i]) - b[p][i]);
      if (!(e <= d.max_abs)) {  // also catches NaN
        d.max_abs = std::isnan(e) ? INFINITY : e;
        d.where = ParamName(p) + "[" + std::to_string(i) + "]: " + std::to_string(a[p][i]) +
                  " vs " + std::to_string(b[p][i]);
      }
      sq += e * e;
      ++n;
    }
  }
  d.rms = n ? std::sqrt(sq / n) : 0;
  return d;
}

// Whether two runs' parameters are the same, bit for bit.
inline bool SameBits(const std::vector<std::vector<float>>& a,
                     const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t p = 0; p < a.size(); ++p) {
    if (a[p].size() != b[p].size() ||
        std::memcmp(a[p].data(), b[p].data(), a[p].size() * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

inline bool AllFinite(const std::vector<std::vector<float>>& params) {
  for (const auto& t : params) {
    for (float x : t) {
      if (!std::isfinite(x)) return false;
    }
  }
  return true;
}

// Tolerances against the simulation. The engine gets the same gradients bit for bit (the test
// computes them, LocalComm sums them in rank order as the simulation does); what may differ is
// the optimizer arithmetic (another kernel variant, a clipping coefficient computed in another
// order), by an ulp or so. Such a difference moves the parameters by ~1e-9, which changes later
// gradients by ~1e-7 relative. Adam amplifies a gradient change dg by at most lr / eps * dg
// where |g| ~ eps, which bounds the effect at ~1e-4 on a few elements; typical elements move
// by far less. A real bug (a step missing or repeated, stale parameters, a wrong gradient
// scale, clipping not applied) moves most elements by ~lr = 1e-2. (Measured: 0 without
// clipping, 4.8e-7 with it.)
constexpr double kSimMaxAbs = 1e-4;
constexpr double kSimRms = 1e-6;

// Invariants every successful run must satisfy.
inline void ExpectHealthyRun(const RunOptions& o, const RunResult& r) {
  EXPECT_TRUE(r.ranks_agree) << "ranks gathered different master parameters";
  EXPECT_TRUE(AllFinite(r.params));
  const bool uses_nvme =
      o.param_tier == Tier::kNvme || (o.optimizer_tier == Tier::kNvme && o.ratio > 0);
  const uint64_t device_budget = o.device_budget_bytes ? o.device_budget_bytes : kHostDeviceMemory;
  for (int rank = 0; rank < o.ranks; ++rank) {
    const std::vector<StepStats>& stats = r.stats[rank];
    ASSERT_EQ(stats.size(), static_cast<size_t>(o.steps * o.grad_accum));
    uint64_t nvme_traffic = 0;
    for (size_t m = 0; m < stats.size(); ++m) {
      SCOPED_TRACE("rank " + std::to_string(rank) + " micro-step " + std::to_string(m));
      // (Layer-major: each micro-batch carries its window's Step, which ends the window.)
      const bool boundary = o.layer_major || (m + 1) % o.grad_accum == 0;
      EXPECT_EQ(stats[m].optimizer_ran, boundary);
      EXPECT_EQ(stats[m].step, static_cast<int64_t>(o.layer_major ? m / o.grad_accum + 1
                                                                  : (m + 1) / o.grad_accum));
      EXPECT_LE(stats[m].peak_device_bytes, device_budget);
      EXPECT_LE(stats[m].peak_pinned_bytes, o.pinned_budget_bytes);
      nvme_traffic += stats[m].nvme_read_bytes + stats[m].nvme_write_bytes;
      if (!uses_nvme) {
        EXPECT_EQ(stats[m].nvme_bytes, 0u);
      }
    }
    if (uses_nvme) {
      EXPECT_GT(nvme_traffic, 0u) << "an nvme placement did no NVMe I/O during the steps";
      EXPECT_GT(stats.back().nvme_bytes, 0u);
    } else {
      EXPECT_EQ(nvme_traffic, 0u);
    }
    if (o.device_budget_bytes) {
      EXPECT_LE(r.device_peaks[rank], o.device_budget_bytes);
    }
  }
  std::vector<double> losses = StepLosses(r.losses, o.grad_accum);
  ASSERT_GE(losses.size(), 2u);
  EXPECT_LT(losses.back(), losses.front()) << "the loss did not decrease";
}

}  // namespace engine_test
}  // namespace zinf
