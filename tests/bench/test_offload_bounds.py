"""benchmarks/host_step_probe.py (T_host: an offloaded engine's host Adam alone, on copies) and
step.py's table of each offload step against max(T_device, T_host), without a GPU."""
from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch

import zerocore

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")))
import host_step_probe  # noqa: E402
import step  # noqa: E402


def _engine(stage: int, offload: bool, bf16: bool = False, offload_param: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    z = {"stage": stage}
    if offload:
        z["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        z["offload_param"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": z,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return zerocore.initialize(model, cfg)


@pytest.mark.parametrize("stage", [2, 3])
def test_probe_times_the_host_step_and_leaves_the_state_alone(stage):
    engine = _engine(stage, offload=True)
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 64)).square().mean())
        engine.step()
    shards = host_step_probe.host_shards(engine)
    assert shards
    before = [t.clone() for s in shards for t in (s.master_h, s.exp_avg_h, s.exp_avg_sq_h)]
    t = host_step_probe.host_step_seconds(engine, reps=2)
    assert t["median_ms"] > 0 and t["min_ms"] <= t["median_ms"] and t["reps"] == 2
    n = sum(p.numel() for p in engine.module.parameters())
    assert t["elements"] == sum(s.split for s in shards) and n <= t["elements"] < n + 64 * len(shards)  # padded
    stepper = engine.offload.stepper
    assert t["threads"] == (stepper.threads if stepper is not None else torch.get_num_threads())
    after = [t for s in shards for t in (s.master_h, s.exp_avg_h, s.exp_avg_sq_h)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # copies were stepped, not the state
    engine.destroy()


@pytest.mark.parametrize("offload_param", [False, True])
def test_probe_times_the_16bit_write_wherever_the_step_makes_it(offload_param):
    """bf16 at stage 3: the host step writes 16-bit values, staged for a GPU or straight into host-resident
    parameters (a CPU device; parameter offload); the probe times that write wherever the step makes it."""
    engine = _engine(3, offload=True, bf16=True, offload_param=offload_param)
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().mean())
        engine.step()
    shards = host_step_probe.host_shards(engine)
    assert shards and all(s.half for s in shards)
    owned = [s.group.owned_params_raw().clone() for s in shards]
    t = host_step_probe.host_step_seconds(engine, reps=1)
    assert t["shards_writing_16bit"] == len(shards)
    assert all(torch.equal(a, s.group.owned_params_raw()) for a, s in zip(owned, shards))  # its own buffer
    engine.destroy()


def test_probe_without_offload_says_none():
    engine = _engine(2, offload=False)
    assert host_step_probe.host_step_seconds(engine) is None
    assert host_step_probe.host_step_seconds(None) is None
    engine.destroy()


def test_bounds_set_each_offload_step_against_host_and_device(capsys):
    args = argparse.Namespace(variants=["zerocore_stage2", "zerocore_stage2_offload", "zerocore_stage3_offload"])
    med = {"zerocore_stage2": 0.050, "zerocore_stage2_offload": 0.240, "zerocore_stage3_offload": 0.300}
    res = {"memory": {"zerocore_stage2_offload": {"host_step": {"median_ms": 200.0, "threads": 15}},
                      "zerocore_stage3_offload": {"host_step": {"median_ms": 250.0, "threads": 15}}}}
    rows = {v: {} for v in args.variants}
    out = step.offload_bounds(res, args, med, rows)
    s2 = out["zerocore_stage2_offload"]
    assert s2["t_device_ms"] == pytest.approx(50.0) and s2["t_host_ms"] == 200.0
    assert s2["vs_max"] == pytest.approx(240 / 200) and s2["vs_sum"] == pytest.approx(240 / 250)
    s3 = out["zerocore_stage3_offload"]  # its device run is not in this run: no ratio, still T_host
    assert s3["t_device_ms"] is None and "vs_max" not in s3 and s3["t_host_ms"] == 250.0
    assert rows["zerocore_stage2_offload"]["host_step"]["threads"] == 15 and "host_step" not in rows["zerocore_stage2"]
    text = capsys.readouterr().out
    assert "offload step against T_host and T_device" in text and "1.20" in text
