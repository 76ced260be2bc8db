"""Accelerate's training loop with ZeroAccelerator on 2 CPU ranks (torchrun, gloo) against the
same loop with a plain Accelerator (DDP): accumulation 2, clipping, a warm-up/decay scheduler."""
import pytest

pytest.importorskip("accelerate", reason="accelerate is not installed")

from integration_launch import max_diff, torchrun  # noqa: E402


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("acc_ddp") / "out.json")
    return torchrun("accelerate_run.py", ["ddp", "0", out], out)


def _run(tmp_path, stage):
    out = str(tmp_path / "out.json")
    return torchrun("accelerate_run.py", ["zerocore", str(stage), out], out)


def _check(ref, got):
    assert len(got["losses"]) == len(ref["losses"]) == 40
    assert max_diff(ref["lrs"], got["lrs"]) == 0.0
    assert max_diff(ref["losses"], got["losses"]) < 2e-5
    assert max_diff(ref["weights"], got["weights"]) < 2e-5


def test_stage2_matches_ddp(ddp, tmp_path):
    _check(ddp, _run(tmp_path, 2))


@pytest.mark.slow
def test_stage3_matches_ddp(ddp, tmp_path):
    _check(ddp, _run(tmp_path, 3))
