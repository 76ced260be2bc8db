"""CPU offload with the model on a GPU (a one-rank NCCL group): the host step batched over consecutive groups at
stages 1/2 (zerocore/offload/host_batch.py: one multi-tensor call, the copies back on one side stream behind one
event) and the device's reduced gradient given back once it landed (ShardedGroup.release_grad) train bit for bit as
the same stage without offload (the CPU and CUDA Adam kernels compute the same bits; the H200 run of 2026-11-26
measured offload equal to no offload), hold no device gradient between steps, and restore a released gradient
from its landed copy after a failed step. Skipped without a GPU or zerocore's CUDA kernels."""
from __future__ import annotations

import pytest
import torch

import zerocore
from zerocore import ops
from zerocore.offload.host_batch import HostStepBatch

from dist_helpers import Case, loss_fn, make_batch, make_model

# the GPU marks and the one-rank NCCL group of the engine's other GPU tests
from test_cuda_engine import nccl_world_of_one, pytestmark  # noqa: E402,F401


def _case(stage: int) -> Case:
    zero = {"stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 100} if stage == 3 else {}
    # a small bucket: several groups, stepped as batches at stages 1/2
    return Case(name=f"cuda-offload-s{stage}", model="gpt", stage=stage, dtype="bf16", steps=5, clip=1.0, gas=2,
                bucket=20_000, zero=zero)


def _train(case: Case, offload: dict | None, fail_first_step: bool = False):
    cfg = case.config()
    if offload:
        cfg["zero_optimization"].update(offload)
    engine = zerocore.initialize(make_model(case.model, case.seed).cuda(), cfg)
    losses = []
    try:
        for step in range(case.steps):
            x, y = make_batch(case.model, step, case.micro * case.gas, case.seed)
            for k in range(case.gas):
                xb = x[k * case.micro:(k + 1) * case.micro]
                xb = (xb.bfloat16() if xb.is_floating_point() else xb).cuda()
                loss = loss_fn(case.model, engine(xb), y[k * case.micro:(k + 1) * case.micro].cuda())
                engine.backward(loss)
                if fail_first_step and step == 0 and k == case.gas - 1:
                    real = ops.adam_step_multi

                    def broken(*a, **kw):
                        raise RuntimeError("host kernel broke")

                    ops.adam_step_multi = broken
                    try:
                        with pytest.raises(RuntimeError, match="host kernel broke"):
                            engine.step()
                    finally:
                        ops.adam_step_multi = real
                    # the window goes on: this backward adds to the held (released, restored) gradient
                    engine.backward(loss_fn(case.model, engine(xb), y[k * case.micro:(k + 1) * case.micro].cuda()))
                engine.step()
                losses.append(loss.item())
        torch.cuda.synchronize()
        report = engine.memory_report()
        batches = [type(m).__name__ for m, _ in engine._batches if m is not None]
        state = {k: v.detach().float().cpu() for k, v in engine.full_state_dict().items()}
        return losses, state, report, batches
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_on_a_gpu_trains_bit_for_bit_as_without(nccl_world_of_one, stage):
    case = _case(stage)
    offload = {"offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        offload["offload_param"] = {"device": "cpu"}
    want_losses, want_state, _, _ = _train(case, None)
    losses, state, report, batches = _train(case, offload)
    assert losses == want_losses
    for name, t in want_state.items():
        assert torch.equal(state[name], t), name
    if stage < 3:
        assert HostStepBatch.__name__ in batches  # the stages 1/2 host step ran as batches
    if stage >= 2:
        assert report["grads"] == 0  # no device gradient held between steps


def test_a_released_gradient_comes_back_after_a_failed_step_on_a_gpu(nccl_world_of_one):
    """The boundary's host step fails; a second backward adds to the held gradient, whose device memory was given
    back after landing: restored from the landed copy (behind its copy's event), the run equals the same run
    with the gradient kept on the device."""
    from zerocore.offload.host_stepped import HostSteppedShard

    case = _case(2)
    offload = {"offload_optimizer": {"device": "cpu"}}
    released = _train(case, offload, fail_first_step=True)
    prop = HostSteppedShard.releases_grad
    HostSteppedShard.releases_grad = property(lambda self: False)
    try:
        kept = _train(case, offload, fail_first_step=True)
    finally:
        HostSteppedShard.releases_grad = prop
    assert released[0] == kept[0]
    for name, t in kept[1].items():
        assert torch.equal(released[1][name], t), name


@pytest.mark.parametrize("stage, params", [(1, False), (2, False), (3, False), (3, True)])
@pytest.mark.parametrize("clip", [1e6, 1.0])
def test_a_speculative_host_step_on_a_gpu_trains_bit_for_bit_as_without(nccl_world_of_one, stage, params, clip):
    """offload_optimizer.speculative_step (zerocore/offload/speculation.py): each batch's (stage 3: unit's) host
    Adam started on the worker as its gradients land (behind their copies' events), out of place; kept (a clip
    that does not bite) or dropped (one that may): the run equals the same stage without offload, bit for bit
    (stage 3 with parameter offload: the kept output becomes the host parameter shard)."""
    import dataclasses

    case = dataclasses.replace(_case(stage), clip=clip)
    want_losses, want_state, _, _ = _train(case, None)
    offload = {"offload_optimizer": {"device": "cpu", "speculative_step": True}}
    if params:
        offload["offload_param"] = {"device": "cpu"}
    losses, state, report, batches = _train(case, offload)
    assert losses == want_losses
    for name, t in want_state.items():
        assert torch.equal(state[name], t), name
    if stage < 3:
        assert HostStepBatch.__name__ in batches
    assert report["host_spare_master"] > 0  # the second state is there (and counted)


@pytest.mark.parametrize("stage, params", [(2, False), (3, True)])
def test_offloaded_state_is_pinned_to_the_page_and_given_back_with_the_engine(nccl_world_of_one, stage, params):
    """The offloaded state's page-locked buffers of 1 MiB and more come from zerocore's allocator sized to the
    page (zerocore/offload/host_memory.py; torch's pin_memory rounds each up to a power of two): every such
    buffer of the engine is in it, no block larger than its page-rounded size, the run equals the same stage
    without offload bit for bit, and the memory goes back to the system when the engine is destroyed."""
    from zerocore.offload import host_memory

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)).cuda()

    def run(offload):
        z = {"stage": stage, "reduce_bucket_size": 600_000, **offload}
        if stage == 3:
            z.update({"stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 1})
        cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "bf16": {"enabled": True},
               "zero_optimization": z, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        engine = zerocore.initialize(model(), cfg)
        g = torch.Generator().manual_seed(1)
        try:
            for _ in range(3):
                x = torch.randn(4, 512, generator=g).bfloat16().cuda()
                engine.backward(engine(x).float().square().mean())
                engine.step()
            torch.cuda.synchronize()
            pool = host_memory._exact_pool
            held = pool.stats() if pool else None
            state = {k: v.detach().float().cpu() for k, v in engine.full_state_dict().items()}
            return state, held
        finally:
            engine.destroy()

    want, _ = run({})
    offload = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if params:
        offload["offload_param"] = {"device": "cpu", "pin_memory": True}
    got, held = run(offload)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    assert held is not None, "zerocore's pinned allocator was not used (is the CUDA extension built?)"
    # the fp32 master, m and v of a 512x1024 group (2 MiB each) at least; each block its size to the page
    assert held["in_use_bytes"] >= 3 * 512 * 1024 * 4 and held["in_use_bytes"] % 4096 == 0
    assert held["reserved_bytes"] == held["in_use_bytes"]  # nothing cached beside the buffers in use
    stats = host_memory._exact_pool.stats()
    assert stats["in_use_bytes"] == 0 and stats["reserved_bytes"] == 0, stats  # back to the system with the engine


def test_the_page_sized_pinned_pool_frees_at_once_and_copies_asynchronously(nccl_world_of_one):
    """PinnedBufferPool(cache=False): a block sized to the page, page-locked (a non-blocking copy from the device
    lands in it), returned to the system when its tensor dies."""
    from zerocore.ops import cuda as zcuda

    pool = zcuda.PinnedBufferPool(cache=False)
    n = 3_000_007
    t = pool.empty((n,), torch.float32)
    assert t.is_pinned() and t.data_ptr() % 4096 == 0
    assert pool.stats()["reserved_bytes"] == -(-n * 4 // 4096) * 4096
    src = torch.randn(n, device="cuda")
    t.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(t, src.cpu())
    del t
    assert pool.stats()["reserved_bytes"] == 0
