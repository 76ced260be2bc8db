"""DeepSpeed's config -> zerocore's keys. zerocore's schema already uses DeepSpeed's main
spellings; this maps the rest:

- DeepSpeed's other accepted spellings (``bfloat16``, the stage-3 keys without their ``stage3_``
  prefix, ``aio.thread_count``), silently;
- its deprecated keys, with one warning naming each: ``stage3_gather_fp16_weights_on_model_save``
  and the ``cpu_offload`` / ``cpu_offload_param`` booleans (-> the offload sections' ``device``)
  and ``cpu_offload_use_pin_memory`` (-> their ``pin_memory``);
- its keys that zerocore has no field for. Inside a section zerocore knows, a key listed in
  ``ACCEPTED`` is dropped when its value asks for what zerocore does anyway, and is an error
  naming why with any other value (any other unknown key is the schema's error, with the nearest
  known spelling). At the top level, the keys in ``TOP_LEVEL`` (logging, monitoring, profiling,
  activation-checkpointing memory knobs: they change nothing training computes) and sections
  switched off (``{"enabled": false}``) are dropped and named in one warning; any other unknown
  top-level key is an error naming it, since ignoring it would train something else than asked.
"""
from __future__ import annotations

import dataclasses
import difflib

from ..options import ConfigError
from ..schema import DTYPE_SPELLINGS, ZeroConfig
from .translation import ANY, Translation, drop_accepted, matches, refusal, rename_at, section_at, with_section

# section path -> {DeepSpeed's other spelling: zerocore's key}
ALIASES: dict[str, dict[str, str]] = {
    "": {"bfloat16": "bf16"},
    "zero_optimization": {
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    },
    "aio": {"thread_count": "intra_op_parallelism"},
    # DeepSpeed's SuperOffload (stage 3, and without clipping only) starts the host step during the backward
    # and undoes an overflowed one arithmetically; zerocore's speculative step does it at every stage, with
    # clipping, keeping the bits of the step without it (zerocore/offload/speculation.py)
    "zero_optimization.offload_optimizer": {"super_offload": "speculative_step"},
}
# section path -> {deprecated spelling: zerocore's key}
DEPRECATED: dict[str, dict[str, str]] = {
    "zero_optimization": {"stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save"},
}
# zero_optimization's deprecated booleans that became offload sections: key -> its section
OFFLOAD_BOOLEANS = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
PIN_MEMORY = "cpu_offload_use_pin_memory"

# section path -> key -> (values zerocore honours, what zerocore does)
ACCEPTED: dict[str, dict[str, tuple]] = {
    "data_types": {
        "param_dtype": (ANY, "DeepSpeed asserts it is the training dtype (the fp16/bf16 enabled flags) and casts "
                             "nothing else by it: checked the same way (before this table)"),
    },
    "zero_optimization": {
        "ignore_unused_parameters": ((True,), "zerocore always trains models with unused parameters (their "
                                              "gradient is zero); zerocore.deepspeed.initialize accepts false "
                                              "too, as DeepSpeed does"),
        "elastic_checkpoint": (ANY, "deprecated by DeepSpeed and without effect there; zerocore's checkpoints load at "
                                    "any world size"),
        "legacy_stage1": ((False,), "zerocore has one stage-1 implementation"),
        "zero_hpz_partition_size": ((1,), "ZeRO++ hierarchical partitioning is not implemented"),
        "zero_quantized_weights": ((False,), "ZeRO++ quantized weights are not implemented"),
        "zero_quantized_nontrainable_weights": ((False,), "ZeRO++ quantized weights are not implemented"),
        "zero_quantized_gradients": ((False,), "ZeRO++ quantized gradients are not implemented"),
        "mics_shard_size": ((-1,), "MiCS sharding is not implemented"),
        "mics_hierarchical_params_gather": ((False,), "MiCS sharding is not implemented"),
        "use_multi_rank_bucket_allreduce": (ANY, "a DeepSpeed performance knob"),
        "memory_efficient_linear": (ANY, "a DeepSpeed performance knob"),
        "log_trace_cache_warnings": (ANY, "a DeepSpeed logging knob"),
        "verbose": (ANY, "a logging knob"),
        "allreduce_always_fp32": ((False,), "zerocore reduces in the training dtype"),
        "postscale_gradients": ((True,), "zerocore divides by the world size after reducing"),
        "gradient_predivide_factor": ((1, 1.0), "zerocore divides by the world size after reducing"),
        "compute_grad_norm": ((True,), "zerocore always computes the global gradient norm"),
        "load_from_fp32_weights": ((True,), "zerocore's checkpoints restore the fp32 master"),
        "stage3_model_persistence_threshold": (ANY, "a DeepSpeed performance knob"),
        "model_persistence_threshold": (ANY, "a DeepSpeed performance knob"),
        "stage3_module_granularity_threshold": (ANY, "a DeepSpeed performance knob (zerocore: "
                                                     "stage3_unit_min_params)"),
        "stage3_use_all_reduce_for_fetch_params": (ANY, "a DeepSpeed performance knob"),
        "stage3_allgather_sequential": (ANY, "a DeepSpeed performance knob"),
        "parameter_alignment": (ANY, "a DeepSpeed memory-layout knob"),
        "pipeline_loading_checkpoint": (ANY, "a DeepSpeed loading knob"),
        "override_module_apply": (ANY, "zerocore.init lets module.apply run on the module being built"),
        "save_muon_momentum_buffer_in_memory": (ANY, "a DeepSpeed Muon knob"),
        "zenflow": ((None,), "ZenFlow (stale CPU updates) is not implemented"),
    },
    "zero_optimization.offload_optimizer": {
        "cpuadam_cores_perc": (ANY, "a DeepSpeed performance knob"),
    },
    "bf16": {
        "immediate_grad_update": (ANY, "a DeepSpeed performance knob"),
        "bf16_master_weights_and_grads": ((False,), "zerocore keeps an fp32 master"),
        "bf16_optimizer_states": ((False,), "zerocore keeps the optimizer state in fp32"),
    },
    "fp16": {
        "auto_cast": ((False,), "zerocore does not cast inputs: feed them in the training dtype"),
        "fp16_master_weights_and_grads": ((False,), "zerocore keeps an fp32 master"),
    },
    "checkpoint": {
        "load_universal": (ANY, "zerocore's checkpoints load at any world size and stage without conversion "
                                "(zerocore.deepspeed.initialize's engines load another world size's optimizer "
                                "state only with true, and then a load without a tag reads latest_universal, as "
                                "DeepSpeed; deepspeed.checkpoint.ds_to_universal makes the universal folder)"),
        "use_node_local_storage": (ANY, "a DeepSpeed storage knob (zerocore: every rank writes its own file)"),
        "parallel_write": (ANY, "a DeepSpeed pipeline-parallel storage knob"),
        "writer": (ANY, "DeepSpeed's checkpoint-engine writer settings (zerocore writes with its own aio engine)"),
    },
    "optimizer.params": {
        "bias_correction": ((True,), "zerocore's Adam always corrects bias"),
        "amsgrad": ((False,), "zerocore's Adam has no AMSGrad"),
        "torch_adam": (ANY, "zerocore always runs its own fused Adam"),
    },
}

LOGGING = "logging, monitoring or profiling of DeepSpeed: no effect on what training computes"

# top-level keys of DeepSpeed's config that zerocore has no field for: (values honoured, why)
TOP_LEVEL: dict[str, tuple] = {
    **{k: (ANY, LOGGING) for k in ("steps_per_print", "wall_clock_breakdown", "memory_breakdown", "tensorboard",
                                   "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger", "timers",
                                   "dump_state", "log_level", "autotuning")},
    "activation_checkpointing": (ANY, "settings of deepspeed.checkpointing (zerocore.deepspeed.checkpointing): "
                                      "partitioning or offloading checkpointed activations saves memory and "
                                      "changes no value; zerocore recomputes them with torch.utils.checkpoint"),
    "zero_force_ds_cpu_optimizer": (ANY, "a DeepSpeed check on client optimizers under offload (applied by "
                                         "zerocore.deepspeed.initialize)"),
    "optimizer_legacy_fusion": (ANY, "a DeepSpeed performance knob"),
    "disable_python_gc": (ANY, "a DeepSpeed performance knob"),
    "disable_allgather": ((False,), "zerocore refreshes parameters with all-gather"),
    "prescale_gradients": ((False,), "zerocore divides by the world size after reducing"),
    "gradient_predivide_factor": ((1, 1.0), "zerocore divides by the world size after reducing"),
    "sparse_gradients": ((False,), "zerocore reduces dense gradients"),
    "fp32_allreduce": ((False,), "zerocore reduces in the training dtype; for fp32 sums set "
                                 "zero_optimization.reduce_dtype to \"fp32\""),
    "communication_data_type": ((None,), "zerocore reduces in the training dtype; for fp32 sums set "
                                         "zero_optimization.reduce_dtype to \"fp32\""),
}
DTYPES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16",
          "bfloat16": "bf16"}

_SCHEMA_TOP = tuple(f.name for f in dataclasses.fields(ZeroConfig))


def translate(data: dict) -> Translation:
    """``data`` with DeepSpeed's other and deprecated spellings written as zerocore's keys and its
    keys without a zerocore field dropped where they change nothing (an error where they would)."""
    deprecated: list[str] = []
    for path, names in ALIASES.items():
        data = rename_at(data, path, names, DEPRECATED.get(path), deprecated)
    z = section_at(data, "zero_optimization")
    if z is not None:
        data = with_section(data, "zero_optimization", _offload_booleans(z, "zero_optimization", deprecated))
    _check_data_types(data.get("data_types"), data)  # grad_accum_dtype depends on other sections: first
    data = drop_accepted(data, ACCEPTED)
    if type(data.get("zero_allow_untested_optimizer")) is int and data["zero_allow_untested_optimizer"] in (0, 1):
        # DeepSpeed reads this flag for its truth value; scripts write 1 (zerocore: no effect either way)
        data = {**data, "zero_allow_untested_optimizer": bool(data["zero_allow_untested_optimizer"])}
    data, ignored = _top_level(data)
    return Translation(data, deprecated=tuple(deprecated), ignored=tuple(ignored))


def _offload_booleans(z: dict, path: str, deprecated: list[str]) -> dict:
    z = dict(z)
    for old, sec in OFFLOAD_BOOLEANS.items():
        if old in z:
            value = z.pop(old)
            if not isinstance(value, bool):
                raise ConfigError(f"{path}.{old}: got {value!r}; allowed: true or false")
            deprecated.append(f"{path}.{old} (use {path}.{sec}.device)")
            if z.get(sec) is not None and not isinstance(z[sec], dict):
                continue  # the parser names the section of the wrong type
            target = dict(z.get(sec) or {})  # null: DeepSpeed's "no offload section"
            target.setdefault("device", "cpu" if value else "none")  # the section's own device wins
            z[sec] = target
    if PIN_MEMORY in z:
        value = z.pop(PIN_MEMORY)
        deprecated.append(f"{path}.{PIN_MEMORY} (use {path}.offload_*.pin_memory)")
        for sec in OFFLOAD_BOOLEANS.values():
            if isinstance(z.get(sec), dict):  # null or absent: no offload, nothing to pin
                z[sec] = {**z[sec], "pin_memory": z[sec].get("pin_memory", value)}
    return z


def _top_level(data: dict) -> tuple[dict, list[str]]:
    kept, ignored = {}, []
    for key, value in data.items():
        if key in _SCHEMA_TOP:
            kept[key] = value
            continue
        _check_top_level(key, value)
        ignored.append(key)
    return kept, ignored


def training_dtype(data: dict) -> str:
    """"bf16", "fp16" or "fp32": what the (translated) config trains in."""
    for key in ("bf16", "fp16"):
        section = data.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            return key
    return "fp32"


def _check_data_types(value, data: dict) -> None:
    """``data_types.grad_accum_dtype`` of DeepSpeed's config, accepted where it asks for what DeepSpeed
    and zerocore both do (see ACCEPTED); the section's other keys are the schema's (DataTypesConfig)."""
    if not isinstance(value, dict):
        return  # null is the defaults; another type is the schema's error
    _check_param_dtype(value.get("param_dtype"), data)
    accum = value.get("grad_accum_dtype")
    if accum is None:
        return
    if accum not in DTYPES:
        raise ConfigError(f"data_types.grad_accum_dtype: got {accum!r}; allowed: null, \"fp32\", \"fp16\", \"bf16\"")
    accum, train = DTYPES[accum], training_dtype(data)
    if accum == train:
        return
    z = data.get("zero_optimization")
    stage = z.get("stage", 0) if isinstance(z, dict) else 0
    if stage >= 1:  # honoured where DeepSpeed honours it (runtime/model_setup.accumulation_dtype), else its training
        return      # dtype, as DeepSpeed's ZeRO optimizer accumulates
    raise ConfigError(f"data_types.grad_accum_dtype: {value.get('grad_accum_dtype')!r} with {train} training at "
                      f"ZeRO stage {stage}: zerocore cannot honour it (without ZeRO, DeepSpeed refuses this mix too); "
                      f"use null or {train!r}")


def _check_param_dtype(param, data: dict) -> None:
    """``data_types.param_dtype`` (DeepSpeed 0.19.8, FSDP's MixedPrecisionPolicy name): null, or the training
    dtype in any of DeepSpeed's spellings; DeepSpeed's engine asserts that (_assert_valid_mixed_precision_config)
    and zerocore refuses the same configs, naming the key."""
    if param is None:
        return
    if not isinstance(param, str) or param not in DTYPE_SPELLINGS:
        raise ConfigError(f"data_types.param_dtype: got {param!r}; allowed: null or one of "
                          f"{', '.join(repr(k) for k in DTYPE_SPELLINGS)} (the training dtype)")
    train = training_dtype(data)
    if DTYPE_SPELLINGS[param] != train:
        raise ConfigError(f"data_types.param_dtype: {param!r} conflicts with the training dtype ({train}, from the "
                          "fp16/bf16 'enabled' flags); set the matching flag or leave param_dtype out (DeepSpeed "
                          "refuses this too)")


def _check_top_level(key: str, value) -> None:
    """Accepts an unknown top-level ``key`` that does not change what training computes (the
    caller names it in a warning); raises ConfigError naming it otherwise."""
    entry = TOP_LEVEL.get(key)
    if entry is None:
        if isinstance(value, dict) and "enabled" in value and value["enabled"] is False:
            return  # a feature section switched off asks for nothing
        near = difflib.get_close_matches(key, _SCHEMA_TOP, n=1, cutoff=0.8)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"{key}: zerocore does not implement this DeepSpeed setting and it would change what "
                          f"training computes{hint}; remove the key (or set \"enabled\": false in its section)")
    allowed, why = entry
    if allowed is not ANY and not matches(value, allowed):
        raise refusal(key, value, allowed, why)
