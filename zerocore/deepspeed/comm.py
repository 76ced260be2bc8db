"""``deepspeed.comm``: rank facts and the common collectives, over torch.distributed.

Without a process group (one process, no torchrun environment) the rank is 0, the world 1, and
the collectives leave their tensors as they are, as a world of one would.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp  # noqa: F401

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500


def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, verbose: bool = True,
                     timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1, world_size: int = -1):
    """Initializes the default process group once: from ``rank``/``world_size`` with
    ``init_method`` when given, else from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT). Backend: ``dist_backend``, else nccl with CUDA, gloo without. With neither
    (one plain process) nothing is initialized and training runs as a world of one. MPI
    discovery is not done: launch with torchrun."""
    if is_initialized() or dist_init_required is False:
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if rank >= 0 and world_size > 0:
        if init_method is None:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(distributed_port))
            init_method = "env://"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, **kwargs)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, init_method=init_method, **kwargs)


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", get_rank()))


def get_world_group():
    return dist.group.WORLD


def get_backend(group=None) -> str | None:
    return dist.get_backend(group) if is_initialized() else None


def barrier(group=None, async_op: bool = False, device_ids=None):
    if is_initialized():
        return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)
    return None


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    if is_initialized():
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return None


def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None):
    return all_reduce(tensor, op=op, group=group)


def reduce(tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    if is_initialized():
        return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)
    return None


def broadcast(tensor, src: int, group=None, async_op: bool = False):
    if is_initialized():
        return dist.broadcast(tensor, src, group=group, async_op=async_op)
    return None


def broadcast_object_list(object_list, src: int = 0, group=None, device=None):
    if is_initialized():
        return dist.broadcast_object_list(object_list, src=src, group=group, device=device)
    return None


def all_gather(tensor_list, tensor, group=None, async_op: bool = False):
    if is_initialized():
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor_list[0].copy_(tensor)
    return None


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op: bool = False):
    if is_initialized():
        return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)
    output_tensor.copy_(tensor.reshape(output_tensor.shape))
    return None


def allgather_fn(output_tensor, input_tensor, group=None, async_op: bool = False, debug=None):
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def all_gather_object(object_list, obj, group=None):
    if is_initialized():
        return dist.all_gather_object(object_list, obj, group=group)
    object_list[0] = obj
    return None


def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    if is_initialized():
        return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)
    output_tensor.copy_(tensor.reshape(output_tensor.shape))
    return None


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, debug=None):
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op: bool = False):
    if is_initialized():
        return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                      async_op=async_op)
    output.copy_(tensor)
    return None


def new_group(ranks=None, **kwargs):
    return dist.new_group(ranks, **kwargs)


def destroy_process_group(group=None):
    if is_initialized():
        dist.destroy_process_group(group)
