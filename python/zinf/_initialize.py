"""Building an engine for a model: the config split (the engine's part, the Python layer's
blocks), the pinned budget, the device, the core engine and the ZinfEngine around it."""
import warnings
import weakref

import torch

from . import _activations, _distributed, _zinf
from ._config import Config
from ._ds import schedulers as _schedulers
from ._ds.batch import resolve_batch
from ._engine import ZinfEngine, context_of
from ._errors import error

ZinfError = _zinf.ZinfError

DEFAULT_PINNED = 1 << 30  # the engine's default zinf.pinned_budget_bytes
# What the machine keeps for everything else when the budget is sized to the model.
_MEMORY_MARGIN = 1 << 30


_engines = []  # weak references to the engines build made, newest last


def newest_engine():
    """The newest engine build made that is still open, or None."""
    while _engines:
        e = _engines[-1]()
        if e is not None and not context_of(e).closed:
            return e
        _engines.pop()
    return None


def cuda_available():
    """Whether zinf was built with CUDA and sees a device (and torch does too)."""
    return _zinf.cuda_device_count() > 0 and torch.cuda.is_available()


def available_memory():
    """MemAvailable of /proc/meminfo (bytes), or physical memory where that is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _zinf.physical_memory()


def _pinned_budget(cfg, model, trained, device_is_host):
    # `trained`: ids of the parameters to train (a GroupPlan's members), None: every one
    # that requires grad.
    """The engine's JSON with zinf.pinned_budget_bytes sized to the model when the config does
    not set it and the default cannot hold what the model needs; refused when the machine
    does not have that much memory available."""
    if cfg.tree is None or cfg.get("zinf", "pinned_budget_bytes") is not None:
        return cfg.text
    specs = [(name, list(p.shape), p.requires_grad and (trained is None or id(p) in trained))
             for name, p in model.named_parameters()]
    try:
        need = _zinf.pinned_bytes_needed(cfg.text, specs, device_is_host)
    except ZinfError:
        return cfg.text  # a bad parameter: registration reports it with its name
    if need <= DEFAULT_PINNED:
        return cfg.text
    budget = -(-need // (64 << 20)) * (64 << 20)  # rounded up to 64 MiB
    have = available_memory()
    if budget + _MEMORY_MARGIN > have:
        raise error("ResourceExhausted",
                    "this model needs %s of pinned host memory (gradient partitions, cpu-tier "
                    "parameters, optimizer swap buffers and staging) and the machine has %s "
                    "available: lower sub_group_size (each optimizer buffer holds one sub-group's "
                    "states), offload_optimizer.buffer_count, or move parameters off the cpu "
                    "tier; or set zinf.pinned_budget_bytes if you know better"
                    % (_zinf.format_bytes(need), _zinf.format_bytes(have)))
    _zinf.log_info("zinf.pinned_budget_bytes not set: pinned host budget %s, what this model "
                   "needs (the default %s would not hold it; %s of memory available)"
                   % (_zinf.format_bytes(budget), _zinf.format_bytes(DEFAULT_PINNED),
                      _zinf.format_bytes(have)))
    return cfg.with_zinf_key("pinned_budget_bytes", budget)


def hyperparameters(cfg):
    """The optimizer's type and hyperparameters, as the config gives them (doubles, not the
    engine's float32 copies, so that schedules computed from them are exact)."""
    s = cfg.summary
    params = cfg.get("optimizer", "params", default={}) or {}
    out = {"type": s["optimizer.type"], "lr": float(params.get("lr", s["optimizer.params.lr"])),
           "betas": tuple(float(b) for b in params.get("betas", s["optimizer.params.betas"])),
           "eps": float(params.get("eps", s["optimizer.params.eps"])),
           "weight_decay": float(params.get("weight_decay",
                                            s["optimizer.params.weight_decay"]))}
    return out


def build(model, config, device=None, scale_wrt_gas=True, engine_class=ZinfEngine,
          client_optimizer=None, lr_scheduler=None, plan=None):
    """A new engine over `model` (see zinf.initialize)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError("zinf.initialize: the model must be a torch.nn.Module, got %s"
                        % type(model).__name__)
    cfg = config if isinstance(config, Config) else Config(config)
    cfg = resolve_batch(cfg, _distributed.from_env()[1])
    for w in cfg.summary["warnings"]:
        warnings.warn("zinf config: " + w, stacklevel=3)
    if device is None:
        device = "cuda" if cuda_available() else "cpu"
    dev = torch.device(device)
    text = _pinned_budget(cfg, model, plan.member if plan is not None else None,
                          dev.type == "cpu")
    group = _distributed.group(cfg.summary)
    if group is not None and dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", group["local_rank"])  # one GPU per process of a machine
    stream = None
    if dev.type == "cpu":
        core = _zinf.Engine(text, "cpu", group=group)
        torch_device = "cpu"
    elif dev.type == "cuda":
        if _zinf.cuda_device_count() == 0:
            raise ZinfError("device %s: zinf was built without CUDA or sees no GPU" % device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        budget = cfg.summary["device_budget_bytes"]
        if budget == 0:
            # Beside torch's caching allocator: a quarter of the GPU unless the config says.
            budget = torch.cuda.get_device_properties(index).total_memory // 4
            warnings.warn("zinf: zinf.device_budget_bytes not set; the engine reserves %.1f GiB "
                          "on cuda:%d (a quarter of the GPU) beside torch's allocator"
                          % (budget / 2**30, index), stacklevel=3)
        with torch.cuda.device(index):
            stream = torch.cuda.current_stream(index).cuda_stream
        core = _zinf.Engine(text, "cuda", index, True, stream, budget, group=group)
        torch_device = "cuda:%d" % index
    else:
        raise ZinfError("device %s: cpu or cuda" % device)
    block = cfg.blocks.get("scheduler")
    if block is not None:
        # The config's schedule wins over one passed in (as in DeepSpeed).
        lr_scheduler = lambda optimizer: _schedulers.from_config(block, optimizer)  # noqa: E731
    activations = _activations.Settings.from_config(cfg.blocks.get("activation_checkpointing"),
                                                    cfg.summary["nvme_paths"])
    engine = engine_class(model, core, torch_device, scale_wrt_gas=scale_wrt_gas,
                          hyper=hyperparameters(cfg), client_optimizer=client_optimizer,
                          lr_scheduler=lr_scheduler, plan=plan, stream=stream)
    engine.local_rank = group["local_rank"] if group is not None else 0
    engine.config = cfg
    if activations is not None:
        _activations.configure(activations, engine)
    _engines.append(weakref.ref(engine))
    return engine
