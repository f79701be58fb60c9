"""Configuration: a dict or a DeepSpeed-style JSON file, parsed by zinf's C++ parser.

Two blocks belong to the Python layer and are taken out before the engine's parser sees the
rest: "scheduler" (DeepSpeed's learning-rate schedules, _schedulers.py) and
"activation_checkpointing" (zinf.checkpoint, _activations.py).
"""
import json
import os

from . import _zinf
from ._errors import error

PYTHON_BLOCKS = ("scheduler", "activation_checkpointing")


def config_text(config):
    """The JSON text of `config`: None ({}), a dict, or the path of a JSON file."""
    if config is None:
        return "{}"
    if isinstance(config, dict):
        try:
            return json.dumps(config)
        except (TypeError, ValueError) as e:
            raise _zinf.ZinfError("zinf config: the dict is not JSON-serialisable (%s)"
                                  % e) from None
    if isinstance(config, (str, os.PathLike)):
        return _read_config_file(os.fspath(config))
    raise TypeError("zinf config: expected a dict, a path or None, got %s" % type(config).__name__)


_MAX_CONFIG_BYTES = 64 << 20


def _read_config_file(path):
    """A config file's text: a regular file only (opened without blocking, so a FIFO or a
    device is refused at once instead of read forever), at most 64 MiB."""
    import stat
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise _zinf.ZinfError("zinf config: cannot read %s (%s)" % (path, e.strerror)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else (
                "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file")
            raise _zinf.ZinfError("zinf config: %s is %s; give a JSON file" % (path, kind))
        if st.st_size > _MAX_CONFIG_BYTES:
            raise _zinf.ZinfError("zinf config: %s holds %d bytes, more than a config may (64 MiB)"
                                  % (path, st.st_size))
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = None
            data = f.read(_MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise _zinf.ZinfError("zinf config: cannot read %s (%s)" % (path, e.strerror)) from None
    finally:
        if fd is not None:
            os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _zinf.ZinfError("zinf config: %s is not UTF-8 text (%s)" % (path, e)) from None


class Config:
    """A config split in two: `text`, the JSON the engine parses (what zinf-train reads), and
    `blocks`, the Python layer's blocks; `tree` is the whole config as a dict (None when the
    text is not JSON, which the engine's parser then reports)."""

    def __init__(self, config):
        text = config_text(config)
        try:
            tree = json.loads(text)
        except ValueError:
            tree = None
        self.tree = tree if isinstance(tree, dict) else None
        self.blocks = {}
        if self.tree is not None and any(k in self.tree for k in PYTHON_BLOCKS):
            rest = dict(self.tree)
            for key in PYTHON_BLOCKS:
                if key in rest:
                    self.blocks[key] = rest.pop(key)
            text = json.dumps(rest)
        self.text = text
        self.summary = _zinf.parse_config(text)

    def get(self, *path, default=None):
        """A value of the whole config by key path, or `default`."""
        node = self.tree
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return default
            node = node[key]
        return node

    def with_zinf_key(self, key, value):
        """The engine's JSON text with "zinf": {key: value} set."""
        tree = json.loads(self.text)
        section = dict(tree.get("zinf") or {})
        section[key] = value
        tree["zinf"] = section
        return json.dumps(tree)


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
    return Config(tree)


def parse(config):
    """The config's JSON text and a summary of the fields the Python layer uses (raises
    ZinfError naming the key path for a bad value; warnings come back in the summary)."""
    c = Config(config)
    return c.text, c.summary
