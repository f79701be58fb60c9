// The engine's core components over one frozen layout: the group board, the parameter and
// state stores, the frozen parameters' storage, the gradient adder thread, the fetch
// scheduler, the gradient window and, at stages 0 and 1 with accumulation, the local gradient
// sums. Built once at placement, in dependency order, from the context the
// façade assembled (Build gives it the board); torn down in reverse, after the optimizer
// pipeline and the persistence layer above, which use them, are gone.
#pragma once

#include <memory>

#include "engine/core/acquire_trace.h"
#include "engine/core/engine_context.h"
#include "engine/core/fetch_scheduler.h"
#include "engine/core/frozen_params.h"
#include "engine/core/gradient_adder.h"
#include "engine/core/gradient_window.h"
#include "engine/core/group_board.h"
#include "engine/core/host_memory.h"
#include "engine/core/local_gradients.h"
#include "engine/core/param_store.h"
#include "engine/core/state_store.h"
#include "zinf/cpu_adam.h"
#include "zinf/status.h"

namespace zinf {

struct CoreParts {
  // What the components share beyond the context (owned by the façade, outliving them).
  struct Shared {
    CpuOptimizer* optimizer = nullptr;
    AcquireTrace* trace = nullptr;
    BlockPool* state_pool = nullptr;  // [master | m | v] of one sub-group
    BlockPool* grad_pool = nullptr;   // streaming accumulators
    bool stream_grads = false;        // accumulators from grad_pool (PinnedPlan::stream_grads)
  };
  // `ctx` without a board: the parts' board becomes ctx.board (ctx() returns it).
  static Result<std::unique_ptr<CoreParts>> Build(EngineContext ctx, const Shared& shared);
  ~CoreParts();  // in reverse order of Build (the adder after the window and the scheduler)

  const EngineContext& ctx() const { return ctx_; }

  std::unique_ptr<GroupBoard> board;
  std::unique_ptr<ParamStore> params;
  std::unique_ptr<StateStore> states;
  std::unique_ptr<FrozenParams> frozen;
  std::unique_ptr<GradientAdder> adder;
  std::unique_ptr<FetchScheduler> fetch;
  std::unique_ptr<GradientWindow> grads;
  // Stages 0 and 1 with accumulation (SumsGradientsLocally); null otherwise.
  std::unique_ptr<LocalGradients> local_grads;

 private:
  CoreParts() = default;
  EngineContext ctx_;
};

}  // namespace zinf
