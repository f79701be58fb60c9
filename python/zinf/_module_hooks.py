"""The hooks an engine puts on the model's modules and parameters (what FSDP2's FSDPState
owns): ModuleHooks.

- Forward: before a module runs, its own parameters are acquired (fetched to the engine's
  device, gathered) and `param.data` becomes a tensor over the engine's memory; after the
  module returns they go back to the placeholder and are released. The outermost call enters
  the engine (checks, the learning rate, whether the forward trains) and pushes the saved-tensor
  hooks (_packing.py) when gradients are enabled. A parameter read through another module (a
  tied head reading `self.wte.weight`) is acquired on that access (each module's _parameters
  is a ParameterDict) and released when the module that read it returns.
- Gradients: a hook on each trainable parameter's AccumulateGrad node takes the parameter's
  gradient, summed over every use in the backward, to the engine (reduce-scatter, fp32
  accumulators) and clears `param.grad`. One gradient per parameter per micro-step: a second
  one (a backward without step()) is refused with what to do.
- Trainability is fixed at zinf.initialize: a parameter registered frozen (requires_grad=False
  then) has no gradient hook and no optimizer states, so setting its requires_grad to True
  afterwards is refused (unfrozen_error: at the setter, _subclasses.py; at the next forward
  with gradients; at step() if a gradient reached it anyway). Freezing a trained parameter is
  fine: it gets no gradient and the optimizer skips it.

Every hook holds the engine's collaborators weakly: the model never keeps a dropped engine (or
its core) alive.
"""
import collections
import weakref

import torch

from . import _zinf
from ._calls import DISABLE, base_data
from ._errors import error
from ._packing import weak_hook
from ._param import GradState
from ._residency import Frame

ZinfError = _zinf.ZinfError


def frozen_at_initialize(p):
    """Whether ManagedParam `p` was registered frozen (requires_grad=False at
    zinf.initialize): no gradient hook, no optimizer states. A parameter left out of
    DeepSpeed's model_parameters keeps its hook (its gradients are dropped)."""
    return p.grad_node is None


def unfrozen_error(names, what):
    """The refusal of training a parameter registered frozen (`what`: what happened)."""
    shown = ", ".join("'%s'" % n for n in names[:8])
    if len(names) > 8:
        shown += " and %d more" % (len(names) - 8)
    return error(
        "FailedPrecondition",
        "parameter(s) %s: %s; they were frozen (requires_grad=False) when zinf.initialize "
        "registered them, and zinf fixes the set of trained parameters at zinf.initialize (a "
        "frozen parameter keeps only its stored values: no fp32 master, no optimizer states). "
        "Set requires_grad before zinf.initialize; or save the values (zinf.save_safetensors), "
        "build the model again with the new trainable set, zinf.initialize it and load them "
        "(zinf.load_safetensors; a checkpoint loads only into the trainable set it was saved "
        "with, and the newly trained parameters start with fresh optimizer states). "
        "Freezing a trained parameter after initialize needs nothing: "
        "it gets no gradient and the optimizer skips it" % (shown, what))


class ParameterDict(collections.OrderedDict):
    """A module's `_parameters` that acquires a parameter read during the engine's forward."""

    def __init__(self, residency, items):
        super().__init__(items)
        self._zinf_residency = weakref.ref(residency)

    def __getitem__(self, key):
        value = collections.OrderedDict.__getitem__(self, key)
        residency = self._zinf_residency()
        if residency is not None and residency.stack and value is not None:
            residency.touch(value)
        return value

    def __reduce__(self):  # copies and pickles see a plain dict
        return (collections.OrderedDict, (list(self.items()),))


class ModuleHooks:
    """Installs, runs and removes an engine's module and gradient hooks (one per engine).
    `model`: the engine's module (its outermost call enters the engine)."""

    def __init__(self, ctx, model, residency, packing):
        self._ctx = ctx
        self._model = model
        self._registry = ctx.registry
        self._residency = residency
        self._packing = packing
        self._micro = ctx.micro
        self._handles = []
        self._direct = {}  # module -> the ManagedParams it owns (acquired when it runs)

    def install(self, model):
        by_obj = self._registry.by_obj
        for module in model.modules():
            owned = [by_obj[id(v)] for v in module._parameters.values()
                     if v is not None and id(v) in by_obj]
            self._direct[module] = owned
            module._parameters = ParameterDict(self._residency, module._parameters.items())
            self._handles.append(module.register_forward_pre_hook(weak_hook(self, "pre_forward")))
            self._handles.append(module.register_forward_hook(weak_hook(self, "post_forward")))
        with torch.enable_grad():
            for p in self._registry.params:
                if not p.param.requires_grad:
                    continue
                node = p.param.expand_as(p.param).grad_fn.next_functions[0][0]
                node.register_hook(self._grad_hook(p))
                p.grad_node = node

    def remove(self, model):
        """Detaches the hooks (the gradient hooks stay on their nodes, and pass once the
        engine is closed)."""
        self.remove_handles()
        for module in model.modules():
            if isinstance(module._parameters, ParameterDict):
                module._parameters = collections.OrderedDict(module._parameters.items())

    def remove_handles(self):
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- Forward

    def pre_forward(self, module, inputs):
        e = self._ctx
        if e.closed:
            return
        res = self._residency
        model = self._model
        if module is model and res.stack:
            res.unwind()  # a forward that raised left its frames
        frame = Frame()
        if not res.stack:
            e.enter("the model's forward")
            if e.gathered:
                raise error("FailedPrecondition",
                            "a forward of the model inside GatheredParameters: the gathered "
                            "parameters are ordinary tensors until the block ends; run the "
                            "forward after it")
            if not e.in_window:
                e.between_steps("a forward of the model")
            res.flush()
            self._check_parameters(e)
            res.traced = torch.is_grad_enabled() and model.training
            if res.traced:
                e.sync_lr()
                self._micro.started = True
            if torch.is_grad_enabled():
                # Every tensor autograd saves inside this call that lies in a parameter's
                # memory is saved as a reference (engine(...), a direct call of the model, a
                # checkpointed segment recomputed in backward).
                frame.hooks = self._packing.hooks()
                frame.hooks.__enter__()
        res.stack.append(frame)
        owned = self._direct.get(module)
        if owned:
            res.acquire_forward(owned, frame)

    def post_forward(self, module, inputs, output):
        if self._ctx.closed or not self._residency.stack:
            return
        self._residency.close_frame(self._residency.stack.pop())

    def _check_parameters(self, e):
        """Before each forward: the parameters are still the engine's placeholders (a .to(),
        .half() or .cuda() after initialize would detach them from the gradient hooks), and on a
        GPU torch still computes on the stream the engine orders its copies against."""
        for p in self._registry.params:
            data = base_data(p.param)
            if data.dtype != p.dtype or data.device != e.device or data.shape != p.shape:
                raise ZinfError(
                    "parameter '%s' is now %s on %s, the engine keeps it as %s on %s: the model's "
                    "parameters must not be converted or moved after zinf.initialize (no "
                    "model.to(), .half(), .cuda())" % (p.names[0], data.dtype, data.device,
                                                         p.dtype, e.device))
        if torch.is_grad_enabled():
            with DISABLE():  # requires_grad set past the setter's check (_subclasses.py)
                unfrozen = [p.names[0] for p in self._registry.params
                            if frozen_at_initialize(p) and p.param.requires_grad]
            if unfrozen:
                raise unfrozen_error(unfrozen, "requires_grad is True in this forward")
        if e.stream is not None and torch.cuda.current_stream(e.device).cuda_stream != \
                e.stream:
            raise ZinfError("torch's current CUDA stream changed since zinf.initialize; the "
                            "engine orders its copies against the stream it was created with: "
                            "train on that stream (or create the engine under the stream you "
                            "use)")

    # -- Gradients

    def _grad_hook(self, p):
        hooks = weakref.ref(self)

        def hook(grad_inputs, grad_outputs):
            h = hooks()
            if h is None or h._ctx.closed:  # the node outlives the engine: torch's again
                return
            with torch._C.DisableTorchFunction():
                grad = p.param.grad
                p.param.grad = None
            if grad is not None and p.trainable:
                h.reduce(p, grad)

        return hook

    def reduce(self, p, grad):
        """Hands `p`'s gradient of this micro-step to the engine."""
        if grad.is_sparse:
            raise ZinfError("parameter '%s' got a sparse gradient; zinf takes dense gradients "
                            "(nn.Embedding(sparse=False))" % p.names[0])
        if grad.shape != p.shape:
            raise ZinfError("parameter '%s': gradient of shape %s for a parameter of shape %s"
                            % (p.names[0], tuple(grad.shape), tuple(p.shape)))
        mb = self._micro.window_mb  # engine.train_window: the micro-batch (zinf checks its order)
        if p.grad_state is GradState.REDUCED and mb is None:
            raise self._micro.second_gradient(p)
        e = self._ctx
        if e.dtype is torch.float16 and not self._micro.in_backward:
            # (The first gradient raises: nothing of this backward reached the engine.)
            raise ZinfError(
                "parameter '%s' got a gradient outside engine.backward: with fp16 the loss must "
                "go through engine.backward(loss), which multiplies it by the loss scale (the "
                "engine divides the gradients by it); after loss.backward() the updates would "
                "be that scale too small" % p.names[0])
        g = grad.detach()
        if g.dtype != torch.float32 or g.device != e.device or not g.is_contiguous():
            g = g.to(device=e.device, dtype=torch.float32).contiguous()
        self._micro.started = True
        if mb is None:
            e.core.reduce_gradient(p.id, g.data_ptr())
        else:
            e.core.reduce_gradient_of(p.id, g.data_ptr(), mb)
        if p.grad_state is GradState.PENDING:
            self._micro.gradient_reduced(p)
        self._residency.flush()

    def check_no_stray_grads(self):
        """Before a step: no parameter holds a .grad its hook did not take."""
        with torch._C.DisableTorchFunction():
            held = [p for p in self._registry.params if p.param.grad is not None]
        unfrozen = [p.names[0] for p in held if frozen_at_initialize(p)]
        if unfrozen:
            raise unfrozen_error(unfrozen, "a gradient reached their .grad")
        stray = [p.names[0] for p in held]
        if stray:
            raise ZinfError(
                "parameter(s) %s hold a .grad that never reached zinf (the gradient hook is "
                "detached: was a parameter converted or replaced after zinf.initialize?)"
                % ", ".join("'%s'" % n for n in stray[:8]))
