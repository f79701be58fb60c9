"""deepspeed.ops (zinf): the optimizers a script hands to initialize."""
from . import adagrad, adam, lion  # noqa: F401
