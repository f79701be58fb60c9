"""ZinfEngine: a torch module's parameters and optimizer states in zinf's engine.

How a parameter is used (every nn.Module that owns parameters gets forward hooks):

- Outside the engine's forward and backward a parameter's data is a placeholder: a tensor of
  the parameter's shape and dtype over one NaN (stride 0). The parameter is a ZinfParameter:
  shape queries work, and any other torch call on it reads its real values or writes through
  the engine (_access.py); nothing computes with the placeholder.
- Forward: before a module runs, its own parameters are acquired (fetched to the engine's
  device, gathered) and `param.data` becomes a tensor over the engine's memory; after the
  module returns they go back to the placeholder and are released. A parameter read through
  another module (a tied head reading `self.wte.weight`) is acquired on that access and
  released when the module that read it returns.
- Autograd: while a module of the engine runs with gradients enabled (engine(...), a direct
  call of the model, a checkpointed segment recomputed in backward), every tensor autograd
  saves that lies in a parameter's memory (the weight a linear layer saves, a transposed view
  of it) is saved as a reference to the parameter, not as memory. In backward the reference
  acquires the parameter again and hands autograd a view of the memory it has now; the
  parameter is released once every reference to it is gone. So backward always reads the
  parameter's current memory, never memory the engine has reused. The hooks chain to other
  saved-tensor hooks (torch.utils.checkpoint, save_on_cpu, zinf.checkpoint): _autograd.py.
- The engine's memory is released only when torch holds no tensor over it any more (a view
  kept by the trainer keeps it acquired; step() then refuses to run, naming the parameter).
- Gradients: a parameter's gradient, summed over every use in the backward, goes to the
  engine (reduce-scatter, fp32 accumulators) and `param.grad` is cleared; the optimizer is
  zinf's, run by step() at accumulation boundaries. One gradient per parameter per micro-step:
  a second one (a backward without step()) is refused with what to do.
- Forward passes without gradients (torch.no_grad(), or eval()) acquire in inference mode:
  they neither record nor invalidate the prefetch trace and may come between steps.
- One thread drives an engine (the first that calls it); a call from another thread is
  refused before it changes anything.

ZinfEngine is a façade over collaborators, each owning its part of the state: ParamRegistry
(_registry.py: the managed parameters, registration), ManagedParam (_param.py: each one's
state, with checked transitions), Residency (_residency.py: what is acquired, for which
holder), Packing (_packing.py: saved tensors as references), ModuleHooks (_hooks.py: forward
and gradient hooks), MicroStep (_microstep.py: the accumulation window and its refusals),
Driver (_driver.py), ParamAccess (_access.py: reads and writes outside the hooks) and
_state.py (checkpoints, gather, full_state_dict).
"""
import os

import torch

from . import _autograd, _state, _zinf
from ._access import ParamAccess
from ._calls import set_base_data
from ._driver import Driver
from ._errors import ZinfError, error
from ._hooks import ModuleHooks
from ._microstep import MicroStep
from ._optim import GroupPlan, ZinfOptimizer
from ._packing import Packing
from ._registry import ParamRegistry
from ._residency import Residency


class ZinfEngine:
    """A model trained by zinf. Create it with zinf.initialize(model, config)."""

    def __init__(self, model, core, device, scale_wrt_gas=True, hyper=None,
                 client_optimizer=None, lr_scheduler=None, plan=None):
        self.module = model
        self.device = torch.device(device)
        self._core = core
        self._scale_wrt_gas = scale_wrt_gas
        self._gas = max(1, core.gradient_accumulation_steps)
        # Data parallelism across processes (zinf._distributed): each rank its own micro-batch,
        # gradients averaged over the ranks, as DeepSpeed does.
        self.rank = core.rank
        self.world_size = core.world_size
        self.local_rank = 0
        self._dtype = torch.bfloat16 if core.bf16 else torch.float32
        self._closed = False
        self._gathered = 0  # GatheredParameters blocks open (_gathered.py)
        self._stream = None  # the CUDA stream handle the engine orders against
        self._driver = Driver()
        self._registry = ParamRegistry()
        self._micro = MicroStep(self._gas)
        self._residency = Residency(self, self._registry, self._micro)
        self._packing = Packing(self._residency, self.device)
        self._hooks = ModuleHooks(self, self._registry, self._residency, self._packing,
                                  self._micro)
        self._access = ParamAccess(self)
        hyper = hyper or {}
        self._group_defaults = {"betas": tuple(hyper.get("betas", (0.9, 0.999))),
                                "eps": hyper.get("eps", 1e-8),
                                "weight_decay": hyper.get("weight_decay", 0.0)}
        # The parameter groups go to the engine before the parameters that name them.
        self._pushed = {}
        if plan is not None:
            for i, g in enumerate(plan.groups):
                self._push_group(i, g)
        _autograd.install()
        self._registry.register(self, model, plan.member if plan is not None else None)
        self._hooks.install(model)
        self._registry.adopt(model, self._access)
        params = self._registry.params
        trainable = [p.param for p in params if p.trainable]
        # Each parameter's group in registration order (-1: not trained), for checkpoints.
        self._group_of = [(plan.member.get(id(p.param), 0) if plan is not None else 0)
                          if p.trainable else -1 for p in params]
        if plan is None or client_optimizer is None and len(plan.groups) == 1:
            groups = trainable or [params[0].param]
            first = plan.groups[0] if plan is not None else {
                "lr": hyper.get("lr", 1e-3), "betas": tuple(hyper.get("betas", (0.9, 0.999))),
                "eps": hyper.get("eps", 1e-8), "weight_decay": hyper.get("weight_decay", 0.0)}
        else:
            by_group = [[] for _ in plan.groups]
            for p in params:
                g = plan.member.get(id(p.param))
                if g is not None:
                    by_group[g].append(p.param)
            groups = [dict(h, params=ps) for h, ps in zip(plan.groups, by_group)]
            first = plan.groups[0]
        self.optimizer = ZinfOptimizer(groups, hyper.get("type", "AdamW"), first["lr"],
                                       first["betas"], first["eps"], first["weight_decay"])
        if client_optimizer is not None:
            # One set of groups: a scheduler made on the trainer's own optimizer moves zinf's
            # hyperparameters (DeepSpeed's wrapper shares them the same way).
            self.optimizer.param_groups = client_optimizer.param_groups
        # A factory (DeepSpeed accepts one) gets the optimizer.
        self.lr_scheduler = lr_scheduler(self.optimizer) if callable(lr_scheduler) else \
            lr_scheduler
        self._sync_lr()

    def _ensure_registered(self):
        if not self._registry.registered:
            self._registry.finish(self._core)

    def _enter(self, what):
        """The checks every entry point makes before changing anything."""
        if self._closed:
            raise error("FailedPrecondition",
                        "%s: this zinf engine was closed (its parameters hold no values unless "
                        "it was closed with restore=True)" % what)
        self._driver.check(what)
        self._ensure_registered()

    def _between_steps(self, action):
        """With several ranks: the ranks compare what they are about to do (one small
        collective) before a path that issues collectives of its own (a forward's gathers, a
        step, a read, write or load of parameters outside a forward). A rank that takes
        another path (rank 0 alone prints a weight, loads a state dict, saves a checkpoint)
        is refused on every rank, naming both paths, instead of pairing its collectives with
        the others' unrelated ones (an abort inside gloo, or a wait for the timeout)."""
        if self.world_size > 1:
            self._core.compare_across_ranks(
                "what they do next", "next: " + action,
                "A managed parameter is partitioned across the ranks, so a forward, a step, "
                "and every read, write, gather, save or load of parameters outside a forward "
                "is a step every rank takes together: do it on every rank alike (to print or "
                "save on one rank, gather on every rank first).")

    def _check_open(self):
        if self._closed:
            raise error("FailedPrecondition", "this zinf engine was closed")
        self._driver.check("a call")

    # ---- Forward and backward -----------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        self._enter("engine(...)")
        try:
            return self.module(*args, **kwargs)
        except BaseException:
            self._residency.unwind()
            raise

    forward = __call__

    def backward(self, loss, retain_graph=False):
        """loss.backward(), with the loss divided by gradient_accumulation_steps (gradients are
        summed over an accumulation window; pass scale_wrt_gas=False to initialize to keep the
        loss as is) and, with several ranks, by the world size (gradients are averaged over the
        ranks, as DeepSpeed's). One backward per micro-step."""
        self._enter("engine.backward")
        self._between_steps("engine.backward")
        self._sync_lr()
        self._micro.losses.append(loss.detach())
        if self._scale_wrt_gas and self._gas > 1:
            loss = loss / self._gas
        if self.world_size > 1:
            loss = loss / self.world_size
        self._micro.in_backward = True
        try:
            loss.backward(retain_graph=retain_graph)
        finally:
            self._micro.in_backward = False
        self._residency.end_backward()
        self._micro.backwards += 1

    # ---- Steps --------------------------------------------------------------------------------

    def step(self, lr_kwargs=None):
        """Ends a micro-step; at an accumulation boundary zinf's optimizer updates every
        parameter that got a gradient, then the learning-rate scheduler (if any) steps.
        Returns the step's statistics (a dict)."""
        self._enter("engine.step")
        self._between_steps("engine.step()")
        self._residency.unwind()
        self._residency.end_backward()
        self._core.drain()
        views = self._core.views()
        if views:
            params = self._registry.params
            names = ", ".join("'%s'" % params[i].names[0] for i in sorted(views))
            raise ZinfError(
                "a tensor still views the memory of parameter(s) %s outside their module's "
                "forward (a parameter, or a view of it, was kept: in a list, as an output, or by "
                "a graph built outside engine(...)); zinf cannot update memory torch still "
                "reads: drop the reference, or keep a .clone()" % names)
        self._hooks.check_no_stray_grads()
        self._sync_lr()
        try:
            stats = self._core.step()
        except ZinfError as e:
            raise self._micro.explain_step_failure(e) from e
        self._micro.ended(stats["optimizer_ran"])
        if stats["optimizer_ran"] and self.lr_scheduler is not None:
            # torch's schedulers count optimizer.step() calls and warn when they see none;
            # zinf's optimizer step ran inside this call.
            opt = getattr(self.lr_scheduler, "optimizer", None)
            if opt is not None and hasattr(opt, "_step_count"):
                opt._step_count += 1
            self.lr_scheduler.step(**(lr_kwargs or {}))
            self._sync_lr()
        return stats

    def _values_set(self):
        """Parameter values were set or loaded: the next optimizer step is the first on them."""
        self._micro.values_set()

    def _warn_nonfinite(self, p):
        _zinf.log_warning("parameter '%s' is being set to values that hold inf or NaN; the next "
                          "optimizer step will stop on them" % p.names[0])

    def zero_grad(self):
        """DeepSpeed's engine.zero_grad(): zinf keeps gradients in its own accumulators (an
        accumulation window's are summed until the optimizer runs, then cleared by it), so
        this only drops any .grad torch left on a parameter."""
        self._check_open()
        with torch._C.DisableTorchFunction():
            for p in self._registry.params:
                p.param.grad = None

    def is_gradient_accumulation_boundary(self):
        """Whether the next step() ends an accumulation window (runs the optimizer)."""
        return self._micro.is_boundary()

    def set_lr(self, lr):
        """The learning rate of the optimizer steps from the next micro-step on."""
        for group in self.optimizer.param_groups:
            group["lr"] = float(lr)
        self._sync_lr()

    def get_lr(self):
        """[the learning rate of the next optimizer step] (DeepSpeed's list shape)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def _push_group(self, i, h):
        key = (h["lr"], tuple(h["betas"]), h["eps"], h["weight_decay"])
        if self._pushed.get(i) != key:
            self._core.set_param_group(i, h["lr"], h["betas"][0], h["betas"][1], h["eps"],
                                       h["weight_decay"])
            self._pushed[i] = key

    def _group_hypers(self):
        """Each optimizer group's hyperparameters (lr, betas, eps, weight_decay)."""
        return [GroupPlan.hyper(g, self._group_defaults, "optimizer param group %d" % i)
                for i, g in enumerate(self.optimizer.param_groups)]

    def _sync_lr(self):
        """Hands each optimizer group's hyperparameters to zinf's optimizer when they changed
        (a scheduler, or a trainer writing param_groups[i][key])."""
        groups = self.optimizer.param_groups
        if len(groups) != self._core.num_param_groups:
            raise error("NotSupported",
                        "the optimizer holds %d param groups and zinf's engine %d: groups are "
                        "fixed when the engine is built (pass every group to initialize)"
                        % (len(groups), self._core.num_param_groups))
        for i, h in enumerate(self._group_hypers()):
            self._push_group(i, h)

    @property
    def global_step(self):
        """Optimizer steps taken (accumulation boundaries)."""
        return self._core.global_step

    @property
    def global_steps(self):
        """DeepSpeed's name for global_step."""
        return self._core.global_step

    def param_updates(self, param):
        """The optimizer updates applied to a parameter (torch's state["step"])."""
        return self._core.param_updates(self._managed(param).id)

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        self.module.eval()
        return self

    # ---- State ----------------------------------------------------------------------------------

    def _persistent_buffers(self):
        return _state.persistent_buffers(self.module)

    def save_checkpoint(self, save_dir, client_state=None):
        """Saves the optimizer states, the step counters, the learning rate and scheduler, the
        model's persistent buffers and `client_state` (JSON-serialisable: data position...)
        into `save_dir` (atomically: the previous checkpoint stays valid until this one is
        complete)."""
        self._enter("save_checkpoint")
        self._save(str(save_dir), client_state)

    def _save(self, path, client_state, extra=None):
        self._between_steps("save the checkpoint %s" % os.path.basename(path.rstrip("/")))
        _state.save(self, path, client_state, extra)

    def load_checkpoint(self, load_dir):
        """Restores the newest checkpoint in `load_dir`; returns its client_state."""
        self._enter("load_checkpoint")
        user = self._load(str(load_dir))
        return None if user is None else user.get("client_state")

    def _load(self, path):
        self._between_steps("load the checkpoint %s" % os.path.basename(path.rstrip("/")))
        return _state.load(self, path)

    def resume_from_store(self):
        """With zinf.durable: continue from the swap store's last committed step (instead of
        initial values or a checkpoint). Call it right after initialize, before anything else.
        Buffers are not in the store: they keep the values the model was built with."""
        self._check_open()
        _state.resume_from_store(self)

    def _managed(self, param):
        return self._registry.managed(param)

    def gather(self, param, dtype=torch.float32):
        """A parameter's values (fp32 master; frozen: stored copy) as a new CPU `dtype` tensor."""
        self._enter("gather")
        rec = self._managed(param)
        self._between_steps("gather parameter '%s'" % rec.names[0])
        return _state.gather(self, rec, dtype)

    def full_state_dict(self, dtype=torch.float32):
        """The model's state_dict with the real parameter values (the fp32 masters, or cast to
        `dtype`) on the CPU, tied parameters under each of their names, buffers as they are.
        Holds the whole model in host memory: for large models export with
        zinf.save_safetensors instead."""
        self._enter("full_state_dict")
        return _state.full_state_dict(self, dtype)

    def parameters_info(self):
        """[(name, shape, numel, trainable)] of the managed parameters, in registration order."""
        return [(p.names[0], tuple(p.shape), p.numel, p.trainable) for p in self._registry.params]

    def close(self, restore=False):
        """Detaches the hooks and destroys the engine. With `restore`, every parameter first
        gets its fp32 master values back as ordinary torch memory (the whole model in host
        memory, in the parameter's dtype, on the engine's device) and is an ordinary
        nn.Parameter again, so the model can go on without zinf; otherwise the parameters hold
        no values (any use of them is refused, naming them)."""
        if self._closed:
            return
        self._driver.check("close")
        self._residency.unwind()
        self._residency.end_backward()
        params = self._registry.params
        if restore:
            self._ensure_registered()
            for p in params:
                set_base_data(p.param, self.gather(p.param).to(device=self.device, dtype=p.dtype))
                p.param.__class__ = torch.nn.Parameter
                del p.param._zinf_rec
        self._hooks.remove(self.module)
        self.module.__dict__.pop("load_state_dict", None)
        for p in params:
            p.param._zinf_engine = None
        self._closed = True
        self._core = None

    def __del__(self):
        try:
            if not self._closed:
                self._hooks.remove_handles()
        except Exception:  # interpreter shutdown: nothing left to detach
            pass
