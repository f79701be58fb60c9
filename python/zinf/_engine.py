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
"""
import base64
import collections
import io
import json
import threading
import weakref

import torch
from torch.utils import dlpack

from . import _autograd, _zinf
from ._access import ParamAccess
from ._calls import base_data, set_base_data, storage_ptr
from ._optim import ZinfOptimizer, error
from ._subclasses import ZinfParameter

ZinfError = _zinf.ZinfError

FLOAT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def placeholder(shape, dtype, device):
    """A tensor of `shape` over one NaN (stride 0): what a parameter is between uses."""
    return torch.full((), float("nan"), dtype=dtype, device=device).expand(shape)


def _all_named_parameters(module, prefix=""):
    """Every (name, parameter) pair, tied parameters under each of their names (what
    named_parameters(remove_duplicate=False) gives on torch >= 2.0)."""
    for key, value in module._parameters.items():
        if value is not None:
            yield prefix + key, value
    for key, child in module._modules.items():
        if child is not None:
            yield from _all_named_parameters(child, prefix + key + ".")


class _Param:
    """One managed torch parameter (tied parameters are one)."""

    __slots__ = ("id", "param", "names", "shape", "numel", "dtype", "placeholder", "trainable",
                 "fwd_live", "fwd_holders", "bwd_flat", "saved_refs", "grad_node", "source",
                 "live_ptr", "engine")

    def __init__(self, pid, param, names, dtype, device, engine):
        self.id = pid
        self.param = param
        self.names = names
        self.shape = param.shape
        self.numel = param.numel()
        self.dtype = dtype
        self.placeholder = placeholder(param.shape, dtype, device)
        self.trainable = param.requires_grad
        self.fwd_live = None  # the acquired tensor `param.data` is, in forward
        self.fwd_holders = 0  # module calls (and accesses) holding it in forward
        self.bwd_flat = None  # the acquired memory saved references read, in backward
        self.saved_refs = 0  # live references autograd saved to it
        self.grad_node = None  # its AccumulateGrad node (kept alive: the hook lives there)
        self.source = None  # its initial values until registration ends
        self.live_ptr = None  # the storage pointer torch sees while acquired
        self.engine = weakref.ref(engine)


class _SavedRef:
    """What autograd keeps of a saved tensor that lay in a parameter's memory."""

    __slots__ = ("engine", "p", "size", "stride", "offset", "dtype", "__weakref__")

    def __init__(self, engine, p, t):
        self.engine = weakref.ref(engine)
        self.p = p
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.dtype = t.dtype
        p.saved_refs += 1

    def __del__(self):
        self.p.saved_refs -= 1
        engine = self.engine()
        if engine is not None and self.p.saved_refs == 0 and self.p.bwd_flat is not None:
            engine._deferred.append(self.p)


class _Frame:
    """A module call in the engine's forward: the parameters it holds, and the saved-tensor
    hooks it pushed when it was the outermost one."""

    __slots__ = ("params", "hooks")

    def __init__(self):
        self.params = []
        self.hooks = None


class _Driver:
    """The one thread that drives an engine: the first to call it, until it ends."""

    def __init__(self):
        self._lock = threading.Lock()
        self._thread = None

    def check(self, what):
        current = threading.current_thread()
        if isinstance(current, threading._DummyThread):
            return  # a thread torch started (autograd's device threads run our hooks)
        with self._lock:
            owner = self._thread
            if owner is None or owner is current or not owner.is_alive():
                self._thread = current
                return
        raise error("FailedPrecondition",
                    "%s from thread %r: this zinf engine is driven by thread %r (one thread "
                    "runs an engine's forward, backward and step; nothing was done). Call it "
                    "from that thread, or give each thread its own engine"
                    % (what, current.name, owner.name))


def _weak_hook(engine, method):
    ref = weakref.ref(engine)

    def hook(*args):
        e = ref()
        if e is not None:
            return getattr(e, method)(*args)
        return None

    return hook


class _ParameterDict(collections.OrderedDict):
    """A module's `_parameters` that acquires a parameter read during the engine's forward."""

    def __init__(self, engine, items):
        super().__init__(items)
        self._zinf_engine = weakref.ref(engine)

    def __getitem__(self, key):
        value = collections.OrderedDict.__getitem__(self, key)
        engine = self._zinf_engine()
        if engine is not None and engine._stack and value is not None:
            engine._touch(value)
        return value

    def __reduce__(self):  # copies and pickles see a plain dict
        return (collections.OrderedDict, (list(self.items()),))


class ZinfEngine:
    """A model trained by zinf. Create it with zinf.initialize(model, config)."""

    def __init__(self, model, core, device, scale_wrt_gas=True, hyper=None,
                 client_optimizer=None, lr_scheduler=None, trained=None):
        self.module = model
        self.device = torch.device(device)
        self._core = core
        self._scale_wrt_gas = scale_wrt_gas
        self._gas = max(1, core.gradient_accumulation_steps)
        self._dtype = torch.bfloat16 if core.bf16 else torch.float32
        self._params = []
        self._by_obj = {}  # id(torch parameter) -> _Param
        self._live = {}  # storage pointer -> _Param (memory currently handed to torch)
        self._stack = []  # forward frames (_Frame): the module calls running now
        self._traced = True
        self._deferred = []  # parameters whose last saved reference died
        self._registered = False
        self._closed = False
        self._handles = []
        self._micro = 0
        self._micro_started = False  # a training forward or a gradient since the last step
        self._reduced = set()  # parameters that got their gradient in this micro-step
        self._backwards = 0  # engine.backward calls completed in this micro-step
        self._in_backward = False  # inside engine.backward's loss.backward()
        self._losses = []  # this window's losses (detached), looked at only if a step fails
        self._updates_since_values = 0  # optimizer steps since values were set or loaded
        self._stream = None  # the CUDA stream handle the engine orders against
        self._driver = _Driver()
        self._access = ParamAccess(self)
        self._lr_pushed = None
        _autograd.install()
        self._register(model, trained)
        self._install_hooks(model)
        self._adopt(model)
        hyper = hyper or {}
        trainable = [p.param for p in self._params if p.trainable]
        self.optimizer = ZinfOptimizer(trainable or [self._params[0].param],
                                       hyper.get("type", "AdamW"), hyper.get("lr", 1e-3),
                                       hyper.get("betas", (0.9, 0.999)), hyper.get("eps", 1e-8),
                                       hyper.get("weight_decay", 0.0))
        if client_optimizer is not None:
            # One set of groups: a scheduler made on the trainer's own optimizer moves zinf's
            # learning rate (DeepSpeed's wrapper shares them the same way).
            self.optimizer.param_groups = client_optimizer.param_groups
        # A factory (DeepSpeed accepts one) gets the optimizer.
        self.lr_scheduler = lr_scheduler(self.optimizer) if callable(lr_scheduler) else \
            lr_scheduler
        self._sync_lr()

    # ---- Setup --------------------------------------------------------------------------------

    def _register(self, model, trained):
        names = collections.defaultdict(list)
        for name, param in _all_named_parameters(model):
            names[id(param)].append(name)
        if not names:
            raise ZinfError("zinf.initialize: the model has no parameters")
        for name, param in model.named_parameters():
            if getattr(param, "_zinf_engine", None) is not None:
                raise ZinfError("parameter '%s' already belongs to another zinf engine" % name)
            if param.__dict__.get("_zinf_rec") is not None:
                raise error("FailedPrecondition",
                            "parameter '%s' belonged to a zinf engine that was closed without "
                            "handing its values back; it holds no values (close the engine "
                            "with restore=True, or build the model again)" % name)
            if param.dtype not in FLOAT_DTYPES:
                raise ZinfError("parameter '%s' is %s; zinf manages float32, bfloat16 and "
                                "float16 parameters" % (name, param.dtype))
            trainable = param.requires_grad and (trained is None or id(param) in trained)
            spill = getattr(param, "_zinf_spill", None)
            if spill is not None:
                spill_file, offset, version = spill
                data = param.data
                # Changed in place after its constructor: the version counter tells, except
                # through .data, which leaves it alone; the placeholder's one NaN tells then.
                if param._version != version or data.stride() != (0,) * data.dim() or \
                        not torch.isnan(data[(0,) * data.dim()]):
                    raise ZinfError(
                        "parameter '%s' was changed in place after its module was built under "
                        "zinf.Init (its values were already handed to zinf): initialise it in "
                        "its module's constructor, or load values with zinf.load_safetensors"
                        % name)
                pid = self._core.register(name, list(param.shape), trainable,
                                          spill=spill_file, spill_offset=offset)
                source = None
            else:
                source = param.detach()
                if source.device.type == "meta":
                    raise ZinfError("parameter '%s' is on the meta device: build the model "
                                    "under zinf.Init (or on the CPU) so it has values" % name)
                source = source.to("cpu").contiguous()
                pid = self._core.register(name, list(param.shape), trainable,
                                          ptr=source.data_ptr(), dtype=FLOAT_DTYPES[param.dtype])
            p = _Param(pid, param, names[id(param)], self._dtype, self.device, self)
            p.trainable = trainable
            p.source = source
            self._params.append(p)
            self._by_obj[id(param)] = p
            param._zinf_engine = weakref.ref(self)
            param.data = p.placeholder
            if hasattr(param, "_zinf_spill"):
                del param._zinf_spill
        # Buffers live in torch, on the engine's device.
        for module in model.modules():
            for key, buf in list(module._buffers.items()):
                if buf is not None and buf.device != self.device:
                    module._buffers[key] = buf.to(self.device)

    def _install_hooks(self, model):
        self._direct = {}
        for module in model.modules():
            owned = [self._by_obj[id(v)] for v in module._parameters.values()
                     if v is not None and id(v) in self._by_obj]
            self._direct[module] = owned
            module._parameters = _ParameterDict(self, module._parameters.items())
            # Hooks hold the engine weakly: the model never keeps a dropped engine alive.
            self._handles.append(module.register_forward_pre_hook(_weak_hook(self, "_pre_hook")))
            self._handles.append(module.register_forward_hook(_weak_hook(self, "_post_hook")))
        with torch.enable_grad():
            for p in self._params:
                if not p.param.requires_grad:
                    continue
                node = p.param.expand_as(p.param).grad_fn.next_functions[0][0]
                node.register_hook(self._grad_hook(p))
                p.grad_node = node

    def _adopt(self, model):
        """Every managed parameter becomes a ZinfParameter (reads and writes outside the hooks
        go through _access.py), and model.load_state_dict loads through the engine."""
        for p in self._params:
            p.param.__class__ = ZinfParameter
            p.param._zinf_rec = p
        access = self._access
        original = type(model).load_state_dict.__get__(model)

        def load_state_dict(state_dict, strict=True):
            return access.load_state_dict(original, state_dict, strict)

        load_state_dict.__doc__ = original.__doc__
        model.__dict__["load_state_dict"] = load_state_dict

    def _ensure_registered(self):
        if self._registered:
            return
        self._core.finish_registration()
        self._registered = True
        for p in self._params:
            p.source = None

    def _enter(self, what):
        """The checks every entry point makes before changing anything."""
        if self._closed:
            raise error("FailedPrecondition",
                        "%s: this zinf engine was closed (its parameters hold no values unless "
                        "it was closed with restore=True)" % what)
        self._driver.check(what)
        self._ensure_registered()

    def _check_open(self):
        if self._closed:
            raise error("FailedPrecondition", "this zinf engine was closed")
        self._driver.check("a call")

    # ---- Forward --------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        self._enter("engine(...)")
        try:
            return self.module(*args, **kwargs)
        except BaseException:
            self._unwind()
            raise

    forward = __call__

    def _pre_hook(self, module, inputs):
        if self._closed:
            return
        if module is self.module and self._stack:
            self._unwind()  # a forward that raised left its frames
        frame = _Frame()
        if not self._stack:
            self._enter("the model's forward")
            self._flush()
            self._check_parameters()
            self._traced = torch.is_grad_enabled() and self.module.training
            if self._traced:
                self._sync_lr()
                self._micro_started = True
            if torch.is_grad_enabled():
                # Every tensor autograd saves inside this call that lies in a parameter's
                # memory is saved as a reference (engine(...), a direct call of the model, a
                # checkpointed segment recomputed in backward).
                frame.hooks = _autograd.ChainedHooks(self._pack_hook, self._unpack_hook)
                frame.hooks.__enter__()
        self._stack.append(frame)
        owned = self._direct.get(module)
        if owned:
            self._acquire_forward(owned, frame)

    def _check_parameters(self):
        """Before each forward: the parameters are still the engine's placeholders (a .to(),
        .half() or .cuda() after initialize would detach them from the gradient hooks), and on a
        GPU torch still computes on the stream the engine orders its copies against."""
        for p in self._params:
            data = base_data(p.param)
            if data.dtype != p.dtype or data.device != self.device or data.shape != p.shape:
                raise ZinfError(
                    "parameter '%s' is now %s on %s, the engine keeps it as %s on %s: the model's "
                    "parameters must not be converted or moved after zinf.initialize (no "
                    "model.to(), .half(), .cuda())" % (p.names[0], data.dtype, data.device,
                                                         p.dtype, self.device))
        if self._stream is not None and torch.cuda.current_stream(self.device).cuda_stream != \
                self._stream:
            raise ZinfError("torch's current CUDA stream changed since zinf.initialize; the "
                            "engine orders its copies against the stream it was created with: "
                            "train on that stream (or create the engine under the stream you "
                            "use)")

    def _post_hook(self, module, inputs, output):
        if self._closed or not self._stack:
            return
        self._close_frame(self._stack.pop())

    def _close_frame(self, frame):
        try:
            self._release_forward(frame)
        finally:
            if frame.hooks is not None:
                hooks, frame.hooks = frame.hooks, None
                hooks.__exit__(None, None, None)

    def _touch(self, param):
        """A parameter read during forward (through a module's _parameters)."""
        p = self._by_obj.get(id(param))
        if p is not None and p.fwd_live is None:
            self._acquire_forward([p], self._stack[-1])

    def _new_frame(self):
        return _Frame()

    def _acquire_forward(self, owned, frame, inference=None):
        if inference is None:
            inference = not self._traced
        need = []
        for p in owned:
            if p.fwd_live is None and p not in need:
                need.append(p)
        if need:
            if not inference:
                self._micro_started = True
            capsules = self._core.acquire([p.id for p in need], inference=inference)
            done = []
            try:
                for p, capsule in zip(need, capsules):
                    flat = dlpack.from_dlpack(capsule)
                    p.fwd_live = flat.view(p.shape)
                    set_base_data(p.param, p.fwd_live)
                    self._add_live(p, flat)
                    done.append(p)
            except BaseException:
                for p in done:
                    set_base_data(p.param, p.placeholder)
                    p.fwd_live = None
                    self._drop_live(p)
                del capsules
                self._core.release([p.id for p in need])
                raise
        for p in owned:
            p.fwd_holders += 1
            frame.params.append(p)

    def _release_forward(self, frame):
        done = []
        for p in frame.params:
            p.fwd_holders -= 1
            if p.fwd_holders == 0:
                set_base_data(p.param, p.placeholder)
                p.fwd_live = None
                if p.bwd_flat is None:
                    self._drop_live(p)
                done.append(p.id)
        frame.params = []
        if done:
            self._core.release(done)

    def _add_live(self, p, flat):
        p.live_ptr = storage_ptr(flat)
        self._live[p.live_ptr] = p

    def _drop_live(self, p):
        self._live.pop(p.live_ptr, None)
        p.live_ptr = None

    def _unwind(self):
        while self._stack:
            self._close_frame(self._stack.pop())

    # ---- Autograd -------------------------------------------------------------------------------

    def _pack(self, t):
        """A reference for a saved tensor in a parameter's memory; None for anything else."""
        if t.device != self.device:
            return None
        p = self._live.get(storage_ptr(t))
        if p is None:
            return None
        return _SavedRef(self, p, t)

    def _unpack(self, saved):
        if not isinstance(saved, _SavedRef):
            return saved
        p = saved.p
        if p.bwd_flat is None:
            self._flush()
            # Backward is training, whatever mode the forward ran in.
            capsule = self._core.acquire([p.id])[0]
            p.bwd_flat = dlpack.from_dlpack(capsule)
            self._add_live(p, p.bwd_flat)
        base = p.bwd_flat
        if saved.dtype != base.dtype:
            base = base.view(saved.dtype)
        return base.as_strided(saved.size, saved.stride, saved.offset)

    @property
    def _pack_hook(self):
        hook = _weak_hook(self, "_pack")
        hook.zinf_engine = weakref.ref(self)
        return hook

    @property
    def _unpack_hook(self):
        return _weak_hook(self, "_unpack")

    def _own_hooks_innermost(self):
        """Whether the saved-tensor hooks autograd calls now are this engine's."""
        top = _autograd.innermost()
        if top is None:
            return False
        ref = getattr(getattr(top[0], "zinf_owner", None), "zinf_engine", None)
        return ref is not None and ref() is self

    def _flush(self):
        """Releases the parameters backward no longer needs (their saved references died)."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        done = []
        for p in deferred:
            if p.saved_refs == 0 and p.bwd_flat is not None:
                self._drop_backward(p, done)
        if done:
            self._core.release(done)

    def _drop_backward(self, p, done):
        p.bwd_flat = None
        if p.fwd_live is None:
            self._drop_live(p)
        done.append(p.id)

    def _grad_hook(self, p):
        engine = weakref.ref(self)

        def hook(grad_inputs, grad_outputs):
            self_ = engine()
            if self_ is None or self_._closed:  # the node outlives the engine: torch's again
                return
            with torch._C.DisableTorchFunction():
                grad = p.param.grad
                p.param.grad = None
            if grad is not None and p.trainable:
                self_._reduce(p, grad)

        return hook

    def _reduce(self, p, grad):
        if grad.is_sparse:
            raise ZinfError("parameter '%s' got a sparse gradient; zinf takes dense gradients "
                            "(nn.Embedding(sparse=False))" % p.names[0])
        if grad.shape != p.shape:
            raise ZinfError("parameter '%s': gradient of shape %s for a parameter of shape %s"
                            % (p.names[0], tuple(grad.shape), tuple(p.shape)))
        if p.id in self._reduced:
            if self._backwards > 0:
                cause = ("engine.backward ran %d time(s) since the last engine.step()"
                         % self._backwards)
            else:
                cause = ("two backward passes reached it in this micro-step: loss.backward() "
                         "called twice, or a reentrant torch.utils.checkpoint segment that shares "
                         "it with code outside the segment (use_reentrant=False or "
                         "zinf.checkpoint avoid that)")
            raise error("FailedPrecondition",
                        "parameter '%s' got a second gradient in one micro-step (%s): call "
                        "engine.step() after every backward; to accumulate gradients over "
                        "several micro-batches, set gradient_accumulation_steps and call "
                        "backward then step for each (step runs the optimizer at the boundary)"
                        % (p.names[0], cause))
        g = grad.detach()
        if g.dtype != torch.float32 or g.device != self.device or not g.is_contiguous():
            g = g.to(device=self.device, dtype=torch.float32).contiguous()
        self._micro_started = True
        self._core.reduce_gradient(p.id, g.data_ptr())
        self._reduced.add(p.id)
        self._flush()

    def backward(self, loss, retain_graph=False):
        """loss.backward(), with the loss divided by gradient_accumulation_steps (gradients are
        summed over an accumulation window; pass scale_wrt_gas=False to initialize to keep the
        loss as is). One backward per micro-step."""
        self._enter("engine.backward")
        self._sync_lr()
        self._losses.append(loss.detach())
        if self._scale_wrt_gas and self._gas > 1:
            loss = loss / self._gas
        self._in_backward = True
        try:
            loss.backward(retain_graph=retain_graph)
        finally:
            self._in_backward = False
        self._end_backward()
        self._backwards += 1

    def _end_backward(self):
        self._flush()
        done = []
        for p in self._params:
            if p.bwd_flat is not None:
                self._drop_backward(p, done)  # a later unpack acquires it again
        if done:
            self._core.release(done)

    # ---- Steps --------------------------------------------------------------------------------

    def step(self, lr_kwargs=None):
        """Ends a micro-step; at an accumulation boundary zinf's optimizer updates every
        parameter that got a gradient, then the learning-rate scheduler (if any) steps.
        Returns the step's statistics (a dict)."""
        self._enter("engine.step")
        self._unwind()
        self._end_backward()
        self._core.drain()
        views = self._core.views()
        if views:
            names = ", ".join("'%s'" % self._params[i].names[0] for i in sorted(views))
            raise ZinfError(
                "a tensor still views the memory of parameter(s) %s outside their module's "
                "forward (a parameter, or a view of it, was kept: in a list, as an output, or by "
                "a graph built outside engine(...)); zinf cannot update memory torch still "
                "reads: drop the reference, or keep a .clone()" % names)
        with torch._C.DisableTorchFunction():
            stray = [p.names[0] for p in self._params if p.param.grad is not None]
        if stray:
            raise ZinfError(
                "parameter(s) %s hold a .grad that never reached zinf (the gradient hook is "
                "detached: was a parameter converted or replaced after zinf.initialize?)"
                % ", ".join("'%s'" % n for n in stray[:8]))
        self._sync_lr()
        try:
            stats = self._core.step()
        except ZinfError as e:
            raise self._explain_step_failure(e) from e
        self._micro += 1
        self._micro_started = False
        self._reduced = set()
        self._backwards = 0
        if stats["optimizer_ran"]:
            self._losses = []
            self._updates_since_values += 1
            if self.lr_scheduler is not None:
                # torch's schedulers count optimizer.step() calls and warn when they see none;
                # zinf's optimizer step ran inside this call.
                opt = getattr(self.lr_scheduler, "optimizer", None)
                if opt is not None and hasattr(opt, "_step_count"):
                    opt._step_count += 1
                self.lr_scheduler.step(**(lr_kwargs or {}))
                self._sync_lr()
        return stats

    def _explain_step_failure(self, err):
        """A failed step with the cause the Python side can tell. The engine's advice for an inf
        or NaN gradient (lower the learning rate) fits a run that diverged; when no optimizer
        update has run since the parameters' values were set (initialize, a checkpoint,
        zinf.load_safetensors, a write) and the loss was already not finite, the learning rate
        cannot be the cause: the values (or the inputs) are."""
        if getattr(err, "code", None) != "FailedPrecondition" or self._updates_since_values:
            return err
        bad = [i for i, l in enumerate(self._losses) if not bool(torch.isfinite(l).all())]
        if not bad:
            return err
        return error("FailedPrecondition",
                     "the optimizer step stopped on inf or NaN gradients, and the loss was "
                     "already %s in micro-step %d of the first optimizer step after the "
                     "parameters' values were set (zinf.initialize, load_checkpoint, "
                     "load_safetensors, load_state_dict or a write): no update has run since, so "
                     "the learning rate is not the cause. The values the model starts from (or "
                     "its inputs) hold or produce inf/NaN: check what was loaded or written, "
                     "then recreate the engine (the engine's own message is this error's "
                     "__cause__)" % (self._losses[bad[0]].item(), bad[0]))

    def _values_set(self):
        """Parameter values were set or loaded: the next optimizer step is the first on them."""
        self._updates_since_values = 0
        self._losses = []

    def _warn_nonfinite(self, p):
        _zinf.log_warning("parameter '%s' is being set to values that hold inf or NaN; the next "
                          "optimizer step will stop on them" % p.names[0])

    def _check_writable(self, p, what):
        if self._stack or self._micro_started or p.fwd_live is not None:
            raise error("FailedPrecondition",
                        "parameter '%s': %s during a micro-step (between engine(...) and "
                        "engine.step()) is refused: the optimizer owns the values then, and the "
                        "write would be lost; write parameters before the forward or after "
                        "engine.step() (nothing was written)" % (p.names[0], what))

    def _check_inference_read(self, p):
        if self._reduced and self.is_gradient_accumulation_boundary():
            raise error("FailedPrecondition",
                        "parameter '%s' read after this step's backward began and before "
                        "engine.step(): the optimizer may be rewriting it; read it after "
                        "engine.step() (or inside the forward)" % p.names[0])

    def zero_grad(self):
        """DeepSpeed's engine.zero_grad(): zinf keeps gradients in its own accumulators (an
        accumulation window's are summed until the optimizer runs, then cleared by it), so
        this only drops any .grad torch left on a parameter."""
        self._check_open()
        with torch._C.DisableTorchFunction():
            for p in self._params:
                p.param.grad = None

    def is_gradient_accumulation_boundary(self):
        """Whether the next step() ends an accumulation window (runs the optimizer)."""
        return (self._micro + 1) % self._gas == 0

    def set_lr(self, lr):
        """The learning rate of the optimizer steps from the next micro-step on."""
        for group in self.optimizer.param_groups:
            group["lr"] = float(lr)
        self._sync_lr()

    def get_lr(self):
        """[the learning rate of the next optimizer step] (DeepSpeed's list shape)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def _sync_lr(self):
        """Hands the optimizer groups' learning rate to zinf's optimizer when it changed (a
        scheduler, or a trainer writing param_groups[i]["lr"])."""
        lrs = {float(g["lr"]) for g in self.optimizer.param_groups}
        if len(lrs) != 1:
            raise error("InvalidArgument",
                        "the optimizer's param groups hold different learning rates %s; zinf's "
                        "optimizer has one" % sorted(lrs))
        lr = lrs.pop()
        if lr != self._lr_pushed:
            self._core.set_lr(lr)
            self._lr_pushed = lr

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
        out = collections.OrderedDict()
        for prefix, module in self.module.named_modules():
            for key, buf in module._buffers.items():
                if buf is not None and key not in module._non_persistent_buffers_set:
                    out[(prefix + "." if prefix else "") + key] = buf
        return out

    def save_checkpoint(self, save_dir, client_state=None):
        """Saves the optimizer states, the step counters, the learning rate and scheduler, the
        model's persistent buffers and `client_state` (JSON-serialisable: data position...)
        into `save_dir` (atomically: the previous checkpoint stays valid until this one is
        complete)."""
        self._enter("save_checkpoint")
        self._save(str(save_dir), client_state)

    def _save(self, path, client_state, extra=None):
        def blob(obj):
            out = io.BytesIO()
            torch.save(obj, out)
            return base64.b64encode(out.getvalue()).decode("ascii")

        doc = {"format": "zinf-python-1", "client_state": client_state,
               "buffers": blob({k: v.detach().cpu() for k, v in
                                self._persistent_buffers().items()}),
               "names": [p.names[0] for p in self._params],
               "lr": self.get_lr()[0]}
        if self.lr_scheduler is not None:
            doc["lr_scheduler"] = blob(self.lr_scheduler.state_dict())
        doc.update(extra or {})
        try:
            user = json.dumps(doc)
        except (TypeError, ValueError) as e:
            raise ZinfError("save_checkpoint: client_state must be JSON-serialisable (%s)" % e)
        self._core.save_checkpoint(path, user)

    def load_checkpoint(self, load_dir):
        """Restores the newest checkpoint in `load_dir`; returns its client_state."""
        self._enter("load_checkpoint")
        user = self._load(str(load_dir))
        return None if user is None else user.get("client_state")

    def _load(self, path):
        raw = self._core.load_checkpoint(path)
        self._values_set()
        self._micro = self._core.global_step * self._gas
        self._micro_started = False
        self._reduced = set()
        self._backwards = 0
        try:
            user = json.loads(raw.decode("utf-8")) if raw else {}
        except ValueError:
            user = {}
        if user.get("format") != "zinf-python-1":
            return None
        data = base64.b64decode(user.get("buffers", ""))
        if data:
            saved = torch.load(io.BytesIO(data), weights_only=True)
            for name, buf in self._persistent_buffers().items():
                if name in saved:
                    with torch.no_grad():
                        buf.copy_(saved[name])
        if self.lr_scheduler is not None and user.get("lr_scheduler"):
            state = torch.load(io.BytesIO(base64.b64decode(user["lr_scheduler"])),
                               weights_only=True)
            self.lr_scheduler.load_state_dict(state)
        if user.get("lr") is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = user["lr"]
        self._sync_lr()
        return user

    def resume_from_store(self):
        """With zinf.durable: continue from the swap store's last committed step (instead of
        initial values or a checkpoint). Call it right after initialize, before anything else.
        Buffers are not in the store: they keep the values the model was built with."""
        self._check_open()
        if self._registered:
            raise ZinfError("resume_from_store must come right after initialize, before any "
                            "forward, step or checkpoint call")
        self._core.finish_registration(resume=True)
        self._registered = True
        self._micro = self._core.global_step * self._gas
        for p in self._params:
            p.source = None

    def _managed(self, param):
        p = self._by_obj.get(id(param))
        if p is None:
            raise ZinfError("not a parameter of this engine")
        return p

    def gather(self, param, dtype=torch.float32):
        """A parameter's full fp32 master values (a new CPU tensor, in `dtype`)."""
        self._enter("gather")
        p = self._managed(param)
        out = torch.empty(p.shape, dtype=torch.float32)
        self._core.gather_master(p.id, out.data_ptr())
        return out if dtype == torch.float32 else out.to(dtype)

    def full_state_dict(self, dtype=torch.float32):
        """The model's state_dict with the real parameter values (the fp32 masters, or cast to
        `dtype`) on the CPU, tied parameters under each of their names, buffers as they are.
        Holds the whole model in host memory: for large models export with
        zinf.save_safetensors instead."""
        self._enter("full_state_dict")
        gathered = {}
        out = collections.OrderedDict()
        for key, value in self.module.state_dict(keep_vars=True).items():
            p = self._by_obj.get(id(value))
            if p is None:
                out[key] = value.detach().cpu().clone()
                continue
            if p.id not in gathered:
                gathered[p.id] = self.gather(p.param, dtype)
            out[key] = gathered[p.id]
        return out

    def parameters_info(self):
        """[(name, shape, numel, trainable)] of the managed parameters, in registration order."""
        return [(p.names[0], tuple(p.shape), p.numel, p.trainable) for p in self._params]

    def close(self, restore=False):
        """Detaches the hooks and destroys the engine. With `restore`, every parameter first
        gets its fp32 master values back as ordinary torch memory (the whole model in host
        memory, in the parameter's dtype, on the engine's device) and is an ordinary
        nn.Parameter again, so the model can go on without zinf; otherwise the parameters hold
        no values (any use of them is refused, naming them)."""
        if self._closed:
            return
        self._driver.check("close")
        self._unwind()
        self._end_backward()
        if restore:
            self._ensure_registered()
            for p in self._params:
                set_base_data(p.param, self.gather(p.param).to(device=self.device, dtype=p.dtype))
                p.param.__class__ = torch.nn.Parameter
                del p.param._zinf_rec
        for h in self._handles:
            h.remove()
        self._handles = []
        for module in self.module.modules():
            if isinstance(module._parameters, _ParameterDict):
                module._parameters = collections.OrderedDict(module._parameters.items())
        self.module.__dict__.pop("load_state_dict", None)
        for p in self._params:
            p.param._zinf_engine = None
        self._closed = True
        self._core = None

    def __del__(self):
        try:
            if not self._closed:
                for h in self._handles:
                    h.remove()
        except Exception:  # interpreter shutdown: nothing left to detach
            pass
