"""zinf for PyTorch: train models larger than GPU (and host) memory with zinf's engine.

    import zinf
    engine = zinf.initialize(model, "ds_config.json")   # or a dict
    for batch in data:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

The parameters, gradients and optimizer states live in zinf's tiers (device, pinned host
memory, NVMe) as the config says; the optimizer is zinf's (Adam, AdamW, Adagrad or Lion from
the config's "optimizer"), not torch's. See the README's "Using zinf from PyTorch".
"""
import warnings

import torch

from . import _zinf
from ._config import config_text
from ._engine import ZinfEngine, ZinfError
from ._init import Init
from ._safetensors import load_safetensors, save_safetensors

__version__ = "0.1.0"

__all__ = ["initialize", "Init", "ZinfEngine", "ZinfError", "load_safetensors",
           "save_safetensors", "cuda_available"]


def cuda_available():
    """Whether zinf was built with CUDA and sees a device (and torch does too)."""
    return _zinf.cuda_device_count() > 0 and torch.cuda.is_available()


def initialize(model, config=None, device=None, scale_wrt_gas=True):
    """Hands `model`'s parameters to a new zinf engine and returns the engine.

    config: a dict, the path of a DeepSpeed-style JSON file, or None (defaults: parameters and
      optimizer states in memory, AdamW). The same keys as zinf-train's --config.
    device: "cpu" (zinf's host device: the model computes on the CPU), "cuda" / "cuda:N"
      (the engine on that GPU, ordered against torch's current stream), or None (cuda when
      zinf and torch both see a GPU, else cpu).
    scale_wrt_gas: engine.backward(loss) divides the loss by gradient_accumulation_steps.

    Every parameter becomes a placeholder until a module that owns it runs inside engine(...);
    requires_grad=False parameters are stored but never stepped. Model buffers stay in torch,
    moved to the engine's device.
    """
    text = config_text(config)
    summary = _zinf.parse_config(text)
    for w in summary["warnings"]:
        warnings.warn("zinf config: " + w, stacklevel=2)
    if device is None:
        device = "cuda" if cuda_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cpu":
        core = _zinf.Engine(text, "cpu")
        torch_device = "cpu"
    elif dev.type == "cuda":
        if _zinf.cuda_device_count() == 0:
            raise ZinfError("device %s: zinf was built without CUDA or sees no GPU" % device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        budget = summary["device_budget_bytes"]
        if budget == 0:
            # Beside torch's caching allocator: a quarter of the GPU unless the config says.
            budget = torch.cuda.get_device_properties(index).total_memory // 4
            warnings.warn("zinf: zinf.device_budget_bytes not set; the engine reserves %.1f GiB "
                          "on cuda:%d (a quarter of the GPU) beside torch's allocator"
                          % (budget / 2**30, index), stacklevel=2)
        with torch.cuda.device(index):
            stream = torch.cuda.current_stream(index).cuda_stream
        core = _zinf.Engine(text, "cuda", index, True, stream, budget)
        torch_device = "cuda:%d" % index
    else:
        raise ZinfError("device %s: cpu or cuda" % device)
    engine = ZinfEngine(model, core, torch_device, scale_wrt_gas=scale_wrt_gas)
    if dev.type == "cuda":
        engine._stream = stream
    return engine
