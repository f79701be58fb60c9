"""DeepSpeed's batch arithmetic over a config (zinf._config.Config): the three batch keys
filled in from any two, as DeepSpeed computes them. zinf.initialize applies it to every config
(zinf's own form, with no batch key, is left as it is)."""
from .._errors import error

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
               "gradient_accumulation_steps")


def resolve_batch(cfg, world):
    """DeepSpeed's batch arithmetic: train_batch_size = train_micro_batch_size_per_gpu x
    gradient_accumulation_steps x the number of ranks. Any two of the three give the third;
    train_batch_size alone means one micro-step per step (micro = train / ranks), micro alone
    the same (train = micro x ranks), accumulation alone changes nothing else; all three must
    agree. Returns `cfg` with the three filled in (a new Config when it changed); refuses an
    inconsistent or indivisible set with the numbers, and "auto" (which Hugging Face's Trainer
    and accelerate fill in before they hand the config over)."""
    if cfg.tree is None:
        return cfg
    given = {}
    for key in _BATCH_KEYS:
        if key not in cfg.tree or cfg.tree[key] is None:
            continue
        v = cfg.tree[key]
        if v == "auto":
            raise error("InvalidArgument",
                        "%s: \"auto\" is filled in by Hugging Face's Trainer or accelerate before "
                        "they hand the config over; called directly, give the number" % key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return cfg  # the engine's parser names the bad value
        given[key] = v
    train = given.get("train_batch_size")
    micro = given.get("train_micro_batch_size_per_gpu")
    gas = given.get("gradient_accumulation_steps")
    if train is None and micro is None:
        return cfg  # zinf's own form: no batch size needed (the engine has no data loader)

    def refuse(why):
        raise error("InvalidArgument",
                    "batch sizes: %s (train_batch_size = train_micro_batch_size_per_gpu x "
                    "gradient_accumulation_steps x ranks, as DeepSpeed computes it; "
                    "given: %s; ranks: %d)"
                    % (why, ", ".join("%s %d" % kv for kv in given.items()), world))

    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * world:
            refuse("%d != %d x %d x %d" % (train, micro, gas, world))
    elif train is not None and micro is not None:
        if train % (micro * world):
            refuse("train_batch_size %d is not a multiple of %d x %d ranks"
                   % (train, micro, world))
        gas = train // (micro * world)
    elif train is not None and gas is not None:
        if train % (gas * world):
            refuse("train_batch_size %d is not a multiple of %d accumulation steps x %d ranks"
                   % (train, gas, world))
        micro = train // (gas * world)
    elif train is not None:
        gas = 1
        if train % world:
            refuse("train_batch_size %d is not a multiple of %d ranks" % (train, world))
        micro = train // world
    else:
        gas = gas or 1
        train = micro * gas * world
    if (train, micro, gas) == (given.get("train_batch_size"),
                               given.get("train_micro_batch_size_per_gpu"),
                               given.get("gradient_accumulation_steps")):
        return cfg
    tree = dict(cfg.tree)
    tree.update({"train_batch_size": train, "train_micro_batch_size_per_gpu": micro,
                 "gradient_accumulation_steps": gas})
    return type(cfg)(tree)
