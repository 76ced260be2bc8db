"""Runs train_script.py under ``torchrun --nproc_per_node 2`` (CPU, gloo) with the real DeepSpeed
and with zerocore.deepspeed, several cases per launch, and reads back each rank's record."""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import warnings

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "train_script.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one_rank(script: str, face: str, out: str) -> dict:
    """What ``script`` saved to ``out`` (torch.save) run as one gloo rank of ``face`` (deepspeed|zerocore): the
    scripts that build a model under both libraries and compare values (init_values_script.py,
    master_init_script.py; their command line: face_script.py)."""
    env = {**os.environ, "ZC_FACE": face, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    proc = subprocess.run([sys.executable, script, "--out", out], env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"{face}: {os.path.basename(script)} failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    import torch

    return torch.load(out)


def launch(face: str, out: str, cases: list[dict], timeout: int = 1500, script: str = SCRIPT) -> dict[str, list[dict]]:
    """{case name: [rank 0 record, rank 1 record]} of one torchrun of ``face`` (deepspeed|zerocore)
    running ``script`` (train_script.py unless given)."""
    env = {**os.environ, "ZC_FACE": face, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_port",
           str(_free_port()), script, "--out", out, "--cases", json.dumps(cases)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 and face == "deepspeed":
        # DeepSpeed's own run is the reference, not what is under test: it once hung in CI in its
        # stage-3 trace check (a rank never joined the collective; the same cases passed on rerun).
        # It gets one more try, said aloud; zerocore's run never does.
        warnings.warn(f"the DeepSpeed reference run failed (rc {proc.returncode}), retried once:\n"
                      f"{proc.stderr[-1500:]}")
        cmd[cmd.index("--master_port") + 1] = str(_free_port())
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{face} run failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return {c["name"]: [json.load(open(os.path.join(out, c["name"], f"rank{r}.json"))) for r in range(WORLD)]
            for c in cases}


def skipped_boundaries(record: dict, key: str = "skipped") -> set[int]:
    """The boundaries (indices into the record's per-boundary lists) whose update was skipped: those
    at which engine.skipped_steps went up. Empty when the record has no ``skipped`` list."""
    counts = record.get(key) or []
    return {i for i, n in enumerate(counts) if n > (counts[i - 1] if i else 0)}


def assert_same_training(ours: list[dict], theirs: list[dict], rtol: float = 2e-5) -> None:
    """Per rank: every boundary's lr equal, every micro-batch's loss and every gradient norm equal
    to fp32 reduction-order tolerance, the same sample counts, and the resumed run continuing as the
    uninterrupted one did. Where the records hold ``skipped`` (engine.skipped_steps per boundary, the
    runs with --inf_at), those lists are equal too, and the norms are compared on the other boundaries."""
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert len(a["loss"]) == len(b["loss"]) > 0 and len(a["lr"]) == len(b["lr"]) > 0
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12, abs=0), f"rank {rank}: lr"
        assert a["samples"] == b["samples"], f"rank {rank}: global_samples"
        assert a["loss"] == pytest.approx(b["loss"], rel=rtol, abs=rtol), f"rank {rank}: losses"
        assert ("skipped" in a) == ("skipped" in b), f"rank {rank}: one record lacks skipped"
        assert a.get("skipped") == b.get("skipped"), f"rank {rank}: skipped_steps per boundary"
        # A skipped boundary's norm is not a number to compare: DeepSpeed reports inf there (stage 1/2
        # and 3 set _global_grad_norm = float("inf") on overflow), zerocore the norm of gradients that
        # hold Inf/NaN, which it reports as inf too (grad_norm.device_norm). Both must be non-finite;
        # the finite norms of the other boundaries are compared.
        skipped = skipped_boundaries(b)
        for i in sorted(skipped):
            assert not math.isfinite(a["norm"][i]) and not math.isfinite(b["norm"][i]), \
                f"rank {rank}: boundary {i} skipped, norms {a['norm'][i]} (ours) {b['norm'][i]} (DeepSpeed)"
        keep = [i for i in range(len(b["norm"])) if i not in skipped]
        assert [a["norm"][i] for i in keep] == pytest.approx([b["norm"][i] for i in keep], rel=rtol * 5, abs=rtol), \
            f"rank {rank}: gradient norms"
        if b["resumed_loss"]:
            assert a["resumed_loss"] == pytest.approx(b["resumed_loss"], rel=rtol, abs=rtol)
            assert a["resumed_lr"] == pytest.approx(b["resumed_lr"], rel=1e-12, abs=0)
            assert a.get("resumed_skipped") == b.get("resumed_skipped"), f"rank {rank}: resumed skipped_steps"
            # and the resumed run is the uninterrupted run's tail
            tail = a["loss"][-len(a["resumed_loss"]):]
            assert a["resumed_loss"] == pytest.approx(tail, rel=1e-6, abs=1e-6), f"rank {rank}: resume"
