"""Accelerate's training loop with ZeroAccelerator on 2 CPU ranks (torchrun, gloo) against the
same loop with a plain Accelerator (DDP): accumulation 2, clipping, a warm-up/decay scheduler; and
epochs that end with a short accumulation window; and beside Accelerate's DeepSpeed route (slow)."""
import pytest

pytest.importorskip("accelerate", reason="accelerate is not installed")

from integration_launch import max_diff, max_rel_diff, torchrun  # noqa: E402


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("acc_ddp") / "out.json")
    return torchrun("accelerate_run.py", ["ddp", "0", out], out)


# 80 samples, 2 ranks, batch 8: 5 micro-batches per rank and epoch, accumulation 2: windows 2, 2, 1
SHORT = ["80", "2"]  # samples, epochs


@pytest.fixture(scope="module")
def ddp_short(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("acc_ddp_short") / "out.json")
    return torchrun("accelerate_run.py", ["ddp", "0", out, *SHORT], out)


def _run(tmp_path, stage, *extra):
    out = str(tmp_path / "out.json")
    return torchrun("accelerate_run.py", ["zerocore", str(stage), out, *extra], out)


def _check(ref, got):
    assert len(got["losses"]) == len(ref["losses"]) == 40
    assert max_diff(ref["lrs"], got["lrs"]) == 0.0
    assert max_diff(ref["losses"], got["losses"]) < 2e-5
    assert max_diff(ref["grad_norms"], got["grad_norms"]) < 2e-5
    assert max_diff(ref["weights"], got["weights"]) < 2e-5


def test_stage2_matches_ddp(ddp, tmp_path):
    _check(ddp, _run(tmp_path, 2))


@pytest.mark.slow
def test_stage3_matches_ddp(ddp, tmp_path):
    _check(ddp, _run(tmp_path, 3))


def _check_short(ref, got):
    # Accelerate syncs at the loader's end: 3 updates an epoch, the third after one micro-batch,
    # whose loss it divides by gradient_accumulation_steps as on DDP
    assert len(got["losses"]) == len(ref["losses"]) == 10 and len(ref["grad_norms"]) == 6
    assert max_diff(ref["lrs"], got["lrs"]) == 0.0
    assert max_rel_diff(ref["losses"], got["losses"]) < 1e-5
    assert max_rel_diff(ref["grad_norms"], got["grad_norms"]) < 1e-5
    assert max_rel_diff(ref["weights"], got["weights"]) < 1e-5


@pytest.mark.slow  # CI runs the short window at stage 3 (below); stage 2 here
def test_stage2_short_last_window_matches_ddp(ddp_short, tmp_path):
    _check_short(ddp_short, _run(tmp_path, 2, *SHORT))


def test_stage3_short_last_window_matches_ddp(ddp_short, tmp_path):
    got = _run(tmp_path, 3, *SHORT)
    _check_short(ddp_short, got)
    assert got["partitioned"] == 6  # every weight and bias


@pytest.mark.slow
@pytest.mark.parametrize("stage, extra", [(2, []), (3, SHORT)])
def test_matches_accelerate_on_deepspeed(tmp_path, monkeypatch, stage, extra):
    # the same loop on Accelerate's DeepSpeed route (DeepSpeed itself, the config ZeroAccelerator gets); slow:
    # DeepSpeed builds its CPU communication op on first use
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    (tmp_path / "ds").mkdir()
    out = str(tmp_path / "ds" / "out.json")
    ref = torchrun("accelerate_run.py", ["deepspeed", str(stage), out, *extra], out)
    (_check_short if extra else _check)(ref, _run(tmp_path, stage, *extra))
