// zinf._zinf: the engine for Python, with no link to torch. Tensors cross as raw pointers,
// shapes and dtypes (and DLPack capsules, which torch reads with torch.utils.dlpack), so one
// build serves every torch version.
//
// What this layer adds to the C++ engine is one rule that makes acquired memory safe to hand
// to torch: an Engine::Release is issued only once torch holds no tensor over the parameter's
// memory. Every capsule counts as a view of its parameter until torch frees the tensor made
// from it (DLPack's deleter); release() records that the Python side is done and the engine's
// Release follows when the views are gone (at the next call into this module).
#include <fcntl.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "device/host/local_comm.h"
#include "zinf/comm.h"
#include "zinf/config.h"
#include "zinf/cpu_adam.h"
#include "zinf/cuda.h"
#include "zinf/device.h"
#include "zinf/engine.h"
#include "zinf/log.h"
#include "zinf/runtime.h"
#include "zinf/safetensors.h"
#include "zinf/swap.h"

namespace py = pybind11;

namespace zinf::python {
namespace {

// ---- Errors -------------------------------------------------------------------------------------

// zinf.ZinfError, created at import (see PYBIND11_MODULE).
PyObject* g_error = nullptr;

struct ZinfException {
  Status status;
};

[[noreturn]] void Throw(const Status& s) { throw ZinfException{s}; }
void Check(const Status& s) {
  if (!s.ok()) Throw(s);
}
template <typename T>
T Take(Result<T> r) {
  if (!r.ok()) Throw(r.status());
  return std::move(r).value();
}

// Runs `fn` (an engine call returning a Status or a Result) with the GIL released, so that
// other Python threads run during its waits; raises its failure, returns its value.
template <typename Fn>
auto WithoutGil(Fn&& fn) {
  using R = decltype(fn());
  if constexpr (std::is_same_v<R, Status>) {
    Status s;
    {
      py::gil_scoped_release nogil;
      s = fn();
    }
    Check(s);
  } else {
    R r = Status::Internal("not run");
    {
      py::gil_scoped_release nogil;
      r = fn();
    }
    return Take(std::move(r));
  }
}

// ---- DLPack (the stable C ABI of dlpack.h, v0.x, which torch.utils.dlpack reads) ----------

struct DLDevice {
  int32_t device_type;  // kDLCPU = 1, kDLCUDA = 2
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // kDLFloat = 2, kDLBfloat = 4
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // null: compact, row-major
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

// ---- Host memory sources for registration -------------------------------------------------------

enum class SourceType { kF32, kBf16, kF16 };

SourceType ParseSourceType(const std::string& name) {
  if (name == "float32") return SourceType::kF32;
  if (name == "bfloat16") return SourceType::kBf16;
  if (name == "float16") return SourceType::kF16;
  Throw(Status::InvalidArgument("parameter dtype " + name +
                                ": zinf manages float32, bfloat16 and float16 parameters"));
}

void ToF32(const void* src, SourceType type, float* dst, size_t n) {
  switch (type) {
    case SourceType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case SourceType::kBf16:
      for (size_t i = 0; i < n; ++i) dst[i] = Bf16ToFp32(static_cast<const uint16_t*>(src)[i]);
      return;
    case SourceType::kF16:
      for (size_t i = 0; i < n; ++i) dst[i] = Fp16ToFp32(static_cast<const uint16_t*>(src)[i]);
      return;
  }
}

// Parameter values written aside while a model is built under zinf.Init: an unlinked file
// (O_TMPFILE) in a folder on disk, fp32, read back when the engine initialises its stores. The
// page cache holds it, not the process, so building a model larger than memory works.
class Spill {
 public:
  explicit Spill(const std::string& dir) : dir_(dir) {
    fd_ = open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd_ < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
      std::string templ = dir + "/.zinf-init-XXXXXX";
      fd_ = mkostemp(templ.data(), O_CLOEXEC);
      if (fd_ >= 0) unlink(templ.c_str());
    }
    if (fd_ < 0) {
      Throw(ErrnoToStatus(errno, "zinf.Init: creating a spill file for parameter values in " + dir +
                                     " (pick a writable folder on disk)"));
    }
  }
  ~Spill() {
    if (fd_ >= 0) close(fd_);
  }
  Spill(const Spill&) = delete;
  Spill& operator=(const Spill&) = delete;

  // Appends n values of `type` at `ptr` as fp32; returns their offset.
  uint64_t Append(uintptr_t ptr, const std::string& dtype, size_t n) {
    const SourceType type = ParseSourceType(dtype);
    const size_t esize = type == SourceType::kF32 ? 4 : 2;
    const uint64_t offset = size_;
    std::vector<float> block(std::min<size_t>(n, kBlock));
    for (size_t done = 0; done < n;) {
      const size_t k = std::min(kBlock, n - done);
      ToF32(reinterpret_cast<const char*>(ptr) + done * esize, type, block.data(), k);
      Check(WriteAll(block.data(), k * sizeof(float), offset + done * sizeof(float)));
      done += k;
    }
    size_ += n * sizeof(float);
    return offset;
  }
  Status Read(uint64_t offset, float* out, size_t n) const {
    char* p = reinterpret_cast<char*>(out);
    size_t left = n * sizeof(float);
    while (left > 0) {
      ssize_t r = pread(fd_, p, std::min<size_t>(left, 1 << 30), static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        return r < 0 ? ErrnoToStatus(errno, "reading the zinf.Init spill file in " + dir_)
                     : Status::Corruption("the zinf.Init spill file in " + dir_ + " is short");
      }
      p += r;
      left -= static_cast<size_t>(r);
      offset += static_cast<uint64_t>(r);
    }
    return Status::OK();
  }
  uint64_t bytes() const { return size_; }

 private:
  static constexpr size_t kBlock = 1 << 20;
  Status WriteAll(const void* buf, size_t n, uint64_t off) {
    const char* p = static_cast<const char*>(buf);
    while (n > 0) {
      ssize_t w = pwrite(fd_, p, std::min<size_t>(n, 1 << 30), static_cast<off_t>(off));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) return ErrnoToStatus(errno, "zinf.Init: writing the spill file in " + dir_);
      p += w;
      n -= static_cast<size_t>(w);
      off += static_cast<uint64_t>(w);
    }
    return Status::OK();
  }
  std::string dir_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

safetensors::DType ParseDType(const std::string& name);

// ---- The engine and what torch holds of it ----------------------------------------------------

// Shared by the Python Engine object and by every capsule handed to torch: a tensor torch
// still holds keeps the engine (and so its memory) alive.
struct Core {
  std::unique_ptr<Device> device;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::unique_ptr<Engine> engine;  // destroyed first (declared last)
  int dl_device_type = 1;
  int dl_device_id = 0;

  std::mutex mu;
  std::vector<int64_t> views;    // guarded by mu: live torch tensors per parameter
  std::vector<int64_t> pending;  // guarded by mu: Releases owed once views reach zero

  // Registration sources, dropped once registration ends.
  std::vector<std::shared_ptr<Spill>> spills;
  Status init_error;  // the first failing source (the engine's init callback cannot fail)

  ~Core() {
    engine.reset();
    comms.clear();
    device.reset();
  }
};

struct Lease {
  std::shared_ptr<Core> core;
  ParamId id = 0;
  int64_t shape[1] = {0};
  DLManagedTensor managed{};
};

void DeleteLease(DLManagedTensor* t) {
  Lease* lease = static_cast<Lease*>(t->manager_ctx);
  {
    std::lock_guard<std::mutex> lock(lease->core->mu);
    --lease->core->views[lease->id];
  }
  delete lease;  // may destroy the engine when it was the last reference
}

void CapsuleDestructor(PyObject* capsule) {
  // A capsule torch consumed is renamed "used_dltensor"; torch calls the deleter itself.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    if (t != nullptr && t->deleter != nullptr) t->deleter(t);
  }
}

class PyEngine {
 public:
  PyEngine(const std::string& config_json, const std::string& device, int device_index,
           bool use_stream, uintptr_t cuda_stream, uint64_t device_memory) {
    std::vector<std::string> warnings;
    EngineConfig config = Take(ParseEngineConfig(config_json, &warnings));
    warnings_ = warnings;
    core_ = std::make_shared<Core>();
    if (device_memory == 0) device_memory = config.device_budget_bytes;
    if (device == "cpu") {
      HostDeviceOptions ho;
      // The one host-device rule (zinf-train, the C API): 0 is the machine's memory, lowered
      // to fit an address-space limit; an explicit budget that cannot fit is refused.
      BudgetNames names;
      names.device = "device_memory (zinf.device_budget_bytes)";
      ho.memory_budget = Take(HostDeviceBudget(device_memory, config.pinned_budget_bytes, names));
      ho.copy_gbps = config.host_copy_gbps;
      Runtime rank = Take(NewHostRuntime(ho));
      core_->device = std::move(rank.device);
      core_->comms.push_back(std::move(rank.comm));
    } else if (device == "cuda") {
      if (device_memory == 0) {
        Throw(Status::InvalidArgument(
            "device cuda: no device memory budget (zinf.device_budget_bytes); zinf reserves it "
            "once beside torch's caching allocator, so it must be given"));
      }
      CudaDeviceOptions co;
      co.device = device_index;
      co.memory_budget = device_memory;
      co.use_external_compute_stream = use_stream;
      co.external_compute_stream = reinterpret_cast<void*>(cuda_stream);
      core_->device = Take(NewCudaDevice(co));
      core_->comms.push_back(Take(NewNcclComm(core_->device.get(), NcclCommOptions{})));
      core_->dl_device_type = 2;
      core_->dl_device_id = device_index;
    } else {
      Throw(Status::InvalidArgument("device '" + device + "': cpu or cuda"));
    }
    core_->engine = Take(Engine::Create(config, core_->device.get(), core_->comms[0].get()));
  }

  const std::vector<std::string>& warnings() const { return warnings_; }
  Engine& engine() { return *core_->engine; }

  // Registers a parameter whose initial values are read, when registration ends, from host
  // memory at `ptr` (the caller keeps it alive until then) or from a spill file.
  ParamId Register(const std::string& name, const std::vector<int64_t>& shape, bool trainable,
                   uintptr_t ptr, const std::string& dtype, std::shared_ptr<Spill> spill,
                   uint64_t spill_offset) {
    ParamSpec spec;
    spec.name = name;
    spec.shape = shape;
    spec.trainable = trainable;
    std::weak_ptr<Core> weak = core_;
    if (spill) {
      core_->spills.push_back(spill);
      spec.init = [weak, spill, spill_offset](float* data, size_t n) {
        Status s = spill->Read(spill_offset, data, n);
        if (!s.ok()) Fail(weak, s, data, n);
      };
    } else {
      const SourceType type = ParseSourceType(dtype);
      if (ptr == 0) Throw(Status::InvalidArgument("parameter '" + name + "': no source memory"));
      spec.init = [type, ptr](float* data, size_t n) {
        ToF32(reinterpret_cast<const void*>(ptr), type, data, n);
      };
    }
    const ParamId id = Take(engine().RegisterParameter(spec));
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->views.resize(id + 1, 0);
    core_->pending.resize(id + 1, 0);
    return id;
  }

  void FinishRegistration(bool resume) {
    Status s;
    {
      py::gil_scoped_release nogil;
      s = resume ? engine().ResumeFromStore() : engine().FinishRegistration();
    }
    core_->spills.clear();
    if (s.ok() && !core_->init_error.ok()) {
      failed_ = Status::FailedPrecondition("the engine could not read the initial values (" +
                                           core_->init_error.message() + "); recreate it");
      Throw(failed_);
    }
    Check(s);
  }

  // Acquires the parameters and returns one DLPack capsule per parameter: a 1-D tensor of
  // numel elements over the engine's memory.
  std::vector<py::capsule> Acquire(const std::vector<ParamId>& ids, bool inference) {
    CheckUsable();
    Drain();
    std::vector<void*> got = WithoutGil([&] {
      return engine().Acquire(ids, inference ? AcquireMode::kInference : AcquireMode::kTraining);
    });
    std::vector<py::capsule> out;
    out.reserve(ids.size());
    const bool bf16 = engine().config().bf16;
    for (size_t i = 0; i < ids.size(); ++i) {
      auto* lease = new Lease;
      lease->core = core_;
      lease->id = ids[i];
      lease->shape[0] = static_cast<int64_t>(engine().param(ids[i]).numel);
      DLTensor& t = lease->managed.dl_tensor;
      t.data = got[i];
      t.device = {core_->dl_device_type, core_->dl_device_id};
      t.ndim = 1;
      t.dtype = bf16 ? DLDataType{4, 16, 1} : DLDataType{2, 32, 1};
      t.shape = lease->shape;
      t.strides = nullptr;
      t.byte_offset = 0;
      lease->managed.manager_ctx = lease;
      lease->managed.deleter = DeleteLease;
      {
        std::lock_guard<std::mutex> lock(core_->mu);
        ++core_->views[ids[i]];
      }
      out.emplace_back(&lease->managed, "dltensor", &CapsuleDestructor);
    }
    return out;
  }

  // The Python side is done with one acquisition of each parameter; the engine's Release
  // follows once torch holds no tensor over it.
  void Release(const std::vector<ParamId>& ids) {
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      for (ParamId id : ids) {
        if (id >= core_->pending.size()) Throw(Status::InvalidArgument("unknown parameter id"));
        ++core_->pending[id];
      }
    }
    Drain();
  }

  // Issues the Releases whose parameters torch no longer views.
  void Drain() {
    std::vector<ParamId> ready;
    {
      std::lock_guard<std::mutex> lock(core_->mu);
      for (ParamId id = 0; id < core_->pending.size(); ++id) {
        if (core_->pending[id] == 0 || core_->views[id] != 0) continue;
        for (int64_t k = 0; k < core_->pending[id]; ++k) ready.push_back(id);
        core_->pending[id] = 0;
      }
    }
    if (ready.empty()) return;
    WithoutGil([&] { return engine().Release(ready); });
  }

  // Parameters torch still views: {id: tensors}.
  std::unordered_map<ParamId, int64_t> Views() {
    std::unordered_map<ParamId, int64_t> out;
    std::lock_guard<std::mutex> lock(core_->mu);
    for (ParamId id = 0; id < core_->views.size(); ++id) {
      if (core_->views[id] != 0) out[id] = core_->views[id];
    }
    return out;
  }
  std::unordered_map<ParamId, int64_t> PendingReleases() {
    std::unordered_map<ParamId, int64_t> out;
    std::lock_guard<std::mutex> lock(core_->mu);
    for (ParamId id = 0; id < core_->pending.size(); ++id) {
      if (core_->pending[id] != 0) out[id] = core_->pending[id];
    }
    return out;
  }

  void ReduceGradient(ParamId id, uintptr_t grad) {
    CheckUsable();
    if (grad == 0) Throw(Status::InvalidArgument("reduce_gradient: null gradient"));
    WithoutGil([&] { return engine().ReduceGradient(id, reinterpret_cast<const float*>(grad)); });
  }

  py::dict Step() {
    CheckUsable();
    Drain();
    StepStats st = WithoutGil([&] { return engine().Step(); });
    py::dict d;
    d["step"] = st.step;
    d["optimizer_ran"] = st.optimizer_ran;
    d["step_seconds"] = st.step_seconds;
    d["nvme_read_bytes"] = st.nvme_read_bytes;
    d["nvme_write_bytes"] = st.nvme_write_bytes;
    d["h2d_bytes"] = st.h2d_bytes;
    d["d2h_bytes"] = st.d2h_bytes;
    d["nvme_busy_seconds"] = st.nvme_busy_seconds;
    d["copy_busy_seconds"] = st.copy_busy_seconds;
    d["optimizer_busy_seconds"] = st.optimizer_busy_seconds;
    d["acquire_wait_seconds"] = st.acquire_wait_seconds;
    d["optimizer_wait_seconds"] = st.optimizer_wait_seconds;
    d["peak_device_bytes"] = st.peak_device_bytes;
    d["peak_pinned_bytes"] = st.peak_pinned_bytes;
    d["nvme_bytes"] = st.nvme_bytes;
    d["overlap_efficiency"] = st.overlap_efficiency;
    d["grad_norm"] = st.grad_norm;
    d["prefetch_hits"] = st.prefetch_hits;
    d["prefetch_misses"] = st.prefetch_misses;
    d["trace_valid"] = st.trace_valid;
    return d;
  }

  void SaveCheckpoint(const std::string& dir, const std::string& user_data) {
    CheckUsable();
    Drain();
    WithoutGil([&] { return engine().SaveCheckpoint(dir, user_data); });
  }
  py::bytes LoadCheckpoint(const std::string& dir) {
    CheckUsable();
    Drain();
    std::string user_data;
    WithoutGil([&] { return engine().LoadCheckpoint(dir, &user_data); });
    return py::bytes(user_data);
  }
  void GatherMaster(ParamId id, uintptr_t out) {
    CheckUsable();
    if (out == 0) Throw(Status::InvalidArgument("gather_master: null output"));
    WithoutGil([&] { return engine().GatherMasterParameter(id, reinterpret_cast<float*>(out)); });
  }
  void LoadSafetensors(const safetensors::Checkpoint& ckpt,
                       const std::vector<std::pair<ParamId, std::string>>& mapping,
                       bool allow_reshape) {
    CheckUsable();
    Drain();
    WithoutGil(
        [&] { return safetensors::LoadIntoEngine(&engine(), ckpt, mapping, allow_reshape); });
  }
  // `extra`: (name, safetensors dtype, shape, pointer) of host tensors written after the
  // parameters as they are (the model's buffers); the caller keeps them alive.
  void SaveSafetensors(
      const std::string& dir, const std::vector<std::pair<ParamId, std::string>>& mapping,
      uint64_t shard_bytes, const std::string& dtype,
      const std::map<std::string, std::string>& metadata,
      const std::vector<std::tuple<std::string, std::string, std::vector<int64_t>, uintptr_t>>&
          extra) {
    CheckUsable();
    Drain();
    safetensors::DType d = safetensors::DType::kF32;
    if (dtype == "BF16") {
      d = safetensors::DType::kBF16;
    } else if (dtype != "F32") {
      Throw(Status::InvalidArgument("export dtype " + dtype + ": F32 or BF16"));
    }
    std::vector<safetensors::HostTensor> host;
    for (const auto& [name, type, shape, ptr] : extra) {
      safetensors::HostTensor t;
      t.name = name;
      t.dtype = ParseDType(type);
      t.shape = shape;
      t.data = reinterpret_cast<const void*>(ptr);
      host.push_back(std::move(t));
    }
    WithoutGil([&] {
      return safetensors::SaveFromEngine(&engine(), mapping, dir, shard_bytes, d, metadata, host);
    });
  }

  // Replaces the values of parameters `ids` between optimizer steps (Engine::SetParameterValues):
  // `fill(id, ptr)` writes the parameter's numel fp32 values at ptr. A Python exception in
  // `fill` is raised again here; the caller checks its sources first (a fill failing after a
  // sub-group was written stops the engine, as the C++ contract says).
  void SetParameterValues(const std::vector<ParamId>& ids, const py::function& fill) {
    CheckUsable();
    Drain();
    std::unique_ptr<py::error_already_set> raised;
    Status s;
    {
      py::gil_scoped_release nogil;
      s = engine().SetParameterValues(ids, [&](ParamId id, float* data) -> Status {
        py::gil_scoped_acquire gil;
        try {
          fill(id, reinterpret_cast<uintptr_t>(data));
        } catch (py::error_already_set& e) {
          if (!raised) raised = std::make_unique<py::error_already_set>(std::move(e));
          return Status::InvalidArgument("the Python values could not be produced");
        }
        return Status::OK();
      });
    }
    if (raised && !s.ok() && failed_.ok()) {
      // Nothing changed unless the engine says it stopped (then the next call reports it).
      raised->restore();
      throw py::error_already_set();
    }
    Check(s);
  }

  py::dict Param(ParamId id) {
    if (id >= engine().num_params()) Throw(Status::InvalidArgument("unknown parameter id"));
    const ParamInfo& p = engine().param(id);
    py::dict d;
    d["name"] = p.name;
    d["shape"] = p.shape;
    d["numel"] = p.numel;
    d["partition_numel"] = p.partition_numel;
    d["sub_group"] = p.sub_group;
    d["persistent"] = p.persistent;
    d["trainable"] = p.trainable;
    return d;
  }

 private:
  static void Fail(const std::weak_ptr<Core>& weak, const Status& s, float* data, size_t n) {
    for (size_t i = 0; i < n; ++i) data[i] = std::nanf("");
    if (std::shared_ptr<Core> core = weak.lock()) {
      if (core->init_error.ok()) core->init_error = s;
    }
  }
  void CheckUsable() {
    if (!failed_.ok()) Throw(failed_);
  }

  std::shared_ptr<Core> core_;
  std::vector<std::string> warnings_;
  Status failed_;
};

// ---- Saved activations on NVMe (zinf.checkpoint with nvme_checkpointing) ----------------------

// A pinned arena (the staging budget) and a swap store of its own in a folder the caller
// made: zinf.checkpoint writes each segment's boundary activations through it in forward and
// reads them back ahead of use in backward. Blocks of the arena reach torch as DLPack uint8
// tensors; a block returns to the arena when torch frees the tensor. Thread-safe (the store
// and the arena are).
class ActivationSwap {
 public:
  ActivationSwap(const std::vector<std::string>& paths, uint64_t buffer_bytes,
                 const std::string& backend, uint32_t block_size, uint32_t queue_depth) {
    PinnedArenaOptions ao;
    ao.bytes = buffer_bytes;
    arena_ = std::shared_ptr<PinnedArena>(Take(PinnedArena::Create(ao)));
    SwapStoreOptions so;
    so.paths = paths;
    so.remove_on_close = true;
    so.backend = Take(ParseIoBackendKind(backend));
    so.backend_options.queue_depth = queue_depth;
    so.block_size = block_size;
    so.chunk_size = std::max<uint64_t>(RoundUp(block_size, 4096), 4096);
    so.registered_regions = {arena_->region()};
    store_ = Take(SwapStore::Open(so));
  }
  ~ActivationSwap() {
    if (store_) {
      Status s = store_->Close();
      if (!s.ok()) LogWarning("closing the activation swap store: " + s.ToString());
    }
  }
  // Closes the store (its swap files are removed); later calls are refused.
  void Close() {
    std::unique_ptr<SwapStore> store = std::move(store_);
    if (store) WithoutGil([&] { return store->Close(); });
  }

  // A block of at least `bytes` (rounded up to the alignment) as a capsule, or None when the
  // arena has no room now (the caller waits for a transfer and asks again).
  py::object Buffer(uint64_t bytes) {
    Result<PinnedBuffer> got = arena_->Allocate(std::max<uint64_t>(bytes, 1));
    if (!got.ok()) {
      if (got.status().code() == StatusCode::kResourceExhausted) return py::none();
      Throw(got.status());
    }
    auto* block = new Block;
    block->arena = arena_;
    block->buffer = std::move(got).value();
    block->shape[0] = static_cast<int64_t>(block->buffer.capacity());
    DLTensor& t = block->managed.dl_tensor;
    t.data = block->buffer.data();
    t.device = {1, 0};
    t.ndim = 1;
    t.dtype = DLDataType{1, 8, 1};  // kDLUInt
    t.shape = block->shape;
    t.strides = nullptr;
    t.byte_offset = 0;
    block->managed.manager_ctx = block;
    block->managed.deleter = [](DLManagedTensor* self) {
      delete static_cast<Block*>(self->manager_ctx);  // the block returns to the arena
    };
    return py::capsule(&block->managed, "dltensor", &CapsuleDestructor);
  }
  Ticket Write(const std::string& key, uintptr_t ptr, uint64_t size, uint64_t capacity) {
    Open();
    return WithoutGil(
        [&] { return store_->Write(key, reinterpret_cast<const void*>(ptr), size, capacity); });
  }
  Ticket Read(const std::string& key, uintptr_t ptr, uint64_t capacity, bool urgent) {
    Open();
    return WithoutGil(
        [&] { return store_->Read(key, reinterpret_cast<void*>(ptr), capacity, urgent); });
  }
  void Wait(Ticket ticket) {
    Open();
    WithoutGil([&] { return store_->Wait(ticket); });
  }
  bool Done(Ticket ticket) {
    Open();
    return store_->Done(ticket);
  }
  void Remove(const std::string& key) {
    Open();
    Check(store_->Remove(key));
  }
  uint64_t alignment() {
    Open();
    return store_->alignment();
  }
  uint64_t capacity() const { return arena_->capacity(); }
  uint64_t used() const { return arena_->used(); }
  uint64_t peak_used() const { return arena_->peak_used(); }
  py::dict Stats() {
    Open();
    const SwapStoreStats st = store_->stats();
    py::dict d;
    d["bytes_written"] = st.bytes_written;
    d["bytes_read"] = st.bytes_read;
    d["file_bytes"] = st.file_bytes;
    d["tensors"] = st.tensors;
    return d;
  }

 private:
  void Open() const {
    if (!store_) Throw(Status::FailedPrecondition("the activation swap store was closed"));
  }
  struct Block {
    std::shared_ptr<PinnedArena> arena;  // declared first: outlives the buffer
    PinnedBuffer buffer;
    int64_t shape[1] = {0};
    DLManagedTensor managed{};
  };
  std::shared_ptr<PinnedArena> arena_;
  std::unique_ptr<SwapStore> store_;
};

// A safetensors dtype by its name in the format ("F32", "I64", ...).
safetensors::DType ParseDType(const std::string& name) {
  using safetensors::DType;
  for (DType d : {DType::kBool, DType::kU8, DType::kI8, DType::kF8E5M2, DType::kF8E4M3, DType::kI16,
                  DType::kU16, DType::kF16, DType::kBF16, DType::kI32, DType::kU32, DType::kF32,
                  DType::kF64, DType::kI64, DType::kU64}) {
    if (name == safetensors::DTypeName(d)) return d;
  }
  Throw(Status::InvalidArgument("safetensors dtype '" + name + "' is not one of the format's"));
}

py::dict InspectCheckpoint(const safetensors::Checkpoint& ckpt) {
  py::dict out;
  for (const auto& [name, t] : ckpt.tensors) {
    out[py::str(name)] =
        py::make_tuple(safetensors::DTypeName(t.dtype), t.shape, ckpt.files[t.file].path);
  }
  return out;
}

}  // namespace
}  // namespace zinf::python

PYBIND11_MODULE(_zinf, m) {
  using namespace zinf;
  using namespace zinf::python;
  m.doc() = "zinf's engine (the C++ core of the zinf package; see zinf/__init__.py)";

  static py::exception<ZinfException> error(m, "ZinfError", PyExc_RuntimeError);
  g_error = error.ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ZinfException& e) {
      py::object err = py::reinterpret_borrow<py::object>(g_error)(e.status.message());
      err.attr("code") = StatusCodeName(e.status.code());
      err.attr("errno") = e.status.sys_errno();
      PyErr_SetObject(g_error, err.ptr());
    }
  });

  m.def("cuda_device_count", &CudaDeviceCount,
        "CUDA devices zinf can use (0 when built without CUDA or without a driver)");
  m.def("cpu_isa", [] { return std::string(CpuIsaName(BestCpuIsa())); });
  m.def("physical_memory", [] {
    return static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
           static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  });
  m.def(
      "parse_config",
      [](const std::string& json) {
        std::vector<std::string> warnings;
        EngineConfig c = Take(ParseEngineConfig(json, &warnings));
        py::dict d;
        d["warnings"] = warnings;
        d["param_tier"] = TierName(c.offload_param.tier);
        d["optimizer_tier"] = TierName(c.offload_optimizer.tier);
        std::vector<std::string> paths = c.offload_param.nvme_paths;
        for (const std::string& p : c.offload_optimizer.nvme_paths) {
          if (std::find(paths.begin(), paths.end(), p) == paths.end()) paths.push_back(p);
        }
        d["nvme_paths"] = paths;
        d["bf16"] = c.bf16;
        d["lr"] = c.optimizer.lr;
        d["optimizer_type"] = std::string(c.optimizer.type == OptimizerType::kAdam      ? "Adam"
                                          : c.optimizer.type == OptimizerType::kAdamW   ? "AdamW"
                                          : c.optimizer.type == OptimizerType::kAdagrad ? "Adagrad"
                                                                                        : "Lion");
        d["betas"] = py::make_tuple(c.optimizer.beta1, c.optimizer.beta2);
        d["eps"] = c.optimizer.eps;
        d["weight_decay"] = c.optimizer.weight_decay;
        d["train_micro_batch_size_per_gpu"] = c.train_micro_batch_size_per_gpu;
        d["train_batch_size"] = c.train_batch_size;
        d["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
        d["gradient_clipping"] = c.gradient_clipping;
        d["durable"] = c.durable;
        d["delayed_update"] = c.delayed_update;
        d["optimizer_state_dtype"] = StateTypeName(c.optimizer_state_type);
        d["device_budget_bytes"] = c.device_budget_bytes;
        d["pinned_budget_bytes"] = c.pinned_budget_bytes;
        return d;
      },
      py::arg("json"), "parses a config (InvalidArgument naming the key path); a summary dict");
  m.def("parse_byte_size", [](const std::string& text, const std::string& what) {
    return Take(ParseByteSize(text, what));
  });

  m.def(
      "pinned_bytes_needed",
      [](const std::string& json,
         const std::vector<std::tuple<std::string, std::vector<int64_t>, bool>>& params,
         bool device_is_host) {
        std::vector<std::string> warnings;
        EngineConfig c = Take(ParseEngineConfig(json, &warnings));
        std::vector<ParamSpec> specs;
        specs.reserve(params.size());
        for (const auto& [name, shape, trainable] : params) {
          ParamSpec spec;
          spec.name = name;
          spec.shape = shape;
          spec.trainable = trainable;
          specs.push_back(std::move(spec));
        }
        return Take(PinnedBytesNeeded(c, specs, 1, device_is_host));
      },
      py::arg("json"), py::arg("params"), py::arg("device_is_host"),
      "the pinned host bytes an engine with this config needs for [(name, shape, trainable)]");
  m.def("log_info", [](const std::string& line) { LogInfo(line); });
  m.def("log_warning", [](const std::string& line) { LogWarning(line); });
  m.def("format_bytes", [](uint64_t n) { return FormatBytes(n); });

  py::class_<ActivationSwap, std::shared_ptr<ActivationSwap>>(m, "ActivationSwap")
      .def(py::init<const std::vector<std::string>&, uint64_t, const std::string&, uint32_t,
                    uint32_t>(),
           py::arg("paths"), py::arg("buffer_bytes"), py::arg("backend") = "io_uring",
           py::arg("block_size") = 1 << 20, py::arg("queue_depth") = 32)
      .def("buffer", &ActivationSwap::Buffer, py::arg("bytes"))
      .def("write", &ActivationSwap::Write, py::arg("key"), py::arg("ptr"), py::arg("size"),
           py::arg("capacity"))
      .def("read", &ActivationSwap::Read, py::arg("key"), py::arg("ptr"), py::arg("capacity"),
           py::arg("urgent") = false)
      .def("wait", &ActivationSwap::Wait, py::arg("ticket"))
      .def("done", &ActivationSwap::Done, py::arg("ticket"))
      .def("remove", &ActivationSwap::Remove, py::arg("key"))
      .def("stats", &ActivationSwap::Stats)
      .def("close", &ActivationSwap::Close)
      .def_property_readonly("alignment", &ActivationSwap::alignment)
      .def_property_readonly("capacity", &ActivationSwap::capacity)
      .def_property_readonly("used", &ActivationSwap::used)
      .def_property_readonly("peak_used", &ActivationSwap::peak_used);

  py::class_<Spill, std::shared_ptr<Spill>>(m, "Spill")
      .def(py::init<const std::string&>(), py::arg("dir"))
      .def("append", &Spill::Append, py::arg("ptr"), py::arg("dtype"), py::arg("numel"),
           "appends numel values at ptr (float32, bfloat16 or float16) as fp32; returns the offset")
      .def("read", [](const Spill& s, uint64_t offset, uintptr_t out,
                      size_t n) { Check(s.Read(offset, reinterpret_cast<float*>(out), n)); })
      .def_property_readonly("bytes", &Spill::bytes);

  py::class_<safetensors::Checkpoint, std::shared_ptr<safetensors::Checkpoint>>(m, "Safetensors")
      .def(py::init([](const std::string& path) {
             return std::make_shared<safetensors::Checkpoint>(
                 WithoutGil([&] { return safetensors::OpenCheckpoint(path); }));
           }),
           py::arg("path"))
      .def("tensors", &InspectCheckpoint, "{name: (dtype, shape, file)}")
      .def("read_f32",
           [](const safetensors::Checkpoint& c, const std::string& name, uintptr_t out) {
             auto it = c.tensors.find(name);
             if (it == c.tensors.end()) Throw(Status::NotFound("no tensor '" + name + "'"));
             Check(safetensors::ReadTensorF32(c, it->second, reinterpret_cast<float*>(out)));
           })
      .def(
          "location",
          [](const safetensors::Checkpoint& c, const std::string& name) {
            auto it = c.tensors.find(name);
            if (it == c.tensors.end()) Throw(Status::NotFound("no tensor '" + name + "'"));
            return py::make_tuple(c.files[it->second.file].path, it->second.offset,
                                  it->second.bytes);
          },
          "(file, offset, bytes) of a tensor's data (checked against its file's size)");

  py::class_<PyEngine>(m, "Engine")
      .def(py::init<const std::string&, const std::string&, int, bool, uintptr_t, uint64_t>(),
           py::arg("config_json"), py::arg("device") = "cpu", py::arg("device_index") = 0,
           py::arg("use_stream") = false, py::arg("cuda_stream") = 0, py::arg("device_memory") = 0)
      .def_property_readonly("warnings", &PyEngine::warnings)
      .def("register", &PyEngine::Register, py::arg("name"), py::arg("shape"), py::arg("trainable"),
           py::arg("ptr") = 0, py::arg("dtype") = "float32", py::arg("spill") = nullptr,
           py::arg("spill_offset") = 0)
      .def("finish_registration", &PyEngine::FinishRegistration, py::arg("resume") = false)
      .def("acquire", &PyEngine::Acquire, py::arg("ids"), py::arg("inference") = false)
      .def("release", &PyEngine::Release, py::arg("ids"))
      .def("drain", &PyEngine::Drain)
      .def("views", &PyEngine::Views)
      .def("pending_releases", &PyEngine::PendingReleases)
      .def("reduce_gradient", &PyEngine::ReduceGradient, py::arg("id"), py::arg("grad_ptr"))
      .def("step", &PyEngine::Step)
      .def("save_checkpoint", &PyEngine::SaveCheckpoint, py::arg("dir"), py::arg("user_data"))
      .def("load_checkpoint", &PyEngine::LoadCheckpoint, py::arg("dir"))
      .def("gather_master", &PyEngine::GatherMaster, py::arg("id"), py::arg("out_ptr"))
      .def("load_safetensors", &PyEngine::LoadSafetensors, py::arg("checkpoint"),
           py::arg("mapping"), py::arg("allow_reshape") = false)
      .def("save_safetensors", &PyEngine::SaveSafetensors, py::arg("dir"), py::arg("mapping"),
           py::arg("shard_bytes"), py::arg("dtype"), py::arg("metadata"),
           py::arg("extra") =
               std::vector<std::tuple<std::string, std::string, std::vector<int64_t>, uintptr_t>>{})
      .def("set_parameter_values", &PyEngine::SetParameterValues, py::arg("ids"), py::arg("fill"))
      .def("set_lr", [](PyEngine& e, float lr) { Check(e.engine().SetLearningRate(lr)); })
      .def_property_readonly("global_step", [](PyEngine& e) { return e.engine().global_step(); })
      .def("param_updates",
           [](PyEngine& e, ParamId id) {
             if (id >= e.engine().num_params())
               Throw(Status::InvalidArgument("unknown parameter id"));
             return e.engine().param_updates(id);
           })
      .def_property_readonly("num_params", [](PyEngine& e) { return e.engine().num_params(); })
      .def("param", &PyEngine::Param)
      .def_property_readonly("bf16", [](PyEngine& e) { return e.engine().config().bf16; })
      .def_property_readonly("gradient_accumulation_steps", [](PyEngine& e) {
        return e.engine().config().gradient_accumulation_steps;
      });
}
