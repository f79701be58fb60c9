"""deepspeed.runtime.zero.offload_config: the offload device names of a config's
offload_param / offload_optimizer "device" (zinf's tiers: none = device memory, cpu, nvme)."""
import enum


class OffloadDeviceEnum(str, enum.Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"
