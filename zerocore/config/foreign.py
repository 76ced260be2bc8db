"""Keys of DeepSpeed's (and ColossalAI's) sections that zerocore has no field for.

Inside a section zerocore knows, an unknown key is an error (a key we cannot honour must not
be dropped): it names the key, says what is allowed and suggests the nearest known spelling.
The exceptions are listed here: keys whose value, as given, asks for what zerocore does anyway
(accepted silently) and that are an error with any other value, naming why.

Unknown *top-level* keys stay a warning: a DeepSpeed ``ds_config.json`` carries settings of
other subsystems there (``steps_per_print``, ``wall_clock_breakdown``, ``tensorboard``,
``flops_profiler``, ``activation_checkpointing``...) that do not change what training computes,
and an existing file must load.
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


def check_unknown(path: str, key: str, value, known: list[str]) -> None:
    """Accepts ``key`` of section ``path`` when FOREIGN lists it with this value; raises
    ConfigError otherwise."""
    full = f"{path}.{key}"
    entry = FOREIGN.get(path, {}).get(key)
    if entry is not None:
        allowed, why = entry
        if allowed is ANY or any(value == a and type(value) is type(a) or
                                 (isinstance(a, float) and not isinstance(value, bool) and value == a)
                                 for a in allowed):
            return
        raise ConfigError(f"{full}: got {value!r}; zerocore cannot honour it ({why}); allowed: "
                          f"{' or '.join(repr(a) for a in allowed)}, or remove the key")
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ConfigError(f"{full}: unknown key{hint}; {path} has: {', '.join(known)}")
