// What every engine component is given when the façade builds it at placement: the frozen
// layout, the configuration, the device and communicator with the engine's streams, the
// objects shared across threads (the device budget, the statistics, the group board) and the
// host and NVMe memory (the pinned arena; the swap store, null without an NVMe tier). Built
// once, in dependency order; a component keeps these pointers, never the engine, and nothing
// is attached after construction.
#pragma once

#include "engine/core/device_budget.h"
#include "engine/core/group_board.h"
#include "engine/core/layout.h"
#include "engine/core/stats_recorder.h"
#include "zinf/comm.h"
#include "zinf/config.h"
#include "zinf/device.h"
#include "zinf/swap.h"

namespace zinf {

// The engine's streams beside the device's compute stream.
struct EngineStreams {
  Stream* copy = nullptr;    // parameters to the device (fetches), states to and from it
  Stream* comm = nullptr;    // collectives: all-gathers, reduce-scatters
  Stream* update = nullptr;  // the optimizer's device work
  Stream* grad = nullptr;    // gradient partitions to the host, accumulation, landing
};

struct EngineContext {
  const Layout* layout = nullptr;
  const EngineConfig* config = nullptr;
  Device* device = nullptr;
  Communicator* comm = nullptr;
  // hpZ (HpzActive): the ranks of this rank's node, split from `comm`; null otherwise.
  Communicator* node_comm = nullptr;
  // hpZ with zero_quantized_gradients: the ranks at this rank's place in every node (the
  // second hop of the gradient reduction), split from `comm`; null otherwise.
  Communicator* cross_comm = nullptr;
  EngineStreams streams;
  DeviceBudget* budget = nullptr;
  StatsRecorder* stats = nullptr;
  GroupBoard* board = nullptr;
  PinnedArena* arena = nullptr;
  SwapStore* swap = nullptr;  // null without an NVMe tier
};

}  // namespace zinf
