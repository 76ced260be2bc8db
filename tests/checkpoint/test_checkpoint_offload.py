"""Checkpoints and offload together (issues 12-14): the checkpoint reads and writes optimizer
state only through ``state_tiles``, so a checkpoint saved with the optimizer state on the
device, in host memory (CPU offload) or in NVMe swap files loads into any of the three, and
training goes on bit for bit as the uninterrupted run of the same placement.

World 1, in this process (no spawn): the placement, not the world size, is under test here;
tests/test_checkpoint.py covers resharding across world sizes and stages.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import zerocore
from checkpoint_helpers import CkCase, train
from dist_helpers import make_model

STEPS_BEFORE, STEPS_AFTER = 2, 2


def _config(case: CkCase, stage: int, placement: str, swap) -> dict:
    cfg = case.config(stage, 1)
    z = cfg["zero_optimization"]
    if placement == "cpu":
        z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif placement == "nvme":
        swap.mkdir(parents=True, exist_ok=True)
        z["offload_optimizer"] = {"device": "nvme", "nvme_path": str(swap), "buffer_count": 3,
                                  "pipeline_read": True, "pipeline_write": True}
        z["sub_group_size"] = 4096  # several tiles per group: the checkpoint streams them one by one
    return cfg


def _weights(engine) -> dict:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def _run(case, stage, placement, swap, steps_from, steps_to, load=None, save=None):
    engine = zerocore.initialize(make_model(case.model, 0), _config(case, stage, placement, swap))
    try:
        if load is not None:
            path, _ = engine.load_checkpoint(load)
            assert path is not None
        rec = train(engine, case, 0, 1, steps_from, steps_to)
        if save is not None:
            engine.save_checkpoint(save, client_state={"placement": placement})
        return rec, _weights(engine)
    finally:
        engine.destroy()


PAIRS = [("device", "cpu"), ("cpu", "nvme"), ("nvme", "device")]


@pytest.mark.parametrize("saved_with,loaded_with", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_checkpoint_moves_between_placements_bit_for_bit(tmp_path, saved_with, loaded_with):
    case = dataclasses.replace(CkCase("bf16", dtype="bf16", lr=3e-3), stage=2)
    ck = tmp_path / "ckpt"
    _, _ = _run(case, 2, saved_with, tmp_path / "swap_a", 0, STEPS_BEFORE, save=ck)
    got, got_w = _run(case, 2, loaded_with, tmp_path / "swap_b", STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER, load=ck)
    # the uninterrupted run in the loading placement (offload is the same kernel on the same bits)
    want, want_w = _run(case, 2, loaded_with, tmp_path / "swap_c", 0, STEPS_BEFORE + STEPS_AFTER)
    assert got["losses"] == want["losses"][-len(got["losses"]):]
    assert got["norms"] == want["norms"][-len(got["norms"]):]
    for name, t in want_w.items():
        assert torch.equal(got_w[name], t), f"{name} differs after {saved_with} -> {loaded_with}"


def test_nvme_checkpoint_streams_tiles_and_leaves_the_swap_alone(tmp_path):
    """Saving from NVMe swap files reads them tile by tile through the verified path; the swap
    folder is neither copied into the checkpoint nor changed by the save."""
    case = dataclasses.replace(CkCase("fp32"), stage=3)
    swap = tmp_path / "swap"
    engine = zerocore.initialize(make_model(case.model, 0), _config(case, 3, "nvme", swap))
    try:
        train(engine, case, 0, 1, 0, 2)
        # the first save waits for the host step still running on the worker (stage 3), which
        # writes its tiles back; from then on nothing writes the swap but training
        engine.save_checkpoint(tmp_path / "first")
        before = {p: p.read_bytes() for p in swap.rglob("*") if p.is_file()}
        engine.save_checkpoint(tmp_path / "ckpt")
        after = {p: p.read_bytes() for p in swap.rglob("*") if p.is_file()}
        assert before == after
        saved = [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]
        assert not any(p.name in {q.name for q in before} for p in saved)
    finally:
        engine.destroy()
