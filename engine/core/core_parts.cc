#include "engine/core/core_parts.h"

#include <string>
#include <system_error>
#include <utility>

namespace zinf {

Result<std::unique_ptr<CoreParts>> CoreParts::Build(EngineContext ctx, const Shared& shared) {
  std::unique_ptr<CoreParts> parts(new CoreParts());
  parts->board = std::make_unique<GroupBoard>(ctx.layout);
  ctx.board = parts->board.get();
  parts->ctx_ = ctx;
  parts->params = std::make_unique<ParamStore>(ctx);
  parts->states = std::make_unique<StateStore>(ctx, shared.state_pool);
  parts->frozen = std::make_unique<FrozenParams>(ctx, parts->params.get(), shared.optimizer);
  try {
    parts->adder = std::make_unique<GradientAdder>();
  } catch (const std::system_error& e) {  // no thread could be started
    return Status::ResourceExhausted(std::string("starting the gradient adder thread: ") +
                                     e.what());
  }
  parts->fetch =
      std::make_unique<FetchScheduler>(ctx, parts->params.get(), shared.trace, parts->adder.get());
  // (A failed Init destroys the parts built so far here, before the façade synchronises the
  // streams: safe, as nothing has been queued on a stream yet: the Inits create events and
  // register host memory only.)
  ZINF_RETURN_IF_ERROR(parts->fetch->Init());
  parts->grads = std::make_unique<GradientWindow>(ctx, parts->fetch.get(), parts->adder.get(),
                                                  shared.grad_pool, shared.stream_grads);
  ZINF_RETURN_IF_ERROR(parts->grads->Init());
  if (SumsGradientsLocally(*ctx.config)) {
    parts->local_grads = std::make_unique<LocalGradients>(ctx);
    ZINF_RETURN_IF_ERROR(parts->local_grads->Init());
  }
  return parts;
}

CoreParts::~CoreParts() {
  local_grads.reset();
  grads.reset();
  fetch.reset();
  adder.reset();  // after the gradient window and the fetch scheduler (they drain it)
  frozen.reset();
  states.reset();
  params.reset();
  board.reset();
}

}  // namespace zinf
