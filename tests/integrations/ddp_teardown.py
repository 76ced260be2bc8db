"""The end of a DDP reference run in the integration scripts (accelerate_run.py, hf_run.py, hf_gen_run.py,
lightning_run.py, trl_run.py): torch's own process-group teardown. A rank leaving while its peer's gloo threads
still talk to it can abort it at exit ("terminate called without an active exception"; seen in CI after the run
had written its results). zerocore's engines and strategies tear their groups down themselves
(zerocore/comm/lifetime.py), so the scripts call this for the reference run only."""
from __future__ import annotations

import torch


def end_reference_group() -> None:
    """Every rank meets, then the default process group is destroyed (nothing when there is none)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
