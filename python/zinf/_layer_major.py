"""zinf.schedule "layer-major" from torch: ZinfEngine.train_window.

A model that is a stack (an embedding, blocks that map hidden states to hidden states, a head
that gives the loss) is run a window at a time: each stage for every micro-batch of the
window before the next stage, forward from the embedding up, then backward from the head
down. The engine fetches a block's parameters once per pass instead of once per micro-batch.

- Forward: each stage runs for every micro-batch with gradients enabled (so its parameters are
  acquired for training: the prefetch trace learns the order) and its output is detached; the
  input of every block is kept, per micro-batch.
- The head: for each micro-batch, its forward from the kept hidden states and its backward
  (the loss scaled as engine.backward scales it), which gives the gradient of the hidden states.
- Backward, from the last block down: for each micro-batch, the block runs again from its kept
  input (the same kernels on the same values: the forward's activations again) and its backward
  takes the gradient from above; the gradient of its input goes on down. Then the embedding.
- Each parameter's gradient goes to the engine tagged with its micro-batch (the engine sums a
  parameter's gradients in micro-batch order), so the result is the micro-batch schedule's,
  bit for bit.

What a model must offer: the three parts, with every parameter in exactly one of them (a head
tied to the embedding would give its weight two gradients per micro-batch: refused by the
engine, keep such models on the micro-batch schedule) and the same result when a block runs
again on the same input (no dropout: it would draw another mask in the backward's rerun).
"""
import torch

from ._errors import error
from ._residency import Frame


def _check(engine, micro_batches, blocks):
    ctx = engine._ctx
    if not ctx.core.layer_major:
        raise error("FailedPrecondition",
                    "engine.train_window needs zinf.schedule \"layer-major\" in the config "
                    "(\"zinf\": {\"schedule\": \"layer-major\"}); with the micro-batch schedule "
                    "call engine(...), engine.backward and engine.step() per micro-batch "
                    "(nothing was run)")
    if len(micro_batches) != ctx.gas:
        raise error("InvalidArgument",
                    "engine.train_window: %d micro-batches for gradient_accumulation_steps %d; a "
                    "window is exactly that many (inputs, targets) pairs (nothing was run)"
                    % (len(micro_batches), ctx.gas))
    if not blocks:
        raise error("InvalidArgument", "engine.train_window: no blocks (nothing was run)")
    if engine._micro.started:
        raise error("FailedPrecondition",
                    "engine.train_window inside a micro-step that already ran a forward or a "
                    "backward: call engine.step() first (nothing was run)")


def _scaled(engine, loss, k):
    """The loss as engine.backward hands it to autograd."""
    ctx = engine._ctx
    if ctx.scale_wrt_gas and k > 1:
        loss = loss / k
    if engine.world_size > 1:
        loss = loss / engine.world_size
    if ctx.core.fp16:
        loss = loss.float() * ctx.core.loss_scale
    return loss


def _backward(engine, j, outputs, grads):
    """The backward of micro-batch `j`'s graph from `outputs` (with `grads` from above)."""
    micro = engine._micro
    micro.window_mb = j
    micro.in_backward = True
    try:
        torch.autograd.backward(outputs, grads)
    finally:
        micro.in_backward = False
        micro.window_mb = None
    engine._residency.end_backward()


class _Held:
    """A stage's parameters held acquired (a forward frame outside the module calls) while it
    runs for every micro-batch, so the engine fetches them once, not once per call. Only an
    nn.Module's parameters can be found (a plain callable's are acquired per call)."""

    def __init__(self, engine, stage):
        self._residency = engine._residency
        self._frame = Frame()
        if not isinstance(stage, torch.nn.Module):
            return
        by_obj = engine._registry.by_obj
        owned = []
        for prm in stage.parameters():
            p = by_obj.get(id(prm))
            if p is not None and p not in owned:
                owned.append(p)
        self._residency.acquire_forward(owned, self._frame, inference=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._residency.release_forward(self._frame)


def _forward(engine, micro_batches, embed, blocks):
    """Each stage for every micro-batch, from the embedding up; returns the blocks' inputs
    (kept[l][j]: micro-batch j's input of block l) and the last block's outputs."""
    with _Held(engine, embed):
        xs = [embed(inputs).detach() for inputs, _ in micro_batches]
    kept = []
    for block in blocks:
        kept.append(xs)
        with _Held(engine, block):
            xs = [block(x).detach() for x in xs]
    return kept, xs


def _head(engine, micro_batches, head, xs):
    """The head's forward and backward per micro-batch; returns the losses and the gradients
    of the hidden states."""
    k = len(micro_batches)
    losses, dys = [], []
    with _Held(engine, head):
        for j, (_, targets) in enumerate(micro_batches):
            x = xs[j].requires_grad_()
            loss = head(x, targets)
            losses.append(loss.detach())
            engine._micro.losses.append(loss.detach())
            _backward(engine, j, _scaled(engine, loss, k), None)
            dys.append(x.grad)
    return losses, dys


def train_window(engine, micro_batches, embed, blocks, head):
    engine._enter("engine.train_window")
    blocks = list(blocks)
    # (The ranks compare the window's shape first: one rank refused alone would leave the
    # others waiting in the window's collectives.)
    engine._between_steps("engine.train_window of %d micro-batches through %d blocks"
                          % (len(micro_batches), len(blocks)))
    _check(engine, micro_batches, blocks)
    engine._sync_lr()
    k = len(micro_batches)
    engine._ctx.in_window = True
    try:
        with torch.enable_grad():
            kept, xs = _forward(engine, micro_batches, embed, blocks)
            losses, dys = _head(engine, micro_batches, head, xs)
            xs = None
            for l in reversed(range(len(blocks))):
                with _Held(engine, blocks[l]):
                    for j in range(k):
                        x = kept[l][j].requires_grad_()
                        _backward(engine, j, blocks[l](x), dys[j])
                        dys[j] = x.grad
                kept[l] = None
            # (A frozen embedding, as under LoRA, takes no backward.)
            if not isinstance(embed, torch.nn.Module) or \
                    any(p.requires_grad for p in embed.parameters()):
                with _Held(engine, embed):
                    for j, (inputs, _) in enumerate(micro_batches):
                        h = embed(inputs)
                        if h.requires_grad:
                            _backward(engine, j, h, dys[j])
    except BaseException:
        engine._residency.unwind()
        raise
    finally:
        engine._ctx.in_window = False
    engine._micro.backwards += 1
    return losses
