// The memory a run needs, known before any engine exists: the pinned host bytes of an
// engine's plan, and the NVMe plan (the space a model needs on its swap folders, the folders
// prepared and checked before anything is written). A trainer sizes its budgets and checks its
// disks with these; the engine plans with the same code (engine/core/memory_plan.cc, in the
// zinf::engine library).
#pragma once

#include <cstdint>
#include <vector>

#include "zinf/config.h"
#include "zinf/engine_types.h"
#include "zinf/status.h"

namespace zinf {

// The pinned host memory (zinf.pinned_budget_bytes) that an engine with `config` needs for
// these parameters, in registration order, on `world_size` ranks: what FinishRegistration's
// plan takes from the budget (cpu-tier partitions, gradient accumulators, optimizer swap
// buffers, staging). A trainer can size the budget with it before creating the engine. Reads
// only each spec's name, shape and trainable flag; InvalidArgument for a parameter
// RegisterParameter would refuse. `device_is_host`: the host device (Device::IsHost()).
Result<uint64_t> PinnedBytesNeeded(const EngineConfig& config, const std::vector<ParamSpec>& params,
                                   int world_size, bool device_is_host);

// Bytes the NVMe tiers of `config` need for a model of `params` trainable parameters and
// `frozen` frozen ones: the parameters in their storage dtype and the optimizer's master and
// states as stored (the delayed update's second parameter buffer, durable mode's committed
// copy, 2 % for alignment); a frozen parameter only its stored copy, once. Saturates at
// UINT64_MAX for counts beyond any disk.
uint64_t NvmeBytesNeeded(const EngineConfig& config, uint64_t params, uint64_t frozen = 0);

// Prepares the swap folders of `config` for a model of `params` trainable and `frozen` frozen
// parameters, before anything is written: each inside zinf.allowed_nvme_roots (checked before
// a folder is created), created when missing, and room for NvmeBytesNeeded on them (the swap
// files a run will reuse count as free). InvalidArgument naming the folder and the key;
// ResourceExhausted with the size needed and the free space; the errno of a folder that cannot be
// created. No-op without NVMe tiers.
Status PrepareNvmeFolders(const EngineConfig& config, uint64_t params, uint64_t frozen = 0);

}  // namespace zinf
