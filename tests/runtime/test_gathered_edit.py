"""``zerocore.gathered(..., modifier_rank=r)`` on 2 gloo ranks: an in-place edit of a parameter
that requires grad works as written (gradient mode is off inside), and an exception inside the
block on one rank is raised on every rank (that rank's own, a RuntimeError naming it on the
others) with nothing written back, instead of leaving the others in the write-back's broadcast."""
from __future__ import annotations

import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocore
from forked_ranks import start_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))


def _scenario(stage: int, rank: int) -> dict:
    model = _model()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100}}
    engine = zerocore.initialize(model, cfg)
    w = model[2].weight
    before = engine.full_state_dict()
    out = {}
    with zerocore.gathered([w]):
        out["grad_mode_reading"] = torch.is_grad_enabled()
    try:
        with zerocore.gathered([w], modifier_rank=0):
            out["grad_mode_editing"] = torch.is_grad_enabled()
            if rank == 1:
                raise ValueError("a mistake on rank 1")
        out["raised"] = None
    except Exception as e:  # noqa: BLE001 - the test looks at which error each rank got
        out["raised"] = f"{type(e).__name__}: {e}"
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in engine.full_state_dict().items())
    with zerocore.gathered([w], modifier_rank=0):  # the README's edit, as written: the group still works
        w.zero_()
    after = engine.full_state_dict()
    out["edited"] = float(after["2.weight"].abs().sum()) == 0.0
    out["others_kept"] = all(torch.equal(after[k], before[k]) for k in before if k != "2.weight")
    engine.destroy()
    return out


def _entry(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
    try:
        res = {}
        for stage in (2, 3):
            try:
                res[stage] = _scenario(stage, rank)
            except Exception:  # noqa: BLE001
                res[stage] = {"error": traceback.format_exc()}
                break
        torch.save(res, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("gathered_edit"))
    ctx = start_ranks(_entry, (2, tmp), 2)
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError("2 ranks did not finish the gathered scenarios in 180 s (a rank left waiting?)")
    return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]


@pytest.mark.parametrize("stage", [2, 3])
def test_edit_in_place_and_an_exception_on_one_rank(results, stage):
    r0, r1 = (results[r][stage] for r in range(2))
    assert "error" not in r0 and "error" not in r1, r0.get("error") or r1.get("error")
    for r in (r0, r1):
        assert r["grad_mode_reading"] is True and r["grad_mode_editing"] is False
        assert r["unchanged"] and r["edited"] and r["others_kept"]
    assert r1["raised"] == "ValueError: a mistake on rank 1"
    assert r0["raised"].startswith("RuntimeError: zerocore.gathered: rank 1 raised an exception inside the block")
