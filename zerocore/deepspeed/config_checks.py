"""Rules of DeepSpeed's that zerocore's own config does not need, checked by the face so that a
DeepSpeed script meets the same refusals, with DeepSpeed's exception types (its tests and scripts
catch them):

- ``zero_optimization.allgather_bucket_size`` must be even at stages 1 and 2 (DeepSpeed aligns
  its all-gather buckets to NCCL's 2-element start alignment and asserts; zerocore's bucket is only
  a cap, any size works);
- without ZeRO (stage 0) ``data_types.grad_accum_dtype`` other than the training dtype is a
  NotImplementedError, as DeepSpeed's ``unsupported mix`` (zerocore's config refuses it too, with
  a ConfigError; this error is both).
"""
from __future__ import annotations

from ..config import ConfigError
from ..config.compat.deepspeed import DTYPES, training_dtype


class DeepSpeedAssertion(ConfigError, AssertionError):
    """A config DeepSpeed refuses with an assert."""


class UnsupportedMix(ConfigError, NotImplementedError):
    """A dtype mix DeepSpeed refuses with NotImplementedError."""


def check_deepspeed_rules(raw: dict | None) -> None:
    """``raw``: the config as the user wrote it (None: a ZeroConfig object, nothing to check)."""
    if raw is None:
        return
    z = raw.get("zero_optimization")
    stage = z.get("stage", 0) if isinstance(z, dict) else 0
    size = z.get("allgather_bucket_size") if isinstance(z, dict) else None
    if stage in (1, 2) and isinstance(size, int) and size % 2:
        raise DeepSpeedAssertion(f"zero_optimization.allgather_bucket_size: got {size}; DeepSpeed requires a multiple "
                                 "of 2 at stages 1 and 2 (allgather_bucket_size must be a multiple of "
                                 "nccl_start_alignment_factor, 2)")
    accum = (raw.get("data_types") or {}).get("grad_accum_dtype") if isinstance(raw.get("data_types"), dict) else None
    if stage == 0 and accum in DTYPES:
        train = training_dtype({("bf16" if k == "bfloat16" else k): v for k, v in raw.items()})
        if DTYPES[accum] != train:
            raise UnsupportedMix(f"data_types.grad_accum_dtype: {accum!r} with {train} training without ZeRO: an "
                                 f"unsupported mix of model dtype {train} and gradient accumulation dtype {accum}, as "
                                 "in DeepSpeed; use null or the training dtype")
