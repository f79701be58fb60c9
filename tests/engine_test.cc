// End-to-end tests of the engine through its public API: a deep MLP (tests/engine_test_model.h)
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
#include "zinf/engine.h"

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

#include "engine/host/local_comm.h"
#include "tests/engine_test_model.h"
#include "tests/test_util.h"
#include "zinf/comm.h"
#include "zinf/config.h"
#include "zinf/cpu_adam.h"
#include "zinf/swap.h"
#ifdef ZINF_ENGINE_TEST_CUDA
#include "zinf/cuda.h"
#endif
#include "zinf/device.h"
#include "zinf/io.h"
#include "zinf/log.h"

namespace zinf {

// Readable test parameters ("nvme", not "4-byte object <02-00 00-00>"); found by ADL.
static void PrintTo(Tier tier, std::ostream* os) {
  *os << (tier == Tier::kDevice ? "device" : tier == Tier::kCpu ? "cpu" : "nvme");
}

namespace {

using testing::Batch;
using testing::MlpShape;
using testing::MlpWorkspace;
using testing::TempDir;

// ---- The training problem -------------------------------------------------------------------

// 45,040 parameters in 12 tensors: with sub_group_size 20,000 the optimizer has several
// sub-groups, and with param_persistence_threshold 100 the biases (96 and 16 elements) persist
// while the weights (>= 1,536 elements) are fetched on every use.
const MlpShape& Shape() {
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
constexpr float kBeta1 = 0.9f;
constexpr float kBeta2 = 0.999f;
constexpr float kEps = 1e-8f;
constexpr double kClip = 0.05;  // below every step's gradient norm here (0.14 to 0.47)
// The model needs ~1.5 MiB pinned; each rank's arena is allocated (and mlocked) whole.
constexpr uint64_t kPinnedBudget = 4ull << 20;
constexpr size_t kHostDeviceMemory = 64ull << 20;

const Batch& TheBatch() {
  static const Batch batch = testing::MakeBatch(Shape(), kGlobalBatch, kBatchSeed);
  return batch;
}

// The loss is mean over the global batch and the outputs: 1/256, a power of two, so scaling
// is exact.
float LossScale() { return 1.0f / static_cast<float>(kGlobalBatch * Shape().widths.back()); }

std::string ParamName(int p) {
  return "mlp.layer" + std::to_string(MlpShape::layer_of(p)) +
         (MlpShape::is_weight(p) ? ".weight" : ".bias");
}

const char* TierLabel(Tier t) {
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
const std::string& CudaSkipReason() {
  static const std::string reason = [] {
    CudaDeviceOptions probe;
    probe.memory_budget = 1 << 20;
    Result<std::unique_ptr<Device>> d = NewCudaDevice(probe);
    return d.ok() ? std::string() : "no usable CUDA device: " + d.status().ToString();
  }();
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
void RunGuarded(const std::string& what, std::chrono::seconds limit, std::function<void()> fn,
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
  // `device`: the engine's device when it is not the host device (CudaDevice): parameters are
  // then copied to host memory for the test's CPU kernels, and gradients back to the device.
  explicit RankTrainer(Engine* engine, Device* device = nullptr)
      : engine_(engine), device_(device != nullptr && !device->IsHost() ? device : nullptr) {}
  ~RankTrainer() {
    if (grad_dev_ != nullptr) device_->Free(grad_dev_);
  }
  RankTrainer(const RankTrainer&) = delete;
  RankTrainer& operator=(const RankTrainer&) = delete;

  // Registers W0, b0, W1, b1, ... in layer order, then ends registration.
  // `finish`: end registration (else the caller does, e.g. by Engine::ResumeFromStore).
  Status Register(bool finish = true) {
    const MlpShape& shape = Shape();
    for (int p = 0; p < shape.num_params(); ++p) {
      ParamSpec spec;
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
  // ReduceGradient calls that succeeded in the last micro-step.
  int gradients_reduced() const { return gradients_reduced_; }

  // One micro-step over rows [row_begin, row_begin + rows) of the batch: forward layer by
  // layer, backward in reverse with ReduceGradient for every parameter, then Step().
  // With `swap_first_two`, the forward acquires layer 1 before layer 0 (a different Acquire
  // sequence, the same arithmetic). On failure, releases what it holds and returns the first
  // error, naming the call.
  Status MicroStep(int row_begin, int rows, bool swap_first_two, double* loss, StepStats* stats) {
    gradients_reduced_ = 0;
    Status s = ForwardBackward(row_begin, rows, swap_first_two, loss);
    if (!s.ok()) {
      for (int l : held_) (void)engine_->Release(LayerIds(l));
      held_.clear();
      return s;
    }
    Result<StepStats> st = engine_->Step();
    if (!st.ok()) return st.status().WithContext("Step");
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
  Status Reduce(int p, const std::vector<float>& grad) {
    const float* src = grad.data();
    if (device_ != nullptr) {
      const size_t bytes = grad.size() * sizeof(float);
      if (bytes > grad_dev_bytes_) {
        if (grad_dev_ != nullptr) {
          ZINF_RETURN_IF_ERROR(device_->SynchronizeStream(device_->ComputeStream()));
          device_->Free(grad_dev_);
          grad_dev_ = nullptr;
        }
        ZINF_ASSIGN_OR_RETURN(grad_dev_, device_->Alloc(Shape().largest_layer_bytes()));
        grad_dev_bytes_ = Shape().largest_layer_bytes();
      }
      ZINF_RETURN_IF_ERROR(
          device_->CopyHostToDevice(grad_dev_, src, bytes, device_->ComputeStream()));
      src = static_cast<const float*>(grad_dev_);
    }
    ZINF_RETURN_IF_ERROR(
        engine_->ReduceGradient(ids_[p], src).WithContext("ReduceGradient " + ParamName(p)));
    if (device_ != nullptr) {
      // The host vector is reused for the next layer: the copy out of it must be done.
      ZINF_RETURN_IF_ERROR(device_->SynchronizeStream(device_->ComputeStream()));
    }
    ++gradients_reduced_;
    return Status::OK();
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

  Engine* engine_;
  Device* device_ = nullptr;  // set only for a device that is not the host
  std::map<int, std::vector<float>> host_w_, host_b_;
  void* grad_dev_ = nullptr;
  size_t grad_dev_bytes_ = 0;
  std::vector<ParamId> ids_;
  std::vector<int> held_;  // layers acquired and not yet released
  int gradients_reduced_ = 0;
  MlpWorkspace ws_;
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
  // Checkpoints: save after this many optimizer steps (-1: never) into checkpoint_dir; or load
  // from it before the first micro-step and start at micro-step first_micro.
  std::string checkpoint_dir;
  int save_after_step = -1;
  bool load_first = false;
  int first_micro = 0;
  std::chrono::seconds timeout{120};

  std::string Describe() const {
    std::ostringstream os;
    os << ranks << " rank(s), params " << TierLabel(param_tier) << ", optimizer "
       << TierLabel(optimizer_tier) << ", accumulation " << grad_accum << ", clipping " << clipping
       << ", device budget " << device_budget_bytes;
    if (delayed) os << ", delayed update";
    if (ratio < 1) os << ", optimizer ratio " << ratio;
    if (swapped_micro_step >= 0) os << ", swapped acquire order at " << swapped_micro_step;
    return os.str();
  }
};

EngineConfig MakeConfig(const RunOptions& o, const std::string& nvme_dir) {
  EngineConfig c;
  c.offload_param.tier = o.param_tier;
  c.offload_optimizer.tier = o.optimizer_tier;
  // All ranks get the same config, as they would from one JSON file: one shared nvme folder.
  if (o.param_tier == Tier::kNvme) c.offload_param.nvme_paths = {nvme_dir};
  if (o.optimizer_tier == Tier::kNvme) c.offload_optimizer.nvme_paths = {nvme_dir};
  // Swap buffers sized for this model (elements; the largest tensor is 9,216), not 100M.
  c.offload_param.buffer_size = 1 << 16;
  c.offload_optimizer.buffer_size = 1 << 16;
  c.sub_group_size = o.sub_group_size;
  // Prefetch up to ~4 layers ahead (elements), sized for this model like the buffers above.
  c.prefetch_bucket_size = 40000;
  c.param_persistence_threshold = kPersistenceThreshold;
  c.optimizer.type = OptimizerType::kAdamW;
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
  return c;
}

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
};

struct RunResult {
  Status status;                              // the first failing rank's error ("rank r: ...")
  std::vector<std::vector<float>> params;     // rank 0's gathered masters, per parameter
  bool ranks_agree = true;                    // every rank gathered the same bits
  std::vector<double> losses;                 // per micro-step, summed over ranks in rank order
  std::vector<std::vector<StepStats>> stats;  // [rank][micro-step]
  std::vector<ParamInfo> infos;               // rank 0's
  std::vector<size_t> device_peaks;           // per rank: the HostDevice's own peak allocation
  std::vector<Status> mid_window_saves;       // per rank
};

// The micro-step's rows for `rank`: the global batch is split over the micro-steps of an
// optimizer step, and each micro-batch over the ranks.
int RowBegin(const RunOptions& o, int micro, int rank) {
  int micro_rows = kGlobalBatch / o.grad_accum;
  return (micro % o.grad_accum) * micro_rows + rank * (micro_rows / o.ranks);
}
int RowsPerRank(const RunOptions& o) { return kGlobalBatch / (o.grad_accum * o.ranks); }

Status RankMain(const RunOptions& o, int rank, Device* device, Communicator* comm,
                const std::string& nvme_dir, RankOutput* out) {
  Result<std::unique_ptr<Engine>> created = Engine::Create(MakeConfig(o, nvme_dir), device, comm);
  if (!created.ok()) return created.status().WithContext("Engine::Create");
  std::unique_ptr<Engine> engine = std::move(*created);
  RankTrainer trainer(engine.get(), device);
  ZINF_RETURN_IF_ERROR(trainer.Register());
  for (int p = 0; p < Shape().num_params(); ++p) {
    out->infos.push_back(engine->param(trainer.id(p)));
  }
  out->phase.store(RankOutput::kTraining);
  if (o.load_first) {
    ZINF_RETURN_IF_ERROR(engine->LoadCheckpoint(o.checkpoint_dir).WithContext("LoadCheckpoint"));
  }
  const int micro_steps = o.steps * o.grad_accum;
  for (int m = o.first_micro; m < micro_steps; ++m) {
    double loss = 0;
    StepStats stats;
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

RunResult RunTraining(const RunOptions& o) {
  RunResult res;
  TempDir nvme_dir;
  if (!nvme_dir.ok()) {
    res.status = Status::IoError("mkdtemp under $ZINF_TEST_DIR or /var/tmp failed");
    return res;
  }
  std::vector<std::unique_ptr<Device>> devices;
  Result<std::vector<std::unique_ptr<Communicator>>> comms =
      std::vector<std::unique_ptr<Communicator>>{};
#ifdef ZINF_ENGINE_TEST_CUDA
  if (!o.host) {
    // The GPU build of this test: one rank on CUDA device 0 with an NCCL communicator.
    if (o.ranks != 1) {
      res.status = Status::NotSupported("the CUDA engine test runs one rank");
      return res;
    }
    CudaDeviceOptions copt;
    copt.memory_budget = kHostDeviceMemory;
    Result<std::unique_ptr<Device>> cuda = NewCudaDevice(copt);
    if (!cuda.ok()) {
      res.status = cuda.status().WithContext("NewCudaDevice");
      return res;
    }
    devices.push_back(std::move(cuda).value());
    Result<std::unique_ptr<Communicator>> nccl = NewNcclComm(devices[0].get(), NcclCommOptions{});
    if (!nccl.ok()) {
      res.status = nccl.status().WithContext("NewNcclComm");
      return res;
    }
    comms->push_back(std::move(nccl).value());
  }
#endif
  if (devices.empty()) {
    std::vector<Device*> raw_devices;
    for (int r = 0; r < o.ranks; ++r) {
      HostDeviceOptions dopt;
      dopt.memory_budget = kHostDeviceMemory;
      devices.push_back(NewHostDevice(dopt));
      raw_devices.push_back(devices.back().get());
    }
    comms = NewLocalComms(raw_devices);
    if (!comms.ok()) {
      res.status = comms.status().WithContext("NewLocalComms");
      return res;
    }
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
    res.device_peaks.push_back(devices[r]->MemoryInfo().peak);
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
std::vector<double> StepLosses(const std::vector<double>& micro_losses, int grad_accum) {
  std::vector<double> out(micro_losses.size() / grad_accum, 0.0);
  for (size_t m = 0; m < micro_losses.size(); ++m) out[m / grad_accum] += micro_losses[m];
  return out;
}

// The all-in-memory run for `ranks` (with or without the delayed update), computed once per
// process.
const RunResult& Reference(int ranks, bool delayed = false) {
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

// Mirrors what the engine must compute: per micro-step, each rank's gradient of its rows,
// summed over ranks in rank order (LocalComm's ReduceScatterSum), accumulated over the
// micro-steps, clipped by the global norm (coefficient clip / (norm + 1e-6), DeepSpeed's),
// then one AdamW step with the scalar reference kernel. With the delayed update, optimizer
// step s's gradients are computed on the parameters after step s - 2 (steps 1 and 2 both on
// the initial values): the update of step s - 1 is still running while step s computes. A
// checkpoint saved after step D finishes that update first, so steps D + 1 and D + 2 both
// run on the parameters after step D.
SimResult Simulate(const RunOptions& o) {
  const MlpShape& shape = Shape();
  const int np = shape.num_params();
  SimResult sim;
  sim.params.resize(np);
  std::vector<std::vector<float>> m(np), v(np), acc(np);
  for (int p = 0; p < np; ++p) {
    sim.params[p].resize(shape.numel(p));
    testing::InitParam(shape, p, sim.params[p].data(), shape.numel(p));
    m[p].assign(shape.numel(p), 0.0f);
    v[p].assign(shape.numel(p), 0.0f);
  }
  std::vector<std::vector<std::vector<float>>> history = {sim.params};  // after 0, 1, ... steps
  for (int step = 0; step < o.steps; ++step) {
    // Delayed: the parameters after step s - 2, or s - 1 while the delay has not started
    // (the update of window w is delayed when w > delayed_after).
    int version = step > o.delayed_after ? std::max(step - 1, 0) : step;
    if (o.save_after_step >= 0 && step >= o.save_after_step) {
      version = std::max(version, o.save_after_step);
    }
    const std::vector<std::vector<float>>& used = o.delayed ? history[version] : sim.params;
    for (int p = 0; p < np; ++p) acc[p].assign(shape.numel(p), 0.0f);
    for (int micro = step * o.grad_accum; micro < (step + 1) * o.grad_accum; ++micro) {
      std::vector<std::vector<float>> sum;
      double loss = 0.0;
      for (int r = 0; r < o.ranks; ++r) {
        std::vector<std::vector<float>> g;
        loss += testing::MlpGradients(shape, TheBatch(), RowBegin(o, micro, r), RowsPerRank(o),
                                      LossScale(), used, &g);
        if (r == 0) {
          sum = std::move(g);
        } else {
          for (int p = 0; p < np; ++p) {
            for (size_t i = 0; i < sum[p].size(); ++i) sum[p][i] += g[p][i];
          }
        }
      }
      sim.losses.push_back(loss);
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
      OptimizerTensors t;
      t.param = sim.params[p].data();
      t.grad = acc[p].data();
      t.grad_type = GradType::kF32;
      t.exp_avg = m[p].data();
      t.exp_avg_sq = v[p].data();
      t.n = acc[p].size();
      Status s = OptimizerStep(hp, t, CpuIsa::kScalar);
      ZINF_CHECK_MSG(s.ok(), s.ToString().c_str());
    }
    history.push_back(sim.params);
  }
  return sim;
}

// ---- Comparisons ----------------------------------------------------------------------------

// "" when a and b hold the same bits; else the first differing element and how many differ.
std::string FirstBitDifference(const std::vector<std::vector<float>>& a,
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

Diff Compare(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
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

bool AllFinite(const std::vector<std::vector<float>>& params) {
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
void ExpectHealthyRun(const RunOptions& o, const RunResult& r) {
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
      const bool boundary = (m + 1) % o.grad_accum == 0;
      EXPECT_EQ(stats[m].optimizer_ran, boundary);
      EXPECT_EQ(stats[m].step, static_cast<int64_t>((m + 1) / o.grad_accum));
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

// ---- The model itself -----------------------------------------------------------------------

// The test's kernels are right (so a failure below is the engine's): analytic gradients agree
// with central differences, computed in double from the fp32 forward.
TEST(EngineTestModel, GradientsMatchFiniteDifferences) {
  const MlpShape& shape = Shape();
  std::vector<std::vector<float>> params(shape.num_params());
  for (int p = 0; p < shape.num_params(); ++p) {
    params[p].resize(shape.numel(p));
    testing::InitParam(shape, p, params[p].data(), shape.numel(p));
  }
  const float scale = LossScale();
  std::vector<std::vector<float>> grads, unused;
  testing::MlpGradients(shape, TheBatch(), 0, kGlobalBatch, scale, params, &grads);
  for (int p = 0; p < shape.num_params(); ++p) {
    // The element with the largest gradient: its finite difference is well above fp32 noise.
    size_t i = std::max_element(grads[p].begin(), grads[p].end(),
                                [](float a, float b) { return std::fabs(a) < std::fabs(b); }) -
               grads[p].begin();
    const float h = 1e-2f;
    const float x = params[p][i];
    params[p][i] = x + h;
    double up = testing::MlpGradients(shape, TheBatch(), 0, kGlobalBatch, scale, params, &unused);
    params[p][i] = x - h;
    double down = testing::MlpGradients(shape, TheBatch(), 0, kGlobalBatch, scale, params, &unused);
    params[p][i] = x;
    double numeric = (up - down) / (2.0 * h);
    EXPECT_NEAR(numeric, grads[p][i], 0.05 * std::fabs(grads[p][i]) + 1e-6)
        << ParamName(p) << "[" << i << "]";
  }
}

// ---- Every placement is bit-identical to the all-in-memory run ------------------------------

// ranks, param tier, optimizer tier, delayed update
using PlacementParam = std::tuple<int, Tier, Tier, bool>;

class PlacementTest : public ::testing::TestWithParam<PlacementParam> {};

TEST_P(PlacementTest, BitIdenticalToAllInMemoryRun) {
  ZINF_SKIP_WITHOUT_CUDA();  // the GPU build only
  RunOptions o;
  std::tie(o.ranks, o.param_tier, o.optimizer_tier, o.delayed) = GetParam();
  const RunResult& ref = Reference(o.ranks, o.delayed);
  ASSERT_TRUE(ref.status.ok()) << "all-in-memory run: " << ref.status.ToString();
  RunResult run = RunTraining(o);
  ASSERT_TRUE(run.status.ok()) << o.Describe() << ": " << run.status.ToString();
  ExpectHealthyRun(o, run);
  EXPECT_EQ(FirstBitDifference(run.params, ref.params), "")
      << o.Describe() << " vs the all-in-memory run";
  ASSERT_EQ(run.losses.size(), ref.losses.size());
  for (size_t m = 0; m < run.losses.size(); ++m) {
    EXPECT_EQ(std::memcmp(&run.losses[m], &ref.losses[m], sizeof(double)), 0)
        << "micro-step " << m << " loss " << run.losses[m] << " vs " << ref.losses[m];
  }
}

std::string PlacementName(const ::testing::TestParamInfo<PlacementParam>& info) {
  return "Ranks" + std::to_string(std::get<0>(info.param)) + "_Param" +
         TierLabel(std::get<1>(info.param)) + "_Optimizer" + TierLabel(std::get<2>(info.param)) +
         (std::get<3>(info.param) ? "_Delayed" : "");
}

INSTANTIATE_TEST_SUITE_P(
    AllPlacements, PlacementTest,
    ::testing::Combine(::testing::Values(1, 2, 4),
                       ::testing::Values(Tier::kDevice, Tier::kCpu, Tier::kNvme),
                       ::testing::Values(Tier::kCpu, Tier::kNvme), ::testing::Bool()),
    PlacementName);

// ---- offload_optimizer.ratio: part of the sub-groups stepped on the device --------------------

// ranks, param tier, optimizer tier, ratio
using RatioParam = std::tuple<int, Tier, Tier, double>;

class RatioTest : public ::testing::TestWithParam<RatioParam> {};

// The sub-groups beyond the ratio keep their states in device memory and are stepped there
// (Device::OptimizerStep; with the parameters on the device it writes them straight into
// their stores): bit-identical to the all-in-memory run, and the device holds their states.
TEST_P(RatioTest, BitIdenticalToAllInMemoryRunWithTheRestOnTheDevice) {
  ZINF_SKIP_WITHOUT_CUDA();
  RunOptions o;
  std::tie(o.ranks, o.param_tier, o.optimizer_tier, o.ratio) = GetParam();
  const RunResult& ref = Reference(o.ranks);
  ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
  RunResult run = RunTraining(o);
  ASSERT_TRUE(run.status.ok()) << o.Describe() << ": " << run.status.ToString();
  ExpectHealthyRun(o, run);
  EXPECT_EQ(FirstBitDifference(run.params, ref.params), "") << o.Describe();
  if (run.device_peaks.empty()) return;  // the CUDA build: no HostDevice to ask
  // The device holds the states of the sub-groups kept there: compare with ratio 1.
  RunOptions offloaded = o;
  offloaded.ratio = 1.0;
  RunResult all_cpu = RunTraining(offloaded);
  ASSERT_TRUE(all_cpu.status.ok()) << all_cpu.status.ToString();
  size_t group_states_min = SIZE_MAX;  // the smallest sub-group's [master|m|v]
  std::map<size_t, size_t> group_numel;
  for (const ParamInfo& info : run.infos) group_numel[info.sub_group] += info.partition_numel;
  ASSERT_GE(group_numel.size(), 2u) << "the test model needs several sub-groups";
  for (const auto& [g, n] : group_numel) group_states_min = std::min(group_states_min, 12 * n);
  for (int r = 0; r < o.ranks; ++r) {
    EXPECT_GE(run.device_peaks[r], all_cpu.device_peaks[r] + group_states_min)
        << "rank " << r << ": no optimizer states on the device";
  }
}

std::string RatioName(const ::testing::TestParamInfo<RatioParam>& info) {
  return "Ranks" + std::to_string(std::get<0>(info.param)) + "_Param" +
         TierLabel(std::get<1>(info.param)) + "_Optimizer" + TierLabel(std::get<2>(info.param)) +
         "_Ratio" + std::to_string(static_cast<int>(std::get<3>(info.param) * 100));
}

INSTANTIATE_TEST_SUITE_P(AllPlacements, RatioTest,
                         ::testing::Combine(::testing::Values(1, 2),
                                            ::testing::Values(Tier::kDevice, Tier::kCpu),
                                            ::testing::Values(Tier::kCpu, Tier::kNvme),
                                            ::testing::Values(0.0, 0.5)),
                         RatioName);

// ---- The all-in-memory run is the right training --------------------------------------------

class ReferenceTest : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(ReferenceTest, MatchesSimulationAndLearns) {
  RunOptions o;
  std::tie(o.ranks, o.delayed) = GetParam();
  const RunResult& ref = Reference(o.ranks, o.delayed);
  ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
  ExpectHealthyRun(o, ref);

  // What the engine knows of the parameters.
  const MlpShape& shape = Shape();
  ASSERT_EQ(ref.infos.size(), static_cast<size_t>(shape.num_params()));
  size_t max_sub_group = 0;
  for (int p = 0; p < shape.num_params(); ++p) {
    const ParamInfo& info = ref.infos[p];
    SCOPED_TRACE(ParamName(p));
    EXPECT_EQ(info.name, ParamName(p));
    EXPECT_EQ(info.shape, shape.param_shape(p));
    EXPECT_EQ(info.numel, shape.numel(p));
    EXPECT_GE(info.partition_numel, (shape.numel(p) + o.ranks - 1) / o.ranks);
    EXPECT_EQ(info.persistent, shape.numel(p) <= kPersistenceThreshold);
    max_sub_group = std::max(max_sub_group, info.sub_group);
  }
  EXPECT_GE(max_sub_group, 1u) << "sub_group_size " << kSubGroupSize << " over "
                               << shape.total_numel() << " elements gives one sub-group";

  SimResult sim = Simulate(o);
  // The first forward runs on the registered initial values: bit-identical loss.
  ASSERT_EQ(ref.losses.size(), sim.losses.size());
  EXPECT_EQ(ref.losses[0], sim.losses[0]);
  Diff d = Compare(ref.params, sim.params);
  std::printf("  vs simulation: max |diff| %.3g, rms %.3g\n", d.max_abs, d.rms);
  EXPECT_LE(d.max_abs, kSimMaxAbs) << "largest difference at " << d.where;
  EXPECT_LE(d.rms, kSimRms);
  // The training moved the parameters by much more than the tolerance.
  std::vector<std::vector<float>> init(shape.num_params());
  for (int p = 0; p < shape.num_params(); ++p) {
    init[p].resize(shape.numel(p));
    testing::InitParam(shape, p, init[p].data(), shape.numel(p));
  }
  EXPECT_GT(Compare(ref.params, init).rms, 100 * kSimRms);
  if (o.delayed) {
    // Every step trains on the same rows: steps 1 and 2 both run on the initial parameters
    // (bit-identical losses), step 3 on the first update.
    ASSERT_GE(ref.losses.size(), 3u);
    EXPECT_EQ(std::memcmp(&ref.losses[0], &ref.losses[1], sizeof(double)), 0)
        << ref.losses[0] << " vs " << ref.losses[1];
    EXPECT_LT(ref.losses[2], ref.losses[1]);
    // A different training from the undelayed one, by far more than the tolerance.
    const RunResult& undelayed = Reference(o.ranks, false);
    ASSERT_TRUE(undelayed.status.ok()) << undelayed.status.ToString();
    EXPECT_GT(Compare(ref.params, undelayed.params).rms, 100 * kSimRms);
    EXPECT_NE(ref.losses[1], undelayed.losses[1]);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ReferenceTest,
                         ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool>>& info) {
                           return "Ranks" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_Delayed" : "");
                         });

// ---- Gradient accumulation ------------------------------------------------------------------

// Two half micro-batches per optimizer step against one step over the whole batch. Not
// bit-exact: each gradient element is summed as (rows 0-7) + (rows 8-15) instead of one
// running sum over 16 rows, which differs by a few ulps of the sum of |terms|, ~1e-7 relative.
// Through 4 Adam steps that bounds the parameter difference as for kSimMaxAbs (at worst
// lr / eps * dg ~ 1e-4 on an element whose gradient is near eps; ~1e-8 typically); a missing
// or doubled micro-step would change the gradient by 2x and the parameters by ~lr. (Measured
// on this problem: max 1.6e-5, rms 7.8e-8.)
TEST(EngineTest, GradientAccumulationMatchesOneStepOverTheWholeBatch) {
  RunOptions o;
  o.ranks = 2;
  o.param_tier = Tier::kNvme;
  o.optimizer_tier = Tier::kCpu;
  o.grad_accum = 2;
  RunResult acc = RunTraining(o);
  ASSERT_TRUE(acc.status.ok()) << o.Describe() << ": " << acc.status.ToString();
  ExpectHealthyRun(o, acc);  // optimizer_ran false, true, false, true, ...
  for (int rank = 0; rank < o.ranks; ++rank) {
    ASSERT_EQ(acc.stats[rank].size(), 8u);
    EXPECT_FALSE(acc.stats[rank][0].optimizer_ran);
    EXPECT_TRUE(acc.stats[rank][1].optimizer_ran);
  }

  const RunResult& whole = Reference(o.ranks);
  ASSERT_TRUE(whole.status.ok()) << whole.status.ToString();
  Diff d = Compare(acc.params, whole.params);
  std::printf("  accumulated vs whole batch: max |diff| %.3g, rms %.3g\n", d.max_abs, d.rms);
  EXPECT_LE(d.max_abs, 1e-4) << "largest difference at " << d.where;
  EXPECT_LE(d.rms, 1e-6);
  std::vector<double> acc_losses = StepLosses(acc.losses, 2);
  std::vector<double> whole_losses = StepLosses(whole.losses, 1);
  ASSERT_EQ(acc_losses.size(), whole_losses.size());
  for (size_t k = 0; k < acc_losses.size(); ++k) {
    EXPECT_NEAR(acc_losses[k], whole_losses[k], 1e-5 * whole_losses[k]) << "step " << k;
  }

  // And against the simulation that accumulates in the same order: as tight as the reference.
  SimResult sim = Simulate(o);
  Diff ds = Compare(acc.params, sim.params);
  std::printf("  accumulated vs simulation: max |diff| %.3g, rms %.3g\n", ds.max_abs, ds.rms);
  EXPECT_LE(ds.max_abs, kSimMaxAbs) << "largest difference at " << ds.where;
  EXPECT_LE(ds.rms, kSimRms);
}

// ---- Gradient clipping ----------------------------------------------------------------------

TEST(EngineTest, ClippingIsActiveAndBitIdenticalAcrossPlacements) {
  const int ranks = 2;
  const std::vector<std::pair<Tier, Tier>> placements = {
      {Tier::kDevice, Tier::kDevice}, {Tier::kCpu, Tier::kNvme}, {Tier::kNvme, Tier::kCpu}};
  RunOptions base;
  base.ranks = ranks;
  base.clipping = kClip;
  SimResult sim = Simulate(base);
  for (double norm : sim.grad_norms) {
    std::printf("  simulated gradient norm %.6f\n", norm);
    ASSERT_GT(norm, 1.5 * kClip) << "clipping would be inactive";
  }

  std::vector<RunResult> runs;
  for (const auto& [param_tier, optimizer_tier] : placements) {
    RunOptions o = base;
    o.param_tier = param_tier;
    o.optimizer_tier = optimizer_tier;
    SCOPED_TRACE(o.Describe());
    runs.push_back(RunTraining(o));
    const RunResult& run = runs.back();
    ASSERT_TRUE(run.status.ok()) << run.status.ToString();
    ExpectHealthyRun(o, run);
    for (int rank = 0; rank < ranks; ++rank) {
      for (int k = 0; k < o.steps; ++k) {
        const StepStats& st = run.stats[rank][k];
        EXPECT_GT(st.grad_norm, kClip) << "rank " << rank << " step " << k;
        // Same gradients as the simulation up to the optimizer's rounding (see kSimMaxAbs).
        EXPECT_NEAR(st.grad_norm, sim.grad_norms[k], 1e-4 * sim.grad_norms[k])
            << "rank " << rank << " step " << k;
      }
    }
    EXPECT_EQ(FirstBitDifference(run.params, runs.front().params), "")
        << "vs the clipped all-in-memory run";
  }
  Diff ds = Compare(runs.front().params, sim.params);
  std::printf("  clipped vs simulation: max |diff| %.3g, rms %.3g\n", ds.max_abs, ds.rms);
  EXPECT_LE(ds.max_abs, kSimMaxAbs) << "vs the clipped simulation, largest at " << ds.where;
  EXPECT_LE(ds.rms, kSimRms);

  // Clipping changed the training by far more than the tolerance: it was applied.
  const RunResult& unclipped = Reference(ranks);
  ASSERT_TRUE(unclipped.status.ok()) << unclipped.status.ToString();
  Diff du = Compare(runs.front().params, unclipped.params);
  std::printf("  clipped vs unclipped: max |diff| %.3g, rms %.3g\n", du.max_abs, du.rms);
  EXPECT_GT(du.rms, 100 * kSimRms) << "clipping had no effect";
}

// ---- Budgets --------------------------------------------------------------------------------

TEST(EngineTest, DeviceAndPinnedBudgetsAreNeverExceeded) {
  // About four layers of full parameters plus slack (209.5 KiB): room for the acquired layer,
  // its gradient scratch and some prefetch, not for every layer with its gradient.
  const uint64_t budget = 4 * Shape().largest_layer_bytes() + (64 << 10);
  for (auto [ranks, param_tier] :
       {std::pair{1, Tier::kCpu}, std::pair{2, Tier::kCpu}, std::pair{2, Tier::kNvme}}) {
    RunOptions o;
    o.ranks = ranks;
    o.param_tier = param_tier;
    o.optimizer_tier = Tier::kCpu;
    o.device_budget_bytes = budget;
    SCOPED_TRACE(o.Describe());
    RunResult run = RunTraining(o);
    ASSERT_TRUE(run.status.ok()) << run.status.ToString();
    ExpectHealthyRun(o, run);  // peak_device_bytes <= budget, peak_pinned_bytes <= pinned
    for (int rank = 0; rank < o.ranks; ++rank) {
      for (const StepStats& st : run.stats[rank]) {
        EXPECT_GT(st.peak_device_bytes, 0u) << "no device use reported";
        EXPECT_LE(st.peak_device_bytes, budget);
        EXPECT_LE(st.peak_pinned_bytes, kPinnedBudget);
      }
      // The device's own count of what the engine allocated agrees.
      EXPECT_LE(run.device_peaks[rank], budget) << "rank " << rank;
    }
    // A budget changes when data moves, never the arithmetic.
    const RunResult& ref = Reference(o.ranks);
    ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
    EXPECT_EQ(FirstBitDifference(run.params, ref.params), "");
  }
}

TEST(EngineTest, BudgetTooSmallForTheLargestLayerFailsAtRegistration) {
  // Half of the largest layer: no schedule can acquire it.
  RunOptions o;
  o.param_tier = Tier::kCpu;
  o.optimizer_tier = Tier::kCpu;
  o.device_budget_bytes = Shape().largest_layer_bytes() / 2;
  std::unique_ptr<Device> device = NewHostDevice(HostDeviceOptions{});
  auto comms = NewLocalComms({device.get()});
  ASSERT_TRUE(comms.ok()) << comms.status().ToString();
  Status failure;
  std::string where;
  RunGuarded("registration under a small budget", std::chrono::seconds(60), [&] {
    Result<std::unique_ptr<Engine>> engine =
        Engine::Create(MakeConfig(o, ""), device.get(), (*comms)[0].get());
    if (!engine.ok()) {
      failure = engine.status();
      where = "Engine::Create";
      return;
    }
    RankTrainer trainer(engine->get());
    failure = trainer.Register();
    where = "registration";
  });
  ASSERT_FALSE(failure.ok()) << "a " << o.device_budget_bytes
                             << "-byte device budget was accepted for a "
                             << Shape().largest_layer_bytes() << "-byte layer";
  std::printf("  %s: %s\n", where.c_str(), failure.ToString().c_str());
  EXPECT_EQ(where, "registration") << failure.ToString();
  EXPECT_TRUE(failure.code() == StatusCode::kResourceExhausted ||
              failure.code() == StatusCode::kInvalidArgument)
      << failure.ToString();
  EXPECT_NE(failure.message().find("budget"), std::string::npos) << failure.ToString();
}

// Whether the model registers (FinishRegistration succeeds) under the options' budgets.
Status RegisterOnly(const RunOptions& o, const std::string& nvme_dir) {
  std::unique_ptr<Device> device = NewHostDevice(HostDeviceOptions{});
  auto comms = NewLocalComms({device.get()});
  if (!comms.ok()) return comms.status();
  Result<std::unique_ptr<Engine>> engine =
      Engine::Create(MakeConfig(o, nvme_dir), device.get(), (*comms)[0].get());
  if (!engine.ok()) return engine.status();
  RankTrainer trainer(engine->get());
  ZINF_RETURN_IF_ERROR(trainer.Register());
  return (*engine)->FinishRegistration();
}

// The smallest pinned budget (to 4 KiB) under which the model registers.
uint64_t SmallestPinnedBudget(RunOptions o, const std::string& nvme_dir) {
  uint64_t lo = 4096, hi = kPinnedBudget;  // registers at hi, not at lo
  EXPECT_TRUE(RegisterOnly(o, nvme_dir).ok());
  while (hi - lo > 4096) {
    o.pinned_budget_bytes = (lo + hi) / 2 / 4096 * 4096;
    (RegisterOnly(o, nvme_dir).ok() ? hi : lo) = o.pinned_budget_bytes;
  }
  return hi;
}

TEST(EngineTest, StreamingGradientAccumulatorsNeedTwoSubGroupsNotAllGradients) {
  // Without accumulation and clipping, a sub-group holds pinned gradient memory only from its
  // first gradient until it is stepped. Small sub-groups make the difference visible: the
  // model's 180 KB of gradients in ~10 sub-groups of at most 37 KB.
  TempDir nvme_dir;
  ASSERT_TRUE(nvme_dir.ok());
  RunOptions o;
  o.param_tier = Tier::kCpu;
  o.optimizer_tier = Tier::kNvme;
  o.sub_group_size = 5000;
  RunOptions clipped = o;
  clipped.clipping = 1e30;  // never clips, but the norm needs every gradient at once
  const uint64_t streaming = SmallestPinnedBudget(o, nvme_dir.path());
  const uint64_t resident = SmallestPinnedBudget(clipped, nvme_dir.path());
  size_t grad_bytes = 0;
  for (int p = 0; p < Shape().num_params(); ++p) grad_bytes += Shape().numel(p) * sizeof(float);
  std::printf("  smallest pinned budget: streaming %llu, resident %llu; gradients %zu bytes\n",
              static_cast<unsigned long long>(streaming), static_cast<unsigned long long>(resident),
              grad_bytes);
  // Resident accumulators need all gradients; streaming ones at most two 9,216-element
  // sub-groups (plus 4 KiB rounding each), so at least grad_bytes - 2 * 40 KiB less.
  EXPECT_GE(resident, streaming + grad_bytes - 2 * (40 << 10));

  // At the smallest budget the backward must wait for the optimizer to free accumulators;
  // the training is still bit-identical to the all-in-memory run.
  o.pinned_budget_bytes = streaming;
  RunResult run = RunTraining(o);
  ASSERT_TRUE(run.status.ok()) << run.status.ToString();
  ExpectHealthyRun(o, run);  // peak pinned <= the budget
  const RunResult& ref = Reference(1);
  ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
  EXPECT_EQ(FirstBitDifference(run.params, ref.params), "");

  // The same budget with clipping fails at registration, naming the key to raise.
  clipped.pinned_budget_bytes = streaming;
  Status s = RegisterOnly(clipped, nvme_dir.path());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_NE(s.message().find("zinf.pinned_budget_bytes"), std::string::npos) << s.ToString();
}

// ---- Checkpoints ----------------------------------------------------------------------------

TEST(EngineCheckpoint, TwoRanksResumeBitIdenticalWithAccumulationAndNvme) {
  TempDir ckpt;
  ASSERT_TRUE(ckpt.ok());
  RunOptions o;
  o.ranks = 2;
  o.param_tier = Tier::kNvme;
  o.optimizer_tier = Tier::kNvme;
  o.grad_accum = 2;
  RunResult straight = RunTraining(o);
  ASSERT_TRUE(straight.status.ok()) << straight.status.ToString();

  // Save after step 2 of 4 (each rank writes its own files; rank 0 commits).
  RunOptions first = o;
  first.checkpoint_dir = ckpt.path();
  first.save_after_step = 2;
  RunResult a = RunTraining(first);
  ASSERT_TRUE(a.status.ok()) << a.status.ToString();
  for (const Status& s : a.mid_window_saves) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
    EXPECT_NE(s.message().find("between optimizer steps"), std::string::npos) << s.ToString();
  }
  std::ifstream latest(ckpt.path() + "/latest");
  std::string name;
  latest >> name;
  EXPECT_EQ(name, "step-000000002");
  for (const char* f : {"rank0.json", "rank0.states", "rank1.json", "rank1.states"}) {
    EXPECT_TRUE(std::filesystem::exists(ckpt.path() + "/" + name + "/" + f)) << f;
  }

  // Fresh engines load it and train steps 3 and 4: the same bits as the straight run.
  RunOptions second = o;
  second.checkpoint_dir = ckpt.path();
  second.load_first = true;
  second.first_micro = 2 * o.grad_accum;
  RunResult b = RunTraining(second);
  ASSERT_TRUE(b.status.ok()) << b.status.ToString();
  EXPECT_TRUE(b.ranks_agree);
  EXPECT_EQ(FirstBitDifference(b.params, straight.params), "");
  ASSERT_EQ(b.losses.size(), 2u * o.grad_accum);
  for (size_t m = 0; m < b.losses.size(); ++m) {
    const double want = straight.losses[second.first_micro + m];
    EXPECT_EQ(std::memcmp(&b.losses[m], &want, sizeof(double)), 0) << "micro-step " << m;
  }
  // Loading into a different layout (one rank) is refused, naming the difference.
  RunOptions wrong = second;
  wrong.ranks = 1;
  RunResult c = RunTraining(wrong);
  ASSERT_FALSE(c.status.ok());
  EXPECT_NE(c.status.message().find("does not match this model"), std::string::npos)
      << c.status.ToString();
}

// The delayed update across a checkpoint: saving finishes the pending update (the next two
// steps run on the saved parameters, see Simulate), and engines that load the checkpoint go on
// bit for bit like the run that saved it.
TEST(EngineCheckpoint, DelayedUpdateResumesBitIdentical) {
  for (int ranks : {1, 2}) {
    SCOPED_TRACE(std::to_string(ranks) + " rank(s)");
    TempDir ckpt;
    ASSERT_TRUE(ckpt.ok());
    RunOptions o;
    o.ranks = ranks;
    o.delayed = true;
    o.param_tier = Tier::kNvme;
    o.optimizer_tier = Tier::kCpu;
    o.checkpoint_dir = ckpt.path();
    o.save_after_step = 2;
    RunResult saving = RunTraining(o);
    ASSERT_TRUE(saving.status.ok()) << saving.status.ToString();
    ExpectHealthyRun(o, saving);
    SimResult sim = Simulate(o);
    Diff d = Compare(saving.params, sim.params);
    EXPECT_LE(d.max_abs, kSimMaxAbs) << "vs the simulation, largest at " << d.where;
    EXPECT_LE(d.rms, kSimRms);
    // Steps 3 and 4 train on the same rows and the same (saved) parameters.
    ASSERT_EQ(saving.losses.size(), 4u);
    EXPECT_EQ(std::memcmp(&saving.losses[2], &saving.losses[3], sizeof(double)), 0);

    RunOptions resumed = o;
    resumed.save_after_step = -1;
    resumed.load_first = true;
    resumed.first_micro = 2;
    RunResult b = RunTraining(resumed);
    ASSERT_TRUE(b.status.ok()) << b.status.ToString();
    EXPECT_EQ(FirstBitDifference(b.params, saving.params), "");
    ASSERT_EQ(b.losses.size(), 2u);
    for (size_t m = 0; m < b.losses.size(); ++m) {
      EXPECT_EQ(std::memcmp(&b.losses[m], &saving.losses[2 + m], sizeof(double)), 0)
          << "micro-step " << m;
    }
  }
}

// Runs `base` with each (parameter tier, optimizer tier): every run healthy and
// bit-identical to the first.
void RunPlacements(const RunOptions& base, const std::vector<std::pair<Tier, Tier>>& placements,
                   std::vector<RunResult>* runs) {
  for (const auto& [param_tier, optimizer_tier] : placements) {
    RunOptions o = base;
    o.param_tier = param_tier;
    o.optimizer_tier = optimizer_tier;
    SCOPED_TRACE(o.Describe());
    runs->push_back(RunTraining(o));
    ASSERT_TRUE(runs->back().status.ok()) << runs->back().status.ToString();
    ExpectHealthyRun(o, runs->back());
    EXPECT_EQ(FirstBitDifference(runs->back().params, runs->front().params), "");
  }
}

// The delayed update with gradient accumulation and clipping (the optimizer waits for the
// global norm): bit-identical across placements, and the delayed simulation's training.
TEST(EngineTest, DelayedUpdateWithAccumulationAndClipping) {
  const std::vector<std::pair<Tier, Tier>> placements = {
      {Tier::kDevice, Tier::kDevice}, {Tier::kNvme, Tier::kNvme}, {Tier::kCpu, Tier::kNvme}};
  RunOptions base;
  base.ranks = 2;
  base.grad_accum = 2;
  base.clipping = kClip;
  base.delayed = true;
  std::vector<RunResult> runs;
  ASSERT_NO_FATAL_FAILURE(RunPlacements(base, placements, &runs));
  SimResult sim = Simulate(base);
  Diff d = Compare(runs.front().params, sim.params);
  std::printf("  delayed, clipped, accumulated vs simulation: max |diff| %.3g, rms %.3g\n",
              d.max_abs, d.rms);
  EXPECT_LE(d.max_abs, kSimMaxAbs) << "largest at " << d.where;
  EXPECT_LE(d.rms, kSimRms);
  for (int k = 0; k < base.steps; ++k) {
    EXPECT_NEAR(runs.front().stats[0][2 * k + 1].grad_norm, sim.grad_norms[k],
                1e-4 * sim.grad_norms[k])
        << "step " << k;
  }
}

// zinf.delayed_update_after: the first steps run undelayed (on the same double-buffered
// stores), then the delay starts. Matches the simulation of that schedule, bit-identical
// across placements, and differs from both the undelayed and the always-delayed training.
TEST(EngineTest, DelayedUpdateStartsAfterTheGivenStep) {
  RunOptions base;
  base.ranks = 2;
  base.steps = 5;
  base.delayed = true;
  base.delayed_after = 2;
  std::vector<RunResult> runs;
  ASSERT_NO_FATAL_FAILURE(
      RunPlacements(base, {{Tier::kDevice, Tier::kDevice}, {Tier::kNvme, Tier::kNvme}}, &runs));
  Diff d = Compare(runs.front().params, Simulate(base).params);
  EXPECT_LE(d.max_abs, kSimMaxAbs) << "largest at " << d.where;
  EXPECT_LE(d.rms, kSimRms);
  // Steps 1-3 run on W0, W1, W2 (undelayed), steps 4 and 5 on W2 and W3: the losses of the
  // first three steps are the undelayed run's, bit for bit, and steps 3 and 4 (same rows, same
  // parameters) have equal losses.
  RunOptions undelayed = base;
  undelayed.delayed = false;
  RunResult u = RunTraining(undelayed);
  ASSERT_TRUE(u.status.ok()) << u.status.ToString();
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(std::memcmp(&runs.front().losses[k], &u.losses[k], sizeof(double)), 0) << k;
  }
  EXPECT_EQ(std::memcmp(&runs.front().losses[2], &runs.front().losses[3], sizeof(double)), 0);
  EXPECT_GT(Compare(runs.front().params, u.params).rms, 100 * kSimRms);
  RunOptions always = base;
  always.delayed_after = 0;
  EXPECT_GT(Compare(runs.front().params, Simulate(always).params).rms, 100 * kSimRms);
}

// With the delayed update, a parameter acquired again after its gradient was reduced (in a
// micro-step that ends a window) is refused: the optimizer may be rewriting its store.
TEST(EngineTest, DelayedUpdateRefusesAcquireAfterReduceGradient) {
  std::unique_ptr<Device> device = NewHostDevice(HostDeviceOptions{});
  auto comms = NewLocalComms({device.get()});
  ASSERT_TRUE(comms.ok()) << comms.status().ToString();
  RunOptions o;
  o.delayed = true;
  o.param_tier = Tier::kCpu;
  o.optimizer_tier = Tier::kCpu;
  Result<std::unique_ptr<Engine>> engine =
      Engine::Create(MakeConfig(o, ""), device.get(), (*comms)[0].get());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  Engine& e = **engine;
  ParamSpec spec;
  spec.name = "w";
  spec.shape = {64};
  spec.init = [](float* d, size_t n) { std::fill(d, d + n, 0.5f); };
  Result<ParamId> w = e.RegisterParameter(spec);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  std::vector<float> grad(64, 1.0f);
  for (int step = 0; step < 2; ++step) {
    ASSERT_TRUE(e.Acquire({*w}).ok());
    ASSERT_TRUE(e.Release({*w}).ok());
    ASSERT_TRUE(e.ReduceGradient(*w, grad.data()).ok());
    Result<std::vector<void*>> again = e.Acquire({*w});
    ASSERT_FALSE(again.ok()) << "step " << step;
    EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(again.status().message().find("after its ReduceGradient"), std::string::npos)
        << again.status().ToString();
    ASSERT_TRUE(e.Step().ok());
  }
  // The update of step 1 is visible from step 3 on; step 2's runs on.
  std::vector<float> master(64);
  ASSERT_TRUE(e.GatherMasterParameter(*w, master.data()).ok());
  EXPECT_LT(master[0], 0.5f);
}

// ---- A step that deviates from the recorded trace -------------------------------------------

// Captures log lines for the duration of a test.
class LogCapture {
 public:
  LogCapture() {
    previous_ = SetLogSink([this](LogLevel level, const std::string& line) {
      std::lock_guard<std::mutex> lock(mu_);
      lines_.emplace_back(level, line);
    });
  }
  ~LogCapture() { SetLogSink(previous_); }
  // Warnings whose text contains `word` (case-insensitive).
  std::vector<std::string> Warnings(const std::string& word) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> out;
    for (const auto& [level, line] : lines_) {
      std::string lower = line;
      std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
      if (level == LogLevel::kWarning && lower.find(word) != std::string::npos) {
        out.push_back(line);
      }
    }
    return out;
  }
  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    lines_.clear();
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<LogLevel, std::string>> lines_;
  LogSink previous_;
};

TEST(EngineTest, TraceMismatchMidRunCompletesWithAWarning) {
  for (int ranks : {1, 2}) {
    RunOptions o;
    o.ranks = ranks;
    o.param_tier = Tier::kNvme;  // prefetch from NVMe follows the trace
    o.optimizer_tier = Tier::kCpu;
    // Past LocalComm's own 60 s collective timeout, so that its diagnosis (which rank
    // stopped issuing collectives) wins the race when the ranks fall out of step.
    o.timeout = std::chrono::seconds(90);
    SCOPED_TRACE(o.Describe());
    LogCapture log;
    RunResult normal = RunTraining(o);
    ASSERT_TRUE(normal.status.ok()) << normal.status.ToString();
    EXPECT_TRUE(log.Warnings("trace").empty())
        << "a run that follows its trace warned: " << log.Warnings("trace").front();
    log.Clear();

    // Micro-steps 0 and 1 record and follow the trace; 2 swaps the first two acquires; 3 is
    // normal again.
    o.swapped_micro_step = 2;
    RunResult swapped = RunTraining(o);
    ASSERT_TRUE(swapped.status.ok()) << swapped.status.ToString();
    ExpectHealthyRun(o, swapped);
    std::vector<std::string> warnings = log.Warnings("trace");
    EXPECT_GE(warnings.size(), 1u) << "no warning about the trace mismatch";
    for (const std::string& w : warnings) std::printf("  warning: %s\n", w.c_str());
    // The acquire order changes nothing in the arithmetic.
    EXPECT_EQ(FirstBitDifference(swapped.params, normal.params), "");
  }
}

// ---- An injected I/O error ------------------------------------------------------------------

struct FaultOutcome {
  Status setup;                             // creation, registration and two clean micro-steps
  std::vector<uint64_t> requests_per_step;  // I/O requests of the clean micro-steps
  uint64_t fault_at = 0;
  uint64_t requests_after = 0;           // requests seen when the faulty steps ended
  Status fault_error;                    // the first failing call's status once the fault is armed
  bool failed_before_gradients = false;  // fault_error came before any ReduceGradient
  int clean_micro_steps = 0;             // micro-steps that succeeded, before and after the failure
  Status recovery;                       // the first failure after the plan is cleared (OK: none)
  int recovered_steps = 0;
  Status gather;
  std::vector<std::vector<float>> params;
};

// One rank, parameters and optimizer states on NVMe: two clean micro-steps, then an EIO on
// the request `ahead` requests from now, then up to 3 micro-steps until a call fails, then
// (the plan cleared) up to 2 more micro-steps, and the masters when those succeeded.
FaultOutcome RunWithInjectedFault(uint64_t ahead, IoFault fault = IoFault{}, bool checksums = false,
                                  bool delayed = false) {
  FaultOutcome out;
  RunOptions o;
  o.delayed = delayed;
  o.param_tier = Tier::kNvme;
  o.optimizer_tier = Tier::kNvme;
  TempDir dir;
  if (!dir.ok()) {
    out.setup = Status::IoError("mkdtemp under $ZINF_TEST_DIR or /var/tmp failed");
    return out;
  }
  std::unique_ptr<Device> device = NewHostDevice(HostDeviceOptions{});
  auto comms = NewLocalComms({device.get()});
  if (!comms.ok()) {
    out.setup = comms.status();
    return out;
  }
  auto plan = std::make_shared<FaultPlan>();
  EngineHooks hooks;
  hooks.fault_plan = plan;
  EngineConfig config = MakeConfig(o, dir.path());
  config.checksums = checksums;
  Result<std::unique_ptr<Engine>> engine =
      Engine::Create(config, device.get(), (*comms)[0].get(), hooks);
  if (!engine.ok()) {
    out.setup = engine.status();
    return out;
  }
  RankTrainer trainer(engine->get());
  out.setup = trainer.Register();
  double loss;
  StepStats stats;
  for (int m = 0; m < 2 && out.setup.ok(); ++m) {
    uint64_t before = plan->requests();
    out.setup = trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats);
    out.requests_per_step.push_back(plan->requests() - before);
  }
  if (!out.setup.ok()) return out;
  // The error may surface in the call that needs the request or, for a prefetch or a
  // write-back, in a later one.
  out.fault_at = plan->requests() + ahead;
  fault.first = out.fault_at;
  plan->Add(fault);
  out.clean_micro_steps = 2;
  for (int attempt = 0; attempt < 3 && out.fault_error.ok(); ++attempt) {
    out.fault_error = trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats);
    if (out.fault_error.ok()) ++out.clean_micro_steps;
  }
  out.failed_before_gradients = !out.fault_error.ok() && trainer.gradients_reduced() == 0 &&
                                out.fault_error.message().rfind("Step", 0) != 0;
  out.requests_after = plan->requests();
  plan->Clear();
  if (out.fault_error.ok()) {  // absorbed: the masters after the faulty steps
    out.gather = trainer.GatherAll(&out.params);
    return out;
  }
  for (int m = 0; m < 2 && out.recovery.ok(); ++m) {
    out.recovery = trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats);
    if (out.recovery.ok()) {
      ++out.recovered_steps;
      ++out.clean_micro_steps;
    }
  }
  if (out.recovered_steps > 0) out.gather = trainer.GatherAll(&out.params);
  return out;
}

// An EIO on each of a spread of request positions (parameter reads in the forward and the
// backward, optimizer state reads and write-backs, parameter write-backs): the step fails
// with an IoError that names the file or the tensor; with the fault gone the engine either
// trains on, with finite masters, or refuses further steps with kFailedPrecondition and a
// reason. It never repeats a stale error for data that could now be read.
void InjectedIoErrorFailsTheStepAndTheEngineStaysConsistent(bool delayed) {
  // Requests per clean micro-step, to spread the fault over a whole step.
  FaultOutcome probe;
  RunGuarded("training with an injected I/O error", std::chrono::seconds(60),
             [&] { probe = RunWithInjectedFault(1'000'000, IoFault{}, false, delayed); });
  ASSERT_TRUE(probe.setup.ok()) << probe.setup.ToString();
  ASSERT_TRUE(probe.fault_error.ok()) << "no fault should fire: " << probe.fault_error.ToString();
  const uint64_t per_step = probe.requests_per_step.back();
  ASSERT_GT(per_step, 0u) << "a micro-step with everything on NVMe did no I/O";
  std::printf("  %llu I/O requests per micro-step\n", static_cast<unsigned long long>(per_step));

  const uint64_t stride = std::max<uint64_t>(1, per_step / 12);
  for (uint64_t ahead = 0; ahead < per_step; ahead += stride) {
    SCOPED_TRACE("EIO on request +" + std::to_string(ahead));
    FaultOutcome f;
    RunGuarded("training with an injected I/O error at +" + std::to_string(ahead),
               std::chrono::seconds(60),
               [&] { f = RunWithInjectedFault(ahead, IoFault{}, false, delayed); });
    ASSERT_TRUE(f.setup.ok()) << f.setup.ToString();
    ASSERT_GT(f.requests_after, f.fault_at) << "the fault never fired in 3 micro-steps";
    ASSERT_FALSE(f.fault_error.ok())
        << "an EIO on request " << f.fault_at << " was not reported by any engine call";
    std::printf("  +%llu: %s\n", static_cast<unsigned long long>(ahead),
                f.fault_error.ToString().c_str());
    EXPECT_EQ(f.fault_error.code(), StatusCode::kIoError) << f.fault_error.ToString();
    EXPECT_TRUE(f.fault_error.message().find("zinf-swap") != std::string::npos ||
                f.fault_error.message().find('\'') != std::string::npos)
        << "the message names neither the swap file nor a tensor: " << f.fault_error.ToString();
    if (!f.recovery.ok()) {
      std::printf("      then: %s\n", f.recovery.ToString().c_str());
      EXPECT_EQ(f.recovery.code(), StatusCode::kFailedPrecondition)
          << "with the fault cleared, the engine must train on or refuse with a reason, not "
             "fail with: "
          << f.recovery.ToString();
      EXPECT_GT(f.recovery.message().size(), 20u) << f.recovery.ToString();
    } else {
      std::printf("      then: %d clean micro-steps\n", f.recovered_steps);
      ASSERT_TRUE(f.gather.ok()) << f.gather.ToString();
      EXPECT_TRUE(AllFinite(f.params)) << "the store holds non-finite values after recovery";
      // A micro-step abandoned before any gradient reached the engine leaves no trace: the
      // masters are those of a clean run with as many (whole-batch) steps as succeeded.
      if (f.failed_before_gradients) {
        RunOptions clean;
        clean.steps = f.clean_micro_steps;
        clean.delayed = delayed;
        RunResult ref = RunTraining(clean);
        ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
        EXPECT_EQ(FirstBitDifference(f.params, ref.params), "")
            << "after recovering from a failed parameter read, vs " << clean.steps
            << " clean steps";
      }
    }
  }
}

TEST(EngineTest, InjectedIoErrorFailsTheStepAndTheEngineStaysConsistent) {
  InjectedIoErrorFailsTheStepAndTheEngineStaysConsistent(false);
}

// Durable mode: a step that dies part-way (an EIO at a spread of request positions: parameter
// reads, state reads, write-backs) leaves the store at its last commit; a fresh engine resumes
// from the store alone and ends bit-identical to a run that never failed.
TEST(EngineDurable, ResumeFromTheStoreAfterAFailedStepIsBitIdentical) {
  for (auto [param_tier, delayed] : {std::pair{Tier::kNvme, false}, std::pair{Tier::kCpu, false},
                                     std::pair{Tier::kNvme, true}}) {
    RunOptions o;
    o.durable = true;
    o.param_tier = param_tier;
    o.optimizer_tier = Tier::kNvme;
    o.delayed = delayed;
    SCOPED_TRACE(o.Describe());
    const RunResult straight = RunTraining(o);
    ASSERT_TRUE(straight.status.ok()) << straight.status.ToString();
    ExpectHealthyRun(o, straight);
    EXPECT_EQ(FirstBitDifference(straight.params, Reference(1, delayed).params), "")
        << "durable mode changed the training";
    for (int fifth = 0; fifth < 5; ++fifth) {
      TempDir dir;
      ASSERT_TRUE(dir.ok());
      std::unique_ptr<Device> device = NewHostDevice(HostDeviceOptions{});
      auto comms = NewLocalComms({device.get()});
      ASSERT_TRUE(comms.ok());
      double loss;
      StepStats stats;
      Status failed;
      int done = 0;  // micro-steps completed (= optimizer steps)
      {
        auto plan = std::make_shared<FaultPlan>();
        EngineHooks hooks;
        hooks.fault_plan = plan;
        auto engine =
            Engine::Create(MakeConfig(o, dir.path()), device.get(), (*comms)[0].get(), hooks);
        ASSERT_TRUE(engine.ok()) << engine.status().ToString();
        RankTrainer trainer(engine->get());
        ASSERT_TRUE(trainer.Register().ok());
        uint64_t per_step = 0;
        for (; done < 2; ++done) {
          const uint64_t before = plan->requests();
          ASSERT_TRUE(trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats).ok());
          per_step = plan->requests() - before;
        }
        ASSERT_GT(per_step, 0u);
        // Spread over the step: at 0, 1/5, ... 4/5 of its requests.
        const uint64_t ahead = per_step * fifth / 5;
        SCOPED_TRACE("EIO on request +" + std::to_string(ahead) + " of " +
                     std::to_string(per_step));
        IoFault fault;
        fault.first = plan->requests() + ahead;
        plan->Add(fault);
        for (int attempt = 0; attempt < 2 && failed.ok(); ++attempt) {
          failed = trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats);
          if (failed.ok()) ++done;
        }
        if (failed.ok()) {
          // Rarely (thread timing) the failed request is a read-ahead of a copy that is
          // dropped before use and fetched again: nothing failed, nothing to resume from.
          ASSERT_GT(plan->requests(), fault.first) << "the faulted request was never issued";
          std::printf("  EIO at +%llu absorbed (a read-ahead dropped before use)\n",
                      static_cast<unsigned long long>(ahead));
          continue;
        }
        // The engine (and its store) go away here, as in a crash: nothing more is committed.
      }
      auto engine = Engine::Create(MakeConfig(o, dir.path()), device.get(), (*comms)[0].get());
      ASSERT_TRUE(engine.ok()) << engine.status().ToString();
      RankTrainer trainer(engine->get());
      ASSERT_TRUE(trainer.Register(/*finish=*/false).ok());
      Status resumed = (*engine)->ResumeFromStore();
      ASSERT_TRUE(resumed.ok()) << resumed.ToString();
      // The failed step never committed: the store is at the last completed one. With the
      // delayed update, the failure of step s's update surfaces in micro-step s + 1 (the
      // store is then at s - 1) or in micro-step s + 2 (a fault in step s + 1's update).
      const int at = static_cast<int>((*engine)->global_step());
      if (delayed) {
        EXPECT_TRUE(at == done || at == done - 1)
            << at << " vs " << done << " after: " << failed.ToString();
      } else {
        EXPECT_EQ(at, done) << "after: " << failed.ToString();
      }
      for (int m = at; m < o.steps; ++m) {
        Status st = trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats);
        ASSERT_TRUE(st.ok()) << "micro-step " << m << ": " << st.ToString();
      }
      std::vector<std::vector<float>> params;
      ASSERT_TRUE(trainer.GatherAll(&params).ok());
      EXPECT_EQ(FirstBitDifference(params, straight.params), "");
    }
  }
}

// Resuming a durable store with the parameters on another tier: NVMe -> CPU -> NVMe. The
// second resume must not trust the NVMe parameter stores the first run left behind (they are
// two steps old by then): the three legs end bit-identical to one uninterrupted run.
TEST(EngineDurable, ResumeAcrossParameterTiersRebuildsStaleParameterStores) {
  RunOptions o;
  o.durable = true;
  o.optimizer_tier = Tier::kNvme;
  o.param_tier = Tier::kNvme;
  const RunResult straight = RunTraining(o);  // kSteps = 4
  ASSERT_TRUE(straight.status.ok()) << straight.status.ToString();
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::unique_ptr<Device> device = NewHostDevice(HostDeviceOptions{});
  auto comms = NewLocalComms({device.get()});
  ASSERT_TRUE(comms.ok());
  double loss;
  StepStats stats;
  std::vector<std::vector<float>> params;
  const Tier legs[] = {Tier::kNvme, Tier::kCpu, Tier::kNvme};
  const int steps[] = {2, 1, 1};
  for (int leg = 0; leg < 3; ++leg) {
    SCOPED_TRACE("leg " + std::to_string(leg));
    RunOptions lo = o;
    lo.param_tier = legs[leg];
    auto engine = Engine::Create(MakeConfig(lo, dir.path()), device.get(), (*comms)[0].get());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    RankTrainer trainer(engine->get());
    ASSERT_TRUE(trainer.Register(/*finish=*/leg == 0).ok());
    if (leg > 0) {
      Status s = (*engine)->ResumeFromStore();
      ASSERT_TRUE(s.ok()) << s.ToString();
    }
    for (int m = 0; m < steps[leg]; ++m) {
      ASSERT_TRUE(trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats).ok());
    }
    if (leg == 2) {
      ASSERT_TRUE(trainer.GatherAll(&params).ok());
    }
  }
  EXPECT_EQ(FirstBitDifference(params, straight.params), "");
}

// Durable mode with several ranks: each rank commits its own store, so a crash can leave one
// rank a commit ahead of another. The stores keep the commit before the last; ResumeFromStore
// agrees on the earliest last commit, which every rank holds.
struct DurableLeg {
  int from_micro = 0;  // resume from the stores first when > 0
  int to_micro = 0;    // run micro-steps [from_micro, to_micro)
  int fail_rank = -1;  // this rank's writes fail with EIO from micro-step fail_micro on
  int fail_micro = -1;
  // With a failing rank, the other one's queued collectives (its next prefetch) wait this
  // long for it before the group fails, when its engine is destroyed.
  std::chrono::milliseconds comm_timeout{60000};
  // Called on every rank before micro-step m (collective calls such as checkpoints go here).
  std::function<Status(Engine* engine, int rank, int m)> before_micro;
  std::vector<Status> status;              // per rank: the first failure
  std::vector<int64_t> resumed_step;       // per rank: global_step() after the resume
  std::vector<std::vector<float>> params;  // rank 0's gathered masters (no failing rank)
};

void RunDurableLeg(const RunOptions& o, const std::string& dir, DurableLeg* leg) {
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<Device*> raw;
  for (int r = 0; r < o.ranks; ++r) {
    HostDeviceOptions dopt;
    dopt.memory_budget = kHostDeviceMemory;
    devices.push_back(NewHostDevice(dopt));
    raw.push_back(devices.back().get());
  }
  LocalCommOptions copt;
  copt.timeout = leg->comm_timeout;
  auto comms = NewLocalComms(raw, copt);
  ASSERT_TRUE(comms.ok()) << comms.status().ToString();
  leg->status.assign(o.ranks, Status::OK());
  leg->resumed_step.assign(o.ranks, -1);
  RunGuarded("durable leg (" + o.Describe() + ")", o.timeout, [&] {
    std::vector<std::thread> threads;
    for (int r = 0; r < o.ranks; ++r) {
      threads.emplace_back([&, r] {
        auto plan = std::make_shared<FaultPlan>();
        EngineHooks hooks;
        hooks.fault_plan = plan;
        auto run = [&]() -> Status {
          auto engine = Engine::Create(MakeConfig(o, dir), raw[r], (*comms)[r].get(), hooks);
          if (!engine.ok()) return engine.status();
          RankTrainer trainer(engine->get());
          ZINF_RETURN_IF_ERROR(trainer.Register(/*finish=*/leg->from_micro == 0));
          if (leg->from_micro > 0) {
            ZINF_RETURN_IF_ERROR((*engine)->ResumeFromStore());
            leg->resumed_step[r] = (*engine)->global_step();
          }
          for (int m = leg->from_micro; m < leg->to_micro; ++m) {
            if (leg->before_micro) ZINF_RETURN_IF_ERROR(leg->before_micro(engine->get(), r, m));
            if (r == leg->fail_rank && m == leg->fail_micro) {
              IoFault fault;  // every write from here on: the optimizer's write-backs
              fault.first = plan->requests();
              fault.count = 1u << 30;
              fault.any_op = false;
              fault.op = IoOp::kWrite;
              plan->Add(fault);
            }
            double loss;
            StepStats stats;
            ZINF_RETURN_IF_ERROR(
                trainer.MicroStep(RowBegin(o, m, r), RowsPerRank(o), false, &loss, &stats)
                    .WithContext("micro-step " + std::to_string(m)));
          }
          if (leg->fail_rank >= 0) return Status::OK();  // a collective the failed rank skips
          std::vector<std::vector<float>> params;
          ZINF_RETURN_IF_ERROR(trainer.GatherAll(&params));
          if (r == 0) leg->params = std::move(params);
          return Status::OK();
        };
        leg->status[r] = run();
      });
    }
    for (std::thread& t : threads) t.join();
  });
}

TEST(EngineDurable, RanksOneCommitApartResumeAtTheCommitTheyShare) {
  RunOptions o;
  o.ranks = 2;
  o.durable = true;
  o.param_tier = Tier::kCpu;  // the only writes of a step: the optimizer's write-backs
  o.optimizer_tier = Tier::kNvme;
  const RunResult straight = RunTraining(o);
  ASSERT_TRUE(straight.status.ok()) << straight.status.ToString();
  EXPECT_EQ(FirstBitDifference(straight.params, Reference(2).params), "")
      << "durable mode changed the training";
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  {
    // Two steps on both ranks; in the third, rank 1's write-backs fail: rank 0 commits step
    // 3, rank 1 stays at step 2. Then both "crash".
    DurableLeg leg;
    leg.to_micro = 3;
    leg.fail_rank = 1;
    leg.fail_micro = 2;
    leg.comm_timeout = std::chrono::seconds(5);
    RunDurableLeg(o, dir.path(), &leg);
    ASSERT_TRUE(leg.status[0].ok()) << leg.status[0].ToString();
    ASSERT_EQ(leg.status[1].code(), StatusCode::kIoError) << leg.status[1].ToString();
    auto rank0 = SwapStore::ListCommits(dir.path() + "/rank0");
    auto rank1 = SwapStore::ListCommits(dir.path() + "/rank1");
    ASSERT_TRUE(rank0.ok() && rank1.ok());
    ASSERT_EQ(rank0->size(), 2u);
    EXPECT_NE((*rank0)[0].find("\"step\":3"), std::string::npos) << (*rank0)[0];
    EXPECT_NE((*rank1)[0].find("\"step\":2"), std::string::npos) << (*rank1)[0];
  }
  {
    DurableLeg leg;
    leg.from_micro = 2;
    leg.to_micro = o.steps;
    RunDurableLeg(o, dir.path(), &leg);
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(leg.status[r].ok()) << "rank " << r << ": " << leg.status[r].ToString();
      EXPECT_EQ(leg.resumed_step[r], 2) << "rank " << r;
    }
    EXPECT_EQ(FirstBitDifference(leg.params, straight.params), "");
  }
  // Stores from different runs (rank 1's from a run one step long): no commit in common;
  // both ranks refuse, neither waits for the other.
  TempDir other;
  ASSERT_TRUE(other.ok());
  {
    DurableLeg leg;
    leg.to_micro = 1;
    RunDurableLeg(o, other.path(), &leg);
    ASSERT_TRUE(leg.status[0].ok() && leg.status[1].ok());
  }
  std::filesystem::remove_all(dir.path() + "/rank1");
  std::filesystem::rename(other.path() + "/rank1", dir.path() + "/rank1");
  DurableLeg leg;
  leg.from_micro = 1;
  leg.to_micro = 2;
  RunDurableLeg(o, dir.path(), &leg);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(leg.status[r].code(), StatusCode::kFailedPrecondition) << leg.status[r].ToString();
    EXPECT_NE(leg.status[r].message().find("no commit in common"), std::string::npos)
        << leg.status[r].ToString();
  }
}

// A checkpoint load starts a new history. Two ranks at step 3 load a step-2 checkpoint and
// train step 3 again with another learning rate; rank 0 commits it, rank 1 fails first. Both
// stores now hold a "step 3", from different histories: the resume must take the step 3 both
// hold (the one before the load), not mix rank 0's new one with rank 1's old one.
TEST(EngineDurable, RanksResumeOnTheHistoryTheyShareAfterACheckpointLoad) {
  RunOptions o;
  o.ranks = 2;
  o.durable = true;
  o.param_tier = Tier::kCpu;
  o.optimizer_tier = Tier::kNvme;
  const RunResult straight = RunTraining(o);
  ASSERT_TRUE(straight.status.ok()) << straight.status.ToString();
  TempDir dir, ckpt;
  ASSERT_TRUE(dir.ok() && ckpt.ok());
  {
    DurableLeg leg;
    leg.to_micro = 4;
    leg.fail_rank = 1;
    leg.fail_micro = 3;
    leg.comm_timeout = std::chrono::seconds(5);
    leg.before_micro = [&](Engine* e, int, int m) -> Status {
      if (m == 2) return e->SaveCheckpoint(ckpt.path());
      if (m == 3) {
        ZINF_RETURN_IF_ERROR(e->LoadCheckpoint(ckpt.path()));
        return e->SetLearningRate(kLr * 3);
      }
      return Status::OK();
    };
    RunDurableLeg(o, dir.path(), &leg);
    ASSERT_TRUE(leg.status[0].ok()) << leg.status[0].ToString();
    ASSERT_EQ(leg.status[1].code(), StatusCode::kIoError) << leg.status[1].ToString();
    for (const char* r : {"/rank0", "/rank1"}) {
      auto commits = SwapStore::ListCommits(dir.path() + r);
      ASSERT_TRUE(commits.ok());
      EXPECT_NE((*commits)[0].find("\"step\":3"), std::string::npos) << r << (*commits)[0];
    }
  }
  DurableLeg leg;
  leg.from_micro = 3;
  leg.to_micro = o.steps;
  RunDurableLeg(o, dir.path(), &leg);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(leg.status[r].ok()) << "rank " << r << ": " << leg.status[r].ToString();
    EXPECT_EQ(leg.resumed_step[r], 3) << "rank " << r;
  }
  // Both resumed from the step 3 before the load: the run ends as one that never loaded.
  EXPECT_EQ(FirstBitDifference(leg.params, straight.params), "");
}

// Durable + delayed update with several ranks: refused at Create, naming both keys (each
// rank's optimizer thread commits on its own, so ranks could drift two commits apart).
TEST(EngineDurable, DelayedUpdateWithSeveralRanksIsRefused) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::unique_ptr<Device> d0 = NewHostDevice(HostDeviceOptions{});
  std::unique_ptr<Device> d1 = NewHostDevice(HostDeviceOptions{});
  auto comms = NewLocalComms({d0.get(), d1.get()});
  ASSERT_TRUE(comms.ok());
  RunOptions o;
  o.ranks = 2;
  o.durable = true;
  o.delayed = true;
  o.param_tier = Tier::kNvme;
  o.optimizer_tier = Tier::kNvme;
  auto e = Engine::Create(MakeConfig(o, dir.path()), d0.get(), (*comms)[0].get());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kNotSupported);
  EXPECT_NE(e.status().message().find("more than one rank"), std::string::npos)
      << e.status().ToString();
}

// What ResumeFromStore refuses: no commit, another model, durable mode off, a call after
// registration ended; and the configurations durable mode does not support.
TEST(EngineDurable, RefusalsNameTheReason) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  std::unique_ptr<Device> device = NewHostDevice(HostDeviceOptions{});
  auto comms = NewLocalComms({device.get()});
  ASSERT_TRUE(comms.ok());
  RunOptions o;
  o.durable = true;
  o.param_tier = Tier::kCpu;
  o.optimizer_tier = Tier::kNvme;
  auto open = [&](const RunOptions& ro) {
    auto e = Engine::Create(MakeConfig(ro, dir.path()), device.get(), (*comms)[0].get());
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? std::move(*e) : nullptr;
  };
  {  // An empty folder: nothing to resume.
    auto e = open(o);
    ASSERT_NE(e, nullptr);
    RankTrainer t(e.get());
    ASSERT_TRUE(t.Register(false).ok());
    Status s = e->ResumeFromStore();
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("index"), std::string::npos) << s.ToString();
    // The engine refuses to go on after a failed resume.
    double loss;
    StepStats stats;
    EXPECT_EQ(t.MicroStep(0, kGlobalBatch, false, &loss, &stats).code(),
              StatusCode::kFailedPrecondition);
  }
  {  // One committed step, then a model with another sub-group layout.
    auto e = open(o);
    RankTrainer t(e.get());
    ASSERT_TRUE(t.Register().ok());
    double loss;
    StepStats stats;
    ASSERT_TRUE(t.MicroStep(0, kGlobalBatch, false, &loss, &stats).ok());
    EXPECT_EQ(e->ResumeFromStore().code(), StatusCode::kFailedPrecondition);  // too late
  }
  {
    RunOptions other = o;
    other.sub_group_size = kSubGroupSize / 2;
    auto e = open(other);
    RankTrainer t(e.get());
    ASSERT_TRUE(t.Register(false).ok());
    Status s = e->ResumeFromStore();
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
    EXPECT_NE(s.message().find("different model"), std::string::npos) << s.ToString();
  }
  {
    RunOptions plain = o;
    plain.durable = false;
    auto e = open(plain);
    EXPECT_EQ(e->ResumeFromStore().code(), StatusCode::kFailedPrecondition);
  }
  // Unsupported combinations fail at Create, naming the keys.
  struct Bad {
    Tier optimizer;
    bool delayed;
    const char* expect;
  };
  for (const Bad& b :
       {Bad{Tier::kCpu, false, "offload_optimizer"}, Bad{Tier::kNvme, true, "delayed_update"}}) {
    RunOptions ro = o;
    ro.optimizer_tier = b.optimizer;
    ro.delayed = b.delayed;
    auto e = Engine::Create(MakeConfig(ro, dir.path()), device.get(), (*comms)[0].get());
    ASSERT_FALSE(e.ok()) << b.expect;
    EXPECT_NE(e.status().message().find(b.expect), std::string::npos) << e.status().ToString();
  }
}

// The same with the delayed update: a failure of the optimizer step that runs on during the
// next micro-step surfaces in that micro-step's Step() (or the next call that waits for it).
TEST(EngineTest, InjectedIoErrorWithTheDelayedUpdate) {
  InjectedIoErrorFailsTheStepAndTheEngineStaysConsistent(true);
}

// Every kind of fault the FaultyBackend injects, on parameter and optimizer-state traffic (a
// rule covers the next 1,000 requests of its op, so it meets whatever the step moves):
// errors (EIO on reads, EIO and ENOSPC on writes) fail a call with a Status naming the file
// or tensor; a torn write (the device drops data but reports success) is caught by the
// checksums when the tensor is read back; short transfers and slow requests are absorbed, and
// the training is then bit-identical to a clean run.
TEST(EngineTest, EveryFaultKindIsReportedOrAbsorbed) {
  struct Case {
    const char* name;
    IoFault fault;
    bool checksums;
    bool absorbed;
    StatusCode code;
  };
  auto make = [](IoFault::Kind kind, bool any_op, IoOp op, int err, uint64_t count) {
    IoFault f;
    f.kind = kind;
    f.any_op = any_op;
    f.op = op;
    f.errno_value = err;
    f.count = count;
    f.short_bytes = 4096;
    f.delay_us = 3000;
    return f;
  };
  const std::vector<Case> cases = {
      {"EIO on a read", make(IoFault::Kind::kError, false, IoOp::kRead, EIO, 1000), false, false,
       StatusCode::kIoError},
      {"EIO on a write", make(IoFault::Kind::kError, false, IoOp::kWrite, EIO, 1000), false, false,
       StatusCode::kIoError},
      {"ENOSPC on a write", make(IoFault::Kind::kError, false, IoOp::kWrite, ENOSPC, 1000), false,
       false, StatusCode::kResourceExhausted},
      {"torn writes", make(IoFault::Kind::kTorn, false, IoOp::kWrite, 0, 1000), true, false,
       StatusCode::kCorruption},
      {"short transfers", make(IoFault::Kind::kShort, true, IoOp::kRead, 0, 40), false, true,
       StatusCode::kOk},
      {"slow requests", make(IoFault::Kind::kDelay, true, IoOp::kRead, 0, 40), false, true,
       StatusCode::kOk},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    FaultOutcome f;
    RunGuarded(std::string("training with ") + c.name, std::chrono::seconds(60),
               [&] { f = RunWithInjectedFault(3, c.fault, c.checksums); });
    ASSERT_TRUE(f.setup.ok()) << f.setup.ToString();
    std::printf("  %s: %s\n", c.name, f.fault_error.ToString().c_str());
    if (c.absorbed) {
      ASSERT_TRUE(f.fault_error.ok()) << f.fault_error.ToString();
      ASSERT_TRUE(f.gather.ok()) << f.gather.ToString();
      RunOptions clean;
      clean.steps = f.clean_micro_steps;
      RunResult ref = RunTraining(clean);
      ASSERT_TRUE(ref.status.ok()) << ref.status.ToString();
      EXPECT_EQ(FirstBitDifference(f.params, ref.params), "")
          << "after " << c.name << ", vs " << clean.steps << " clean steps";
      continue;
    }
    ASSERT_FALSE(f.fault_error.ok()) << c.name << " was not reported by any engine call";
    EXPECT_EQ(f.fault_error.code(), c.code) << f.fault_error.ToString();
    EXPECT_TRUE(f.fault_error.message().find("zinf-swap") != std::string::npos ||
                f.fault_error.message().find('\'') != std::string::npos)
        << "names neither the swap file nor a tensor: " << f.fault_error.ToString();
    // With the fault gone: trains on with finite masters, or refuses with a reason. The same
    // kind of error may come once more: a prefetch issued while the fault was armed reports
    // at the Acquire that needs it, and after a torn write the data on disk stays damaged.
    if (!f.recovery.ok()) {
      std::printf("      then: %s\n", f.recovery.ToString().c_str());
      EXPECT_TRUE(f.recovery.code() == StatusCode::kFailedPrecondition ||
                  f.recovery.code() == c.code)
          << f.recovery.ToString();
    } else if (f.recovered_steps > 0) {
      ASSERT_TRUE(f.gather.ok()) << f.gather.ToString();
      EXPECT_TRUE(AllFinite(f.params));
    }
  }
}

// ---- Configuration errors -------------------------------------------------------------------

TEST(EngineTest, NvmePathsOutsideTheAllowedRootsOrNotFoldersAreRefused) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string allowed = dir.path() + "/allowed", other = dir.path() + "/other";
  ASSERT_EQ(mkdir(allowed.c_str(), 0700), 0);
  ASSERT_EQ(mkdir(other.c_str(), 0700), 0);
  ASSERT_EQ(symlink(other.c_str(), (allowed + "/escape").c_str()), 0);
  std::ofstream(dir.path() + "/file") << "x";
  struct Case {
    std::string path;
    std::string expect;  // empty: accepted
  };
  const std::vector<Case> cases = {
      {allowed, ""},
      {other, "outside the allowed folders"},
      {allowed + "/escape", "outside the allowed folders"},  // a link out of the root
      {allowed + "/../other", "outside the allowed folders"},
      {dir.path() + "/file", "not a folder"},
      {dir.path() + "/missing", "create the folder"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.path);
    std::unique_ptr<Device> device = NewHostDevice(HostDeviceOptions{});
    auto comms = NewLocalComms({device.get()});
    ASSERT_TRUE(comms.ok());
    RunOptions o;
    o.optimizer_tier = Tier::kNvme;
    EngineConfig config = MakeConfig(o, c.path);
    config.allowed_nvme_roots = {allowed};
    Result<std::unique_ptr<Engine>> engine =
        Engine::Create(config, device.get(), (*comms)[0].get());
    if (c.expect.empty()) {
      EXPECT_TRUE(engine.ok()) << engine.status().ToString();
      continue;
    }
    ASSERT_FALSE(engine.ok());
    EXPECT_NE(engine.status().message().find(c.expect), std::string::npos)
        << engine.status().ToString();
  }
  // The key parses, with a type check.
  std::vector<std::string> warnings;
  Result<EngineConfig> parsed =
      ParseEngineConfig(R"({"zinf": {"allowed_nvme_roots": ["/a", "/b"]}})", &warnings);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->allowed_nvme_roots, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_TRUE(warnings.empty());
  parsed = ParseEngineConfig(R"({"zinf": {"allowed_nvme_roots": "/a"}})", &warnings);
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("zinf.allowed_nvme_roots"), std::string::npos);
}

// Read-only folders (a read-only filesystem: root ignores permission bits) as the NVMe path
// and as the checkpoint folder: one clear error naming the path, nothing crashes, and the
// engine trains on after a refused checkpoint. Needs mount(2) (root); skipped otherwise.
TEST(EngineTest, ReadOnlyPathsAreRefusedNamingThePath) {
  TempDir dir;
  ASSERT_TRUE(dir.ok());
  const std::string ro = dir.path() + "/ro";
  ASSERT_EQ(mkdir(ro.c_str(), 0700), 0);
  const std::string cmd = "mount -t tmpfs -o ro,size=1m zinf-ro " + ro + " 2>/dev/null";
  if (std::system(cmd.c_str()) != 0) {
    GTEST_SKIP() << "cannot mount a read-only tmpfs here (needs root and mount(2))";
  }
  struct Unmount {
    std::string path;
    ~Unmount() { (void)std::system(("umount " + path).c_str()); }
  } unmount{ro};
  std::unique_ptr<Device> device = NewHostDevice(HostDeviceOptions{});
  auto comms = NewLocalComms({device.get()});
  ASSERT_TRUE(comms.ok());
  RunOptions o;
  o.param_tier = Tier::kNvme;
  o.optimizer_tier = Tier::kNvme;
  Result<std::unique_ptr<Engine>> refused =
      Engine::Create(MakeConfig(o, ro), device.get(), (*comms)[0].get());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(ro), std::string::npos) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("not writable"), std::string::npos)
      << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("Read-only file system"), std::string::npos)
      << refused.status().ToString();

  // A checkpoint into the read-only folder fails; training goes on.
  o.param_tier = o.optimizer_tier = Tier::kCpu;
  auto engine = Engine::Create(MakeConfig(o, ""), device.get(), (*comms)[0].get());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  RankTrainer trainer(engine->get());
  ASSERT_TRUE(trainer.Register().ok());
  double loss;
  StepStats stats;
  ASSERT_TRUE(trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats).ok());
  Status saved = (*engine)->SaveCheckpoint(ro + "/ckpt");
  ASSERT_FALSE(saved.ok());
  EXPECT_NE(saved.message().find(ro), std::string::npos) << saved.ToString();
  ASSERT_TRUE(trainer.MicroStep(0, kGlobalBatch, false, &loss, &stats).ok());
}

TEST(EngineTest, NvmeTierWithoutPathFailsAtCreate) {
  std::unique_ptr<Device> device = NewHostDevice(HostDeviceOptions{});
  auto comms = NewLocalComms({device.get()});
  ASSERT_TRUE(comms.ok()) << comms.status().ToString();
  for (int which = 0; which < 2; ++which) {
    EngineConfig c = MakeConfig(RunOptions{}, "");
    (which == 0 ? c.offload_param : c.offload_optimizer).tier = Tier::kNvme;
    Result<std::unique_ptr<Engine>> engine = Engine::Create(c, device.get(), (*comms)[0].get());
    ASSERT_FALSE(engine.ok()) << (which == 0 ? "offload_param" : "offload_optimizer")
                              << " on nvme without a path was accepted";
    EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument) << engine.status().ToString();
    EXPECT_NE(engine.status().message().find("nvme"), std::string::npos)
        << engine.status().ToString();
  }
}

}  // namespace
}  // namespace zinf
