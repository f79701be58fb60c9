"""DeepSpeed's activation-checkpointing module, for `import zinf as deepspeed` trainers:
deepspeed.checkpointing.checkpoint(function, *args) and configure(...). See zinf.checkpoint
(_activations.py) for what happens to the activations."""
from . import _config
from ._activations import Settings, checkpoint, current_store
from ._activations import configure as _configure

__all__ = ["checkpoint", "configure", "is_configured"]


def configure(mpu_=None, deepspeed_config=None, partition_activations=None,
              contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None,
              synchronize=None, profile=None, nvme_checkpointing=None, nvme_path=None):
    """DeepSpeed's signature: the config's "activation_checkpointing" block (a dict or a JSON
    file's path as deepspeed_config), with the keyword arguments overriding it. A model-
    parallel `mpu_` is refused (one rank per process)."""
    if mpu_ is not None:
        raise _config._zinf.ZinfError("zinf.checkpointing.configure: model parallelism (mpu_) "
                                      "is not provided by zinf")
    block, paths = {}, []
    if deepspeed_config is not None:
        cfg = _config.Config(deepspeed_config)
        block = dict(cfg.blocks.get("activation_checkpointing") or {})
        paths = cfg.summary["nvme_paths"]
    overrides = {"partition_activations": partition_activations,
                 "contiguous_memory_optimization": contiguous_checkpointing,
                 "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
                 "synchronize_checkpoint_boundary": synchronize, "profile": profile,
                 "nvme_checkpointing": nvme_checkpointing, "nvme_path": nvme_path}
    block.update({k: v for k, v in overrides.items() if v is not None})
    return _configure(Settings.from_config(block, paths))


def is_configured():
    return current_store() is not None
