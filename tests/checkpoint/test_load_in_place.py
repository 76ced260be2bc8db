"""Loads that read straight into the optimizer state (``checkpoint/load_in_place.py``).

- A resume (an engine that has not trained) reads in place: the state comes out bit-identical to
  a staged load's, and all but the partial end blocks go by O_DIRECT into the state (no copy), for
  a synchronous save (tiles placed by their memory), an asynchronous one (tiles placed on pages)
  and a checkpoint of another world size (pieces from several files at any offset).
- A trained engine (a step, a load, a ``gathered`` edit) stays staged by default: a failed load
  leaves it unchanged; ``in_place=True`` / ``False`` override.
- A failed in-place load says the state was partly overwritten; the weights are unchanged, and
  ``step()`` and ``save_checkpoint()`` refuse, naming the load, until a load succeeds; then
  training matches an engine that loaded the good checkpoint directly. With two ranks a corrupt
  file of one fails both.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import zerocore
from zerocore.checkpoint import CheckpointError, blockio, load_in_place
from checkpoint_helpers import CkCase, result, spawn, train
from dist_helpers import make_model

CASE = CkCase("in_place", dtype="bf16", model="mlp_big", stage=2, lr=3e-3)
BLOCK = 16 << 10  # checksum blocks: several per state tensor of this model (real ones have 16 per 16 MiB tile)


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setattr(blockio, "BLOCK_BYTES", BLOCK)


def _state(e) -> list[dict]:
    return [{k: v.clone() for k, v in st.items()} for s in e.shards for _, _, st in s.state_tiles(1 << 40)]


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in x:
            assert torch.equal(x[k], y[k]), k


class _Count:
    """Bytes a load copied out of pooled buffers and bytes it read into place (whole blocks)."""

    def __init__(self, monkeypatch):
        self.copied, self.direct, self.staged_loads = 0, 0, 0
        real_copy, real_into, real_run = blockio.Fetch.copy_into, blockio.read_into, blockio.Fetch.run

        def copy_into(fetch, name, off, out):
            self.copied += out.numel() * out.element_size()
            return real_copy(fetch, name, off, out)

        def read_into(files, handles, targets, piece_bytes=blockio.IO_BYTES):
            self.direct += sum(t.numel() for _, _, t in targets)
            return real_into(files, handles, targets, piece_bytes)

        monkeypatch.setattr(blockio.Fetch, "copy_into", copy_into)
        monkeypatch.setattr(zerocore.checkpoint.reader, "read_into", read_into)

    def in_place(self) -> int:
        return self.direct - self.copied  # copy_into also serves read_into's partial end blocks


def _engine(seed=0):
    return zerocore.initialize(make_model("mlp_big", seed), CASE.config(2, 1))


@pytest.mark.parametrize("save", ["sync", "async"])
def test_a_resume_reads_in_place_and_matches_a_staged_load(tmp_path, monkeypatch, save):
    src = _engine(5)
    train(src, CASE, 0, 1, 0, 2)
    if save == "sync":
        src.save_checkpoint(str(tmp_path), tag="t")
    else:
        src.save_checkpoint(str(tmp_path), tag="t", async_save=True).wait()
    want = _state(src)
    src.destroy()
    count = _Count(monkeypatch)
    a, b = _engine(), _engine()
    try:
        assert load_in_place.nothing_to_lose(a)
        a.load_checkpoint(str(tmp_path), tag="t")
        total = sum(t.numel() * 4 for st in want for t in st.values())
        assert 0.99 * total < count.direct <= total and count.in_place() > 0.9 * total, (count.direct, count.copied, total)
        count.direct = count.copied = 0
        b.load_checkpoint(str(tmp_path), tag="t", in_place=False)
        assert count.direct == 0 and count.copied > 0.99 * total  # staged: every byte copied into the state
        _same(_state(a), want)
        _same(_state(b), want)
        assert train(a, CASE, 0, 1, 2, 4) == train(b, CASE, 0, 1, 2, 4)
    finally:
        a.destroy()
        b.destroy()


def _damage_last_block(tag_dir) -> str:
    f = os.path.join(tag_dir, "rank00000.bin")
    data = bytearray(open(f, "rb").read())
    data[-1] ^= 0x10
    open(f, "wb").write(bytes(data))
    return f


def test_a_failed_in_place_load_refuses_to_train_until_a_load_succeeds(tmp_path, monkeypatch):
    src = _engine(5)
    train(src, CASE, 0, 1, 0, 2)
    src.save_checkpoint(str(tmp_path / "good"), tag="t")
    src.save_checkpoint(str(tmp_path / "bad"), tag="t")
    src.destroy()
    bad = _damage_last_block(tmp_path / "bad" / "t")
    e, twin = _engine(), _engine()
    try:
        weights = {k: v.clone() for k, v in e.module.state_dict().items()}
        with pytest.raises(CheckpointError, match="partly overwritten") as info:
            e.load_checkpoint(str(tmp_path / "bad"), tag="t")
        assert bad in str(info.value) and "corrupt" in str(info.value)
        for k, v in e.module.state_dict().items():
            assert torch.equal(v, weights[k]), f"weight {k} changed"
        assert e.optimizer_steps == 0
        with pytest.raises(CheckpointError, match=f"step\\(\\) refused: a load of {tmp_path / 'bad' / 't'} failed"):
            train(e, CASE, 0, 1, 0, 1)
        e.zero_grad()
        with pytest.raises(CheckpointError, match="save_checkpoint\\(\\) refused"):
            e.save_checkpoint(str(tmp_path / "never"), tag="t")
        assert not os.path.exists(tmp_path / "never" / "t")
        e.load_checkpoint(str(tmp_path / "good"), tag="t")  # in place again: still nothing to lose
        twin.load_checkpoint(str(tmp_path / "good"), tag="t", in_place=False)
        _same(_state(e), _state(twin))
        assert train(e, CASE, 0, 1, 2, 4) == train(twin, CASE, 0, 1, 2, 4)
    finally:
        e.destroy()
        twin.destroy()


@pytest.mark.parametrize("history", ["stepped", "loaded", "edited"])
def test_a_trained_engine_loads_staged_unless_told(tmp_path, monkeypatch, history):
    src = _engine(5)
    train(src, CASE, 0, 1, 0, 2)
    src.save_checkpoint(str(tmp_path / "good"), tag="t")
    src.save_checkpoint(str(tmp_path / "bad"), tag="t")
    src.destroy()
    _damage_last_block(tmp_path / "bad" / "t")
    e = _engine()
    try:
        if history == "stepped":
            train(e, CASE, 0, 1, 0, 1)
        elif history == "loaded":
            e.load_checkpoint(str(tmp_path / "good"), tag="t")
        else:
            with zerocore.gathered(list(e.module.parameters())[:1], modifier_rank=0) as (w,):
                w.mul_(0.5)
        assert not load_in_place.nothing_to_lose(e)
        before = _state(e)
        count = _Count(monkeypatch)
        with pytest.raises(blockio.ChecksumError) as info:  # staged: nothing was written
            e.load_checkpoint(str(tmp_path / "bad"), tag="t")
        assert "overwritten" not in str(info.value) and count.direct == 0
        _same(_state(e), before)
        e.load_checkpoint(str(tmp_path / "good"), tag="t", in_place=True)
        assert count.in_place() > 0
    finally:
        e.destroy()


def _two_ranks(root: str, rank: int, world: int) -> dict:
    """World 2 saves; world 2 resumes in place from a checkpoint whose rank-1 file is corrupt: every
    rank's load fails and its engine refuses to step; then both resume from a good one and match
    a world-1 engine that loaded it staged (pieces at any offset of two files)."""
    src = zerocore.initialize(make_model("mlp_big", 5), CASE.config(2, world))
    train(src, CASE, rank, world, 0, 2)
    src.save_checkpoint(os.path.join(root, "good"), tag="t")
    src.save_checkpoint(os.path.join(root, "bad"), tag="t")
    src.reducer.remove_hooks()
    if rank == 1:
        f = os.path.join(root, "bad", "t", "rank00001.bin")
        data = bytearray(open(f, "rb").read())
        data[len(data) // 2] ^= 1
        open(f, "wb").write(bytes(data))
    torch.distributed.barrier()
    e = zerocore.initialize(make_model("mlp_big", 0), CASE.config(2, world))
    try:
        e.load_checkpoint(os.path.join(root, "bad"), tag="t")
        error = None
    except CheckpointError as exc:
        error = str(exc)
    try:
        train(e, CASE, rank, world, 2, 3)
        refused = None
    except CheckpointError as exc:
        refused = str(exc)
    e.zero_grad()
    e.load_checkpoint(os.path.join(root, "good"), tag="t")
    out = {"load_error": error, "refused": refused, "weights": e.full_state_dict(),
           "norms": train(e, CASE, rank, world, 2, 4)["norms"]}
    e.reducer.remove_hooks()
    return out


def test_two_ranks_fail_together_and_resume_together(tmp_path):
    root, work = tmp_path / "ck", tmp_path / "w"
    os.makedirs(root)
    os.makedirs(work)
    runs = result(spawn([("run", _two_ranks, (str(root),))], 2, work, timeout=300), "run")
    assert "rank00001.bin is corrupt" in runs[1]["load_error"] and "partly overwritten" in runs[1]["load_error"]
    assert "other rank(s) failed" in runs[0]["load_error"] and "partly overwritten" in runs[0]["load_error"]
    for r in runs:
        assert "step() refused" in r["refused"]
    one = _engine()
    try:
        one.load_checkpoint(str(root / "good"), tag="t", in_place=False)  # world 2 -> 1, staged
        for k, v in one.full_state_dict().items():
            assert torch.equal(v, runs[0]["weights"][k]), k
        # the global gradient norm of the next steps (the same batches at any world size)
        assert train(one, CASE, 0, 1, 2, 4)["norms"] == pytest.approx(runs[0]["norms"], rel=1e-3)
    finally:
        one.destroy()
    shutil.rmtree(root)
