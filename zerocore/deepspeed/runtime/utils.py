"""``deepspeed.runtime.utils.see_memory_usage``: a memory report printed by rank 0."""
from __future__ import annotations

import gc

import torch
import torch.distributed as dist

_GiB = 1024 ** 3


def see_memory_usage(message: str, force: bool = False) -> None:
    """With ``force``, rank 0 prints ``message``, the accelerator's allocated and reserved memory
    (now and peak, in GiB; 0 on the CPU) and the host's used virtual memory, then resets the
    device's peak counters. Without ``force`` nothing (DeepSpeed's default)."""
    if not force or dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    gc.collect()  # what is only waiting for the collector is not in use
    print(message)
    if torch.cuda.is_available():
        print(f"MA {torch.cuda.memory_allocated() / _GiB:.2f} GB  Max_MA {torch.cuda.max_memory_allocated() / _GiB:.2f} "
              f"GB  CA {torch.cuda.memory_reserved() / _GiB:.2f} GB  Max_CA "
              f"{torch.cuda.max_memory_reserved() / _GiB:.2f} GB")
        torch.cuda.reset_peak_memory_stats()
    total, available = host_memory()
    used = total - available
    print(f"CPU Virtual Memory:  used = {used / _GiB:.2f} GB, percent = {round(100 * used / total, 1)}%")


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of the host's memory, as psutil.virtual_memory() says them. psutil is not
    one of zerocore's requirements (DeepSpeed brings it; a user of this face may have none): without it
    Linux's /proc/meminfo (MemTotal, MemAvailable), which psutil reads on Linux too."""
    try:
        import psutil
    except ImportError:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024  # kB
        return fields["MemTotal"], fields["MemAvailable"]
    vm = psutil.virtual_memory()
    return vm.total, vm.available
