"""Configuration: a dict or a DeepSpeed-style JSON file, parsed by zinf's C++ parser.

Two blocks belong to the Python layer and are taken out before the engine's parser sees the
rest: "scheduler" (DeepSpeed's learning-rate schedules, _schedulers.py) and
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
            raise _zinf.ZinfError("zinf config: the dict is not JSON-serialisable (%s)" % e) from None
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, "r", encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise _zinf.ZinfError("zinf config: cannot read %s (%s)" % (path, e.strerror)) from None
    raise TypeError("zinf config: expected a dict, a path or None, got %s" % type(config).__name__)


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
    """The config's JSON text and a summary of the fields the Python layer uses (raises
    ZinfError naming the key path for a bad value; warnings come back in the summary)."""
    c = Config(config)
    return c.text, c.summary
