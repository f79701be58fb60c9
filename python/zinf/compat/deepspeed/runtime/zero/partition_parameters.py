"""deepspeed.runtime.zero.partition_parameters over zinf: Init, GatheredParameters,
ZeroParamStatus and register_external_parameter."""
import torch

import zinf
from zinf._ds import gathered as _gathered
from zinf._subclasses import ZeroParamStatus  # noqa: F401


class Init(zinf.Init):
    """deepspeed.zero.Init(module=None, data_parallel_group=None, mem_efficient_linear=True,
    remote_device=None, pin_memory=False, config_dict_or_path=None, config=None, enabled=True,
    dtype=None, mpu=None, ...): zinf.Init with DeepSpeed's arguments. The parameters of modules
    built inside go to a spill file in the config's first nvme_path (or $TMPDIR); their dtype
    is kept (zinf's engine stores them as the config's bf16 or fp16 says)."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, zero_param_parallel_group=None,
                 zero_quantized_weights=False, zero_quantized_nontrainable_weights=False,
                 sequence_data_parallel_group=None, param_swapper=None):
        if module is not None:
            raise zinf.ZinfError("deepspeed.zero.Init(module=...): zinf spills the parameters "
                                 "of modules built inside the context only; build the module "
                                 "inside `with deepspeed.zero.Init(...):`")
        if mpu is not None:
            raise zinf.ZinfError("deepspeed.zero.Init(mpu=...): zinf has no model parallelism")
        if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise zinf.ZinfError("deepspeed.zero.Init(dtype=%s): zinf stores parameters as "
                                 "fp32, bf16 or fp16 (the config's bf16.enabled or "
                                 "fp16.enabled)" % dtype)
        given = config_dict_or_path if config_dict_or_path is not None else config
        for key, on in (("zero_quantized_weights", zero_quantized_weights),
                        ("zero_quantized_nontrainable_weights",
                         zero_quantized_nontrainable_weights)):
            if on and not _zero_key(given, key):
                # (The gathers are the engine's: deepspeed.initialize's config decides them.)
                raise zinf.ZinfError(
                    "deepspeed.zero.Init(%s=True): zinf's engine takes it from the config; set "
                    "\"zero_optimization\": {\"%s\": true} in the config given to "
                    "deepspeed.initialize and here (config_dict_or_path=)" % (key, key))
        super().__init__(config=config_dict_or_path if config_dict_or_path is not None
                         else config, enabled=enabled)


def _zero_key(config, key):
    """Whether `config` (what zinf.initialize takes, or None) sets zero_optimization.<key>."""
    if config is None:
        return False
    from zinf._config import Config  # (read and parsed as the engine will: errors named)
    return Config(config).summary["zero_optimization." + key] is True


GatheredParameters = _gathered.GatheredParameters


def register_external_parameter(module, parameter):
    raise zinf.ZinfError("deepspeed.zero.register_external_parameter: zinf fetches the "
                         "parameters a module owns; use the parameter inside the module that "
                         "registers it (a tied weight is one parameter under two names)")
