"""deepspeed.runtime.engine: DeepSpeedEngine is zinf's (zinf._ds.engine.DeepSpeedEngine)."""
from zinf._ds.engine import DeepSpeedEngine  # noqa: F401

DeepSpeedOptimizerCallable = object  # a type name the integrations annotate with
DeepSpeedSchedulerCallable = object
