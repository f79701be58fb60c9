"""deepspeed.checkpoint.utils (zinf)."""
import torch


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """`item` (tensors inside lists, tuples and dicts) with every tensor cloned to `device`, so
    that torch.save writes each tensor's own values, not the storage it views."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
