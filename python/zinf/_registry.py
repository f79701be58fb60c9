"""Which torch parameters an engine manages: their registration with the engine (initial values,
or a zinf.Init spill), a ManagedParam for each (tied parameters are one), the end of
registration, and the adoption of the model (each parameter becomes a ZinfParameter, and
model.load_state_dict loads through the engine).
"""
import collections
import weakref

import torch

from . import _zinf
from ._errors import error
from ._param import FLOAT_DTYPES, ManagedParam
from ._subclasses import ZinfParameter

ZinfError = _zinf.ZinfError


def all_named_parameters(module, prefix=""):
    """Every (name, parameter) pair, tied parameters under each of their names (what
    named_parameters(remove_duplicate=False) gives on torch >= 2.0)."""
    for key, value in module._parameters.items():
        if value is not None:
            yield prefix + key, value
    for key, child in module._modules.items():
        if child is not None:
            yield from all_named_parameters(child, prefix + key + ".")


class ParamRegistry:
    """An engine's managed parameters, in registration order."""

    def __init__(self):
        self.params = []  # ManagedParam, in registration order (their ids)
        self.by_obj = {}  # id(torch parameter) -> ManagedParam
        self.group_of = []  # each one's optimizer group, in registration order (-1: not trained)
        self.registered = False  # the engine's registration has ended (it holds the values)

    def register(self, ctx, engine, model, trained):
        """Registers every parameter of `model` with the core of `ctx` (the EngineContext of
        `engine`, which each parameter then names weakly as its owner); its data becomes the
        placeholder. `trained`: id(parameter) -> its parameter group, for the parameters to
        train (None: every one that requires grad, in group 0)."""
        core = ctx.core
        names = collections.defaultdict(list)
        for name, param in all_named_parameters(model):
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
            group = trained.get(id(param), 0) if trainable and trained is not None else 0
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
                pid = core.register(name, list(param.shape), trainable,
                                    spill=spill_file, spill_offset=offset, group=group)
                source = None
            else:
                source = param.detach()
                if source.device.type == "meta":
                    raise ZinfError("parameter '%s' is on the meta device: build the model "
                                    "under zinf.Init (or on the CPU) so it has values" % name)
                source = source.to("cpu").contiguous()
                pid = core.register(name, list(param.shape), trainable,
                                    ptr=source.data_ptr(), dtype=FLOAT_DTYPES[param.dtype],
                                    group=group)
            p = ManagedParam(pid, param, names[id(param)], ctx.dtype, ctx.device, engine)
            p.trainable = trainable
            p.source = source
            self.params.append(p)
            self.by_obj[id(param)] = p
            self.group_of.append(group if trainable else -1)
            param._zinf_engine = weakref.ref(engine)
            param.data = p.placeholder
            if hasattr(param, "_zinf_spill"):
                del param._zinf_spill
        # Buffers live in torch, on the engine's device.
        for module in model.modules():
            for key, buf in list(module._buffers.items()):
                if buf is not None and buf.device != ctx.device:
                    module._buffers[key] = buf.to(ctx.device)

    def adopt(self, model, access):
        """Every managed parameter becomes a ZinfParameter (reads and writes outside the hooks
        go through _access.py), and model.load_state_dict loads through the engine."""
        for p in self.params:
            p.param.__class__ = ZinfParameter
            p.param._zinf_rec = p
        original = type(model).load_state_dict.__get__(model)

        def load_state_dict(state_dict, strict=True):
            return access.load_state_dict(original, state_dict, strict)

        load_state_dict.__doc__ = original.__doc__
        model.__dict__["load_state_dict"] = load_state_dict

    def finish(self, core, resume=False):
        """Ends registration: the engine builds its stores (from the initial values, or with
        `resume` from the swap store's last committed step) and holds every value."""
        if resume:
            core.finish_registration(resume=True)
        else:
            core.finish_registration()
        self.registered = True
        for p in self.params:
            p.finish_registration()

    def managed(self, param):
        p = self.by_obj.get(id(param))
        if p is None:
            raise ZinfError("not a parameter of this engine")
        return p
