// The engine's C API: one rank on the host device (include/zinf/zinf.h).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "c_api/c_api_internal.h"
#include "zinf/comm.h"
#include "zinf/device.h"
#include "zinf/engine.h"
#include "zinf/log.h"
#include "zinf/runtime.h"
#include "zinf/zinf.h"

using zinf::capi::Fail;
using zinf::capi::FromStatus;
using zinf::capi::Succeed;

struct zinf_engine {
  uint64_t magic = zinf::capi::kEngineMagic;
  zinf::Runtime rank;                    // the host device and its one-rank communicator
  std::unique_ptr<zinf::Engine> engine;  // destroyed first (declared last)
};

namespace {

// Whether `e` is a live engine handle (else the failure is recorded for `fn`).
bool Live(const zinf_engine* e, const char* fn) {
  if (e != nullptr && e->magic == zinf::capi::kEngineMagic) return true;
  Fail(std::string(fn) + (e == nullptr ? ": engine is NULL"
                                       : ": not a live engine (destroyed already, or not a "
                                         "zinf_engine*)"));
  return false;
}

}  // namespace

extern "C" {

int zinf_engine_create(const char* config_json, zinf_engine** out) {
  return zinf::capi::Guarded("zinf_engine_create", [&] {
    if (out == nullptr) return Fail("zinf_engine_create: out must not be NULL");
    std::vector<std::string> warnings;
    zinf::Result<zinf::EngineConfig> config = zinf::ParseEngineConfig(
        config_json != nullptr && config_json[0] != '\0' ? config_json : "{}", &warnings);
    if (!config.ok()) return FromStatus(config.status());
    for (const std::string& w : warnings) zinf::LogWarning(w);
    auto handle = std::unique_ptr<zinf_engine>(new (std::nothrow) zinf_engine);
    if (!handle) return Fail("zinf_engine_create: out of memory");
    // The host device's budget by zinf-train's rule: zinf.device_budget_bytes, else (0) the
    // machine's memory, both checked against an address-space limit.
    zinf::Result<uint64_t> budget =
        zinf::HostDeviceBudget(config->device_budget_bytes, config->pinned_budget_bytes);
    if (!budget.ok()) return FromStatus(budget.status());
    zinf::HostDeviceOptions ho;
    ho.memory_budget = *budget;
    ho.copy_gbps = config->host_copy_gbps;
    // A rank of the launcher's group when its variables say so (RANK, WORLD_SIZE, ...).
    zinf::Result<zinf::ProcessGroupOptions> group = zinf::ProcessGroupFromEnv();
    if (!group.ok()) return FromStatus(group.status());
    group->timeout =
        std::chrono::milliseconds(static_cast<int64_t>(config->collective_timeout_seconds * 1000));
    zinf::Result<zinf::Runtime> rank = zinf::NewHostRuntime(ho, *group);
    if (!rank.ok()) return FromStatus(rank.status());
    handle->rank = std::move(rank).value();
    auto engine = zinf::Engine::Create(*config, handle->rank.device.get(), handle->rank.comm.get());
    if (!engine.ok()) return FromStatus(engine.status());
    handle->engine = std::move(engine).value();
    *out = handle.release();
    return Succeed();
  });
}

int zinf_engine_register(zinf_engine* engine, const char* name, const int64_t* shape, size_t ndim,
                         const float* init, uint32_t* id) {
  return zinf_engine_register_in_group(engine, name, shape, ndim, init, 0, id);
}

int zinf_engine_register_in_group(zinf_engine* engine, const char* name, const int64_t* shape,
                                  size_t ndim, const float* init, size_t param_group,
                                  uint32_t* id) {
  if (!Live(engine, "zinf_engine_register")) return -1;
  if (name == nullptr || shape == nullptr || init == nullptr || id == nullptr || ndim == 0) {
    return Fail("zinf_engine_register: name, shape (ndim > 0), init and id are required");
  }
  // (zinf_engine_register is this with group 0: the messages name the call users know.)
  return zinf::capi::Guarded("zinf_engine_register", [&] {
    zinf::ParamSpec spec;
    spec.name = name;
    spec.param_group = param_group;
    spec.shape.assign(shape, shape + ndim);
    size_t numel = 1;
    for (size_t i = 0; i < ndim; ++i) {
      if (shape[i] <= 0) {
        return Fail("zinf_engine_register('" + spec.name + "'): shape must be positive");
      }
      // The values are copied here: a shape beyond memory (or one whose element count
      // overflows) is refused before any allocation.
      if (__builtin_mul_overflow(numel, static_cast<size_t>(shape[i]), &numel) ||
          numel > (size_t{1} << 48)) {
        return Fail("zinf_engine_register('" + spec.name +
                    "'): the shape has more than 2^48 elements");
      }
    }
    auto values = std::make_shared<std::vector<float>>(init, init + numel);
    spec.init = [values](float* data, size_t n) {
      std::copy(values->begin(), values->begin() + static_cast<std::ptrdiff_t>(n), data);
    };
    zinf::Result<zinf::ParamId> r = engine->engine->RegisterParameter(spec);
    if (!r.ok()) return FromStatus(r.status());
    *id = r.value();
    return Succeed();
  });
}

int zinf_engine_acquire(zinf_engine* engine, const uint32_t* ids, size_t n, void** ptrs) {
  if (!Live(engine, "zinf_engine_acquire")) return -1;
  if (n > 0 && (ids == nullptr || ptrs == nullptr)) {
    return Fail("zinf_engine_acquire: ids and ptrs must not be NULL");
  }
  return zinf::capi::Guarded("zinf_engine_acquire", [&] {
    auto r = engine->engine->Acquire(std::vector<zinf::ParamId>(ids, ids + n));
    if (!r.ok()) return FromStatus(r.status());
    for (size_t i = 0; i < n; ++i) ptrs[i] = r.value()[i];
    return Succeed();
  });
}

int zinf_engine_release(zinf_engine* engine, const uint32_t* ids, size_t n) {
  if (!Live(engine, "zinf_engine_release")) return -1;
  if (n > 0 && ids == nullptr) return Fail("zinf_engine_release: ids must not be NULL");
  return zinf::capi::Guarded("zinf_engine_release", [&] {
    return FromStatus(engine->engine->Release(std::vector<zinf::ParamId>(ids, ids + n)));
  });
}

int zinf_engine_reduce_gradient(zinf_engine* engine, uint32_t id, const float* grad) {
  if (!Live(engine, "zinf_engine_reduce_gradient")) return -1;
  if (grad == nullptr) return Fail("zinf_engine_reduce_gradient: grad must not be NULL");
  return zinf::capi::Guarded("zinf_engine_reduce_gradient",
                             [&] { return FromStatus(engine->engine->ReduceGradient(id, grad)); });
}

int zinf_engine_reduce_gradient_of(zinf_engine* engine, uint32_t id, const float* grad,
                                   int micro_batch) {
  if (!Live(engine, "zinf_engine_reduce_gradient_of")) return -1;
  if (grad == nullptr) return Fail("zinf_engine_reduce_gradient_of: grad must not be NULL");
  return zinf::capi::Guarded("zinf_engine_reduce_gradient_of", [&] {
    return FromStatus(engine->engine->ReduceGradient(id, grad, micro_batch));
  });
}

int zinf_engine_step(zinf_engine* engine, zinf_step_stats* stats) {
  if (!Live(engine, "zinf_engine_step")) return -1;
  zinf::Result<zinf::StepStats> r = zinf::Status::Internal("not run");
  if (zinf::capi::Guarded("zinf_engine_step", [&] {
        r = engine->engine->Step();
        return 0;
      }) != 0) {
    return -1;
  }
  if (!r.ok()) return FromStatus(r.status());
  if (stats != nullptr) {
    stats->step = r->step;
    stats->optimizer_ran = r->optimizer_ran ? 1 : 0;
    stats->step_seconds = r->step_seconds;
    stats->overlap_efficiency = r->overlap_efficiency;
    stats->nvme_read_bytes = r->nvme_read_bytes;
    stats->nvme_write_bytes = r->nvme_write_bytes;
    stats->grad_norm = r->grad_norm;
  }
  return Succeed();
}

int zinf_engine_gather_master(zinf_engine* engine, uint32_t id, float* out) {
  if (!Live(engine, "zinf_engine_gather_master")) return -1;
  if (out == nullptr) return Fail("zinf_engine_gather_master: out must not be NULL");
  if (id >= engine->engine->num_params()) {
    return Fail("zinf_engine_gather_master: unknown parameter id " + std::to_string(id));
  }
  return zinf::capi::Guarded("zinf_engine_gather_master", [&] {
    return FromStatus(engine->engine->GatherMasterParameter(id, out));
  });
}

int zinf_engine_set_learning_rate(zinf_engine* engine, float lr) {
  if (!Live(engine, "zinf_engine_set_learning_rate")) return -1;
  return FromStatus(engine->engine->SetLearningRate(lr));
}

int zinf_engine_set_param_group(zinf_engine* engine, size_t group, float lr, float beta1,
                                float beta2, float eps, float weight_decay) {
  if (!Live(engine, "zinf_engine_set_param_group")) return -1;
  return zinf::capi::Guarded("zinf_engine_set_param_group", [&] {
    zinf::ParamGroupHyper hp;
    hp.lr = lr;
    hp.beta1 = beta1;
    hp.beta2 = beta2;
    hp.eps = eps;
    hp.weight_decay = weight_decay;
    return FromStatus(engine->engine->SetParamGroup(group, hp));
  });
}

int64_t zinf_engine_global_step(const zinf_engine* engine) {
  return engine == nullptr || engine->magic != zinf::capi::kEngineMagic
             ? -1
             : engine->engine->global_step();
}

double zinf_engine_loss_scale(const zinf_engine* engine) {
  return engine == nullptr || engine->magic != zinf::capi::kEngineMagic
             ? -1
             : engine->engine->loss_scale();
}

int zinf_engine_offload_states(zinf_engine* engine, uint32_t include, const char* device,
                               int pin_memory, int non_blocking) {
  if (!Live(engine, "zinf_engine_offload_states")) return -1;
  return zinf::capi::Guarded("zinf_engine_offload_states", [&] {
    const std::string where = device == nullptr ? "cpu" : device;
    if (where != "cpu" && where != "nvme") {
      return Fail("zinf_engine_offload_states: device must be \"cpu\" or \"nvme\", got \"" + where +
                  "\"");
    }
    zinf::Engine::OffloadStatesOptions o;
    o.include = include == 0 ? zinf::Engine::kOffloadAll : include;
    o.device = where == "cpu" ? zinf::Tier::kCpu : zinf::Tier::kNvme;
    o.pin_memory = pin_memory != 0;
    o.non_blocking = non_blocking != 0;
    return FromStatus(engine->engine->OffloadStates(o));
  });
}

int zinf_engine_reload_states(zinf_engine* engine, int non_blocking) {
  if (!Live(engine, "zinf_engine_reload_states")) return -1;
  return zinf::capi::Guarded("zinf_engine_reload_states", [&] {
    return FromStatus(engine->engine->ReloadStates(non_blocking != 0));
  });
}

int zinf_engine_states_offloaded(const zinf_engine* engine) {
  return engine == nullptr || engine->magic != zinf::capi::kEngineMagic
             ? -1
             : (engine->engine->states_offloaded() ? 1 : 0);
}

int64_t zinf_engine_skipped_steps(const zinf_engine* engine) {
  return engine == nullptr || engine->magic != zinf::capi::kEngineMagic
             ? -1
             : static_cast<int64_t>(engine->engine->skipped_steps());
}

int zinf_engine_save_checkpoint(zinf_engine* engine, const char* dir, const char* user_data) {
  if (!Live(engine, "zinf_engine_save_checkpoint")) return -1;
  if (dir == nullptr || dir[0] == '\0') {
    return Fail("zinf_engine_save_checkpoint: a folder name is required");
  }
  return zinf::capi::Guarded("zinf_engine_save_checkpoint", [&] {
    return FromStatus(
        engine->engine->SaveCheckpoint(dir, user_data != nullptr ? user_data : std::string()));
  });
}

int zinf_engine_load_checkpoint(zinf_engine* engine, const char* dir, char* user_data,
                                size_t capacity, size_t* user_data_len) {
  if (!Live(engine, "zinf_engine_load_checkpoint")) return -1;
  if (dir == nullptr || dir[0] == '\0') {
    return Fail("zinf_engine_load_checkpoint: a folder name is required");
  }
  if (user_data != nullptr && capacity == 0) {
    return Fail("zinf_engine_load_checkpoint: a user_data buffer needs capacity >= 1");
  }
  std::string text;
  zinf::Status s;
  if (zinf::capi::Guarded("zinf_engine_load_checkpoint", [&] {
        s = engine->engine->LoadCheckpoint(dir, &text);
        return 0;
      }) != 0) {
    return -1;
  }
  if (!s.ok()) return FromStatus(s);
  if (user_data != nullptr) {
    const size_t n = std::min(text.size(), capacity - 1);
    std::memcpy(user_data, text.data(), n);
    user_data[n] = '\0';
  }
  if (user_data_len != nullptr) *user_data_len = text.size();
  return Succeed();
}

int zinf_engine_resume_from_store(zinf_engine* engine) {
  if (!Live(engine, "zinf_engine_resume_from_store")) return -1;
  return zinf::capi::Guarded("zinf_engine_resume_from_store",
                             [&] { return FromStatus(engine->engine->ResumeFromStore()); });
}

void zinf_engine_destroy(zinf_engine* engine) {
  if (engine == nullptr) return;
  if (!Live(engine, "zinf_engine_destroy")) return;  // a second destroy: refused, not a crash
  engine->magic = 0;
  engine->engine.reset();  // before its device and communicator
  engine->rank.comm.reset();
  engine->rank.device.reset();
  zinf::capi::RetireHandle(engine, [](void* p) { delete static_cast<zinf_engine*>(p); });
}

}  // extern "C"
