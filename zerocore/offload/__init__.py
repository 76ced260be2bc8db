"""CPU offload: the owned optimizer shard (fp32 master, m, v) and, at stage 3, the 16-bit
parameter shards rest in host memory; the host step runs the SIMD Adam kernel on a worker
thread, in the order the next forward needs the parameters (stage 3).

host_memory.py  host buffers: page-locked only when a CUDA device copies to/from them
host_stepped.py HostSteppedShard: what every host-stepped shard shares (landing, norm, hand-off)
host_shard.py   HostOptimizerShard: one group's owned state on the host (ratio < 1: part on the device)
stepper.py      the worker thread and the per-group Ready flag gathers wait on
placement.py    OffloadPlan: the engine's placement decision and the reducer/step hooks
"""
from .host_shard import HostOptimizerShard
from .placement import OffloadPlan
from .stepper import HostStepper, Ready

__all__ = ["HostOptimizerShard", "OffloadPlan", "HostStepper", "Ready"]
