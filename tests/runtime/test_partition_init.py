"""``zerocore.init`` on 2 spawned gloo ranks: parameters partitioned as the model is built (memory
while building and training; every rank gets rank 0's values, exactly as a whole build), and the
trap of a parameter changed after it was partitioned (named, not lost) with its way out, the change
made under ``zerocore.gathered(modifier_rank=0)``.

One spawn of 2 ranks runs both scenarios (tests/stage3_ranks.py); the tests check what they returned.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import zerocore
from dist_helpers import gc_tensor_bytes
from stage3_ranks import (Stack, _drop, assert_losses, config, reference, results, same_on_every_rank, spawn,
                          train)


class Parent(nn.Module):
    """Initializes its child's weight in its own __init__: the trap zerocore.init catches, and
    (``fixed``) the way out: the change made under zerocore.gathered(modifier_rank=0)."""

    def __init__(self, d: int = 32, fixed: bool = False):
        super().__init__()
        self.child = nn.Linear(d, d)
        self.head = nn.Linear(d, d)
        if fixed:
            with zerocore.gathered([self.child.weight], modifier_rank=0):
                nn.init.normal_(self.child.weight, std=0.3)
        else:
            nn.init.normal_(self.child.weight, std=0.3)

    def forward(self, x):
        return self.head(torch.tanh(self.child(x)))



SAMPLES: list[int] = []  # gc_tensor_bytes() taken while a model is built / trained



def _sample():
    SAMPLES.append(gc_tensor_bytes())



class SampledLinear(nn.Linear):
    """A Linear that records the bytes alive at the end of its __init__ (its weight still whole:
    zerocore.init partitions it when this __init__ returns)."""

    def __init__(self, d: int):
        super().__init__(d, d)
        _sample()



# -- scenarios (each runs on every rank; returns what the tests check) ---------------------------------
MEM_N, MEM_D, MEM_STEPS = 32, 256, 2
# stage-3 limits for the memory run: about two units gathered ahead, three resident
MEM_ZERO = {"stage3_prefetch_bucket_size": 2 * (MEM_D + 1) * MEM_D, "stage3_max_live_parameters": 3 * (MEM_D + 1) * MEM_D}



def sc_init_memory(rank: int, world: int) -> dict:
    """A 32 x Linear(256, 256) model (8.4 MB of fp32 parameters) built under zerocore.init and
    trained at stage 3, against the same model built whole (and trained at stage 0). Bytes alive
    (gc) are sampled at the end of some blocks' __init__ (their weight still whole), after the
    build, and while training: before/after some blocks' forward, when their gradient is
    ready, after each step."""
    out = {}
    sampled = {MEM_N // 2 - 1, MEM_N - 1}

    def block(i):
        return SampledLinear(MEM_D) if i in sampled else nn.Linear(MEM_D, MEM_D)

    def build(partitioned: bool, seed: int):
        SAMPLES.clear()
        base = gc_tensor_bytes()
        torch.manual_seed(seed)
        if partitioned:
            with zerocore.init(config(**MEM_ZERO)):
                model = Stack(MEM_N, MEM_D, block=block)
        else:
            model = Stack(MEM_N, MEM_D, block=block)
        _sample()
        return model, base, max(SAMPLES) - base

    def run(model, cfg, base, sample: bool):
        SAMPLES.clear()
        engine = zerocore.initialize(model, cfg)
        _sample()
        hooks = []
        if sample:
            for i in (0, MEM_N // 2, MEM_N - 1):
                b = model.blocks[i]
                hooks += [b.register_forward_pre_hook(lambda *a: _sample()), b.register_forward_hook(lambda *a: _sample()),
                          b.weight.register_post_accumulate_grad_hook(lambda p: _sample())]
        losses = train(engine, MEM_STEPS, rank, world, MEM_D, hook=_sample)
        for h in hooks:
            h.remove()
        peak = max(SAMPLES) - base
        state = engine.full_state_dict()
        _drop(engine)
        return losses, peak, state

    # rank r seeds with r: zerocore.init must give every rank rank 0's values
    model, base, out["build_peak_init"] = build(True, seed=rank)
    out["empty_after_build"] = all(p.numel() == 0 for p in model.parameters())
    out["shapes"] = {n: tuple(p._zc_init.shape) for n, p in model.named_parameters()}
    out["losses_init"], out["train_peak_init"], out["state_init"] = run(model, config(**MEM_ZERO), base, True)
    del model
    model, base, out["build_peak_whole"] = build(False, seed=0)
    out["losses_whole"], _, out["state_whole"] = run(model, config(**MEM_ZERO), base, False)
    del model
    model, base, _ = build(False, seed=0)
    out["losses_stage0"], out["train_peak_stage0"], _ = run(model, config(stage=0), base, False)
    out["psi"] = sum(p.numel() for p in model.parameters())
    del model
    return out



def sc_init_trap(rank: int, world: int) -> dict:
    out = {}
    # a parent's __init__ changing its child's (already partitioned) weight
    try:
        with zerocore.init(config()):
            Parent()
        out["parent"] = None
    except RuntimeError as e:
        out["parent"] = str(e)
    # TinyGPT does exactly that (nn.init.normal_(self.tok.weight) at the end of TinyGPT.__init__)
    from zerocore.demo import Block, TinyGPT

    try:
        with zerocore.init(config()):
            TinyGPT(vocab=29, dim=32, layers=1, heads=2, ctx=12)
        out["tinygpt"] = None
    except RuntimeError as e:
        out["tinygpt"] = str(e)
    # ... but its blocks are fine: nn.MultiheadAttention zeroes out_proj.bias right after building
    # out_proj (a child initialized by its parent before anything else is built)
    torch.manual_seed(rank)
    with zerocore.init(config()):
        blocks = nn.Sequential(Block(32, 2), Block(32, 2))
    engine = zerocore.initialize(blocks, config())
    out["blocks_state"] = engine.full_state_dict()
    _drop(engine)
    torch.manual_seed(0)
    out["blocks_ref"] = {k: v.detach().clone() for k, v in nn.Sequential(Block(32, 2), Block(32, 2)).state_dict().items()}
    # a change made after construction, before initialize: caught by initialize
    for kind in ("inplace", "assign"):
        torch.manual_seed(0)
        with zerocore.init(config()):
            model = Stack()
        if kind == "inplace":
            with torch.no_grad():
                model.blocks[2].bias.add_(1.0)
        else:
            model.blocks[2].weight.data = torch.ones(32, 32)
        try:
            engine = zerocore.initialize(model, config())
            _drop(engine)
            out[kind] = None
        except RuntimeError as e:
            out[kind] = str(e)
    # a read-only gathered() edit of a parameter zerocore.init partitioned: discarded, with a warning naming it
    with zerocore.init(config()):
        model = Stack()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with zerocore.gathered([model.blocks[0].weight]):
            with torch.no_grad():
                model.blocks[0].weight.add_(1.0)
    out["loose_warned"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    with zerocore.init(config(enable_sanity_checks=True)):  # DeepSpeed's rule there: an error
        model = Stack()
    try:
        with zerocore.gathered([model.blocks[0].weight]):
            with torch.no_grad():
                model.blocks[0].weight.add_(1.0)
        out["loose_raised"] = None
    except RuntimeError as e:
        out["loose_raised"] = str(e)
    # the fix: the parent's change made under gathered(modifier_rank=0); rank r seeds with r
    torch.manual_seed(rank)
    with zerocore.init(config()):
        model = Parent(fixed=True)
    out["fixed_empty"] = all(p.numel() == 0 for p in model.parameters())
    engine = zerocore.initialize(model, config())
    out["fixed_state"] = engine.full_state_dict()
    out["fixed_losses"] = train(engine, 3, rank, world, 32)
    _drop(engine)
    torch.manual_seed(0)
    ref = Parent(fixed=False)  # what rank 0 built, without zerocore.init
    out["ref_state"] = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    out["ref_losses"], _ = reference(ref, 3, world, 32)
    return out



@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn([sc_init_memory, sc_init_trap], 2, tmp_path_factory.mktemp("init2"))


# -- 1. zerocore.init: memory while building and training; values from rank 0 -----------------------
def test_init_keeps_memory_under_the_limit(world2):
    for r in results(world2, "init_memory"):
        full_params = 4 * r["psi"]  # fp32
        stage0_state = 16 * r["psi"]  # a whole (stage 0) run: fp32 params, grads, Adam m and v
        # building: rank's share (1/2) plus a block or two whole; a whole build holds all of it
        assert r["build_peak_init"] <= 0.6 * full_params, (r["build_peak_init"], full_params)
        assert r["build_peak_whole"] > 0.6 * full_params  # the limit means something
        assert r["empty_after_build"]
        assert set(r["shapes"].values()) == {(MEM_D, MEM_D), (MEM_D,)}
        # training: sharded states plus the units gathered at a time, against a whole run
        assert r["train_peak_init"] <= 0.6 * stage0_state, (r["train_peak_init"], stage0_state)
        assert r["train_peak_stage0"] > 0.6 * stage0_state



def test_init_does_not_change_values(world2):
    rs = results(world2, "init_memory")
    state = same_on_every_rank(rs, "state_init")
    for r in rs:
        # rank r seeded with r under zerocore.init: rank 0's values, exactly as a whole build
        assert r["losses_init"] == r["losses_whole"]
        for k, v in r["state_whole"].items():
            assert torch.equal(state[k], v), k
        assert_losses(r["losses_init"], r["losses_stage0"])



# -- 2. the in-place-after-partition trap, and the way out ----------------------------------------------
def test_change_after_partition_raises_naming_the_parameter(world2):
    for r in results(world2, "init_trap"):
        assert r["parent"] is not None and "'child.weight'" in r["parent"] and "modified in place" in r["parent"]
        assert "zerocore.gathered" in r["parent"]
        assert r["tinygpt"] is not None and "'tok.weight'" in r["tinygpt"]
        assert r["inplace"] is not None and "'blocks.2.bias'" in r["inplace"]
        assert r["assign"] is not None and "'blocks.2.weight'" in r["assign"] and ".data replaced" in r["assign"]



def test_parent_initializing_a_child_just_built_works(world2):
    # nn.MultiheadAttention zeroes out_proj.bias in its own __init__: not lost, not an error
    rs = results(world2, "init_trap")
    state = same_on_every_rank(rs, "blocks_state")
    ref = rs[0]["blocks_ref"]
    assert state.keys() == ref.keys()
    for k in ref:
        assert torch.equal(state[k], ref[k].float()), k
    assert torch.count_nonzero(state["0.attn.out_proj.bias"]) == 0
    assert torch.count_nonzero(state["0.attn.out_proj.weight"]) > 0



def test_read_only_gathered_edit_of_an_init_parameter_is_discarded_with_a_warning(world2):
    for r in results(world2, "init_trap"):
        assert len(r["loose_warned"]) == 1
        assert "parameter of shape (32, 32) inside a block without modifier_rank" in r["loose_warned"][0]
        assert "enable_sanity_checks" in r["loose_raised"] and "parameter of shape (32, 32)" in r["loose_raised"]


def test_gathered_modifier_fixes_the_trap(world2):
    rs = results(world2, "init_trap")
    state = same_on_every_rank(rs, "fixed_state")
    ref = rs[0]["ref_state"]
    for r in rs:
        assert r["fixed_empty"]
    for k in ref:  # rank 0's normal_ draw (std 0.3), on every rank, exactly
        assert torch.equal(state[k], ref[k]), k
    assert 0.2 < state["child.weight"].std() < 0.4
    assert_losses(rs[0]["fixed_losses"], rs[0]["ref_losses"])



def test_over_nccl_parameters_built_on_the_host_go_to_the_gpu(monkeypatch):
    # NCCL's collectives take device tensors only: zerocore.init without a device moves what the host built to this
    # rank's GPU before the broadcast that partitions it (as DeepSpeed's zero.Init places it); gloo: as made
    import types

    from zerocore.runtime.partition_init import collective_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device(types.SimpleNamespace(backend="nccl")) == torch.device("cuda", 3)
    assert collective_device(types.SimpleNamespace(backend="gloo")) is None
