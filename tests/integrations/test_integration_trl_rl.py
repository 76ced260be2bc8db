"""TRL's trainers that do more than a loss, driving zerocore on CPU ranks, against the same trainer with plain DDP
(trl_run.py): GRPOTrainer (it generates with the model being trained every step: the same completions are sampled
in both runs, equal rewards at every step, so each update is compared on the same data), DPOTrainer (a reference
model beside the trained one), DistillationTrainer (a teacher; the student generates its completions) and GKDTrainer
(a teacher that generates). Equal: the logged losses (and rewards, reward margins) and the final weights, to fp32
reduction-order tolerance."""
import pytest

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("trl", reason="trl is not installed")

from integration_launch import max_diff, max_rel_diff, run_in  # noqa: E402

TOL = 2e-5


def run(tmp, name, *opts, nproc):
    return run_in("trl_run.py", tmp, name, *opts, nproc=nproc)


def _same_training(ref, got, steps):
    assert len(got["losses"]) == len(ref["losses"]) == steps
    assert max_diff(ref["losses"], got["losses"]) < TOL
    assert max_rel_diff(ref["weights"], got["weights"]) < TOL


def _same_grpo(ref, got):
    assert max_diff(ref["reward"], got["reward"]) == 0.0  # the same completions were sampled
    assert any(s > 0 for s in ref["reward_std"])  # rewards differed within a group: the steps moved the weights
    _same_training(ref, got, 3)


def _reference_partitioned(got, world):
    """zerocore at stage 3 held the reference model partitioned: one engine, 1/world of the weights (the partition's
    padding aside), nothing whole outside a forward."""
    ref = got["ref"]
    assert ref["engines"] == 1 and ref["param_elems"] == 0
    assert ref["whole"] / world <= ref["held"] <= ref["whole"] / world + 64 * 4


def test_grpo_stage3_one_rank_matches_plain(tmp_path):
    both = run(tmp_path, "both", "trainer=grpo", "backend=both", "stage=3", nproc=1)  # one launch: plain, zerocore
    _same_grpo(both["plain"], both["zerocore"])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_grpo_two_ranks_matches_ddp(tmp_path, stage):
    _same_grpo(run(tmp_path, "ddp", "trainer=grpo", "backend=ddp", nproc=2),
               run(tmp_path, f"z{stage}", "trainer=grpo", "backend=zerocore", f"stage={stage}", nproc=2))


def _same_dpo(ref, got):
    assert ref["rewards/margins"][-1] > 0  # the policy moved away from the reference
    assert max_diff(ref["rewards/margins"], got["rewards/margins"]) < TOL
    _same_training(ref, got, 4)


@pytest.mark.slow  # (7.5 s; CI keeps GRPO's and distillation's one-rank runs, and the frozen engines' own tests)
def test_dpo_stage3_one_rank_matches_plain(tmp_path):
    both = run(tmp_path, "both", "trainer=dpo", "backend=both", "stage=3", nproc=1)
    _same_dpo(both["plain"], both["zerocore"])
    _reference_partitioned(both["zerocore"], 1)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_dpo_with_a_reference_model_two_ranks_matches_ddp(tmp_path, stage):
    ref = run(tmp_path, "ddp", "trainer=dpo", "backend=ddp", nproc=2)
    got = run(tmp_path, f"z{stage}", "trainer=dpo", "backend=zerocore", f"stage={stage}", nproc=2)
    _same_dpo(ref, got)
    if stage == 3:  # partitioned, as TRL's DeepSpeed path does; below stage 3 whole on every rank, as TRL keeps it
        _reference_partitioned(got, 2)
    else:
        assert got["ref"]["engines"] == 0 and got["ref"]["param_elems"] * 4 == got["ref"]["whole"]


@pytest.mark.slow
def test_grpo_with_a_kl_term_stage3_two_ranks_matches_ddp(tmp_path):
    """beta > 0: GRPO loads a reference model (the policy's initial weights, from the name in its config) and adds a
    KL term to the loss; at stage 3 zerocore partitions that model."""
    ref = run(tmp_path, "ddp", "trainer=grpo", "backend=ddp", "beta=0.04", nproc=2)
    got = run(tmp_path, "z3", "trainer=grpo", "backend=zerocore", "stage=3", "beta=0.04", nproc=2)
    _same_grpo(ref, got)
    _reference_partitioned(got, 2)


def _same_distillation(ref, got, world):
    assert ref["losses"][0] > 0  # the student differs from the teacher (a loss of 0.0 was the partitioned lm_head)
    _same_training(ref, got, 3)
    # the teacher partitioned by an engine that trains nothing, but for its lm_head, whole on every rank: TRL's loss
    # reads that weight after the teacher's forward has returned (frozen_models.py)
    teacher = got["ref"]
    head = teacher["head_elems"] * 4
    assert head > 0 and teacher["engines"] == 1 and teacher["param_elems"] * 4 == head
    partitioned = (teacher["whole"] - head) / world + head
    assert partitioned <= teacher["held"] <= partitioned + 64 * 4


def test_distillation_stage3_one_rank_matches_plain(tmp_path):
    """TRL's DistillationTrainer computes its loss inside the student's forward (forward redirection through the
    trainer's accelerator.unwrap_model) and projects with the student's lm_head weight read there: gathered at
    stage 3, as DDP's whole weight."""
    both = run(tmp_path, "both", "trainer=distill", "backend=both", "stage=3", nproc=1)
    _same_distillation(both["plain"], both["zerocore"], 1)


@pytest.mark.slow
def test_distillation_stage3_two_ranks_matches_ddp(tmp_path):
    _same_distillation(run(tmp_path, "ddp", "trainer=distill", "backend=ddp", nproc=2),
                       run(tmp_path, "z3", "trainer=distill", "backend=zerocore", "stage=3", nproc=2), 2)


@pytest.mark.slow  # (8 s)
def test_gkd_with_the_teacher_generating_stage3_one_rank_matches_plain(tmp_path):
    """TRL's GKDTrainer with seq_kd: the partitioned teacher generates each step's completions (its generate through
    TRL's unwrap_model_for_generation) and runs its forward for the loss."""
    both = run(tmp_path, "both", "trainer=gkd", "backend=both", "stage=3", "seq_kd=1", nproc=1)
    _same_distillation(both["plain"], both["zerocore"], 1)


@pytest.mark.slow
def test_gkd_stage3_two_ranks_matches_ddp(tmp_path):
    _same_distillation(run(tmp_path, "ddp", "trainer=gkd", "backend=ddp", "seq_kd=1", nproc=2),
              run(tmp_path, "z3", "trainer=gkd", "backend=zerocore", "stage=3", "seq_kd=1", nproc=2), 2)


@pytest.mark.slow
def test_grpo_with_a_reward_model_stage3_two_ranks_matches_ddp(tmp_path):
    """A reward model in reward_funcs (TRL calls it under torch.inference_mode): partitioned at stage 3 by an engine
    that trains nothing; its rewards equal DDP's whole model's bit for bit."""
    ref = run(tmp_path, "ddp", "trainer=grpo", "backend=ddp", "reward=model", nproc=2)
    got = run(tmp_path, "z3", "trainer=grpo", "backend=zerocore", "stage=3", "reward=model", nproc=2)
    _same_grpo(ref, got)
    assert got["frozen_engines"] == 1
