"""zinf.checkpoint: activation checkpointing whose kept activations can leave device memory.

checkpoint(function, *args, **kwargs) runs function(*args, **kwargs) and keeps none of the
tensors autograd would save inside it: each is replaced by a numbered slot. In backward, the
first slot autograd asks for runs the function again from its inputs (with the forward's RNG
state) and the recomputed tensors fill the slots in order (torch's non-reentrant checkpoint
works the same way; the parameters the function uses are fetched again by the engine's hooks,
which chain to these). What a segment keeps from forward to backward is its inputs, the
boundary activations; where they wait is the config's "activation_checkpointing":

- neither option: in device memory, as torch's checkpoint keeps them;
- cpu_checkpointing: in host memory (pinned, copied asynchronously, on a GPU; on the host
  device they are in host memory already and stay where they are);
- nvme_checkpointing (zinf): on NVMe, through a swap store of their own in a folder made under
  nvme_path, staged through a pinned arena of buffer_bytes (the budget: a tensor is cut into
  chunks of a quarter of it, and a write waits for an earlier one when the arena is full).

In backward, segments are recomputed in the reverse order of the forward; with NVMe, when one
starts, the inputs of the prefetch_depth segments before it are read back (within half the
staging arena), so that their reads overlap its recomputation and backward. With
cpu_checkpointing on a GPU the copy back is issued when the segment needs it (asynchronous to
the host, on the current stream); it is not prefetched.

One configuration is current at a time: the last zinf.initialize with an
"activation_checkpointing" block (or zinf.checkpointing.configure) sets it for every
zinf.checkpoint call; without one, boundaries stay in device memory.

partition_activations (DeepSpeed: split activations across model-parallel ranks) has nothing
to split with one rank per process, and DeepSpeed's contiguous_memory_optimization,
number_checkpoints, synchronize_checkpoint_boundary and profile have no effect here: they
are accepted and said so once.
"""
import os
import weakref

import torch

from . import _zinf
from ._activation_store import ActivationStore
from ._autograd import ChainedHooks
from ._errors import error

_DEEPSPEED_NO_EFFECT = ("contiguous_memory_optimization", "number_checkpoints",
                        "synchronize_checkpoint_boundary", "profile")
_KEYS = ("partition_activations", "cpu_checkpointing", "nvme_checkpointing", "nvme_path",
         "buffer_bytes", "prefetch_depth") + _DEEPSPEED_NO_EFFECT


class Settings:
    """The "activation_checkpointing" block, checked."""

    def __init__(self, where="memory", nvme_path=None, buffer_bytes=256 << 20, prefetch_depth=2):
        self.where = where  # "memory", "cpu" or "nvme"
        self.nvme_path = nvme_path
        self.buffer_bytes = buffer_bytes
        self.prefetch_depth = prefetch_depth

    @classmethod
    def from_config(cls, block, nvme_paths):
        if block is None:
            return None
        prefix = "activation_checkpointing"
        if not isinstance(block, dict):
            raise error("InvalidArgument", "%s: expected an object" % prefix)
        for key in block:
            if key not in _KEYS:
                raise error("InvalidArgument", "%s.%s: unknown key (known: %s)"
                            % (prefix, key, ", ".join(_KEYS)))
        for key in ("partition_activations", "cpu_checkpointing", "nvme_checkpointing",
                    "contiguous_memory_optimization", "synchronize_checkpoint_boundary",
                    "profile"):
            if key in block and not isinstance(block[key], bool):
                raise error("InvalidArgument", "%s.%s: expected true or false, got %r"
                            % (prefix, key, block[key]))
        noted = [k for k in ("partition_activations",) + _DEEPSPEED_NO_EFFECT
                 if block.get(k) not in (None, False)]
        if noted:
            _zinf.log_info("%s: %s accepted with no effect (one rank per process: nothing to "
                           "partition; the others are Megatron's layout options)"
                           % (prefix, ", ".join(noted)))
        cpu, nvme = block.get("cpu_checkpointing", False), block.get("nvme_checkpointing", False)
        if cpu and nvme:
            raise error("InvalidArgument", "%s: cpu_checkpointing and nvme_checkpointing are "
                                           "both set; choose one" % prefix)
        s = cls("nvme" if nvme else "cpu" if cpu else "memory")
        if "buffer_bytes" in block:
            v = block["buffer_bytes"]
            if isinstance(v, str):
                v = _zinf.parse_byte_size(v, prefix + ".buffer_bytes")
            if isinstance(v, bool) or not isinstance(v, int) or v < (4 << 20):
                raise error("InvalidArgument", "%s.buffer_bytes: a byte size of at least 4M, "
                                               "got %r" % (prefix, block["buffer_bytes"]))
            s.buffer_bytes = v
        if "prefetch_depth" in block:
            v = block["prefetch_depth"]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise error("InvalidArgument", "%s.prefetch_depth: an integer >= 0, got %r"
                            % (prefix, v))
            s.prefetch_depth = v
        if nvme:
            path = block.get("nvme_path") or (nvme_paths[0] if nvme_paths else None)
            if not path:
                raise error("InvalidArgument", "%s.nvme_path: nvme_checkpointing needs a folder "
                                               "(or an offload nvme_path to use)" % prefix)
            if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
                raise error("InvalidArgument", "%s.nvme_path %s: not a writable folder"
                            % (prefix, path))
            s.nvme_path = path
        return s


_store = None  # the ActivationStore of the settings configured last


def configure(settings, engine=None):
    """Makes `settings` (Settings, or None for none) what zinf.checkpoint uses from now on."""
    global _store
    if settings is None:
        _store = None
        return None
    device = engine.device if engine is not None else torch.device("cpu")
    _store = ActivationStore(settings, device)
    return _store


def current_store():
    return _store


# ---- Segments ---------------------------------------------------------------------------------


class _Slot:
    __slots__ = ("index", "__weakref__")

    def __init__(self, index):
        self.index = index


class _Segment:
    """One checkpointed call: what it keeps, its slots, and its recomputation."""

    def __init__(self, store, function, args, kwargs):
        self.store = store
        self.function = function
        self.kwargs = kwargs
        self.args = []  # non-tensor arguments as they are; tensors as None
        self.kept = []  # _Kept per tensor argument (None elsewhere)
        for a in args:
            if isinstance(a, torch.Tensor):
                self.args.append(None)
                self.kept.append(store.keep(a))
            else:
                self.args.append(a)
                self.kept.append(None)
        self.slots = []  # weakrefs to the forward's slots, in order
        self.storage = weakref.WeakKeyDictionary()
        self.recomputed = False
        self.done = False
        self.rng = torch.get_rng_state()
        self.cuda_rng = None
        self.devices = []
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.devices = list(range(torch.cuda.device_count()))
            self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.grad_enabled = torch.is_grad_enabled()

    def pack(self, t):
        slot = _Slot(len(self.slots))
        self.slots.append(weakref.ref(slot))
        return slot

    def unpack(self, slot):
        if not self.recomputed:
            self.recompute()
        try:
            return self.storage[slot]
        except KeyError:
            raise error("Internal", "zinf.checkpoint: a saved tensor was asked for twice after "
                                    "its segment's backward (retain_graph with a checkpointed "
                                    "segment is not supported)") from None

    def recompute(self):
        store = self.store
        store.prefetch_before(self)
        inputs = []
        for a, k in zip(self.args, self.kept):
            if k is None:
                inputs.append(a)
            else:
                t = store.restore(k)
                inputs.append(t.detach().requires_grad_(k.requires_grad))
        self.kept = [None] * len(self.kept)
        counter = [0]

        def inner_pack(t):
            i = counter[0]
            counter[0] += 1
            if i < len(self.slots):
                slot = self.slots[i]()
                if slot is not None:
                    self.storage[slot] = t.detach()
            return None

        def inner_unpack(x):
            raise error("Internal", "zinf.checkpoint: the recomputation's own graph was used")

        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.rng)
            if self.cuda_rng is not None:
                for d, state in zip(self.devices, self.cuda_rng):
                    torch.cuda.set_rng_state(state, d)
            with torch.enable_grad(), ChainedHooks(inner_pack, lambda x: x):
                self.function(*inputs, **self.kwargs)
        self.recomputed = True
        self.done = True
        if counter[0] != len(self.slots):
            raise error("FailedPrecondition",
                        "zinf.checkpoint: the segment saved %d tensors in forward and %d when "
                        "it ran again in backward; a checkpointed function must compute the "
                        "same way each time (same inputs, no branch on global state)"
                        % (len(self.slots), counter[0]))

    def __del__(self):
        for k in self.kept:
            if k is not None:
                try:
                    self.store.drop(k)
                except Exception:  # interpreter shutdown
                    pass


def checkpoint(function, *args, **kwargs):
    """Runs function(*args, **kwargs) without keeping its activations for backward; they are
    recomputed then, and the tensor arguments (the boundary activations) wait where the config's
    activation_checkpointing says (see the module docstring). `use_reentrant` and
    `preserve_rng_state` are accepted for torch's signature (the RNG state is always kept;
    there is no reentrant mode)."""
    kwargs.pop("use_reentrant", None)
    kwargs.pop("preserve_rng_state", None)
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    store = _store if _store is not None else _default_store()
    segment = _Segment(store, function, args, kwargs)
    store.added(segment)
    with torch.autograd.graph.saved_tensors_hooks(segment.pack, segment.unpack):
        return function(*args, **kwargs)


_default = None


def _default_store():
    global _default
    if _default is None:
        _default = ActivationStore(Settings(), "cpu")
    return _default
