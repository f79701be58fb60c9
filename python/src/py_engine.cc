#include "python/src/py_engine.h"

#include <pybind11/stl.h>

#include <cmath>
#include <utility>

#include "python/src/py_store.h"
#include "zinf/config.h"
#include "zinf/cuda.h"
#include "zinf/log.h"
#include "zinf/runtime.h"

namespace zinf::python {
namespace {

// A capsule handed to torch: keeps the engine alive and counts as a view of its parameter.
struct Lease {
  std::shared_ptr<Core> core;
  ParamId id = 0;
  int64_t shape[1] = {0};
  DLManagedTensor managed{};
};

void DeleteLease(DLManagedTensor* t) noexcept {
  Lease* lease = static_cast<Lease*>(t->manager_ctx);
  Status s = lease->core->views.DropView(lease->id);
  // A deleter cannot raise; a miscount is this module's bug, reported where it happened (a
  // failure to build the message leaves only the report out).
  if (!s.ok()) {
    try {
      LogWarning("zinf: " + s.ToString());
    } catch (...) {
    }
  }
  delete lease;  // may destroy the engine when it was the last reference
}

// The engine's init callback cannot fail: a source that cannot be read fills NaN and records
// the first error, which FinishRegistration raises.
void FailInit(const std::weak_ptr<Core>& weak, const Status& s, float* data, size_t n) {
  for (size_t i = 0; i < n; ++i) data[i] = std::nanf("");
  if (std::shared_ptr<Core> core = weak.lock()) {
    MutexLock lock(&core->init_mu);
    if (core->init_error.ok()) core->init_error = s;
  }
}

}  // namespace

Core::~Core() {
  engine.reset();
  comms.clear();
  device.reset();
}

PyEngine::PyEngine(const std::string& config_json, const std::string& device, int device_index,
                   bool use_stream, uintptr_t cuda_stream, uint64_t device_memory,
                   const py::object& group_object) {
  const ProcessGroupOptions group = GroupFromPython(group_object);
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
    Runtime rank = Take(NewHostRuntime(ho, group));
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
    Runtime rank = Take(NewCudaRuntime(co, group));  // its NCCL group meets in group.store
    core_->device = std::move(rank.device);
    core_->comms.push_back(std::move(rank.comm));
    core_->dl_device_type = 2;
    core_->dl_device_id = device_index;
  } else {
    Throw(Status::InvalidArgument("device '" + device + "': cpu or cuda"));
  }
  core_->engine = Take(Engine::Create(config, core_->device.get(), core_->comms[0].get()));
}

ParamId PyEngine::Register(const std::string& name, const std::vector<int64_t>& shape,
                           bool trainable, uintptr_t ptr, const std::string& dtype,
                           std::shared_ptr<SpillFile> spill, uint64_t spill_offset, size_t group) {
  ParamSpec spec;
  spec.name = name;
  spec.param_group = group;
  spec.shape = shape;
  spec.trainable = trainable;
  std::weak_ptr<Core> weak = core_;
  if (spill) {
    core_->spills.push_back(spill);
    spec.init = [weak, spill, spill_offset](float* data, size_t n) {
      Status s = spill->Read(spill_offset, data, n);
      if (!s.ok()) {
        FailInit(weak, s, data, n);
        return;
      }
      // The engine initialises each parameter once: its spilled values can go (the disk then
      // holds the larger of the spill and the stores, not both).
      spill->Release(spill_offset, n);
    };
  } else {
    const HostValueType type = Take(ParseHostValueType(dtype));
    if (ptr == 0) Throw(Status::InvalidArgument("parameter '" + name + "': no source memory"));
    spec.init = [type, ptr](float* data, size_t n) {
      HostValuesToF32(reinterpret_cast<const void*>(ptr), type, data, n);
    };
  }
  const ParamId id = Take(engine().RegisterParameter(spec));
  core_->views.Resize(id + 1);
  return id;
}

void PyEngine::FinishRegistration(bool resume) {
  Status s;
  {
    py::gil_scoped_release nogil;
    s = resume ? engine().ResumeFromStore() : engine().FinishRegistration();
  }
  core_->spills.clear();
  Status init_error;
  {
    MutexLock lock(&core_->init_mu);
    init_error = core_->init_error;
  }
  if (s.ok() && !init_error.ok()) {
    failed_ = Status::FailedPrecondition("the engine could not read the initial values (" +
                                         init_error.message() + "); recreate it");
    Throw(failed_);
  }
  Check(s);
}

std::vector<py::capsule> PyEngine::Acquire(const std::vector<ParamId>& ids, bool inference) {
  CheckUsable();
  Drain();
  std::vector<void*> got = WithoutGil([&] {
    return engine().Acquire(ids, inference ? AcquireMode::kInference : AcquireMode::kTraining);
  });
  std::vector<py::capsule> out;
  // bf16: kDLBfloat; fp16 and fp32: kDLFloat.
  const EngineConfig& c = engine().config();
  const DLDataType dtype = c.bf16           ? DLDataType{4, 16, 1}
                           : c.fp16.enabled ? DLDataType{2, 16, 1}
                                            : DLDataType{2, 32, 1};
  const DLDevice where{core_->dl_device_type, core_->dl_device_id};
  try {
    out.reserve(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      auto lease = std::make_unique<Lease>();
      lease->core = core_;
      lease->id = ids[i];
      lease->shape[0] = static_cast<int64_t>(engine().param(ids[i]).numel);
      lease->managed.manager_ctx = lease.get();
      lease->managed.deleter = DeleteLease;
      // The id was acquired, so the ledger knows it (Register sized it).
      Check(core_->views.AddView(ids[i]));
      py::capsule capsule;
      try {
        capsule = MakeCapsule(&lease->managed, got[i], where, dtype, lease->shape);
      } catch (...) {
        // No capsule owns the lease: its view is dropped here, the lease freed by its
        // unique_ptr. Discarding the Status is safe: the count was just raised, so the drop
        // cannot fail.
        (void)core_->views.DropView(ids[i]);  // cannot fail: see above
        throw;
      }
      lease.release();  // the capsule's deleter owns it now
      out.push_back(std::move(capsule));
    }
  } catch (...) {
    // Every id was acquired: the capsules made so far are freed (their views dropped) and each
    // id is owed its Release, so a failure here leaves nothing held. A failing Release stops
    // the engine, which the next call reports; the error raised is the one that got here.
    out.clear();
    if (core_->views.OweRelease(ids).ok()) {
      try {
        Drain();
      } catch (const ZinfException&) {
      }
    }
    throw;
  }
  return out;
}

void PyEngine::Release(const std::vector<ParamId>& ids) {
  Check(core_->views.OweRelease(ids));
  Drain();
}

void PyEngine::Drain() {
  std::vector<ParamId> due = core_->views.TakeDue();
  if (due.empty()) return;
  WithoutGil([&] { return engine().Release(due); });
}

void PyEngine::ReduceGradient(ParamId id, uintptr_t grad) {
  CheckUsable();
  if (grad == 0) Throw(Status::InvalidArgument("reduce_gradient: null gradient"));
  WithoutGil([&] { return engine().ReduceGradient(id, reinterpret_cast<const float*>(grad)); });
}

void PyEngine::ReduceGradientOf(ParamId id, uintptr_t grad, int micro_batch) {
  CheckUsable();
  if (grad == 0) Throw(Status::InvalidArgument("reduce_gradient_of: null gradient"));
  WithoutGil([&] {
    return engine().ReduceGradient(id, reinterpret_cast<const float*>(grad), micro_batch);
  });
}

py::dict PyEngine::Step() {
  CheckUsable();
  Drain();
  StepStats st = WithoutGil([&] { return engine().Step(); });
  py::dict d;
  VisitStepStats(st, [&](const char* name, auto value) { d[name] = value; });
  return d;
}

void PyEngine::SaveCheckpoint(const std::string& dir, const std::string& user_data) {
  CheckUsable();
  Drain();
  WithoutGil([&] { return engine().SaveCheckpoint(dir, user_data); });
}

void PyEngine::OffloadStates(uint32_t include, const std::string& device, bool pin_memory,
                             bool non_blocking) {
  CheckUsable();
  if (device != "cpu" && device != "nvme") {
    Check(Status::InvalidArgument("offload_states: device must be \"cpu\" or \"nvme\", got \"" +
                                  device + "\""));
  }
  Drain();
  Engine::OffloadStatesOptions o;
  o.include = include;
  o.device = device == "cpu" ? Tier::kCpu : Tier::kNvme;
  o.pin_memory = pin_memory;
  o.non_blocking = non_blocking;
  WithoutGil([&] { return engine().OffloadStates(o); });
}

void PyEngine::ReloadStates(bool non_blocking) {
  CheckUsable();
  WithoutGil([&] { return engine().ReloadStates(non_blocking); });
}

py::bytes PyEngine::LoadCheckpoint(const std::string& dir) {
  CheckUsable();
  Drain();
  std::string user_data;
  WithoutGil([&] { return engine().LoadCheckpoint(dir, &user_data); });
  return py::bytes(user_data);
}

void PyEngine::GatherMaster(ParamId id, uintptr_t out) {
  CheckUsable();
  if (out == 0) Throw(Status::InvalidArgument("gather_master: null output"));
  WithoutGil([&] { return engine().GatherMasterParameter(id, reinterpret_cast<float*>(out)); });
}

void PyEngine::CompareAcrossRanks(const std::string& what, const std::string& text,
                                  const std::string& remedy) {
  CheckUsable();
  WithoutGil([&] { return engine().CompareAcrossRanks(what, text, remedy); });
}

void PyEngine::LoadSafetensors(const safetensors::Checkpoint& ckpt,
                               const std::vector<std::pair<ParamId, std::string>>& mapping,
                               bool allow_reshape) {
  CheckUsable();
  Drain();
  WithoutGil([&] { return safetensors::LoadIntoEngine(&engine(), ckpt, mapping, allow_reshape); });
}

void PyEngine::SaveSafetensors(const std::string& dir,
                               const std::vector<std::pair<ParamId, std::string>>& mapping,
                               uint64_t shard_bytes, const std::string& dtype,
                               const std::map<std::string, std::string>& metadata,
                               const std::vector<HostTensorSpec>& extra) {
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
    t.dtype = ParseSafetensorsDType(type);
    t.shape = shape;
    t.data = reinterpret_cast<const void*>(ptr);
    host.push_back(std::move(t));
  }
  WithoutGil([&] {
    return safetensors::SaveFromEngine(&engine(), mapping, dir, shard_bytes, d, metadata, host);
  });
}

void PyEngine::SetParameterValues(const std::vector<ParamId>& ids, const py::function& fill) {
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

py::dict PyEngine::Param(ParamId id) {
  CheckParamId(id);
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

void PyEngine::CheckParamId(ParamId id) {
  if (id >= engine().num_params()) Throw(Status::InvalidArgument("unknown parameter id"));
}

void PyEngine::CheckUsable() const {
  if (!failed_.ok()) Throw(failed_);
}

safetensors::DType ParseSafetensorsDType(const std::string& name) {
  std::optional<safetensors::DType> d = safetensors::DTypeByName(name);
  if (!d)
    Throw(Status::InvalidArgument("safetensors dtype '" + name + "' is not one of the format's"));
  return *d;
}

}  // namespace zinf::python
