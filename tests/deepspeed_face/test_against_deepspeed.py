"""The same DeepSpeed-style script (train_script.py) under torchrun on 2 CPU ranks, with the real
DeepSpeed and with ``import zerocore.deepspeed as deepspeed``: the lr at every boundary, the
losses, gradient norms and sample counts agree, and a checkpoint saved mid-run resumes as the
uninterrupted run continues. bf16 runs with an Inf put into one gradient: the boundary is skipped as
DeepSpeed skips it (skipped_steps, the lr schedule held, global_samples advancing)."""
from __future__ import annotations

import inspect
import math

import pytest

import zerocore

from .runner import assert_same_training, launch

pytest.importorskip("deepspeed", reason="comparing with DeepSpeed needs it installed (pip install deepspeed)")

_PARAMS = inspect.signature(zerocore.initialize).parameters
needs_groups = pytest.mark.skipif("lr_scheduler" not in _PARAMS or "model_parameters" not in _PARAMS,
                                  reason="needs parameter groups, schedules and client optimizers in the engine")


def _runs_torch_optimizers() -> bool:
    """Whether the engine steps a non-Adam client optimizer (SGD) on its shards."""
    import torch

    model = torch.nn.Linear(2, 2)
    try:
        zerocore.initialize(model, {"gradient_clipping": 0.0}, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    except TypeError as e:
        return "not supported" not in str(e)
    except Exception:  # noqa: BLE001 - anything else is for the test itself to show
        return True
    return True


def _compare(tmp_path, cases):
    theirs = launch("deepspeed", str(tmp_path / "ds"), cases)
    ours = launch("zerocore", str(tmp_path / "zc"), cases)
    for c in cases:
        assert_same_training(ours[c["name"]], theirs[c["name"]])


# The two stage-2 resume cases run in one launch per library (a launch is ~5 s of start-up on 2 cores).
RESUME_CASES = [
    # no gradient_clipping key: DeepSpeed 0.19 clips at 1.0 by default, and so must zerocore
    # (the norms here are above 1, so a different default would change every loss after the first step)
    {"name": "s2", "stage": 2, "gas": 2, "steps": 8, "save_at": 4},
    {"name": "s2_sched", "stage": 2, "gas": 2, "steps": 12, "save_at": 5, "sched": "warmup_decay", "groups": True},
]


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds_resume")
    return launch("deepspeed", str(tmp / "ds"), RESUME_CASES), launch("zerocore", str(tmp / "zc"), RESUME_CASES)


def test_stage2_resume_with_deepspeed_default_clipping(resume_runs):
    theirs, ours = resume_runs
    assert_same_training(ours["s2"], theirs["s2"])


@needs_groups
def test_stage2_scheduler_and_groups_resume(resume_runs):
    theirs, ours = resume_runs
    assert_same_training(ours["s2_sched"], theirs["s2_sched"])


@pytest.mark.slow
@needs_groups
def test_stages_1_and_3_schedules_groups_and_client_adamw(tmp_path):
    _compare(tmp_path, [
        {"name": "s1", "stage": 1, "gas": 1, "steps": 6, "clip": 0.5, "sched": "warmup", "groups": True},
        {"name": "s3_init", "stage": 3, "gas": 2, "steps": 8, "save_at": 4, "sched": "warmup", "groups": True},
        {"name": "client_adamw", "stage": 2, "gas": 2, "steps": 8, "save_at": 4, "client": "adamw", "clip": 0.0},
    ])


@pytest.mark.slow
@needs_groups
def test_client_sgd(tmp_path):
    if not _runs_torch_optimizers():
        pytest.skip("needs non-Adam client optimizers stepped on the shards in the engine")
    _compare(tmp_path, [
        {"name": "client_sgd", "stage": 2, "gas": 1, "steps": 8, "save_at": 4, "client": "sgd"},
        {"name": "client_sgd_s1", "stage": 1, "gas": 2, "steps": 6, "client": "sgd", "clip": 0.0},
    ])


@pytest.mark.slow
def test_stages_1_and_3_config_optimizer(tmp_path):
    _compare(tmp_path, [
        {"name": "s1", "stage": 1, "gas": 1, "steps": 6, "clip": 0.5},
        {"name": "s3_init", "stage": 3, "gas": 2, "steps": 8, "save_at": 4},
    ])


# -- bf16: an Inf in a gradient (bf16.check_grad_overflow, on by default in both) ----------------------
#
# DeepSpeed 0.19.8's rule, read in its source and asserted on its own records below: at stages 1/2
# DeepSpeedZeroOptimizer.step checks the gradients for Inf/NaN (check_grad_overflow) and, on overflow,
# sets _global_grad_norm = inf, drops the gradients and returns without an update; at stage 3 (bf16 does
# not run check_overflow there) the norm of such gradients is invalid, which sets the same overflow.
# engine._take_model_step then counts skipped_steps += 1 and does not step the lr scheduler, and still
# advances global_steps and global_samples. zerocore skips on the device and settles the counts and the
# schedule when the host next asks (runtime/deferred_skip.py): what the script reads after the boundary
# (get_lr, get_global_grad_norm, skipped_steps, a checkpoint) must be what DeepSpeed shows.

INF_AT = 2


def _assert_deepspeed_skip_rule(records: list[dict], train_batch: int) -> None:
    """What DeepSpeed did at the boundary with the Inf, per rank: skipped there and only there, its lr
    schedule not stepped (the lr stays the previous boundary's, and moves again at the next), its norm
    reported as inf, the sample count advancing as on any boundary."""
    for r in records:
        n = len(r["lr"])
        assert r["skipped"] == [0] * INF_AT + [1] * (n - INF_AT)
        assert r["lr"][INF_AT] == r["lr"][INF_AT - 1] != r["lr"][INF_AT + 1]
        assert r["norm"][INF_AT] == float("inf") and all(math.isfinite(v) for i, v in enumerate(r["norm"])
                                                          if i != INF_AT)
        assert r["samples"] == [train_batch * (i + 1) for i in range(n)]
        assert all(math.isfinite(v) for v in r["loss"])


def _compare_inf_skip(runs, names: list[str]) -> None:
    theirs, ours = runs
    for c in (INF_CASES[n] for n in names):
        _assert_deepspeed_skip_rule(theirs[c["name"]], train_batch=c["micro"] * c["gas"] * 2)
        if not c.get("bf16"):
            rtol = 2e-5  # fp32: assert_same_training's own tolerance
        elif c.get("round_init"):
            # The same fp32 master in both (round_init, train_script.build) and the same bf16 operations:
            # on this CPU the losses agree bit for bit and the norms to ~5e-8 (DeepSpeed sums squares in
            # fp32, zerocore in fp64). 1e-3, a quarter of a bf16 ulp (2^-8), leaves room for a weight
            # rounded an ulp apart by another summation order and none for a different update.
            rtol = 1e-3
        else:
            # The initial values as a user's model has them: DeepSpeed's fp32 master is built from the
            # bf16-cast module, zerocore's from the fp32 values, so the bf16 weights differ by an ulp here
            # and there from the first update on (measured: losses up to 0.3% apart, norms 0.8%, in the
            # case below; 1.1% and 2.6% at stage 1 with gas 1 after 7 steps): bf16 tolerance.
            rtol = 2e-2
        assert_same_training(ours[c["name"]], theirs[c["name"]], rtol=rtol)


_BF16 = {"bf16": True, "inf_at": INF_AT, "micro": 4}


# The cases of the three tests below, run in one launch per library (module fixture ``inf_runs``).
INF_CASES = {c["name"]: c for c in [
    {"name": "s1_gas1", **_BF16, "stage": 1, "gas": 1, "steps": 7, "sched": "warmup_decay", "round_init": True},
    {"name": "s2_gas2_resume", **_BF16, "stage": 2, "gas": 2, "steps": 6, "sched": "warmup", "round_init": True,
     "save_at": INF_AT + 1},
    # outside zero.Init (test_bf16_stage3_zero_init_initial_values builds under it)
    {"name": "s3_gas2", **_BF16, "stage": 3, "gas": 2, "steps": 6, "sched": "warmup", "round_init": True,
     "zero_init": 0, "groups": True},
    {"name": "s2_user_init", **_BF16, "stage": 2, "gas": 2, "steps": 8, "sched": "warmup_decay"},
    # round_init: only for the tight tolerance (the values zero.Init makes are bf16 in both already)
    {"name": "s3_zero_init", **_BF16, "stage": 3, "gas": 2, "steps": 6, "sched": "warmup", "round_init": True},
    {"name": "s2_fp32", "inf_at": INF_AT, "micro": 4, "stage": 2, "gas": 2, "steps": 6, "sched": "warmup"},
    {"name": "s3_fp32", "inf_at": INF_AT, "micro": 4, "stage": 3, "gas": 1, "steps": 5, "sched": "warmup",
     "zero_init": 0},
    {"name": "s3_unchecked", **_BF16, "check_grad_overflow": 0, "stage": 3, "gas": 2, "steps": 6,
     "sched": "warmup", "round_init": True, "zero_init": 0},
]}


@pytest.fixture(scope="module")
def inf_runs(tmp_path_factory):
    tmp, cases = tmp_path_factory.mktemp("ds_inf"), list(INF_CASES.values())
    return launch("deepspeed", str(tmp / "ds"), cases), launch("zerocore", str(tmp / "zc"), cases)


@needs_groups
def test_bf16_inf_gradient_skips_as_deepspeed(inf_runs):
    """Stages 1, 2, 3: the boundary whose gradients hold an Inf is skipped, counted in skipped_steps and
    leaves the WarmupLR/WarmupDecayLR schedule where it was, as in DeepSpeed; the runs go on equal
    (stage 2 also through a checkpoint saved right after the skipped boundary and resumed)."""
    _compare_inf_skip(inf_runs, ["s1_gas1", "s2_gas2_resume", "s3_gas2", "s2_user_init"])


@needs_groups
def test_bf16_stage3_zero_init_initial_values(inf_runs):
    """bf16 under deepspeed.zero.Init: both make each new float tensor bf16 as it is created, so Conv2d/Linear's
    kaiming_uniform_ draws in bf16 in both (torch's CPU uniform_ in bf16 can return the lower bound where an fp32
    draw rounded afterwards gives ~+bound) and the models agree from the first forward."""
    _compare_inf_skip(inf_runs, ["s3_zero_init"])


# DeepSpeed 0.19.8 also skips where the overflow check is not asked for, on a non-finite norm alone:
# DeepSpeedZeroOptimizer.step (stages 1/2) sets overflow when ``(self.dtype != torch.bfloat16 or
# self.check_grad_overflow) and is_invalid_grad_norm(norm)``, so fp32 (and fp16) training skips; stage 3's
# step sets it on is_invalid_grad_norm whatever the dtype and the bf16 setting. zerocore.deepspeed's engines
# follow that rule (deepspeed/semantics.py, skips_nonfinite); zerocore.initialize's apply such an update
# (torch.optim's behaviour) unless fp16 or bf16.check_grad_overflow asks for the check. (bf16 with
# check_grad_overflow=false at stages 1/2: both apply it, NaN from then on in both; not compared, NaN losses
# are not comparable.)


@needs_groups
def test_skips_where_deepspeed_skips_without_being_asked(inf_runs):
    """fp32 at stages 2 and 3, bf16 with check_grad_overflow false at stage 3: DeepSpeed skips the boundary
    with the Inf gradient, and so do zerocore.deepspeed's engines."""
    _compare_inf_skip(inf_runs, ["s2_fp32", "s3_fp32", "s3_unchecked"])
