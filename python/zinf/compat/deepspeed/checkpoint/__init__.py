"""deepspeed.checkpoint (zinf)."""
from . import utils  # noqa: F401
