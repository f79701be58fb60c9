"""deepspeed.moe.layer (zinf): MoE is refused (deepspeed.moe)."""
from . import MoE  # noqa: F401
