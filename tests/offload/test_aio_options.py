"""The NVMe I/O engine's (zerocore.ops.AsyncIO) options, arguments and setup: bad options and
arguments named, explicit backends and "auto", page-aligned locked buffers, the bounce path logged
once, the config mapping (DeepSpeed's aio section) and its errors, and the build configuration
(why aio is missing, no system libaio needed at run time). Round trips: tests/offload/test_aio.py."""
from __future__ import annotations

import logging
import os
import subprocess

import pytest
import torch

from aio_helpers import BACKENDS, REASON, buffer
from zerocore.ops import aio as zaio

pytestmark = pytest.mark.skipif(REASON is not None, reason=f"zerocore was built without NVMe I/O: {REASON}")


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

