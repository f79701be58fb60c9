"""Where an engine is in its accumulation window, and the refusals that depend on it.

A micro-step runs from the first training forward (or gradient) after a step to the next
engine.step(); every gradient_accumulation_steps-th step is a boundary, where zinf's optimizer
runs. Between the start of a micro-step and its step the optimizer owns the parameters'
values, so a write is refused; once the backward of a boundary began, so is a read outside the
forward. Each parameter's gradient state (GradState, _param.py) is reset here when a
micro-step ends.
"""
import torch

from ._errors import error


class MicroStep:
    """The counters of the current micro-step and accumulation window (one per engine)."""

    def __init__(self, gas, span=1):
        self.gas = gas
        # Micro-batches one engine.step() ends: the window's with zinf.schedule layer-major
        # (engine.train_window), else 1.
        self.span = span
        # Inside engine.train_window's backward: the micro-batch whose gradients come now.
        self.window_mb = None
        self.index = 0  # micro-batches ended (by engine.step(), or restored from a checkpoint)
        self.started = False  # a training forward or a gradient since the last step
        self.reduced = []  # the parameters whose gradient reached the engine in this micro-step
        self.backwards = 0  # engine.backward calls completed in this micro-step
        self.in_backward = False  # inside engine.backward's loss.backward()
        self.losses = []  # this window's losses (detached), looked at only if a step fails
        self.updates_since_values = 0  # optimizer steps since values were set or loaded

    def is_boundary(self):
        """Whether the next step() ends an accumulation window (runs the optimizer)."""
        return (self.index + self.span) % self.gas == 0

    def gradient_reduced(self, p):
        p.reduce_gradient()
        self.reduced.append(p)

    def _clear_gradients(self):
        for p in self.reduced:
            p.end_micro_step()
        self.reduced = []

    def ended(self, optimizer_ran, applied=True):
        """engine.step() ended the micro-step (and the window when the optimizer ran;
        `applied`: its update was not skipped, as fp16 skips one whose gradients overflowed)."""
        self.index += self.span
        self.started = False
        self._clear_gradients()
        self.backwards = 0
        if optimizer_ran:
            self.losses = []
            if applied:
                self.updates_since_values += 1

    def restart(self, index):
        """A checkpoint was loaded: the next micro-step is `index`, nothing of it has run."""
        self.index = index
        self.started = False
        self._clear_gradients()
        self.backwards = 0

    def values_set(self):
        """Parameter values were set or loaded: the next optimizer step is the first on them."""
        self.updates_since_values = 0
        self.losses = []

    def check_writable(self, p, what, forward_running):
        if forward_running or self.started or p.state.in_forward:
            raise error("FailedPrecondition",
                        "parameter '%s': %s during a micro-step (between engine(...) and "
                        "engine.step()) is refused: the optimizer owns the values then, and the "
                        "write would be lost; write parameters before the forward or after "
                        "engine.step() (nothing was written)" % (p.names[0], what))

    def check_inference_read(self, p):
        if self.reduced and self.is_boundary():
            raise error("FailedPrecondition",
                        "parameter '%s' read after this step's backward began and before "
                        "engine.step(): the optimizer may be rewriting it; read it after "
                        "engine.step() (or inside the forward)" % p.names[0])

    def second_gradient(self, p):
        """The refusal of a parameter's second gradient in one micro-step, with its cause."""
        if self.backwards > 0:
            cause = ("engine.backward ran %d time(s) since the last engine.step()"
                     % self.backwards)
        else:
            cause = ("two backward passes reached it in this micro-step: loss.backward() "
                     "called twice, or a reentrant torch.utils.checkpoint segment that shares "
                     "it with code outside the segment (use_reentrant=False or "
                     "zinf.checkpoint avoid that)")
        return error("FailedPrecondition",
                     "parameter '%s' got a second gradient in one micro-step (%s): call "
                     "engine.step() after every backward; to accumulate gradients over "
                     "several micro-batches, set gradient_accumulation_steps and call "
                     "backward then step for each (step runs the optimizer at the boundary)"
                     % (p.names[0], cause))

    def explain_step_failure(self, err):
        """A failed step with the cause the Python side can tell. The engine's advice for an inf
        or NaN gradient (lower the learning rate) fits a run that diverged; when no optimizer
        update has run since the parameters' values were set (initialize, a checkpoint,
        zinf.load_safetensors, a write) and the loss was already not finite, the learning rate
        cannot be the cause: the values (or the inputs) are."""
        if getattr(err, "code", None) != "FailedPrecondition" or self.updates_since_values:
            return err
        bad = [i for i, l in enumerate(self.losses) if not bool(torch.isfinite(l).all())]
        if not bad:
            return err
        return error("FailedPrecondition",
                     "the optimizer step stopped on inf or NaN gradients, and the loss was "
                     "already %s in micro-step %d of the first optimizer step after the "
                     "parameters' values were set (zinf.initialize, load_checkpoint, "
                     "load_safetensors, load_state_dict or a write): no update has run since, so "
                     "the learning rate is not the cause. The values the model starts from (or "
                     "its inputs) hold or produce inf/NaN: check what was loaded or written, "
                     "then recreate the engine (the engine's own message is this error's "
                     "__cause__)" % (self.losses[bad[0]].item(), bad[0]))
