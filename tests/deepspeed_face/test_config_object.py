"""``deepspeed.runtime.config.DeepSpeedConfig``, ``precision_config`` and ``config_utils.DeepSpeedConfigModel`` in
the face: DeepSpeed's object beside the face's on the same configs (config_object_script.py: the batch sizes as
resolved for worlds of 1 and 2, the ZeRO, precision, optimizer and scheduler values, defaults included, and which
configs DeepSpeed's assertions refuse), then what only the face's side shows (files, duplicate keys, base64, a
bad value named)."""
from __future__ import annotations

import base64
import json
import os

import pytest

from zerocore.config import ConfigError, load_config
from zerocore.deepspeed.runtime.config import DeepSpeedConfig
from zerocore.deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

from .runner import run_one_rank

SCRIPT = os.path.join(os.path.dirname(__file__), "config_object_script.py")
PRECISION_SCRIPT = os.path.join(os.path.dirname(__file__), "precision_section_script.py")


def test_the_same_values_as_deepspeeds_config_object(tmp_path):
    pytest.importorskip("deepspeed", reason="comparing with DeepSpeed needs it installed (pip install deepspeed)")
    theirs = run_one_rank(SCRIPT, "deepspeed", str(tmp_path / "ds.pt"))
    ours = run_one_rank(SCRIPT, "zerocore", str(tmp_path / "zc.pt"))
    assert len(ours) == len(theirs) == 19
    assert sum("error" in t for t in theirs) == 6  # the refused cases stay refused cases
    for i, (got, want) in enumerate(zip(ours, theirs)):
        differ = [k for k in sorted(set(got) | set(want)) if got.get(k) != want.get(k)]
        assert got == want, f"case {i}: " + ", ".join(f"{k}: {got.get(k)!r} vs DeepSpeed's {want.get(k)!r}"
                                                      for k in differ)


def test_fp16_section_objects_accept_and_refuse_as_deepspeeds(tmp_path):
    """DeepSpeed's ``DeepSpeedFP16Config`` beside the face's on 45 sections: the same values, the same refusals,
    each a pydantic ``ValidationError`` (the face's is zerocore's ``ConfigError`` too)."""
    pytest.importorskip("deepspeed", reason="comparing with DeepSpeed needs it installed (pip install deepspeed)")
    pytest.importorskip("pydantic", reason="DeepSpeed's section objects are pydantic models")
    theirs = run_one_rank(PRECISION_SCRIPT, "deepspeed", str(tmp_path / "ds.pt"))
    ours = run_one_rank(PRECISION_SCRIPT, "zerocore", str(tmp_path / "zc.pt"))
    assert len(ours) == len(theirs) == 45
    assert sum("refused" in t for t in theirs) == 25
    for i, (got, want) in enumerate(zip(ours, theirs)):
        assert got == want, f"case {i}: {got} vs DeepSpeed's {want}"


def test_fp16_section_errors_are_configerrors_too():
    pydantic = pytest.importorskip("pydantic", reason="the face raises pydantic's error where pydantic is installed")
    from zerocore.deepspeed.runtime.precision_config import DeepSpeedFP16Config

    with pytest.raises(ConfigError, match="fp16.loss_scale_window: got 0") as info:
        DeepSpeedFP16Config(enabled=True, loss_scale=0, loss_scale_window=0)
    assert isinstance(info.value, pydantic.ValidationError) and info.value.errors()[0]["loc"] == ("loss_scale_window",)
    # zerocore's own loader: the window and floor are checked where the dynamic scale reads them
    static = {"fp16": {"enabled": True, "loss_scale": 64, "loss_scale_window": 0}}
    assert load_config(static).fp16.loss_scale_window == 0
    with pytest.raises(ConfigError, match="fp16.min_loss_scale: got 0; allowed: a number > 0 with the dynamic"):
        load_config({"fp16": {"enabled": True, "min_loss_scale": 0}})


def test_files_json_hjson_base64_and_a_key_given_twice(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "gradient_accumulation_steps": 2}))
    cfg = DeepSpeedConfig(str(path))
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 4, 2)
    encoded = base64.urlsafe_b64encode(path.read_bytes()).decode()
    assert DeepSpeedConfig(encoded).train_micro_batch_size_per_gpu == 4
    with pytest.raises(ValueError, match="existing deepspeed config"):
        DeepSpeedConfig(str(tmp_path / "missing.json"))
    twice = tmp_path / "twice.json"
    twice.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}')
    for read in (DeepSpeedConfig, load_config):  # the engine's loader refuses it too: json would keep the last
        with pytest.raises(ConfigError, match="'stage' is given twice"):
            read(str(twice))
    pytest.importorskip("hjson", reason="HJSON files need hjson (DeepSpeed depends on it)")
    hj = tmp_path / "ds.hjson"
    hj.write_text('{\n  // comment\n  train_batch_size: 16,\n  train_batch_size: 16,\n}')
    with pytest.raises(ConfigError, match="'train_batch_size' is given twice"):
        DeepSpeedConfig(str(hj))
    hj.write_text('{\n  // comment\n  train_batch_size: 16,\n}')
    assert DeepSpeedConfig(str(hj)).train_micro_batch_size_per_gpu == 16


def test_bad_values_are_named_and_the_users_dict_is_kept():
    with pytest.raises(ConfigError, match="stage"):
        DeepSpeedConfig({"train_batch_size": 2, "zero_optimization": {"stage": 7}})
    with pytest.raises(ConfigError, match="loss_scale"):
        get_float16_config({"fp16": {"enabled": True, "loss_scale": -1}})
    with pytest.raises(ConfigError, match=r"fp16.loss_scale must be a number: got \[\] \(a list\)"):
        get_float16_config({"fp16": {"enabled": True, "loss_scale": []}})  # DeepSpeed's words, zerocore's key
    assert get_float16_config({"fp16": {"enabled": True, "loss_scale": "3"}}).loss_scale == 3.0
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled  # DeepSpeed's older section name
    given = {"train_micro_batch_size_per_gpu": 2}
    DeepSpeedConfig(given)
    assert given == {"train_micro_batch_size_per_gpu": 2}  # resolved on the object, not in the dict
    with pytest.raises(ConfigError, match="elasticity: DeepSpeed 0.19.8 removed"):
        DeepSpeedConfig({"train_batch_size": 2, "elasticity": {"enabled": True}})


def test_config_model_rules():
    pydantic = pytest.importorskip("pydantic", reason="DeepSpeedConfigModel is a pydantic model")
    from typing import List, Optional

    from zerocore.deepspeed.runtime.config_utils import DeepSpeedConfigModel

    class Section(DeepSpeedConfigModel):
        size: int = 3
        old_names: Optional[str] = pydantic.Field(None, json_schema_extra={
            "deprecated": True, "new_param": "names", "new_param_fn": lambda v: [v]})
        names: Optional[List[str]] = None
        depth: int = pydantic.Field(0, alias="depth_alias")

    assert Section(size="auto").size == 3  # the Trainer's placeholder: the default
    with pytest.raises(pydantic.ValidationError):
        Section(strict=True, size="auto")
    assert Section(old_names="a").names == ["a"]
    with pytest.raises(AssertionError, match="together"):
        Section(old_names="a", names=["b"])
    assert Section(depth=2).depth == Section(depth_alias=2).depth == 2
    for bad in ({"size": "x"}, {"sise": 1}):
        with pytest.raises(pydantic.ValidationError):
            Section(**bad)
    s = Section()
    with pytest.raises(pydantic.ValidationError):
        s.size = "many"  # assignments are validated


def test_initialize_without_a_model_is_deepspeeds_assertion_and_a_value_error():
    import zerocore.deepspeed as deepspeed

    for kind in (AssertionError, ValueError):
        with pytest.raises(kind, match="requires a model"):
            deepspeed.initialize(model=None, config={"train_batch_size": 1})
