"""zinf.Init: build a model whose parameters would not fit in host memory.

Inside `with zinf.Init(config):`, as soon as a module's constructor returns, the values of the
parameters it created are written to a spill file on disk (the config's NVMe folder, else
$TMPDIR or /var/tmp) and the parameters become placeholders. zinf.initialize then registers
them from the spill, and the engine reads them back one sub-group at a time into its stores.
Host memory holds one module's parameters at a time.

The parameters are created for real by the constructor (on the CPU), so any initialisation in
a module's constructor is kept. Initialisation run after a constructor returns (a parent that
re-initialises its children, Hugging Face's post_init) cannot reach values already handed to
zinf: an in-place change of a placeholder fails (or, for fill_/zero_, is detected by
zinf.initialize); load pretrained values with zinf.load_safetensors instead.

Only modules constructed on the thread that entered the Init are intercepted: another thread
building a module meanwhile gets an ordinary module with its values (torch.nn.Module's
constructors are patched process-wide while any Init is entered, and each call looks at its
own thread's Inits).
"""
import functools
import os
import threading

import torch

from . import _config, _zinf
from ._errors import ZinfError
from ._param import FLOAT_DTYPES, placeholder

# The patch of torch.nn.Module constructors is process-wide (class attributes), so it is
# installed once while any Init is entered and consults the constructing thread's own stack of
# entered Inits: a module another thread builds meanwhile is an ordinary module.
_lock = threading.Lock()
_tls = threading.local()
_entered = 0  # Init contexts entered, every thread
_patched = {}  # class -> its own __init__, while patched
_prev_init_subclass = None


def _thread_inits():
    stack = getattr(_tls, "inits", None)
    if stack is None:
        stack = _tls.inits = []
    return stack


def _subclasses(cls):
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        for s in c.__subclasses__():
            if s not in out:
                out.append(s)
                todo.append(s)
    return out


def _wrap(cls):
    original = cls.__dict__.get("__init__")
    if original is None or cls in _patched:
        return

    @functools.wraps(original)
    def __init__(module, *args, **kwargs):
        inits = _thread_inits()
        if not inits:
            return original(module, *args, **kwargs)  # not this thread's Init
        init = inits[-1]
        key = id(module)
        depth = init._building.get(key, 0)
        init._building[key] = depth + 1
        try:
            original(module, *args, **kwargs)
        finally:
            if depth == 0:
                del init._building[key]
            else:
                init._building[key] = depth
        if depth == 0:
            init._spill_module(module)

    _patched[cls] = original
    cls.__init__ = __init__


def _install():
    global _prev_init_subclass
    for cls in [torch.nn.Module] + _subclasses(torch.nn.Module):
        _wrap(cls)
    _prev_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

    def init_subclass(cls, **kwargs):
        super(torch.nn.Module, cls).__init_subclass__(**kwargs)
        with _lock:
            if _entered:
                _wrap(cls)

    torch.nn.Module.__init_subclass__ = classmethod(init_subclass)


def _uninstall():
    for cls, original in _patched.items():
        cls.__init__ = original
    _patched.clear()
    if _prev_init_subclass is None:
        del torch.nn.Module.__init_subclass__
    else:
        torch.nn.Module.__init_subclass__ = _prev_init_subclass


class Init:
    """Context manager: modules constructed inside, on this thread, hand their parameters to a
    spill file. Modules other threads construct meanwhile are not touched."""

    def __init__(self, config=None, spill_dir=None, enabled=True):
        self.enabled = enabled
        self.spill_dir = spill_dir
        self._config = config
        self._spill = None
        self._building = {}
        self.parameters = 0  # parameters spilled
        self.bytes = 0

    def __enter__(self):
        global _entered
        if not self.enabled:
            return self
        if self.spill_dir is None:
            _, summary = _config.parse(self._config)
            paths = summary["nvme_paths"]
            self.spill_dir = paths[0] if paths else os.environ.get("TMPDIR", "/var/tmp")
        self._spill = _zinf.Spill(str(self.spill_dir))
        with _lock:
            if _entered == 0:
                _install()
            _entered += 1
        _thread_inits().append(self)
        return self

    def __exit__(self, *exc):
        global _entered
        if not self.enabled:
            return False
        inits = _thread_inits()
        if self in inits:
            inits.remove(self)
        with _lock:
            _entered -= 1
            if _entered == 0:
                _uninstall()
        # The parameters built inside hold the spill until the engine has read them.
        self._spill = None
        return False

    def _spill_module(self, module):
        params = module.__dict__.get("_parameters")
        if not params:
            return
        for name, param in params.items():
            if param is None or hasattr(param, "_zinf_spill"):
                continue
            if param.dtype not in FLOAT_DTYPES:
                raise ZinfError("zinf.Init: parameter '%s' of %s is %s; zinf manages float "
                                "parameters" % (name, type(module).__name__, param.dtype))
            if param.device.type == "meta":
                raise ZinfError("zinf.Init: parameter '%s' of %s was created on the meta device; "
                                "zinf.Init needs its values (create it on the CPU)"
                                % (name, type(module).__name__))
            values = param.detach().to("cpu").contiguous()
            offset = self._spill.append(values.data_ptr(), FLOAT_DTYPES[param.dtype],
                                        values.numel())
            del values
            param.data = placeholder(param.shape, param.dtype, "cpu")
            param._zinf_spill = (self._spill, offset, param._version)
            self.parameters += 1
            self.bytes += param.numel() * 4
