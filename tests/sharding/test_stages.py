"""Stages 0/1/2 on 1, 2 and 4 gloo ranks against one process training the same model with
torch.optim.AdamW on the concatenated global batch (mean loss).

Tolerances, and why:
- fp32: every element within rtol 1e-5 (atol 1e-6 = 1e-4 x lr, for values near zero), except
  elements whose true gradient is near zero: there the different summation order of the
  ranks' gradients is rounding noise that Adam's normalisation turns into lr-sized steps. For
  a tensor with such elements (at most 1% of it) we compare the tensor's training delta as a
  whole: || delta_engine - delta_ref || / || delta_ref || <= 1e-4.
- The key bias of attention (the middle third of ``in_proj_bias``) has an identically zero
  true gradient (softmax ignores a shift of all keys), so its update is pure rounding noise in
  both runs; it is left out of weight comparisons.
- bf16 / fp16 (16-bit forward and backward, fp32 master) against the fp32 reference: per
  tensor relative delta <= 0.15 (bf16, 8-bit mantissa) / 0.03 (fp16); the same bounds hold at
  world 1, so they measure the dtype, not the sharding.
- Adam and clipping would hide a wrong gradient scale, so the global gradient norm (before
  clipping) is compared every step: rtol 1e-5 (fp32), 3e-2 (bf16), 5e-3 (fp16).
"""
from __future__ import annotations

import math

import pytest
import torch

from dist_helpers import Case, case_results, reference, relative_delta_error, run_case, spawn_cases
from zerocore.runtime.memory import formula_bytes

FP32_NORM_RTOL = 1e-5
TOL = {"fp32": (None, FP32_NORM_RTOL), "bf16": (0.15, 3e-2), "fp16": (0.03, 5e-3)}


def _mask(name: str, t: torch.Tensor) -> torch.Tensor:
    keep = torch.ones_like(t, dtype=torch.bool)
    if name.endswith("attn.in_proj_bias"):
        d = t.numel() // 3
        keep[d:2 * d] = False  # key bias: zero true gradient (see module docstring)
    return keep


def assert_fp32_close(name, got, want, init):
    keep = _mask(name, want)
    g, w, i = got[keep], want[keep], init[keep].float()
    bad = ~torch.isclose(g, w, rtol=1e-5, atol=1e-6)
    if bad.any():
        frac = bad.float().mean().item()
        rd = relative_delta_error(g, w, i)
        assert frac <= 0.01 and rd <= 1e-4, (
            f"{name}: {bad.sum().item()}/{bad.numel()} elements off (max abs {(g - w).abs().max().item():.3g}), "
            f"relative delta error {rd:.3g}")


def check_against_reference(case: Case, world: int, per_rank: list[dict]):
    ref = reference(case, world)
    first = per_rank[0]
    # full_state_dict: the same full weights on every rank, under the model's own names
    for r in per_rank[1:]:
        assert r["state"].keys() == first["state"].keys()
        for k in first["state"]:
            assert torch.equal(first["state"][k], r["state"][k]), f"rank differs on {k}"
    assert set(first["state"]) == set(ref["state"])
    delta_tol, norm_rtol = TOL[case.dtype]
    # global grad norm, every step, on every rank
    for r in per_rank:
        for step, (got, want) in enumerate(zip(r["norms"], ref["norms"])):
            if math.isinf(want):
                assert math.isinf(got), f"step {step}: expected an overflow"
            else:
                assert got == pytest.approx(want, rel=norm_rtol), f"step {step}: grad norm {got} vs {want}"
    # the loss each step: the mean over ranks and micro-batches of the micro-batch losses
    losses = torch.tensor([r["losses"] for r in per_rank]).reshape(len(per_rank), case.steps, case.gas)
    mean = losses.mean(dim=(0, 2))
    torch.testing.assert_close(mean, torch.tensor(ref["losses"]), rtol=1e-5 if case.dtype == "fp32" else 3e-2,
                               atol=1e-6, check_dtype=False)
    for name, want in ref["state"].items():
        got, init = first["state"][name], ref["init"][name]
        assert got.dtype == torch.float32 and got.shape == want.shape
        if torch.equal(want, init):  # frozen: must not move at all (16-bit: up to one rounding)
            torch.testing.assert_close(got, want, rtol=0 if case.dtype == "fp32" else 1e-2, atol=0)
            continue
        if case.dtype == "fp32":
            assert_fp32_close(name, got, want, init)
        else:
            keep = _mask(name, want)
            rd = relative_delta_error(got[keep], want[keep], init[keep].float())
            assert rd <= delta_tol, f"{name}: relative delta error {rd:.3g} > {delta_tol}"
    return ref


# -- world 2: one spawn, every case ---------------------------------------------------------------
W2 = [
    Case("mlp_stage0", "mlp", 0),
    Case("mlp_stage1_acc4_clip_frozen_unused", "mlp_frozen_unused", 1, gas=4, clip=0.05),
    # tiny all-gather buckets too: the optimizer step batches groups (one Adam call per batch)
    Case("mlp_stage2_acc4_clip_frozen_unused_tiny_bucket", "mlp_frozen_unused", 2, gas=4, clip=0.05, bucket=300,
         overlap=True, zero={"allgather_bucket_size": 700}),
    Case("mlp_stage2_allreduce_no_overlap", "mlp", 2, gas=2, reduce_scatter=False, overlap=False, bucket=1000),
    Case("gpt_stage0_overlap", "gpt", 0, gas=2, bucket=4000, overlap=True),
    Case("gpt_stage1", "gpt", 1, bucket=3000, overlap=True),
    Case("gpt_stage2_acc2", "gpt", 2, gas=2, bucket=2000, overlap=True),
    Case("gpt_stage1_bf16", "gpt", 1, dtype="bf16", lr=3e-3, bucket=5000),
    # bf16 training, gradients summed over ranks in fp32 (zero_optimization.reduce_dtype)
    Case("gpt_stage1_bf16_reduce_fp32", "gpt", 1, dtype="bf16", lr=3e-3, bucket=5000, zero={"reduce_dtype": "fp32"}),
    Case("gpt_stage2_bf16_reduce_fp32", "gpt", 2, dtype="bf16", lr=3e-3, bucket=3000, overlap=True,
         zero={"reduce_dtype": "fp32"}),
    Case("gpt_stage2_fp16", "gpt", 2, dtype="fp16", lr=3e-3, fp16={"initial_scale_power": 10}),
    Case("mlp_stage2_fp16_overflow", "mlp", 2, dtype="fp16", inject_inf=(3, 1),
         fp16={"initial_scale_power": 8, "hysteresis": 1}),
    # the backend's own reduce-scatter, as on NCCL (gloo normally runs an all-reduce instead)
    Case("gpt_stage0_native_rs", "gpt", 0, native_rs=True, bucket=3000, overlap=True),
    Case("mlp_stage1_native_rs_acc2", "mlp_frozen_unused", 1, gas=2, native_rs=True, bucket=500, overlap=True),
    Case("mlp_stage2_native_rs_acc2_bf16", "mlp", 2, gas=2, dtype="bf16", native_rs=True, bucket=500,
         overlap=True),
    Case("memory_stage0", "mlp_big", 0, dtype="bf16", memory_only=True),
    Case("memory_stage1", "mlp_big", 1, dtype="bf16", memory_only=True, bucket=300_000),
    Case("memory_stage2", "mlp_big", 2, dtype="bf16", memory_only=True, bucket=300_000, overlap=True),
    Case("memory_stage2_fp32", "mlp_big", 2, memory_only=True, bucket=300_000, overlap=True),
]
W4 = [
    Case("mlp_stage1_acc2_clip_tiny_bucket", "mlp_frozen_unused", 1, gas=2, clip=0.05, bucket=100, overlap=True,
         zero={"allgather_bucket_size": 400}),
    Case("mlp_stage2_acc4_clip_frozen_unused", "mlp_frozen_unused", 2, gas=4, clip=0.05, bucket=700, overlap=True),
    Case("gpt_stage2_bf16", "gpt", 2, dtype="bf16", lr=3e-3, bucket=3000, overlap=True),
    Case("mlp_stage2_native_rs", "mlp", 2, native_rs=True, bucket=600, overlap=True),
    Case("memory_stage1", "mlp_big", 1, dtype="bf16", memory_only=True, bucket=300_000),
    Case("memory_stage2", "mlp_big", 2, dtype="bf16", memory_only=True, bucket=300_000, overlap=True),
]
W1 = [
    Case("mlp_stage2_acc4_clip_frozen_unused", "mlp_frozen_unused", 2, gas=4, clip=0.05, bucket=500, overlap=True),
    Case("gpt_stage1_acc2", "gpt", 1, gas=2),
]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn_cases(W2, 2, tmp_path_factory.mktemp("w2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return spawn_cases(W4, 4, tmp_path_factory.mktemp("w4"))


TRAIN_W2 = [c for c in W2 if not c.memory_only]
TRAIN_W4 = [c for c in W4 if not c.memory_only]


@pytest.mark.parametrize("case", TRAIN_W2, ids=lambda c: c.name)
def test_world2_matches_adamw(world2, case):
    check_against_reference(case, 2, case_results(world2, W2, case.name))


@pytest.mark.parametrize("case", TRAIN_W4, ids=lambda c: c.name)
def test_world4_matches_adamw(world4, case):
    check_against_reference(case, 4, case_results(world4, W4, case.name))


@pytest.mark.parametrize("case", W1, ids=lambda c: c.name)
def test_world1_matches_adamw(case):
    # no process group at all: the engine runs as a world of one
    check_against_reference(case, 1, [run_case(case, 0, 1)])


def test_clipping_really_clips():
    for case in [c for c in W2 + W4 + W1 if c.clip > 0]:
        world = 4 if case in W4 else 2 if case in W2 else 1
        norms = reference(case, world)["norms"]
        assert min(norms) > case.clip, f"{case.name}: clip {case.clip} never active (norms {norms})"


def test_buckets_smaller_than_a_parameter(world2, world4):
    for results, cases, name in [(world2, W2, "mlp_stage2_acc4_clip_frozen_unused_tiny_bucket"),
                                 (world4, W4, "mlp_stage1_acc2_clip_tiny_bucket")]:
        r = case_results(results, cases, name)[0]
        case = next(c for c in cases if c.name == name)
        assert r["groups"] >= 6  # one group per parameter larger than the bucket
        assert case.bucket < 37 * 53  # the largest weight does not fit one bucket


def test_fp16_overflow_skips_exactly_that_step_on_every_rank(world2):
    case = next(c for c in W2 if c.name == "mlp_stage2_fp16_overflow")
    per_rank = case_results(world2, W2, case.name)
    for r in per_rank:  # Inf injected on rank 1 only; every rank skips step 3
        assert r["skipped"] == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
        assert r["scales"][:3] == [256.0] * 3 and r["scales"][3] == 128.0  # hysteresis 1: halved at once
        assert math.isinf(r["norms"][3]) and all(math.isfinite(n) for i, n in enumerate(r["norms"]) if i != 3)
    # and afterwards it still matches the reference that also skipped step 3
    check_against_reference(case, 2, per_rank)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_memory_held_matches_zero_formulas(world2, world4, world, stage):
    results, cases = (world2, W2) if world == 2 else (world4, W4)
    for r in case_results(results, cases, f"memory_stage{stage}"):
        mem, psi = r["memory"], r["numel"]
        buckets = mem["buckets"]
        # stage 1 reduces the full gradient buffer in place: no separate buckets; stage 2's
        # transient buckets live only during backward: none between steps
        assert buckets == 0
        want = formula_bytes(psi, world, stage, half=True) + buckets
        assert abs(mem["total"] - want) <= 0.05 * want, (mem, want)
        # the role split too: 16-bit params 2 psi, grads 2 psi (stage 1) or 2 psi / N (stage 2)
        assert abs(mem["params"] - 2 * psi) <= 0.05 * 2 * psi
        assert abs(mem["grads"] - (2 * psi if stage == 1 else 2 * psi / world)) <= 0.05 * 2 * psi / world
        for role in ("master", "exp_avg", "exp_avg_sq"):
            assert abs(mem[role] - 4 * psi / world) <= 0.05 * 4 * psi / world
        # an independent count: every tensor alive in the rank (via the garbage collector) that
        # was not there before the model was built = the engine's tensors + one small batch
        # (64 KB either way: the collector sees only storages some Python object holds, a C++-held one it
        # misses; one run counted 14 KB less than the engine reports, and passed when run again)
        assert mem["total"] - 64 * 1024 <= r["gc_bytes"] <= mem["total"] * 1.01 + 64 * 1024


def test_memory_stage0_and_fp32(world2):
    r0 = case_results(world2, W2, "memory_stage0")[0]
    psi = r0["numel"]
    assert abs(r0["memory"]["total"] - 16 * psi) <= 0.05 * 16 * psi  # 2 + 2 + 12 per parameter
    r = case_results(world2, W2, "memory_stage2_fp32")[0]
    mem = r["memory"]
    assert mem["master"] == 0  # fp32: the master is the parameter itself
    want = formula_bytes(psi, 2, 2, half=False) + mem["buckets"]  # 4 psi + 12 psi / N
    assert abs(mem["total"] - want) <= 0.05 * want
