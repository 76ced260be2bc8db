"""Checkpoints of stage 3 with partitioned frozen parameters (tests/frozen_models.py's LoRA-shaped
model): each rank writes its chunks of them (manifest version 3: extras in chunks), and the
checkpoint loads at stage 3 and stage 2, at world 2 and world 1, synchronously or asynchronously
saved, and consolidates offline; a stage-2 checkpoint (frozen parameters saved whole) loads into
stage 3's chunks. The frozen values saved are not the initial ones (rank 0 edited one under
``zerocore.gathered``), so a load that skipped them would show.

Two spawns (world 2, then world 1 reading what world 2 saved); the tests check what they returned.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import zerocore
from frozen_models import config, frozen_net, train
from stage3_ranks import results, spawn
from zerocore.checkpoint.offline import load_full_state_dict

DIR = "ZC_TEST_FROZEN_CKPT"  # where the scenarios save and load (inherited by the spawned ranks)


def _saved_engine(rank: int, world: int, stage: int = 3, async_save: bool = False):
    model = frozen_net()
    engine = zerocore.initialize(model, config(stage))
    train(engine, 2, rank, world)
    with zerocore.gathered([model.blocks[1].base.weight], modifier_rank=0):  # frozen values unlike a fresh model's
        with torch.no_grad():
            model.blocks[1].base.weight.mul_(-2.0)
    path = os.path.join(os.environ[DIR], f"s{stage}{'a' if async_save else ''}")
    h = engine.save_checkpoint(path, async_save=async_save)
    if async_save:
        h.wait()
    return engine, path


def _load(stage: int, path: str, rank: int, world: int) -> dict:
    engine = zerocore.initialize(frozen_net(seed=1), config(stage))  # other initial values everywhere
    engine.load_checkpoint(path)
    out = {"state": engine.full_state_dict(), "losses": train(engine, 2, rank, world, first=2)[0]}
    engine.destroy()
    return out


def _load_frozen(stage: int, path: str, **kw) -> dict:
    """An engine that trains nothing (an evaluation) reads the training checkpoint's weights: the frozen ones from
    its frozen tensors, the trained ones from their fp32 masters."""
    engine = zerocore.initialize(frozen_net(seed=1), config(stage), frozen=True)
    engine.load_checkpoint(path, **kw)
    out = engine.full_state_dict()
    engine.destroy()
    return out


def sc_save_and_reload(rank: int, world: int) -> dict:
    out = {}
    for async_save in (False, True):
        engine, path = _saved_engine(rank, world, async_save=async_save)
        key = "async" if async_save else "sync"
        out[f"{key}_saved"] = engine.full_state_dict()
        out[f"{key}_continued"] = train(engine, 2, rank, world, first=2)[0]
        engine.destroy()
        for stage in (3, 2):
            out[f"{key}_load{stage}"] = _load(stage, path, rank, world)
    out["frozen_load3"], out["frozen_load2"] = _load_frozen(3, path, load_module_only=True), _load_frozen(2, path)
    return out


def sc_stage2_into_stage3(rank: int, world: int) -> dict:
    engine, path = _saved_engine(rank, world, stage=2)
    out = {"saved": engine.full_state_dict(), "continued": train(engine, 2, rank, world, first=2)[0]}
    engine.destroy()
    out["load3"] = _load(3, path, rank, world)
    return out


def sc_world1_loads(rank: int, world: int) -> dict:
    path = os.path.join(os.environ[DIR], "s3")
    return {**{f"load{stage}": _load(stage, path, rank, world) for stage in (3, 2)},
            "frozen_load3": _load_frozen(3, path)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("frozen_ckpt")
    os.environ[DIR] = str(d)
    (d / "w2").mkdir()
    (d / "w1").mkdir()
    try:
        w2 = spawn([sc_save_and_reload, sc_stage2_into_stage3], 2, d / "w2", timeout=240)
        w1 = spawn([sc_world1_loads], 1, d / "w1")
    finally:
        del os.environ[DIR]
    return d, w2, w1


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_each_rank_writes_its_chunks_of_frozen_parameters(saved):
    d, _, _ = saved
    with open(os.path.join(d, "s3", "global_step2", "manifest.json")) as f:
        m = json.load(f)
    assert m["version"] == 3
    chunked = {e["name"]: e for e in m["extras"] if "chunks" in e}
    assert "blocks.1.base.weight" in chunked and "embed.weight" in chunked
    for e in chunked.values():
        assert e["kind"] == "frozen"
        n, pos = 1, 0
        for s in e["shape"]:
            n *= s
        for a, b, _, _ in sorted(e["chunks"]):  # the chunks cover the parameter, in order, once
            assert a == pos
            pos = b
        assert pos == n
    # the owners wrote them: a weight across both ranks' chunks comes from both files
    assert {c[2] for c in chunked["blocks.1.base.weight"]["chunks"]} == {"rank00000.bin", "rank00001.bin"}
    whole = [e for e in m["extras"] if "chunks" not in e]
    assert {e["name"] for e in whole} >= {"norm.weight", "blocks.0.base.bias"}  # persistent: whole, by rank 0
    with open(os.path.join(d, "s2", "global_step2", "manifest.json")) as f:
        assert json.load(f)["version"] == 2  # nothing chunked: readable by an older zerocore


@pytest.mark.parametrize("key", ["sync", "async"])
def test_world2_reloads_at_stage_3_and_2(saved, key):
    _, w2, _ = saved
    rs = results(w2, "save_and_reload")
    init = frozen_net().state_dict()
    for r in rs:
        assert not torch.equal(r[f"{key}_saved"]["blocks.1.base.weight"], init["blocks.1.base.weight"])
        for stage in (3, 2):
            _same(r[f"{key}_load{stage}"]["state"], r[f"{key}_saved"])
            assert r[f"{key}_load{stage}"]["losses"] == r[f"{key}_continued"], stage


def test_world1_loads_what_world2_saved(saved):
    _, w2, w1 = saved
    want = results(w2, "save_and_reload")[0]["sync_saved"]
    (r,) = results(w1, "world1_loads")
    for stage in (3, 2):
        _same(r[f"load{stage}"]["state"], want)


def test_an_engine_that_trains_nothing_loads_the_trained_weights(saved):
    _, w2, w1 = saved
    for r in results(w2, "save_and_reload"):
        for stage in (3, 2):  # at world 2: stage 3's chunks (each rank its pieces of the masters), stage 2 whole
            _same(r[f"frozen_load{stage}"], r["async_saved"])  # (the last one saved: the same model as sync's)
    _same(results(w1, "world1_loads")[0]["frozen_load3"], results(w2, "save_and_reload")[0]["sync_saved"])


def test_stage2_checkpoint_loads_into_stage3_chunks(saved):
    _, w2, _ = saved
    for r in results(w2, "stage2_into_stage3"):
        _same(r["load3"]["state"], r["saved"])
        assert r["load3"]["losses"] == r["continued"]


def test_offline_consolidation_reads_the_chunks(saved):
    d, w2, _ = saved
    want = results(w2, "save_and_reload")[0]["sync_saved"]
    _same(load_full_state_dict(os.path.join(d, "s3")), want)


def test_a_missing_chunk_is_named_before_anything_is_loaded(saved, tmp_path):
    import shutil

    from zerocore.checkpoint import CheckpointError

    d, _, _ = saved
    bad = tmp_path / "bad"
    shutil.copytree(os.path.join(d, "s3"), bad)
    path = bad / "global_step2" / "manifest.json"
    m = json.loads(path.read_text())
    e = next(e for e in m["extras"] if e["name"] == "blocks.1.base.weight")
    e["chunks"] = sorted(e["chunks"])[:-1]  # the last rank's part is gone
    path.write_text(json.dumps(m))
    engine = zerocore.initialize(frozen_net(seed=1), config(3))
    before = engine.full_state_dict()
    with pytest.raises(CheckpointError, match="blocks.1.base.weight"):
        engine.load_checkpoint(str(bad))
    _same(engine.full_state_dict(), before)
    engine.destroy()
