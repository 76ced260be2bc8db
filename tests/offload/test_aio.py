"""NVMe I/O engine (zerocore.ops.AsyncIO): round trips through every backend and queue shape,
unaligned sizes/offsets/memory, many requests in flight, error paths, the O_DIRECT fallback.
Files live under pytest's tmp_path (ext4 here, so O_DIRECT is real). Options, arguments, buffers,
the config mapping and the build: tests/offload/test_aio_options.py."""
from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from aio_helpers import BACKENDS, REASON, buffer, random_tensor, same_bytes
from zerocore.ops import aio as zaio

pytestmark = pytest.mark.skipif(REASON is not None, reason=f"zerocore was built without NVMe I/O: {REASON}")

# (block_size, queue_depth, threads, single_submit, overlap_events)
SHAPES = [(4096, 1, 1, False, True), (65536, 4, 2, False, True), (1 << 20, 8, 1, False, True),
          (1 << 20, 16, 3, True, False)]
DTYPES = [torch.float32, torch.bfloat16, torch.uint8]
SIZES = [1, 4095, 4096, 4097, (1 << 20) + 3]  # elements


@pytest.fixture(scope="module", params=[(b, s) for b in BACKENDS for s in SHAPES],
                ids=lambda p: f"{p[0]}-bs{p[1][0]}-qd{p[1][1]}-t{p[1][2]}{'-single' if p[1][3] else ''}")
def handle(request):
    backend, (bs, qd, threads, single, overlap) = request.param
    h = zaio.AsyncIO(bs, qd, threads, backend=backend, single_submit=single, overlap_events=overlap)
    assert h.backend == backend
    yield h
    h.close()


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", [0, 12345])
def test_round_trip(handle, tmp_path, dtype, n, offset):
    src_mem, dst_mem = ("aligned", "shifted") if (n + offset) % 2 else ("shifted", "torch")
    src = buffer(n, dtype, src_mem)
    src.copy_(random_tensor(n, dtype, seed=n + offset))
    path = tmp_path / "rt.bin"
    handle.async_pwrite(src, path, offset)
    assert handle.wait() == 1
    nbytes = n * src.element_size()
    assert os.path.getsize(path) == offset + nbytes  # no padding left behind
    if offset:
        with open(path, "rb") as f:
            assert f.read(offset) == bytes(offset)  # the hole before the data reads as zeros
    dst = buffer(n, dtype, dst_mem)
    dst.view(torch.uint8).fill_(0xA5)
    handle.async_pread(dst, path, offset)
    assert handle.wait() == 1
    assert same_bytes(src, dst)
    with open(path, "rb") as f:  # and what is on disk is exactly the tensor's bytes
        f.seek(offset)
        assert f.read() == src.view(torch.uint8).numpy().tobytes()
    assert handle.pending == 0


def test_64mib(backend, tmp_path):
    h = zaio.AsyncIO(1 << 20, 8, 2, backend=backend)
    src = zaio.aligned_pinned_empty(16 << 20, torch.float32)
    src.copy_(random_tensor(16 << 20, torch.float32, seed=3))
    path = tmp_path / "big.bin"
    assert h.sync_pwrite(src, path, 4096) == 64 << 20
    dst = torch.empty(16 << 20)  # torch memory: bounce path for a 64 MiB read
    assert h.sync_pread(dst, str(path), 4096) == 64 << 20
    assert torch.equal(src, dst)
    assert os.path.getsize(path) == (64 << 20) + 4096


def test_async_returns_before_the_transfer_ends(tmp_path):
    # 16 MiB in 4 KiB blocks one at a time: thousands of I/Os, far longer than a submit call.
    h = zaio.AsyncIO(4096, 1, 1)
    t = zaio.aligned_pinned_empty(4 << 20, torch.float32).fill_(1.5)
    h.async_pwrite(t, tmp_path / "slow.bin")
    assert h.pending == 1
    assert h.wait() == 1 and h.pending == 0


def test_many_requests_in_flight(backend, tmp_path):
    """Dozens of requests at once: many files, and pieces packed back to back at unaligned
    offsets in one file (neighbours share 4 KiB sectors), read back concurrently too."""
    h = zaio.AsyncIO(65536, 8, 2, backend=backend)
    tensors = [random_tensor(1000 + 3001 * i, [torch.float32, torch.bfloat16, torch.uint8][i % 3], seed=i)
               for i in range(48)]
    offsets, packed = [], 0
    for i, t in enumerate(tensors):
        if i % 2:
            h.async_pwrite(t, tmp_path / f"f{i}.bin", i)
            offsets.append(i)
        else:
            h.async_pwrite(t, tmp_path / "packed.bin", packed)
            offsets.append(packed)
            packed += t.numel() * t.element_size()
    assert h.wait() == len(tensors)
    assert os.path.getsize(tmp_path / "packed.bin") == packed
    back = [torch.empty_like(t) for t in tensors]
    for i, b in enumerate(back):
        h.async_pread(b, tmp_path / ("packed.bin" if i % 2 == 0 else f"f{i}.bin"), offsets[i])
    assert h.wait() == len(tensors)
    for i, (t, b) in enumerate(zip(tensors, back)):
        assert same_bytes(t, b), f"tensor {i} differs"


def test_interleaved_reads_and_writes_of_different_files(backend, tmp_path):
    h = zaio.AsyncIO(65536, 4, 2, backend=backend)
    old = [random_tensor(50_000 + 17 * i, torch.float32, seed=100 + i) for i in range(6)]
    for i, t in enumerate(old):
        h.async_pwrite(t, tmp_path / f"old{i}.bin")
    assert h.wait() == 6
    new = [random_tensor(70_001 + 5 * i, torch.bfloat16, seed=200 + i) for i in range(6)]
    back = [torch.empty_like(t) for t in old]
    for i in range(6):  # reads of old files and writes of new ones in flight together
        h.async_pread(back[i], tmp_path / f"old{i}.bin")
        h.async_pwrite(new[i], tmp_path / f"new{i}.bin", 100 * i)
    assert h.wait() == 12
    assert all(same_bytes(a, b) for a, b in zip(old, back))
    for i, t in enumerate(new):
        got = torch.empty_like(t)
        h.sync_pread(got, tmp_path / f"new{i}.bin", 100 * i)
        assert same_bytes(t, got)


def test_write_into_existing_file_keeps_neighbours(tmp_path):
    h = zaio.AsyncIO(8192, 4, 2)
    base = random_tensor(100_000, torch.uint8, seed=1)
    patch = random_tensor(20_001, torch.uint8, seed=2)
    path = tmp_path / "f.bin"
    h.sync_pwrite(base, path)
    h.sync_pwrite(patch, path, 3001)
    want = base.clone()
    want[3001:3001 + patch.numel()] = patch
    got = torch.empty_like(base)
    h.sync_pread(got, path)
    assert torch.equal(got, want) and os.path.getsize(path) == base.numel()


def test_sync_calls_do_not_count_in_wait(tmp_path):
    h = zaio.AsyncIO()
    t = random_tensor(1000, torch.float32)
    assert h.sync_pwrite(t, tmp_path / "a.bin") == 4000
    h.async_pwrite(t, tmp_path / "b.bin")
    assert h.wait() == 1
    assert h.wait() == 0


def test_handle_dropped_with_requests_in_flight_finishes_them(tmp_path):
    h = zaio.AsyncIO(4096, 2, 1)
    t = random_tensor(1 << 20, torch.float32, seed=9)
    h.async_pwrite(t, tmp_path / "x.bin")
    del h
    gc.collect()
    got = torch.empty_like(t)
    zaio.AsyncIO().sync_pread(got, tmp_path / "x.bin")
    assert torch.equal(got, t)


def test_empty_tensor(tmp_path):
    h = zaio.AsyncIO()
    e = torch.empty(0)
    assert h.sync_pwrite(e, tmp_path / "empty.bin") == 0
    assert os.path.exists(tmp_path / "empty.bin") and os.path.getsize(tmp_path / "empty.bin") == 0
    assert h.sync_pread(e, tmp_path / "empty.bin") == 0


# Errors ------------------------------------------------------------------------------------


def assert_usable(h, tmp_path):
    t = random_tensor(5000, torch.float32, seed=5)
    h.async_pwrite(t, tmp_path / "after.bin", 7)
    assert h.wait() == 1
    got = torch.empty_like(t)
    h.sync_pread(got, tmp_path / "after.bin", 7)
    assert torch.equal(got, t) and h.pending == 0


def test_missing_file(backend, tmp_path):
    h = zaio.AsyncIO(backend=backend)
    t = torch.empty(100)
    path = tmp_path / "nope.bin"
    for call in (h.async_pread, h.sync_pread):
        with pytest.raises(FileNotFoundError) as e:
            call(t, path)
        assert e.value.filename == str(path)
    with pytest.raises(FileNotFoundError) as e:  # writing into a directory that does not exist
        h.async_pwrite(t, tmp_path / "no_dir" / "x.bin")
    assert e.value.filename == str(tmp_path / "no_dir" / "x.bin")
    assert h.wait() == 0
    assert_usable(h, tmp_path)


def test_read_past_end_of_file(backend, tmp_path):
    h = zaio.AsyncIO(backend=backend)
    path = tmp_path / "short.bin"
    h.sync_pwrite(torch.zeros(100, dtype=torch.uint8), path)
    for n, off in [(101, 0), (50, 51), (1, 100), (1 << 20, 4096)]:
        with pytest.raises(OSError) as e:
            h.async_pread(torch.empty(n, dtype=torch.uint8), path, off)
        msg = str(e.value)
        assert str(path) in msg and f"offset {off}" in msg and "end of the file" in msg, msg
    assert h.wait() == 0
    assert_usable(h, tmp_path)


def test_directory_as_file(backend, tmp_path):
    h = zaio.AsyncIO(backend=backend)
    t = torch.empty(100)
    for call in (h.async_pread, h.async_pwrite, h.sync_pread, h.sync_pwrite):
        with pytest.raises(IsADirectoryError) as e:
            call(t, tmp_path)
        assert e.value.filename == str(tmp_path)
    assert_usable(h, tmp_path)


def test_failure_during_transfer_is_raised_by_wait(tmp_path):
    """A write that hits the file-size limit (RLIMIT_FSIZE: a short write, then EFBIG) fails in
    the middle of the transfer: wait() raises it naming file, offset and errno text, and the
    handle goes on working. In a child process: the limit is per process."""
    code = textwrap.dedent(f"""
        import errno, resource, signal, torch
        from zerocore.ops import aio
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        for backend in {BACKENDS!r}:
            h = aio.AsyncIO(65536, 4, 2, backend=backend)
            path = {str(tmp_path)!r} + "/limited_" + backend
            h.async_pwrite(torch.ones(1 << 20), path)          # 4 MiB > 1 MiB limit
            h.async_pwrite(torch.ones(10), path + ".small")     # fine
            try:
                h.wait()
                raise SystemExit("no error")
            except OSError as e:
                assert e.errno == errno.EFBIG, e
                assert e.filename == path and "offset" in str(e) and "too large" in str(e), str(e)
            assert h.wait() == 0                               # the error was reported once
            t = torch.arange(1000.)
            h.sync_pwrite(t, path + ".after")
            u = torch.empty(1000)
            h.sync_pread(u, path + ".after")
            assert torch.equal(t, u)
            try:
                h.sync_pwrite(torch.ones(1 << 20), path + ".sync")
                raise SystemExit("no error")
            except OSError as e:
                assert e.errno == errno.EFBIG and e.filename == path + ".sync", e
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_odirect_refused_falls_back_or_errors(tmp_path, caplog):
    t = random_tensor(10_001, torch.float32, seed=4)
    lax = zaio.AsyncIO(direct="auto")
    lax._engine._simulate_no_direct(True)
    with caplog.at_level(logging.WARNING, logger="zerocore.ops"):
        lax.async_pwrite(t, tmp_path / "fb.bin", 3)
        lax.async_pwrite(t, tmp_path / "fb2.bin", 3)
        assert lax.wait() == 2
    warned = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(warned) == 1 and str(tmp_path / "fb.bin") in warned[0].getMessage()
    got = torch.empty_like(t)
    lax.sync_pread(got, tmp_path / "fb2.bin", 3)
    assert torch.equal(got, t)

    strict = zaio.AsyncIO(direct=True)
    strict._engine._simulate_no_direct(True)
    with pytest.raises(OSError) as e:
        strict.sync_pwrite(t, tmp_path / "strict.bin")
    assert e.value.filename == str(tmp_path / "strict.bin") and "O_DIRECT" in str(e.value)
    strict._engine._simulate_no_direct(False)
    assert_usable(strict, tmp_path)

    off = zaio.AsyncIO(direct=False)  # never asks for O_DIRECT: page cache, same results
    off.sync_pwrite(t, tmp_path / "off.bin", 5)
    got = torch.empty_like(t)
    off.sync_pread(got, tmp_path / "off.bin", 5)
    assert torch.equal(got, t)


def test_tmpfs(tmp_path):
    """tmpfs (/dev/shm) accepted O_DIRECT here; where it does not, direct='auto' falls back."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/zerocore_test_aio_{os.getpid()}.bin"
    try:
        h = zaio.AsyncIO()
        t = random_tensor(70_001, torch.bfloat16, seed=6)
        h.sync_pwrite(t, path, 1)
        got = torch.empty_like(t)
        h.sync_pread(got, path, 1)
        assert same_bytes(t, got)
    finally:
        if os.path.exists(path):
            os.unlink(path)


# Bigger sweep (not in the default run) ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("bs", [4096, 65536, 1 << 20, 8 << 20])
@pytest.mark.parametrize("qd", [1, 4, 32])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_sweep_64mib(backend, tmp_path, bs, qd, threads):
    h = zaio.AsyncIO(bs, qd, threads, backend=backend)
    n = (16 << 20) + 7
    src = random_tensor(n, torch.float32, seed=bs + qd + threads)
    path = tmp_path / "sweep.bin"
    h.async_pwrite(src, path, 4099)
    assert h.wait() == 1
    dst = zaio.aligned_pinned_empty(n, torch.float32)
    h.async_pread(dst, path, 4099)
    assert h.wait() == 1
    assert torch.equal(src, dst)
