"""The divergence guard's shared-memory header exchange (zerocore/comm/shm_headers.py): every rank's fields in rank
order across thousands of exchanges (the two records per rank reused by parity), a record read half-written is read
again, a peer that never publishes is a timeout, a peer that exited is named well before the timeout, ranks that
cannot all map the page (another host) fall back to gloo together, and the engines' guard uses it on one host.
"""
from __future__ import annotations

import json
import mmap
import os
import socket
import sys
import time

import pytest
import torch.distributed as dist

from zerocore.comm.shm_headers import HeaderTimeout, PeerExited, ShmHeaders, _check, _start_time

if not sys.platform.startswith("linux"):
    pytest.skip("shared-memory headers are used on Linux only", allow_module_level=True)

from forked_ranks import start_ranks  # noqa: E402
from stage3_ranks import results, spawn  # noqa: E402


def _ours() -> set:
    return {f for f in os.listdir("/dev/shm") if f.startswith("zerocore-headers-")}


def sc_many(rank: int, world: int) -> dict:
    before = _ours()
    shm = ShmHeaders.create(dist.group.WORLD, rank, world, 5)
    dist.barrier()  # (rank 0 unlinks it after the others have mapped it, maybe a moment after they return)
    left = _ours() - before
    bad = []
    for i in range(3000):
        rows = shm.exchange([i, rank, i * world + rank, -i, 7], 30.0)
        want = [[i, r, i * world + r, -i, 7] for r in range(world)]
        if rows != want:
            bad.append((i, rows))
    shm.close()
    return {"made": True, "bad": bad[:3], "left": sorted(left)}


def sc_timeout(rank: int, world: int) -> dict:
    """Rank 1 publishes nothing: rank 0 gives up after its deadline; then both go on."""
    shm = ShmHeaders.create(dist.group.WORLD, rank, world, 5)
    out = {"error": None}
    t0 = time.monotonic()
    if rank == 0:
        try:
            shm.exchange([1, 2, 3, 4, 5], 1.5)
        except HeaderTimeout as e:
            out["error"] = str(e)
    out["seconds"] = time.monotonic() - t0
    dist.barrier()
    shm.close()
    return out


def sc_other_host(rank: int, world: int) -> dict:
    """A rank on another host name: no rank uses the page, and nothing is left in /dev/shm."""
    real = socket.gethostname
    socket.gethostname = (lambda: "elsewhere") if rank == 1 else real
    try:
        shm = ShmHeaders.create(dist.group.WORLD, rank, world, 5)
    finally:
        socket.gethostname = real
    return {"none": shm is None}


def _peer_exits(rank: int, world: int, tmp: str) -> None:
    """Rank 1 exits between two exchanges without a word; rank 0 writes what its second exchange raised."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
    shm = ShmHeaders.create(dist.group.WORLD, rank, world, 5)
    shm.exchange([0] * 5, 30.0)
    if rank == 1:
        os._exit(0)
    out = {"error": None}
    t0 = time.monotonic()
    try:
        shm.exchange([1] * 5, 60.0)
    except PeerExited as e:
        out["error"] = str(e)
    out["seconds"] = time.monotonic() - t0
    with open(os.path.join(tmp, "rank0.json"), "w") as f:
        json.dump(out, f)
    os._exit(0)  # (its group's peer is gone: no teardown to wait for)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn([sc_many, sc_timeout, sc_other_host], 2, tmp_path_factory.mktemp("shm2"))


def test_every_rank_gets_every_ranks_fields_in_rank_order(world2, tmp_path):
    for r in results(world2, "many"):
        assert r["made"] and r["bad"] == [] and r["left"] == []
    for r in results(spawn([sc_many], 3, tmp_path), "many"):
        assert r["made"] and r["bad"] == [] and r["left"] == []


def test_a_rank_that_never_publishes_is_a_timeout(world2):
    r0, r1 = results(world2, "timeout")
    assert r0["error"] is not None and "ranks [1] did not publish exchange #1 within 1.5 s" in r0["error"]
    assert 1.4 < r0["seconds"] < 10
    assert r1["error"] is None


def test_another_host_falls_back_on_every_rank(world2):
    assert all(r["none"] for r in results(world2, "other_host"))


def test_a_peer_that_exited_is_named_before_the_timeout(tmp_path):
    start_ranks(_peer_exits, (2, str(tmp_path)), 2, join=True)
    with open(tmp_path / "rank0.json") as f:
        r0 = json.load(f)
    assert r0["error"] is not None and r0["error"].startswith("rank 1 (pid ") and "exited" in r0["error"], r0
    assert r0["seconds"] < 5  # the deadline was 60 s


def test_a_half_written_record_is_read_again():
    """One process, two ranks' views of one page: rank 1's record with a check that does not match its fields is
    not taken (a torn read), the same record with the right check is."""
    world, width = 2, 5
    page = mmap.mmap(-1, world * 2 * (width + 2) * 8)
    me = ShmHeaders(page, 0, world, width, [os.getpid()] * 2, [_start_time(os.getpid())] * 2)  # (both: this one)
    other = me._buf[1, 1]
    other[:] = [1, 9, 9, 9, 9, 9, _check(1, [9, 9, 9, 9, 8])]  # fields and check disagree
    with pytest.raises(HeaderTimeout):
        me.exchange([1, 2, 3, 4, 5], 0.2)
    me.number = 0  # (the timed-out exchange is tried again)
    other[-1] = _check(1, [9, 9, 9, 9, 9])
    assert me.exchange([1, 2, 3, 4, 5], 5.0) == [[1, 2, 3, 4, 5], [9, 9, 9, 9, 9]]
