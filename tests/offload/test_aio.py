"""NVMe I/O engine (zerocore.ops.AsyncIO): round trips through every backend and queue shape,
unaligned sizes/offsets/memory, many requests in flight, error paths, the O_DIRECT fallback,
config mapping. Files live under pytest's tmp_path (ext4 here, so O_DIRECT is real)."""
from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from zerocore.ops import aio as zaio

REASON = zaio.aio_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"zerocore was built without NVMe I/O: {REASON}")

BACKENDS = [b for b, why in zaio.available_backends().items() if why is None] if REASON is None else []
# (block_size, queue_depth, threads, single_submit, overlap_events)
SHAPES = [(4096, 1, 1, False, True), (65536, 4, 2, False, True), (1 << 20, 8, 1, False, True),
          (1 << 20, 16, 3, True, False)]
DTYPES = [torch.float32, torch.bfloat16, torch.uint8]
SIZES = [1, 4095, 4096, 4097, (1 << 20) + 3]  # elements


def random_tensor(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return torch.randn(n, generator=g).to(dtype)


def buffer(n: int, dtype: torch.dtype, memory: str) -> torch.Tensor:
    """'aligned': page-aligned, locked; 'shifted': one element past a page boundary (forces
    the bounce path); 'torch': whatever torch.empty gives."""
    if memory == "aligned":
        t = zaio.aligned_pinned_empty(n, dtype)
        assert t.data_ptr() % 4096 == 0
        return t
    if memory == "shifted":
        t = zaio.aligned_pinned_empty(n + 1, dtype)[1:]
        assert t.data_ptr() % 4096 != 0
        return t
    return torch.empty(n, dtype=dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


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


@pytest.mark.parametrize("kwargs, exc, word", [
    (dict(block_size=1000), ValueError, "block_size"),
    (dict(block_size=0), ValueError, "block_size"),
    (dict(block_size="1M"), TypeError, "block_size"),
    (dict(queue_depth=0), ValueError, "queue_depth"),
    (dict(threads=0), ValueError, "threads"),
    (dict(threads=True), TypeError, "threads"),
    (dict(backend="posix"), ValueError, "backend"),
    (dict(direct="maybe"), ValueError, "direct"),
    (dict(single_submit=1), TypeError, "single_submit"),
])
def test_bad_options(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        zaio.AsyncIO(**kwargs)


def test_bad_arguments(tmp_path):
    h = zaio.AsyncIO()
    t = torch.empty(10, 10)
    with pytest.raises(TypeError, match="tensor"):
        h.async_pwrite([1, 2], tmp_path / "x")
    with pytest.raises(ValueError, match="contiguous"):
        h.async_pwrite(t.t(), tmp_path / "x")
    with pytest.raises(ValueError, match="offset"):
        h.async_pwrite(t, tmp_path / "x", -1)
    with pytest.raises(TypeError, match="offset"):
        h.async_pwrite(t, tmp_path / "x", 1.5)
    with pytest.raises(TypeError, match="path"):
        h.async_pwrite(t, 42)
    with pytest.raises(ValueError, match="path"):
        h.async_pwrite(t, "")
    for nul in (str(tmp_path / "a\0b"), os.fsencode(tmp_path / "a\0b")):  # would write to .../a
        with pytest.raises(ValueError, match="NUL byte"):
            h.sync_pwrite(t, nul)
    assert not (tmp_path / "a").exists()
    for off in (2**63, 2**63 - 1, 2**64):  # past int64 with the tensor's bytes: named, not wrapped
        with pytest.raises(ValueError, match="offset"):
            h.async_pwrite(t, tmp_path / "x", off)
    with pytest.raises(TypeError, match="offset"):
        h.async_pwrite(t, tmp_path / "x", 1.0)
    # The native layer checks too (someone calling the binding directly).
    with pytest.raises(ValueError, match="contiguous"):
        h._engine.submit(True, t.t(), str(tmp_path / "x"), 0)
    with pytest.raises(ValueError, match="offset"):
        h._engine.submit(True, t, str(tmp_path / "x"), -5)
    assert h.wait() == 0
    h.close()
    assert h.pending == 0
    with pytest.raises(ValueError, match="closed"):
        h.async_pwrite(t, tmp_path / "x")
    with pytest.raises(ValueError, match="closed"):
        h.wait()


def test_explicit_backends_and_auto():
    usable = zaio.available_backends()
    assert set(usable) == {"libaio", "io_uring", "threadpool"} and usable["threadpool"] is None  # always built
    assert zaio.AsyncIO(backend="auto").backend == next(b for b in zaio.AUTO_ORDER if usable[b] is None)
    for b in BACKENDS:
        assert zaio.AsyncIO(backend=b).backend == b


# Buffers and logging -------------------------------------------------------------------------


def test_aligned_pinned_empty():
    for shape, dtype in [(1, torch.float32), ((3, 5), torch.bfloat16), (4097, torch.uint8), (0, torch.float16),
                         ([2, 2, 2], torch.int64)]:
        t = zaio.aligned_pinned_empty(shape, dtype)
        assert t.data_ptr() % 4096 == 0 and t.dtype == dtype and t.device.type == "cpu"
        assert tuple(t.shape) == ((shape,) if isinstance(shape, int) else tuple(shape))
        t.fill_(1)  # writable
    with pytest.raises(TypeError, match="shape"):
        zaio.aligned_pinned_empty(-1)
    with pytest.raises(TypeError, match="dtype"):
        zaio.aligned_pinned_empty(3, "float32")
    from zerocore.ops import AsyncIO, aligned_pinned_empty  # exported
    assert AsyncIO is zaio.AsyncIO and aligned_pinned_empty is zaio.aligned_pinned_empty
    h = AsyncIO()
    t = h.new_cpu_locked_tensor(100, torch.empty(1, dtype=torch.bfloat16))
    assert t.dtype == torch.bfloat16 and t.numel() == 100 and t.data_ptr() % 4096 == 0


def test_unaligned_tensor_logged_once_at_debug(tmp_path, caplog):
    h = zaio.AsyncIO()
    shifted = buffer(1000, torch.float32, "shifted")
    with caplog.at_level(logging.DEBUG, logger="zerocore.ops"):
        h.async_pwrite(shifted, tmp_path / "a.bin")
        h.async_pwrite(shifted, tmp_path / "b.bin")
        h.async_pwrite(buffer(1000, torch.float32, "aligned"), tmp_path / "c.bin")
        assert h.wait() == 3
    msgs = [r.getMessage() for r in caplog.records if "bounce" in r.getMessage()]
    assert len(msgs) == 1 and all(r.levelno == logging.DEBUG for r in caplog.records if "bounce" in r.getMessage())


# Config ---------------------------------------------------------------------------------------


def test_from_config_defaults_and_mapping():
    h = zaio.AsyncIO.from_config({})
    assert (h.block_size, h.queue_depth, h.threads, h.single_submit, h.overlap_events) == (1 << 20, 8, 1, False, True)
    h = zaio.AsyncIO.from_config({"block_size": 262144, "queue_depth": 32, "intra_op_parallelism": 2,
                                  "single_submit": True, "overlap_events": False})
    assert (h.block_size, h.queue_depth, h.threads, h.single_submit, h.overlap_events) == (262144, 32, 2, True, False)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_intra_op_parallelism(), h.get_thread_count(),
            h.get_single_submit(), h.get_overlap_events()) == (262144, 32, 2, 2, True, False)
    assert zaio.AsyncIO.from_config({"thread_count": 3}).threads == 3
    assert zaio.AsyncIO.from_config({"aio": {"queue_depth": 4}, "train_batch_size": 8}).queue_depth == 4
    assert zaio.config_to_kwargs({"block_size": 1048576.0})["block_size"] == 1048576.0
    assert zaio.AsyncIO.from_config({"block_size": 1048576.0}).block_size == 1048576
    assert zaio.AsyncIO.from_config(None, queue_depth=2).queue_depth == 2


def test_from_config_errors_name_the_key():
    with pytest.warns(UserWarning, match="use_gds"):
        zaio.AsyncIO.from_config({"use_gds": False})
    with pytest.raises(ValueError, match="intra_op_parallelism.*thread_count"):
        zaio.AsyncIO.from_config({"intra_op_parallelism": 2, "thread_count": 4})
    with pytest.raises(TypeError, match="aio config: queue_depth"):
        zaio.AsyncIO.from_config({"queue_depth": "8"})
    with pytest.raises(ValueError, match="aio config: thread_count"):
        zaio.AsyncIO.from_config({"thread_count": 0})
    with pytest.raises(TypeError, match="overlap_events"):
        zaio.AsyncIO.from_config({"overlap_events": "yes"})
    with pytest.raises(ValueError, match="block_size"):
        zaio.AsyncIO.from_config({"block_size": 1000})
    with pytest.raises(TypeError, match="mapping"):
        zaio.AsyncIO.from_config([("block_size", 4096)])


# Build configuration ----------------------------------------------------------------------------


def test_build_spec_reports_why_aio_is_missing(monkeypatch):
    from zerocore.ops import build_spec

    cfg = build_spec.aio_config(build_spec.repo_root())
    assert cfg["unavailable"] is None and ("ZEROCORE_WITH_AIO", None) in cfg["define_macros"]
    assert "csrc/bindings_aio.cpp" in cfg["sources"]
    assert any(a.endswith("libaio.a") for a in cfg["extra_link_args"])  # static: no libaio.so at run time
    for src in cfg["sources"]:
        assert os.path.exists(os.path.join(build_spec.repo_root(), src)), src
    monkeypatch.setenv("ZEROCORE_AIO", "0")
    assert "ZEROCORE_AIO=0" in build_spec.aio_config(build_spec.repo_root())["unavailable"]
    monkeypatch.delenv("ZEROCORE_AIO")
    real = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if "libaio" in str(p) else real(p))
    cfg = build_spec.aio_config(build_spec.repo_root())  # a machine without libaio's headers
    assert cfg["unavailable"] is None and "csrc/aio/threadpool_context.cpp" in cfg["sources"]
    assert "csrc/aio/libaio_context.cpp" not in cfg["sources"] and not any("libaio" in a for a in cfg["extra_link_args"])
    assert "libaio-dev" in cfg["backends_unavailable"]["libaio"]
    full = build_spec.extension_config(build_spec.repo_root())
    assert "libaio-dev" in full["unavailable"]["aio.libaio"] and "aio" not in full["unavailable"]
    monkeypatch.setattr(os.path, "exists", real)
    monkeypatch.setenv("ZEROCORE_LIBAIO", "0")
    monkeypatch.setenv("ZEROCORE_URING", "0")
    cfg = build_spec.aio_config(build_spec.repo_root())
    assert cfg["extra_link_args"] == [] and ("ZEROCORE_WITH_AIO", None) in cfg["define_macros"]
    assert cfg["backends_unavailable"] == {"libaio": "left out of this build by ZEROCORE_LIBAIO=0",
                                           "io_uring": "left out of this build by ZEROCORE_URING=0"}


def test_extension_needs_no_system_libaio():
    import zerocore

    so = [f for f in os.listdir(os.path.dirname(zerocore.__file__)) if f.startswith("_C") and f.endswith(".so")]
    if not so:
        pytest.skip("no prebuilt zerocore._C (JIT build)")
    out = subprocess.run(["ldd", os.path.join(os.path.dirname(zerocore.__file__), so[0])], capture_output=True,
                         text=True).stdout
    assert "libaio" not in out and "liburing" not in out, out


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
