// zinf._zinf.Engine: an Engine on a host or CUDA device whose acquired parameters reach torch
// as DLPack capsules. The one rule this layer adds (ViewLedger): an Engine::Release is issued
// only once torch holds no tensor over the parameter's memory; release() records that the
// Python side is done, and the engine's Release follows when the views are gone (at the next
// call into this module).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/thread_annotations.h"
#include "interop/spill_file.h"
#include "interop/view_ledger.h"
#include "python/src/binding_util.h"
#include "zinf/comm.h"
#include "zinf/device.h"
#include "zinf/engine.h"
#include "zinf/safetensors_engine.h"

namespace zinf::python {

// Shared by the Python Engine object and by every capsule handed to torch: a tensor torch
// still holds keeps the engine (and so its memory) alive.
struct Core {
  std::unique_ptr<Device> device;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::unique_ptr<Engine> engine;  // destroyed first (declared last of the three)
  int dl_device_type = 1;
  int dl_device_id = 0;
  ViewLedger views;

  // Registration sources, dropped once registration ends.
  std::vector<std::shared_ptr<SpillFile>> spills;
  // The first failing source: the engine's init callback cannot fail, and runs on the engine's
  // threads.
  Mutex init_mu;
  Status init_error GUARDED_BY(init_mu);

  ~Core();
};

class PyEngine {
 public:
  // `group`: None for one rank, else the dict GroupFromPython reads (this process's rank of a
  // group of processes; the engine's collectives go over gloo on cpu, NCCL on cuda).
  PyEngine(const std::string& config_json, const std::string& device, int device_index,
           bool use_stream, uintptr_t cuda_stream, uint64_t device_memory, const py::object& group);

  const std::vector<std::string>& warnings() const { return warnings_; }
  Engine& engine() { return *core_->engine; }
  // The engine's device memory: its budget, the bytes in use and the peak.
  DeviceMemoryInfo device_memory() const { return core_->device->MemoryInfo(); }

  // Registers a parameter whose initial values are read, when registration ends, from host
  // memory at `ptr` (the caller keeps it alive until then) or from a spill file; `group`:
  // its parameter group (ParamSpec::param_group).
  ParamId Register(const std::string& name, const std::vector<int64_t>& shape, bool trainable,
                   uintptr_t ptr, const std::string& dtype, std::shared_ptr<SpillFile> spill,
                   uint64_t spill_offset, size_t group);
  void FinishRegistration(bool resume);

  // Acquires the parameters and returns one DLPack capsule per parameter: a 1-D tensor of
  // numel elements over the engine's memory.
  std::vector<py::capsule> Acquire(const std::vector<ParamId>& ids, bool inference);
  // The Python side is done with one acquisition of each parameter; the engine's Release
  // follows once torch holds no tensor over it.
  void Release(const std::vector<ParamId>& ids);
  // Issues the Releases whose parameters torch no longer views.
  void Drain();
  // Parameters torch still views / whose Release is owed: {id: count}.
  std::map<ParamId, int64_t> Views() const { return core_->views.Views(); }
  std::map<ParamId, int64_t> PendingReleases() const { return core_->views.Owed(); }

  void ReduceGradient(ParamId id, uintptr_t grad);
  // The gradient of micro-batch `micro_batch` of the window (zinf.schedule layer-major).
  void ReduceGradientOf(ParamId id, uintptr_t grad, int micro_batch);
  py::dict Step();
  void SaveCheckpoint(const std::string& dir, const std::string& user_data);
  py::bytes LoadCheckpoint(const std::string& dir);
  void GatherMaster(ParamId id, uintptr_t out);
  // Engine::CompareAcrossRanks (collective), without the GIL.
  void CompareAcrossRanks(const std::string& what, const std::string& text,
                          const std::string& remedy);
  void LoadSafetensors(const safetensors::Checkpoint& ckpt,
                       const std::vector<std::pair<ParamId, std::string>>& mapping,
                       bool allow_reshape);
  // `extra`: (name, safetensors dtype, shape, pointer) of host tensors written after the
  // parameters as they are (the model's buffers); the caller keeps them alive.
  using HostTensorSpec = std::tuple<std::string, std::string, std::vector<int64_t>, uintptr_t>;
  void SaveSafetensors(const std::string& dir,
                       const std::vector<std::pair<ParamId, std::string>>& mapping,
                       uint64_t shard_bytes, const std::string& dtype,
                       const std::map<std::string, std::string>& metadata,
                       const std::vector<HostTensorSpec>& extra);
  // Replaces the values of parameters `ids` between optimizer steps (Engine::SetParameterValues):
  // `fill(id, ptr)` writes the parameter's numel fp32 values at ptr. A Python exception in
  // `fill` is raised again here; the caller checks its sources first (a fill failing after a
  // sub-group was written stops the engine, as the C++ contract says).
  void SetParameterValues(const std::vector<ParamId>& ids, const py::function& fill);
  py::dict Param(ParamId id);
  // offload_states / reload_states (Engine::OffloadStates, ReloadStates): `device` "cpu" or
  // "nvme"; the releases owed first, as every between-steps call.
  void OffloadStates(uint32_t include, const std::string& device, bool pin_memory,
                     bool non_blocking);
  void ReloadStates(bool non_blocking);
  // Checks an id from Python before it reaches an Engine accessor that trusts it.
  void CheckParamId(ParamId id);

 private:
  void CheckUsable() const;

  std::shared_ptr<Core> core_;
  std::vector<std::string> warnings_;
  Status failed_;
};

// A safetensors dtype by its name in the format ("F32", "I64", ...); InvalidArgument else.
safetensors::DType ParseSafetensorsDType(const std::string& name);

}  // namespace zinf::python
