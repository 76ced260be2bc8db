"""Stages 1/2 with CPU offload step consecutive host shards as one job (zerocore/offload/host_batch.py): one
multi-tensor Adam call over their host state instead of a job per group. Which shards join, how the batches
are cut, and that a batch computes the bits the per-group steps computed."""
from __future__ import annotations

import pytest
import torch

import zerocore
import zerocore.runtime.engine as engine_mod
from zerocore import ops
from zerocore.offload.host_batch import HostStepBatch


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 4))


def _engine(stage=2, offload=None, groups=False, bf16=False, **zero):
    model = _model()
    z = {"stage": stage, "reduce_bucket_size": 2048, "offload_optimizer": {"device": "cpu", **(offload or {})}, **zero}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": z,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    if bf16:  # 16-bit parameters: the kernel writes them in the same pass (param_out)
        cfg["bf16"] = {"enabled": True}
    params = None
    if groups:  # two hyper-parameter groups: every owned range is stepped in pieces of each
        ps = list(model.parameters())
        params = [{"params": [p for p in ps if p.ndim == 2]},
                  {"params": [p for p in ps if p.ndim < 2], "lr": 3e-3, "weight_decay": 0.0}]
    return zerocore.initialize(model, cfg, model_parameters=params)


def _train(engine, steps=4) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    dtype = next(engine.module.parameters()).dtype
    for _ in range(steps):
        x, y = torch.randn(4, 32, generator=g, dtype=dtype), torch.randn(4, 4, generator=g)
        loss = (engine(x).float() - y).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _kinds(engine) -> list:
    return [(type(multi).__name__ if multi is not None else None, tuple(index)) for multi, index in engine._batches]


def test_consecutive_host_shards_form_batches_cut_at_host_batch_elems(monkeypatch):
    engine = _engine()
    try:
        assert len(engine.groups) >= 3, "the test needs several groups"
        # every group in one batch, in index order
        assert _kinds(engine) == [("HostStepBatch", tuple(range(len(engine.groups))))]
    finally:
        engine.destroy()
    sizes = None
    monkeypatch.setattr(engine_mod, "HOST_BATCH_ELEMS", 4096)
    engine = _engine()
    try:
        sizes = [g.hi - g.lo for g in engine.groups]
        batches = [index for _, index in engine._batches]
        assert [i for b in batches for i in b] == list(range(len(sizes)))
        assert len(batches) > 1
        for b in batches:  # at most the cap, unless one group alone is larger
            assert sum(sizes[i] for i in b) <= 4096 or len(b) == 1
        for a, b in zip(batches, batches[1:]):  # cut only where the next group would not fit
            assert sum(sizes[i] for i in a) + sizes[b[0]] > 4096
    finally:
        engine.destroy()


def test_twin_flow_shards_keep_their_own_step():
    engine = _engine(offload={"ratio": 0.5})  # a device part stepped beside the host part
    try:
        assert not any(isinstance(multi, HostStepBatch) for multi, _ in engine._batches)
        _train(engine, 2)
    finally:
        engine.destroy()


def test_stage3_batches_only_its_whole_kept_groups():
    """Stage 3 queues a unit's host step behind the next forward (each unit's gather waits for its own): those
    stay single; the persistent groups (kept whole, stepped when the engine asks) may batch."""
    engine = _engine(stage=3, stage3_param_persistence_threshold=100)
    try:
        batched = {i for multi, index in engine._batches if isinstance(multi, HostStepBatch) for i in index}
        assert batched and all(not engine.groups[i].partitioned for i in batched)
        assert any(g.partitioned for g in engine.groups)
        _train(engine, 2)
    finally:
        engine.destroy()


def test_a_client_torch_optimizer_keeps_its_own_host_step():
    model = _model()
    engine = zerocore.initialize(model, {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {
        "stage": 2, "reduce_bucket_size": 2048, "offload_optimizer": {"device": "cpu"}}},
        optimizer=torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    try:
        assert not any(isinstance(multi, HostStepBatch) for multi, _ in engine._batches)
        _train(engine, 2)
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("groups, bf16", [(False, False), (True, False), (True, True)])
def test_a_batch_computes_the_bits_of_the_per_group_steps(monkeypatch, stage, groups, bf16):
    """All groups in one batch (one native call), one group per batch, and each shard's own step (no batch):
    losses, the gradient norms and every weight and optimizer state bit for bit, with clipping and two
    hyper-parameter groups."""
    default = engine_mod.HOST_BATCH_ELEMS

    def run(cap, batched=True):
        monkeypatch.setattr(engine_mod, "HOST_BATCH_ELEMS", cap)
        if not batched:
            monkeypatch.setattr(engine_mod, "batchable", lambda shard: False)
        engine = _engine(stage, groups=groups, bf16=bf16)
        try:
            n_batches = len(engine._batches)
            losses, norms = [], []
            for _ in range(4):
                losses += _train(engine, 1)
                norms.append(engine.get_global_grad_norm())
            weights = [p.detach().clone() for p in engine.module.parameters()]
            states = [t.clone() for s in engine.shards for t in (s.master_h, s.exp_avg_h, s.exp_avg_sq_h)]
            return n_batches, losses, norms, weights, states
        finally:
            engine.destroy()

    real_batchable = engine_mod.batchable
    unbatched = run(default, batched=False)
    monkeypatch.setattr(engine_mod, "batchable", real_batchable)
    one, per_group = run(default), run(1)
    assert one[0] == 1 and per_group[0] == unbatched[0] > 1
    for other in (per_group, one):
        assert other[1] == unbatched[1] and other[2] == unbatched[2]
        for a, b in zip(other[3] + other[4], unbatched[3] + unbatched[4]):
            assert torch.equal(a, b)


def test_a_batch_is_one_native_call_per_hyper_group(monkeypatch):
    calls = []
    multi = ops.adam_step_multi

    def counting(params, *a, **kw):
        calls.append(len(params))
        return multi(params, *a, **kw)

    monkeypatch.setattr(ops, "adam_step_multi", counting)
    engine = _engine(groups=True)
    try:
        _train(engine, 1)
        assert len(calls) == 2, calls  # one call for each hyper-parameter group, over every group's pieces
        assert sum(calls) >= len(engine.groups)
    finally:
        engine.destroy()


# -- the device's reduced gradient given back once it landed (ShardedGroup.release_grad) ----------------------
def _device_grad_bytes(engine) -> list[int]:
    return [g.grad_shard.untyped_storage().nbytes() for g in engine.groups]


@pytest.mark.parametrize("stage", [2, 3])
def test_the_device_gradient_is_given_back_once_landed_and_taken_again_by_the_next_reduction(stage):
    model = _model()
    z = {"stage": stage, "reduce_bucket_size": 2048, "offload_optimizer": {"device": "cpu"}}
    engine = zerocore.initialize(model, {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                                         "zero_optimization": z,
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    try:
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
        engine.backward(engine(x).square().mean())  # not the boundary: the gradient stays on the device
        engine.step()
        assert all(n > 0 for n in _device_grad_bytes(engine))
        engine.backward(engine(x).square().mean())  # the boundary: landed on the host, given back
        assert all(n == 0 for n in _device_grad_bytes(engine))
        engine.step()
        assert engine.memory_report()["grads"] == 0  # held between steps: none on the device
        engine.backward(engine(x).square().mean())  # the next window's first reduction takes it again
        assert all(n > 0 for n in _device_grad_bytes(engine))
    finally:
        engine.destroy()


def test_a_gradient_added_to_after_a_failed_step_comes_back_from_its_landed_copy(monkeypatch):
    """The boundary's step fails (nothing updated), the next backward adds to the held gradient: the
    released device gradient is restored from the copy on the host first, so training goes on as if it had
    never been released (bit for bit the run that keeps it)."""
    from zerocore.offload.host_stepped import HostSteppedShard

    def run(release: bool):
        if not release:
            monkeypatch.setattr(HostSteppedShard, "releases_grad", property(lambda self: False))
        engine = _engine()
        try:
            g = torch.Generator().manual_seed(3)
            x, y = torch.randn(4, 32, generator=g), torch.randn(4, 4, generator=g)
            engine.backward((engine(x) - y).square().mean())
            multi = ops.adam_step_multi

            def broken(*a, **kw):
                raise RuntimeError("host kernel broke")

            monkeypatch.setattr(ops, "adam_step_multi", broken)
            with pytest.raises(RuntimeError, match="host kernel broke"):
                engine.step()
            monkeypatch.setattr(ops, "adam_step_multi", multi)
            engine.backward((engine(2 * x) - y).square().mean())  # added to the held gradient
            engine.step()
            losses = _train(engine, 2)
            return losses, [p.detach().clone() for p in engine.module.parameters()]
        finally:
            engine.destroy()
            monkeypatch.undo()

    kept, released = run(False), run(True)
    assert kept[0] == released[0]
    for a, b in zip(kept[1], released[1]):
        assert torch.equal(a, b)
