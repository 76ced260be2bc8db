"""The "auto" filling of a zerocore config from TrainingArguments (as Transformers fills
DeepSpeed's), its errors, and the integrations' version checks."""
import json

import pytest

pytest.importorskip("transformers", reason="transformers is not installed")

from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

from zerocore.integrations._common import check_version  # noqa: E402
from zerocore.integrations.transformers import fill_auto  # noqa: E402


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    return TrainingArguments(output_dir=str(tmp_path_factory.mktemp("out")), use_cpu=True, report_to=[],
                             per_device_train_batch_size=3, gradient_accumulation_steps=4, learning_rate=2e-4,
                             adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7, weight_decay=0.1,
                             max_grad_norm=0.7, warmup_steps=0.1)


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


AUTO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"}}


def test_every_auto_filled_as_transformers_fills_deepspeed(args, model):
    cfg = fill_auto(AUTO, args, model, num_training_steps=200)
    assert cfg["train_micro_batch_size_per_gpu"] == 3 and cfg["gradient_accumulation_steps"] == 4
    assert cfg["train_batch_size"] == 12 * args.world_size
    assert cfg["gradient_clipping"] == 0.7
    assert cfg["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.8, 0.95], "eps": 1e-7, "weight_decay": 0.1}
    assert cfg["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 2e-4, "warmup_num_steps": 20,
                                          "total_num_steps": 200}
    assert cfg["bf16"]["enabled"] is False
    z = cfg["zero_optimization"]
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == \
        (256, int(0.9 * 256), 160)
    assert AUTO["train_batch_size"] == "auto"  # the caller's dict is left as it was


def test_json_path_and_clipping_default(args, model, tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    cfg = fill_auto(str(p), args, model)
    assert cfg["gradient_clipping"] == 0.7  # the Trainer's max_grad_norm when the config leaves it out


def test_contradiction_names_both(args, model):
    bad = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError) as e:
        fill_auto(bad, args, model)
    msg = str(e.value)
    assert "train_micro_batch_size_per_gpu=8" in msg and "per_device_train_batch_size=3" in msg
    assert "optimizer.params.lr=0.001" in msg and "learning_rate=0.0002" in msg


def test_hidden_size_auto_without_hidden_size(args):
    import torch

    with pytest.raises(ValueError, match="reduce_bucket_size='auto' needs the model's hidden size"):
        fill_auto({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, args, torch.nn.Linear(2, 2))


def test_bad_config_file_named(args, model, tmp_path):
    with pytest.raises(ValueError, match="missing.json"):
        fill_auto(str(tmp_path / "missing.json"), args, model)


def test_unsupported_version_says_which_are_supported():
    with pytest.raises(ImportError, match=r"supports torch >=99.0,<100; installed is"):
        check_version("torch", "99.0", "100", "zerocore.integrations.x")
    with pytest.raises(ImportError, match="not installed"):
        check_version("no-such-dist-zc", "1.0", "2", "zerocore.integrations.x")


def test_trl_gather_for_generation_fills_stage3_only_and_the_config_wins(model, tmp_path):
    """TRL's ``ds3_gather_for_generation`` (default true: TRL gathers DeepSpeed's ZeRO-3 model for generation)
    becomes ``stage3_gather_for_generation`` at stage 3 unless the config sets it; plain TrainingArguments have no
    such argument (Transformers' own generation under ZeRO-3 gathers per module)."""
    trl = pytest.importorskip("trl", reason="trl is not installed")
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    z3 = {"zero_optimization": {"stage": 3}}
    grpo = trl.GRPOConfig(**common)
    assert grpo.ds3_gather_for_generation is True
    assert fill_auto(z3, grpo, model)["zero_optimization"]["stage3_gather_for_generation"] is True
    off = trl.GRPOConfig(**common, ds3_gather_for_generation=False)
    assert fill_auto(z3, off, model)["zero_optimization"]["stage3_gather_for_generation"] is False
    explicit = {"zero_optimization": {"stage": 3, "stage3_gather_for_generation": False}}
    assert fill_auto(explicit, grpo, model)["zero_optimization"]["stage3_gather_for_generation"] is False
    assert "stage3_gather_for_generation" not in fill_auto({"zero_optimization": {"stage": 2}}, grpo,
                                                           model)["zero_optimization"]
    plain = TrainingArguments(**common)
    assert "stage3_gather_for_generation" not in fill_auto(z3, plain, model)["zero_optimization"]
