"""save_checkpoint's tag on several ranks (checkpoint.tag_validation, DeepSpeed's WARN / IGNORE /
FAIL), a save in the middle of an accumulation window (allowed, as DeepSpeed's, with a warning),
and a save without a directory."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

import zerocore
from dist_helpers import spawn_cases


def _engine(mode="WARN", gas=1, stage=2):
    torch.manual_seed(0)
    return zerocore.initialize(nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)), {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "checkpoint": {"tag_validation": mode}})


def _step(engine, seed):
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def _per_rank_tags(case, rank, world):
    mode, root = case
    root = os.path.join(root, mode)
    engine = _engine(mode)
    _step(engine, rank)
    out = {"rank": rank}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            out["path"] = engine.save_checkpoint(root, tag=f"tag-{rank}")
        except AssertionError as e:  # DeepSpeed's type (zerocore's CheckpointError too)
            out["error"] = f"{type(e).__name__}: {e}"
    out["warned"] = [str(w.message) for w in seen if "rank 0's tag" in str(w.message)]
    out["listing"] = sorted(os.listdir(root)) if os.path.isdir(root) else []
    if "path" in out:  # the checkpoint loads whole on every rank
        other = _engine(mode)
        other.load_checkpoint(root)
        want, got = engine.full_state_dict(), other.full_state_dict()
        out["same"] = all(torch.equal(want[k], got[k]) for k in want)
    return {"result": out}


def test_different_tags_on_the_ranks(tmp_path):
    cases = [(mode, str(tmp_path)) for mode in ("WARN", "IGNORE", "FAIL")]
    results = spawn_cases(cases, 2, tmp_path, run=_per_rank_tags)
    by_mode = {}
    for rank in range(2):
        for (mode, _), r in zip(cases, results[rank]):
            assert "error" not in r or "result" in r, r.get("error")
            by_mode.setdefault(mode, []).append(r["result"])
    for mode in ("WARN", "IGNORE"):
        r0, r1 = by_mode[mode]
        # saved under rank 0's tag on both ranks, complete and loadable; only rank 1 (the one that differs) warned
        assert r0["path"].endswith("tag-0") and r1["path"].endswith("tag-0") and r0["same"] and r1["same"]
        assert r0["listing"] == ["latest", "tag-0", "zero_to_fp32.py"]
        assert r0["warned"] == [] and len(r1["warned"]) == (1 if mode == "WARN" else 0)
    for r in by_mode["FAIL"]:  # every rank raises, nothing is written
        assert r["error"].startswith("TagMismatch:") and "different tags on different ranks" in r["error"]
        assert r["listing"] == []


def test_a_save_mid_accumulation_warns_and_a_resume_starts_the_window_again(tmp_path):
    a = _engine(gas=2)
    _step(a, 0)
    _step(a, 1)  # one optimizer step
    _step(a, 2)  # half a window
    with pytest.warns(RuntimeWarning, match="middle of gradient accumulation"):
        a.save_checkpoint(str(tmp_path))
    b = _engine(gas=2)
    b.load_checkpoint(str(tmp_path))
    assert (b.global_steps, b.micro_steps) == (1, 2)  # the window starts again
    assert all(torch.equal(v, b.full_state_dict()[k]) for k, v in a.full_state_dict().items())


@pytest.mark.parametrize("where", [None, ""])
def test_save_without_a_directory_is_a_value_error(where):
    with pytest.raises(ValueError, match="needs a directory"):
        _engine().save_checkpoint(where)
