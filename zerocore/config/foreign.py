"""Keys of DeepSpeed's (and ColossalAI's) sections that zerocore has no field for.

Inside a section zerocore knows, an unknown key is an error (a key we cannot honour must not
be dropped): it names the key, says what is allowed and suggests the nearest known spelling.
The exceptions are listed here: keys whose value, as given, asks for what zerocore does anyway
(accepted silently) and that are an error with any other value, naming why.

At the top level, a DeepSpeed ``ds_config.json`` also carries settings of other subsystems.
Those that do not change what training computes (logging, monitoring, profiling, timers,
activation-checkpointing memory knobs) are accepted and named in one warning; those that do
(another parallelism, compression, data sampling...) are an error naming the key, unless the
section is switched off (``{"enabled": false}``) or has the value that asks for what zerocore
does anyway (``TOP_LEVEL`` below).
"""
from __future__ import annotations

import difflib

from .options import ConfigError

ANY = object()  # every value is harmless (a performance or logging knob of the other library)

# section path -> key -> (values zerocore honours, what zerocore does)
FOREIGN: dict[str, dict[str, tuple]] = {
    "zero_optimization": {
        "ignore_unused_parameters": ((True,), "zerocore always trains models with unused parameters (their "
                                              "gradient is zero)"),
        "elastic_checkpoint": ((False,), "zerocore has no elastic checkpoints"),
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
        "partition_grads": ((True,), "ColossalAI's Level_2 always partitions gradients; for whole gradients "
                                     "use stage 1"),
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
        "enable_sanity_checks": (ANY, "a DeepSpeed debugging knob"),
        "save_muon_momentum_buffer_in_memory": (ANY, "a DeepSpeed Muon knob"),
        "zenflow": ((None,), "ZenFlow (stale CPU updates) is not implemented"),
    },
    "zero_optimization.offload_optimizer": {
        "super_offload": ((False,), "SuperOffload is not implemented"),
        "cpuadam_cores_perc": (ANY, "a DeepSpeed performance knob"),
    },
    "bf16": {
        "immediate_grad_update": (ANY, "a DeepSpeed performance knob"),
        "check_grad_overflow": ((True,), "zerocore always skips a step whose gradients hold Inf/NaN"),
        "bf16_master_weights_and_grads": ((False,), "zerocore keeps an fp32 master"),
        "bf16_optimizer_states": ((False,), "zerocore keeps the optimizer state in fp32"),
    },
    "fp16": {
        "auto_cast": ((False,), "zerocore does not cast inputs: feed them in the training dtype"),
        "fp16_master_weights_and_grads": ((False,), "zerocore keeps an fp32 master"),
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
    "zero_force_ds_cpu_optimizer": (ANY, "a DeepSpeed check on client optimizers under offload"),
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
    "managed_gradient_accumulation": ((True,), "zerocore counts micro-batches itself (or follows "
                                               "engine.set_gradient_accumulation_boundary)"),
    "checkpoint": (ANY, "DeepSpeed's checkpoint-engine settings (tag validation, storage): zerocore's "
                        "checkpoints are verified and reshardable on their own"),
}


def check_top_level(key: str, value) -> None:
    """Accepts an unknown top-level ``key`` that does not change what training computes (the caller
    names it in a warning); raises ConfigError naming it otherwise."""
    entry = TOP_LEVEL.get(key)
    if entry is None:
        if isinstance(value, dict) and "enabled" in value and value["enabled"] is False:
            return  # a feature section switched off asks for nothing
        raise ConfigError(f"{key}: zerocore does not implement this DeepSpeed setting and it would change what "
                          "training computes; remove the key (or set \"enabled\": false in its section)")
    allowed, why = entry
    if allowed is ANY or _matches(value, allowed):
        return
    raise ConfigError(f"{key}: got {value!r}; zerocore cannot honour it ({why}); allowed: "
                      f"{' or '.join(repr(a) for a in allowed)}, or remove the key")


def _matches(value, allowed) -> bool:
    return any(value == a and type(value) is type(a) or
               (isinstance(a, float) and not isinstance(value, bool) and value == a) for a in allowed)


def check_unknown(path: str, key: str, value, known: list[str]) -> None:
    """Accepts ``key`` of section ``path`` when FOREIGN lists it with this value; raises
    ConfigError otherwise."""
    full = f"{path}.{key}"
    entry = FOREIGN.get(path, {}).get(key)
    if entry is not None:
        allowed, why = entry
        if allowed is ANY or _matches(value, allowed):
            return
        raise ConfigError(f"{full}: got {value!r}; zerocore cannot honour it ({why}); allowed: "
                          f"{' or '.join(repr(a) for a in allowed)}, or remove the key")
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ConfigError(f"{full}: unknown key{hint}; {path} has: {', '.join(known)}")
