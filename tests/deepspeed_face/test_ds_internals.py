"""DeepSpeed's internals that zerocore.deepspeed offers with DeepSpeed's meanings (DeepSpeed's unit
tests TestZeroAdamOptimizerStepCount, TestPartitionNcclAlignment, TestParamPartitioningSkipInit,
TestZero3InitForParentWeightInitialization, test_multiple_all_gather_handles_* read them):
stage 3's sub-groups, stages 1-2's partitions, ``zero.Init``'s per-parameter chunks (DeepSpeed's
``ceil(numel / world)``, ``skip_init`` modules included) and ``MultipleAllGatherHandles``."""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn.utils import skip_init

import zerocore.deepspeed as deepspeed
from zerocore.deepspeed.runtime.zero.partition_parameters import MultipleAllGatherHandles

from checkpoint_helpers import result, spawn


def _cfg(stage, **zero):
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, **zero}}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _train(engine, steps):
    for i in range(steps):
        engine.backward(engine(torch.randn(1, 4, generator=torch.Generator().manual_seed(i))).sum())
        engine.step()


def test_multiple_all_gather_handles_pass_handle_dependency_by_keyword():
    seen = []

    class Positional:
        def wait(self, handle_dependency=True):
            seen.append(handle_dependency)

    class KeywordOnly:
        def wait(self, *, handle_dependency=True):
            seen.append(handle_dependency)

    MultipleAllGatherHandles([Positional(), KeywordOnly()]).wait(handle_dependency=False)
    MultipleAllGatherHandles([Positional()]).wait()
    assert seen == [False, False, True]


def test_stage3_subgroups_are_the_state_views_keys():
    engine, opt, *_ = deepspeed.initialize(model=_model(), config=_cfg(3, stage3_param_persistence_threshold=0))
    groups, flats = opt.fp16_groups, opt.fp32_partitioned_groups_flat
    assert len(groups) == len(flats) >= 1
    assert sorted(id(p) for g in groups for p in g) == sorted(id(p) for p in engine.module.parameters())
    _train(engine, 3)
    state = opt.optimizer.state
    assert [float(state[f]["step"]) for f in flats] == [3.0] * len(flats) and engine.global_steps == 3
    for f in flats:  # views of the engine's fp32 master, this rank's
        assert f.dtype == torch.float32 and state[f]["exp_avg"].shape == f.shape
    engine, opt, *_ = deepspeed.initialize(model=_model(), config=_cfg(2))
    assert not hasattr(opt, "fp16_groups") and not hasattr(opt, "fp32_partitioned_groups_flat")
    engine, opt, *_ = deepspeed.initialize(model=_model(), config=_cfg(3))
    assert not hasattr(opt, "nccl_start_alignment_factor")


def test_zero_param_shapes_and_the_stage3_state_groups_calls():
    """``engine._get_zero_param_shapes()`` names each flat group's parameters with their full shapes in the order
    its fp32 master holds them (DeepSpeed's universal-checkpoint tests pair them with the state view's sub-groups);
    ``_set/_clear_fp32_optimizer_param_groups`` change nothing (the view always holds the master pieces)."""
    engine, opt, *_ = deepspeed.initialize(model=_model(), config=_cfg(3, stage3_param_persistence_threshold=0))
    shapes = engine._get_zero_param_shapes()
    full = engine.full_state_dict()
    assert sorted(k for g in shapes for k in g) == sorted(full)
    assert all(shape == full[name].shape for g in shapes for name, shape in g.items())
    for g, group in zip(shapes, engine.groups):  # the group's order
        assert [full[name].numel() for name in g] == [s.numel for s in group.layout.slots]
    _train(engine, 1)
    before = opt.optimizer.state_dict()
    opt._set_fp32_optimizer_param_groups()
    after = opt.optimizer.state_dict()
    opt._clear_fp32_optimizer_param_groups()
    assert before["state"].keys() == after["state"].keys()
    assert all(torch.equal(before["state"][k]["exp_avg"], after["state"][k]["exp_avg"]) for k in before["state"])
    engine, opt, *_ = deepspeed.initialize(model=_model(), config=_cfg(2))
    assert len(engine._get_zero_param_shapes()) == len(engine.groups)
    assert not hasattr(opt, "_set_fp32_optimizer_param_groups")  # DeepSpeed's stage-3 optimizer's only


def _ranks(root, rank, world):
    out = {}
    engine, opt, *_ = deepspeed.initialize(model=_model(), config=_cfg(2))
    factor = opt.nccl_start_alignment_factor
    parts = opt.parallel_partitioned_bit16_groups
    out["aligned"] = all(t.storage_offset() % factor == 0 for per_rank in parts for t in per_rank)
    out["cover"] = all(torch.equal(torch.cat(per_rank), g.param_flat) for per_rank, g in zip(parts, engine.groups))
    out["world"] = [len(per_rank) for per_rank in parts] == [world] * len(parts)
    out["views"] = all(t.untyped_storage().data_ptr() == g.param_flat.untyped_storage().data_ptr()
                       for per_rank, g in zip(parts, engine.groups) for t in per_rank)

    class Parent(torch.nn.Module):  # a parent initializing the child it just built, per rank
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(12, 1)
            with torch.no_grad():
                self.linear.weight.fill_(1 + rank)
            self.skipped = skip_init(torch.nn.Linear, 10, 10)

    with deepspeed.zero.Init(config_dict_or_path=_cfg(3)):
        model = Parent()
    out["numel"] = [(p.ds_numel, p.ds_tensor.numel()) for p in model.parameters()]
    out["rank0_value"] = bool((model.linear.weight.ds_tensor == 1).all())
    engine, *_ = deepspeed.initialize(model=model, config=_cfg(3))
    x = torch.randn(1, 12)
    engine.backward(engine.module.linear(x).sum() + engine.module.skipped(x[:, :10]).sum())
    engine.step()
    return out


@pytest.mark.slow
def test_partitions_and_init_chunks_on_two_ranks(tmp_path):
    for r in result(spawn([("ranks", _ranks, (str(tmp_path),))], 2, tmp_path, timeout=120), "ranks"):
        assert r["aligned"] and r["cover"] and r["world"] and r["views"]
        assert r["numel"] == [(n, math.ceil(n / 2)) for n in (12, 1, 100, 10)]  # DeepSpeed's partition size
        assert r["rank0_value"]  # partitioned after the parent's __init__: rank 0's values on every rank


def test_skip_init_modules_are_partitioned_by_init():
    with deepspeed.zero.Init(config_dict_or_path=_cfg(3)):
        lin = skip_init(torch.nn.Linear, 6, 5)
    assert lin.weight.ds_numel == 30 and lin.weight.ds_tensor.numel() == 30 and lin.weight.numel() == 0
    engine, *_ = deepspeed.initialize(model=lin, config=_cfg(3))
    engine.backward(engine(torch.randn(1, 6)).sum())
    engine.step()
