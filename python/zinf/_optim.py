"""The optimizer a trainer sees: zinf's optimizer runs in the engine, this object carries its
hyperparameters the way torch's optimizers do, so that torch learning-rate schedulers and code
written for DeepSpeed (optimizer.param_groups[0]["lr"]) work unchanged.

Parameter groups are the engine's (Engine::SetParamGroup): each group's lr, betas, eps and
weight_decay step its parameters. The engine reads every group before each micro-step and
hands a changed value to zinf's optimizer (a scheduler, or a trainer writing
param_groups[i][key]); the optimizer step of an accumulation window takes the values of the
window's last micro-step. Groups are fixed at initialize: add_param_group is refused.
"""
import torch

from ._errors import error

# torch optimizer classes zinf's optimizer can stand for, and its config name for each.
_TORCH_TYPES = {"Adam": "Adam", "AdamW": "AdamW", "Adagrad": "Adagrad"}


class ZinfOptimizer(torch.optim.Optimizer):
    """Stands for zinf's optimizer (the config's "optimizer"): param_groups hold each group's
    hyperparameters; step() belongs to engine.step(), zero_grad() clears stray .grad."""

    def __init__(self, params, kind, lr, betas, eps, weight_decay):
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.kind = kind
        self._fixed = True  # the groups are the engine's from here on
        # DeepSpeed's fp16 optimizers report here whether the last step was skipped because
        # its gradients overflowed (accelerate's step_was_skipped reads it); engine.step sets
        # it. Without fp16 a non-finite gradient fails the step instead.
        self.overflow = False
        self._loss_scale_source = None  # the engine's, set by it

    @property
    def cur_scale(self):
        """The dynamic loss scale now (DeepSpeed's fp16 optimizers' cur_scale; 1 without
        fp16)."""
        source = self._loss_scale_source() if self._loss_scale_source is not None else None
        return 1.0 if source is None else float(source())

    @property
    def loss_scale(self):
        """DeepSpeed's fp16 optimizers' name for cur_scale."""
        return self.cur_scale

    def add_param_group(self, param_group):
        if getattr(self, "_fixed", False):
            raise error("NotSupported",
                        "optimizer.add_param_group: zinf's parameter groups are fixed when the "
                        "engine is built; pass every group to initialize (model_parameters or "
                        "the optimizer)")
        super().add_param_group(param_group)

    def step(self, closure=None):
        raise error("FailedPrecondition",
                    "zinf's optimizer runs inside engine.step() (it updates the parameters "
                    "where zinf keeps them): call engine.step() instead of optimizer.step()")

    def zero_grad(self, set_to_none=True):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


# The hyperparameter keys of a group zinf's optimizer reads (Adagrad's have no betas).
HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")


class GroupPlan:
    """Parameter groups as torch's optimizers hold them: `groups`, one dict of
    hyperparameters per group (lr, betas, eps, weight_decay; floats), and `member`, id(torch
    parameter) -> its group's index. Parameters in no group are not trained."""

    def __init__(self, groups, member):
        self.groups = groups
        self.member = member

    @staticmethod
    def hyper(group, defaults, where):
        """A group's hyperparameters: its own keys over `defaults` (the config's)."""
        out = {}
        for k in HYPER_KEYS:
            v = group.get(k, defaults.get(k))
            try:
                out[k] = tuple(float(b) for b in v) if k == "betas" else float(v)
            except (TypeError, ValueError):
                raise error("InvalidArgument", "%s: %s = %r is not a number" % (where, k, v)) \
                    from None
            if k == "betas" and len(out[k]) != 2:
                raise error("InvalidArgument", "%s: betas = %r: two values" % (where, v))
        return out

    @classmethod
    def from_groups(cls, groups, defaults, where):
        """From torch-style groups (dicts with "params", or parameters: one group)."""
        groups = list(groups)
        if not groups:
            raise error("InvalidArgument", "%s: no parameters" % where)
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        plan = cls([], {})
        for i, g in enumerate(groups):
            if not isinstance(g, dict):
                raise error("InvalidArgument", "%s: group %d is a %s; give every group as a dict "
                                               "with \"params\" (torch's param groups) or pass "
                                               "the parameters alone"
                            % (where, i, type(g).__name__))
            params = g.get("params", [])
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            for k in ("amsgrad", "maximize", "nesterov"):
                if g.get(k):
                    raise error("InvalidArgument", "%s: group %d: %s=True is not implemented by "
                                                   "zinf's optimizer" % (where, i, k))
            plan.groups.append(cls.hyper(g, defaults, "%s: group %d" % (where, i)))
            for p in params:
                if id(p) in plan.member:
                    raise error("InvalidArgument", "%s: a parameter is in groups %d and %d; "
                                                   "torch allows one group per parameter"
                                % (where, plan.member[id(p)], i))
                plan.member[id(p)] = i
        return plan


class GroupSync:
    """Each parameter group's hyperparameters as zinf's optimizer last got them (one per
    engine): a group goes to the core (Engine::SetParamGroup) only when its values changed (a
    scheduler, or a trainer writing param_groups[i][key])."""

    def __init__(self, defaults):
        self.defaults = defaults  # the config's betas, eps and weight_decay
        self._pushed = {}  # group index -> the values the core has

    def push(self, core, i, h):
        """Hands group `i`'s hyperparameters `h` to `core` unless it has them already."""
        key = (h["lr"], tuple(h["betas"]), h["eps"], h["weight_decay"])
        if self._pushed.get(i) != key:
            core.set_param_group(i, h["lr"], h["betas"][0], h["betas"][1], h["eps"],
                                 h["weight_decay"])
            self._pushed[i] = key

    def hypers(self, param_groups):
        """Each of the optimizer's groups' hyperparameters (lr, betas, eps, weight_decay)."""
        return [GroupPlan.hyper(g, self.defaults, "optimizer param group %d" % i)
                for i, g in enumerate(param_groups)]

    def sync(self, core, param_groups):
        """Hands each of the optimizer's groups to `core` when it changed."""
        if len(param_groups) != core.num_param_groups:
            raise error("NotSupported",
                        "the optimizer holds %d param groups and zinf's engine %d: groups are "
                        "fixed when the engine is built (pass every group to initialize)"
                        % (len(param_groups), core.num_param_groups))
        for i, h in enumerate(self.hypers(param_groups)):
            self.push(core, i, h)


# DeepSpeed's own optimizer classes (deepspeed.ops.adam), and whether each is AdamW.
def _adam_kind(optimizer):
    name = type(optimizer).__name__
    if name in _TORCH_TYPES:
        return _TORCH_TYPES[name]
    if getattr(optimizer, "_zinf_kind", None) is not None:
        return optimizer._zinf_kind
    return None


def from_torch(optimizer, config_block):
    """The config "optimizer" block (the type and group 0's values) and the GroupPlan for a
    torch optimizer handed to initialize (DeepSpeed's client optimizer: a torch Adam / AdamW /
    Adagrad, or deepspeed.ops.adam's DeepSpeedCPUAdam / FusedAdam). Refuses types zinf has no
    kernel for and a config that names an optimizer too."""
    if config_block is not None:
        raise error("InvalidArgument",
                    "zinf.initialize: an optimizer was passed and the config has an "
                    "\"optimizer\" block; give one of them")
    kind = _adam_kind(optimizer)
    if kind is None:
        raise error("InvalidArgument",
                    "zinf.initialize: optimizer %s: zinf's optimizer is Adam, AdamW, Adagrad or "
                    "Lion; pass torch.optim.Adam/AdamW/Adagrad or deepspeed.ops.adam's "
                    "DeepSpeedCPUAdam/FusedAdam, or name it in the config's \"optimizer\""
                    % type(optimizer).__name__)
    defaults = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    if kind == "Adagrad":
        for i, g in enumerate(optimizer.param_groups):
            for k in ("lr_decay", "initial_accumulator_value"):
                if g.get(k, 0):
                    raise error("InvalidArgument",
                                "optimizer %s: group %d: %s=%r is not implemented by zinf's "
                                "Adagrad (0 only)" % (type(optimizer).__name__, i, k, g[k]))
    plan = GroupPlan.from_groups(optimizer.param_groups, defaults,
                                 "optimizer %s" % type(optimizer).__name__)
    first = plan.groups[0]
    params = {"lr": first["lr"], "eps": first["eps"], "weight_decay": first["weight_decay"]}
    if kind != "Adagrad":
        params["betas"] = list(first["betas"])
    return {"type": kind, "params": params}, plan


def model_parameter_groups(model_parameters, defaults):
    """The GroupPlan of DeepSpeed's model_parameters (parameters, or torch param-group dicts
    whose keys override the config's optimizer params, as DeepSpeed's optimizer built from the
    config takes them)."""
    return GroupPlan.from_groups(model_parameters, defaults, "zinf.initialize: model_parameters")
