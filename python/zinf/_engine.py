"""ZinfEngine: a torch module's parameters and optimizer states in zinf's engine.

How a parameter is used (every nn.Module that owns parameters gets forward hooks):

- Outside the engine's forward and backward a parameter's data is a placeholder: a tensor of
  the parameter's shape and dtype over one NaN (stride 0). Shape queries work; computing with
  it gives NaN; writing to it in place fails.
- Forward: before a module runs, its own parameters are acquired (fetched to the engine's
  device, gathered) and `param.data` becomes a tensor over the engine's memory; after the
  module returns they go back to the placeholder and are released. A parameter read through
  another module (a tied head reading `self.wte.weight`) is acquired on that access and
  released when the module that read it returns.
- Autograd: inside `engine(...)`, every tensor autograd saves that lies in a parameter's
  memory (the weight a linear layer saves, a transposed view of it) is saved as a reference
  to the parameter, not as memory. In backward the reference acquires the parameter again and
  hands autograd a view of the memory it has now; the parameter is released once every
  reference to it is gone. So backward always reads the parameter's current memory, never
  memory the engine has reused.
- The engine's memory is released only when torch holds no tensor over it any more (a view
  kept by the trainer keeps it acquired; step() then refuses to run, naming the parameter).
- Gradients: a parameter's gradient, summed over every use in the backward, goes to the
  engine (reduce-scatter, fp32 accumulators) and `param.grad` is cleared; the optimizer is
  zinf's, run by step() at accumulation boundaries.
- Forward passes without gradients (torch.no_grad(), or eval()) acquire in inference mode:
  they neither record nor invalidate the prefetch trace and may come between steps.
"""
import base64
import collections
import io
import json
import math
import weakref

import torch
from torch.utils import dlpack

from . import _zinf

ZinfError = _zinf.ZinfError

FLOAT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def placeholder(shape, dtype, device):
    """A tensor of `shape` over one NaN (stride 0): what a parameter is between uses."""
    return torch.full((), float("nan"), dtype=dtype, device=device).expand(shape)


def storage_ptr(t):
    try:
        return t.untyped_storage().data_ptr()
    except AttributeError:  # torch < 2.0
        return t.storage().data_ptr()


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
                 "live_ptr")

    def __init__(self, pid, param, names, dtype, device):
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

    def __init__(self, model, core, device, scale_wrt_gas=True):
        self.module = model
        self.device = torch.device(device)
        self._core = core
        self._scale_wrt_gas = scale_wrt_gas
        self._gas = max(1, core.gradient_accumulation_steps)
        self._dtype = torch.bfloat16 if core.bf16 else torch.float32
        self._params = []
        self._by_obj = {}  # id(torch parameter) -> _Param
        self._live = {}  # storage pointer -> _Param (memory currently handed to torch)
        self._stack = []  # forward frames: parameters each running module call holds
        self._traced = True
        self._deferred = []  # parameters whose last saved reference died
        self._registered = False
        self._closed = False
        self._handles = []
        self._micro = 0
        self._stream = None  # the CUDA stream handle the engine orders against
        self._register(model)
        self._install_hooks(model)

    # ---- Setup --------------------------------------------------------------------------------

    def _register(self, model):
        names = collections.defaultdict(list)
        for name, param in _all_named_parameters(model):
            names[id(param)].append(name)
        if not names:
            raise ZinfError("zinf.initialize: the model has no parameters")
        for name, param in model.named_parameters():
            if getattr(param, "_zinf_engine", None) is not None:
                raise ZinfError("parameter '%s' already belongs to another zinf engine" % name)
            if param.dtype not in FLOAT_DTYPES:
                raise ZinfError("parameter '%s' is %s; zinf manages float32, bfloat16 and "
                                "float16 parameters" % (name, param.dtype))
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
                pid = self._core.register(name, list(param.shape), param.requires_grad,
                                          spill=spill_file, spill_offset=offset)
                source = None
            else:
                source = param.detach()
                if source.device.type == "meta":
                    raise ZinfError("parameter '%s' is on the meta device: build the model "
                                    "under zinf.Init (or on the CPU) so it has values" % name)
                source = source.to("cpu").contiguous()
                pid = self._core.register(name, list(param.shape), param.requires_grad,
                                          ptr=source.data_ptr(), dtype=FLOAT_DTYPES[param.dtype])
            p = _Param(pid, param, names[id(param)], self._dtype, self.device)
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
                if not p.trainable:
                    continue
                node = p.param.expand_as(p.param).grad_fn.next_functions[0][0]
                node.register_hook(self._grad_hook(p))
                p.grad_node = node

    def _ensure_registered(self):
        if self._registered:
            return
        self._core.finish_registration()
        self._registered = True
        for p in self._params:
            p.source = None

    # ---- Forward --------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        self._check_open()
        self._ensure_registered()
        try:
            if torch.is_grad_enabled():
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    return self.module(*args, **kwargs)
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
        if not self._stack:
            self._ensure_registered()
            self._flush()
            self._check_parameters()
            self._traced = torch.is_grad_enabled() and self.module.training
        frame = []
        self._stack.append(frame)
        owned = self._direct.get(module)
        if owned:
            self._acquire_forward(owned, frame)

    def _check_parameters(self):
        """Before each forward: the parameters are still the engine's placeholders (a .to(),
        .half() or .cuda() after initialize would detach them from the gradient hooks), and on a
        GPU torch still computes on the stream the engine orders its copies against."""
        for p in self._params:
            data = p.param.data
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
        self._release_forward(self._stack.pop())

    def _touch(self, param):
        """A parameter read during forward (through a module's _parameters)."""
        p = self._by_obj.get(id(param))
        if p is not None and p.fwd_live is None:
            self._acquire_forward([p], self._stack[-1])

    def _acquire_forward(self, owned, frame):
        need = []
        for p in owned:
            if p.fwd_live is None and p not in need:
                need.append(p)
        if need:
            capsules = self._core.acquire([p.id for p in need], inference=not self._traced)
            done = []
            try:
                for p, capsule in zip(need, capsules):
                    flat = dlpack.from_dlpack(capsule)
                    p.fwd_live = flat.view(p.shape)
                    p.param.data = p.fwd_live
                    self._add_live(p, flat)
                    done.append(p)
            except BaseException:
                for p in done:
                    p.param.data = p.placeholder
                    p.fwd_live = None
                    self._drop_live(p)
                del capsules
                self._core.release([p.id for p in need])
                raise
        for p in owned:
            p.fwd_holders += 1
            frame.append(p)

    def _release_forward(self, frame):
        done = []
        for p in frame:
            p.fwd_holders -= 1
            if p.fwd_holders == 0:
                p.param.data = p.placeholder
                p.fwd_live = None
                if p.bwd_flat is None:
                    self._drop_live(p)
                done.append(p.id)
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
            self._release_forward(self._stack.pop())

    # ---- Autograd ---------------------------------------------------------------------------------

    def _pack(self, t):
        p = self._live.get(storage_ptr(t)) if t.device == self.device else None
        if p is None:
            return t
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
            grad = p.param.grad
            p.param.grad = None
            if grad is not None:
                self_._reduce(p, grad)

        return hook

    def _reduce(self, p, grad):
        if grad.is_sparse:
            raise ZinfError("parameter '%s' got a sparse gradient; zinf takes dense gradients "
                            "(nn.Embedding(sparse=False))" % p.names[0])
        if grad.shape != p.shape:
            raise ZinfError("parameter '%s': gradient of shape %s for a parameter of shape %s"
                            % (p.names[0], tuple(grad.shape), tuple(p.shape)))
        g = grad.detach()
        if g.dtype != torch.float32 or g.device != self.device or not g.is_contiguous():
            g = g.to(device=self.device, dtype=torch.float32).contiguous()
        self._core.reduce_gradient(p.id, g.data_ptr())
        self._flush()

    def backward(self, loss, retain_graph=False):
        """loss.backward(), with the loss divided by gradient_accumulation_steps (gradients are
        summed over an accumulation window; pass scale_wrt_gas=False to initialize to keep the
        loss as is). One backward per micro-step."""
        self._check_open()
        if self._scale_wrt_gas and self._gas > 1:
            loss = loss / self._gas
        loss.backward(retain_graph=retain_graph)
        self._end_backward()

    def _end_backward(self):
        self._flush()
        done = []
        for p in self._params:
            if p.bwd_flat is not None:
                self._drop_backward(p, done)  # a later unpack acquires it again
        if done:
            self._core.release(done)

    # ---- Steps --------------------------------------------------------------------------------

    def step(self):
        """Ends a micro-step; at an accumulation boundary zinf's optimizer updates every
        parameter that got a gradient. Returns the step's statistics (a dict)."""
        self._check_open()
        self._ensure_registered()
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
        stray = [p.names[0] for p in self._params if p.param.grad is not None]
        if stray:
            raise ZinfError(
                "parameter(s) %s hold a .grad that never reached zinf (the gradient hook is "
                "detached: was a parameter converted or replaced after zinf.initialize?)"
                % ", ".join("'%s'" % n for n in stray[:8]))
        stats = self._core.step()
        self._micro += 1
        return stats

    def is_gradient_accumulation_boundary(self):
        """Whether the next step() ends an accumulation window (runs the optimizer)."""
        return (self._micro + 1) % self._gas == 0

    def set_lr(self, lr):
        """The learning rate of the optimizer steps from the next micro-step on."""
        self._core.set_lr(float(lr))

    @property
    def global_step(self):
        """Optimizer steps taken (accumulation boundaries)."""
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
        """Saves the optimizer states, the step counters, the model's persistent buffers and
        `client_state` (JSON-serialisable: data position, scheduler state...) into `save_dir`
        (atomically: the previous checkpoint stays valid until this one is complete)."""
        self._check_open()
        self._ensure_registered()
        buffers = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in self._persistent_buffers().items()}, buffers)
        try:
            user = json.dumps({"format": "zinf-python-1", "client_state": client_state,
                               "buffers": base64.b64encode(buffers.getvalue()).decode("ascii"),
                               "names": [p.names[0] for p in self._params]})
        except (TypeError, ValueError) as e:
            raise ZinfError("save_checkpoint: client_state must be JSON-serialisable (%s)" % e)
        self._core.save_checkpoint(str(save_dir), user)

    def load_checkpoint(self, load_dir):
        """Restores the newest checkpoint in `load_dir`; returns its client_state."""
        self._check_open()
        self._ensure_registered()
        raw = self._core.load_checkpoint(str(load_dir))
        self._micro = self._core.global_step * self._gas
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
        return user.get("client_state")

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
        self._ensure_registered()
        p = self._managed(param)
        out = torch.empty(p.shape, dtype=torch.float32)
        self._core.gather_master(p.id, out.data_ptr())
        return out if dtype == torch.float32 else out.to(dtype)

    def full_state_dict(self, dtype=torch.float32):
        """The model's state_dict with the real parameter values (the fp32 masters, or cast to
        `dtype`) on the CPU, tied parameters under each of their names, buffers as they are.
        Holds the whole model in host memory: for large models export with
        zinf.save_safetensors instead."""
        self._check_open()
        self._ensure_registered()
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
        memory, in the parameter's dtype, on the engine's device), so the model can go on
        without zinf; otherwise the parameters stay placeholders."""
        if self._closed:
            return
        self._unwind()
        self._end_backward()
        if restore:
            self._ensure_registered()
            for p in self._params:
                p.param.data = self.gather(p.param).to(device=self.device, dtype=p.dtype)
        for h in self._handles:
            h.remove()
        self._handles = []
        for module in self.module.modules():
            if isinstance(module._parameters, _ParameterDict):
                module._parameters = collections.OrderedDict(module._parameters.items())
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

    def _check_open(self):
        if self._closed:
            raise ZinfError("this zinf engine was closed")
