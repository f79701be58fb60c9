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
import shutil
import tempfile
import weakref

import torch
from torch.utils import dlpack

from . import _zinf
from ._autograd import ChainedHooks
from ._optim import error

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


# ---- Where the boundary activations wait ------------------------------------------------------


class _Kept:
    """One boundary tensor kept by a segment: the tensor, or where its bytes went."""

    __slots__ = ("tensor", "shape", "dtype", "device", "requires_grad", "chunks", "event",
                 "reads")

    def __init__(self, t):
        self.tensor = None
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.requires_grad = t.requires_grad
        self.chunks = []  # nvme: [(key, offset, nbytes, write ticket)]
        self.event = None  # cpu offload on a GPU: the copy's event
        self.reads = None  # nvme: [(block, ticket)] once read back


class ActivationStore:
    """Keeps boundary activations where the settings say, and brings them back."""

    def __init__(self, settings, device):
        self.settings = settings
        self.device = torch.device(device)
        self._swap = None
        self._folder = None
        self._keys = 0
        self._in_flight = []  # [(block, ticket)]: staging blocks whose write runs
        self._order = []  # weakrefs to segments, forward order
        self.stats = {"boundary_bytes": 0, "nvme_written": 0, "nvme_read": 0,
                      "prefetched": 0, "read_on_demand": 0}

    # -- NVMe plumbing

    def _open_swap(self):
        if self._swap is None:
            self._folder = tempfile.mkdtemp(prefix="zinf-activations-",
                                            dir=self.settings.nvme_path)
            self._swap = _zinf.ActivationSwap([self._folder], self.settings.buffer_bytes)
            weakref.finalize(self, ActivationStore._remove_folder, self._swap, self._folder)
        return self._swap

    @staticmethod
    def _remove_folder(swap, folder):
        """The store's swap files and folder go when the store does (or at exit)."""
        try:
            swap.close()
        except _zinf.ZinfError:
            pass
        shutil.rmtree(folder, ignore_errors=True)

    def _block(self, nbytes):
        """A pinned staging block, waiting for earlier transfers when the arena is full."""
        swap = self._swap
        while True:
            capsule = swap.buffer(nbytes)
            if capsule is not None:
                return dlpack.from_dlpack(capsule)
            if not self._in_flight:
                raise error("ResourceExhausted",
                            "activation_checkpointing.buffer_bytes (%s) has no room for %s of "
                            "staging while nothing is being written: raise buffer_bytes"
                            % (_zinf.format_bytes(swap.capacity), _zinf.format_bytes(nbytes)))
            block, ticket = self._in_flight.pop(0)
            swap.wait(ticket)
            del block

    def _reap(self):
        while self._in_flight and self._swap.done(self._in_flight[0][1]):
            block, ticket = self._in_flight.pop(0)
            self._swap.wait(ticket)

    def _chunk(self):
        return max(1 << 20, self.settings.buffer_bytes // 4)

    # -- Forward: keep

    def keep(self, t):
        k = _Kept(t)
        where = self.settings.where
        self.stats["boundary_bytes"] += t.numel() * t.element_size()
        if where == "memory" or (where == "cpu" and t.device.type == "cpu") or t.numel() == 0:
            k.tensor = t.detach()
            return k
        if where == "cpu":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t.detach(), non_blocking=True)
            k.event = torch.cuda.Event()
            k.event.record()
            k.tensor = host
            return k
        swap = self._open_swap()
        self._reap()
        data = t.detach().contiguous().view(-1).view(torch.uint8)
        if t.device.type == "cuda":
            torch.cuda.current_stream(t.device).synchronize()
        total = data.numel()
        chunk = self._chunk()
        for offset in range(0, total, chunk):
            n = min(chunk, total - offset)
            block = self._block(n)
            block[:n].copy_(data[offset:offset + n])
            if t.device.type == "cuda":
                torch.cuda.current_stream(t.device).synchronize()
            key = "a%d" % self._keys
            self._keys += 1
            ticket = swap.write(key, block.data_ptr(), n, block.numel())
            self._in_flight.append((block, ticket))
            k.chunks.append((key, offset, n, ticket))
            self.stats["nvme_written"] += n
        return k

    # -- Backward: bring back

    def start_read(self, k):
        """Prefetch: starts reading a kept tensor's chunks back (NVMe), as many as fit in half
        the staging arena (the other half stays for reads that cannot wait). Returns False
        when it could not start all of them (the rest are read when needed)."""
        if not k.chunks or k.reads is not None:
            return True
        swap = self._swap
        k.reads = {}
        for i, (key, offset, n, write_ticket) in enumerate(k.chunks):
            if swap.used + n > swap.capacity // 2:
                return False
            capsule = swap.buffer(n)
            if capsule is None:
                return False
            block = dlpack.from_dlpack(capsule)
            if not swap.done(write_ticket):
                self._wait_write(write_ticket)
            k.reads[i] = (block, swap.read(key, block.data_ptr(), block.numel(), False))
        return True

    def _wait_write(self, ticket):
        for i, (block, t) in enumerate(self._in_flight):
            if t == ticket:
                self._in_flight.pop(i)
                self._swap.wait(ticket)
                return
        self._swap.wait(ticket)

    def restore(self, k):
        """The kept tensor, back on its device (a new tensor the caller owns)."""
        if k.tensor is not None:
            t = k.tensor
            if t.device != k.device:
                if k.event is not None:
                    k.event.synchronize()
                t = t.to(k.device, non_blocking=True)
            return t
        swap = self._swap
        issued = k.reads if k.reads is not None else {}
        self.stats["prefetched" if issued else "read_on_demand"] += 1
        k.reads = None
        total = sum(n for _, _, n, _ in k.chunks)
        out = torch.empty(total, dtype=torch.uint8, device=k.device)
        done = set()

        def finish(i):
            block, ticket = issued.pop(i)
            swap.wait(ticket)
            key, offset, n, _ = k.chunks[i]
            out[offset:offset + n].copy_(block[:n])
            swap.remove(key)
            self.stats["nvme_read"] += n
            done.add(i)

        count = len(k.chunks)
        for i in range(count):
            # Reads for chunk i and as many after it as the arena holds (a pipeline).
            j = i
            while j < count:
                if j in issued or j in done:
                    j += 1
                    continue
                key, offset, n, write_ticket = k.chunks[j]
                capsule = swap.buffer(n)
                if capsule is None:
                    if j > i or i in issued or i in done:
                        break
                    # No room for the chunk needed now: finish a later chunk of ours, or a
                    # write still in flight, to free a block.
                    later = sorted(x for x in issued if x > i)
                    if later:
                        finish(later[0])
                    elif self._in_flight:
                        block, ticket = self._in_flight.pop(0)
                        swap.wait(ticket)
                        del block
                    else:
                        raise error("ResourceExhausted",
                                    "activation_checkpointing.buffer_bytes (%s) has no room for "
                                    "a %s read: raise buffer_bytes"
                                    % (_zinf.format_bytes(swap.capacity),
                                       _zinf.format_bytes(n)))
                    continue
                block = dlpack.from_dlpack(capsule)
                if not swap.done(write_ticket):
                    self._wait_write(write_ticket)
                issued[j] = (block, swap.read(key, block.data_ptr(), block.numel(), True))
                j += 1
            if i in issued:
                finish(i)
        k.chunks = []
        return out.view(k.dtype).view(k.shape)

    def drop(self, k):
        """A kept tensor nobody will restore (its segment's graph died)."""
        if k.chunks and self._swap is not None:
            reading = set(k.reads or {})
            for i, (key, offset, n, ticket) in enumerate(k.chunks):
                try:
                    self._wait_write(ticket)
                    if i not in reading:
                        self._swap.remove(key)
                except _zinf.ZinfError:
                    pass
            for i, (block, ticket) in (k.reads or {}).items():
                try:
                    self._swap.wait(ticket)
                    self._swap.remove(k.chunks[i][0])
                except _zinf.ZinfError:
                    pass
        k.chunks, k.reads, k.tensor = [], None, None

    # -- Segment order (for prefetch)

    def added(self, segment):
        self._order = [r for r in self._order if r() is not None and not r().done]
        self._order.append(weakref.ref(segment))

    def prefetch_before(self, segment):
        """Starts reading the inputs of the segments run just before `segment` in forward."""
        depth = self.settings.prefetch_depth
        if depth == 0 or self.settings.where != "nvme":
            return
        alive = [r() for r in self._order]
        alive = [s for s in alive if s is not None and not s.done and not s.recomputed]
        if segment not in alive:
            return
        i = alive.index(segment)
        for seg in reversed(alive[max(0, i - depth):i]):
            for k in seg.kept:
                if k is not None and not self.start_read(k):
                    return


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
