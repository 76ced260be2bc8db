"""DeepSpeed's ``data_types.buffer_dtype`` and ``data_types.keep_in_fp32_modules``: every spelling
DeepSpeed 0.19.8 accepts is accepted, and what it refuses is a ConfigError naming the key."""
from __future__ import annotations

import warnings

import pytest

from zerocore.config import load_config
from zerocore.config.options import ConfigError


def _load(data_types):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config({"bf16": {"enabled": True}, "data_types": data_types})


def test_defaults_are_deepspeeds():
    cfg = _load({})
    assert cfg.data_types.buffer_dtype is None and cfg.data_types.keep_in_fp32_modules == "auto"
    assert load_config({}).data_types.buffer_dtype is None


@pytest.mark.parametrize("spelling, canonical", [
    ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"), ("torch.float16", "fp16"),
    ("fp32", "fp32"), ("float32", "fp32"), ("float", "fp32"), ("torch.float32", "fp32"),
    ("bf16", "bf16"), ("bfloat16", "bf16"), ("torch.bfloat16", "bf16"), (None, None), ("keep", "keep")])
def test_buffer_dtype_spellings(spelling, canonical):
    assert _load({"buffer_dtype": spelling}).data_types.buffer_dtype == canonical


@pytest.mark.parametrize("value", ["int8", "fp8", "auto", 16, True])
def test_buffer_dtype_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"^data_types\.buffer_dtype: got"):
        _load({"buffer_dtype": value})


@pytest.mark.parametrize("value", ["auto", [], ["inv_freq"], ["rotary*", "e_score_correction_bias"]])
def test_keep_in_fp32_modules_accepted(value):
    assert _load({"keep_in_fp32_modules": value}).data_types.keep_in_fp32_modules == value


@pytest.mark.parametrize("value", [None, "none", "inv_freq", [1], ["a", None], {"a": 1}, True])
def test_keep_in_fp32_modules_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"^data_types\.keep_in_fp32_modules: got"):
        _load({"keep_in_fp32_modules": value})


def test_grad_accum_dtype_beside_the_new_keys():
    # stage 2: bf16 with grad_accum_dtype fp32 is refused at stage 0 (as DeepSpeed refuses it)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
                           "data_types": {"grad_accum_dtype": "fp32", "buffer_dtype": "fp32",
                                          "keep_in_fp32_modules": []}})
    assert cfg.data_types.buffer_dtype == "fp32" and cfg.data_types.keep_in_fp32_modules == []
    with pytest.raises(ConfigError, match=r"data_types\.other: unknown key"):
        _load({"other": 1})
