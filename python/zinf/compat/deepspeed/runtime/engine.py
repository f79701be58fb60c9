"""deepspeed.runtime.engine: DeepSpeedEngine is zinf's (zinf._deepspeed.DeepSpeedEngine)."""
from zinf._deepspeed import DeepSpeedEngine  # noqa: F401

DeepSpeedOptimizerCallable = object  # a type name the integrations annotate with
DeepSpeedSchedulerCallable = object
