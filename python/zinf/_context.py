"""What an engine's collaborators share: EngineContext (one per engine, built first and handed to
each collaborator at construction, so that none reaches into the engine).

It holds the core engine (None once the engine is closed), where the engine computes, the
leaf collaborators every other one uses (the thread that drives the engine, the managed
parameters, the micro-step), a few flags the engine and its hooks both read, and the checks
every entry point makes before it changes anything. It holds no collaborator that holds it
back, and nothing outside the engine holds it: a dropped engine frees its core at once.
"""
import ctypes

import torch

from . import _zinf
from ._errors import error


class EngineContext:
    """An engine's shared state and entry checks (see the module's docstring)."""

    def __init__(self, core, device, dtype, gas, scale_wrt_gas, driver, registry, micro,
                 residency, groups, sync_lr, stream=None):
        self.core = core  # zinf._zinf.Engine; None once the engine is closed
        self.device = device  # the torch device the engine's memory is on
        self.dtype = dtype  # the dtype torch computes with (bfloat16, float16 or float32)
        self.gas = gas  # gradient_accumulation_steps (at least 1)
        self.scale_wrt_gas = scale_wrt_gas  # engine.backward divides the loss by `gas`
        self.rank = core.rank
        self.world_size = core.world_size
        self.stream = stream  # the CUDA stream handle the engine orders against, or None
        self.driver = driver  # _driver.Driver
        self.registry = registry  # _registry.ParamRegistry
        self.micro = micro  # _microstep.MicroStep
        self.residency = residency  # _residency.Residency (it holds the engine weakly)
        self.groups = groups  # _optim.GroupSync: the optimizer groups the core has
        self.closed = False
        self.gathered = 0  # GatheredParameters blocks open (_ds/gathered.py)
        # Inside engine.train_window: the ranks compared the whole window once, so its stage
        # calls skip the per-forward comparison (2 x layers x micro-batches collectives).
        self.in_window = False
        # The engine's hand-over of its optimizer's groups (groups.sync with the optimizer the
        # engine holds now; a weak method: the context never keeps the engine alive).
        self._sync_lr = sync_lr

    # -- The checks every entry point makes

    def ensure_registered(self):
        if not self.registry.registered:
            self.registry.finish(self.core)

    def enter(self, what):
        """The checks every entry point makes before changing anything."""
        if self.closed:
            raise error("FailedPrecondition",
                        "%s: this zinf engine was closed (its parameters hold no values unless "
                        "it was closed with restore=True)" % what)
        self.driver.check(what)
        self.ensure_registered()

    def check_open(self):
        if self.closed:
            raise error("FailedPrecondition", "this zinf engine was closed")
        self.driver.check("a call")

    def between_steps(self, action):
        """With several ranks: the ranks compare what they are about to do (one small
        collective) before a path that issues collectives of its own (a forward's gathers, a
        step, a read, write or load of parameters outside a forward). A rank that takes
        another path (rank 0 alone prints a weight, loads a state dict, saves a checkpoint)
        is refused on every rank, naming both paths, instead of pairing its collectives with
        the others' unrelated ones (an abort inside gloo, or a wait for the timeout)."""
        if self.world_size > 1:
            self.core.compare_across_ranks(
                "what they do next", "next: " + action,
                "A managed parameter is partitioned across the ranks, so a forward, a step, "
                "and every read, write, gather, save or load of parameters outside a forward "
                "is a step every rank takes together: do it on every rank alike (to print or "
                "save on one rank, gather on every rank first).")

    # -- What several collaborators do alike

    def sync_lr(self):
        """Hands each optimizer group's hyperparameters to zinf's optimizer when they changed."""
        sync = self._sync_lr()
        if sync is not None:
            sync()

    def gather(self, p, dtype):
        """ManagedParam `p`'s full values: its fp32 master, or a frozen one's stored copy (a new
        CPU tensor, in `dtype`)."""
        out = torch.empty(p.shape, dtype=torch.float32)
        self.core.gather_master(p.id, out.data_ptr())
        return out if dtype == torch.float32 else out.to(dtype)

    @property
    def forward_running(self):
        """Whether a module of the engine's forward runs now (a frame is open)."""
        return bool(self.residency.stack)

    def set_values(self, pairs):
        """Hands fp32 copies of `pairs` [(ManagedParam, tensor)] to the engine in one call."""
        values = {}
        for r, t in pairs:
            values[r.id] = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
            if not bool(torch.isfinite(values[r.id]).all()):
                self.warn_nonfinite(r)

        def fill(pid, ptr):
            v = values[pid]
            ctypes.memmove(ptr, v.data_ptr(), v.numel() * 4)

        self.core.set_parameter_values(sorted(values), fill)
        self.values_set()

    def values_set(self):
        """Parameter values were set or loaded: the next optimizer step is the first on them."""
        self.micro.values_set()

    @staticmethod
    def warn_nonfinite(p):
        _zinf.log_warning("parameter '%s' is being set to values that hold inf or NaN; the next "
                          "optimizer step will stop on them" % p.names[0])
