"""``zerocore.gathered`` on a stage-3 engine, on 2 spawned gloo ranks: full parameters visible for a
while and edits discarded, or one rank's edit (``modifier_rank``) written back to every rank and
into training (fp32, and bf16 where the edit goes into that parameter's fp32 master only);
persistent (never partitioned) parameters; and gathered() inside a forward that meets a prefetch
in flight.

One spawn of 2 ranks runs every scenario (tests/stage3_ranks.py); the tests check what they returned.
"""
from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch

import zerocore
from stage3_ranks import (Stack, _drop, assert_losses, assert_states_close, batch, config, reference, results,
                          same_on_every_rank, spawn, stack, train)


# -- scenarios (each runs on every rank; returns what the tests check) ---------------------------------
def sc_gathered_engine(rank: int, world: int) -> dict:
    """fp32: read, discard, and rank 0's edit written back; training goes on from the edit."""
    out = {}
    model = stack()
    engine = zerocore.initialize(model, config())
    train(engine, 2, rank, world, 32)
    sd = engine.full_state_dict()
    names = dict(model.named_parameters())
    seen_full, seen_equal = {}, {}
    with pytest.warns(RuntimeWarning, match="in-place modification of .* discarded on exit") as caught, \
            zerocore.gathered(list(model.parameters())) as ps:
        out["yields_params"] = [id(p) for p in ps] == [id(p) for p in model.parameters()]
        for n, p in names.items():
            seen_full[n] = tuple(p.shape)
            seen_equal[n] = torch.equal(p.detach(), sd[n])
        # in the context full_state_dict still works (and agrees)
        sd_inside = engine.full_state_dict()
        out["inside_sd_equal"] = all(torch.equal(sd_inside[n], sd[n]) for n in sd)
        with torch.no_grad():
            for p in ps:
                p.add_(1.0)  # no modifier_rank: discarded
    out["warned_of"] = str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reading only: no warning
        with zerocore.gathered(list(model.parameters())):
            pass
    out["seen_full"], out["seen_equal"] = seen_full, seen_equal
    out["shape_after"] = {n: tuple(p.shape) for n, p in names.items()}
    sd_discard = engine.full_state_dict()
    out["discarded"] = all(torch.equal(sd_discard[n], sd[n]) for n in sd)
    # rank 0 zeroes row 0 and adds 1 to row 1 of blocks.1.weight; rank 1 makes another change
    w = model.blocks[1].weight
    with zerocore.gathered([w], modifier_rank=0):
        with torch.no_grad():
            if rank == 0:
                w[0].zero_()
                w[1].add_(1.0)
            else:
                w.mul_(3.0)
    out["before_edit"] = sd
    out["after_edit"] = engine.full_state_dict()
    out["losses_after"] = train(engine, 3, rank, world, 32, first=2)
    out["state_end"] = engine.full_state_dict()
    _drop(engine)
    # the reference: the same edit at the same point
    ref = stack()
    losses, opt = reference(ref, 2, world, 32)
    with torch.no_grad():
        ref.blocks[1].weight[0].zero_()
        ref.blocks[1].weight[1].add_(1.0)
    out["ref_losses_after"], _ = reference(ref, 3, world, 32, first=2, opt=opt)
    out["ref_state_end"] = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return out



def sc_gathered_bf16(rank: int, world: int) -> dict:
    """bf16: the fp32 master of the edited parameter takes the edit; the others (also those in
    the same unit) keep their full fp32 values."""
    out = {}
    model = stack()
    engine = zerocore.initialize(model, config("bf16"))
    train(engine, 2, rank, world, 32, dtype=torch.bfloat16)
    out["before"] = engine.full_state_dict()
    w = model.blocks[1].weight
    with zerocore.gathered([w], modifier_rank=0):
        out["inside_dtype"] = str(w.dtype)
        out["inside"] = w.detach().clone()
        with torch.no_grad():
            if rank == 0:
                w[0].add_(1.0)
            else:
                w.zero_()
    out["after"] = engine.full_state_dict()
    out["losses"] = train(engine, 2, rank, world, 32, first=2, dtype=torch.bfloat16)
    _drop(engine)
    ref = stack()  # fp32, the same edit at the same point
    _, opt = reference(ref, 2, world, 32)
    with torch.no_grad():
        ref.blocks[1].weight[0].add_(1.0)
    out["ref_losses"], _ = reference(ref, 2, world, 32, first=2, opt=opt)
    return out



def sc_gathered_persistent(rank: int, world: int) -> dict:
    """Persistent (never partitioned) parameters: the biases (32 < threshold 100)."""
    out = {}
    for dtype in ("fp32", "bf16"):
        model = stack()
        engine = zerocore.initialize(model, config(dtype, stage3_param_persistence_threshold=100))
        tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        train(engine, 1, rank, world, 32, dtype=tdtype)
        before = engine.full_state_dict()
        b, w = model.blocks[0].bias, model.blocks[0].weight
        with pytest.warns(RuntimeWarning, match=r"of blocks\.0\.bias, blocks\.0\.weight inside"):
            with zerocore.gathered([b, w]):
                with torch.no_grad():
                    b.add_(1.0)  # no modifier_rank: discarded (the persistent bias restored from its copy)
                    w.add_(1.0)
        out[f"{dtype}_discard"] = engine.full_state_dict()
        out[f"{dtype}_discard_local"] = b.detach().float().clone()
        with zerocore.gathered([b], modifier_rank=0):
            with torch.no_grad():
                b.fill_(0.5 if rank == 0 else -7.0)
        out[f"{dtype}_before"] = before
        out[f"{dtype}_modified"] = engine.full_state_dict()
        out[f"{dtype}_modified_local"] = b.detach().float().clone()
        out[f"{dtype}_losses"] = train(engine, 1, rank, world, 32, first=1, dtype=tdtype)
        _drop(engine)
    return out



class Peeking(Stack):
    """Reads a parameter of another unit under zerocore.gathered() in its own forward (from a
    list captured before initialize, so no attribute access gathers it first)."""

    def forward(self, x, skip=None):
        if self.__dict__.get("peek"):
            self.__dict__["state"] = self.__dict__["probe"]()
            with zerocore.gathered(self.__dict__["peek"]) as ps:
                self.__dict__["seen"] = [p.detach().clone() for p in ps]
        return super().forward(x, skip)



def sc_gathered_in_forward(rank: int, world: int) -> dict:
    """In the second step the root's pre-forward hook prefetches the blocks (recorded order):
    gathered() on blocks.1.weight inside the root's forward meets a gather in flight."""
    out = {}
    for peek in (False, True):
        torch.manual_seed(0)
        model = Peeking()
        w = model.blocks[1].weight
        engine = zerocore.initialize(model, config())
        train(engine, 1, rank, world, 32)
        sd = engine.full_state_dict()
        model.__dict__["peek"] = [w] if peek else None
        group = engine.groups[engine.param_index[id(w)][0]]
        model.__dict__["probe"] = lambda: str(group.param_state.value)
        count = engine.guard.count
        losses = train(engine, 1, rank, world, 32, first=1)
        out[f"headers_{peek}"] = engine.guard.count - count
        out[f"losses_{peek}"] = losses
        if peek:
            out["state_inside_forward"] = model.__dict__["state"]
            out["seen"] = model.__dict__["seen"][0]
            out["want"] = sd["blocks.1.weight"]
            out["empty_after"] = w.numel() == 0
        _drop(engine)
    return out



def sc_gathered_holds_units(rank: int, world: int) -> dict:
    """The whole model gathered by one block (generation's way): forwards inside it gather nothing more; training
    steps inside it train as outside (the first backward's end hands the units back: the step changes the chunks)."""
    out = {}
    model = stack()
    engine = zerocore.initialize(model, config())
    losses = train(engine, 1, rank, world, 32)
    x = batch(9, 4, 32)[0]
    with torch.no_grad():
        outside = engine(x)
    gathers = []
    for g in engine.groups:  # (this engine's groups only: each instance's all-gathers counted)
        g.start_gather = functools.partial(lambda start, *a, **k: gathers.append(1) or start(*a, **k), g.start_gather)
    with zerocore.gathered(list(model.parameters())):
        out["gathers_entering"] = len(gathers)
        with torch.no_grad():
            inside = [engine(x) for _ in range(3)]
        out["gathers_forwards"] = len(gathers) - out["gathers_entering"]
        out["inside_equal"] = all(torch.equal(t, outside) for t in inside)
        losses += train(engine, 2, rank, world, 32, first=1)
    out["empty_after"] = all(p.numel() == 0 for p in model.parameters())
    out["losses"] = losses + train(engine, 1, rank, world, 32, first=3)
    out["ref_losses"] = reference(stack(), 4, world, 32)[0]
    _drop(engine)
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn([sc_gathered_engine, sc_gathered_bf16, sc_gathered_persistent, sc_gathered_in_forward,
                  sc_gathered_holds_units], 2,
                 tmp_path_factory.mktemp("gathered2"))


# -- gathered() on a stage-3 engine ------------------------------------------------------------------
def test_gathered_shows_full_params_and_discards_edits(world2):
    for r in results(world2, "gathered_engine"):
        assert r["yields_params"]
        for n, shape in r["seen_full"].items():
            assert shape == tuple(r["before_edit"][n].shape) and shape != (0,)
            assert r["seen_equal"][n], f"{n} inside gathered() differs from full_state_dict()"
            assert r["shape_after"][n] == (0,)  # partitioned again
        assert r["inside_sd_equal"]
        assert r["discarded"]
        assert "blocks.0.weight" in r["warned_of"] and "modifier_rank=<rank>" in r["warned_of"]



def test_gathered_modifier_rank_edit_reaches_every_rank_and_training(world2):
    rs = results(world2, "gathered_engine")
    after = same_on_every_rank(rs, "after_edit")
    before = rs[0]["before_edit"]
    want = before["blocks.1.weight"].clone()
    want[0] = 0.0
    want[1] += 1.0
    assert torch.equal(after["blocks.1.weight"], want)  # rank 0's edit; rank 1's (x3) discarded
    for k in before:
        if k != "blocks.1.weight":
            assert torch.equal(after[k], before[k]), k
    r = rs[0]
    assert_losses(r["losses_after"], r["ref_losses_after"])
    assert_states_close(same_on_every_rank(rs, "state_end"), r["ref_state_end"], stack().state_dict())



def test_gathered_bf16_edit_goes_into_the_fp32_master_of_that_param_only(world2):
    rs = results(world2, "gathered_bf16")
    after = same_on_every_rank(rs, "after")
    before = rs[0]["before"]
    inside = rs[0]["inside"]
    assert rs[0]["inside_dtype"] == "torch.bfloat16"
    assert torch.equal(inside.float(), before["blocks.1.weight"].bfloat16().float())
    want = inside.clone()
    want[0] += 1.0  # in bf16, as rank 0 did
    assert torch.equal(after["blocks.1.weight"], want.float())
    for k in before:
        if k == "blocks.1.weight":
            continue
        assert torch.equal(after[k], before[k]), k  # full fp32 values kept, also blocks.1.bias (same unit)
        assert not torch.equal(before[k], before[k].bfloat16().float()), f"{k}: no fp32 precision to lose?"
    assert_losses(rs[0]["losses"], rs[0]["ref_losses"], rtol=3e-2, atol=1e-3)



@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gathered_persistent_params(world2, dtype):
    rs = results(world2, "gathered_persistent")
    before = rs[0][f"{dtype}_before"]
    discard = same_on_every_rank(rs, f"{dtype}_discard")
    modified = same_on_every_rank(rs, f"{dtype}_modified")
    for k in before:  # no modifier_rank: the whole (persistent) bias is restored too
        assert torch.equal(discard[k], before[k]), k
    for r in rs:
        assert torch.equal(r[f"{dtype}_discard_local"], before["blocks.0.bias"].to(DTYPE[dtype]).float())
        assert torch.equal(r[f"{dtype}_modified_local"], torch.full((32,), 0.5))
    assert torch.equal(modified["blocks.0.bias"], torch.full((32,), 0.5))  # rank 0's value, in the master too
    for k in before:
        if k != "blocks.0.bias":
            assert torch.equal(modified[k], before[k]), k
    assert rs[0][f"{dtype}_losses"] == rs[1][f"{dtype}_losses"] and all(map(math.isfinite, rs[0][f"{dtype}_losses"]))



DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}



# -- gathered() inside a forward ---------------------------------------------------------------------
def test_gathered_inside_forward_waits_for_the_prefetch_in_flight(world2):
    for r in results(world2, "gathered_in_forward"):
        assert r["state_inside_forward"] == "ParamState.GATHERING"  # the case this covers
        assert torch.equal(r["seen"], r["want"])
        assert r["empty_after"]
        # no extra collective (the prefetched gather is used, not redone), same training
        assert r["headers_True"] == r["headers_False"]
        assert r["losses_True"] == r["losses_False"]



def test_forwards_inside_a_block_gather_nothing_more_and_training_inside_is_exact(world2):
    for r in results(world2, "gathered_holds_units"):
        assert r["gathers_entering"] == 4  # one all-gather per unit, on entering
        assert r["gathers_forwards"] == 0  # three forwards of the whole model: the units stay whole
        assert r["inside_equal"]
        assert r["empty_after"]
        assert_losses(r["losses"], r["ref_losses"])


def test_what_is_taken_from_gathered_parameters_stays_valid_after_the_context():
    """DeepSpeed scripts keep ``p.detach().cpu()`` (on the CPU: the same storage) or a state dict taken
    inside the context; the stage-3 group gives up that buffer instead of resizing it, so the taken
    tensors keep their values, and the engine trains on as before."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        return zerocore.initialize(model, {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                           "zero_optimization": {"stage": 3,
                                                                 "stage3_param_persistence_threshold": 0}})

    def train(engine):
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            engine.backward(engine(torch.randn(2, 6, generator=g)).pow(2).mean())
            engine.step()

    engine, twin = build(), build()
    train(engine)
    train(twin)
    taken = {}
    with zerocore.gathered(list(engine.module.parameters())):
        for name, p in engine.module.named_parameters():
            taken[name] = p.detach().cpu()  # no copy on the CPU: an alias of the gathered buffer
        state = engine.module.state_dict()
    assert all(p.numel() == 0 for p in engine.module.parameters())  # partitioned again
    want = engine.full_state_dict()
    for name, t in taken.items():
        assert torch.equal(t, want[name]) and torch.equal(state[name], want[name]), name
    train(engine)  # gathers into the group's new buffer
    train(twin)
    got, ref = engine.full_state_dict(), twin.full_state_dict()
    assert all(torch.equal(got[k], ref[k]) for k in ref)
