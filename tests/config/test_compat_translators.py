"""zerocore/config/compat: each translator turns another library's form into the canonical dict
(zerocore's own key names) that the schema reads, as a pure function; the canonical dict trains
exactly what the foreign one asked for."""
from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch

from zerocore.runtime.model_setup import accumulation_dtype

from zerocore.config import ConfigError, ConfigWarning, ZeroConfig, load_config
from zerocore.config.compat import (accepted_keys, colossalai, deepspeed, other_spellings, to_canonical,
                                    top_level_keys)


def _same_config(foreign: dict, canonical: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        assert dataclasses.asdict(load_config(foreign)) == dataclasses.asdict(load_config(canonical))


# -- DeepSpeed -----------------------------------------------------------------------------------------------
def test_deepspeed_aliases_become_zerocore_keys():
    given = {"bfloat16": {"enabled": True}, "aio": {"thread_count": 3},
             "zero_optimization": {"stage": 3, "prefetch_bucket_size": 7, "param_persistence_threshold": 8,
                                   "max_live_parameters": 9, "max_reuse_distance": 10,
                                   "gather_16bit_weights_on_model_save": True}}
    before = copy.deepcopy(given)
    t = deepspeed.translate(given)
    assert given == before  # pure: the input is not changed
    assert t.config == {"bf16": {"enabled": True}, "aio": {"intra_op_parallelism": 3},
                        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 7,
                                              "stage3_param_persistence_threshold": 8,
                                              "stage3_max_live_parameters": 9, "stage3_max_reuse_distance": 10,
                                              "stage3_gather_16bit_weights_on_model_save": True}}
    assert (t.notes, t.deprecated, t.ignored) == ((), (), ())
    _same_config(given, t.config)


def test_deepspeed_deprecated_keys_map_onto_the_offload_sections():
    given = {"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                   "cpu_offload_use_pin_memory": False,
                                   "stage3_gather_fp16_weights_on_model_save": True}}
    t = deepspeed.translate(given)
    assert t.config == {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                                              "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                              "offload_param": {"device": "cpu", "pin_memory": False}}}
    assert t.deprecated == (
        "zero_optimization.stage3_gather_fp16_weights_on_model_save (use stage3_gather_16bit_weights_on_model_save)",
        "zero_optimization.cpu_offload (use zero_optimization.offload_optimizer.device)",
        "zero_optimization.cpu_offload_param (use zero_optimization.offload_param.device)",
        "zero_optimization.cpu_offload_use_pin_memory (use zero_optimization.offload_*.pin_memory)")
    _same_config(given, t.config)
    # the section's own values win over the deprecated booleans; false means no offload
    t = deepspeed.translate({"zero_optimization": {"stage": 2, "cpu_offload": False, "cpu_offload_use_pin_memory": True,
                                                   "offload_optimizer": {"device": "cpu", "pin_memory": False}}})
    assert t.config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert deepspeed.translate({"zero_optimization": {"cpu_offload": False}}).config == {
        "zero_optimization": {"offload_optimizer": {"device": "none"}}}
    with pytest.raises(ConfigError, match="zero_optimization.cpu_offload: got 'yes'; allowed: true or false"):
        deepspeed.translate({"zero_optimization": {"cpu_offload": "yes"}})


def test_deepspeed_keys_without_a_field_are_dropped_when_harmless_and_refused_otherwise():
    given = {
        "steps_per_print": 10, "wall_clock_breakdown": False, "pipeline": {"enabled": False},
        "zero_optimization": {"stage": 2, "ignore_unused_parameters": True, "mics_shard_size": -1,
                              "offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 0.8}},
        "fp16": {"enabled": True, "auto_cast": False}, "optimizer": {"params": {"bias_correction": True}}}
    t = deepspeed.translate(given)
    assert t.config == {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                        "fp16": {"enabled": True}, "optimizer": {"params": {}}}
    assert t.ignored == ("steps_per_print", "wall_clock_breakdown", "pipeline")
    for bad, named in [
        ({"zero_optimization": {"zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights: got True"),
        ({"prescale_gradients": True}, "prescale_gradients: got True; zerocore cannot honour it"),
        ({"pipeline": {"stages": 2}}, "pipeline: zerocore does not implement this DeepSpeed setting"),
        ({"zero_optimisation": {"stage": 2}}, "zero_optimisation: zerocore does not implement this DeepSpeed "
                                              "setting and it would change what training computes (did you mean "
                                              "'zero_optimization'?)"),
        ({"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}},
         "zero_optimization.stage3_prefetch_bucket_size: given twice (as 'prefetch_bucket_size' and "
         "'stage3_prefetch_bucket_size')"),
        ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "bf16: given twice"),
    ]:
        with pytest.raises(ConfigError) as e:
            deepspeed.translate(bad)
        assert named in str(e.value), (bad, str(e.value))


def test_deepspeeds_super_offload_is_the_speculative_step():
    """SuperOffload (DeepSpeed: the host step started during the backward, stage 3, without clipping) is
    zerocore's offload_optimizer.speculative_step (every stage, clipping included, the same bits)."""
    for value in (True, False):
        t = deepspeed.translate({"zero_optimization": {"stage": 3, "offload_optimizer": {
            "device": "cpu", "super_offload": value, "cpuadam_cores_perc": 0.8}}})
        assert t.config == {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                                     "speculative_step": value}}}
    with pytest.raises(ConfigError, match="speculative_step: given twice"):
        deepspeed.translate({"zero_optimization": {"offload_optimizer": {"super_offload": True,
                                                                         "speculative_step": True}}})


def test_deepspeed_translator_leaves_sections_of_the_wrong_type_to_the_schema():
    assert deepspeed.translate({"zero_optimization": 3}).config == {"zero_optimization": 3}
    with pytest.raises(ConfigError, match="zero_optimization: got int; allowed: a JSON object"):
        load_config({"zero_optimization": 3})
    with pytest.raises(ConfigError, match="zero_optimization.offload_optimizer: got str"):
        load_config({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": "cpu"}})


# -- ColossalAI ----------------------------------------------------------------------------------------------
from colossalai_forms import MAX_IN_CPU, colossalai_forms as _colossal_forms


def test_colossalai_forms_become_canonical_dicts():
    first, second, third, fourth = _colossal_forms("/nvme")
    common = {"optimizer": {"params": {"lr": 0.001, "weight_decay": 0, "adam_w_mode": False}, "type": "Adam"},
              "fp16": {"enabled": True, "loss_scale": 0}, "gradient_clipping": 1.0}
    expected = [
        {"zero_optimization": {"stage": 3}},
        {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True, "fast_init": True},
                               "stage": 3}},
        {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True, "fast_init": True},
                               "offload_param": {"device": "cpu", "pin_memory": True, "max_in_cpu": MAX_IN_CPU},
                               "stage": 3}},
        {"zero_optimization": {"offload_optimizer": {"device": "nvme", "pin_memory": True, "fast_init": True,
                                                     "nvme_path": "/nvme"},
                               "offload_param": {"device": "nvme", "pin_memory": True, "max_in_cpu": MAX_IN_CPU,
                                                 "nvme_path": "/nvme"},
                               "stage": 3}},
    ]
    for given, want in zip((first, second, third, fourth), expected):
        before = copy.deepcopy(given)
        t = colossalai.translate(given)
        assert given == before
        assert t.config == {**want, **common}, given
        assert bool(t.notes) == (given is third)
        _same_config(given, t.config)
    note = colossalai.translate(third).notes[0]
    assert note.startswith(f"zero.offload_param_config.fast_init={MAX_IN_CPU} taken as "
                           f"zero.offload_param_config.max_in_cpu={MAX_IN_CPU}")
    assert "seed" not in note


def test_colossalai_spellings_and_their_conflicts():
    t = colossalai.translate({"zero": {"level": 2, "partition_grads": True, "gradient_accumulation_steps": 4},
                              "optimizer": {"type": "AdamW", "lr": 0.5}})
    assert t.config == {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4,
                        "optimizer": {"params": {"lr": 0.5}, "type": "AdamW"}}
    t = colossalai.translate({"zero_optimization": {"type": "ZeroRedundancyOptimizer_Level_1", "static_loss_scale": 64}})
    assert t.config == {"zero_optimization": {"stage": 1}, "fp16": {"enabled": True, "loss_scale": 64.0}}
    for bad, named in [
        ({"zero": {"stage": 1}, "zero_optimization": {"stage": 1}}, "zero_optimization: given twice"),
        ({"zero": {"level": 1, "stage": 1}}, "zero_optimization.stage: given twice (as 'level' and 'stage')"),
        ({"zero": {"partition_grads": False}}, "zero_optimization.partition_grads: got False; zerocore cannot "
                                              "honour it (ColossalAI's Level_2 always partitions gradients"),
        ({"zero": {"type": "ZeroRedundancyOptimizer_Level_3", "level": 2}}, "means stage 3 but zero.level is 2"),
        ({"zero": {"offload_param_config": {"fast_init": 5, "max_in_cpu": 6}}},
         "zero.offload_param_config.fast_init: got 5 and max_in_cpu 6"),
        ({"zero": {"dynamic_loss_args": {"init_scale": 8}}}, "zero.dynamic_loss_args: given without "
                                                             "dynamic_loss_scale: true"),
    ]:
        with pytest.raises(ConfigError) as e:
            colossalai.translate(bad)
        assert named in str(e.value), (bad, str(e.value))


# -- both, in one place ----------------------------------------------------------------------------------------
def test_to_canonical_runs_both_and_its_output_is_a_fixed_point():
    given = {"zero": {"level": 3, "prefetch_bucket_size": 5, "cpu_offload": True,
                      "offload_param_config": {"device": "cpu"}},
             "bfloat16": {"enabled": True}, "steps_per_print": 1}
    t = to_canonical(given)
    assert t.config == {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5,
                                              "offload_param": {"device": "cpu"},
                                              "offload_optimizer": {"device": "cpu"}},
                        "bf16": {"enabled": True}}
    assert t.deprecated == ("zero_optimization.cpu_offload (use zero_optimization.offload_optimizer.device)",)
    assert t.ignored == ("steps_per_print",)
    again = to_canonical(t.config)
    assert (again.config, again.notes, again.deprecated, again.ignored) == (t.config, (), (), ())
    _same_config(given, t.config)


def test_docs_list_every_other_spelling_with_its_library():
    spellings = other_spellings()
    assert spellings["zero_optimization"] == [("zero", "ColossalAI")]
    assert spellings["zero_optimization.stage"] == [("level", "ColossalAI")]
    assert ("stage3_gather_fp16_weights_on_model_save", "DeepSpeed, deprecated") in spellings[
        "zero_optimization.stage3_gather_16bit_weights_on_model_save"]
    assert spellings["aio.intra_op_parallelism"] == [("thread_count", "DeepSpeed")]


def _schema_keys(path: str) -> set[str]:
    cls = ZeroConfig
    for part in path.split(".") if path else ():
        cls = {f.name: f for f in dataclasses.fields(cls)}[part].default_factory
    return {f.name for f in dataclasses.fields(cls)}


def test_tables_map_onto_schema_keys_and_accept_only_keys_the_schema_lacks():
    for key in other_spellings():  # every other spelling names a key the schema has
        path, _, name = key.rpartition(".")
        assert name in _schema_keys(path), key
    for path, keys in accepted_keys().items():  # a foreign key never shadows a schema key
        assert not set(keys) & _schema_keys(path), path
    assert not set(top_level_keys()) & _schema_keys("")


def _quiet_load(cfg: dict) -> ZeroConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return load_config(cfg)


@pytest.mark.parametrize("stage, train, accum, accepted", [
    (0, None, None, True), (0, "bf16", "bf16", True), (0, None, "fp32", True),  # asks for nothing
    (0, "bf16", "fp32", False), (0, None, "fp16", False),  # DeepSpeed refuses these mixes without ZeRO too
    (1, "fp16", "fp32", True), (1, None, "bf16", True),  # DeepSpeed's stage-1 optimizer accumulates in the
    (2, "bf16", "fp32", True), (3, "fp16", "bf16", True),  # training dtype whatever it says, as zerocore
    (1, "bf16", "fp32", True),  # DeepSpeed's BF16 optimizer accumulates in fp32: so does zerocore (accumulation_dtype)
])
def test_deepspeed_data_types_section(stage, train, accum, accepted):
    cfg = {"zero_optimization": {"stage": stage}, "data_types": {"grad_accum_dtype": accum}}
    if train:
        cfg[train] = {"enabled": True}
    if accepted:
        loaded = _quiet_load(cfg)
        assert loaded.data_types.grad_accum_dtype == accum
        fp32 = (stage, train, accum) == (1, "bf16", "fp32")
        assert accumulation_dtype(loaded) == (torch.float32 if fp32 else None)
        if stage > 0:
            offload = {**cfg, "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
            assert accumulation_dtype(_quiet_load(offload)) is None  # DeepSpeed's ZeRO optimizer then: bf16
    else:
        with pytest.raises(ConfigError, match=f"data_types.grad_accum_dtype: '{accum}' with {train or 'fp32'} "
                                              f"training at ZeRO stage {stage}"):
            _quiet_load(cfg)
    with pytest.raises(ConfigError, match="data_types.other: unknown key"):
        _quiet_load({"data_types": {"other": 1}})
    with pytest.raises(ConfigError, match="grad_accum_dtype: got 'int8'"):
        _quiet_load({"data_types": {"grad_accum_dtype": "int8"}})


def test_elastic_checkpoint_is_accepted_with_any_value_and_tag_validation_is_a_key():
    for value in (True, False):
        cfg = _quiet_load({"zero_optimization": {"stage": 3, "elastic_checkpoint": value}})
        assert cfg.zero_optimization.stage == 3
    assert _quiet_load({}).checkpoint.tag_validation == "WARN"  # DeepSpeed's default
    assert _quiet_load({"checkpoint": {"tag_validation": "fail", "load_universal": True}}).checkpoint.tag_validation \
        in ("fail", "FAIL")
    with pytest.raises(ConfigError, match="checkpoint.tag_validation"):
        _quiet_load({"checkpoint": {"tag_validation": "foo"}})
    with pytest.raises(ConfigError, match="checkpoint.tag_check: unknown key"):
        _quiet_load({"checkpoint": {"tag_check": "WARN"}})


def test_zero_allow_untested_optimizer_may_be_written_as_0_or_1():
    assert deepspeed.translate({"zero_allow_untested_optimizer": 1}).config == {"zero_allow_untested_optimizer": True}
    assert _quiet_load({"zero_allow_untested_optimizer": 0}).zero_allow_untested_optimizer is False
    with pytest.raises(ConfigError, match="zero_allow_untested_optimizer: got 2"):
        _quiet_load({"zero_allow_untested_optimizer": 2})


@pytest.mark.parametrize("flags, param", [
    ({"bf16": {"enabled": True}}, "bf16"), ({"bf16": {"enabled": True}}, "torch.bfloat16"),
    ({"bf16": {"enabled": True}}, "fp32"), ({}, "fp32"), ({}, "float"), ({}, "fp16"),
    ({"fp16": {"enabled": True}}, "half"), ({"fp16": {"enabled": True}}, "bfloat16"),
    ({"bf16": {"enabled": True}}, "int8"), ({"bf16": {"enabled": True}}, "bf-16"), ({}, None)])
def test_param_dtype_is_refused_where_deepspeed_refuses_it(flags, param):
    """data_types.param_dtype (DeepSpeed 0.19.8): DeepSpeed's engine asserts it equals the training dtype
    (DeepSpeedEngine._assert_valid_mixed_precision_config, run here on the same values); zerocore refuses the
    same configs naming the key and drops the others (nothing else reads it)."""
    pytest.importorskip("deepspeed", reason="comparing with DeepSpeed's check needs it installed")
    from types import SimpleNamespace

    from deepspeed.runtime.engine import DeepSpeedEngine

    stub = SimpleNamespace(_config=SimpleNamespace(param_dtype=param),
                           fp16_enabled=lambda: flags.get("fp16", {}).get("enabled", False),
                           bfloat16_enabled=lambda: flags.get("bf16", {}).get("enabled", False))
    try:
        DeepSpeedEngine._assert_valid_mixed_precision_config(stub)
        theirs = True
    except (AssertionError, ValueError):
        theirs = False
    try:
        t = deepspeed.translate({**flags, "data_types": {"param_dtype": param}})
        ours = True
        assert "param_dtype" not in t.config["data_types"]
    except ConfigError as e:
        ours = False
        assert "data_types.param_dtype" in str(e)
    assert ours == theirs, (flags, param, ours, theirs)
