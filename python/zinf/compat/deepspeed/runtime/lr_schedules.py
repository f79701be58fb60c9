"""deepspeed.runtime.lr_schedules: DeepSpeed's schedules, zinf's implementation of them
(zinf._ds.schedulers: the same formulas, checked against a transcription of DeepSpeed's)."""
from zinf._ds.schedulers import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR  # noqa: F401

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
# LRRangeTest is DeepSpeed's too; zinf refuses it in a config (its "scheduler.type" names the
# four it runs), so it is not listed as valid here.
VALID_LR_SCHEDULES = [ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
