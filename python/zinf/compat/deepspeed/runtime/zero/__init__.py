"""deepspeed.runtime.zero (zinf)."""
from .partition_parameters import GatheredParameters, Init, ZeroParamStatus  # noqa: F401
