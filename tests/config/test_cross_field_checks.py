"""Every check that involves more than one key is a schema section's check: it raises when the
config is read (and when a ZeroConfig is built or validated in Python), naming the keys, before
any model or process group is touched. What only the machine can tell (an nvme_path's
existence) is checked at zerocore.initialize."""
from __future__ import annotations

import warnings

import pytest
import torch.nn as nn

import zerocore
from zerocore.config import (ConfigError, ConfigWarning, FP16Config, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig,
                             ZeroOptimizationConfig, load_config)

CROSS_FIELD = [
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     ["zero_optimization.offload_optimizer.device", "needs stage 1, 2 or 3", "got stage 0"]),
    ({"zero_optimization": {"stage": 0, "cpu_offload": True}},  # DeepSpeed's deprecated spelling, same check
     ["zero_optimization.offload_optimizer.device", "needs stage 1, 2 or 3"]),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     ["zero_optimization.offload_param.device", "needs stage 3", "got stage 2"]),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "ratio": 0.5}}},
     ["zero_optimization.offload_optimizer.ratio: 0.5 with device 'nvme'"]),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     ["zero_optimization.offload_optimizer.nvme_path: required when device is 'nvme'"]),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     ["zero_optimization.offload_param.nvme_path: required when device is 'nvme'"]),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, ["fp16.enabled and bf16.enabled", "at most one"]),
    ({"fp16": {"enabled": True, "initial_scale_power": 2, "min_loss_scale": 8}},
     ["fp16.min_loss_scale: got 8", "fp16.initial_scale_power"]),
    ({"scheduler": {"params": {"warmup_num_steps": 5}}}, ["scheduler.params: given without scheduler.type"]),
]


@pytest.mark.parametrize("cfg,named", CROSS_FIELD)
def test_cross_field_checks_raise_when_the_config_is_read(cfg, named):
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    for text in named:
        assert text in str(e.value), (cfg, str(e.value))


def test_cross_field_checks_run_on_python_construction_and_validation():
    with pytest.raises(ConfigError, match="offload_optimizer.device: 'cpu' needs stage 1, 2 or 3"):
        ZeroOptimizationConfig(stage=0, offload_optimizer=OffloadOptimizerConfig(device="cpu"))
    with pytest.raises(ConfigError, match="offload_optimizer.ratio: 0.25 with device 'nvme'"):
        OffloadOptimizerConfig(device="nvme", nvme_path="/x", ratio=0.25)
    with pytest.raises(ConfigError, match="offload_param.device: 'cpu' needs stage 3"):
        ZeroOptimizationConfig(stage=1, offload_param=OffloadParamConfig(device="cpu"))
    with pytest.raises(ConfigError, match="fp16.min_loss_scale"):
        FP16Config(enabled=True, initial_scale_power=0, min_loss_scale=4.0)
    cfg = ZeroConfig(zero_optimization=ZeroOptimizationConfig(stage=1, offload_optimizer=OffloadOptimizerConfig(
        device="cpu")))
    cfg.zero_optimization.stage = 0  # assigned after construction: caught when validated again
    with pytest.raises(ConfigError, match="offload_optimizer.device: 'cpu' needs stage 1, 2 or 3"):
        load_config(cfg)


def test_the_accepted_combinations_still_load():
    for cfg in ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
                {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"},
                                       "offload_param": {"device": "nvme", "nvme_path": "/x"}}},
                {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "none", "ratio": 0.5}}},
                {"fp16": {"enabled": False, "initial_scale_power": 2, "min_loss_scale": 8}}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigWarning)  # ratio without offload: named as having no effect
            load_config(cfg)


def test_the_machine_facts_of_a_parameter_nvme_path_are_checked_at_initialize(tmp_path):
    missing = tmp_path / "missing"
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(missing)}}}
    load_config(cfg)  # the config itself is fine: the path is this machine's fact
    with pytest.raises(ConfigError, match=f"zero_optimization.offload_param.nvme_path: '{missing}' does not exist"):
        zerocore.initialize(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), cfg)
