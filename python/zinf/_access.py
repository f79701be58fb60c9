"""Every way torch code reaches a managed parameter: reads see real values, writes reach zinf.

After zinf.initialize each managed parameter is a ZinfParameter (an nn.Parameter subclass).
While a module that uses it runs inside the engine's forward, it is acquired: an ordinary
parameter over the engine's memory, and torch calls on it pass straight through. Otherwise
its data is a placeholder (its shape and dtype over one NaN), and ParamAccess sorts each torch
call that involves it:

- metadata (shape, dtype, requires_grad, grad, hooks, ...): answered from the placeholder;
- a write (an in-place method such as zero_/fill_/copy_/normal_, `p[i] = v`, `p += x`, every
  torch.nn.init function, `p.data = t`, the copy_ of load_state_dict): applied to the fp32
  master through Engine::SetParameterValues, between optimizer steps; during a micro-step
  (between the first engine(...) and engine.step()) it is refused with a ZinfError, because
  the optimizer owns the values then;
- a read (any other call: p.sum(), p @ x, torch.save, repr, iteration, state_dict's detach):
  the parameter is acquired for the call and released after it; with gradients enabled the
  call runs under the engine's saved-tensor hooks, so its backward fetches the parameter again.
  A result that is a view of the parameter (p.detach(), p[0], p.data, state_dict()'s values)
  comes back as a Snapshot: a copy of the values of that moment. A write into a Snapshot of the
  whole parameter goes to the parameter (as torch's write through a view would); a write into
  a part of one is refused, since it could not reach the parameter.

The engine keeps acquired memory, placeholders and releases; this module decides what a call
is and which of the engine's paths serves it.
"""
import collections
import ctypes
import weakref

import torch

from ._autograd import ChainedHooks
from ._optim import error

_DISABLE = torch._C.DisableTorchFunction
_BASE_DATA = torch._C._TensorBase.data


def base_data(t):
    """t.data without zinf's property (the placeholder or the acquired memory)."""
    with _DISABLE():
        return _BASE_DATA.__get__(t)


def set_base_data(t, value):
    with _DISABLE():
        _BASE_DATA.__set__(t, value)


def storage_ptr(t):
    try:
        return t.untyped_storage().data_ptr()
    except AttributeError:  # torch < 2.0
        return t.storage().data_ptr()


# ---- What a torch call is ---------------------------------------------------------------------

META, READ, WRITE = "meta", "read", "write"

# Methods that neither read the values nor write them.
_META_METHODS = {
    "size", "dim", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
    "element_size", "get_device", "is_floating_point", "is_complex", "is_signed", "ndimension",
    "requires_grad_", "retain_grad", "register_hook", "__hash__", "__len__", "is_shared",
    "share_memory_", "_is_view", "has_names", "data_ptr", "untyped_storage", "storage",
    "_typed_storage", "is_set_to", "__setstate__", "_fix_weakref", "detach_", "is_pinned",
    "is_inference", "__sizeof__", "__dir__", "_register_access_hook", "dim_order",
    "_has_compatible_shallow_copy_type",
}
# Attribute getters that are views of the values (other getters are metadata).
_VIEW_GETTERS = {"T", "mT", "H", "mH", "real", "imag", "data"}
# In-place operators that do not end with "_".
_INPLACE_DUNDERS = {
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
    "__setitem__",
}
_cache = {}


def classify(func, kwargs):
    """META, READ or WRITE for a torch call (before looking at its arguments)."""
    if kwargs and kwargs.get("out") is not None:
        return WRITE
    kind = _cache.get(func)
    if kind is not None:
        return kind
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        attr = getattr(getattr(func, "__self__", None), "__name__", "")
        if name == "__get__":
            return READ if attr in _VIEW_GETTERS else META
        return WRITE if attr == "data" else META  # every other setter: grad, requires_grad
    if name in _META_METHODS:
        kind = META
    elif name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__")):
        kind = WRITE
    else:
        kind = READ
    try:
        _cache[func] = kind
    except TypeError:  # not hashable
        pass
    return kind


def _tensors(args, kwargs):
    """The tensors among a call's arguments (and one level inside lists and tuples)."""
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def _written(args, kwargs):
    """The tensors a write call writes: `out=`, or its first argument (a list for _foreach)."""
    if kwargs and kwargs.get("out") is not None:
        target = kwargs["out"]
    elif args:
        target = args[0]
    else:  # torch.nn.init passes its tensor by keyword
        target = next((kwargs[k] for k in ("tensor", "input", "self") if k in kwargs), None)
    if isinstance(target, (list, tuple)):
        return [t for t in target if isinstance(t, torch.Tensor)]
    return [target] if isinstance(target, torch.Tensor) else []


def _replace(obj, old, new):
    """`obj` (an argument) with the tensor `old` replaced by `new`, lists and tuples too."""
    if obj is old:
        return new
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace(o, old, new) for o in obj)
    return obj


# ---- ZinfParameter ---------------------------------------------------------------------------


class ZinfParameter(torch.nn.Parameter):
    """A parameter whose values live in a zinf engine (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        kind = classify(func, kwargs)
        if kind != META:
            managed = [t for t in _tensors(args, kwargs)
                       if type(t) is ZinfParameter and t.__dict__.get("_zinf_rec") is not None]
            if managed:
                access = _access_of(managed[0])
                if kind == WRITE:
                    written = [t for t in _written(args, kwargs)
                               if any(t is m for m in managed)]
                    if written:
                        return access.write(func, args, kwargs, written, managed)
                if any(t._zinf_rec.fwd_live is None for t in managed):
                    return access.read(func, args, kwargs, managed)
        with _DISABLE():
            return func(*args, **kwargs)

    @property
    def data(self):
        rec = self.__dict__.get("_zinf_rec")
        if rec is None or rec.fwd_live is not None:
            return base_data(self)
        # Outside its module's forward: a Snapshot of the values (a write to it reaches the
        # parameter; see the module docstring).
        with torch.no_grad():
            return _access_of(self).read(torch.Tensor.detach, (self,), {}, [self])

    @data.setter
    def data(self, value):
        rec = self.__dict__.get("_zinf_rec")
        if rec is None:
            set_base_data(self, value)
            return
        _access_of(self).assign(self, value)

    def __repr__(self):
        if self.__dict__.get("_zinf_rec") is None:
            return torch.nn.Parameter.__repr__(self)
        values = _plain(self.data).detach()
        return repr(torch.nn.Parameter(values, self.requires_grad))

    def __reduce_ex__(self, proto):
        # A pickled model or parameter carries the values, as an ordinary parameter.
        values = _plain(self.data).detach().clone()
        return (torch._utils._rebuild_parameter,
                (values, self.requires_grad, collections.OrderedDict()))

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        out = torch.nn.Parameter(_plain(self.data).detach().clone(), self.requires_grad)
        memo[id(self)] = out
        return out


def _access_of(param):
    rec = param._zinf_rec
    engine = rec.engine()
    if engine is None:
        raise error("FailedPrecondition",
                    "parameter '%s' belonged to a zinf engine that no longer exists: its values "
                    "went with it (keep the engine, or close(restore=True) it to hand the "
                    "values back to torch)" % rec.names[0])
    return engine._access


def _plain(t):
    with _DISABLE():
        return t.as_subclass(torch.Tensor)


# ---- Snapshot ---------------------------------------------------------------------------------


class Snapshot(torch.Tensor):
    """A copy of a parameter's values taken outside its module's forward (what a view of the
    parameter gives there). Computes like any tensor; an in-place write is sent to the
    parameter when the snapshot is the whole parameter, and refused when it is a part."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        name = getattr(func, "__name__", "")
        if name == "__reduce_ex__":  # torch.save / pickle: an ordinary tensor
            return _plain(args[0]).__reduce_ex__(*args[1:])
        if name == "__deepcopy__":
            return _plain(args[0]).clone()
        kind = classify(func, kwargs)
        if kind == WRITE:
            snaps = [t for t in _written(args, kwargs) if isinstance(t, Snapshot)]
            if snaps:
                return _write_snapshot(func, args, kwargs, snaps[0])
        snaps = [t for t in _tensors(args, kwargs) if isinstance(t, Snapshot)]
        with _DISABLE():
            out = func(*args, **kwargs)
        if kind == META or not snaps:
            return out
        return _wrap_views(out, {storage_ptr(s): s for s in snaps})


def _snapshot(values, param, whole):
    """A Snapshot over `values` (a fresh copy) of `param`."""
    with _DISABLE():
        snap = values.as_subclass(Snapshot)
    snap._zinf_of = weakref.ref(param)
    snap._zinf_whole = whole
    snap._zinf_name = param._zinf_rec.names[0]
    return snap


def _is_whole(view, base_shape):
    return view.shape == base_shape and view.storage_offset() == 0 and view.is_contiguous()


def _wrap_views(out, sources):
    """Results of a call on Snapshots: views of a snapshot are snapshots (of the whole when
    they cover it), everything else stays an ordinary tensor."""
    if isinstance(out, torch.Tensor):
        src = sources.get(storage_ptr(out)) if out.numel() > 0 else None
        if src is None:
            return _plain(out) if isinstance(out, Snapshot) else out
        with _DISABLE():
            snap = out.as_subclass(Snapshot)
        snap._zinf_of = src._zinf_of
        snap._zinf_whole = src._zinf_whole and _is_whole(out, src.shape)
        snap._zinf_name = src._zinf_name
        return snap
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_views(o, sources) for o in out)
    return out


def _write_snapshot(func, args, kwargs, snap):
    param = snap._zinf_of() if snap._zinf_whole else None
    if param is None or param.__dict__.get("_zinf_rec") is None:
        raise error("FailedPrecondition",
                    "this tensor is a copy of %s of parameter '%s', taken outside its module's "
                    "forward; writing it cannot change the parameter (torch's view would): "
                    "write the parameter itself (p.copy_(t) or p[i] = v under torch.no_grad(), "
                    "nn.init, model.load_state_dict)"
                    % ("the values" if snap._zinf_whole else "a part", snap._zinf_name))
    access = _access_of(param)
    new_args = tuple(_replace(a, snap, param) for a in args)
    new_kwargs = {k: _replace(v, snap, param) for k, v in kwargs.items()}
    with torch.no_grad():  # a snapshot is detached, as the view it stands for
        access.write(func, new_args, new_kwargs, [param],
                     [t for t in _tensors(new_args, new_kwargs) if type(t) is ZinfParameter])
    # The snapshot shows what the parameter holds now, as the view would.
    with _DISABLE():
        snap.copy_(access.engine.gather(param).reshape(snap.shape))
    return snap


# ---- ParamAccess: one per engine ------------------------------------------------------------


class ParamAccess:
    """Serves the reads and writes of an engine's parameters outside its module hooks."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)
        self._batch = None  # {param id: (record, source tensor)} while load_state_dict runs

    @property
    def engine(self):
        return self._engine()

    # -- Reads

    def read(self, func, args, kwargs, managed):
        e = self.engine
        recs = []
        for t in managed:
            if t._zinf_rec not in recs:
                recs.append(t._zinf_rec)
        e._enter("reading parameter '%s'" % recs[0].names[0])
        need = [r for r in recs if r.fwd_live is None]
        grad = torch.is_grad_enabled() and any(r.param.requires_grad for r in need)
        # Outside a forward a read starts no micro-step: an inference acquire, unless a
        # backward runs (its acquires are training ones).
        inference = (not e._traced) if e._stack else not e._in_backward
        if inference:
            e._check_inference_read(need[0])
        frame = e._new_frame()
        e._acquire_forward(need, frame, inference=inference)
        try:
            hooks = None
            if grad and not e._own_hooks_innermost():
                hooks = ChainedHooks(e._pack_hook, e._unpack_hook)
            if hooks is not None:
                with hooks:
                    with _DISABLE():
                        out = func(*args, **kwargs)
            else:
                with _DISABLE():
                    out = func(*args, **kwargs)
            return self._copy_views(out, {r.live_ptr: r for r in need})
        finally:
            e._release_forward(frame)

    def _copy_views(self, out, fetched):
        """A result over the memory fetched for one call becomes a Snapshot (a copy)."""
        if isinstance(out, torch.Tensor):
            rec = fetched.get(storage_ptr(out)) if out.numel() > 0 else None
            if rec is None:
                return out
            whole = _is_whole(out, rec.shape)
            with _DISABLE():
                values = out.clone()
            return _snapshot(values, rec.param, whole)
        if isinstance(out, (list, tuple)):
            return type(out)(self._copy_views(o, fetched) for o in out)
        return out

    # -- Writes

    def write(self, func, args, kwargs, written, managed):
        e = self.engine
        recs = []
        for t in written:
            if t._zinf_rec not in recs:
                recs.append(t._zinf_rec)
        what = getattr(func, "__name__", "a write")
        e._enter("writing parameter '%s'" % recs[0].names[0])
        e._check_writable(recs[0], what)
        if self._batch is not None and what == "copy_" and len(recs) == 1 and \
                len(args) >= 2 and not kwargs and isinstance(args[1], torch.Tensor) and \
                args[1].shape == recs[0].shape:
            # load_state_dict: collected, loaded together when it returns.
            self._batch[recs[0].id] = (recs[0], args[1])
            return written[0]
        sources = [t for t in managed if t._zinf_rec not in recs and t._zinf_rec.fwd_live is None]
        frame = e._new_frame()
        if sources:
            e._acquire_forward([t._zinf_rec for t in sources], frame, inference=True)
        scratch = {}
        try:
            for r in recs:
                values = e.gather(r.param)
                scratch[r.id] = values.to(e.device) if e.device.type != "cpu" else values
                set_base_data(r.param, scratch[r.id])
            with _DISABLE():
                out = func(*args, **kwargs)
        finally:
            for r in recs:
                set_base_data(r.param, r.placeholder)
            e._release_forward(frame)
        for r in recs:
            v = scratch[r.id]
            if v.shape != r.shape or v.dtype != torch.float32:
                raise error("InvalidArgument",
                            "%s on parameter '%s' would change its shape or dtype to %s %s; "
                            "zinf keeps a parameter's shape (nothing was written)"
                            % (what, r.names[0], tuple(v.shape), v.dtype))
        self._set_values([(r, scratch[r.id]) for r in recs])
        return written[0] if out is None else out

    def assign(self, param, value):
        """`param.data = value`: new values of the same shape, dtype and device."""
        rec = param._zinf_rec
        e = self.engine
        e._enter("assigning parameter '%s'.data" % rec.names[0])
        if isinstance(value, Snapshot) and value._zinf_of() is param and value._zinf_whole \
                and value._version == 0:
            return  # its own values, unchanged (model.float() or .to(the same device))
        if not isinstance(value, torch.Tensor):
            raise TypeError("parameter '%s'.data: expected a tensor, got %s"
                            % (rec.names[0], type(value).__name__))
        if value.shape != rec.shape or value.dtype != rec.dtype or value.device != e.device:
            raise error("InvalidArgument",
                        "parameter '%s'.data = a %s %s tensor on %s: zinf keeps it as %s %s on "
                        "%s; a parameter is not converted, moved or reshaped after "
                        "zinf.initialize (no model.to(), .half(), .cuda()). To set values, "
                        "assign a tensor of that shape, dtype and device, or use p.copy_(t) "
                        "under torch.no_grad()" % (rec.names[0], value.dtype, tuple(value.shape),
                                                   value.device, rec.dtype, tuple(rec.shape),
                                                   e.device))
        e._check_writable(rec, ".data =")
        self._set_values([(rec, _plain(value).detach())])

    def _set_values(self, pairs):
        """Hands fp32 copies of `pairs` [(record, tensor)] to the engine in one call."""
        e = self.engine
        values = {}
        for r, t in pairs:
            values[r.id] = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
            if not bool(torch.isfinite(values[r.id]).all()):
                e._warn_nonfinite(r)

        def fill(pid, ptr):
            v = values[pid]
            ctypes.memmove(ptr, v.data_ptr(), v.numel() * 4)

        e._core.set_parameter_values(sorted(values), fill)
        e._values_set()

    # -- load_state_dict

    def load_state_dict(self, original, state_dict, strict=True):
        """model.load_state_dict through the engine: the same keys, shapes and strictness as
        torch's; every copy torch makes into a parameter is collected and loaded in one pass
        when torch's load has checked everything, and nothing is loaded when it fails."""
        e = self.engine
        e._enter("load_state_dict")
        if self._batch is not None:
            return original(state_dict, strict)
        self._batch = {}
        try:
            try:
                result = original(state_dict, strict)
            except RuntimeError as err:
                raise error("InvalidArgument", "%s\n(zinf loads parameters all or nothing: no "
                                               "parameter was changed)" % err) from err
            batch = self._batch
        finally:
            self._batch = None
        if batch:
            self._set_values([batch[k] for k in sorted(batch)])
        return result
