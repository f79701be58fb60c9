"""Configuration: a dict or a DeepSpeed-style JSON file, parsed by zinf's C++ parser."""
import json
import os

from . import _zinf


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


def parse(config):
    """The config's JSON text and a summary of the fields the Python layer uses (raises
    ZinfError naming the key path for a bad value; warnings come back in the summary)."""
    text = config_text(config)
    return text, _zinf.parse_config(text)
