"""How many OpenMP threads the host optimizer step of CPU/NVMe offload takes.

With the model on a GPU the training thread only launches kernels, so the host step may take
this rank's share of the cores, less one for the training thread. The share is not
``torch.get_num_threads()``: torchrun sets ``OMP_NUM_THREADS=1`` in every rank when it starts
more than one (and many launch scripts and benchmarks call ``torch.set_num_threads(1)``), which
would leave the host Adam on one core: on a 16-core host that is several times slower than the
memory allows, and the whole offloaded step waits for it. So the share is read from the cores
this process may run on (its CPU affinity): all of them when the launcher bound this rank to its
own cores (the affinity is then smaller than the machine), else the machine's cores divided by
the ranks on this machine (``LOCAL_WORLD_SIZE``, set by torchrun, Accelerate and DeepSpeed's
launcher).

With the model on the CPU both threads compete for the same cores: the host step takes the
training thread's count, as the rest of the step does.

``ZEROCORE_HOST_STEP_THREADS=n`` sets the count outright (on any device); it also makes stages
1/2 run their host step on the worker thread on a CPU device (as on a GPU), which is how the
tests exercise that path without a GPU.
"""
from __future__ import annotations

import os

import torch

ENV = "ZEROCORE_HOST_STEP_THREADS"


def threads_from_env() -> int | None:
    """The count ``ZEROCORE_HOST_STEP_THREADS`` asks for, None when unset."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"zerocore: {ENV}={raw!r} is not a whole number of threads") from None
    if n < 1:
        raise ValueError(f"zerocore: {ENV}={raw!r}: the host step needs at least 1 thread")
    return n


def cores_of_this_rank() -> int:
    """The cores this rank may use: its CPU affinity when a launcher bound it to fewer cores than the
    machine has, else the machine's cores over the ranks on this machine."""
    machine = os.cpu_count() or 1
    try:
        mine = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        mine = machine
    if mine < machine:  # bound by the launcher (numactl, --bind_cores_to_rank, a cgroup's cpuset)
        return max(1, mine)
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return max(1, machine // max(1, local))


def host_step_threads(device: torch.device) -> int:
    """OpenMP threads of the host step (see the module's docstring)."""
    n = threads_from_env()
    if n is not None:
        return n
    if device.type == "cpu":
        return max(1, torch.get_num_threads())
    return max(1, cores_of_this_rank() - 1)


def worker_at_stages_1_2(device: torch.device) -> bool:
    """Whether stages 1/2 hand their host step to the worker thread (and wait for it): on a GPU, so
    the step gets its own thread count whatever the training thread's is; on the CPU only when
    ``ZEROCORE_HOST_STEP_THREADS`` is set."""
    return device.type != "cpu" or threads_from_env() is not None
