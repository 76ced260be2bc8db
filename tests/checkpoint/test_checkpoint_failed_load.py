"""A load that fails changes nothing: a checkpoint with a flipped byte (in the last block, so a
load that wrote as it read would already have overwritten state), a truncated file, another
model, or a corrupt file that only the other rank reads is refused with an error naming the
file, and the engine's weights, optimizer state (also on NVMe), counters, lr, loss scale and RNG
stay bit-identical; training then goes on exactly as a twin engine that never tried the load.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

import zerocore
from zerocore.checkpoint import blockio, staging
from checkpoint_helpers import CkCase, result, spawn, train
from dist_helpers import make_model

CASE = CkCase("failed", dtype="bf16", model="mlp", stage=2, lr=3e-3)
SMALL_BLOCK = 4096  # checksum blocks: the model's state spans several, so state precedes the flipped one


def snapshot(e) -> dict:
    """Everything a load may change, copied."""
    state = [{k: v.detach().cpu().clone() for k, v in st.items()}
             for shard in e.shards for _, _, st in shard.state_tiles(1 << 12)]
    return {"weights": {k: v.clone() for k, v in e.full_state_dict().items()},
            "module": {k: v.detach().clone() for k, v in e.module.state_dict().items()}, "state": state,
            "counters": (e.micro_steps, e.global_steps, e.optimizer_steps, e.skipped_steps),
            "lr": e.lr, "scale": e.loss_scale, "rng": torch.get_rng_state()}


def assert_same(a: dict, b: dict) -> None:
    assert a["counters"] == b["counters"] and a["lr"] == b["lr"] and a["scale"] == b["scale"]
    assert torch.equal(a["rng"], b["rng"])
    for part in ("weights", "module"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f"{part} {k} changed"
    assert len(a["state"]) == len(b["state"])
    for i, (x, y) in enumerate(zip(a["state"], b["state"])):
        for k in x:
            assert torch.equal(x[k], y[k]), f"optimizer state tile {i} {k} changed"


def damage(tag_dir: str, how: str, rank_file: str = "rank00000.bin", where: int = -1) -> str:
    f = os.path.join(tag_dir, rank_file)
    data = bytearray(open(f, "rb").read())
    if how == "flip":
        # by default the last block: a load that wrote as it read has overwritten all the state by
        # then; byte 0: the first block, before any good one
        data[where] ^= 0x10
    elif how == "truncate":
        data = data[:-100]
    with open(f, "wb") as fh:
        fh.write(bytes(data))
    return rank_file


def _config(placement: str, swap) -> dict:
    cfg = CASE.config(2, 1)
    if placement == "nvme":
        os.makedirs(swap, exist_ok=True)
        cfg["zero_optimization"].update(offload_optimizer={"device": "nvme", "nvme_path": str(swap)},
                                        sub_group_size=4096)
    return cfg


@pytest.mark.parametrize("how", ["flip", "truncate", "other model"])
@pytest.mark.parametrize("placement", ["device", "nvme"])
# the state read once into fresh staging, or into the buffers the engine keeps for asynchronous
# saves, or twice
@pytest.mark.parametrize("reads", ["staged", "held", "two-pass"])
def test_failed_load_leaves_the_engine_as_it_was(tmp_path, monkeypatch, how, placement, reads):
    monkeypatch.setattr(blockio, "BLOCK_BYTES", SMALL_BLOCK)
    monkeypatch.setattr(staging, "STAGING_BYTES", 0 if reads == "two-pass" else None)
    ck = tmp_path / "ck"
    if how == "other model":
        from torch import nn

        other = zerocore.initialize(nn.Sequential(nn.Linear(7, 3)), CASE.config(2, 1))
        other.save_checkpoint(str(tmp_path / "other"), tag="t")
        other.destroy()
    src = zerocore.initialize(make_model("mlp", 5), _config(placement, tmp_path / "swap_src"))
    train(src, CASE, 0, 1, 0, 3)  # another run: its checkpoint differs from the engine under test everywhere
    src.save_checkpoint(str(ck), tag="t")
    src.destroy()
    e = zerocore.initialize(make_model("mlp", 0), _config(placement, tmp_path / "swap_a"))
    twin = zerocore.initialize(make_model("mlp", 0), _config(placement, tmp_path / "swap_b"))
    try:
        train(e, CASE, 0, 1, 0, 2)
        train(twin, CASE, 0, 1, 0, 2)
        if reads == "held":
            e.save_checkpoint(str(tmp_path / "own"), tag="a", async_save=True).wait()
            assert staging.held_buffers(e)
        before = snapshot(e)
        if how == "other model":
            with pytest.raises(zerocore.checkpoint.CheckpointError, match="different model"):
                e.load_checkpoint(str(tmp_path / "other"), tag="t")
        else:
            name = damage(str(ck / "t"), how)
            with pytest.raises(Exception, match=name) as info:
                e.load_checkpoint(str(ck), tag="t")
            assert "overwritten" not in str(info.value)
        assert_same(snapshot(e), before)
        a, b = train(e, CASE, 0, 1, 2, 4), train(twin, CASE, 0, 1, 2, 4)
        assert a == b  # losses, lrs, scales, norms of the next steps
        assert_same(snapshot(e), snapshot(twin))
    finally:
        e.destroy()
        twin.destroy()


def _other_rank_corrupt(root: str, where, rank: int, world: int) -> dict:
    """World 2: rank 1's file has a flipped byte (at ``where``); rank 0's reads are all good, and
    it must not write them either."""
    blockio.BLOCK_BYTES = SMALL_BLOCK
    src = zerocore.initialize(make_model("mlp", 5), CASE.config(2, world))
    train(src, CASE, rank, world, 0, 3)
    src.save_checkpoint(root, tag="t")
    src.reducer.remove_hooks()
    e = zerocore.initialize(make_model("mlp", 0), CASE.config(2, world))
    twin = zerocore.initialize(make_model("mlp", 0), CASE.config(2, world))
    train(e, CASE, rank, world, 0, 2)
    train(twin, CASE, rank, world, 0, 2)
    if rank == 0:
        damage(os.path.join(root, "t"), "flip", "rank00001.bin", where)
    dist.barrier()
    before = snapshot(e)
    try:
        e.load_checkpoint(root, tag="t")
        error = None
    except Exception as exc:  # noqa: BLE001 - the message is checked by the test
        error = str(exc)
    after = snapshot(e)
    a, b = train(e, CASE, rank, world, 2, 4), train(twin, CASE, rank, world, 2, 4)
    out = {"load_error": error, "before": before, "after": after, "a": a, "b": b, "e": snapshot(e), "twin": snapshot(twin)}
    e.reducer.remove_hooks()
    twin.reducer.remove_hooks()
    return out


# the file's last block (read last) or its first
@pytest.mark.parametrize("where", [-1, 0])
def test_a_corrupt_file_of_another_rank_changes_no_rank(tmp_path, where):
    root, work = tmp_path / "ck", tmp_path / "w2"
    os.makedirs(root)
    os.makedirs(work)
    runs = result(spawn([("run", _other_rank_corrupt, (str(root), where))], 2, work, timeout=300), "run")
    assert "rank00001.bin" in runs[1]["load_error"] and "corrupt: bytes" in runs[1]["load_error"]
    assert ("bytes 0-" in runs[1]["load_error"]) == (where == 0)  # the blocks before a later one were good
    assert "other rank(s) failed" in runs[0]["load_error"] and "unchanged" in runs[0]["load_error"]
    for r in runs:
        assert_same(r["after"], r["before"])
        assert r["a"] == r["b"]
        assert_same(r["e"], r["twin"])
    shutil.rmtree(root)


def test_a_checkpoint_with_zlib_checksums_still_loads(tmp_path, monkeypatch):
    """Checkpoints written before CRC32C (format version 1: zlib's CRC-32 per block) still load,
    verified: a flipped byte in one is refused too."""
    import json
    import zlib

    monkeypatch.setattr(blockio, "BLOCK_BYTES", SMALL_BLOCK)
    e = zerocore.initialize(make_model("mlp", 5), CASE.config(2, 1))
    train(e, CASE, 0, 1, 0, 2)
    e.save_checkpoint(str(tmp_path), tag="t")
    want = snapshot(e)
    e.destroy()
    mpath = tmp_path / "t" / "manifest.json"
    m = json.loads(mpath.read_text())
    m["version"] = 1
    for name, rec in m["files"].items():
        data = (tmp_path / "t" / name).read_bytes()
        rec["crc32"] = [zlib.crc32(data[i:i + rec["block"]]) for i in range(0, len(data), rec["block"])]
        del rec["crc32c"]
    mpath.write_text(json.dumps(m))
    e2 = zerocore.initialize(make_model("mlp", 0), CASE.config(2, 1))
    try:
        e2.load_checkpoint(str(tmp_path), tag="t")
        got = snapshot(e2)
        for k in want["weights"]:
            assert torch.equal(got["weights"][k], want["weights"][k]), k
        for x, y in zip(got["state"], want["state"]):
            assert all(torch.equal(x[k], y[k]) for k in x)
        damage(str(tmp_path / "t"), "flip")
        with pytest.raises(blockio.ChecksumError, match="rank00000.bin is corrupt"):
            e2.load_checkpoint(str(tmp_path), tag="t")
    finally:
        e2.destroy()
