"""GatheredParameters (deepspeed.zero.GatheredParameters over zinf): inside the block every rank
holds the whole values of the given parameters as ordinary tensors (reads and in-place writes
act on them, no engine call); at its end, with modifier_rank set, the values of that rank are
sent to every rank (torch.distributed's default group) and every parameter whose values
changed is written into the engine on every rank (its fp32 master, its stores): DeepSpeed loses
such a write once the optimizer exists; zinf does not. Without modifier_rank the block's writes
are dropped, as in DeepSpeed. Collective: every rank enters and leaves the block together,
between optimizer steps, with no forward inside it.
"""
import torch

from .._calls import base_data, set_base_data
from .._engine import context_of
from .._errors import error


def _managed(params):
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        params = [params]
    out = []
    for p in params:
        if not isinstance(p, torch.Tensor):
            continue  # None (an absent bias), as DeepSpeed skips it
        if getattr(p, "_zinf_spill", None) is not None:
            raise error("FailedPrecondition",
                        "GatheredParameters before initialize: a parameter built under "
                        "zero.Init has handed its values to a spill file and holds none; set "
                        "its values in its module's constructor, or gather it after "
                        "deepspeed.initialize")
        rec = p.__dict__.get("_zinf_rec")
        if rec is not None and all(r is not rec for r in out):
            out.append(rec)
    return out


class GatheredParameters:
    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if fwd_module is not None:
            raise error("NotSupported", "GatheredParameters(fwd_module=...): zinf fetches a "
                                        "module's own parameters; no external registration")
        self.enabled = enabled
        self.modifier_rank = modifier_rank
        self.recs = _managed(params) if enabled else []
        self.before = {}

    def __enter__(self):
        if not self.recs:
            return self
        engines = {id(r.engine()): r.engine() for r in self.recs}
        if len(engines) != 1:
            raise error("InvalidArgument", "GatheredParameters: the parameters belong to %d "
                                           "engines; gather each engine's separately"
                        % len(engines))
        self.engine = next(iter(engines.values()))
        e = self.ctx = context_of(self.engine)
        names = ", ".join("'%s'" % r.names[0] for r in self.recs[:4])
        e.enter("GatheredParameters")
        if self.modifier_rank is not None:
            for r in self.recs:
                e.micro.check_writable(r, "GatheredParameters(modifier_rank=%d)"
                                       % self.modifier_rank, e.forward_running)
        e.between_steps("GatheredParameters(%s%s)" % (names, ", ..." if len(self.recs) > 4
                                                       else ""))
        for r in self.recs:
            if r.gathered:
                raise error("FailedPrecondition", "GatheredParameters: parameter '%s' is "
                                                  "already gathered (nested blocks over one "
                                                  "parameter)" % r.names[0])
        self.masters = {}
        self.shown = {}
        try:
            for r in self.recs:
                master = e.gather(r, torch.float32)
                values = master.to(dtype=r.dtype, device=e.device)
                self.masters[r.id] = master
                self.before[r.id] = values.clone()
                self.shown[r.id] = values
                set_base_data(r.param, values)
                r.gathered = True
        except BaseException:
            self._restore()
            raise
        e.gathered += 1
        return self

    def _restore(self):
        for r in self.recs:
            if r.gathered:
                set_base_data(r.param, r.placeholder)
                r.gathered = False

    def __exit__(self, exc_type, exc, tb):
        if not self.recs:
            return False
        e = self.ctx
        e.gathered -= 1
        try:
            for r in self.recs:
                held = base_data(r.param)
                if held.data_ptr() != self.shown[r.id].data_ptr() or \
                        held.shape != self.shown[r.id].shape:
                    raise error("Internal", "GatheredParameters: parameter '%s' lost its "
                                            "gathered values inside the block (nothing was "
                                            "written)" % r.names[0])
            if self.modifier_rank is None:
                return False
            now = {r.id: base_data(r.param).detach().clone() for r in self.recs}
            if e.world_size > 1:
                import torch.distributed as dist
                if not dist.is_initialized():
                    raise error("FailedPrecondition",
                                "GatheredParameters(modifier_rank=%d) with %d ranks sends rank "
                                "%d's values over torch.distributed: call "
                                "deepspeed.init_distributed() first"
                                % (self.modifier_rank, e.world_size, self.modifier_rank))
                on_gpu = dist.get_backend() == "nccl"
                # Every rank learns whether every rank finished its block before any value
                # moves: one that raised makes them all skip the write (none waits alone).
                ok = torch.tensor([0 if exc_type is not None else 1], dtype=torch.int32)
                ok = ok.cuda() if on_gpu else ok
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)
                if int(ok.item()) == 0:
                    if exc_type is not None:
                        return False
                    raise error("Aborted", "GatheredParameters(modifier_rank=%d): another rank "
                                           "raised inside the block; nothing was written"
                                % self.modifier_rank)
                for r in self.recs:
                    t = now[r.id].cuda() if on_gpu else now[r.id].cpu()
                    dist.broadcast(t, self.modifier_rank)
                    now[r.id] = t.to(e.device)
            elif exc_type is not None:
                return False
            changed = []
            for r in self.recs:
                mask = (now[r.id] != self.before[r.id]).cpu()
                if bool(mask.any()):
                    # Only the elements written change the fp32 master (a bf16 view of it
                    # would round every other element).
                    merged = self.masters[r.id].clone()
                    merged[mask] = now[r.id].cpu().float()[mask]
                    changed.append((r, merged))
            self._restore()
            if changed:
                e.set_values(changed)
        finally:
            self._restore()
        return False
