"""Where zinf.checkpoint's boundary activations wait between forward and backward (device
memory, pinned host memory, or NVMe through a swap store of their own) and how they come back
(read ahead for the segments recomputed next). _activations.py's docstring gives the policy;
this module moves the bytes.
"""
import shutil
import tempfile
import weakref

import torch
from torch.utils import dlpack

from . import _zinf
from ._errors import error


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

