"""Config: DeepSpeed JSON as users have it, aliases, the ColossalAI form, one warning for all
unknown keys, errors that name the key, later-issue settings refused, generated docs current."""
import json
import os
import subprocess
import sys
import warnings

import pytest

from zerocore.config import (ConfigError, ConfigWarning, ZeroConfig, ZeroOptimizationConfig, load_config,
                             pending_features, require_implemented)
from zerocore.config.docs import render

DS_JSON = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 8,
    "gradient_clipping": 0.5,
    "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
             "hysteresis": 3, "min_loss_scale": 0.5},
    "bf16": {"enabled": False},
    "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True, "reduce_scatter": False,
                          "reduce_bucket_size": 2e7, "allgather_bucket_size": 3e7},
}


def test_every_listed_key_parses_from_a_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DS_JSON))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean DeepSpeed config warns about nothing
        cfg = load_config(str(path))
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (64, 4, 8)
    assert cfg.gradient_clipping == 0.5
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params.lr == 3e-4
    assert cfg.optimizer.params.betas == [0.8, 0.99] and cfg.optimizer.params.eps == 1e-6
    assert cfg.optimizer.params.weight_decay == 0.1
    f = cfg.fp16
    assert (f.enabled, f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale) == (
        True, 0.0, 12, 500, 3, 0.5)
    assert cfg.bf16.enabled is False
    z = cfg.zero_optimization
    assert (z.stage, z.contiguous_gradients, z.overlap_comm, z.reduce_scatter) == (2, True, True, False)
    assert z.reduce_bucket_size == 20_000_000 and isinstance(z.reduce_bucket_size, int)
    assert z.allgather_bucket_size == 30_000_000
    assert cfg.batch_sizes(world_size=2) == (8, 4, 64)


def test_defaults_are_deepspeeds():
    cfg = ZeroConfig()
    z = cfg.zero_optimization
    assert (z.stage, z.contiguous_gradients, z.reduce_scatter, z.overlap_comm) == (0, True, True, None)
    assert z.overlap is False and ZeroConfig(zero_optimization=ZeroOptimizationConfig(stage=3)).zero_optimization.overlap
    assert z.reduce_bucket_size == z.allgather_bucket_size == 500_000_000
    assert z.stage3_prefetch_bucket_size == 50_000_000 and z.stage3_param_persistence_threshold == 100_000
    assert z.offload_optimizer.buffer_count == 4 and z.offload_param.buffer_count == 5
    assert (cfg.fp16.initial_scale_power, cfg.fp16.loss_scale_window, cfg.fp16.hysteresis) == (16, 1000, 2)
    assert cfg.aio.block_size == 1048576 and cfg.aio.queue_depth == 8


def test_unknown_keys_one_warning_naming_all():
    with pytest.warns(ConfigWarning) as rec:
        load_config({"steps_per_print": 10, "zero_optimization": {"stage": 1, "bogus": 1},
                     "fp16": {"enabled": False, "nope": 2}})
    msgs = [str(w.message) for w in rec if "unknown" in str(w.message)]
    assert len(msgs) == 1
    for key in ("steps_per_print", "zero_optimization.bogus", "fp16.nope"):
        assert key in msgs[0]


@pytest.mark.parametrize("cfg,key,allowed", [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "0, 1, 2, 3"),
    ({"zero_optimization": {"overlap_comm": "yes"}}, "zero_optimization.overlap_comm", "true or false"),
    ({"zero_optimization": {"reduce_bucket_size": 1.5}}, "zero_optimization.reduce_bucket_size", "integer"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size", ">= 1"),
    ({"fp16": {"loss_scale_window": "x"}}, "fp16.loss_scale_window", "integer"),
    ({"fp16": {"min_loss_scale": 0}}, "fp16.min_loss_scale", "> 0"),
    ({"optimizer": {"type": "SGD"}}, "optimizer.type", "'Adam', 'AdamW'"),
    ({"optimizer": {"params": {"betas": [0.9]}}}, "optimizer.params.betas", "two numbers"),
    ({"gradient_clipping": "auto"}, "gradient_clipping", "number"),
    ({"zero_optimization": {"offload_optimizer": {"device": "disk"}}}, "zero_optimization.offload_optimizer.device",
     "'nvme'"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.offload_optimizer.nvme_path", "required"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled", "at most one"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param.device", "stage 3"),
    ({"zero_optimization": 3}, "zero_optimization", "JSON object"),
])
def test_bad_values_name_the_key_and_what_is_allowed(cfg, key, allowed):
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert key in str(e.value) and allowed in str(e.value)


def test_python_construction_is_validated_too():
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        ZeroOptimizationConfig(stage=7)


def test_batch_size_rules():
    assert load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}).batch_sizes(4) == (2, 4, 32)
    assert load_config({"train_batch_size": 32, "gradient_accumulation_steps": 2}).batch_sizes(4) == (2, 4, 32)
    assert load_config({}).batch_sizes(3) == (1, None, None)
    with pytest.raises(ConfigError, match="train_batch_size"):
        load_config({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                     "gradient_accumulation_steps": 2}).batch_sizes(4)


def test_deepspeed_aliases_and_deprecated_spellings():
    with pytest.warns(ConfigWarning) as rec:
        cfg = load_config({"bfloat16": {"enabled": True}, "zero_optimization": {
            "stage": 2, "cpu_offload": True, "prefetch_bucket_size": 123,
            "stage3_gather_fp16_weights_on_model_save": True}})
    assert cfg.bf16.enabled
    z = cfg.zero_optimization
    assert z.offload_optimizer.device == "cpu" and z.stage3_prefetch_bucket_size == 123
    assert z.stage3_gather_16bit_weights_on_model_save is True
    text = " ".join(str(w.message) for w in rec)
    assert "deprecated" in text and "cpu_offload" in text and "stage3_gather_fp16_weights_on_model_save" in text
    # stage-3 knobs at stage 2 are named as having no effect, not silently dropped
    assert "stage3_prefetch_bucket_size=123 (applies only with stage 3)" in text
    with pytest.raises(ConfigError, match="given twice"):
        load_config({"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}})


def test_colossalai_form_maps_onto_the_schema():
    cfg = load_config({"zero": dict(level=3, offload_optimizer_config=dict(device="cpu", pin_memory=True,
                                                                           fast_init=True),
                                    offload_param_config=dict(device="nvme", pin_memory=False, max_in_cpu=10**6,
                                                              nvme_path="/tmp/zc"))})
    z = cfg.zero_optimization
    assert z.stage == 3
    assert (z.offload_optimizer.device, z.offload_optimizer.fast_init) == ("cpu", True)
    assert (z.offload_param.device, z.offload_param.pin_memory, z.offload_param.max_in_cpu,
            z.offload_param.nvme_path) == ("nvme", False, 10**6, "/tmp/zc")
    # CPU and NVMe offload are implemented (parameter shards beyond max_in_cpu on NVMe: an error at initialize)
    require_implemented(cfg)


def test_implemented_settings_pass():
    assert pending_features(load_config({"zero_optimization": {"stage": 2}})) == []
    require_implemented(load_config(DS_JSON))


def test_no_effect_values_warn():
    with pytest.warns(ConfigWarning, match="contiguous_gradients=false"):
        load_config({"zero_optimization": {"contiguous_gradients": False}})


def test_bad_sources():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/ds.json")
    with pytest.raises(ConfigError, match="allowed: a dict"):
        load_config(42)


def test_docs_match_the_schema():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "config.md"), encoding="utf-8") as f:
        committed = f.read()
    assert committed == render(), "docs/config.md is stale: run `python -m zerocore config-docs --write docs/config.md`"
    out = subprocess.run([sys.executable, "-m", "zerocore", "config-docs"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out == committed
