// zinf._zinf: the engine for Python, with no link to torch. Tensors cross as raw pointers,
// shapes and dtypes (and DLPack capsules, which torch reads with torch.utils.dlpack), so one
// build serves every torch version. This file only binds: the engine and what torch holds of
// it are py_engine.h, saved activations on NVMe activation_swap.h, the zinf.Init spill file
// and the release rule interop/spill_file.h and interop/view_ledger.h.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "interop/spill_file.h"
#include "python/src/activation_swap.h"
#include "python/src/binding_util.h"
#include "python/src/py_engine.h"
#include "zinf/config.h"
#include "zinf/cpu_adam.h"
#include "zinf/cuda.h"
#include "zinf/engine.h"
#include "zinf/log.h"
#include "zinf/runtime.h"
#include "zinf/safetensors_engine.h"

namespace zinf::python {
namespace {

// zinf.ZinfError, created at import (see PYBIND11_MODULE).
PyObject* g_error = nullptr;

py::dict InspectCheckpoint(const safetensors::Checkpoint& ckpt) {
  py::dict out;
  for (const auto& [name, t] : ckpt.tensors) {
    out[py::str(name)] =
        py::make_tuple(safetensors::DTypeName(t.dtype), t.shape, ckpt.files[t.file].path);
  }
  return out;
}

// parse_config's dict: every config field by its key (VisitEngineConfig), the parse's
// warnings, and "nvme_paths": the NVMe folders of both offloads, each once.
py::dict ConfigSummary(const EngineConfig& c, const std::vector<std::string>& warnings) {
  py::dict d;
  VisitEngineConfig(c, [&](const char* key, const auto& value) { d[key] = value; });
  d["warnings"] = warnings;
  std::vector<std::string> paths = c.offload_param.nvme_paths;
  for (const std::string& p : c.offload_optimizer.nvme_paths) {
    if (std::find(paths.begin(), paths.end(), p) == paths.end()) paths.push_back(p);
  }
  d["nvme_paths"] = paths;
  return d;
}

// zinf.ZinfError, raised for every failed Status (its code and errno as attributes).
void BindErrors(py::module_& m) {
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
}

// Module-level functions: the build's and the machine's facts, config parsing and planning,
// zinf's log.
void BindFunctions(py::module_& m) {
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
        return ConfigSummary(c, warnings);
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
}

// The files the Python layer drives: saved activations on NVMe, the zinf.Init spill file,
// safetensors checkpoints.
void BindFiles(py::module_& m) {
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

  py::class_<SpillFile, std::shared_ptr<SpillFile>>(m, "Spill")
      .def(py::init([](const std::string& dir) {
             return std::shared_ptr<SpillFile>(Take(SpillFile::Create(dir)));
           }),
           py::arg("dir"))
      .def(
          "append",
          [](SpillFile& s, uintptr_t ptr, const std::string& dtype, size_t n) {
            const HostValueType type = Take(ParseHostValueType(dtype));
            return Take(s.Append(reinterpret_cast<const void*>(ptr), type, n));
          },
          py::arg("ptr"), py::arg("dtype"), py::arg("numel"),
          "appends numel values at ptr (float32, bfloat16 or float16) as fp32; returns the offset")
      .def("read", [](const SpillFile& s, uint64_t offset, uintptr_t out,
                      size_t n) { Check(s.Read(offset, reinterpret_cast<float*>(out), n)); })
      .def_property_readonly("bytes", &SpillFile::bytes);

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
}

// The engine (PyEngine).
void BindEngine(py::module_& m) {
  py::class_<PyEngine>(m, "Engine")
      .def(py::init<const std::string&, const std::string&, int, bool, uintptr_t, uint64_t,
                    const py::object&>(),
           py::arg("config_json"), py::arg("device") = "cpu", py::arg("device_index") = 0,
           py::arg("use_stream") = false, py::arg("cuda_stream") = 0, py::arg("device_memory") = 0,
           py::arg("group") = py::none())
      .def_property_readonly("rank", [](PyEngine& e) { return e.engine().rank(); })
      .def_property_readonly("world_size", [](PyEngine& e) { return e.engine().world_size(); })
      .def_property_readonly("warnings", &PyEngine::warnings)
      .def("register", &PyEngine::Register, py::arg("name"), py::arg("shape"), py::arg("trainable"),
           py::arg("ptr") = 0, py::arg("dtype") = "float32", py::arg("spill") = nullptr,
           py::arg("spill_offset") = 0, py::arg("group") = 0)
      .def("finish_registration", &PyEngine::FinishRegistration, py::arg("resume") = false)
      .def("acquire", &PyEngine::Acquire, py::arg("ids"), py::arg("inference") = false)
      .def("release", &PyEngine::Release, py::arg("ids"))
      .def("drain", &PyEngine::Drain)
      .def("views", &PyEngine::Views)
      .def("pending_releases", &PyEngine::PendingReleases)
      .def("reduce_gradient", &PyEngine::ReduceGradient, py::arg("id"), py::arg("grad_ptr"))
      .def("reduce_gradient_of", &PyEngine::ReduceGradientOf, py::arg("id"), py::arg("grad_ptr"),
           py::arg("micro_batch"))
      .def("step", &PyEngine::Step)
      .def("save_checkpoint", &PyEngine::SaveCheckpoint, py::arg("dir"), py::arg("user_data"))
      .def("load_checkpoint", &PyEngine::LoadCheckpoint, py::arg("dir"))
      .def("gather_master", &PyEngine::GatherMaster, py::arg("id"), py::arg("out_ptr"))
      .def("compare_across_ranks", &PyEngine::CompareAcrossRanks, py::arg("what"), py::arg("text"),
           py::arg("remedy"))
      .def("load_safetensors", &PyEngine::LoadSafetensors, py::arg("checkpoint"),
           py::arg("mapping"), py::arg("allow_reshape") = false)
      .def("save_safetensors", &PyEngine::SaveSafetensors, py::arg("dir"), py::arg("mapping"),
           py::arg("shard_bytes"), py::arg("dtype"), py::arg("metadata"),
           py::arg("extra") = std::vector<PyEngine::HostTensorSpec>{})
      .def("set_parameter_values", &PyEngine::SetParameterValues, py::arg("ids"), py::arg("fill"))
      .def("set_lr", [](PyEngine& e, float lr) { Check(e.engine().SetLearningRate(lr)); })
      .def("offload_states", &PyEngine::OffloadStates, py::arg("include"), py::arg("device"),
           py::arg("pin_memory"), py::arg("non_blocking"))
      .def("reload_states", &PyEngine::ReloadStates, py::arg("non_blocking"))
      .def_property_readonly("states_offloaded",
                             [](PyEngine& e) { return e.engine().states_offloaded(); })
      .def(
          "set_param_group",
          [](PyEngine& e, size_t group, float lr, float beta1, float beta2, float eps,
             float weight_decay) {
            Check(e.engine().SetParamGroup(group, {lr, beta1, beta2, eps, weight_decay}));
          },
          py::arg("group"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
          py::arg("weight_decay"))
      .def_property_readonly("device_memory",
                             [](PyEngine& e) {
                               const DeviceMemoryInfo m = e.device_memory();
                               py::dict d;
                               d["budget"] = m.budget;
                               d["used"] = m.used;
                               d["peak"] = m.peak;
                               d["committed"] = m.committed;
                               return d;
                             })
      .def_property_readonly("pinned_memory",
                             [](PyEngine& e) {
                               Result<Engine::PinnedMemoryInfo> m = e.engine().pinned_memory();
                               Check(m.status());
                               py::dict d;
                               d["capacity"] = m->capacity;
                               d["used"] = m->used;
                               d["resident"] = m->resident;
                               return d;
                             })
      .def_property_readonly("num_param_groups",
                             [](PyEngine& e) { return e.engine().num_param_groups(); })
      .def_property_readonly("global_step", [](PyEngine& e) { return e.engine().global_step(); })
      .def("param_updates",
           [](PyEngine& e, ParamId id) {
             e.CheckParamId(id);
             return e.engine().param_updates(id);
           })
      .def_property_readonly("num_params", [](PyEngine& e) { return e.engine().num_params(); })
      .def("param", &PyEngine::Param)
      .def_property_readonly("bf16", [](PyEngine& e) { return e.engine().config().bf16; })
      .def_property_readonly("fp16", [](PyEngine& e) { return e.engine().config().fp16.enabled; })
      // The loss scale the next backward multiplies the loss by (1 without fp16), and the
      // optimizer steps skipped for inf/NaN gradients so far (fp16's overflows).
      .def_property_readonly("loss_scale", [](PyEngine& e) { return e.engine().loss_scale(); })
      .def_property_readonly("skipped_steps",
                             [](PyEngine& e) { return e.engine().skipped_steps(); })
      .def_property_readonly(
          "gradient_accumulation_steps",
          [](PyEngine& e) { return e.engine().config().gradient_accumulation_steps; })
      // zinf.schedule "layer-major": one step per window (ZinfEngine.train_window).
      .def_property_readonly("layer_major",
                             [](PyEngine& e) { return e.engine().config().layer_major; });
}

}  // namespace
}  // namespace zinf::python

PYBIND11_MODULE(_zinf, m) {
  m.doc() = "zinf's engine (the C++ core of the zinf package; see zinf/__init__.py)";
  zinf::python::BindErrors(m);
  zinf::python::BindFunctions(m);
  zinf::python::BindFiles(m);
  zinf::python::BindEngine(m);
}
