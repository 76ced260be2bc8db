"""ZeRO stage 3 on 1, 2 and 4 gloo ranks against one process training the same model with
torch.optim.AdamW (the tolerances of test_stages.py: fp32 elementwise rtol 1e-5 with the
whole-tensor relative-delta fallback for near-zero-gradient elements, bf16 <= 0.15 / fp16
<= 0.03 relative update error, the global gradient norm every step).

The models cover what stage 3 must survive: units chosen by size and by class, units nested in
units, a module called twice in one forward, a parameter read by a module that does not own
it (NestedNet's head reads the input layer's weight), tied embeddings (TinyGPT), frozen and
unused parameters, persistent small parameters, accumulation and clipping, prefetch on and
off, reuse, eval-mode no-grad generation after training. Memory: bytes held between steps
against 16 psi / N, and the peak gathered during forward (sampled at every module's hooks)
against the two largest units.
"""
from __future__ import annotations

import pytest
import torch

from dist_helpers import Case, case_results, make_model, run_case, spawn_cases
from test_stages import check_against_reference
from zerocore.runtime.memory import formula_bytes

SIZE = {"stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 100}
NESTED_CLASSES = {"stage3_param_persistence_threshold": 0, "stage3_unit_classes": ["Middle", "Inner", "Head"]}
# mlp_big's three Linear units: 525822, 523264 and 34304 elements; a prefetch window of one
# unit ahead keeps at most two units gathered
MEMORY = {"stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 100,
          "stage3_prefetch_bucket_size": 530_000}

W2 = [
    Case("gpt_size_units_generate", "gpt", 3, zero=SIZE, generate=True),
    Case("gpt_block_units_persistent_bf16", "gpt", 3, dtype="bf16", lr=3e-3,
         zero={"stage3_unit_classes": ["Block"], "stage3_param_persistence_threshold": 300}),
    Case("gpt_acc2_clip_no_prefetch", "gpt", 3, gas=2, clip=0.05, zero={**SIZE, "stage3_prefetch_bucket_size": 0}),
    Case("gpt_reuse_distance", "gpt", 3, zero={**SIZE, "stage3_max_reuse_distance": 10**9}),
    Case("gpt_fp16", "gpt", 3, dtype="fp16", lr=3e-3, zero=SIZE, fp16={"initial_scale_power": 10}),
    Case("gpt_no_divergence_check", "gpt", 3, zero={**SIZE, "stage3_check_divergence": False}),
    Case("mlp_acc4_clip_frozen_unused", "mlp_frozen_unused", 3, gas=4, clip=0.05, zero=SIZE),
    Case("nested_by_class_generate", "nested", 3, zero=NESTED_CLASSES, generate=True),
    Case("nested_by_size_acc2", "nested", 3, gas=2, zero=SIZE, generate=True),
    Case("order_changes_every_step", "swap", 3, zero=SIZE),
    Case("gpt_activation_checkpointing_acc2", "gpt_ckpt", 3, gas=2, zero={**SIZE, "stage3_unit_classes": ["Block"]}),
    # bf16 on this model puts one bias at 0.18 relative update error at stage 2 too (the dtype, not
    # the sharding): compared with stage 2 instead, which must give the same bits
    Case("nested_by_size_bf16", "nested", 3, dtype="bf16", lr=3e-3, zero=SIZE),
    Case("nested_stage2_bf16", "nested", 2, dtype="bf16", lr=3e-3),
    Case("memory_bf16", "mlp_big", 3, dtype="bf16", memory_only=True, sample_peak=True, zero=MEMORY, overlap=True),
    Case("memory_fp32", "mlp_big", 3, memory_only=True, sample_peak=True, zero=MEMORY, overlap=True),
]
W4 = [
    Case("gpt_size_units", "gpt", 3, zero=SIZE),
    Case("nested_by_size_acc2_clip", "nested", 3, gas=2, clip=0.05, zero=SIZE, generate=True),
    Case("gpt_block_units_bf16", "gpt", 3, dtype="bf16", lr=3e-3, zero={"stage3_unit_classes": ["Block"]}),
    Case("memory_bf16", "mlp_big", 3, dtype="bf16", memory_only=True, sample_peak=True, zero=MEMORY, overlap=True),
]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn_cases(W2, 2, tmp_path_factory.mktemp("s3w2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return spawn_cases(W4, 4, tmp_path_factory.mktemp("s3w4"))


def check_generation(case: Case, per_rank: list[dict]):
    """The eval-mode outputs equal those of a plain model holding the engine's full weights."""
    model = make_model(case.model, case.seed)
    model.load_state_dict(per_rank[0]["state"])
    model.eval()
    tol = dict(rtol=1e-5, atol=1e-5) if case.dtype == "fp32" else dict(rtol=0.1, atol=0.1)
    for r in per_rank:
        assert len(r["generated"]) >= 2
        for x, got in r["generated"]:
            with torch.no_grad():
                want = model(x.float() if x.is_floating_point() else x)
            torch.testing.assert_close(got, want.float(), **tol)


def test_bf16_stage3_gives_stage2_bits(world2):
    s3 = case_results(world2, W2, "nested_by_size_bf16")
    s2 = case_results(world2, W2, "nested_stage2_bf16")
    for a, b in zip(s3, s2):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        for k in b["state"]:
            assert torch.equal(a["state"][k], b["state"][k]), k


@pytest.mark.parametrize("case", [c for c in W2 if not c.memory_only and c.stage == 3 and "bf16" not in c.name
                                  or c.name == "gpt_block_units_persistent_bf16"], ids=lambda c: c.name)
def test_world2_matches_adamw(world2, case):
    per_rank = case_results(world2, W2, case.name)
    check_against_reference(case, 2, per_rank)
    if case.generate:
        check_generation(case, per_rank)


@pytest.mark.parametrize("case", [c for c in W4 if not c.memory_only], ids=lambda c: c.name)
def test_world4_matches_adamw(world4, case):
    per_rank = case_results(world4, W4, case.name)
    check_against_reference(case, 4, per_rank)
    if case.generate:
        check_generation(case, per_rank)


def test_world1_matches_adamw():
    case = Case("gpt_world1", "gpt", 3, zero=SIZE, steps=4, generate=True)
    r = run_case(case, 0, 1)
    check_against_reference(case, 1, [r])
    check_generation(case, [r])


def test_units_are_really_partitioned(world2):
    """Not a stage-2 run in disguise: every unit's parameters are sharded between steps."""
    for name in ("gpt_size_units_generate", "nested_by_size_acc2"):
        for r in case_results(world2, W2, name):
            mem = r["memory"]
            assert mem["gathered"] == 0
            assert r["groups"] >= 3
            # 16-bit/fp32 params held = the owned chunks only (fp32 here: 4 bytes / param / rank)
            assert mem["params"] <= 4 * r["padded"] / 2 * 1.001


@pytest.mark.parametrize("world", [2, 4])
def test_memory_between_steps_matches_16_psi_over_n(world2, world4, world):
    results, cases = (world2, W2) if world == 2 else (world4, W4)
    for r in case_results(results, cases, "memory_bf16"):
        mem, psi = r["memory"], r["numel"]
        assert mem["gathered"] == 0  # nothing stays gathered between steps
        assert mem["buckets"] == 0  # transient buckets live only during backward
        want = formula_bytes(psi, world, 3, half=True) + mem["buckets"]
        assert abs(mem["total"] - want) <= 0.05 * want, (mem, want)
        for role, per_param in (("params", 2), ("grads", 2), ("master", 4), ("exp_avg", 4), ("exp_avg_sq", 4)):
            assert abs(mem[role] - per_param * psi / world) <= 0.05 * per_param * psi / world, role
        # an independent count of every tensor alive (garbage collector)
        # (64 KB either way: the collector sees only storages some Python object holds, a C++-held one it
        # misses; one run counted 14 KB less than the engine reports, and passed when run again)
        assert mem["total"] - 64 * 1024 <= r["gc_bytes"] <= mem["total"] * 1.01 + 64 * 1024


def test_memory_fp32_master_is_the_partition(world2):
    r = case_results(world2, W2, "memory_fp32")[0]
    mem, psi = r["memory"], r["numel"]
    assert mem["master"] == 0  # fp32: the owned chunk is the master
    want = formula_bytes(psi, 2, 3, half=False) + mem["buckets"]
    assert abs(mem["total"] - want) <= 0.05 * want


@pytest.mark.parametrize("world", [2, 4])
def test_peak_during_forward_is_two_units(world2, world4, world):
    """With a prefetch window of one unit, at most the running unit and the next are gathered:
    sampled at every module's forward hooks, from the tensors held."""
    results, cases = (world2, W2) if world == 2 else (world4, W4)
    units = sorted([525822, 523264, 34304], reverse=True)
    for r in case_results(results, cases, "memory_bf16"):
        pad = 32 * world
        two_largest = sum(-(-n // pad) * pad for n in units[:2]) * 2  # bf16
        peak = r["peaks"]["gathered"]
        assert -(-units[0] // pad) * pad * 2 <= peak <= two_largest, (peak, two_largest)
        # everything alive at any forward hook (gc count, activations of a 2-row batch included)
        sharded = r["memory"]["total"]
        assert r["peaks"]["gc"] <= sharded + two_largest + 256 * 1024, (r["peaks"], sharded)


def _tiny_engine(zero: dict, dtype: str = "fp32"):
    import zerocore

    model = make_model("gpt", 0)
    cfg = {"zero_optimization": {"stage": 3, **SIZE, **zero}, "bf16": {"enabled": dtype == "bf16"},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    return zerocore.initialize(model, cfg)


def _train(engine, steps: int = 3):
    from dist_helpers import loss_fn, make_batch

    for s in range(steps):
        x, y = make_batch("gpt", s, 4, 0)
        engine.backward(loss_fn("gpt", engine(x), y))
        engine.step()


def test_sub_group_size_tiles_the_step_without_changing_it():
    a, b = _tiny_engine({}), _tiny_engine({"sub_group_size": 100})
    assert b.shards[0].tile == 100 and b.shards[0].master.numel() > 100
    _train(a)
    _train(b)
    sa, sb = a.full_state_dict(), b.full_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_save_16bit_model_needs_the_stage3_key_and_writes_atomically(tmp_path):
    engine = _tiny_engine({}, dtype="bf16")
    _train(engine, 1)
    with pytest.raises(RuntimeError, match="stage3_gather_16bit_weights_on_model_save"):
        engine.save_16bit_model(str(tmp_path))
    assert not list(tmp_path.iterdir())
    engine = _tiny_engine({"stage3_gather_16bit_weights_on_model_save": True}, dtype="bf16")
    _train(engine, 1)
    assert engine.save_16bit_model(str(tmp_path), "m.bin")
    saved = torch.load(tmp_path / "m.bin")
    assert [p.name for p in tmp_path.iterdir()] == ["m.bin"]  # no temporary file left
    full = engine.full_state_dict()
    assert saved.keys() == full.keys() and saved["tok.weight"].dtype == torch.bfloat16
    assert saved["tok.weight"] is not None and torch.equal(saved["head.weight"], saved["tok.weight"])
    torch.testing.assert_close(saved["tok.weight"].float(), full["tok.weight"], rtol=1e-2, atol=1e-2)


def test_parameters_are_empty_between_steps_and_unit_classes_are_checked():
    import zerocore

    engine = _tiny_engine({})
    _train(engine, 1)
    assert engine.module.blocks[0].mlp[0].weight.numel() == 0  # sharded: DeepSpeed's empty placeholder
    assert engine.module.blocks[0].mlp[0].weight.grad is None
    with pytest.raises(ValueError, match="stage3_unit_classes.*NoSuchBlock.*Block"):
        zerocore.initialize(make_model("gpt", 0), {"zero_optimization": {"stage": 3,
                                                                         "stage3_unit_classes": ["NoSuchBlock"]}})
