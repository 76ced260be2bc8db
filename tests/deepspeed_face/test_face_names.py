"""The names DeepSpeed's scripts and tests import beside initialize (issue 34): op builders and
``__compatible_ops__``, config constants and exception types, ``DeepSpeedZeroConfig``, the logger,
checkpoint and MoE helpers, ``see_memory_usage``, torch version checks (the tensor-fragment functions:
test_tensor_fragments.py)."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zerocore
import zerocore.deepspeed as deepspeed
from zerocore.config import ConfigError


def _cfg(stage=1, **extra):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **extra}


def test_op_builders_say_which_ops_the_face_offers():
    from zerocore.deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, FusedLambBuilder

    ops = deepspeed.ops.__compatible_ops__
    assert ops[CPUAdamBuilder.NAME] is True and ops[FusedAdamBuilder.NAME] is True  # zerocore's Adam kernels
    assert ops[FusedLambBuilder.NAME] is False and not FusedLambBuilder().is_compatible()
    assert CPUAdamBuilder().absolute_name() == "deepspeed.ops.cpu_adam_op"
    with pytest.raises(NotImplementedError, match="zerocore.ops"):
        CPUAdamBuilder().load()


def test_config_constants_and_exception_types():
    from zerocore.deepspeed.runtime.config import ADAM_OPTIMIZER, ADAMW_OPTIMIZER, DeepSpeedConfigError
    from zerocore.deepspeed.runtime.zero.utils import ZeRORuntimeException

    assert (ADAM_OPTIMIZER, ADAMW_OPTIMIZER) == ("adam", "adamw")
    assert deepspeed.DeepSpeedConfigError is DeepSpeedConfigError
    with pytest.raises(deepspeed.DeepSpeedConfigError, match="tag_validation"):  # zerocore's ConfigError is it
        zerocore.initialize(nn.Linear(3, 3), _cfg(checkpoint={"tag_validation": "foo"}))
    assert issubclass(ConfigError, DeepSpeedConfigError) and issubclass(ZeRORuntimeException, Exception)


def test_zero_config_object_validates_and_warns_through_the_logger(monkeypatch):
    from zerocore.deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    said = []
    monkeypatch.setattr(deepspeed.utils.logger, "warning", lambda msg, *a, **k: said.append(str(msg)))
    z = DeepSpeedZeroConfig(stage=3, elastic_checkpoint=True, stage3_prefetch_bucket_size=1000)
    assert (z.stage, z.elastic_checkpoint, z.stage3_prefetch_bucket_size) == (3, True, 1000)
    assert any("elastic checkpointing is deprecated" in m.lower() for m in said)
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        DeepSpeedZeroConfig(stage=7)


ZERO_SECTIONS = [{}, {"stage": 1}, {"stage": 2}, {"stage": 3}, {"stage": 3, "overlap_comm": False},
                 {"cpu_offload": True}, {"cpu_offload_param": True}, {"offload_param": None, "offload_optimizer": None},
                 {"offload_param": {}, "offload_optimizer": {}},
                 {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False}},
                 {"stage3_prefetch_bucket_size": 12345, "stage3_param_persistence_threshold": 77,
                  "stage3_max_reuse_distance": 5, "stage3_max_live_parameters": 99},
                 {"stage3_gather_fp16_weights_on_model_save": True}, {"stage3_module_granularity_threshold": 10}]


def _zero_config_facts(z) -> dict:
    def offload(o):
        return None if o is None else (str(getattr(o.device, "value", o.device)), o.pin_memory)

    return {"stage": int(z.stage), "overlap_comm": z.overlap_comm, "offload_optimizer": offload(z.offload_optimizer),
            "offload_param": offload(z.offload_param), "prefetch_bucket_size": z.prefetch_bucket_size,
            "param_persistence_threshold": z.param_persistence_threshold,
            "max_live_parameters": z.max_live_parameters,
            "gather_16bit_weights_on_model_save": z.gather_16bit_weights_on_model_save,
            "pipeline_loading_checkpoint": z.pipeline_loading_checkpoint,
            "module_granularity_threshold": z.module_granularity_threshold}


@pytest.mark.parametrize("section", ZERO_SECTIONS, ids=[str(s) for s in ZERO_SECTIONS])
def test_zero_config_object_reads_as_deepspeeds(section):
    """The face's DeepSpeedZeroConfig beside DeepSpeed's own on the same section: DeepSpeed's field names,
    overlap_comm by stage, offload sections None unless given (the deprecated cpu_offload keys read as device
    cpu). max_reuse_distance is zerocore's (its default is 0, DeepSpeed's 1e9: docs/deepspeed_unit_tests.md)."""
    from zerocore.deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ds_config = pytest.importorskip("deepspeed.runtime.zero.config", reason="compares with DeepSpeed's own")
    ours = DeepSpeedZeroConfig(**section)
    assert _zero_config_facts(ours) == _zero_config_facts(ds_config.DeepSpeedZeroConfig(**section))
    if "stage3_max_reuse_distance" in section:
        assert ours.max_reuse_distance == section["stage3_max_reuse_distance"]


def test_offload_config_objects():
    from zerocore.deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                                DeepSpeedZeroOffloadParamConfig)

    assert not DeepSpeedZeroOffloadOptimizerConfig().pipeline
    assert DeepSpeedZeroOffloadOptimizerConfig(device="nvme", nvme_path="/tmp", pipeline_write=True).pipeline
    assert DeepSpeedZeroOffloadParamConfig(device="cpu").device == "cpu"
    with pytest.raises(ConfigError, match="zero_optimization.offload_param.device"):
        DeepSpeedZeroOffloadParamConfig(device="disk")


def test_logger_and_log_dist(caplog):
    assert deepspeed.utils.logger is logging.getLogger("DeepSpeed")
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        deepspeed.utils.log_dist("hello", ranks=[0])
        deepspeed.utils.log_dist("not here", ranks=[3])
    assert [r.getMessage() for r in caplog.records] == ["[Rank 0] hello"]


def test_clone_tensors_for_torch_save_copies_only_the_elements():
    from zerocore.deepspeed.checkpoint.utils import clone_tensors_for_torch_save, get_model_ckpt_name_for_rank

    flat = torch.arange(10.0)
    item = {"a": flat[2:4], "b": [flat[:1], (flat[5:6], 3)], "c": "text"}
    out = clone_tensors_for_torch_save(item)
    assert torch.equal(out["a"], flat[2:4]) and out["a"].untyped_storage().nbytes() == 8
    assert out["a"].data_ptr() != flat.data_ptr() and isinstance(out["b"][1], tuple) and out["b"][1][1] == 3
    assert out["c"] == "text"
    assert get_model_ckpt_name_for_rank("/ckpt/global_step3", "00") == "/ckpt/global_step3/mp_rank_00_model_states.pt"


def test_moe_group_helper_passes_dense_groups_and_refuses_experts():
    from zerocore.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = nn.Linear(3, 3)
    group = {"params": list(model.parameters()), "name": "parameters"}
    assert split_params_into_different_moe_groups_for_optimizer(group) == [group]
    model.weight.allreduce = False  # how DeepSpeed marks an expert parameter
    with pytest.raises(ValueError, match="expert"):
        split_params_into_different_moe_groups_for_optimizer([group])
    dense = nn.Linear(3, 3)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(dense.parameters()), "name": "x"})
    engine, *_ = deepspeed.initialize(model=dense, config=_cfg(), model_parameters=groups)
    assert engine.optimizer.param_groups[0]["name"] == "x"  # the helper's group is taken as it is


def test_see_memory_usage_prints_only_when_forced(capsys):
    from zerocore.deepspeed.runtime.utils import see_memory_usage

    see_memory_usage("quiet")
    assert capsys.readouterr().out == ""
    see_memory_usage("loud", force=True)
    out = capsys.readouterr().out
    assert out.startswith("loud\n") and "CPU Virtual Memory:  used =" in out


def test_required_torch_version():
    from zerocore.deepspeed.utils.torch import required_torch_version

    major_minor = float(".".join(torch.__version__.split(".")[:2]))
    assert required_torch_version(min_version=1.8)
    assert not required_torch_version(min_version=major_minor + 1)
    assert not required_torch_version(max_version=1.0)


def test_version_attributes_as_deepspeeds():
    """``deepspeed.__version_major__`` and its siblings (DeepSpeed's test_check_version reads them all)."""
    assert (deepspeed.__version_major__, deepspeed.__version_minor__, deepspeed.__version_patch__) == tuple(
        int(x) for x in deepspeed.__version__.split(".")[:3])
    assert deepspeed.__git_hash__ and deepspeed.__git_branch__
    real = pytest.importorskip("deepspeed", reason="compares with DeepSpeed's own")
    for name in ("__version_major__", "__version_minor__", "__version_patch__", "__git_hash__", "__git_branch__"):
        assert type(getattr(deepspeed, name)) is type(getattr(real, name)), name


def test_repeating_loader_repeats_as_deepspeeds():
    """``deepspeed.utils.RepeatingLoader``: the same items in the same order as DeepSpeed's over a list, a
    shuffling DataLoader (each pass reshuffles from torch's generator) and an empty iterable (which ends)."""
    from zerocore.deepspeed.runtime.dataloader import RepeatingLoader as from_runtime
    from zerocore.deepspeed.utils import RepeatingLoader

    assert RepeatingLoader is from_runtime
    loader = RepeatingLoader([1, 2, 3])
    assert iter(loader) is loader and [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(StopIteration):
        next(RepeatingLoader([]))

    def shuffled(cls) -> list[int]:
        torch.manual_seed(3)
        data = torch.utils.data.DataLoader(torch.arange(10), batch_size=4, shuffle=True)
        it = cls(data)
        return [int(v) for _ in range(9) for v in next(it)]

    ours = shuffled(RepeatingLoader)
    assert sorted(ours[:10]) == list(range(10)) and ours[:10] != ours[10:20]  # each pass a new order
    ds = pytest.importorskip("deepspeed.utils", reason="comparing with DeepSpeed needs it installed")
    assert ours == shuffled(ds.RepeatingLoader)
