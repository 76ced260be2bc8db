"""``deepspeed.runtime.precision_config``: a config's ``fp16`` / ``bf16`` sections as DeepSpeed's config objects
(``get_float16_config(param_dict).enabled``, ``get_bfloat16_config(...)``). The keys zerocore has are validated by
its schema (a bad value is pydantic's ``ValidationError``, as DeepSpeed's, with zerocore's message naming the key);
DeepSpeed's keys zerocore has no field for are read as given, else DeepSpeed's default. ``bfloat16`` is
DeepSpeed's older name of the ``bf16`` section."""
from __future__ import annotations

import dataclasses

from ...config import load_config
from .section_errors import validation_errors

BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"
FP16 = "fp16"


class _PrecisionSection:
    SECTION = ""
    DEEPSPEED_ONLY: dict = {}  # DeepSpeed's keys without a zerocore field: their DeepSpeed defaults

    def __init__(self, **section):
        ours = {k: v for k, v in section.items() if k not in self.DEEPSPEED_ONLY}
        with validation_errors(type(self).__name__, section):
            parsed = getattr(load_config({self.SECTION: ours}), self.SECTION)
        for f in dataclasses.fields(parsed):
            setattr(self, f.name, getattr(parsed, f.name))
        for key, default in self.DEEPSPEED_ONLY.items():
            setattr(self, key, section.get(key, default))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class DeepSpeedBF16Config(_PrecisionSection):
    SECTION = "bf16"
    DEEPSPEED_ONLY = {"immediate_grad_update": False, "bf16_master_weights_and_grads": False,
                      "bf16_optimizer_states": False}


class DeepSpeedFP16Config(_PrecisionSection):
    SECTION = "fp16"
    DEEPSPEED_ONLY = {"auto_cast": False, "fp16_master_weights_and_grads": False}


def get_bfloat16_config(param_dict: dict) -> DeepSpeedBF16Config:
    section = param_dict.get(BFLOAT16)
    if section is None:
        section = param_dict.get(BFLOAT16_OLD, {})
    return DeepSpeedBF16Config(**section)


def get_float16_config(param_dict: dict) -> DeepSpeedFP16Config:
    return DeepSpeedFP16Config(**param_dict.get(FP16, {}))
