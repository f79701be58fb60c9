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

The engine keeps acquired memory, placeholders and releases (_residency.py); this module
decides what a call is (_calls.py) and which of the engine's paths serves it.
"""
import weakref

import torch

# base_data stays reachable as zinf._access.base_data (tests read the placeholder through it).
from ._calls import DISABLE, base_data, plain, set_base_data, storage_ptr  # noqa: F401
from ._errors import error
from ._residency import Frame
from ._subclasses import Snapshot, is_whole, snapshot


# ---- ParamAccess: one per engine ------------------------------------------------------------


class ParamAccess:
    """Serves the reads and writes of an engine's parameters outside its module hooks.

    The model holds it (its load_state_dict), so it holds the engine's context and
    collaborators weakly: a dropped engine's core goes with it, and so does its residency,
    whose frames a model called directly may have left behind (a parameter read then says
    the engine is gone instead of acquiring through a dead one)."""

    def __init__(self, ctx, residency, packing):
        self._ctx = weakref.ref(ctx)
        self._residency = weakref.ref(residency)
        self._packing = weakref.ref(packing)
        self._batch = None  # {param id: (record, source tensor)} while load_state_dict runs

    @property
    def ctx(self):
        return self._ctx()

    # -- Reads

    def read(self, func, args, kwargs, managed):
        e = self.ctx
        recs = []
        for t in managed:
            if t._zinf_rec not in recs:
                recs.append(t._zinf_rec)
        e.enter("reading parameter '%s'" % recs[0].names[0])
        need = [r for r in recs if not r.state.in_forward]
        grad = torch.is_grad_enabled() and any(r.param.requires_grad for r in need)
        # Outside a forward a read starts no micro-step: an inference acquire, unless a
        # backward runs (its acquires are training ones).
        residency = self._residency()
        inference = (not residency.traced) if residency.stack else not e.micro.in_backward
        if not residency.stack and not e.micro.in_backward and need:
            e.between_steps("read parameter %s outside a forward"
                             % ", ".join("'%s'" % r.names[0] for r in need))
        if inference:
            e.micro.check_inference_read(need[0])
        frame = Frame()
        residency.acquire_forward(need, frame, inference=inference)
        try:
            hooks = None
            packing = self._packing()
            if grad and not packing.own_hooks_innermost():
                hooks = packing.hooks()
            if hooks is not None:
                with hooks:
                    with DISABLE():
                        out = func(*args, **kwargs)
            else:
                with DISABLE():
                    out = func(*args, **kwargs)
            return self._copy_views(out, {r.live_ptr: r for r in need})
        finally:
            residency.release_forward(frame)

    def _copy_views(self, out, fetched):
        """A result over the memory fetched for one call becomes a Snapshot (a copy)."""
        if isinstance(out, torch.Tensor):
            rec = fetched.get(storage_ptr(out)) if out.numel() > 0 else None
            if rec is None:
                return out
            whole = is_whole(out, rec.shape)
            with DISABLE():
                values = out.clone()
            return snapshot(values, rec.param, whole)
        if isinstance(out, (list, tuple)):
            return type(out)(self._copy_views(o, fetched) for o in out)
        return out

    # -- Writes

    def write(self, func, args, kwargs, written, managed):
        e = self.ctx
        recs = []
        for t in written:
            if t._zinf_rec not in recs:
                recs.append(t._zinf_rec)
        what = getattr(func, "__name__", "a write")
        e.enter("writing parameter '%s'" % recs[0].names[0])
        e.micro.check_writable(recs[0], what, e.forward_running)
        if self._batch is None:
            e.between_steps("write parameter %s (%s)"
                             % (", ".join("'%s'" % r.names[0] for r in recs), what))
        if self._batch is not None and what == "copy_" and len(recs) == 1 and \
                len(args) >= 2 and not kwargs and isinstance(args[1], torch.Tensor) and \
                args[1].shape == recs[0].shape:
            # load_state_dict: collected, loaded together when it returns.
            self._batch[recs[0].id] = (recs[0], args[1])
            return written[0]
        sources = [t for t in managed
                   if t._zinf_rec not in recs and not t._zinf_rec.state.in_forward]
        frame = Frame()
        residency = self._residency()
        if sources:
            residency.acquire_forward([t._zinf_rec for t in sources], frame,
                                            inference=True)
        scratch = {}
        try:
            for r in recs:
                values = e.gather(r, torch.float32)
                scratch[r.id] = values.to(e.device) if e.device.type != "cpu" else values
                set_base_data(r.param, scratch[r.id])
            with DISABLE():
                out = func(*args, **kwargs)
        finally:
            for r in recs:
                set_base_data(r.param, r.placeholder)
            residency.release_forward(frame)
        for r in recs:
            v = scratch[r.id]
            if v.shape != r.shape or v.dtype != torch.float32:
                raise error("InvalidArgument",
                            "%s on parameter '%s' would change its shape or dtype to %s %s; "
                            "zinf keeps a parameter's shape (nothing was written)"
                            % (what, r.names[0], tuple(v.shape), v.dtype))
        e.set_values([(r, scratch[r.id]) for r in recs])
        return written[0] if out is None else out

    def assign(self, param, value):
        """`param.data = value`: new values of the same shape, dtype and device."""
        rec = param._zinf_rec
        e = self.ctx
        e.enter("assigning parameter '%s'.data" % rec.names[0])
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
        e.micro.check_writable(rec, ".data =", e.forward_running)
        e.between_steps("write parameter '%s' (.data =)" % rec.names[0])
        e.set_values([(rec, plain(value).detach())])

    # -- load_state_dict

    def load_state_dict(self, original, state_dict, strict=True):
        """model.load_state_dict through the engine: the same keys, shapes and strictness as
        torch's; every copy torch makes into a parameter is collected and loaded in one pass
        when torch's load has checked everything, and nothing is loaded when it fails."""
        e = self.ctx
        e.enter("load_state_dict")
        if self._batch is not None:
            return original(state_dict, strict)
        e.between_steps("model.load_state_dict")
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
            e.set_values([batch[k] for k in sorted(batch)])
        return result
