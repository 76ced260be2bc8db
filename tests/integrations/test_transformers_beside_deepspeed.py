"""The Hugging Face Trainer on zerocore beside the same Trainer on DeepSpeed itself (TrainingArguments(deepspeed=
config)), on 2 CPU ranks over gloo, with the one DeepSpeed config both get (hf_run.py): its own optimizer and schedule
sections of "auto"s (filled from the TrainingArguments by Transformers for DeepSpeed, by fill_auto for zerocore), a
resume from a checkpoint, a short last accumulation window at stage 3, bf16, and CPU offload. Compared: the learning
rate of every step (equal), the losses, gradient norms and final weights. Slow: DeepSpeed builds its CPU communication op on first
use (about a minute in a fresh home)."""
import pytest

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)")

from integration_launch import max_diff, max_rel_diff, run_in, same_run  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _cpu_deepspeed(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def run(tmp, name, *opts):
    return run_in("hf_run.py", tmp, name, *opts)


def test_deepspeed_schedule_sections_and_resume(tmp_path):
    # WarmupDecayLR and AdamW from the config, every value "auto"; checkpoints at step 6 of 12
    opts = ("stage=2", "sched=WarmupDecayLR", "steps=12", "save_steps=6")
    ref = run(tmp_path, "deepspeed", "backend=deepspeed", *opts)
    got = run(tmp_path, "zerocore", *opts)
    same_run(ref, got)
    assert ref["lrs"][0] == 0.0 and max(ref["lrs"]) == pytest.approx(3e-3)  # DeepSpeed's warm-up, then its decay
    resumed = run(tmp_path, "resumed", *opts, f"resume={tmp_path / 'zerocore' / 'run' / 'checkpoint-6'}")
    # the schedule the engine stepped comes back with the checkpoint: steps 7-12 as uninterrupted
    assert max_diff(got["lrs"], resumed["lrs"]) == 0.0
    assert max_diff(got["losses"], resumed["losses"]) == 0.0
    assert max_diff(got["weights"], resumed["weights"]) == 0.0


def test_stage3_short_last_window(tmp_path):
    # 88 rows on 2 ranks with batch 4 and accumulation 2: every epoch ends with a window of one micro-batch
    opts = ("stage=3", "sched=WarmupLR", "steps=12", "rows=88")
    same_run(run(tmp_path, "deepspeed", "backend=deepspeed", *opts), run(tmp_path, "zerocore", *opts))


def test_bf16_stage3_trainer_optimizer(tmp_path):
    # no optimizer or scheduler section: both step the Trainer's AdamW hyperparameters on its linear schedule.
    # master=rounded: zerocore's fp32 master starts from the bf16-rounded model, as DeepSpeed's does (its own
    # default starts from the fp32 values given); the buffers (the rotary inv_freq) stay fp32 in both
    opts = ("stage=3", "bf16=1", "steps=12")
    ref = run(tmp_path, "deepspeed", "backend=deepspeed", *opts)
    got = run(tmp_path, "zerocore", *opts, "master=rounded")
    assert ref["steps"] == got["steps"] and max_diff(ref["lrs"], got["lrs"]) == 0.0
    # the first updates land on the same bf16 weights: the next losses are equal, bit for bit
    assert ref["losses"][:3] == got["losses"][:3]
    assert max_rel_diff(ref["grad_norms"][:3], got["grad_norms"][:3]) < 1e-6  # (zerocore sums in fp64)
    # later a reduction's rounding differs here and there: within bf16's resolution
    assert max_rel_diff(ref["losses"], got["losses"]) < 1e-4
    assert max_rel_diff(ref["weights"], got["weights"]) < 2 ** -7


@pytest.mark.parametrize("opts", [("stage=2", "sched=WarmupLR", "steps=8"),
                                  ("stage=3", "sched=WarmupDecayLR", "steps=12", "rows=88")], ids=["stage2", "stage3"])
def test_cpu_offload(tmp_path, opts):
    # offload_optimizer (and offload_param at stage 3) to the CPU: DeepSpeed steps its DeepSpeedCPUAdam (built on
    # first use), zerocore its own host Adam; at stage 3 with short last windows
    opts = (*opts, "offload=1")
    same_run(run(tmp_path, "deepspeed", "backend=deepspeed", *opts), run(tmp_path, "zerocore", *opts))


@pytest.mark.parametrize("stage", ["2", "3"])
def test_bf16_without_accumulation_bit_for_bit(tmp_path, stage):
    # one micro-batch a step: every loss is DeepSpeed's bit for bit (its bf16 parameters after each update are), the
    # gradient norms to fp32's resolution (zerocore sums the norm in fp64). With accumulation (above) a last bf16 bit
    # differs now and then from the fourth step on: the two sum the micro-batches' bf16 gradients with different
    # rounding (measured: the same runs with one micro-batch a step are equal throughout)
    opts = (f"stage={stage}", "bf16=1", "steps=8", "acc=1")
    ref = run(tmp_path, "deepspeed", "backend=deepspeed", *opts)
    got = run(tmp_path, "zerocore", *opts, "master=rounded")
    assert ref["losses"] == got["losses"]
    assert max_rel_diff(ref["grad_norms"], got["grad_norms"]) < 1e-6


def test_bf16_stage3_evaluation_before_training(tmp_path):
    # trainer.evaluate() first: zerocore's evaluation engine hands the training engine the bf16 weights it held, so
    # the fp32 master starts from them (without master=rounded), as DeepSpeed's master always does; the training is
    # DeepSpeed's bit for bit. (DeepSpeed itself is run without the evaluation: through Transformers 5.24 and
    # Accelerate 1.15 its first backward after one fails, the Accelerator holding no DeepSpeed engine.)
    opts = ("stage=3", "bf16=1", "steps=8", "acc=1")
    ref = run(tmp_path, "deepspeed", "backend=deepspeed", *opts)
    got = run(tmp_path, "zerocore", *opts, "eval_first=1")
    assert ref["losses"] == got["losses"]
    assert max_rel_diff(ref["grad_norms"], got["grad_norms"]) < 1e-6
