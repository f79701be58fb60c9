"""deepspeed.compression (zinf): the module-path helpers DeepSpeed-Chat's LoRA code uses."""
from . import helper  # noqa: F401
