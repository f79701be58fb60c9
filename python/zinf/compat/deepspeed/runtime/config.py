"""deepspeed.runtime.config.DeepSpeedConfig: a config (dict or JSON path) with DeepSpeed's batch
arithmetic applied (train = micro x accumulation x ranks) and the values the integrations read."""
from zinf._config import Config
from zinf._ds.batch import resolve_batch
from zinf._distributed import from_env


class DeepSpeedConfig:
    def __init__(self, config, mpu=None, mesh_device=None):
        if mpu is not None:
            raise ValueError("DeepSpeedConfig(mpu=...): zinf has no model parallelism")
        cfg = resolve_batch(Config(config), from_env()[1])
        s = cfg.summary
        self._param_dict = dict(cfg.tree or {})
        self.train_batch_size = s["train_batch_size"] or None
        self.train_micro_batch_size_per_gpu = s["train_micro_batch_size_per_gpu"] or None
        self.gradient_accumulation_steps = s["gradient_accumulation_steps"]
        self.zero_optimization_stage = cfg.get("zero_optimization", "stage", default=3)
        self.zero_enabled = self.zero_optimization_stage > 0
        self.bfloat16_enabled = bool(s["bf16.enabled"])
        self.fp16_enabled = bool(s["fp16.enabled"])
        self.gradient_clipping = cfg.get("gradient_clipping", default=0.0)
        self.optimizer_name = cfg.get("optimizer", "type")
        self.optimizer_params = cfg.get("optimizer", "params")
        self.scheduler_name = cfg.get("scheduler", "type")
        self.scheduler_params = cfg.get("scheduler", "params")
