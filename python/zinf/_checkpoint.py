"""Checkpoints of an engine (what the Python side adds to the engine's own: client_state,
buffers, learning rate and scheduler), resuming from the swap store, and the parameters' full
values (full_state_dict). The engine's checkpoint folder holds the parameters, optimizer states
and counters; this module fills and reads its user document.

Each function takes the engine's EngineContext (_context.py) for the core and the managed
parameters, and the engine itself only for its public training state (module, optimizer,
lr_scheduler).
"""
import base64
import collections
import io
import json
import os

import torch

from . import _zinf
from ._errors import error

ZinfError = _zinf.ZinfError

_FORMAT = "zinf-python-1"


def persistent_buffers(module):
    """The model's persistent buffers under their state_dict names."""
    out = collections.OrderedDict()
    for prefix, sub in module.named_modules():
        for key, buf in sub._buffers.items():
            if buf is not None and key not in sub._non_persistent_buffers_set:
                out[(prefix + "." if prefix else "") + key] = buf
    return out


def _encode(obj):
    """A scheduler's state as JSON with its types kept (torch 1.13's weights-only loader refuses
    floats and Counters, and plain JSON would turn MultiStepLR's Counter of int milestones into
    string keys, so the rate would never decay after a resume). Raises TypeError for anything
    but numbers, strings, None, lists, tuples, dicts and Counters."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_encode(v) for v in obj]
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v) for v in obj]}
    if isinstance(obj, collections.Counter):
        return {"__counter__": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if type(obj) is dict:
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v) for k, v in obj.items()}
        return {"__dict__": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    raise TypeError("%s is not kept in a checkpoint's JSON" % type(obj).__name__)


def _decode(obj):
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if isinstance(obj, dict):
        if "__tuple__" in obj:
            return tuple(_decode(v) for v in obj["__tuple__"])
        if "__counter__" in obj:
            return collections.Counter({_key(k): _decode(v) for k, v in obj["__counter__"]})
        if "__dict__" in obj:
            return {_key(k): _decode(v) for k, v in obj["__dict__"]}
        return {k: _decode(v) for k, v in obj.items()}
    return obj


def _key(k):
    k = _decode(k)
    return tuple(k) if isinstance(k, list) else k


def _folder(path):
    return os.path.basename(path.rstrip("/"))


def save(ctx, engine, path, client_state, extra=None):
    """Writes a checkpoint of `engine` into the folder `path` (atomically; every rank
    together), with `extra` keys in its user document (the DeepSpeed engine's tag)."""
    ctx.between_steps("save the checkpoint %s" % _folder(path))

    def blob(obj):
        out = io.BytesIO()
        torch.save(obj, out)
        return base64.b64encode(out.getvalue()).decode("ascii")

    doc = {"format": _FORMAT, "client_state": client_state,
           "buffers": blob({k: v.detach().cpu() for k, v in
                            persistent_buffers(engine.module).items()}),
           "names": [p.names[0] for p in ctx.registry.params],
           "lr": engine.get_lr()[0],
           "param_groups": [{k: (list(v) if k == "betas" else v) for k, v in h.items()}
                            for h in ctx.groups.hypers(engine.optimizer.param_groups)],
           "param_group_of": ctx.registry.group_of}
    if engine.lr_scheduler is not None:
        state = engine.lr_scheduler.state_dict()
        try:
            doc["lr_scheduler_state"] = _encode(state)
        except TypeError:
            doc["lr_scheduler"] = blob(state)  # tensors inside: torch's bytes
    doc.update(extra or {})
    try:
        user = json.dumps(doc)
    except (TypeError, ValueError) as e:
        raise ZinfError("save_checkpoint: client_state must be JSON-serialisable (%s)" % e)
    ctx.core.save_checkpoint(path, user)


def load(ctx, engine, path):
    """Restores the checkpoint in the folder `path` into `engine` (every rank together); returns
    its user document (None when it was not written by the Python side)."""
    ctx.between_steps("load the checkpoint %s" % _folder(path))
    core = ctx.core
    raw = core.load_checkpoint(path)
    ctx.micro.values_set()
    ctx.micro.restart(core.global_step * ctx.gas)
    try:
        user = json.loads(raw.decode("utf-8")) if raw else {}
    except ValueError:
        user = {}
    if user.get("format") != _FORMAT:
        return None
    data = base64.b64decode(user.get("buffers", ""))
    if data:
        saved = torch.load(io.BytesIO(data), weights_only=True)
        for name, buf in persistent_buffers(engine.module).items():
            if name in saved:
                with torch.no_grad():
                    buf.copy_(saved[name])
    if engine.lr_scheduler is not None and user.get("lr_scheduler_state") is not None:
        engine.lr_scheduler.load_state_dict(_decode(user["lr_scheduler_state"]))
    elif engine.lr_scheduler is not None and user.get("lr_scheduler"):
        state = torch.load(io.BytesIO(base64.b64decode(user["lr_scheduler"])),
                           weights_only=True)
        engine.lr_scheduler.load_state_dict(state)
    saved = user.get("param_groups")
    if saved is not None:
        groups = engine.optimizer.param_groups
        member = user.get("param_group_of")
        group_of = ctx.registry.group_of
        if len(saved) != len(groups) or (member is not None and member != group_of):
            first = next((i for i, (a, b) in enumerate(zip(member or [], group_of))
                          if a != b), None)
            raise error("FailedPrecondition",
                        "%s was saved with %d parameter groups%s and this engine's optimizer "
                        "has %d%s: the parameters, optimizer states and counters were loaded, "
                        "the groups' hyperparameters were not (they would step other "
                        "parameters); build the optimizer with the groups it was saved with "
                        "and load again"
                        % (path, len(saved),
                           "" if first is None else ", '%s' in group %d"
                           % (ctx.registry.params[first].names[0], member[first]),
                           len(groups), "" if first is None else " (here in group %d)"
                           % group_of[first]))
        for group, h in zip(groups, saved):  # torch's optimizer.load_state_dict does the same
            for k, v in h.items():
                group[k] = tuple(v) if k == "betas" else v
    elif user.get("lr") is not None:
        for group in engine.optimizer.param_groups:
            group["lr"] = user["lr"]
    ctx.groups.sync(core, engine.optimizer.param_groups)
    return user


def resume_from_store(ctx):
    """Ends registration from the swap store's last committed step (zinf.durable)."""
    if ctx.registry.registered:
        raise ZinfError("resume_from_store must come right after initialize, before any "
                        "forward, step or checkpoint call")
    ctx.registry.finish(ctx.core, resume=True)
    ctx.micro.index = ctx.core.global_step * ctx.gas


def full_state_dict(registry, engine, dtype):
    """The model's state_dict with every parameter's gathered values (tied ones once, each
    through engine.gather)."""
    by_obj = registry.by_obj
    gathered = {}
    out = collections.OrderedDict()
    for key, value in engine.module.state_dict(keep_vars=True).items():
        p = by_obj.get(id(value))
        if p is None:
            out[key] = value.detach().cpu().clone()
            continue
        if p.id not in gathered:
            gathered[p.id] = engine.gather(p.param, dtype)
        out[key] = gathered[p.id]
    return out
