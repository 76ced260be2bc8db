"""Lightning's Trainer with the zerocore strategy on 2 CPU ranks (torchrun, gloo) against the
same Trainer with DDP: losses, learning rates and final weights; a checkpoint resumed; epochs that
end with a short accumulation window; a compiled LightningModule."""
import os

import pytest

pytest.importorskip("lightning", reason="lightning is not installed")

from integration_launch import max_diff, max_rel_diff, torchrun  # noqa: E402

STEPS, ACC = "20", "2"


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp")
    return torchrun("lightning_run.py", ["ddp", str(d / "out.json"), STEPS, ACC], str(d / "out.json"))


def _check_matches(ref, got):
    assert len(got["losses"]) == len(ref["losses"]) == 2 * int(STEPS)  # micro-batches
    assert got["global_step"] == ref["global_step"] == int(STEPS)
    assert max_diff(ref["lrs"], got["lrs"]) == 0.0  # warm-up then decay, stepped per optimizer step
    assert max_diff(ref["losses"], got["losses"]) < 2e-5
    assert max_diff(ref["grad_norms"], got["grad_norms"]) < 2e-5
    assert max_diff(ref["weights"], got["weights"]) < 2e-5


def test_stage2_matches_ddp(ddp, tmp_path):
    out = str(tmp_path / "out.json")
    _check_matches(ddp, torchrun("lightning_run.py", ["zerocore_stage_2", out, STEPS, ACC], out))


@pytest.mark.slow
def test_stage3_matches_ddp_and_resumes(ddp, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    out = str(full / "out.json")
    got = torchrun("lightning_run.py", ["zerocore_stage_3", out, STEPS, ACC, "10"], out)
    _check_matches(ddp, got)
    ckpt = [c for c in os.listdir(full / "ckpt") if "step=10" in c]
    assert ckpt, os.listdir(full / "ckpt")
    res = tmp_path / "res"
    res.mkdir()
    out2 = str(res / "out.json")
    resumed = torchrun("lightning_run.py", ["zerocore_stage_3", out2, STEPS, ACC, "0", str(full / "ckpt" / ckpt[0])],
                       out2)
    # step 10 closes an epoch: the resumed run sees the same batches and continues exactly
    assert resumed["global_step"] == int(STEPS)
    assert max_diff(got["losses"][20:], resumed["losses"]) < 1e-6
    assert max_diff(got["lrs"][20:], resumed["lrs"]) == 0.0
    assert max_diff(got["weights"], resumed["weights"]) < 1e-6


@pytest.mark.slow
def test_stage2_offload_matches_ddp(ddp, tmp_path):
    out = str(tmp_path / "out.json")
    _check_matches(ddp, torchrun("lightning_run.py", ["zerocore_stage_2_offload", out, STEPS, ACC], out))


# 128 samples, 2 ranks, batch 8: 8 batches per rank and epoch, accumulate_grad_batches 3: windows 3, 3
# and 2; 6 steps are two epochs. argv after the output: steps, accumulate, ckpt_every, resume, samples
SHORT = ["6", "3", "0", "-", "128"]


@pytest.fixture(scope="module")
def ddp_short(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ddp_short") / "out.json")
    return torchrun("lightning_run.py", ["ddp", out, *SHORT], out)


def _check_short(ref, got):
    # Lightning steps at the epoch's last batch (the loss divided by accumulate_grad_batches, as on
    # DDP); before the fix the engine's own counter crashed there ("step() without backward()")
    assert got["global_step"] == ref["global_step"] == 6
    assert len(got["losses"]) == len(ref["losses"]) == 16 and len(ref["grad_norms"]) == 6
    assert max_diff(ref["lrs"], got["lrs"]) == 0.0
    assert max_rel_diff(ref["losses"], got["losses"]) < 1e-5
    assert max_rel_diff(ref["grad_norms"], got["grad_norms"]) < 1e-5
    assert max_rel_diff(ref["weights"], got["weights"]) < 1e-5
    # Lightning's model summary as fit starts counts every parameter whole (stage 3: partitioned by then)
    assert got["summary"] == ref["summary"] and ref["summary"]["total"] > 0


@pytest.mark.slow  # CI runs the short window at stage 3 (below); stage 2 here
def test_stage2_short_last_window_matches_ddp(ddp_short, tmp_path):
    out = str(tmp_path / "out.json")
    _check_short(ddp_short, torchrun("lightning_run.py", ["zerocore_stage_2", out, *SHORT], out))


def test_stage3_short_last_window_matches_ddp(ddp_short, tmp_path):
    out = str(tmp_path / "out.json")
    got = torchrun("lightning_run.py", ["zerocore_stage_3", out, *SHORT], out)
    _check_short(ddp_short, got)
    assert got["partitioned"] == 6  # every weight and bias


@pytest.mark.slow
def test_stage3_compiled_module_matches_ddp(ddp, tmp_path, monkeypatch):
    # a LightningModule given to fit() compiled (torch.compile(model)): Lightning unwraps it and compiles its
    # forward and training_step in place, which then run over the engine (the eager backend: the numbers of eager)
    monkeypatch.setenv("LIGHTNING_COMPILE", "eager")
    out = str(tmp_path / "out.json")
    _check_matches(ddp, torchrun("lightning_run.py", ["zerocore_stage_3", out, STEPS, ACC], out))


EVAL = ("8", "2", "4")  # 8 steps, accumulation 2, a checkpoint every 4 steps


def _evaluated(strategy, d):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LIGHTNING_EVAL", "1")
        out = str(d / "out.json")
        return torchrun("lightning_run.py", [strategy, out, *EVAL], out)


@pytest.fixture(scope="module")
def ddp_eval(tmp_path_factory):
    return _evaluated("ddp", tmp_path_factory.mktemp("ddp_eval"))


@pytest.mark.slow  # (13 s; CI's own checks of an engine that trains nothing: tests/runtime/test_trains_nothing.py,
@pytest.mark.parametrize("stage", [2, 3])  # and of its checkpoint load: tests/checkpoint/test_checkpoint_frozen.py)
def test_validate_test_predict_match_ddp(ddp_eval, tmp_path, stage):
    # validate() before fit, test() and predict() after it, validate(ckpt_path=) of the first checkpoint: each on
    # an engine that trains nothing (no gradient buffer, master or optimizer state), as Lightning's DeepSpeed
    # strategy builds DeepSpeed's inference engine there; the checkpoint's trained weights read from its masters
    got = _evaluated(f"zerocore_stage_{stage}", tmp_path)
    assert got["eval_engines"] == {k: {"trains": False, "state": 0} for k in ("val", "test")}
    assert got["evals"]["val"] == ddp_eval["evals"]["val"]  # before training: the same model, the same numbers
    assert max_diff(ddp_eval["losses"], got["losses"]) < 2e-5 and max_diff(ddp_eval["weights"], got["weights"]) < 2e-5
    for kind in ("test", "val_ckpt"):
        assert max_diff(ddp_eval["evals"][kind], got["evals"][kind]) < 2e-5, kind
    assert max_rel_diff(sum(ddp_eval["predictions"], []), sum(got["predictions"], [])) < 2e-5
    # validate(ckpt_path=) loaded the checkpoint's weights into the model, as on DDP
    assert max_diff(ddp_eval["after_ckpt_validate"], got["after_ckpt_validate"]) < 2e-5
