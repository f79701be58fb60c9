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
import torch

from . import _initialize, _zinf
from ._access import Snapshot, ZinfParameter
from ._config import config_text
from ._engine import ZinfEngine, ZinfError
from ._init import Init
from ._safetensors import load_safetensors, save_safetensors

__version__ = "0.1.0"

__all__ = ["initialize", "Init", "ZinfEngine", "ZinfError", "ZinfParameter", "Snapshot",
           "load_safetensors", "save_safetensors", "cuda_available"]

cuda_available = _initialize.cuda_available


def initialize(model, config=None, device=None, scale_wrt_gas=True):
    """Hands `model`'s parameters to a new zinf engine and returns the engine.

    config: a dict, the path of a DeepSpeed-style JSON file, or None (defaults: parameters and
      optimizer states in memory, AdamW). The same keys as zinf-train's --config.
    device: "cpu" (zinf's host device: the model computes on the CPU), "cuda" / "cuda:N"
      (the engine on that GPU, ordered against torch's current stream), or None (cuda when
      zinf and torch both see a GPU, else cpu).
    scale_wrt_gas: engine.backward(loss) divides the loss by gradient_accumulation_steps.

    Every parameter becomes a ZinfParameter whose values live in the engine (reads fetch
    them, writes go through the engine: see _access.py); requires_grad=False parameters are
    stored but never stepped. Model buffers stay in torch, moved to the engine's device.
    """
    return _initialize.build(model, config, device, scale_wrt_gas)
