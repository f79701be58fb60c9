"""deepspeed.accelerator: the device zinf's engines compute on (the host device, "cpu", or a
CUDA GPU), with DeepSpeed's accessor names. memory_allocated and max_memory_allocated are the
device budget's bytes of the newest live engine (zinf's own accounting: on the host device too),
or torch's where there is no engine and a GPU."""
import torch

import zinf

def _engine():
    """The context (zinf._context.EngineContext) of the newest live engine zinf.initialize
    made, or None."""
    from zinf import _engine, _initialize
    e = _initialize.newest_engine()
    return None if e is None else _engine.context_of(e)


class ZinfAccelerator:
    """DeepSpeed's accelerator interface over zinf's device choice."""

    def __init__(self):
        self._name = "cuda" if zinf.cuda_available() else "cpu"

    # -- the device
    def device_name(self, device_index=None):
        if device_index is None or self._name == "cpu":
            return self._name
        return "%s:%d" % (self._name, device_index)

    def device(self, device_index=None):
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index):
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def current_device(self):
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def current_device_name(self):
        return self.device_name(self.current_device()) if self._name == "cuda" else "cpu"

    def device_count(self):
        return torch.cuda.device_count() if self._name == "cuda" else 1

    def is_available(self):
        return True

    def synchronize(self, device_index=None):
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self):
        return "nccl" if self._name == "cuda" else "gloo"

    def is_bf16_supported(self):
        return True

    def is_fp16_supported(self):
        return True  # fp16 with dynamic loss scaling (the config's fp16 block)

    def supported_dtypes(self):
        return [torch.float32, torch.bfloat16, torch.float16]

    # -- memory
    def memory_allocated(self, device_index=None):
        e = _engine()
        if e is not None:
            return e.core.device_memory["used"]
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else 0

    def max_memory_allocated(self, device_index=None):
        e = _engine()
        if e is not None:
            return e.core.device_memory["peak"]
        return torch.cuda.max_memory_allocated(device_index) if self._name == "cuda" else 0

    def total_memory(self, device_index=None):
        e = _engine()
        if e is not None:
            return e.core.device_memory["budget"]
        if self._name == "cuda":
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return zinf._zinf.physical_memory()

    def available_memory(self, device_index=None):
        return self.total_memory(device_index) - self.memory_allocated(device_index)

    def empty_cache(self):
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def reset_peak_memory_stats(self, device_index=None):
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)

    # -- tensors and randomness
    def pin_memory(self, tensor, align_bytes=1):
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def is_pinned(self, tensor):
        return tensor.is_pinned() if self._name == "cuda" else False

    def on_accelerator(self, tensor):
        return tensor.device.type == self._name

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def random(self):
        return torch.random

    def initial_seed(self):
        return torch.initial_seed()


_accelerator = None


def get_accelerator():
    global _accelerator
    if _accelerator is None:
        _accelerator = ZinfAccelerator()
    return _accelerator


def set_accelerator(accel):
    raise zinf.ZinfError("deepspeed.accelerator.set_accelerator: zinf chooses its device "
                         "(initialize's device=, or a GPU when torch and zinf see one)")
