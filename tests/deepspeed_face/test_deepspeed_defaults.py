"""zerocore's config defaults are DeepSpeed's: the table in zerocore/config/deepspeed_defaults.py
(rendered into docs/config.md) is read against the installed DeepSpeed, and every schema default
equals it except the listed, explained differences."""
from __future__ import annotations

import inspect
import os

import pytest

from zerocore.config.deepspeed_defaults import DEEPSPEED_DEFAULTS, DIFFERS, ONLY_ZEROCORE
from zerocore.config.options import walk
from zerocore.config.schema import ZeroConfig

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def test_every_schema_key_has_deepspeeds_default_or_a_reason():
    for key, _, _, default in walk(ZeroConfig):
        assert key in DEEPSPEED_DEFAULTS, f"{key}: no DeepSpeed default listed"
        ds = DEEPSPEED_DEFAULTS[key]
        if ds is ONLY_ZEROCORE or key in DIFFERS:
            continue
        assert default == ds, f"{key}: zerocore {default!r}, DeepSpeed {ds!r}"


def _installed() -> dict:
    pytest.importorskip("deepspeed", reason="reading DeepSpeed's defaults needs it installed")
    from deepspeed.ops.adam import FusedAdam
    from deepspeed.runtime import constants as c
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.swap_tensor import constants as aio
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)

    out = {"gradient_clipping": c.GRADIENT_CLIPPING_DEFAULT, "dataloader_drop_last": c.DATALOADER_DROP_LAST_DEFAULT,
           "zero_allow_untested_optimizer": c.ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT,
           "aio.block_size": aio.AIO_BLOCK_SIZE_DEFAULT, "aio.queue_depth": aio.AIO_QUEUE_DEPTH_DEFAULT,
           "aio.intra_op_parallelism": aio.AIO_INTRA_OP_PARALLELISM_DEFAULT,
           "aio.single_submit": aio.AIO_SINGLE_SUBMIT_DEFAULT, "aio.overlap_events": aio.AIO_OVERLAP_EVENTS_DEFAULT,
           "checkpoint.tag_validation": str(c.CHECKPOINT_TAG_VALIDATION_DEFAULT),
           "data_types.buffer_dtype": c.BUFFER_DTYPE_DEFAULT,
           "data_types.keep_in_fp32_modules": c.KEEP_IN_FP32_MODULES_DEFAULT}
    sig = inspect.signature(FusedAdam).parameters
    out.update({"optimizer.params.lr": sig["lr"].default, "optimizer.params.betas": list(sig["betas"].default),
                "optimizer.params.eps": sig["eps"].default, "optimizer.params.weight_decay": sig["weight_decay"].default,
                "optimizer.params.adam_w_mode": sig["adam_w_mode"].default})
    sections = [("fp16.", DeepSpeedFP16Config), ("bf16.", DeepSpeedBF16Config),
                ("zero_optimization.", DeepSpeedZeroConfig),
                ("zero_optimization.offload_optimizer.", DeepSpeedZeroOffloadOptimizerConfig),
                ("zero_optimization.offload_param.", DeepSpeedZeroOffloadParamConfig)]
    try:  # DeepSpeed 0.18 and later
        from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig
        sections.append(("zero_optimization.leaf_module.", DeepSpeedZeroLeafModuleConfig))
    except ImportError:
        pass
    for prefix, cls in sections:
        for name, f in cls.model_fields.items():
            # (a list's default is a factory: its value is what DeepSpeed starts from)
            out[prefix + (f.alias or name)] = f.get_default(call_default_factory=True)
    return out


def test_the_listed_defaults_are_the_installed_deepspeeds():
    installed = _installed()
    checked = 0
    for key, ds in DEEPSPEED_DEFAULTS.items():
        if ds is ONLY_ZEROCORE or key not in installed:
            continue
        assert installed[key] == ds, f"{key}: listed {ds!r}, DeepSpeed has {installed[key]!r}"
        checked += 1
    assert checked >= 45  # nearly every key is read from DeepSpeed itself, not assumed
