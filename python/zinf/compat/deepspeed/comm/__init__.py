"""deepspeed.comm: the ranks of a zinf job (torchrun's variables), and the script's own
collectives over torch.distributed's default group (init_distributed creates it, one rank
included)."""

import torch
import torch.distributed as _dist

from zinf import init_distributed  # noqa: F401
from zinf._distributed import from_env as _from_env

ReduceOp = _dist.ReduceOp


def is_initialized():
    return _dist.is_initialized()


def is_available():
    return _dist.is_available()


def get_rank(group=None):
    return _dist.get_rank(group) if _dist.is_initialized() else _from_env()[0]


def get_world_size(group=None):
    return _dist.get_world_size(group) if _dist.is_initialized() else _from_env()[1]


def get_local_rank():
    return _from_env()[2]


def get_world_group():
    return _dist.group.WORLD


def _need(name):
    if not _dist.is_initialized():
        if _from_env()[1] == 1:
            return False  # one rank: nothing to exchange
        raise RuntimeError("deepspeed.comm.%s with %d ranks: call deepspeed.init_distributed() "
                           "first" % (name, _from_env()[1]))
    return True


def barrier(group=None, async_op=False, device_ids=None):
    if _need("barrier"):
        return _dist.barrier(group=group, async_op=async_op)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    if _need("all_reduce"):
        return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None):
    return all_reduce(tensor, op, group)


def broadcast(tensor, src, group=None, async_op=False):
    if _need("broadcast"):
        return _dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    if _need("all_gather"):
        return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor_list[0].copy_(tensor)


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False):
    if _need("all_gather_into_tensor"):
        parts = list(output_tensor.chunk(get_world_size(group)))
        return _dist.all_gather(parts, tensor, group=group, async_op=async_op)
    output_tensor.copy_(tensor.reshape(output_tensor.shape))


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    if _need("reduce"):
        return _dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def all_gather_object(object_list, obj, group=None):
    if _need("all_gather_object"):
        return _dist.all_gather_object(object_list, obj, group=group)
    object_list[0] = obj


def broadcast_object_list(object_list, src=0, group=None, device=None):
    if _need("broadcast_object_list"):
        return _dist.broadcast_object_list(object_list, src, group=group)


def new_group(ranks=None):
    return _dist.new_group(ranks)


def get_global_rank(group=None, group_rank=0):
    return _dist.get_global_rank(group, group_rank) if group is not None else group_rank


def destroy_process_group(group=None):
    if _dist.is_initialized():
        _dist.destroy_process_group(group)


def log_summary(*args, **kwargs):
    pass  # DeepSpeed prints its communication log here; zinf keeps none (nothing to print)


def configure(*args, **kwargs):
    if kwargs.get("enabled") or (args and args[0] is not None):
        raise RuntimeError("deepspeed.comm.configure: zinf keeps no communication log")


__all__ = ["ReduceOp", "init_distributed", "is_initialized", "get_rank", "get_world_size",
           "get_local_rank", "barrier", "all_reduce", "broadcast", "all_gather",
           "all_gather_into_tensor", "reduce", "all_gather_object", "broadcast_object_list",
           "new_group", "destroy_process_group"]
