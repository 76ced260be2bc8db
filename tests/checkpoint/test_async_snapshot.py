"""An asynchronous save copies the state on its own thread: ``save_checkpoint(async_save=True)``
returns before the copy is done, the engine's next ``step`` waits for it, and the checkpoint holds
the state of the call (optimizer moments included), however soon training changes it. A copy that
fails in the background is raised by ``wait()`` and publishes nothing."""
from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers

import zerocore  # noqa: E402
from zerocore.checkpoint import async_save, blockio, save  # noqa: E402
from checkpoint_helpers import CkCase, train  # noqa: E402
from dist_helpers import make_model  # noqa: E402

CASE = CkCase("async_snapshot", dtype="bf16", model="mlp", stage=2, lr=3e-3)


def _state(e) -> list[dict]:
    return [{k: v.detach().cpu().clone() for k, v in st.items()}
            for shard in e.shards for _, _, st in shard.state_tiles(1 << 12)]


def test_the_checkpoint_holds_the_state_of_the_call_and_step_waits_for_the_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(blockio, "BLOCK_BYTES", 4096)
    e = zerocore.initialize(make_model("mlp", 5), CASE.config(2, 1))
    fresh = zerocore.initialize(make_model("mlp", 0), CASE.config(2, 1))
    # the background copy is held until the test lets it go: the call must return before it
    gate, copying = threading.Event(), threading.Event()
    plain = async_save._write_rank

    def held(*a, **kw):
        copying.set()
        assert gate.wait(30)
        return plain(*a, **kw)

    monkeypatch.setattr(async_save, "_write_rank", held)
    try:
        train(e, CASE, 0, 1, 0, 2)
        want = _state(e)
        handle = e.save_checkpoint(str(tmp_path), tag="t", async_save=True)
        assert copying.wait(30) and not handle.snapshot.is_set()  # returned with the copy still to do
        stepped = threading.Thread(target=train, args=(e, CASE, 0, 1, 2, 3))
        stepped.start()
        stepped.join(0.5)
        assert stepped.is_alive(), "the step waits for the copy before it changes the state"
        gate.set()
        stepped.join(60)
        assert not stepped.is_alive()
        handle.wait()
        assert any(not torch.equal(x["exp_avg"], y["exp_avg"]) for x, y in zip(_state(e), want))  # it did step
        fresh.load_checkpoint(str(tmp_path), tag="t")
        got = _state(fresh)
        assert len(got) == len(want)
        for x, y in zip(got, want):
            for k in y:
                assert torch.equal(x[k], y[k]), k
    finally:
        gate.set()
        e.destroy()
        fresh.destroy()


def test_a_copy_that_fails_in_the_background_is_raised_by_wait_and_publishes_nothing(tmp_path, monkeypatch):
    e = zerocore.initialize(make_model("mlp", 5), CASE.config(2, 1))

    def fail(rank, what):
        raise OSError(f"no more memory while copying {what}")

    try:
        train(e, CASE, 0, 1, 0, 1)
        monkeypatch.setattr(save, "between_writes", fail)
        handle = e.save_checkpoint(str(tmp_path), tag="t", async_save=True)
        with pytest.raises(OSError, match="no more memory while copying group 0 master"):
            handle.wait()
        assert not (tmp_path / "t").exists() and not (tmp_path / "latest").exists()
        monkeypatch.setattr(save, "between_writes", None)
        train(e, CASE, 0, 1, 1, 2)  # training goes on: the step does not wait for a copy that ended
        with pytest.warns(RuntimeWarning, match="left by an interrupted save"):  # the failed one's directory
            e.save_checkpoint(str(tmp_path), tag="t", async_save=True).wait()
        assert (tmp_path / "t" / "manifest.json").exists()
    finally:
        e.destroy()
