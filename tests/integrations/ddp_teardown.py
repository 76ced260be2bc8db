"""The end of a reference run (DDP, DeepSpeed) in the integration scripts (accelerate_run.py, hf_run.py,
hf_gen_run.py, lightning_run.py, trl_run.py), once its results are written.

Why the process leaves with ``os._exit``: gloo runs each collective on a worker thread of its process
group, and with torch 2.13 those threads outlive ``destroy_process_group`` while the group's C++ object
is still referenced (the Trainer's DDP wrapper holds it). A worker dropping its last finished collective
while the interpreter finalizes aborts the process ("terminate called without an active exception"):
seen in CI on the DDP reference of the short-window Trainer test, after a barrier and a destroy, rank 1
aborting while rank 0 read its saved weights. zerocore's own exit pauses for those threads
(zerocore/comm/lifetime.py); a reference run is not zerocore's to fix, so it skips finalization, the
only place the abort can happen, once every rank has met and its output is flushed."""
from __future__ import annotations

import os
import sys

import torch


def end_reference_run() -> None:
    """Every rank meets, the default process group is destroyed (when there is one), then the process
    exits with status 0 without finalizing the interpreter. Call it last, after the results are written."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
