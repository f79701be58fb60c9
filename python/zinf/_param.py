"""A managed parameter and its explicit state (what FSDP2's FSDPParam is to its sharded state).

Where a parameter's values are for torch is one ParamState, changed only by ManagedParam's
transition methods. Each checks the state it starts from before it changes anything: an illegal
transition is a bug in zinf's bookkeeping (the engine's own checks refuse the user's mistakes
first, with what to do), and raises a ZinfError (a RuntimeError, code "Internal") naming the
parameter, the state it was in and the moves the transition makes. A transition sets the new
state only once its work is done, so one that fails midway leaves the parameter as it was.

    REGISTERED --finish_registration--> RELEASED
    RELEASED   --gather_forward-->  FORWARD   --release_forward-->  RELEASED
    RELEASED   --gather_backward--> BACKWARD  --release_backward--> RELEASED
    FORWARD    --gather_backward--> FORWARD_BACKWARD --release_backward--> FORWARD
    BACKWARD   --gather_forward-->  FORWARD_BACKWARD --release_forward-->  BACKWARD

Both at once happens when a module runs forward while backward holds its parameter (a
checkpointed segment recomputed in backward, a read of the parameter in a backward function):
the two holds are counted apart and each releases its own. The counts are kept here too
(forward holders, autograd's saved references); Residency (_residency.py) acquires and releases
the memory when they say so, as FSDP2's FSDPParamGroup does for its FSDPParams.

The gradient has a state of its own, per micro-step (GradState): PENDING until the backward
hands the parameter's gradient to the engine (REDUCED), PENDING again when the micro-step ends
(engine.step(), load_checkpoint).
"""
import enum
import weakref

import torch

from ._calls import set_base_data
from ._errors import error

FLOAT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def placeholder(shape, dtype, device):
    """A tensor of `shape` over one NaN (stride 0): what a parameter is between uses."""
    return torch.full((), float("nan"), dtype=dtype, device=device).expand(shape)


class ParamState(enum.Enum):
    """Where a managed parameter's values are for torch."""

    # (value, in_forward, in_backward): the two flags are plain attributes because
    # ZinfParameter reads in_forward on every torch call made on a parameter.
    REGISTERED = ("registered", False, False)  # the engine may still read `source`
    RELEASED = ("released", False, False)  # param.data is the placeholder
    FORWARD = ("forward", True, False)  # param.data is acquired memory (a module runs)
    BACKWARD = ("backward", False, True)  # saved references read acquired memory
    FORWARD_BACKWARD = ("forward+backward", True, True)

    def __init__(self, value, in_forward, in_backward):
        self.in_forward = in_forward
        self.in_backward = in_backward


class GradState(enum.Enum):
    """Whether a parameter's gradient reached the engine in the current micro-step."""

    PENDING = "pending"
    REDUCED = "reduced"


_S = ParamState
_MOVES = {
    "finish_registration": {_S.REGISTERED: _S.RELEASED},
    "gather_forward": {_S.RELEASED: _S.FORWARD, _S.BACKWARD: _S.FORWARD_BACKWARD},
    "release_forward": {_S.FORWARD: _S.RELEASED, _S.FORWARD_BACKWARD: _S.BACKWARD},
    "gather_backward": {_S.RELEASED: _S.BACKWARD, _S.FORWARD: _S.FORWARD_BACKWARD},
    "release_backward": {_S.BACKWARD: _S.RELEASED, _S.FORWARD_BACKWARD: _S.FORWARD},
    "reduce_gradient": {GradState.PENDING: GradState.REDUCED},
}


def _illegal(p, transition, current):
    moves = ", ".join("%s -> %s" % (a.name, b.name) for a, b in _MOVES[transition].items())
    return error("Internal",
                 "parameter '%s': %s in state %s; it moves only %s (zinf's record of where the "
                 "parameter is went wrong: a bug in zinf, please report it)"
                 % (p.names[0], transition, current.name, moves))


class ManagedParam:
    """One managed torch parameter (tied parameters are one), its state and its memory."""

    __slots__ = ("id", "param", "names", "shape", "numel", "dtype", "placeholder", "trainable",
                 "state", "grad_state", "fwd_live", "fwd_holders", "bwd_flat", "saved_refs",
                 "grad_node", "source", "live_ptr", "engine", "gathered")

    def __init__(self, pid, param, names, dtype, device, engine):
        self.id = pid
        self.param = param
        self.names = names
        self.shape = param.shape
        self.numel = param.numel()
        self.dtype = dtype
        self.placeholder = placeholder(param.shape, dtype, device)
        self.trainable = param.requires_grad
        self.state = ParamState.REGISTERED
        self.grad_state = GradState.PENDING
        self.fwd_live = None  # the acquired tensor `param.data` is, in forward
        self.fwd_holders = 0  # module calls (and accesses) holding it in forward
        self.bwd_flat = None  # the acquired memory saved references read, in backward
        self.saved_refs = 0  # live references autograd saved to it
        self.grad_node = None  # its AccumulateGrad node (kept alive: the hook lives there)
        self.source = None  # its initial values until registration ends
        self.live_ptr = None  # the storage pointer torch sees while acquired
        self.engine = weakref.ref(engine)
        # Inside a GatheredParameters block (_ds/gathered.py): the base data is an ordinary
        # tensor of the whole values, and torch calls act on it without the engine.
        self.gathered = False

    def _next(self, transition):
        """The state `transition` leads to from the current one; raises when it is illegal."""
        new = _MOVES[transition].get(self.state)
        if new is None:
            raise _illegal(self, transition, self.state)
        return new

    def finish_registration(self):
        """The engine holds the values: the initial ones (`source`) may go."""
        new = self._next("finish_registration")
        self.source = None
        self.state = new

    def gather_forward(self, flat):
        """`flat`, acquired for a forward, becomes `param.data` in the parameter's shape."""
        new = self._next("gather_forward")
        live = flat.view(self.shape)
        set_base_data(self.param, live)
        self.fwd_live = live
        self.state = new

    def release_forward(self):
        """The last forward holder returned: `param.data` is the placeholder again."""
        new = self._next("release_forward")
        set_base_data(self.param, self.placeholder)
        self.fwd_live = None
        self.state = new

    def gather_backward(self, flat):
        """`flat`, acquired in backward, is what saved references to the parameter read."""
        new = self._next("gather_backward")
        self.bwd_flat = flat
        self.state = new

    def release_backward(self):
        new = self._next("release_backward")
        self.bwd_flat = None
        self.state = new

    def reduce_gradient(self):
        """Its gradient of this micro-step went to the engine (one per micro-step)."""
        if self.grad_state is not GradState.PENDING:
            raise _illegal(self, "reduce_gradient", self.grad_state)
        self.grad_state = GradState.REDUCED

    def end_micro_step(self):
        self.grad_state = GradState.PENDING

    # -- Who holds it (Residency releases the memory when the last holder of a kind is gone)

    def add_forward_holder(self):
        """A module call (or an access outside the forward) holds it."""
        self.fwd_holders += 1

    def drop_forward_holder(self):
        """A forward holder returned; whether it was the last."""
        self.fwd_holders -= 1
        return self.fwd_holders == 0

    def add_saved_ref(self):
        """Autograd saved a reference to its memory (_packing.py)."""
        self.saved_refs += 1

    def drop_saved_ref(self):
        """A saved reference died; whether backward no longer needs the memory."""
        self.saved_refs -= 1
        return self.backward_unneeded

    @property
    def backward_unneeded(self):
        """Held in backward with no saved reference left to read it."""
        return self.saved_refs == 0 and self.state.in_backward

    def backward_view(self, size, stride, offset, dtype):
        """The view of the memory backward holds that a saved reference stands for."""
        base = self.bwd_flat
        if dtype != base.dtype:
            base = base.view(dtype)
        return base.as_strided(size, stride, offset)
