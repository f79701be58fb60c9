"""deepspeed.utils (zinf): the logger and the safe_* accessors of a ZeRO-3 parameter's whole
values (collective: every rank calls them together, between steps)."""
import logging

import torch

import zinf

logger = logging.getLogger("DeepSpeed")
if not logger.handlers:
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] %(message)s"))
    logger.addHandler(_h)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def log_dist(message, ranks=None, level=logging.INFO):
    from deepspeed import comm
    rank = comm.get_rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)


def _engine_of(param):
    ref = getattr(param, "_zinf_engine", None)
    e = ref() if ref is not None else None
    if e is None:
        raise zinf.ZinfError("not a parameter of a live zinf engine")
    return e


def safe_get_full_fp32_param(param):
    """The parameter's fp32 master, whole (a new CPU tensor)."""
    return _engine_of(param).gather(param, torch.float32)


def safe_set_full_fp32_param(param, value):
    """Sets the parameter's fp32 master (every rank, the same value)."""
    with torch.no_grad():
        param.copy_(value.to(dtype=param.dtype, device=param.device))


def safe_get_full_grad(param):
    raise zinf.ZinfError("safe_get_full_grad: zinf reduces each gradient into its optimizer's "
                         "partition as it is produced and keeps no whole gradient; read "
                         "engine.get_global_grad_norm() for the norm")


def safe_get_full_optimizer_state(param, optim_state_key):
    raise zinf.ZinfError("safe_get_full_optimizer_state: not provided by zinf (its optimizer "
                         "states are in checkpoints: engine.save_checkpoint)")


def set_z3_leaf_modules(model, leaf_module_classes):
    """Marks the modules of these classes as ZeRO-3 leaves (their parameters fetched together,
    as zinf fetches every module's own parameters anyway); returns them."""
    classes = tuple(c for c in leaf_module_classes if isinstance(c, type))
    names = {c for c in leaf_module_classes if isinstance(c, str)}
    leaves = [m for m in model.modules()
              if isinstance(m, classes) or type(m).__name__ in names]
    for m in leaves:
        m._z3_leaf = True
    return leaves
