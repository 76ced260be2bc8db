"""Hugging Face Trainer (and TRL's SFTTrainer) driving zerocore on 2 CPU ranks (torchrun, gloo),
against the same Trainer with plain DDP (use_cpu=True, ddp_backend="gloo"): a 2-layer Llama from
its config, a synthetic token dataset, 30 steps with linear warm-up and decay, accumulation 2; and
epochs that end with a short accumulation window (issue 34)."""
import os

import pytest

pytest.importorskip("transformers", reason="transformers is not installed")

from integration_launch import max_diff, run_in, same_run  # noqa: E402

TOL = 2e-5


def run(tmp, name, *opts, nproc=2):
    return run_in("hf_run.py", tmp, name, *opts, nproc=nproc)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return run(tmp_path_factory.mktemp("hf"), "ddp", "backend=ddp")


# 88 rows, 2 ranks, batch 4: 11 micro-batches per rank and epoch, accumulation 2: windows of 2 and a
# last one of 1; 12 steps are two epochs
SHORT = ("steps=12", "rows=88")


@pytest.fixture(scope="module")
def ddp_short(tmp_path_factory):
    return run(tmp_path_factory.mktemp("hf_short"), "ddp", "backend=ddp", *SHORT)


def _same_short_curve(ref, got):
    # the Trainer steps after the epoch's 11th micro-batch, its loss normalised by that window's
    # own token count (num_items_in_batch), as on DDP; a shifted window shows from step 6 on
    assert ref["steps"] == list(range(1, 13))
    same_run(ref, got)
    # the Trainer's floating-point estimate counts every parameter whole (at stage 3 too, where they are partitioned)
    assert got["total_flos"] == ref["total_flos"] > 0
    # so does its "Number of trainable parameters" log as training starts
    assert got["trainable_params_logged"] == ref["trainable_params_logged"] != [0]
    assert len(ref["trainable_params_logged"]) == 1


@pytest.fixture(scope="module")
def z2_short(tmp_path_factory):
    # checkpoints at steps 6 and 12: each right after an epoch's short window
    root = tmp_path_factory.mktemp("hf_short_z2")
    return root, run(root, "z2s", "stage=2", "save_steps=6", *SHORT)


# CI runs the short window at stage 3 (below, saving where the window ended early too); stage 2 here
@pytest.mark.slow
def test_stage2_short_last_window_matches_ddp(ddp_short, z2_short):
    root, got = z2_short
    _same_short_curve(ddp_short, got)
    # saved where the window ended early (refused before as "in the middle of gradient accumulation")
    assert (root / "z2s" / "run" / "checkpoint-6" / "latest").is_file()


@pytest.mark.slow
def test_resume_after_short_window_continues_as_uninterrupted(z2_short, tmp_path):
    root, full = z2_short
    resumed = run(tmp_path, "resumed", "stage=2", f"resume={root / 'z2s' / 'run' / 'checkpoint-6'}", *SHORT)
    assert resumed["steps"] == full["steps"]
    assert max_diff(full["losses"][6:], resumed["losses"][6:]) < 1e-6
    assert max_diff(full["grad_norms"][6:], resumed["grad_norms"][6:]) < 1e-6
    assert max_diff(full["weights"], resumed["weights"]) < 1e-6


def test_stage3_short_last_window_matches_ddp(ddp_short, tmp_path):
    _same_short_curve(ddp_short, run(tmp_path, "z3s", "stage=3", "save_steps=6", *SHORT))
    # saved where the window ended early (refused before as "in the middle of gradient accumulation")
    assert (tmp_path / "z3s" / "run" / "checkpoint-6" / "latest").is_file()


def _same_curve(ref, got):
    assert len(got["losses"]) == len(ref["losses"]) == 30
    assert max_diff(ref["lrs"], got["lrs"]) == 0.0  # warm-up 5 steps then linear decay
    assert max_diff(ref["losses"], got["losses"]) < TOL
    assert max_diff(ref["grad_norms"], got["grad_norms"]) < TOL
    assert max_diff(ref["weights"], got["weights"]) < TOL


def _saved_model_reloads(got):
    assert "model.safetensors" in got["saved_files"]
    assert got["reload_empty"] == []  # no empty tensors in what from_pretrained reads back
    assert got["reload_max_diff"] == 0.0


def test_stage2_matches_ddp_and_saves(ddp, tmp_path):
    got = run(tmp_path, "z2", "stage=2")
    _same_curve(ddp, got)
    _saved_model_reloads(got)
    assert got["optimizer_is_trainable"]


@pytest.mark.slow
def test_stage3_matches_ddp_and_generates_uneven(ddp, tmp_path):
    got = run(tmp_path, "z3", "stage=3", "gen=1")
    _same_curve(ddp, got)
    _saved_model_reloads(got)
    # rank 0 asked for 3 new tokens, rank 1 for 7: rank 0 finished and returned (no hang)
    assert len(got["generated"]) == 4 + 3


@pytest.mark.slow
def test_stage3_offload_from_pretrained_partitioned_matches_ddp(ddp, tmp_path):
    got = run(tmp_path, "z3o", "stage=3", "offload=1", "init=1")
    assert got["partitioned_at_load"] > 0  # built under zerocore.init, loaded with gathered(modifier_rank=0)
    _same_curve(ddp, got)
    _saved_model_reloads(got)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 1])
def test_resume_continues_as_uninterrupted(tmp_path, nproc):
    full = run(tmp_path, "full", "stage=2", "save_steps=15", nproc=nproc)
    ckpt = tmp_path / "full" / "run" / "checkpoint-15"
    assert (ckpt / "latest").is_file() and (ckpt / "model.safetensors").is_file()
    resumed = run(tmp_path, "resumed", "stage=2", f"resume={ckpt}", nproc=nproc)
    # log_history comes back from the checkpoint: steps 1-15 as saved, 16-30 trained again
    assert resumed["steps"] == full["steps"]
    assert max_diff(full["losses"][15:], resumed["losses"][15:]) < 1e-6
    assert max_diff(full["lrs"], resumed["lrs"]) == 0.0
    assert max_diff(full["weights"], resumed["weights"]) < 1e-6


@pytest.mark.slow
def test_checkpoint_loads_at_another_world_size(tmp_path):
    run(tmp_path, "w2", "stage=3", "save_steps=15", "steps=15")
    ckpt = tmp_path / "w2" / "run" / "checkpoint-15"
    # a world of one resumes the 2-rank checkpoint at its last step: what it saves is what was loaded
    run(tmp_path, "w1", "stage=2", "steps=15", f"resume={ckpt}", nproc=1)
    from safetensors.torch import load_file

    saved, loaded = load_file(str(ckpt / "model.safetensors")), load_file(str(tmp_path / "w1" / "final" /
                                                                               "model.safetensors"))
    assert saved.keys() == loaded.keys()
    assert max((saved[k] - loaded[k]).abs().max().item() for k in saved) == 0.0


@pytest.mark.slow
def test_sft_trainer_matches_its_ddp_run(tmp_path):
    pytest.importorskip("trl", reason="trl is not installed")
    ref = run(tmp_path, "sft_ddp", "backend=ddp", "trainer=sft", "steps=4")
    got = run(tmp_path, "sft_z2", "stage=2", "trainer=sft", "steps=4")
    assert len(got["losses"]) == 4
    assert max_diff(ref["losses"], got["losses"]) < TOL
    _saved_model_reloads(got)


@pytest.mark.slow
def test_lora_steps_and_saves_only_adapters(tmp_path):
    pytest.importorskip("peft", reason="peft is not installed")
    got = run(tmp_path, "lora", "stage=3", "lora=1", "steps=6")
    assert got["optimizer_is_trainable"] and got["optimizer_params"] == 8  # q/v lora_A/B x 2 layers
    assert "adapter_model.safetensors" in got["saved_files"] and "model.safetensors" not in got["saved_files"]
    assert all("lora_" in k for k in got["adapter_keys"]) and len(got["adapter_keys"]) == 8
    assert got["adapter_max_diff"] == 0.0


@pytest.fixture(scope="module")
def ddp_eval(tmp_path_factory):
    return run(tmp_path_factory.mktemp("hf_eval"), "ddp", "backend=ddp", "eval_only=1")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["1", "3"])
def test_evaluation_before_training(tmp_path, ddp, ddp_eval, stage):
    """trainer.evaluate() and predict() before train() run on an engine that trains nothing (no optimizer state, no
    gradient buffer; at stage 3 the parameters partitioned outside its forward), which then gives the model to the
    training engine (at stage 3 still partitioned, destroy(partitioned=True)): the evaluation equals DDP's, the
    training DDP's without an evaluation first. (DDP's own run with one trains apart: Transformers 5.24 leaves the
    model it evaluated unwrapped, so its ranks never average their gradients: docs/integrations.md.)"""
    got = run(tmp_path, "zerocore", f"stage={stage}", "eval_first=1")
    assert got["first_eval_loss"] == pytest.approx(ddp_eval["first_eval_loss"], rel=1e-6)
    assert got["predictions_shape"] == ddp_eval["predictions_shape"] == [24, 16, 96]
    e = got["eval_engine"]
    assert not e["trains"] and e["master"] == e["moments"] == e["grads"] == 0
    # stage 3: only the five RMSNorm weights (32 each, under the persistence threshold) are whole
    assert e["param_elems"] == (160 if stage == "3" else 24736)
    assert got["wrapped_as"] == "EngineModule"
    same_run(ddp, got)


@pytest.mark.slow
def test_evaluation_only_at_stage3(tmp_path, ddp_eval):
    # evaluate, predict and save_model with no training: the saved model is the one given, whole
    got = run(tmp_path, "zerocore", "stage=3", "eval_only=1")
    assert got["first_eval_loss"] == pytest.approx(ddp_eval["first_eval_loss"], rel=1e-6)
    assert got["eval_engine"]["master"] == 0 and got["saved_max_diff"] == 0.0


@pytest.mark.slow
def test_stage3_evaluates_and_loads_best_model(tmp_path):
    got = run(tmp_path, "best", "stage=3", "save_steps=10", "best=1")
    assert len(got["eval_losses"]) == 3  # evaluation at steps 10, 20, 30 through the stage-3 engine
    # "best" = the highest eval loss (greater_is_better): an early checkpoint, not the last weights
    best = got["best_checkpoint"]
    assert best.endswith(f"checkpoint-{10 * (1 + got['eval_losses'].index(max(got['eval_losses'])))}")
    assert not best.endswith("checkpoint-30"), got["eval_losses"]
    from safetensors.torch import load_file

    saved = load_file(os.path.join(best, "model.safetensors"))
    # the final weights are the best checkpoint's (only the first 64 values of each are reported)
    assert max(max(abs(a - b) for a, b in zip(saved[k].reshape(-1)[:64].tolist(), got["weights"][k]))
               for k in saved) == 0.0


@pytest.mark.slow
def test_weight_decay_groups_match_ddp(tmp_path):
    # weight_decay > 0: the Trainer's decay / no-decay groups become the engine's parameter groups
    ref = run(tmp_path, "wd_ddp", "backend=ddp", "wd=0.1", "steps=12")
    got = run(tmp_path, "wd_z2", "stage=2", "wd=0.1", "steps=12")
    assert max_diff(ref["losses"], got["losses"]) < TOL
    assert max_diff(ref["weights"], got["weights"]) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("lora", ["0", "1"])
def test_stage3_gradient_checkpointing_matches_ddp(tmp_path, lora):
    # the Trainer's gradient_checkpointing: each decoder layer's forward runs again inside the backward, where
    # stage 3 gathers its parameters a second time (with LoRA: the frozen base's inputs made to require grad)
    opts = ("steps=8", "gc=1", f"lora={lora}")
    ref = run(tmp_path, "ddp", "backend=ddp", *opts)
    same_run(ref, run(tmp_path, "z3", "stage=3", *opts))


@pytest.fixture(scope="module")
def ddp_batch2(tmp_path_factory):
    return run(tmp_path_factory.mktemp("hf_b2"), "ddp", "backend=ddp", "steps=6", "bs=2", "rows=96")


@pytest.mark.parametrize("stage", ["2", pytest.param("1", marks=pytest.mark.slow),
                                   pytest.param("3", marks=pytest.mark.slow)])
def test_auto_find_batch_size_retry_drops_the_failed_windows_gradients(ddp_batch2, tmp_path, stage):
    # auto_find_batch_size: the second forward at batch 4 fails as out of memory after the first micro-batch's
    # backward; the Trainer trains again from step 0 at batch 2 and calls model.zero_grad() first, which on DDP
    # drops that micro-batch's gradients. The engine kept them and added them to the first update (its gradient
    # norm 1.47 where a clean run at batch 2 has 0.98), silently
    same_run(ddp_batch2, run(tmp_path, "z", f"stage={stage}", "steps=6", "oom=1"))


@pytest.mark.slow
def test_stage3_neftune_matches_ddp(tmp_path):
    # neftune_noise_alpha: the Trainer hooks the input embeddings' forward to add noise; the embedding is
    # gathered by the engine at stage 3, and the noise draws the same random numbers as on DDP
    ref = run(tmp_path, "ddp", "backend=ddp", "steps=6", "neftune=5")
    same_run(ref, run(tmp_path, "z3", "stage=3", "steps=6", "neftune=5"))
