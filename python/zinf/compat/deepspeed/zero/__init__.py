"""deepspeed.zero: Init (zinf.Init: modules built inside hand their parameters to a spill file
at once, so a model larger than host memory can be built), GatheredParameters (every rank sees
the whole values; a write by modifier_rank reaches the fp32 masters on every rank) and the
ZeRO-3 parameter attributes (zinf's ZinfParameter answers ds_id, ds_status, ds_numel and
ds_shape; no ds_tensor: its numel() is the whole count already)."""
from deepspeed.runtime.zero.partition_parameters import (  # noqa: F401
    GatheredParameters, Init, ZeroParamStatus, register_external_parameter)
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum  # noqa: F401
