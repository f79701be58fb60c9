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

from . import _state
from ._calls import base_data, set_base_data
from ._optim import error


def _managed(params):
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        params = [params]
    out = []
    for p in params:
        rec = p.__dict__.get("_zinf_rec") if isinstance(p, torch.Tensor) else None
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
        e = next(iter(engines.values()))
        self.engine = e
        names = ", ".join("'%s'" % r.names[0] for r in self.recs[:4])
        e._enter("GatheredParameters")
        if self.modifier_rank is not None:
            for r in self.recs:
                e._micro.check_writable(r, "GatheredParameters(modifier_rank=%d)"
                                        % self.modifier_rank, bool(e._residency.stack))
        e._between_steps("GatheredParameters(%s%s)" % (names, ", ..." if len(self.recs) > 4
                                                       else ""))
        for r in self.recs:
            if r.gathered:
                raise error("FailedPrecondition", "GatheredParameters: parameter '%s' is "
                                                  "already gathered (nested blocks over one "
                                                  "parameter)" % r.names[0])
        try:
            for r in self.recs:
                values = _state.gather(e, r, r.dtype).to(e.device)
                self.before[r.id] = values.clone()
                set_base_data(r.param, values)
                r.gathered = True
        except BaseException:
            self._restore()
            raise
        return self

    def _restore(self):
        for r in self.recs:
            if r.gathered:
                set_base_data(r.param, r.placeholder)
                r.gathered = False

    def __exit__(self, exc_type, exc, tb):
        if not self.recs:
            return False
        e = self.engine
        try:
            if exc_type is not None or self.modifier_rank is None:
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
                for r in self.recs:
                    t = now[r.id].cpu() if dist.get_backend() == "gloo" else now[r.id]
                    dist.broadcast(t, self.modifier_rank)
                    now[r.id] = t.to(e.device)
            changed = [(r, now[r.id]) for r in self.recs
                       if not torch.equal(now[r.id], self.before[r.id])]
            self._restore()
            if changed:
                e._access._set_values(changed)
        finally:
            self._restore()
        return False
