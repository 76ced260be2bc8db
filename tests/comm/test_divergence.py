"""The stage-3 divergence guard on spawned gloo ranks: ranks that issue different stage-3
collectives, or stop issuing them, get a DivergenceError naming what each rank was doing instead of
a hang or a SIGABRT, and the process group still works afterwards; training with the check on and
off equals the one-process reference; at world 4, zerocore.init's values and a divergence.

One spawn of 2 ranks (and one of 4) runs the scenarios (tests/stage3_ranks.py); the tests check
what they returned.
"""
from __future__ import annotations

import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocore
from stage3_ranks import (MICRO, Stack, Wide, _drop, assert_losses, assert_states_close, batch, config, mixed,
                          mixed_unseeded, reference, results, same_on_every_rank, spawn, stack, train)


# -- scenarios (each runs on every rank; returns what the tests check) ---------------------------------
def sc_check_disabled(rank: int, world: int) -> dict:
    out = {}
    for check in (True, False):
        model = mixed()
        engine = zerocore.initialize(model, config(stage3_check_divergence=check))
        out[f"losses_{check}"] = train(engine, 4, rank, world, 32)
        out[f"state_{check}"] = engine.full_state_dict()
        out[f"guard_{check}"] = engine.guard.enabled
        out[f"shm_{check}"] = engine.guard._shm is not None  # one host: the headers go through shared memory
        _drop(engine)
    ref = mixed()
    out["ref_losses"], _ = reference(ref, 4, world, 32)
    out["ref_state"] = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return out



def sc_init_values(rank: int, world: int) -> dict:
    """zerocore.init with rank r seeding r, against the whole build of rank 0's seed."""
    out = {}
    torch.manual_seed(rank)
    with zerocore.init(config()):
        model = mixed_unseeded()
    out["chunks"] = [p._zc_init.chunk.numel() * world >= p._zc_init.numel for p in model.parameters()]
    engine = zerocore.initialize(model, config())
    out["state_init"] = engine.full_state_dict()
    out["losses_init"] = train(engine, 2, rank, world, 32)
    _drop(engine)
    engine = zerocore.initialize(mixed(), config())
    out["state_whole"] = engine.full_state_dict()
    out["losses_whole"] = train(engine, 2, rank, world, 32)
    _drop(engine)
    return out



def _diverge(rank: int, world: int, model: Stack, skip_rank: int, skip: int, at_step: int, **zero) -> dict:
    engine = zerocore.initialize(model, config(**zero))
    t0 = time.perf_counter()
    out = {"error": None, "step": None}
    try:
        for step in range(at_step + 1):
            x, _ = batch(step, MICRO * world, 32)
            t0 = time.perf_counter()
            y = engine(x[rank * MICRO:(rank + 1) * MICRO], skip=skip if (rank == skip_rank and step == at_step)
                       else None)
            engine.backward(y.square().mean())
            engine.step()
    except zerocore.DivergenceError as e:
        out["error"], out["step"] = str(e), step
    out["seconds"] = time.perf_counter() - t0
    # after the error the process group still works: one more collective, then the next scenario
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    out["after"] = t.item()
    _drop(engine)
    return out



def sc_diverge_same_size(rank: int, world: int) -> dict:
    # rank 1 skips blocks.1 in its first forward: rank 0 gathers blocks.1, rank 1 blocks.2
    return _diverge(rank, world, stack(), skip_rank=1, skip=1, at_step=0)



def sc_diverge_other_size(rank: int, world: int) -> dict:
    # blocks.1 is twice the size of the others; without the check the mismatched all-gathers abort gloo
    model = stack(block=lambda i: Wide(32) if i == 1 else nn.Linear(32, 32))
    return _diverge(rank, world, model, skip_rank=1, skip=1, at_step=0)



def sc_diverge_later_step(rank: int, world: int) -> dict:
    # in the third step (orders recorded), without prefetch: the skip shows at the next gather
    return _diverge(rank, world, stack(), skip_rank=1, skip=2, at_step=2, stage3_prefetch_bucket_size=0)



def sc_diverge_prefetched(rank: int, world: int) -> dict:
    """The default config (prefetch on): rank 1 skips blocks.1 in the third step only; the steps
    after it run the same modules on both ranks."""
    engine = zerocore.initialize(stack(), config())
    out = {"error": None, "step": None}
    try:
        for step in range(5):
            x, _ = batch(step, MICRO * world, 32)
            y = engine(x[rank * MICRO:(rank + 1) * MICRO], skip=1 if (rank == 1 and step == 2) else None)
            engine.backward(y.square().mean())
            engine.step()
    except zerocore.DivergenceError as e:
        out["error"], out["step"] = str(e), step
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    out["after"] = t.item()
    _drop(engine)
    return out



def sc_diverge_stop(rank: int, world: int) -> dict:
    """Rank 1 stops issuing zerocore collectives (it leaves the loop and waits on a barrier):
    rank 0 raises after stage3_divergence_timeout, then meets rank 1 at that barrier."""
    model = stack()
    engine = zerocore.initialize(model, config(stage3_divergence_timeout=3))
    out = {"error": None}
    t0 = time.perf_counter()
    if rank == 0:
        try:
            x, _ = batch(0, MICRO * world, 32)
            engine(x[:MICRO])
        except zerocore.DivergenceError as e:
            out["error"] = str(e)
    out["seconds"] = time.perf_counter() - t0
    dist.barrier()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    out["after"] = t.item()
    _drop(engine)
    return out



@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn([sc_check_disabled, sc_diverge_same_size, sc_diverge_other_size, sc_diverge_later_step,
                  sc_diverge_prefetched, sc_diverge_stop], 2, tmp_path_factory.mktemp("diverge2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return spawn([sc_init_values, sc_diverge_same_size], 4, tmp_path_factory.mktemp("diverge4"))


# -- divergence -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, ranks_doing", [
    ("diverge_same_size", ("gathering unit 'blocks.1' (forward)", "gathering unit 'blocks.2' (forward)")),
    ("diverge_other_size", ("gathering unit 'blocks.1.up' (forward)", "gathering unit 'blocks.2' (forward)")),
    ("diverge_later_step", ("gathering unit 'blocks.2' (forward)", "gathering unit 'blocks.3' (forward)")),
])
def test_divergence_raises_on_every_rank(world2, name, ranks_doing):
    rs = results(world2, name)
    for r in rs:
        msg = r["error"]
        assert msg is not None, "no DivergenceError"
        assert "ranks diverged" in msg
        for rank, doing in enumerate(ranks_doing):
            assert f"rank {rank}: collective #" in msg and doing in msg, msg
        assert r["seconds"] < 30
        assert r["after"] == 1.0  # the process group still works afterwards
    assert rs[0]["error"] == rs[1]["error"]  # every rank names the same thing
    assert rs[0]["step"] == rs[1]["step"] == (2 if name == "diverge_later_step" else 0)



def test_divergence_with_prefetch_is_caught_in_the_step_it_happens(world2):
    for r in results(world2, "diverge_prefetched"):
        assert r["after"] == 1.0  # caught somewhere, on both ranks, the group still works (holds today)
        assert r["error"] is not None
        assert r["step"] == 2, f"caught in step {r['step']}, not the step rank 1 skipped a block in:\n{r['error']}"
        # caught by the end-of-forward order check, naming the first unit that differs on each rank
        assert "forward pass" in r["error"] and "rank 0: ran unit 'blocks.1'" in r["error"], r["error"]
        assert "rank 1: ran unit 'blocks.2'" in r["error"], r["error"]



def test_rank_that_stops_issuing_collectives_times_out(world2):
    r0, r1 = results(world2, "diverge_stop")
    assert r0["error"] is not None and "waited 3 s" in r0["error"] and "stage3_divergence_timeout" in r0["error"]
    assert "gathering unit 'blocks.0'" in r0["error"]
    assert 2.5 < r0["seconds"] < 30
    assert r1["error"] is None
    # both then met at rank 1's barrier and did one more collective: nothing left pending
    assert r0["after"] == r1["after"] == 1.0



# -- the check disabled -----------------------------------------------------------------------------
def test_training_matches_reference_with_and_without_the_check(world2):
    rs = results(world2, "check_disabled")
    r = rs[0]
    assert r["guard_True"] and not r["guard_False"]
    assert r["shm_True"] == sys.platform.startswith("linux") and not r["shm_False"]
    for check in (True, False):
        assert_losses(r[f"losses_{check}"], r["ref_losses"])
        assert_states_close(same_on_every_rank(rs, f"state_{check}"), r["ref_state"], mixed().state_dict())



# -- world 4 -------------------------------------------------------------------------------------------
def test_world4_init_values_and_divergence(world4):
    rs = results(world4, "init_values")
    state = same_on_every_rank(rs, "state_init")
    for r in rs:
        assert all(r["chunks"])
        assert r["losses_init"] == r["losses_whole"]
        for k, v in r["state_whole"].items():
            assert torch.equal(state[k], v), k
    rs = results(world4, "diverge_same_size")
    for r in rs:  # rank 1 skipped blocks.1; the three others name it, and rank 1 names blocks.2
        msg = r["error"]
        assert msg is not None and msg == rs[0]["error"]
        for rank in range(4):
            doing = "blocks.2" if rank == 1 else "blocks.1"
            assert f"rank {rank}: collective #2, gathering unit '{doing}' (forward)" in msg, msg
        assert r["after"] == 6.0  # 0 + 1 + 2 + 3: the group still works

