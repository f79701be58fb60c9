"""DeepSpeed's learning-rate schedules, from a config's "scheduler" block.

Each schedule keeps DeepSpeed's contract: it is created with last_batch_iteration = -1 and
sets the optimizer's learning rate for the first optimizer step; step() (which the engine
calls after every optimizer step, i.e. at each accumulation boundary) advances the iteration
and sets the rate of the next one; state_dict() is {"last_batch_iteration": n}. The formulas
are DeepSpeed's (deepspeed/runtime/lr_schedules.py), written here from its documented
behaviour; python/tests/test_deepspeed.py checks every step against a separate transcription.

    WarmupLR        warmup_min_lr -> warmup_max_lr over warmup_num_steps ("log" or "linear"),
                    then warmup_max_lr
    WarmupDecayLR   the same warmup, then linear decay to 0 at total_num_steps
    WarmupCosineLR  ratios of the optimizer's lr: warmup_min_ratio -> 1 over warmup_num_steps,
                    then a cosine down to cos_min_ratio at total_num_steps
    OneCycle        cycle_min_lr -> cycle_max_lr over cycle_first_step_size, back over
                    cycle_second_step_size (optionally in stairs), then cycle_min_lr divided by
                    1 + decay_lr_rate * (steps after the cycle) / decay_step_size

OneCycle's momentum cycling (cycle_momentum, on by default in DeepSpeed) is not implemented
here, so it is refused with a message rather than silently not done (a schedule of the
trainer's own may set param_groups[i]["betas"]: the engine takes them).
"""
import math

from .._errors import error

TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle")


def _number(params, key, default, where, integer=False, positive=False):
    value = params.get(key, default)
    if isinstance(value, str):
        raise error("InvalidArgument",
                    "%s.%s: %r is not a number (\"auto\" values are filled in by Hugging Face's "
                    "Trainer; give the number)" % (where, key, value))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error("InvalidArgument", "%s.%s: expected a number, got %r" % (where, key, value))
    if integer and value != int(value):
        raise error("InvalidArgument", "%s.%s: expected an integer, got %r" % (where, key, value))
    if not math.isfinite(value) or (positive and value <= 0) or value < 0:
        raise error("InvalidArgument", "%s.%s: must be a finite number %s, got %r"
                    % (where, key, "> 0" if positive else ">= 0", value))
    return int(value) if integer else float(value)


def _warmup_type(params, where):
    kind = params.get("warmup_type", "log")
    if kind not in ("log", "linear"):
        raise error("InvalidArgument",
                    "%s.warmup_type: \"log\" or \"linear\", got %r" % (where, kind))
    return kind


def _check_keys(params, allowed, where):
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise error("InvalidArgument", "%s: unknown key(s) %s (this schedule takes %s)"
                    % (where, ", ".join(unknown), ", ".join(sorted(allowed))))


class _Schedule:
    """What the schedules share: the iteration counter, the optimizer's groups, state."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.last_batch_iteration = -1
        self._last_lr = self._apply(self.group_lrs(-1))

    def lr_at(self, iteration):  # pragma: no cover - every schedule defines it
        raise NotImplementedError

    def group_lrs(self, iteration):
        """Every parameter group's rate at `iteration`: the schedule's one rate (DeepSpeed's
        WarmupLR, WarmupDecayLR and OneCycle give every group the same; WarmupCosineLR scales
        each group's own)."""
        return [self.lr_at(iteration) for _ in self.optimizer.param_groups]

    def _apply(self, lrs):
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        return list(lrs)

    def get_lr(self):
        return self.group_lrs(self.last_batch_iteration)

    def get_last_lr(self):
        return self._last_lr

    def step(self, last_batch_iteration=None):
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply(self.group_lrs(last_batch_iteration))

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state):
        self.last_batch_iteration = state["last_batch_iteration"]
        self._last_lr = self.group_lrs(self.last_batch_iteration)


def _warmup_fraction(iteration, steps, kind):
    """How far the warmup is at `iteration` (0 at the start), for iteration < steps."""
    if kind == "log":
        return math.log(iteration + 1) / math.log(steps)
    return iteration / steps


class WarmupLR(_Schedule):
    KEYS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
            "last_batch_iteration")

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type="log"):
        self.min_lr = warmup_min_lr
        self.max_lr = optimizer.param_groups[0]["lr"] if warmup_max_lr is None else warmup_max_lr
        # DeepSpeed takes at least two warmup steps (log(1) would divide by zero).
        self.warmup_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer)

    def _gamma(self, iteration):
        if iteration < self.warmup_steps:
            return _warmup_fraction(iteration, self.warmup_steps, self.warmup_type)
        return 1.0

    def lr_at(self, iteration):
        if iteration < 0:
            return self.min_lr
        return self.min_lr + (self.max_lr - self.min_lr) * self._gamma(iteration)


class WarmupDecayLR(WarmupLR):
    KEYS = WarmupLR.KEYS + ("total_num_steps",)

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type="log"):
        self.total_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _gamma(self, iteration):
        if iteration < self.warmup_steps:
            return _warmup_fraction(iteration, self.warmup_steps, self.warmup_type)
        left = float(self.total_steps - iteration)
        return max(0.0, left / float(max(1.0, self.total_steps - self.warmup_steps)))


class WarmupCosineLR(_Schedule):
    KEYS = ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
            "warmup_type", "last_batch_iteration")

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type="log"):
        self.total_steps = total_num_steps
        self.min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.warmup_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        # Each group's own rate, scaled by the ratio (DeepSpeed's org_lrs).
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.base_lr = self.base_lrs[0]
        super().__init__(optimizer)

    def ratio(self, iteration):
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_steps:
            f = _warmup_fraction(iteration, self.warmup_steps, self.warmup_type)
            return self.min_ratio + f * (1.0 - self.min_ratio)
        # The cosine runs from the last warmup step; past total_num_steps it stays at its end.
        done = iteration - self.warmup_steps + 1
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, done / span)
        half = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * half)

    def lr_at(self, iteration):
        return self.base_lr * self.ratio(iteration)

    def group_lrs(self, iteration):
        r = self.ratio(iteration)
        return [b * r for b in self.base_lrs]


class OneCycle(_Schedule):
    KEYS = ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size",
            "cycle_second_step_size", "cycle_first_stair_count", "cycle_second_stair_count",
            "decay_step_size", "cycle_momentum", "cycle_min_mom", "cycle_max_mom",
            "decay_mom_rate", "last_batch_iteration")

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0,
                 cycle_first_step_size=2000, cycle_second_step_size=None,
                 cycle_first_stair_count=0, cycle_second_stair_count=None, decay_step_size=0):
        self.min_lr = cycle_min_lr
        self.max_lr = cycle_max_lr
        self.decay_rate = decay_lr_rate
        self.up = float(cycle_first_step_size)
        self.down = float(cycle_second_step_size) if cycle_second_step_size is not None \
            else self.up
        self.cycle = self.up + self.down
        self.up_share = self.up / self.cycle
        self.up_stairs = cycle_first_stair_count
        self.down_stairs = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step = decay_step_size
        super().__init__(optimizer)

    def _height(self, iteration):
        """The cycle's fraction of the way from min to max after `iteration` + 1 batches."""
        batches = iteration + 1
        position = batches / self.cycle - math.floor(batches / self.cycle)
        if position <= self.up_share:
            height, stairs = position / self.up_share, self.up_stairs
        else:
            height, stairs = (position - 1) / (self.up_share - 1), self.down_stairs
        if stairs > 0:
            # Stairs are counted from the batch offset inside the cycle (exact integers).
            offset = batches % self.cycle
            if offset <= self.up:
                level = offset * stairs / self.up
            else:
                level = (self.cycle - offset) * stairs / self.down
            height = math.floor(level) / stairs
        return height

    def lr_at(self, iteration):
        if iteration < 0:
            return self.min_lr
        if iteration < self.cycle:
            return self.min_lr + (self.max_lr - self.min_lr) * self._height(iteration)
        if math.isclose(self.decay_step, 0) or math.isclose(self.decay_rate, 0):
            return self.min_lr
        after = iteration - self.cycle + 1
        return self.min_lr / (1 + self.decay_rate * after / self.decay_step)


def from_config(block, optimizer):
    """The schedule a config's "scheduler" block names, over `optimizer`; ZinfError naming
    the key for anything wrong."""
    if not isinstance(block, dict):
        raise error("InvalidArgument", "scheduler: expected an object with \"type\" and "
                                       "\"params\", got %r" % (block,))
    kind = block.get("type")
    if kind not in TYPES:
        raise error("InvalidArgument", "scheduler.type: one of %s, got %r (LRRangeTest is not "
                                       "provided)" % (", ".join(TYPES), kind))
    extra = sorted(set(block) - {"type", "params"})
    if extra:
        raise error("InvalidArgument", "scheduler: unknown key(s) %s" % ", ".join(extra))
    params = block.get("params", {})
    if not isinstance(params, dict):
        raise error("InvalidArgument", "scheduler.params: expected an object")
    where = "scheduler.params"
    cls = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
           "WarmupCosineLR": WarmupCosineLR, "OneCycle": OneCycle}[kind]
    _check_keys(params, cls.KEYS, where)
    if params.get("last_batch_iteration", -1) != -1:
        raise error("InvalidArgument", "%s.last_batch_iteration: only -1 (a run resumes its "
                                       "schedule through load_checkpoint)" % where)
    warm = lambda: _number(params, "warmup_num_steps", 1000, where, integer=True,  # noqa: E731
                           positive=True)
    if kind == "WarmupLR":
        max_lr = None if "warmup_max_lr" not in params else \
            _number(params, "warmup_max_lr", 0.001, where)
        return WarmupLR(optimizer, _number(params, "warmup_min_lr", 0.0, where), max_lr, warm(),
                        _warmup_type(params, where))
    if kind == "WarmupDecayLR":
        if "total_num_steps" not in params:
            raise error("InvalidArgument", "%s.total_num_steps: required by WarmupDecayLR" % where)
        return WarmupDecayLR(optimizer,
                             _number(params, "total_num_steps", 0, where, integer=True),
                             _number(params, "warmup_min_lr", 0.0, where),
                             _number(params, "warmup_max_lr", 0.001, where), warm(),
                             _warmup_type(params, where))
    if kind == "WarmupCosineLR":
        if "total_num_steps" not in params:
            raise error("InvalidArgument", "%s.total_num_steps: required by WarmupCosineLR"
                        % where)
        return WarmupCosineLR(optimizer,
                              _number(params, "total_num_steps", 0, where, integer=True),
                              _number(params, "warmup_min_ratio", 0.0, where), warm(),
                              _number(params, "cos_min_ratio", 0.0001, where),
                              _warmup_type(params, where))
    # OneCycle
    if params.get("cycle_momentum", True) is not False:
        raise error("InvalidArgument",
                    "%s.cycle_momentum: OneCycle cycles Adam's beta1 by default, which zinf's "
                    "OneCycle does not implement; set \"cycle_momentum\": false to run the "
                    "learning-rate cycle alone" % where)
    for key in ("cycle_min_lr", "cycle_max_lr"):
        if key not in params:
            raise error("InvalidArgument", "%s.%s: required by OneCycle" % (where, key))
    second = params.get("cycle_second_step_size")
    second_stairs = params.get("cycle_second_stair_count")
    return OneCycle(optimizer,
                    _number(params, "cycle_min_lr", 0.0, where),
                    _number(params, "cycle_max_lr", 0.0, where),
                    _number(params, "decay_lr_rate", 0.0, where),
                    _number(params, "cycle_first_step_size", 2000, where, integer=True,
                            positive=True),
                    None if second is None else
                    _number(params, "cycle_second_step_size", 0, where, integer=True,
                            positive=True),
                    _number(params, "cycle_first_stair_count", 0, where, integer=True),
                    None if second_stairs is None else
                    _number(params, "cycle_second_stair_count", 0, where, integer=True),
                    _number(params, "decay_step_size", 0, where, integer=True))
