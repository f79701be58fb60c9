"""Configuration: a dict or a DeepSpeed-style JSON file, parsed by zinf's C++ parser.

Two blocks belong to the Python layer and are taken out before the engine's parser sees the
rest: "scheduler" (DeepSpeed's learning-rate schedules, _ds/schedulers.py) and
"activation_checkpointing" (zinf.checkpoint, _activations.py).
"""
import json
import os

from . import _zinf

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


def parse(config):
    """The config's JSON text and a summary: every field by its config key (raises
    ZinfError naming the key path for a bad value; warnings come back in the summary)."""
    c = Config(config)
    return c.text, c.summary


# DeepSpeed's batch arithmetic lives with the DeepSpeed surface; zinf._config.resolve_batch
# stays its name here (zinf's build and the tests use it).
from ._ds.batch import resolve_batch  # noqa: E402,F401
