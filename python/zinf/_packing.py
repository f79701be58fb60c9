"""Autograd's saved tensors that lie in a parameter's memory, saved as references.

While a module of the engine runs with gradients enabled (engine(...), a direct call of the
model, a checkpointed segment recomputed in backward), every tensor autograd saves that lies in
a parameter's acquired memory (the weight a linear layer saves, a transposed view of it) is
saved as a SavedRef: the parameter, and the view's size, stride, offset and dtype. In backward
the reference acquires the parameter again (Residency.acquire_backward) and hands autograd a
view of the memory it has now; the parameter is released once every reference to it is gone.
So backward always reads the parameter's current memory, never memory the engine has reused.
The hooks chain to other saved-tensor hooks (torch.utils.checkpoint, save_on_cpu,
zinf.checkpoint): _autograd.py.
"""
import weakref

from . import _autograd
from ._errors import error


class SavedRef:
    """What autograd keeps of a saved tensor that lay in a parameter's memory."""

    __slots__ = ("residency", "p", "size", "stride", "offset", "dtype", "__weakref__")

    def __init__(self, residency, p, t):
        self.residency = weakref.ref(residency)
        self.p = p
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.dtype = t.dtype
        p.add_saved_ref()

    def __del__(self):
        unneeded = self.p.drop_saved_ref()
        residency = self.residency()
        if residency is not None and unneeded:
            residency.deferred.append(self.p)


def weak_hook(obj, method, orphan=None):
    """A hook that calls obj.method while obj lives, `orphan` (or nothing: None) after: what
    torch keeps of a hook (a module's, a graph's) never keeps an engine alive."""
    ref = weakref.ref(obj)

    def hook(*args):
        o = ref()
        if o is not None:
            return getattr(o, method)(*args)
        return orphan(*args) if orphan is not None else None

    return hook


def _unpack_orphan(saved):
    """The unpack of hooks whose engine is gone (a direct call of the model that raised leaves
    its hooks on torch's stack): what it saved as itself comes back; a reference into a dead
    engine's parameter cannot."""
    if isinstance(saved, SavedRef):
        raise error("FailedPrecondition",
                    "a tensor saved for backward lay in a parameter of a zinf engine that no "
                    "longer exists; run backward before dropping the engine")
    return saved


class Packing:
    """An engine's saved-tensor hooks (one per engine)."""

    def __init__(self, residency, device):
        self._residency = residency
        self._device = device

    def pack(self, t):
        """A reference for a saved tensor in a parameter's memory; None for anything else."""
        if t.device != self._device:
            return None
        p = self._residency.holder_of(t)
        if p is None:
            return None
        return SavedRef(self._residency, p, t)

    def unpack(self, saved):
        if not isinstance(saved, SavedRef):
            return saved
        p = saved.p
        if not p.state.in_backward:
            self._residency.acquire_backward(p)
        return p.backward_view(saved.size, saved.stride, saved.offset, saved.dtype)

    def hooks(self):
        """A saved_tensors_hooks context with this engine's pack and unpack, chained to the
        pair innermost when it is entered."""
        pack = weak_hook(self, "pack")
        pack.zinf_packing = weakref.ref(self)  # whose hooks these are (own_hooks_innermost)
        return _autograd.ChainedHooks(pack, weak_hook(self, "unpack", orphan=_unpack_orphan))

    def own_hooks_innermost(self):
        """Whether the saved-tensor hooks autograd calls now are this engine's."""
        top = _autograd.innermost()
        if top is None:
            return False
        ref = getattr(getattr(top[0], "zinf_owner", None), "zinf_packing", None)
        return ref is not None and ref() is self
