"""zinf for PyTorch: train models larger than GPU (and host) memory with zinf's engine.

    import zinf
    engine = zinf.initialize(model, "ds_config.json")   # or a dict
    for batch in data:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

or, for a trainer written for DeepSpeed, `import zinf as deepspeed`:

    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters())

The parameters, gradients and optimizer states live in zinf's tiers (device, pinned host
memory, NVMe) as the config says; the optimizer is zinf's (Adam, AdamW, Adagrad or Lion from
the config's "optimizer"), not torch's. See docs/pytorch.md.
"""
import torch

from . import _initialize, _zinf, checkpointing
from ._activations import checkpoint
from ._config import config_text
from ._ds import initialize as _ds_initialize
from ._ds.engine import DeepSpeedEngine
from ._ds.initialize import add_config_arguments, init_distributed
from ._ds.schedulers import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from ._engine import ZinfEngine, ZinfError
from ._init import Init
from ._safetensors import load_safetensors, save_safetensors
from ._subclasses import Snapshot, ZinfParameter

__version__ = "0.1.0"

__all__ = ["initialize", "Init", "ZinfEngine", "DeepSpeedEngine", "ZinfError", "ZinfParameter",
           "Snapshot", "load_safetensors", "save_safetensors", "cuda_available", "checkpoint",
           "checkpointing", "add_config_arguments", "init_distributed", "WarmupLR",
           "WarmupDecayLR", "WarmupCosineLR", "OneCycle"]

cuda_available = _initialize.cuda_available


def initialize(args=None, model=None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port=None, mpu=None,
               dist_init_required=None, collate_fn=None, config=None, config_params=None,
               device=None, scale_wrt_gas=True):
    """Hands a model's parameters to a new zinf engine. Two forms:

    zinf's:      engine = zinf.initialize(model, config=None, device=None, scale_wrt_gas=True)
    DeepSpeed's: engine, optimizer, training_dataloader, lr_scheduler = zinf.initialize(
                     args=None, model=..., optimizer=None, model_parameters=None,
                     training_data=None, lr_scheduler=None, config=... or config_params=...)
                 (the model as a keyword, or args first; the config may also come from
                 args.deepspeed_config). Returns a DeepSpeedEngine.

    config: a dict, the path of a DeepSpeed-style JSON file, or None (defaults: parameters and
      optimizer states in memory, AdamW). The same keys as zinf-train's --config, plus the
      Python layer's "scheduler" (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle) and
      "activation_checkpointing" (zinf.checkpoint) blocks.
    device: "cpu" (zinf's host device: the model computes on the CPU), "cuda" / "cuda:N"
      (the engine on that GPU, ordered against torch's current stream), or None (cuda when
      zinf and torch both see a GPU, else cpu).
    scale_wrt_gas: engine.backward(loss) divides the loss by gradient_accumulation_steps.
    optimizer (DeepSpeed form): a torch Adam/AdamW/Adagrad (or a factory of the parameters)
      whose type and hyperparameters zinf's optimizer takes; its param_groups stay the ones a
      scheduler moves. model_parameters: the parameters to train (others are stored, never
      stepped). lr_scheduler: a torch scheduler (or a factory of the optimizer), stepped after
      every optimizer step; a config "scheduler" block wins over it, as in DeepSpeed.

    Every parameter becomes a ZinfParameter whose values live in the engine (reads fetch
    them, writes go through the engine: see _access.py); requires_grad=False parameters are
    stored but never stepped. Model buffers stay in torch, moved to the engine's device.
    """
    if isinstance(args, torch.nn.Module):
        if model is not None and config is None and not isinstance(model, torch.nn.Module):
            config = model  # initialize(model, config)
        if isinstance(optimizer, (str, torch.device)) and device is None:
            device = optimizer  # initialize(model, config, device)
            optimizer = None
        if optimizer is not None or model_parameters is not None or training_data is not None \
                or lr_scheduler is not None:
            raise TypeError("zinf.initialize(model, config): the optimizer, model_parameters, "
                            "training_data and lr_scheduler arguments belong to the DeepSpeed "
                            "form initialize(model=..., ...)")
        return _initialize.build(args, config if config is not None else config_params, device,
                                 scale_wrt_gas)
    if model is None:
        raise TypeError("zinf.initialize: pass the model: initialize(model, config) or "
                        "initialize(args=..., model=..., config=...)")
    return _ds_initialize.initialize(
        args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
        training_data=training_data, lr_scheduler=lr_scheduler,
        distributed_port=distributed_port, mpu=mpu, dist_init_required=dist_init_required,
        collate_fn=collate_fn, config=config, config_params=config_params, device=device,
        scale_wrt_gas=scale_wrt_gas)
