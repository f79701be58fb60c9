"""The tensor subclasses torch code meets: ZinfParameter (a managed parameter) and Snapshot (a
copy of its values taken outside its module's forward). Each sorts the torch calls made on it
(_calls.py) and hands those that need the engine to the engine's ParamAccess (_access.py, whose
docstring says what each kind of call does).
"""
import collections
import enum
import weakref

import torch

from ._calls import (DISABLE, META, WRITE, base_data, call_tensors, classify, plain,
                     replace_tensor, set_base_data, storage_ptr, written_tensors)
from ._errors import error
from ._module_hooks import frozen_at_initialize, unfrozen_error


# ---- ZinfParameter ---------------------------------------------------------------------------


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's states of a ZeRO-3 parameter (deepspeed.runtime.zero.partition_parameters
    re-exports this one): a ZinfParameter is AVAILABLE while its module's forward runs or inside
    GatheredParameters, NOT_AVAILABLE otherwise."""
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


class ZinfParameter(torch.nn.Parameter):
    """A parameter whose values live in a zinf engine (see _access.py's docstring).

    DeepSpeed's ZeRO-3 attributes, which Hugging Face's peft and DeepSpeed-Chat read: ds_id (its
    id in the engine), ds_status, ds_numel and ds_shape (the whole parameter's: a ZinfParameter
    keeps its shape). No ds_tensor: its numel() is the whole count already."""

    @property
    def ds_id(self):
        return self.__dict__["_zinf_rec"].id

    @property
    def ds_status(self):
        rec = self.__dict__["_zinf_rec"]
        return ZeroParamStatus.AVAILABLE if rec.gathered or rec.state.in_forward else \
            ZeroParamStatus.NOT_AVAILABLE

    @property
    def ds_numel(self):
        return self.__dict__["_zinf_rec"].numel

    @property
    def ds_shape(self):
        return self.__dict__["_zinf_rec"].shape

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        kind = classify(func, kwargs)
        if kind != META:
            # (A parameter inside GatheredParameters holds its values as an ordinary tensor.)
            managed = [t for t in call_tensors(args, kwargs)
                       if type(t) is ZinfParameter and t.__dict__.get("_zinf_rec") is not None
                       and not t._zinf_rec.gathered]
            if managed:
                access = _access_of(managed[0])
                if kind == WRITE:
                    written = [t for t in written_tensors(args, kwargs)
                               if any(t is m for m in managed)]
                    if written:
                        return access.write(func, args, kwargs, written, managed)
                if any(not t._zinf_rec.state.in_forward for t in managed):
                    return access.read(func, args, kwargs, managed)
        elif getattr(func, "__name__", "") in ("requires_grad_", "__set__"):
            _check_requires_grad(func, args, kwargs)
        with DISABLE():
            return func(*args, **kwargs)

    @property
    def data(self):
        rec = self.__dict__.get("_zinf_rec")
        if rec is None or rec.state.in_forward or rec.gathered:
            return base_data(self)
        # Outside its module's forward: a Snapshot of the values (a write to it reaches the
        # parameter; see _access.py's docstring).
        with torch.no_grad():
            return _access_of(self).read(torch.Tensor.detach, (self,), {}, [self])

    @data.setter
    def data(self, value):
        rec = self.__dict__.get("_zinf_rec")
        if rec is None:
            set_base_data(self, value)
            return
        if rec.gathered:  # GatheredParameters: into the gathered values
            with torch.no_grad():
                base_data(self).copy_(value)
            return
        _access_of(self).assign(self, value)

    def __repr__(self):
        if self.__dict__.get("_zinf_rec") is None:
            return torch.nn.Parameter.__repr__(self)
        values = plain(self.data).detach()
        return repr(torch.nn.Parameter(values, self.requires_grad))

    def __reduce_ex__(self, proto):
        # A pickled model or parameter carries the values, as an ordinary parameter.
        values = plain(self.data).detach().clone()
        return (torch._utils._rebuild_parameter,
                (values, self.requires_grad, collections.OrderedDict()))

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        out = torch.nn.Parameter(plain(self.data).detach().clone(), self.requires_grad)
        memo[id(self)] = out
        return out


def _check_requires_grad(func, args, kwargs):
    """Refuses requires_grad=True on a parameter registered frozen (trainability is fixed at
    zinf.initialize: see _module_hooks.py); freezing, and every other setter, passes."""
    if func.__name__ == "__set__":
        if getattr(getattr(func, "__self__", None), "__name__", "") != "requires_grad":
            return
        value = args[1]
    else:
        value = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
    param = args[0]
    rec = param.__dict__.get("_zinf_rec") if type(param) is ZinfParameter else None
    if not value or rec is None or not frozen_at_initialize(rec):
        return
    engine = rec.engine()
    if engine is None or _engine.context_of(engine).closed:
        return
    with DISABLE():
        if param.requires_grad:  # set past this check: the forward refuses it
            return
    raise unfrozen_error(rec.names, "requires_grad=True after zinf.initialize is refused")


def _engine_of(param):
    rec = param._zinf_rec
    engine = rec.engine()
    if engine is None:
        raise error("FailedPrecondition",
                    "parameter '%s' belonged to a zinf engine that no longer exists: its values "
                    "went with it (keep the engine, or close(restore=True) it to hand the "
                    "values back to torch)" % rec.names[0])
    return engine


def _access_of(param):
    return _engine.access_of(_engine_of(param))


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
            return plain(args[0]).__reduce_ex__(*args[1:])
        if name == "__deepcopy__":
            return plain(args[0]).clone()
        kind = classify(func, kwargs)
        if kind == WRITE:
            snaps = [t for t in written_tensors(args, kwargs) if isinstance(t, Snapshot)]
            if snaps:
                return _write_snapshot(func, args, kwargs, snaps[0])
        snaps = [t for t in call_tensors(args, kwargs) if isinstance(t, Snapshot)]
        with DISABLE():
            out = func(*args, **kwargs)
        if kind == META or not snaps:
            return out
        return _wrap_views(out, {storage_ptr(s): s for s in snaps})


def snapshot(values, param, whole):
    """A Snapshot over `values` (a fresh copy) of `param`."""
    with DISABLE():
        snap = values.as_subclass(Snapshot)
    snap._zinf_of = weakref.ref(param)
    snap._zinf_whole = whole
    snap._zinf_name = param._zinf_rec.names[0]
    return snap


def is_whole(view, base_shape):
    return view.shape == base_shape and view.storage_offset() == 0 and view.is_contiguous()


def _wrap_views(out, sources):
    """Results of a call on Snapshots: views of a snapshot are snapshots (of the whole when
    they cover it), everything else stays an ordinary tensor."""
    if isinstance(out, torch.Tensor):
        src = sources.get(storage_ptr(out)) if out.numel() > 0 else None
        if src is None:
            return plain(out) if isinstance(out, Snapshot) else out
        with DISABLE():
            snap = out.as_subclass(Snapshot)
        snap._zinf_of = src._zinf_of
        snap._zinf_whole = src._zinf_whole and is_whole(out, src.shape)
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
    engine = _engine_of(param)
    access = _engine.access_of(engine)
    new_args = tuple(replace_tensor(a, snap, param) for a in args)
    new_kwargs = {k: replace_tensor(v, snap, param) for k, v in kwargs.items()}
    with torch.no_grad():  # a snapshot is detached, as the view it stands for
        access.write(func, new_args, new_kwargs, [param],
                     [t for t in call_tensors(new_args, new_kwargs) if type(t) is ZinfParameter])
    # The snapshot shows what the parameter holds now, as the view would.
    with DISABLE():
        snap.copy_(engine.gather(param).reshape(snap.shape))
    return snap


# Last: _engine imports this module (through _access); the functions above use it when called.
from . import _engine  # noqa: E402
