"""Which saved-tensor hooks are active, so that zinf's hooks compose with other ones.

zinf saves a reference instead of a parameter's memory when autograd saves a tensor that lies
in it (_packing.py). Other code uses the same mechanism: torch.utils.checkpoint without
reentrance (torch 1.13 recomputes a segment inside its unpack hook, under hooks of its own
that record the recomputed tensors by their order), torch.autograd.graph.save_on_cpu,
zinf.checkpoint. torch keeps the hooks in a stack and calls only the innermost pair, with
no way to ask for the pair below, so zinf pushing its hooks over another pair would hide
that pair from every tensor saved meanwhile (and break a checkpoint's order bookkeeping).

torch pushes and pops every pair through two functions of torch._C._autograd, looked up at
call time; install() wraps them to keep a copy of the stack for each thread. zinf's hooks
call the pair below them first for every tensor (so the other code's bookkeeping sees every
tensor, in order), then keep their own reference for a parameter's memory and the other
code's packed value for anything else.

A pair pushed before install() ran is not seen; hooks of a thread that autograd propagates to
its own worker threads (a CUDA backward) are not seen there either. Both only make zinf push
over a pair it does not know, as it did before this module existed.
"""
import threading

import torch

_tls = threading.local()
_installed = False
_lock = threading.Lock()


def _stack():
    s = getattr(_tls, "stack", None)
    if s is None:
        s = _tls.stack = []
    return s


def install():
    """Wraps torch's push and pop of saved-tensor hooks (once per process)."""
    global _installed
    with _lock:
        if _installed:
            return
        mod = torch._C._autograd
        push, pop = mod._push_saved_tensors_default_hooks, mod._pop_saved_tensors_default_hooks

        def tracked_push(pack_hook, unpack_hook):
            push(pack_hook, unpack_hook)
            _stack().append((pack_hook, unpack_hook))

        def tracked_pop():
            pop()
            s = _stack()
            if s:
                s.pop()

        mod._push_saved_tensors_default_hooks = tracked_push
        mod._pop_saved_tensors_default_hooks = tracked_pop
        _installed = True


def innermost():
    """The (pack, unpack) pair autograd calls now on this thread, or None."""
    s = _stack()
    return s[-1] if s else None


class OuterPacked:
    """What zinf's pack hook keeps of a tensor it leaves to the pair below it."""

    __slots__ = ("unpack", "packed")

    def __init__(self, unpack, packed):
        self.unpack = unpack
        self.packed = packed


class ChainedHooks:
    """A saved_tensors_hooks context whose pack calls the pair that was innermost when it was
    entered, then `own(t)`: a value of its own, or None to keep the other pair's."""

    def __init__(self, own_pack, own_unpack):
        self._own_pack = own_pack
        self._own_unpack = own_unpack
        self._ctx = None

    def __enter__(self):
        outer = innermost()
        own_pack, own_unpack = self._own_pack, self._own_unpack
        if outer is None:
            # Never the tensor itself: a saved output would hold its own grad_fn, a cycle
            # through the graph that Python's collector cannot see (a graph that is never run
            # backward, a checkpoint's recomputation, would then live forever). A detached
            # alias has the same content, which is all autograd asks of an unpack hook.
            def pack(t):
                mine = own_pack(t)
                return t.detach() if mine is None else mine
        else:
            outer_pack, outer_unpack = outer

            def pack(t):
                theirs = outer_pack(t)
                mine = own_pack(t)
                return OuterPacked(outer_unpack, theirs) if mine is None else mine

        def unpack(x):
            if isinstance(x, OuterPacked):
                return x.unpack(x.packed)
            return own_unpack(x)

        pack.zinf_owner = own_pack  # which code's hooks these are (_packing.py asks)

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.__exit__(*exc)
        return False
