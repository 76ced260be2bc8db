"""Stage 3 partitions frozen parameters (issue 34): a LoRA-shaped model (tests/frozen_models.py: a
frozen input layer, a frozen LayerNorm, blocks of a frozen base Linear plus a trainable low-rank
update, two blocks frozen whole, a trainable head) on spawned gloo ranks at world 1 and 2.

- exactness against one-process torch.optim.AdamW over the trainable parameters (accumulation 2,
  clipping): losses, the gradient norm of every step, every trainable tensor's delta; every frozen
  tensor unchanged bit for bit;
- bf16: stage 3 gives the same bits as stage 2 (where frozen parameters stay whole);
- what is held: each frozen weight only as this rank's chunk between uses (the parameter is the
  empty tensor), no gradient buffer or optimizer state for it, frozen bytes per rank from the
  tensors held; units with only frozen parameters gathered and freed like the others (at most two
  units gathered at once);
- with parameter offload the frozen chunks rest in host memory, and training is as exact;
- ``zerocore.gathered`` reads and edits a frozen parameter; ``destroy()`` gives it back whole;
  ``offload_states`` / ``reload_states`` move its chunk and bring it back bit for bit.
"""
from __future__ import annotations

import pytest
import torch

import zerocore
from frozen_models import batch, config, frozen_names, frozen_net, reference, train
from stage3_ranks import assert_losses, assert_states_close, results, spawn


def _facts(engine, model) -> dict:
    frozen = [p for p in model.parameters() if not p.requires_grad]
    held = {id(p) for g in engine.frozen_groups for p in g.params}
    return {
        "memory": engine.memory_report(),
        "frozen_groups": len(engine.frozen_groups),
        "frozen_elems_partitioned": sum(s.numel for g in engine.frozen_groups for s in g.layout.slots),
        "frozen_padded": sum(g.layout.padded for g in engine.frozen_groups),
        "frozen_whole_bytes": sum(p.numel() * p.element_size() for p in frozen if id(p) not in held),
        "empty_between_steps": all(p.numel() == 0 for p in frozen if id(p) in held),
        "frozen_in_trainable_groups": any(not p.requires_grad for g in engine.groups for p in g.params),
        "optimizer_elems": sum(s.master.numel() for s in engine.shards),
        "trainable_padded": sum(g.hi - g.lo for g in engine.groups),
        "peak_live": engine.gatherer.peak_live,
        "units": {u.name: u.padded for u in engine.gatherer.units},
        "unit_kinds": {u.name: (u.trains, u.extra is not None) for u in engine.gatherer.units},
    }


# -- scenarios (each runs on every rank; returns what the tests check) ---------------------------------
def sc_exact(rank: int, world: int) -> dict:
    model = frozen_net()
    engine = zerocore.initialize(model, config(gas=2, clip=0.5, stage3_prefetch_bucket_size=0))
    losses, norms = train(engine, 4, rank, world, gas=2)
    out = {"losses": losses, "norms": norms, "state": engine.full_state_dict(), **_facts(engine, model)}
    engine.destroy()
    return out


def sc_bf16_stage3_as_stage2(rank: int, world: int) -> dict:
    out = {}
    for stage in (2, 3):
        model = frozen_net()
        engine = zerocore.initialize(model, config(stage, "bf16"))
        out[f"losses{stage}"], out[f"norms{stage}"] = train(engine, 3, rank, world, dtype=torch.bfloat16)
        out[f"state{stage}"] = engine.full_state_dict()
        engine.destroy()
    return out


def sc_gathered_and_destroy(rank: int, world: int) -> dict:
    out = {}
    model = frozen_net()
    engine = zerocore.initialize(model, config())
    train(engine, 1, rank, world)
    w = model.blocks[0].base.weight  # frozen, partitioned
    before = engine.full_state_dict()
    with zerocore.gathered([w]) as (p,):
        out["read_equal"] = torch.equal(p.detach(), before["blocks.0.base.weight"])
    out["empty_after_read"] = w.numel() == 0
    # a unit's trainable and frozen groups are gathered together: a forward inside finds it whole
    x = batch(0, 2)[0]
    with torch.no_grad():
        want = engine(x)
        with zerocore.gathered([model.blocks[0].down.weight]):
            out["forward_inside_gathered"] = torch.equal(engine(x), want)
    with zerocore.gathered([w], modifier_rank=0):
        with torch.no_grad():
            w[0].fill_(0.25 if rank == 0 else -9.0)  # rank 0's edit is what counts
    out["edited"] = engine.full_state_dict()["blocks.0.base.weight"]
    out["losses_after_edit"], _ = train(engine, 2, rank, world, first=1)
    out["state_before_destroy"] = engine.full_state_dict()
    engine.destroy()
    out["given_back"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["requires_grad"] = {n: p.requires_grad for n, p in model.named_parameters()}
    return out


def sc_offload_states(rank: int, world: int) -> dict:
    out = {}
    for aside in (False, True):
        model = frozen_net()
        engine = zerocore.initialize(model, config())
        train(engine, 1, rank, world)
        if aside:
            engine.offload_states()
            out["chunks_moved"] = all(g.param_shard.untyped_storage().nbytes() == 0 for g in engine.frozen_groups)
            engine.reload_states()
        out[f"losses{aside}"], _ = train(engine, 2, rank, world, first=1)
        out[f"state{aside}"] = engine.full_state_dict()
        engine.destroy()
    return out


def sc_offload_param(rank: int, world: int) -> dict:
    """offload_param / offload_optimizer 'cpu': the frozen chunks rest in host memory too."""
    model = frozen_net()
    engine = zerocore.initialize(model, config(gas=2, clip=0.5, offload_param={"device": "cpu"},
                                               offload_optimizer={"device": "cpu"}))
    losses, norms = train(engine, 4, rank, world, gas=2)
    out = {"losses": losses, "norms": norms, "state": engine.full_state_dict(), **_facts(engine, model),
           "on_host": [g.params_on_host for g in engine.frozen_groups]}
    engine.destroy()
    return out


# kept whole by name (zero_optimization.stage3_persistent_param_names): a trainable weight and a frozen one, each
# above the persistence threshold, matched by a plain name and by a pattern
NAMED_WHOLE = {"head.weight": "head.weight", "blocks.3.base.weight": "blocks.3.*.weight"}


def sc_persistent_names(rank: int, world: int) -> dict:
    model = frozen_net()
    engine = zerocore.initialize(model, config(gas=2, clip=0.5, stage3_prefetch_bucket_size=0,
                                               stage3_persistent_param_names=sorted(set(NAMED_WHOLE.values()))))
    params = dict(model.named_parameters())
    grouped = {id(p) for g in engine.groups if not g.policy.keep_full_params for p in g.params}
    grouped |= {id(p) for g in engine.frozen_groups for p in g.params}
    out = {"whole_before": {n: tuple(params[n].shape) for n in NAMED_WHOLE},
           "in_unit_groups": [n for n in NAMED_WHOLE if id(params[n]) in grouped],
           "ds_persist": {n: bool(getattr(params[n], "ds_persist", False)) for n in NAMED_WHOLE}}
    out["losses"], out["norms"] = train(engine, 4, rank, world, gas=2)
    out["whole_after"] = {n: tuple(params[n].shape) for n in NAMED_WHOLE}
    out["state"] = engine.full_state_dict()
    engine.destroy()
    return out


W2 = [sc_exact, sc_bf16_stage3_as_stage2, sc_gathered_and_destroy, sc_offload_states, sc_offload_param,
      sc_persistent_names]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn(W2, 2, tmp_path_factory.mktemp("frozen_w2"), timeout=240)


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    return spawn([sc_exact], 1, tmp_path_factory.mktemp("frozen_w1"))


def _init_state() -> dict:
    return {k: v.detach().clone() for k, v in frozen_net().state_dict().items()}


@pytest.mark.parametrize("world", [1, 2])
def test_exact_against_adamw_with_a_frozen_part(world, world1, world2):
    rs = results(world2 if world == 2 else world1, "exact")
    ref = frozen_net()
    init = _init_state()
    want_losses, want_norms = reference(ref, 4, world, gas=2, clip=0.5)
    want = {k: v.detach() for k, v in ref.state_dict().items()}
    frozen = set(frozen_names(ref))
    for r in rs:
        assert_losses(r["losses"], want_losses)
        torch.testing.assert_close(torch.tensor(r["norms"], dtype=torch.float64),
                                   torch.tensor(want_norms, dtype=torch.float64), rtol=1e-5, atol=0)
        for name in frozen:
            assert torch.equal(r["state"][name], init[name]), f"frozen {name} moved"
        trained = {k: v for k, v in r["state"].items() if k not in frozen}
        assert_states_close(trained, {k: want[k] for k in trained}, {k: init[k] for k in trained})
        assert any(not torch.equal(r["state"][k], init[k]) for k in trained)  # training happened


@pytest.mark.parametrize("world", [1, 2])
def test_frozen_parameters_are_partitioned_and_never_trained(world, world1, world2):
    for r in results(world2 if world == 2 else world1, "exact"):
        assert r["frozen_groups"] == 5  # embed, blocks.0.base, blocks.3.base and the whole of blocks.1, blocks.2
        assert r["empty_between_steps"]
        assert not r["frozen_in_trainable_groups"]
        # no optimizer state, no gradient buffer for frozen bytes: only the trainable groups have them
        assert r["optimizer_elems"] == r["trainable_padded"]
        mem = r["memory"]
        assert mem["grads"] == r["trainable_padded"] * 4
        assert mem["frozen"] == r["frozen_padded"] * 4 // world + r["frozen_whole_bytes"]
        assert mem["gathered"] == 0  # nothing stays gathered between steps
        # prefetch off: at most two units at once (where one's backward ends as the next one's
        # begins), so blocks.2 and blocks.1 (only frozen parameters) were freed after their backward
        # (else blocks 2, 1 and 0 would be gathered together)
        units = sorted(r["units"].values())
        assert r["peak_live"] <= units[-1] + units[-2]
        kinds = r["unit_kinds"]
        assert kinds["embed"] == kinds["blocks.1"] == kinds["blocks.2"] == (False, False)
        assert kinds["blocks.0"] == (True, True)  # trainable low-rank update + the frozen base


def test_frozen_bytes_per_rank_halve_at_world_2(world1, world2):
    one = results(world1, "exact")[0]
    for r in results(world2, "exact"):
        part = r["frozen_elems_partitioned"] * 4
        assert r["memory"]["frozen"] - r["frozen_whole_bytes"] <= 0.55 * part
        assert one["memory"]["frozen"] - one["frozen_whole_bytes"] >= part


def test_bf16_stage3_gives_the_bits_of_stage2(world2):
    init = _init_state()
    for r in results(world2, "bf16_stage3_as_stage2"):
        assert r["losses3"] == r["losses2"] and r["norms3"] == r["norms2"]
        for k, v in r["state2"].items():
            assert torch.equal(r["state3"][k], v), k
        for k in frozen_names(frozen_net()):  # frozen: the initial value rounded to bf16, no more
            assert torch.equal(r["state3"][k], init[k].bfloat16().float()), k


def test_gathered_reads_and_edits_a_partitioned_frozen_parameter(world2):
    rs = results(world2, "gathered_and_destroy")
    for r in rs:
        assert r["read_equal"] and r["empty_after_read"] and r["forward_inside_gathered"]
        assert (r["edited"][0] == 0.25).all()
    assert all(torch.equal(rs[0]["edited"], r["edited"]) for r in rs)
    init = _init_state()
    torch.testing.assert_close(rs[0]["edited"][1:], init["blocks.0.base.weight"][1:], rtol=0, atol=0)


def test_destroy_gives_frozen_parameters_back_whole(world2):
    for r in results(world2, "gathered_and_destroy"):
        for name, value in r["given_back"].items():
            assert torch.equal(value, r["state_before_destroy"][name]), name
        assert {n for n, g in r["requires_grad"].items() if not g} == set(frozen_names(frozen_net()))


def test_offload_states_moves_frozen_chunks_and_back(world2):
    for r in results(world2, "offload_states"):
        assert r["chunks_moved"]  # every frozen chunk's bytes left the "device" (the CPU here)
        assert r["lossesTrue"] == r["lossesFalse"]
        for k, v in r["stateFalse"].items():
            assert torch.equal(r["stateTrue"][k], v), k


def test_parameter_offload_keeps_frozen_chunks_in_host_memory(world2):
    ref = frozen_net()
    init = _init_state()
    want_losses, want_norms = reference(ref, 4, 2, gas=2, clip=0.5)
    want = {k: v.detach() for k, v in ref.state_dict().items()}
    frozen = set(frozen_names(ref))
    for r in results(world2, "offload_param"):
        assert r["on_host"] and all(r["on_host"])
        assert r["memory"]["host_frozen"] == r["frozen_padded"] * 4 // 2  # the chunks, in host memory
        assert r["memory"]["frozen"] == r["frozen_whole_bytes"]  # only the whole ones stay where they were
        assert_losses(r["losses"], want_losses)
        torch.testing.assert_close(torch.tensor(r["norms"], dtype=torch.float64),
                                   torch.tensor(want_norms, dtype=torch.float64), rtol=1e-5, atol=0)
        for name in frozen:
            assert torch.equal(r["state"][name], init[name]), name
        trained = {k: v for k, v in r["state"].items() if k not in frozen}
        assert_states_close(trained, {k: want[k] for k in trained}, {k: init[k] for k in trained})


def test_frozen_partitioned_parameters_carry_deepspeeds_attributes():
    """Third-party code reads ds_numel/ds_tensor of every stage-3 parameter, frozen ones included."""
    from zerocore.runtime.ds_param_attrs import ZeroParamStatus

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    model[0].requires_grad_(False)
    engine = zerocore.initialize(model, {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    w = model[0].weight
    assert engine.frozen_groups and w.ds_numel == 64 * 64 and tuple(w.ds_shape) == (64, 64)
    assert not w.ds_persist and w.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert w.ds_tensor.numel() == 64 * 64  # world 1: this rank's part is the whole of it
    engine.destroy()


def test_parameters_named_persistent_stay_whole_and_train_exactly(world2):
    """zero_optimization.stage3_persistent_param_names: the named weights (one trained, one frozen) are never
    partitioned, whole on every rank between steps as inside them, and training is AdamW's as before."""
    ref = frozen_net()
    init = _init_state()
    want_losses, want_norms = reference(ref, 4, 2, gas=2, clip=0.5)
    want = {k: v.detach() for k, v in ref.state_dict().items()}
    shapes = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    frozen = set(frozen_names(ref))
    for r in results(world2, "persistent_names"):
        assert r["in_unit_groups"] == []
        for n in NAMED_WHOLE:
            assert r["whole_before"][n] == r["whole_after"][n] == shapes[n], n
            assert r["ds_persist"][n], n
        assert_losses(r["losses"], want_losses)
        torch.testing.assert_close(torch.tensor(r["norms"], dtype=torch.float64),
                                   torch.tensor(want_norms, dtype=torch.float64), rtol=1e-5, atol=0)
        assert torch.equal(r["state"]["blocks.3.base.weight"], init["blocks.3.base.weight"])
        trained = {k: v for k, v in r["state"].items() if k not in frozen}
        assert_states_close(trained, {k: want[k] for k in trained}, {k: init[k] for k in trained})


def test_a_persistent_name_matching_no_parameter_is_refused():
    from zerocore.config import ConfigError

    with pytest.raises(ConfigError, match=r"stage3_persistent_param_names: 'head\.weigth' matches no parameter"):
        zerocore.initialize(frozen_net(), config(stage3_persistent_param_names=["head.weigth"]))
    with pytest.raises(ConfigError, match="stage3_persistent_param_names"):
        zerocore.initialize(frozen_net(), config(stage3_persistent_param_names=[3]))
