// zinf-engine-bench: a synthetic layered model driven through the engine on the host device
// (or a GPU, --device cuda), to measure how well fetches, NVMe traffic and the optimizer
// overlap with compute.
//
// Each layer owns one parameter; "compute" is --compute-ms per layer and pass: on the host
// device a sleep of the trainer thread (a GPU computing leaves the host CPU free, and so does a
// sleep), on a GPU a kernel that keeps the compute stream busy that long (cuda::Spin) while the
// trainer thread runs ahead, as a PyTorch trainer's does. One JSON line per step.
//
// Compute idle: between the start of a step's first compute and the end of its last, the time
// the compute stream (the trainer thread, on the host device) was not computing: waiting for
// parameters, for the engine's own work on that stream, or for the host to issue work. Timed
// on the GPU's own clock (each kernel records its start and end) or the host's.
#include <sched.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "bench/collective_peer.h"
#include "common/cli.h"
#include "common/rank_launcher.h"
#include "config/engine_flags.h"
#include "zinf/comm.h"
#include "zinf/cuda.h"
#include "zinf/device.h"
#include "zinf/engine.h"
#include "zinf/log.h"
#include "zinf/runtime.h"
#include "zinf/swap.h"

namespace zinf {
namespace {

EngineFlags BenchEngineDefaults() {
  EngineFlags e;
  e.nvme = {"."};
  e.param_tier = "nvme";
  e.optimizer_tier = "cpu";
  e.optimizer_ratio = 1.0;
  e.gradient_transfer = "fp32";
  e.gradient_clipping = 0;
  e.speculative_step = "auto";
  e.optimizer_threads = 0;
  return e;
}

struct Flags {
  std::string preset = "none";
  int layers = 16;
  uint64_t layer_elems = 4u << 20;
  double compute_ms = 5;
  double copy_gbps = 0;
  int steps = 4;
  uint64_t sub_group_elems = 8u << 20;
  uint64_t prefetch_elems = 16u << 20;
  bool bf16 = false;
  std::string device = "host";
  int nproc = 0;                       // --nproc: ranks as processes (LaunchRanks)
  int offload_cycles = 0;              // --offload-cycles
  std::string offload_device = "cpu";  // --offload-device
  // The engine flags (config/engine_flags.h), with the bench's defaults.
  EngineFlags engine = BenchEngineDefaults();
};

// The run's settings in its JSON report (both the rank report and the single-rank one).
void ReportSettings(const Flags& f, nlohmann::json* j) {
  (*j)["preset"] = f.preset;
  (*j)["delayed_update"] = f.engine.delayed_update;
  (*j)["device"] = f.device;
  (*j)["optimizer_ratio"] = f.engine.optimizer_ratio;
  (*j)["gradient_transfer"] = f.engine.gradient_transfer;
  (*j)["gradient_clipping"] = f.engine.gradient_clipping;
  (*j)["speculative_step"] = f.engine.speculative_step;
  (*j)["state_dtype"] = f.engine.state_dtype.empty() ? "fp32" : f.engine.state_dtype;
  (*j)["io_backend"] = f.engine.io_backend.empty() ? "io_uring" : f.engine.io_backend;
}

// The bench's "compute" and its busy intervals, for the compute-idle figure.
class Compute {
 public:
  // Up to `max_runs` runs per step.
  static Result<std::unique_ptr<Compute>> Create(Device* device, bool cuda, size_t max_runs) {
    auto c = std::unique_ptr<Compute>(new Compute(device, cuda, max_runs));
    if (cuda) {
      ZINF_ASSIGN_OR_RETURN(void* times, device->Alloc(2 * max_runs * sizeof(uint64_t)));
      c->times_ = static_cast<uint64_t*>(times);
    }
    return c;
  }
  Compute(const Compute&) = delete;
  Compute& operator=(const Compute&) = delete;
  ~Compute() {
    if (times_ != nullptr) device_->Free(times_);
  }

  Status Run(double ms) {
    if (runs_ >= max_runs_) return Status::Internal("more compute runs than planned in a step");
    if (cuda_) return cuda::Spin(ms / 1e3, times_ + 2 * runs_++, device_->ComputeStream());
    const auto t0 = Clock::now();
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
    const auto t1 = Clock::now();
    host_.push_back(static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(t0.time_since_epoch()).count()));
    host_.push_back(static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(t1.time_since_epoch()).count()));
    ++runs_;
    return Status::OK();
  }

  // The step's idle seconds between its first compute's start and its last compute's end
  // (waits for the compute stream); starts the next step.
  Result<double> EndStep() {
    std::vector<uint64_t> t(2 * runs_);
    if (cuda_ && runs_ > 0) {
      Stream* compute = device_->ComputeStream();
      ZINF_RETURN_IF_ERROR(device_->SynchronizeStream(compute));
      ZINF_RETURN_IF_ERROR(device_->CopyDeviceToHost(t.data(), times_, t.size() * 8, compute));
      ZINF_RETURN_IF_ERROR(device_->SynchronizeStream(compute));
    } else {
      t = host_;
    }
    host_.clear();
    runs_ = 0;
    if (t.empty()) return 0.0;
    uint64_t busy = 0;
    for (size_t k = 0; k < t.size(); k += 2) busy += t[k + 1] - t[k];
    const uint64_t span = t.back() - t.front();
    return static_cast<double>(span > busy ? span - busy : 0) / 1e9;
  }

 private:
  using Clock = std::chrono::steady_clock;
  Compute(Device* device, bool cuda, size_t max_runs)
      : device_(device), cuda_(cuda), max_runs_(max_runs) {}
  Device* const device_;
  const bool cuda_;
  const size_t max_runs_;
  size_t runs_ = 0;
  uint64_t* times_ = nullptr;  // cuda: device memory, [start, end] per run
  std::vector<uint64_t> host_;
};

void AddFlags(CLI::App& app, Flags* f) {
  app.add_option("--preset", f->preset,
                 "io-bound (parameters on NVMe, light compute) or adam-bound (parameters on "
                 "the device, optimizer on the CPU); other flags override")
      ->check(CLI::IsMember({"none", "io-bound", "adam-bound"}));
  app.add_option("--layers", f->layers)->check(CLI::Range(1, 100000));
  app.add_option("--nproc", f->nproc,
                 "ranks as N processes on this machine (ZeRO-3 over gloo); rank 0 reports, "
                 "with the collectives' bytes and time per step beside gloo alone moving a "
                 "step's data")
      ->check(CLI::Range(1, 64));
  app.add_option("--layer-elems", f->layer_elems, "parameter elements per layer")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 34));
  app.add_option("--compute-ms", f->compute_ms, "simulated compute per layer and pass")
      ->check(FiniteNumber())
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--copy-gbps", f->copy_gbps, "HostDevice host<->device bandwidth cap (0: none)")
      ->check(FiniteNumber())
      ->check(CLI::Range(0.0, 1e4));
  app.add_option("--steps", f->steps)->check(CLI::Range(1, 100000));
  app.add_option("--sub-group-elems", f->sub_group_elems)
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 34));
  app.add_option("--prefetch-elems", f->prefetch_elems)
      ->check(CLI::Range(uint64_t{0}, uint64_t{1} << 40));
  app.add_flag("--bf16", f->bf16, "bf16 parameters on the device");
  app.add_option("--offload-cycles", f->offload_cycles,
                 "after the steps: this many offload_states / reload_states cycles (blocking, "
                 "pinned host memory), one JSON line each with their seconds and the device "
                 "memory in use before and while offloaded, then one more step")
      ->check(CLI::Range(0, 1000));
  app.add_option("--offload-device", f->offload_device,
                 "where --offload-cycles move the states: cpu (host memory) or nvme (the first "
                 "--nvme folder; the pinned host memory is released too)")
      ->check(CLI::IsMember({"cpu", "nvme"}));
  app.add_option("--device", f->device,
                 "host (HostDevice, simulated link) or cuda (GPU 0 and a one-rank NCCL "
                 "communicator)")
      ->check(CLI::IsMember({"host", "cuda"}));
  AddEngineFlags(app, &f->engine);
  app.get_option("--gradient-clipping")
      ->description(
          "gradient_clipping (max global L2 norm; 0: off). The bench's gradient is 1e-3 per "
          "element, so its norm is 1e-3 x sqrt(layers x layer elements): below it every step "
          "clips, above none does");
  app.get_option("--speculative-step")
      ->description(
          "zinf.speculative_step with clipping: on, off or auto (on a GPU when the optimizer "
          "states are in CPU memory; off on the host device); the bench adds one snapshot per "
          "sub-group to the pinned budget");
}

// The preset's settings over the bench's defaults, keeping f's NVMe folders and device; the
// explicit flags are then parsed again over them.
Flags PresetFlags(const Flags& f) {
  Flags p;
  p.preset = f.preset;
  if (f.preset == "io-bound") {
    p.layers = 16;
    p.layer_elems = 8u << 20;
    p.compute_ms = 1;
    p.engine.param_tier = "nvme";
    p.engine.optimizer_tier = "cpu";
    // One core for Adam, one for I/O completions and copies (2-core machine).
    p.engine.optimizer_threads = 1;
  } else {
    // Parameters stay on the device (one rank: no fetch copies), states on the CPU: the
    // optimizer and the gradient/parameter copies around it carry the step.
    p.layers = 8;
    p.layer_elems = 16u << 20;
    p.compute_ms = 1;
    p.engine.param_tier = "device";
    p.engine.optimizer_tier = "cpu";
  }
  p.engine.nvme = f.engine.nvme;
  p.device = f.device;
  return p;
}

// The engine flags, the bench's model sizes, and a pinned budget sized for the model.
Result<EngineConfig> BenchEngineConfig(const Flags& f) {
  EngineConfig c;
  ZINF_RETURN_IF_ERROR(ApplyEngineFlags(f.engine, &c));
  c.sub_group_size = f.sub_group_elems;
  c.prefetch_bucket_size = f.prefetch_elems;
  c.param_persistence_threshold = 0;
  c.max_reuse_distance = 0;
  c.bf16 = f.bf16;
  const uint64_t elem = f.bf16 ? 2 : 4;
  // Speculation (with clipping): a snapshot of [master | m | v] per sub-group, about 12 bytes
  // per element of the model, twice ("auto" takes at most half of what the budget leaves).
  const uint64_t snapshots = f.engine.gradient_clipping > 0 && f.engine.speculative_step != "off"
                                 ? uint64_t{24} * f.layers * f.layer_elems + (64u << 20)
                                 : 0;
  c.pinned_budget_bytes =
      RoundUp(f.layers * f.layer_elems * 4 + 4 * f.sub_group_elems * 14 + f.prefetch_elems * elem +
                  64 * f.layer_elems + (256u << 20) + snapshots,
              2u << 20);
  return c;
}

// GPU `group.local_rank` (--device cuda) or the host device with its simulated link, and the
// group's communicator.
Result<Runtime> NewBenchRuntime(const Flags& f, const ProcessGroupOptions& group) {
  if (f.device == "cuda") {
    CudaDeviceOptions co;
    co.device = group.local_rank;
    return NewCudaRuntime(co, group);
  }
  HostDeviceOptions ho;
  ho.memory_budget = size_t{64} << 30;
  ho.copy_gbps = f.copy_gbps;
  return NewHostRuntime(ho, group);
}

// One parameter per layer, then FinishRegistration (which initialises the stores).
Result<std::vector<ParamId>> RegisterLayers(const Flags& f, Engine& e) {
  std::vector<ParamId> ids;
  for (int l = 0; l < f.layers; ++l) {
    ParamSpec spec;
    spec.name = "layer" + std::to_string(l);
    spec.shape = {static_cast<int64_t>(f.layer_elems)};
    spec.init = [l](float* d, size_t n) {
      for (size_t i = 0; i < n; ++i) d[i] = 0.001f * static_cast<float>((i + l) % 97);
    };
    ZINF_ASSIGN_OR_RETURN(ParamId id, e.RegisterParameter(spec));
    ids.push_back(id);
  }
  std::fprintf(stderr,
               "zinf-engine-bench: %d layers x %llu elements, params on %s, optimizer on "
               "%s; initialising stores...\n",
               f.layers, static_cast<unsigned long long>(f.layer_elems),
               f.engine.param_tier.c_str(), f.engine.optimizer_tier.c_str());
  ZINF_RETURN_IF_ERROR(e.FinishRegistration());
  return ids;
}

// The gradient the "backward" hands over, in device memory (one layer's worth, 1e-3 each).
// After a failed copy the buffer is not freed: the bench exits on the error.
Result<void*> UploadGradient(const Flags& f, Device* device) {
  const std::vector<float> grad_host(f.layer_elems, 1e-3f);
  const size_t grad_bytes = f.layer_elems * sizeof(float);
  ZINF_ASSIGN_OR_RETURN(void* mem, device->Alloc(grad_bytes));
  ZINF_RETURN_IF_ERROR(
      device->CopyHostToDevice(mem, grad_host.data(), grad_bytes, device->ComputeStream()));
  ZINF_RETURN_IF_ERROR(device->SynchronizeStream(device->ComputeStream()));
  return mem;
}

// The cores this process may run on: the CPU-seconds figures against cores x step time.
int AllowedCores() {
  cpu_set_t affinity;
  CPU_ZERO(&affinity);
  return sched_getaffinity(0, sizeof(affinity), &affinity) == 0 ? std::max(1, CPU_COUNT(&affinity))
                                                                : 1;
}

// What each step drives and reports on.
struct BenchRun {
  Engine* engine;
  std::vector<ParamId> ids;  // one per layer
  const float* grad;         // device memory
  Compute* compute;
  Communicator* comm;  // the rank's, traced (--nproc)
  int cores;           // AllowedCores()
  bench::CollectiveTrace* trace;
};

// One step's figures: the engine's, the compute stream's idle time, and the collectives'.
struct StepFigures {
  StepStats stats;
  double idle_seconds = 0;
  double cpu_utilisation = 0;
  CommCounters comm;  // this step's collectives, bytes and seconds
};

// The measured steps' figures, for the medians of the final report.
struct StepSeries {
  std::vector<double> effs, step_secs, nvme_busy, copy_busy, opt_busy, idle_secs, d2h;
  std::vector<double> cpu_total, cpu_trainer, cpu_optimizer, cpu_util;
  std::vector<double> comm_bytes, comm_secs;
  uint64_t speculated = 0, kept = 0, redone = 0, landing = 0;

  void Add(const StepFigures& s) {
    const StepStats& st = s.stats;
    effs.push_back(st.overlap_efficiency);
    step_secs.push_back(st.step_seconds);
    nvme_busy.push_back(st.nvme_busy_seconds);
    copy_busy.push_back(st.copy_busy_seconds);
    opt_busy.push_back(st.optimizer_busy_seconds);
    idle_secs.push_back(s.idle_seconds);
    d2h.push_back(static_cast<double>(st.d2h_bytes));
    comm_bytes.push_back(static_cast<double>(s.comm.bytes_sent));
    comm_secs.push_back(s.comm.seconds);
    cpu_total.push_back(st.cpu_seconds_total);
    cpu_trainer.push_back(st.cpu_seconds_trainer);
    cpu_optimizer.push_back(st.cpu_seconds_optimizer);
    cpu_util.push_back(s.cpu_utilisation);
    speculated += st.speculated_groups;
    kept += st.kept_groups;
    redone += st.redone_groups;
    landing += st.landing_groups;
  }
};

// One micro-step's passes: every layer acquired, computed and released forward, then
// backward with its gradient reduced.
Status ForwardBackward(const Flags& f, const BenchRun& run) {
  Engine& e = *run.engine;
  for (int l = 0; l < f.layers; ++l) {
    if (auto p = e.Acquire({run.ids[l]}); !p.ok()) return p.status();
    ZINF_RETURN_IF_ERROR(run.compute->Run(f.compute_ms));
    ZINF_RETURN_IF_ERROR(e.Release({run.ids[l]}));
  }
  for (int l = f.layers - 1; l >= 0; --l) {
    if (auto p = e.Acquire({run.ids[l]}); !p.ok()) return p.status();
    ZINF_RETURN_IF_ERROR(
        run.compute->Run(2 * f.compute_ms));  // backward costs about twice the forward
    ZINF_RETURN_IF_ERROR(e.ReduceGradient(run.ids[l], run.grad));
    ZINF_RETURN_IF_ERROR(e.Release({run.ids[l]}));
  }
  return Status::OK();
}

// The step's JSON line.
void ReportStep(const Flags& f, const BenchRun& run, const StepFigures& s) {
  const StepStats& st = s.stats;
  nlohmann::json j;
  VisitStepStats(st, [&](const char* name, auto value) { j[name] = value; });
  j["ranks"] = run.comm->world_size();
  j["comm_collectives"] = s.comm.collectives;
  j["comm_bytes_sent"] = s.comm.bytes_sent;
  j["comm_seconds"] = s.comm.seconds;
  ReportSettings(f, &j);
  j["cpu_cores"] = run.cores;
  j["cpu_utilisation"] = s.cpu_utilisation;
  j["compute_seconds"] = 3 * f.layers * f.compute_ms / 1e3;
  j["compute_idle_seconds"] = s.idle_seconds;
  j["nvme_read_gbps"] = st.nvme_read_bytes / st.step_seconds / 1e9;
  j["nvme_write_gbps"] = st.nvme_write_bytes / st.step_seconds / 1e9;
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

// Runs the steps, one JSON line each; all but the first go into `series`.
Status RunSteps(const Flags& f, const BenchRun& run, StepSeries* series) {
  for (int step = 0; step < f.steps; ++step) {
    bench::SetTraceStep(*run.trace, step);
    const CommCounters before = run.comm->Counters();
    ZINF_RETURN_IF_ERROR(ForwardBackward(f, run));
    StepFigures s;
    ZINF_ASSIGN_OR_RETURN(s.stats, run.engine->Step());
    ZINF_ASSIGN_OR_RETURN(s.idle_seconds, run.compute->EndStep());
    const CommCounters after = run.comm->Counters();
    s.comm.collectives = after.collectives - before.collectives;
    s.comm.bytes_sent = after.bytes_sent - before.bytes_sent;
    s.comm.seconds = after.seconds - before.seconds;
    // The share of the cores' time the process used: near 1, the step is CPU-bound, and busy
    // times that overlap in wall time competed for the same cores.
    s.cpu_utilisation = s.stats.step_seconds > 0
                            ? s.stats.cpu_seconds_total / (run.cores * s.stats.step_seconds)
                            : 0.0;
    ReportStep(f, run, s);
    if (step > 0) series->Add(s);  // step 0 records the trace
  }
  return Status::OK();
}

// The process's resident set (/proc/self/statm), 0 when unreadable.
size_t ResidentBytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long long size = 0, resident = 0;
  const int n = std::fscanf(f, "%llu %llu", &size, &resident);
  std::fclose(f);
  return n == 2 ? static_cast<size_t>(resident) * static_cast<size_t>(sysconf(_SC_PAGESIZE)) : 0;
}

// --offload-cycles: offload_states / reload_states cycles between steps, timed, with the device
// memory in use and backed before, while offloaded and after; then a step, which must still
// run.
Status OffloadCycles(const Flags& f, const BenchRun& run, Device* device) {
  std::vector<double> offload_s, reload_s;
  Engine::OffloadStatesOptions opt;
  opt.device = f.offload_device == "nvme" ? Tier::kNvme : Tier::kCpu;
  for (int c = 0; c < f.offload_cycles; ++c) {
    const DeviceMemoryInfo before = device->MemoryInfo();
    ZINF_ASSIGN_OR_RETURN(const Engine::PinnedMemoryInfo pinned_before,
                          run.engine->pinned_memory());
    const size_t rss_before = ResidentBytes();
    const auto t0 = std::chrono::steady_clock::now();
    ZINF_RETURN_IF_ERROR(run.engine->OffloadStates(opt));
    const auto t1 = std::chrono::steady_clock::now();
    const DeviceMemoryInfo offloaded = device->MemoryInfo();
    ZINF_ASSIGN_OR_RETURN(const Engine::PinnedMemoryInfo pinned_offloaded,
                          run.engine->pinned_memory());
    const size_t rss_offloaded = ResidentBytes();
    ZINF_RETURN_IF_ERROR(run.engine->ReloadStates(/*non_blocking=*/false));
    const auto t2 = std::chrono::steady_clock::now();
    const DeviceMemoryInfo reloaded = device->MemoryInfo();
    offload_s.push_back(std::chrono::duration<double>(t1 - t0).count());
    reload_s.push_back(std::chrono::duration<double>(t2 - t1).count());
    nlohmann::json j;
    j["offload_cycle"] = c;
    j["offload_seconds"] = offload_s.back();
    j["reload_seconds"] = reload_s.back();
    j["device_used_before"] = before.used;
    j["device_used_offloaded"] = offloaded.used;
    j["device_used_reloaded"] = reloaded.used;
    // Backed by device memory (what the driver sees taken; the pool's whole chunks).
    j["device_committed_before"] = before.committed;
    j["device_committed_offloaded"] = offloaded.committed;
    j["device_committed_reloaded"] = reloaded.committed;
    // Host memory: the pinned arena's resident bytes and the process's RSS.
    j["pinned_used"] = pinned_before.used;
    j["pinned_resident_before"] = pinned_before.resident;
    j["pinned_resident_offloaded"] = pinned_offloaded.resident;
    j["rss_before"] = rss_before;
    j["rss_offloaded"] = rss_offloaded;
    std::printf("%s\n", j.dump().c_str());
  }
  ZINF_RETURN_IF_ERROR(ForwardBackward(f, run));
  ZINF_ASSIGN_OR_RETURN(StepStats st, run.engine->Step());
  nlohmann::json j;
  j["median_offload_seconds"] = bench::Median(offload_s);
  j["median_reload_seconds"] = bench::Median(reload_s);
  j["step_after_cycles"] = st.step;
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
  return Status::OK();
}

// With several ranks: the engine's collectives per step, beside gloo alone replaying them
// (bench/collective_peer.h). The rate is the step's bytes over the time inside collectives.
void ReportCollectives(const StepSeries& series, const Result<bench::CollectiveFigures>& peer,
                       nlohmann::json* j) {
  const auto median = bench::Median;
  const double bytes = median(series.comm_bytes);
  (*j)["median_comm_bytes_sent"] = bytes;
  (*j)["median_comm_seconds"] = median(series.comm_secs);
  (*j)["median_comm_gbps"] =
      median(series.comm_secs) > 0 ? bytes / median(series.comm_secs) / 1e9 : 0;
  if (!peer.ok()) {
    (*j)["peer"] = peer.status().ToString();
    return;
  }
  // Over the bytes of every group's collectives (the counters above are the job's only).
  const double all = peer->bytes_per_step;
  const auto gbps = [&](double s) { return s > 0 ? all / s / 1e9 : 0.0; };
  (*j)["collective_bytes_sent"] = all;
  (*j)["peer"] = "gloo alone replaying the step's collectives (same sizes, groups and order)";
  (*j)["collectives_per_step"] = peer->collectives_per_step;
  (*j)["median_collective_seconds_with_waits"] = peer->engine_seconds_with_waits;
  (*j)["median_collective_seconds"] = peer->engine_seconds;  // from each one's last arrival
  (*j)["collective_gbps"] = gbps(peer->engine_seconds);
  (*j)["peer_seconds"] = peer->peer_seconds;
  (*j)["peer_gbps"] = gbps(peer->peer_seconds);
  (*j)["collective_efficiency"] =
      peer->engine_seconds > 0 ? peer->peer_seconds / peer->engine_seconds : 0.0;
}

// The final JSON line: medians over the measured steps.
void ReportSummary(const Flags& f, const StepSeries& series, int cores, const Communicator& comm,
                   const Result<bench::CollectiveFigures>& peer) {
  const auto median = bench::Median;
  nlohmann::json j;
  j["median_step_seconds"] = median(series.step_secs);
  // The engine's own resources, to read the overlap figure against: the trainer's time
  // includes the engine work done on its thread (gradient copies on the host device).
  j["median_nvme_busy_seconds"] = median(series.nvme_busy);
  j["median_copy_busy_seconds"] = median(series.copy_busy);
  j["median_optimizer_busy_seconds"] = median(series.opt_busy);
  j["simulated_compute_seconds"] = 3 * f.layers * f.compute_ms / 1e3;
  // The compute stream's idle time within the step (see the top of this file), against the
  // compute it ran: 0 is perfect overlap.
  j["median_compute_idle_seconds"] = median(series.idle_secs);
  const double span = median(series.idle_secs) + 3 * f.layers * f.compute_ms / 1e3;
  j["median_compute_idle_fraction"] = span > 0 ? median(series.idle_secs) / span : 0.0;
  ReportSettings(f, &j);
  // CPU seconds per step beside the wall-clock busy times above (which share the cores).
  j["cpu_cores"] = cores;
  j["median_cpu_seconds_total"] = median(series.cpu_total);
  j["median_cpu_seconds_trainer"] = median(series.cpu_trainer);
  j["median_cpu_seconds_optimizer"] = median(series.cpu_optimizer);
  j["median_cpu_utilisation"] = median(series.cpu_util);
  // Sub-group steps over the measured steps: speculated, and of those kept or redone.
  j["speculated_groups"] = series.speculated;
  j["kept_groups"] = series.kept;
  j["redone_groups"] = series.redone;
  // Sub-groups stepped while their last gradient was landing (the undelayed host device).
  j["landing_groups"] = series.landing;
  j["median_d2h_bytes"] = median(series.d2h);
  j["median_overlap_efficiency"] = median(series.effs);
  j["ranks"] = comm.world_size();
  if (comm.world_size() > 1) ReportCollectives(series, peer, &j);
  std::printf("%s\n", j.dump().c_str());
}

// Builds the engine and model on this rank's device, runs the steps and reports.
int RunBench(const Flags& f) {
  Result<EngineConfig> c = BenchEngineConfig(f);
  if (!c.ok()) {
    std::fprintf(stderr, "zinf-engine-bench: %s\n", c.status().message().c_str());
    return 2;
  }
  Result<ProcessGroupOptions> group = ProcessGroupFromEnv();
  if (!group.ok()) {
    std::fprintf(stderr, "zinf-engine-bench: %s\n", group.status().ToString().c_str());
    return 2;
  }
  Result<Runtime> rank = NewBenchRuntime(f, *group);
  if (!rank.ok()) {
    std::fprintf(stderr, "zinf-engine-bench: %s%s\n", f.device == "cuda" ? "--device cuda: " : "",
                 rank.status().ToString().c_str());
    return 1;
  }
  Device* const device = rank->device.get();
  // The engine's collectives, traced for the gloo peer (bench/collective_peer.h).
  std::shared_ptr<bench::CollectiveTrace> trace = bench::NewCollectiveTrace();
  const std::unique_ptr<Communicator> traced =
      bench::TraceCollectives(rank->comm.get(), device, trace);
  Communicator* const comm = traced.get();
  if (comm->rank() != 0 && std::freopen("/dev/null", "w", stdout) == nullptr) return 1;
  auto engine = Engine::Create(*c, device, comm);
  if (!engine.ok()) {
    std::fprintf(stderr, "zinf-engine-bench: %s\n", engine.status().ToString().c_str());
    return 1;
  }
  Result<std::vector<ParamId>> ids = RegisterLayers(f, **engine);
  if (!ids.ok()) {
    std::fprintf(stderr, "zinf-engine-bench: %s\n", ids.status().ToString().c_str());
    return 1;
  }
  Result<void*> grad_mem = UploadGradient(f, device);
  if (!grad_mem.ok()) {
    std::fprintf(stderr, "zinf-engine-bench: gradient buffer: %s\n",
                 grad_mem.status().ToString().c_str());
    return 1;
  }
  Result<std::unique_ptr<Compute>> compute =
      Compute::Create(device, f.device == "cuda", 2 * f.layers);
  if (!compute.ok()) {
    std::fprintf(stderr, "zinf-engine-bench: compute timing: %s\n",
                 compute.status().ToString().c_str());
    return 1;
  }
  const BenchRun run{
      engine->get(),  std::move(*ids), static_cast<const float*>(*grad_mem), compute->get(), comm,
      AllowedCores(), trace.get()};
  StepSeries series;
  Status s = RunSteps(f, run, &series);
  bench::SetTraceStep(*trace, f.steps);  // what follows is not a measured step
  if (s.ok() && f.offload_cycles > 0) s = OffloadCycles(f, run, device);
  engine->reset();   // drains the engine's streams before its gradient source goes
  compute->reset();  // its timing buffer, while the device lives
  device->Free(*grad_mem);
  if (!s.ok()) {
    std::fprintf(stderr, "zinf-engine-bench: %s\n", s.ToString().c_str());
    return 1;
  }
  // Steps 1 and later are measured; the peer replays the last. Against gloo only: a GPU's
  // collectives run on NCCL (and the stamps would sit between its kernels).
  Result<bench::CollectiveFigures> peer =
      Status::NotSupported(f.device == "cuda" ? "the gloo peer replays host (gloo) collectives only"
                                              : "fewer than 2 steps: no measured step");
  if (comm->world_size() > 1 && f.steps > 1 && f.device != "cuda") {
    peer = bench::CompareWithGloo(*trace, comm, 1, f.steps - 1);
  }
  ReportSummary(f, series, run.cores, *comm, peer);
  return 0;
}

int Main(int argc, char** argv) {
  Flags f;
  CLI::App app{"zinf-engine-bench: overlap of compute, NVMe and the CPU optimizer"};
  AddFlags(app, &f);
  // Presets first, then explicit flags win: parse twice.
  if (int rc = ParseCommandLine(app, argc, argv); rc >= 0) return rc;
  if (f.nproc > 1) return LaunchRanks("zinf-engine-bench", argc, argv, f.nproc);
  if (f.preset != "none") {
    f = PresetFlags(f);
    if (int rc = ParseCommandLine(app, argc, argv); rc >= 0) return rc;
  }
  return RunBench(f);
}

}  // namespace
}  // namespace zinf

int main(int argc, char** argv) { return zinf::Main(argc, argv); }
