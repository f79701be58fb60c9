"""The optimizer a trainer sees: zinf's optimizer runs in the engine, this object carries its
hyperparameters the way torch's optimizers do, so that torch learning-rate schedulers and code
written for DeepSpeed (optimizer.param_groups[0]["lr"]) work unchanged.

The engine reads param_groups[0]["lr"] before each micro-step that starts an accumulation
window's optimizer step and hands it to zinf's optimizer; every group must then hold the same
learning rate (zinf has one). betas, eps and weight_decay are the config's and fixed: a change
of them is refused at the next step rather than ignored.
"""
import torch

from . import _zinf

ZinfError = _zinf.ZinfError

# torch optimizer classes zinf's optimizer can stand for, and its config name for each.
_TORCH_TYPES = {"Adam": "Adam", "AdamW": "AdamW", "Adagrad": "Adagrad"}


def error(code, message):
    """A ZinfError raised from Python, with a code like the engine's."""
    e = ZinfError(message)
    e.code = code
    e.errno = 0
    return e


class ZinfOptimizer(torch.optim.Optimizer):
    """Stands for zinf's optimizer (the config's "optimizer"): param_groups hold the
    hyperparameters; step() belongs to engine.step(), zero_grad() clears stray .grad."""

    def __init__(self, params, kind, lr, betas, eps, weight_decay):
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.kind = kind

    def step(self, closure=None):
        raise error("FailedPrecondition",
                    "zinf's optimizer runs inside engine.step() (it updates the parameters "
                    "where zinf keeps them): call engine.step() instead of optimizer.step()")

    def zero_grad(self, set_to_none=True):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def from_torch(optimizer, config_block):
    """The config "optimizer" block for a torch optimizer handed to initialize (DeepSpeed's
    client optimizer): its type and the first group's hyperparameters. Refuses types zinf
    has no kernel for, groups that differ, and a config that names an optimizer too."""
    if config_block is not None:
        raise error("InvalidArgument",
                    "zinf.initialize: an optimizer was passed and the config has an "
                    "\"optimizer\" block; give one of them")
    kind = _TORCH_TYPES.get(type(optimizer).__name__)
    if kind is None:
        raise error("InvalidArgument",
                    "zinf.initialize: optimizer %s: zinf's optimizer is Adam, AdamW, Adagrad or "
                    "Lion; pass one of torch.optim.Adam/AdamW/Adagrad, or name it in the "
                    "config's \"optimizer\"" % type(optimizer).__name__)
    groups = optimizer.param_groups
    keys = ("lr", "betas", "eps", "weight_decay") if kind != "Adagrad" else \
        ("lr", "eps", "weight_decay")
    first = groups[0]
    for i, g in enumerate(groups[1:], 1):
        for k in keys:
            if g.get(k) != first.get(k):
                raise error("InvalidArgument",
                            "zinf.initialize: optimizer param group %d has %s=%r, group 0 has "
                            "%r; zinf's optimizer applies one set of hyperparameters to every "
                            "parameter" % (i, k, g.get(k), first.get(k)))
    for k in ("amsgrad", "maximize", "nesterov"):
        if first.get(k):
            raise error("InvalidArgument",
                        "zinf.initialize: %s=True is not implemented by zinf's optimizer" % k)
    params = {"lr": float(first["lr"]), "eps": float(first.get("eps", 1e-8)),
              "weight_decay": float(first.get("weight_decay", 0.0))}
    if kind != "Adagrad":
        params["betas"] = [float(b) for b in first.get("betas", (0.9, 0.999))]
    return {"type": kind, "params": params}


def trained_parameters(model_parameters):
    """The set of parameter ids a DeepSpeed-style model_parameters names (parameters or param
    group dicts), and the groups when there are several with differing hyperparameters."""
    ids = set()
    groups = list(model_parameters)
    for g in groups:
        if isinstance(g, dict):
            for p in g.get("params", []):
                ids.add(id(p))
        else:
            ids.add(id(g))
    hp = [{k: v for k, v in g.items() if k != "params"} for g in groups if isinstance(g, dict)]
    for i, g in enumerate(hp[1:], 1):
        if g != hp[0]:
            raise error("InvalidArgument",
                        "zinf.initialize: model_parameters group %d has %s, group 0 has %s; "
                        "zinf's optimizer applies one set of hyperparameters to every "
                        "parameter (no per-group weight_decay or lr)" % (i, g, hp[0]))
    return ids, (hp[0] if hp else {})
