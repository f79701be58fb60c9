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
holder), Packing (_packing.py: saved tensors as references), ModuleHooks (_module_hooks.py:
forward and gradient hooks), MicroStep (_microstep.py: the accumulation window and its
refusals), Driver (_driver.py), ParamAccess (_access.py: reads and writes outside the hooks)
and _checkpoint.py (checkpoints, resuming from the store, full_state_dict). What they share
(the core, the entry checks) is one EngineContext (_context.py), handed to each at
construction: no other module reads the engine's private fields. Code that is handed an
engine by the user (zinf.load_safetensors, GatheredParameters, the DeepSpeed engine in _ds/)
reaches its context through context_of(engine).
"""
import warnings
import weakref

import torch

from . import _autograd, _checkpoint, _layer_major
from ._access import ParamAccess
from ._calls import set_base_data
from ._context import EngineContext
from ._driver import Driver
from ._errors import ZinfError, error
from ._microstep import MicroStep
from ._module_hooks import ModuleHooks
from ._optim import GroupSync, ZinfOptimizer
from ._packing import Packing
from ._registry import ParamRegistry
from ._residency import Residency


def context_of(engine):
    """`engine`'s EngineContext: for the package's code that is handed an engine (by the user,
    or through a parameter) rather than built by it."""
    return engine._ctx


def access_of(engine):
    """`engine`'s ParamAccess (what a ZinfParameter hands its reads and writes to)."""
    return engine._access


class ZinfEngine:
    """A model trained by zinf. Create it with zinf.initialize(model, config)."""

    def __init__(self, model, core, device, scale_wrt_gas=True, hyper=None,
                 client_optimizer=None, lr_scheduler=None, plan=None, stream=None):
        self.module = model
        self.device = torch.device(device)
        # Data parallelism across processes (zinf._distributed): each rank its own micro-batch,
        # gradients averaged over the ranks, as DeepSpeed does.
        self.rank = core.rank
        self.world_size = core.world_size
        self.local_rank = 0
        self._registry = ParamRegistry()
        gas = max(1, core.gradient_accumulation_steps)
        self._micro = MicroStep(gas, gas if core.layer_major else 1)
        self._residency = Residency(self, self._registry, self._micro)
        hyper = hyper or {}
        self._groups = GroupSync({"betas": tuple(hyper.get("betas", (0.9, 0.999))),
                                  "eps": hyper.get("eps", 1e-8),
                                  "weight_decay": hyper.get("weight_decay", 0.0)})
        # `stream`: the CUDA stream handle the engine orders against (None on the host device).
        self._ctx = ctx = EngineContext(
            core, self.device,
            torch.bfloat16 if core.bf16 else torch.float16 if core.fp16 else torch.float32,
            self._micro.gas, scale_wrt_gas, Driver(), self._registry, self._micro,
            self._residency, self._groups, weakref.WeakMethod(self._sync_lr), stream)
        self._packing = Packing(self._residency, self.device)
        self._hooks = ModuleHooks(ctx, model, self._residency, self._packing)
        self._access = ParamAccess(ctx, self._residency, self._packing)
        # The parameter groups go to the engine before the parameters that name them.
        if plan is not None:
            for i, g in enumerate(plan.groups):
                self._groups.push(core, i, g)
        _autograd.install()
        self._registry.register(ctx, self, model, plan.member if plan is not None else None)
        self._hooks.install(model)
        self._registry.adopt(model, self._access)
        params = self._registry.params
        trainable = [p.param for p in params if p.trainable]
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
        # (Read live: a checkpoint load or a skipped step changes it.)
        self.optimizer._loss_scale_source = weakref.WeakMethod(self._current_loss_scale)
        if client_optimizer is not None:
            # One set of groups: a scheduler made on the trainer's own optimizer moves zinf's
            # hyperparameters (DeepSpeed's wrapper shares them the same way).
            self.optimizer.param_groups = client_optimizer.param_groups
        # A factory (DeepSpeed accepts one) gets the optimizer.
        self.lr_scheduler = lr_scheduler(self.optimizer) if callable(lr_scheduler) else \
            lr_scheduler
        self._sync_lr()

    # ---- The context's fields, under the names the engine's own code (and tests) use -----------

    @property
    def _core(self):
        return self._ctx.core  # None once closed

    @property
    def _closed(self):
        return self._ctx.closed

    @property
    def _gas(self):
        return self._ctx.gas

    @property
    def _dtype(self):
        return self._ctx.dtype

    @property
    def _stream(self):
        return self._ctx.stream

    def _ensure_registered(self):
        self._ctx.ensure_registered()

    def _enter(self, what):
        """The checks every entry point makes before changing anything (EngineContext.enter)."""
        self._ctx.enter(what)

    def _between_steps(self, action):
        """With several ranks: the ranks agree on what they do next (see
        EngineContext.between_steps)."""
        self._ctx.between_steps(action)

    def _check_open(self):
        self._ctx.check_open()

    # ---- Forward and backward -----------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        self._enter("engine(...)")
        try:
            return self.module(*args, **kwargs)
        except BaseException:
            self._residency.unwind()
            raise

    forward = __call__

    def _current_loss_scale(self):
        return self._core.loss_scale

    @property
    def skipped_steps(self):
        """Optimizer steps skipped because their gradients overflowed (fp16; DeepSpeed's)."""
        return self._core.skipped_steps

    def backward(self, loss, retain_graph=False):
        """loss.backward(), with the loss divided by gradient_accumulation_steps (gradients are
        summed over an accumulation window; pass scale_wrt_gas=False to initialize to keep the
        loss as is) and, with several ranks, by the world size (gradients are averaged over the
        ranks, as DeepSpeed's); with fp16, multiplied by the loss scale (the engine divides the
        gradients by it). One backward per micro-step."""
        self._enter("engine.backward")
        if self._micro.span > 1:
            raise error("FailedPrecondition",
                        "engine.backward with zinf.schedule \"layer-major\" and %d accumulation "
                        "steps: the window's micro-batches go through engine.train_window("
                        "micro_batches, embed, blocks, head) (one call and one engine.step() per "
                        "window); or set zinf.schedule \"micro-batch\" to call backward and step "
                        "per micro-batch (nothing was run)" % self._gas)
        self._between_steps("engine.backward")
        self._sync_lr()
        self._micro.losses.append(loss.detach())
        if self._ctx.scale_wrt_gas and self._gas > 1:
            loss = loss / self._gas
        if self.world_size > 1:
            loss = loss / self.world_size
        if self._core.fp16:
            # fp16: the loss scaled (in fp32) so that small gradients survive in fp16; the
            # engine divides the gradients by the scale, and skips the step when they overflow.
            loss = loss.float() * self._core.loss_scale
        self._micro.in_backward = True
        try:
            loss.backward(retain_graph=retain_graph)
        finally:
            self._micro.in_backward = False
        self._residency.end_backward()
        self._micro.backwards += 1

    def train_window(self, micro_batches, embed, blocks, head):
        """zinf.schedule "layer-major": the forward and backward of a whole accumulation window
        (then call engine.step() once), each block run for every micro-batch before the next, so
        each parameter is fetched once per pass whatever gradient_accumulation_steps is.
        `micro_batches`: gradient_accumulation_steps (inputs, targets) pairs. The model must be a
        stack: `embed(inputs)` -> hidden states, `blocks` (modules, hidden -> hidden, in order),
        `head(hidden, targets)` -> the scalar loss (zinf.models.Llama.stack() gives the three).
        Each micro-batch's block inputs are kept; each block is run again in the backward to
        get its activations. The gradients are summed in micro-batch order, so the parameters
        are those of engine(...), engine.backward and engine.step() per micro-batch, bit for
        bit. Returns the micro-batches' losses (detached)."""
        return _layer_major.train_window(self, micro_batches, embed, blocks, head)

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
        skipped_before = self._core.skipped_steps
        try:
            stats = self._core.step()
        except ZinfError as e:
            raise self._micro.explain_step_failure(e) from e
        # fp16: a step whose gradients overflowed was skipped (no update; the scale lowered);
        # as DeepSpeed's, the learning-rate scheduler does not step then.
        overflow = bool(stats["optimizer_ran"]) and stats["skipped_steps"] > skipped_before
        self.optimizer.overflow = overflow
        self._micro.ended(stats["optimizer_ran"], applied=not overflow)
        if stats["optimizer_ran"] and not overflow and self.lr_scheduler is not None:
            # torch's schedulers count optimizer.step() calls and warn when they see none;
            # zinf's optimizer step ran inside this call.
            opt = getattr(self.lr_scheduler, "optimizer", None)
            if opt is not None and hasattr(opt, "_step_count"):
                opt._step_count += 1
            self.lr_scheduler.step(**(lr_kwargs or {}))
            self._sync_lr()
        return stats

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

    def _sync_lr(self):
        """Hands each optimizer group's hyperparameters to zinf's optimizer when they changed
        (a scheduler, or a trainer writing param_groups[i][key])."""
        self._groups.sync(self._core, self.optimizer.param_groups)

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

    # ---- Freeing device memory between phases --------------------------------------------------

    _OFFLOAD_BITS = {"lp_params": 1, "optim_states": 2, "hp_params": 2, "lp_grads": 4,
                     "contiguous_grad_buffer": 4}

    def offload_states(self, include=None, device="cpu", pin_memory=True, non_blocking=False):
        """DeepSpeed's engine.offload_states(): between optimizer steps, moves what zinf holds in
        device memory (parameter copies and device-tier partitions, device-stepped optimizer
        states, gradient accumulators) to host memory, so that the device memory in use drops
        to the model's own tensors (e.g. for generation in an RLHF loop). `include`: None (all)
        or OffloadStateTypeEnum members (or their names: "lp_params", "optim_states",
        "hp_params", "lp_grads", "contiguous_grad_buffer"). `device`: "cpu" or "nvme"
        (OffloadDeviceEnum or its name): "nvme" writes everything (include None, or every
        type) to a swap store of its own under the first nvme_path of the config (else
        ./zinf-swap) and releases the pinned host memory too
        (engine._core.pinned_memory["resident"] drops to 0); it always blocks, and any reload
        (a forward under no_grad too) reads everything back into host memory first.
        `non_blocking`: return once the copies are queued. reload_states() puts everything
        back; engine(...), backward, step and the checkpoint calls reload it
        first anyway."""
        self._enter("offload_states")
        dev = str(getattr(device, "value", device))
        if dev == "none":
            warnings.warn("offload_states(device='none'): nothing to do (DeepSpeed's behaviour)")
            return
        mask = 0
        for item in ([] if include is None else include):
            name = getattr(item, "value", item)
            if name not in self._OFFLOAD_BITS:
                raise error("InvalidArgument",
                            "offload_states(include=...): unknown state %r; expected one of %s"
                            % (name, ", ".join(sorted(self._OFFLOAD_BITS))))
            mask |= self._OFFLOAD_BITS[name]
        if include is None:
            mask = 7
        if mask == 0:
            return  # an empty include moves nothing
        self._between_steps("offload_states(include mask %d)" % mask)
        self._core.offload_states(mask, dev, bool(pin_memory), bool(non_blocking))

    def reload_states(self, non_blocking=False):
        """DeepSpeed's engine.reload_states(): puts back what offload_states moved (nothing to
        do when nothing is offloaded)."""
        self._enter("reload_states")
        self._core.reload_states(bool(non_blocking))

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        self.module.eval()
        return self

    # ---- State ----------------------------------------------------------------------------------

    def save_checkpoint(self, save_dir, client_state=None):
        """Saves the optimizer states, the step counters, the learning rate and scheduler, the
        model's persistent buffers and `client_state` (JSON-serialisable: data position...)
        into `save_dir` (atomically: the previous checkpoint stays valid until this one is
        complete)."""
        self._enter("save_checkpoint")
        _checkpoint.save(self._ctx, self, str(save_dir), client_state)

    def load_checkpoint(self, load_dir):
        """Restores the newest checkpoint in `load_dir`; returns its client_state."""
        self._enter("load_checkpoint")
        user = _checkpoint.load(self._ctx, self, str(load_dir))
        return None if user is None else user.get("client_state")

    def resume_from_store(self):
        """With zinf.durable: continue from the swap store's last committed step (instead of
        initial values or a checkpoint). Call it right after initialize, before anything else.
        Buffers are not in the store: they keep the values the model was built with."""
        self._check_open()
        _checkpoint.resume_from_store(self._ctx)

    def _managed(self, param):
        return self._registry.managed(param)

    def gather(self, param, dtype=torch.float32):
        """A parameter's values (fp32 master; frozen: stored copy) as a new CPU `dtype` tensor."""
        self._enter("gather")
        rec = self._managed(param)
        self._between_steps("gather parameter '%s'" % rec.names[0])
        return self._ctx.gather(rec, dtype)

    def full_state_dict(self, dtype=torch.float32):
        """The model's state_dict with the real parameter values (the fp32 masters, or cast to
        `dtype`) on the CPU, tied parameters under each of their names, buffers as they are.
        Holds the whole model in host memory: for large models export with
        zinf.save_safetensors instead."""
        self._enter("full_state_dict")
        return _checkpoint.full_state_dict(self._registry, self, dtype)

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
        self._ctx.driver.check("close")
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
        self._ctx.closed = True
        self._ctx.core = None

    def __del__(self):
        try:
            if not self._closed:
                self._hooks.remove_handles()
        except Exception:  # interpreter shutdown: nothing left to detach
            pass
