"""DeepSpeed's Python API served by zinf (this is not Microsoft's DeepSpeed).

This package is on the import path only when asked for: `python3 -m zinf.launch ...` puts it
on every rank's path, and `python3 -m zinf.launch --deepspeed-path` prints its folder for other
launchers (accelerate launch, mpirun). A script written for DeepSpeed then runs unchanged:

    import deepspeed
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model,
                                                                model_parameters=params)

Each name is backed by zinf (zinf.initialize, zinf.Init, its engine, its optimizer and
schedules); a name zinf cannot serve raises a ZinfError naming it rather than doing nothing.
`deepspeed.__zinf__` holds zinf's version (a script can tell which DeepSpeed it has).
"""
import importlib.metadata as _metadata

import zinf as _zinf
from zinf import ZinfError, add_config_arguments, init_distributed, initialize  # noqa: F401
from zinf import checkpointing  # noqa: F401  (deepspeed.checkpointing: activation checkpoints)
from zinf._ds.engine import DeepSpeedEngine  # noqa: F401

from . import accelerator, comm, compression, moe, ops, runtime, utils, zero  # noqa: F401
from . import checkpoint  # noqa: F401
from .runtime.config import DeepSpeedConfig  # noqa: F401

__zinf__ = _zinf.__version__
try:
    __version__ = _metadata.version("deepspeed")
except _metadata.PackageNotFoundError:  # imported from its folder without the metadata
    __version__ = "0.16.0+zinf"
version = __version__
__version_major__, __version_minor__, __version_patch__ = (
    int(x) for x in __version__.split("+")[0].split(".")[:3])
__git_hash__ = None
__git_branch__ = None
dist = comm


def _not_served(name, instead):
    raise ZinfError("deepspeed.%s is not provided by zinf's DeepSpeed API: %s" % (name, instead))


def init_inference(*args, **kwargs):
    _not_served("init_inference", "zinf trains; for inference call the model in eval mode "
                                  "under torch.no_grad() after zinf.initialize")
