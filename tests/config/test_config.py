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


def test_unknown_top_level_keys_one_warning_naming_all():
    # other subsystems' DeepSpeed keys (logging, profilers) live at the top level: a warning
    with pytest.warns(ConfigWarning) as rec:
        load_config({"steps_per_print": 10, "wall_clock_breakdown": False, "zero_optimization": {"stage": 1}})
    msgs = [str(w.message) for w in rec if "unknown" in str(w.message)]
    assert len(msgs) == 1
    for key in ("steps_per_print", "wall_clock_breakdown"):
        assert key in msgs[0]


@pytest.mark.parametrize("cfg,wording", [
    ({"zero_optimization": {"stage": 1, "bogus": 1}}, "zero_optimization.bogus: unknown key; zero_optimization has: "),
    ({"fp16": {"enabled": False, "nope": 2}}, "fp16.nope: unknown key"),
    ({"zero_optimization": {"reduce_bucket_sise": 5}}, "did you mean 'reduce_bucket_size'?"),
    ({"optimizer": {"params": {"momentum": 0.9}}}, "optimizer.params.momentum: unknown key"),
    ({"zero_optimization": {"zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights: got True; "
     "zerocore cannot honour it (ZeRO++ quantized weights are not implemented)"),
    ({"zero_optimization": {"ignore_unused_parameters": False}}, "ignore_unused_parameters: got False"),
    ({"fp16": {"auto_cast": True}}, "fp16.auto_cast: got True"),
])
def test_unknown_keys_of_known_sections_are_errors(cfg, wording):
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert wording in str(e.value)


def test_other_libraries_keys_with_the_value_zerocore_honours_pass_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config({"zero_optimization": {"stage": 2, "ignore_unused_parameters": True,
                                                 "use_multi_rank_bucket_allreduce": False, "mics_shard_size": -1},
                           "fp16": {"enabled": True, "auto_cast": False},
                           "optimizer": {"params": {"bias_correction": True, "amsgrad": False}}})
    assert cfg.zero_optimization.stage == 2 and cfg.fp16.enabled


@pytest.mark.parametrize("cfg,key,allowed", [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "0, 1, 2, 3"),
    ({"zero_optimization": {"overlap_comm": "yes"}}, "zero_optimization.overlap_comm", "true or false"),
    ({"zero_optimization": {"reduce_bucket_size": 1.5}}, "zero_optimization.reduce_bucket_size", "integer"),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size", ">= 1"),
    ({"fp16": {"loss_scale_window": "x"}}, "fp16.loss_scale_window", "integer"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale", "> 0"),
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
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "config.md"), encoding="utf-8") as f:
        committed = f.read()
    assert committed == render(), "docs/config.md is stale: run `python -m zerocore config-docs --write docs/config.md`"
    out = subprocess.run([sys.executable, "-m", "zerocore", "config-docs"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out == committed


# -- ColossalAI's form (its four dicts, as ColossalAI's examples write them) ---------------------
from colossalai_forms import MAX_IN_CPU as OFFLOAD_PARAM_MAX_IN_CPU, colossalai_forms


def _assert_seed_common(cfg):
    assert cfg.zero_optimization.stage == 3
    p = cfg.optimizer.params
    assert (cfg.optimizer.type, p.lr, p.weight_decay) == ("Adam", 0.001, 0.0)
    assert cfg.optimizer.decoupled is False  # ColossalAI's type='Adam' is torch.optim.Adam
    assert cfg.fp16.enabled and cfg.fp16.loss_scale == 0 and not cfg.bf16.enabled  # fp16, dynamic scaling
    assert cfg.gradient_clipping == 1.0


def test_seed_dicts_mean_what_they_say(tmp_path):
    first, second, third, fourth = colossalai_forms(str(tmp_path / "nvme"))
    for d in (first, second):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing of these two is unknown, guessed or ignored
            cfg = load_config(d)
        _assert_seed_common(cfg)
    z = load_config(first).zero_optimization
    assert (z.offload_optimizer.device, z.offload_param.device) == ("none", "none")
    z = load_config(second).zero_optimization
    assert (z.offload_optimizer.device, z.offload_optimizer.pin_memory, z.offload_optimizer.fast_init) == (
        "cpu", True, True)
    assert z.offload_param.device == "none"

    with pytest.warns(ConfigWarning) as rec:
        cfg = load_config(third)
    _assert_seed_common(cfg)
    z = cfg.zero_optimization
    assert (z.offload_optimizer.device, z.offload_optimizer.fast_init) == ("cpu", True)
    assert (z.offload_param.device, z.offload_param.pin_memory, z.offload_param.max_in_cpu) == (
        "cpu", True, OFFLOAD_PARAM_MAX_IN_CPU)
    text = " ".join(str(w.message) for w in rec)
    assert (f"zero.offload_param_config.fast_init={OFFLOAD_PARAM_MAX_IN_CPU} taken as "
            f"zero.offload_param_config.max_in_cpu={OFFLOAD_PARAM_MAX_IN_CPU}") in text and "write max_in_cpu" in text

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(fourth)
    _assert_seed_common(cfg)
    z = cfg.zero_optimization
    assert (z.offload_optimizer.device, z.offload_optimizer.nvme_path) == ("nvme", str(tmp_path / "nvme"))
    assert (z.offload_param.device, z.offload_param.max_in_cpu, z.offload_param.nvme_path) == (
        "nvme", OFFLOAD_PARAM_MAX_IN_CPU, str(tmp_path / "nvme"))


def test_colossalai_form_levels_loss_scaling_and_conflicts():
    for level in (1, 2, 3):
        cfg = load_config({"zero": {"type": f"ZeroRedundancyOptimizer_Level_{level}"}})
        assert cfg.zero_optimization.stage == level and not cfg.fp16.enabled
    cfg = load_config({"zero": {"type": "ZeroRedundancyOptimizer_Level_2", "static_loss_scale": 128.0,
                                "gradient_accumulation_steps": 4}})
    assert (cfg.fp16.enabled, cfg.fp16.loss_scale, cfg.gradient_accumulation_steps) == (True, 128.0, 4)
    cfg = load_config({"zero": {"dynamic_loss_scale": True, "dynamic_loss_args": {
        "init_scale": 2**10, "scale_window": 100, "delayed_shift": 3, "min_scale": 0.25}}})
    f = cfg.fp16
    assert (f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale) == (10, 100, 3, 0.25)
    # a flat AdamW keeps decoupled decay; optimizer.params and flat keys merge
    cfg = load_config({"optimizer": {"type": "AdamW", "lr": 0.5, "params": {"eps": 1e-5}}})
    assert (cfg.optimizer.params.lr, cfg.optimizer.params.eps, cfg.optimizer.decoupled) == (0.5, 1e-5, True)
    for bad, wording in [
        ({"zero": {"type": "ZeroRedundancyOptimizer_Level_4"}}, "zero.type: got 'ZeroRedundancyOptimizer_Level_4'"),
        ({"zero": {"type": "ZeroRedundancyOptimizer_Level_3", "level": 2}}, "means stage 3 but zero.level is 2"),
        ({"zero": {"clip_grad": 1.0}, "gradient_clipping": 0.5},
         "zero.clip_grad: got 1.0 but gradient_clipping is 0.5"),
        ({"zero": {"dynamic_loss_scale": True}, "fp16": {"loss_scale": 64}}, "fp16.loss_scale is 64"),
        ({"zero": {"dynamic_loss_scale": True}, "bf16": {"enabled": True}}, "bf16.enabled is true"),
        ({"zero": {"dynamic_loss_scale": "yes"}}, "zero.dynamic_loss_scale: got 'yes'"),
        ({"zero": {"dynamic_loss_args": {"init_scale": 1000}, "dynamic_loss_scale": True}}, "a power of 2"),
        ({"zero": {"offload_param_config": {"device": "cpu", "fast_init": True}}},
         "offload_param has no fast_init (offload_optimizer's fast_init is the bool)"),
        ({"optimizer": {"lr": 0.1, "params": {"lr": 0.2}}}, "optimizer.lr: got 0.1 but optimizer.params.lr is 0.2"),
        ({"optimizer": {"type": "Adam", "momentum": 0.9}}, "optimizer.params.momentum: unknown key"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(bad)
        assert wording in str(e.value), (bad, str(e.value))


# -- values that used to crash deep inside, or pass and mislead (issue 15) --------------------------------------
@pytest.mark.parametrize("cfg,wording", [
    ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage: got the string '3'; allowed: 0, 1, 2, 3"),
    ({"zero_optimization": {"stage3_divergence_timeout": 1e30}},
     "zero_optimization.stage3_divergence_timeout: got 1e+30; allowed: a number > 0 and <= 604800"),
    ({"gradient_accumulation_steps": 1e30}, "gradient_accumulation_steps: got 1e+30 (too large)"),
    ({"gradient_accumulation_steps": 2_000_000}, "gradient_accumulation_steps: got 2000000; allowed: an integer >= 1 "
     "and <= 1e+06"),
    ({"fp16": {"enabled": True, "min_loss_scale": 2.0**17}}, "fp16.min_loss_scale: got 131072, above the initial "
     "scale 2**fp16.initial_scale_power = 65536"),
    ({"zero_optimization": {"stage": 3, "stage3_unit_classes": [["Linear"]]}},
     "zero_optimization.stage3_unit_classes: got [['Linear']]; allowed: a list of class names (strings)"),
    ({"zero_optimization": {"reduce_bucket_size": 2.0**70}}, "zero_optimization.reduce_bucket_size: got "
     "1.1805916207174113e+21 (too large)"),
])
def test_values_that_crashed_inside_are_named(cfg, wording):
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert wording in str(e.value)


def test_pin_memory_with_null_offload_section_and_null_sections():
    with pytest.warns(ConfigWarning, match="cpu_offload_use_pin_memory"):
        cfg = load_config({"zero_optimization": {"stage": 2, "offload_optimizer": None,
                                                 "cpu_offload_use_pin_memory": True}})
    assert cfg.zero_optimization.offload_optimizer.device == "none"


def test_bad_config_paths_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory"):
        load_config(str(tmp_path))
    binary = tmp_path / "latin1.json"
    binary.write_bytes('{"gradient_clipping": 1.0, "x": "caf\xe9"}'.encode("latin-1"))
    with pytest.raises(ConfigError, match=f"config file {binary} is not UTF-8 text"):
        load_config(binary)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="got a JSON list; allowed: a JSON object"):
        load_config(listed)


HJSON_CONFIG = """{
  // DeepSpeed reads its config files as HJSON: comments, unquoted keys, trailing commas
  train_micro_batch_size_per_gpu: 2,
  "zero_optimization": {"stage": 3,},
}
"""


def test_hjson_config_files_read_as_deepspeed_reads_them(tmp_path, monkeypatch):
    path = tmp_path / "ds_config.json"
    path.write_text(HJSON_CONFIG)
    broken = tmp_path / "broken.json"
    broken.write_text('{"zero_optimization": {"stage": 3}')  # neither JSON nor HJSON: a brace missing
    try:
        import hjson  # noqa: F401
    except ImportError:
        hjson = None
    if hjson is not None:
        cfg = load_config(path)
        assert cfg.zero_optimization.stage == 3 and cfg.train_micro_batch_size_per_gpu == 2
        with pytest.raises(ConfigError, match=f"config file {broken} is neither JSON .* nor HJSON"):
            load_config(broken)
    monkeypatch.setitem(sys.modules, "hjson", None)  # as on a machine without it
    with pytest.raises(ConfigError, match=f"config file {path} is not valid JSON: .*pip install hjson"):
        load_config(path)


def test_mutated_zeroconfig_is_validated_again():
    cfg = load_config({"zero_optimization": {"stage": 2}})
    cfg.zero_optimization.stage = "3"
    with pytest.raises(ConfigError, match="zero_optimization.stage: got the string '3'"):
        load_config(cfg)
    cfg.zero_optimization.stage = 3
    cfg.fp16.enabled = cfg.bf16.enabled = True
    with pytest.raises(ConfigError, match="at most one"):
        load_config(cfg)
