"""Stage-3 parameters carry DeepSpeed's ds_* attributes with DeepSpeed's meanings (ds_id, ds_numel,
ds_shape, ds_tensor, ds_status, ds_persist), under zerocore.init / deepspeed.zero.Init and in an
engine; destroy() takes them off; engine.empty_partition_cache() frees what stays gathered."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zerocore
import zerocore.deepspeed as deepspeed
from dist_helpers import spawn_cases
from zerocore.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, partitioned_param_data_shape

AVAILABLE, NOT_AVAILABLE = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE


def _cfg(**zero):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10, **zero}}


def _model(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3), nn.Linear(3, 3))
    m[3].requires_grad_(False)  # frozen: kept whole at stage 3
    return m


def _full_from_parts(p, comm_gather) -> torch.Tensor:
    """The parameter's value rebuilt from every rank's ds_tensor, in rank order."""
    parts = comm_gather(p.ds_tensor.detach().float().clone())
    return torch.cat(parts)[:p.ds_numel].view(p.ds_shape)


def _gather_list(t):
    import torch.distributed as dist

    if not dist.is_initialized():
        return [t]
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, t.numel())
    out = [torch.empty(n) for n in sizes]
    padded = [torch.zeros(max(sizes)) for _ in sizes]
    mine = torch.zeros(max(sizes))
    mine[:t.numel()] = t
    dist.all_gather(padded, mine)
    return [q[:n] for q, n in zip(padded, sizes)]


def _check(case, rank, world):
    """Runs on each rank: the attributes through zerocore.init, then in an engine, then destroy()."""
    out = {}
    full_before = {n: p.detach().clone() for n, p in _model().named_parameters()}
    with deepspeed.zero.Init(config_dict_or_path=_cfg()):
        model = _model()
    ids = []
    for name, p in model.named_parameters():
        assert hasattr(p, "ds_id") and p.ds_status is NOT_AVAILABLE and p.ds_persist is False, name
        assert p.shape == torch.Size(partitioned_param_data_shape) and p.ds_shape == full_before[name].shape
        assert p.ds_numel == full_before[name].numel() and p.ds_tensor.dtype == torch.float32
        assert torch.equal(_full_from_parts(p, _gather_list), full_before[name]), name
        ids.append(p.ds_id)
    assert len(set(ids)) == len(ids) and ids == sorted(ids)  # in the order they were partitioned
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        assert all(p.ds_status is AVAILABLE for p in model.parameters())
    assert all(p.ds_status is NOT_AVAILABLE for p in model.parameters())

    engine, *_ = deepspeed.initialize(model=model, config=_cfg())
    assert [p.ds_id for p in model.parameters()] == ids  # kept from zero.Init
    for name, p in model.named_parameters():
        persist = name.startswith("3.") or name.endswith("bias") and p.numel() <= 10
        assert p.ds_persist is persist, name
        assert p.ds_status is (AVAILABLE if persist else NOT_AVAILABLE), name
        # (a frozen parameter's ds_tensor is all of it, on every rank: the first copy is the value)
        assert torch.equal(_full_from_parts(p, _gather_list), full_before[name]), name
        if persist:  # whole: a plain copy (as DeepSpeed's)
            assert isinstance(copy.deepcopy(p), nn.Parameter) and not hasattr(copy.deepcopy(p), "ds_id")
        else:  # the empty stand-in: refused (DeepSpeed copies the empty tensor)
            with pytest.raises(RuntimeError, match=f"deepcopy of stage-3 parameter '{name}' while it is partitioned"):
                copy.deepcopy(p)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        loss = engine(torch.randn(2, 5, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    trained = engine.full_state_dict()
    for name, p in model.named_parameters():  # the parts follow the training
        assert torch.equal(_full_from_parts(p, _gather_list), trained[name]), name
    engine.destroy()
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter and not hasattr(p, "ds_id") and not hasattr(p, "ds_status"), name
        assert torch.equal(p.detach(), trained[name]), name
    out["ok"] = True
    return out


def test_ds_attributes_in_one_process():
    assert _check(None, 0, 1)["ok"]


def test_ds_attributes_over_two_ranks(tmp_path):
    results = spawn_cases([None], 2, tmp_path, run=_check)
    for rank in range(2):
        assert "error" not in results[rank][0], results[rank][0].get("error")


def test_outside_the_context_parameters_stay_plain():
    with deepspeed.zero.Init(config_dict_or_path=_cfg()):
        inside = nn.Linear(4, 2)
    outside = nn.Linear(4, 2)
    assert inside.weight.ds_status is NOT_AVAILABLE
    assert type(outside.weight) is nn.Parameter and not hasattr(outside.weight, "ds_status")
    engine = zerocore.initialize(nn.Linear(4, 2), {**_cfg(), "zero_optimization": {"stage": 2}})
    assert not any(hasattr(p, "ds_id") for p in engine.parameters())  # only stage 3 partitions parameters


def _train(engine, empty: bool, steps=3):
    g = torch.Generator().manual_seed(1)
    freed = []
    for _ in range(steps):
        loss = engine(torch.randn(2, 5, generator=g)).pow(2).mean()
        if empty:
            kept = [p.ds_status for p in engine.parameters() if not p.ds_persist]
            engine.empty_partition_cache()
            freed.append((kept, [p.ds_status for p in engine.parameters() if not p.ds_persist]))
        engine.backward(loss)
        engine.step()
    return engine.full_state_dict(), freed


def test_empty_partition_cache_frees_kept_units_and_training_is_unchanged():
    cfg = _cfg(stage3_max_reuse_distance=10**9)  # the forward keeps units the backward will reuse
    want, _ = _train(zerocore.initialize(_model(), cfg), empty=False)
    got, freed = _train(zerocore.initialize(_model(), cfg), empty=True)
    assert any(AVAILABLE in kept for kept, _ in freed)  # something was kept gathered...
    assert all(after == [NOT_AVAILABLE] * len(after) for _, after in freed)  # ...and freed
    for k in want:
        assert torch.equal(got[k], want[k]), k  # the backward gathered again what it needed


def test_empty_partition_cache_at_stages_0_to_2_and_inside_a_forward():
    for stage in (0, 1, 2):
        engine = zerocore.initialize(_model(), {**_cfg(), "zero_optimization": {"stage": stage}})
        engine.empty_partition_cache()  # nothing is partitioned: nothing to do
    engine = zerocore.initialize(_model(), _cfg())
    engine.module[2].register_forward_hook(lambda *_: engine.empty_partition_cache())
    with pytest.raises(RuntimeError, match="inside a forward or backward"):
        engine(torch.randn(2, 5))


@pytest.mark.parametrize("cfg, dtype", [(None, torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_init_partitions_in_deepspeeds_dtype(cfg, dtype):
    """DeepSpeed's Init: the config's training dtype, fp32 without bf16/fp16, fp16 without a config; an
    explicit dtype wins. (On an accelerator without fp16, bf16 without a config or with dtype=:
    test_init_tensor_overrides.py.)"""
    if not deepspeed.accelerator.get_accelerator().is_fp16_supported():
        pytest.skip("this CPU has no fp16 (oneDNN): DeepSpeed's Init takes bf16 without a config or with dtype=")
    config = None if cfg is None else {**_cfg(), **({"bf16": {"enabled": True}} if cfg == "bf16" else {})}
    with deepspeed.zero.Init(config_dict_or_path=config):
        layer = nn.Linear(10, 10)
    assert layer.weight.ds_tensor.dtype == dtype and layer.weight.ds_status is NOT_AVAILABLE
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.float32):  # an explicit dtype wins
        layer = nn.Linear(10, 10)
    assert layer.weight.ds_tensor.dtype == torch.float32
