"""TRL's GRPOTrainer (generation with the model being trained, every step) driving zerocore at ZeRO stage 3 on CPU
ranks, against the same GRPOTrainer with plain DDP (grpo_run.py): the logged losses and rewards and the final weights
equal to fp32 reduction-order tolerance. The generation sampled the same completions in both runs (equal rewards
at every step), so each step's update is compared on the same data."""
import pytest

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("trl", reason="trl is not installed")

from integration_launch import max_diff, max_rel_diff, torchrun  # noqa: E402

TOL = 2e-5


def run(tmp, name, *opts, nproc):
    d = tmp / name
    d.mkdir()
    out = str(d / "out.json")
    return torchrun("grpo_run.py", [out, *opts], out, nproc=nproc)


def _same_training(ref, got):
    assert len(got["losses"]) == len(ref["losses"]) == 3
    assert max_diff(ref["rewards"], got["rewards"]) == 0.0  # the same completions were sampled
    assert any(s > 0 for s in ref["reward_std"])  # rewards differed within a group: the steps moved the weights
    assert max_diff(ref["losses"], got["losses"]) < TOL
    assert max_rel_diff(ref["weights"], got["weights"]) < TOL


def test_grpo_stage3_one_rank_matches_plain(tmp_path):
    both = run(tmp_path, "both", "backend=both", "stage=3", nproc=1)  # one launch: plain, then zerocore
    _same_training(both["plain"], both["zerocore"])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_grpo_two_ranks_matches_ddp(tmp_path, stage):
    _same_training(run(tmp_path, "ddp", "backend=ddp", nproc=2),
                   run(tmp_path, f"z{stage}", "backend=zerocore", f"stage={stage}", nproc=2))
