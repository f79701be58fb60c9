"""zinf's one error type, shared by the engine (C++, through the binding) and the Python layer:
ZinfError carries `code` (the engine's status code name) and `errno` (0 when none)."""
from . import _zinf

ZinfError = _zinf.ZinfError


def error(code, message):
    """A ZinfError raised from Python, with a code like the engine's."""
    e = ZinfError(message)
    e.code = code
    e.errno = 0
    return e
