"""A load reads each block of its state once when the state fits the staging budget (verified
in staging, then copied into the engine after the ranks agree), twice when it does not (verify
everything, then read again tile by tile); both give the engine exactly the saved state."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers

import zerocore  # noqa: E402
from zerocore.checkpoint import blockio, staging  # noqa: E402
from checkpoint_helpers import CkCase, train  # noqa: E402
from dist_helpers import make_model  # noqa: E402

CASE = CkCase("read_once", dtype="bf16", model="mlp", stage=2, lr=3e-3)
SMALL_BLOCK = 4096


def _state(e) -> list[dict]:
    return [{k: v.detach().cpu().clone() for k, v in st.items()}
            for shard in e.shards for _, _, st in shard.state_tiles(1 << 12)]


def _count_reads(monkeypatch) -> dict:
    """Bytes each checkpoint file was read by Fetch.run (whole blocks), per file name."""
    seen: dict[str, int] = {}
    plain = blockio.Fetch.run

    def run(self, *a, **kw):
        for name, lo, hi in self._plan():
            seen[name] = seen.get(name, 0) + (hi - lo)
        return plain(self, *a, **kw)

    monkeypatch.setattr(blockio.Fetch, "run", run)
    return seen


def _count_allocations(monkeypatch) -> list:
    """Sizes of the staging regions and buffers allocated from now on."""
    sizes: list = []
    plain = staging.ops.aligned_pinned_empty

    def counted(n, *a, **kw):
        sizes.append(n)
        return plain(n, *a, **kw)

    monkeypatch.setattr(staging.ops, "aligned_pinned_empty", counted)
    return sizes


@pytest.mark.parametrize("budget,passes,held", [(None, 1, False), (None, 1, True), (0, 2, False)])
def test_state_is_read_once_when_it_fits_and_twice_when_not(tmp_path, monkeypatch, budget, passes, held):
    """``held``: the engine saved asynchronously before, so it keeps buffers; the load stages in
    them, allocating nothing, and keeps no more of them than before."""
    monkeypatch.setattr(blockio, "BLOCK_BYTES", SMALL_BLOCK)
    monkeypatch.setattr(staging, "STAGING_BYTES", budget)
    src = zerocore.initialize(make_model("mlp", 5), CASE.config(2, 1))
    e = zerocore.initialize(make_model("mlp", 0), CASE.config(2, 1))
    try:
        train(src, CASE, 0, 1, 0, 3)
        src.save_checkpoint(str(tmp_path), tag="t")
        want_state, want_weights = _state(src), src.full_state_dict()
        train(e, CASE, 0, 1, 0, 1)
        if held:
            e.save_checkpoint(str(tmp_path / "own"), tag="a", async_save=True).wait()
            kept = [b.data_ptr() for b in staging.held_buffers(e)]
            assert kept
            fresh = _count_allocations(monkeypatch)
        seen = _count_reads(monkeypatch)
        e.load_checkpoint(str(tmp_path), tag="t")
        if held:
            assert fresh == [], "the load staged in the buffers the engine keeps"
            assert sorted(b.data_ptr() for b in staging.held_buffers(e)) == sorted(kept)
        size = os.path.getsize(tmp_path / "t" / "rank00000.bin")
        state_bytes = sum(s.master.numel() for s in src.shards) * 12
        # the state once (or twice) plus the small pieces (frozen tensors, client state) once
        assert passes * state_bytes <= seen["rank00000.bin"] <= passes * state_bytes + size - state_bytes \
            + 2 * SMALL_BLOCK * passes
        got_state, got_weights = _state(e), e.full_state_dict()
        assert len(got_state) == len(want_state)
        for x, y in zip(got_state, want_state):
            for k in x:
                assert torch.equal(x[k], y[k]), k
        for k in want_weights:
            assert torch.equal(got_weights[k], want_weights[k]), k
        # and training goes on as the source does
        assert train(e, CASE, 0, 1, 3, 5) == train(src, CASE, 0, 1, 3, 5)
    finally:
        src.destroy()
        e.destroy()


def test_staging_slices_are_aligned_and_bounded():
    a = staging.Arena(3 * 4096 + 10)
    x, y = a.take(100), a.take(4096)
    assert x.data_ptr() % staging.ALIGN == 0 and y.data_ptr() % staging.ALIGN == 0
    a.take(4096 + 10)
    with pytest.raises(MemoryError):
        a.take(1)
    a.free()


def test_held_staging_uses_the_kept_buffers_then_fresh_ones_and_keeps_no_more():
    piece = 3 * 4096
    held = [staging.ops.aligned_pinned_empty(piece, torch.uint8, lock=False) for _ in range(2)]
    ptrs = sorted(b.data_ptr() for b in held)
    a = staging.HeldArena(held, piece)
    # three reads of a piece, one larger than a buffer (a checkpoint with larger blocks): fresh for the last two
    assert a.fresh_bytes([piece, 100, piece, 2 * piece + 1]) == piece + staging.padded(2 * piece + 1)
    views = [a.take(piece), a.take(100), a.take(piece), a.take(2 * piece + 1)]
    assert [v.numel() for v in views] == [piece, 100, piece, 2 * piece + 1]
    assert all(v.data_ptr() % staging.ALIGN == 0 for v in views)
    assert sorted(v.data_ptr() for v in views[:2]) == ptrs and held == []
    a.free()
    assert len(held) == 2  # as many as before: the fresh one beyond is dropped
    assert sorted(b.data_ptr() for b in held) == ptrs  # the engine's own buffers, taken first, come back
