"""deepspeed.ops (zinf): the optimizers a script hands to initialize."""
from . import adam  # noqa: F401
