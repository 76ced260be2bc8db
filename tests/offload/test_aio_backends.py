"""The NVMe engine's I/O backends (libaio, io_uring, threadpool) are interchangeable (issue 13).

- AsyncIO round trips on every backend usable here, and on the thread pool with every
  pread/pwrite cut short (the kernel returning less than asked must be continued, not lost);
- ``aio.backend`` in the config picks the backend of NVMe offload and checkpoint I/O, 'auto'
  the first usable of ops.aio.AUTO_ORDER, an unknown name is an error naming the key;
- NVMe offload training (stages 2 and 3, world 1 and 2) is bit for bit the same on every
  backend: losses, per-step gradient norms, final parameters;
- the swap-file fault cases of test_offload_nvme.py (flipped byte, truncated file, full disk,
  read-only file system) run again with ``aio.backend: threadpool``: the machines without
  libaio/liburing headers run exactly that path.
Test-only and thread-pool-specific engine tests live in test_aio.py (every backend) and
csrc/aio/test_aio_native.cpp (ctest).
"""
from __future__ import annotations

import dataclasses
import errno
import os

import pytest
import torch

import test_offload_nvme as nv
import zerocore
from dist_helpers import case_results, spawn_cases
from test_offload import assert_same_bits
from zerocore.config import ConfigError
from zerocore.ops import aio as zaio

REASON = zaio.aio_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"zerocore was built without NVMe I/O: {REASON}")
USABLE = [b for b, why in zaio.available_backends().items() if why is None] if REASON is None else []


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# -- the engine --------------------------------------------------------------------------------
def test_threadpool_is_always_built_and_auto_picks_the_first_usable():
    usable = zaio.available_backends()
    assert set(usable) == {"libaio", "io_uring", "threadpool"} and usable["threadpool"] is None
    assert zaio.AUTO_ORDER[-1] == "threadpool"
    assert zaio.auto_backend(usable) == zaio.AsyncIO().backend
    assert zaio.auto_backend({"libaio": "not built", "io_uring": "disabled", "threadpool": None}) == "threadpool"
    assert zaio.auto_backend({"libaio": "not built", "io_uring": "disabled", "threadpool": "x"}) is None


def test_a_backend_left_out_of_the_build_is_reported_with_the_build_reason(monkeypatch):
    """What a machine without libaio/liburing headers shows: the build's reason per backend, the
    thread pool picked by 'auto', and `zerocore env` saying so."""
    from zerocore import env_report
    from zerocore.ops import _loader

    class NoKernelAio:  # the binding of such a build: only the thread pool makes a queue
        WITH_AIO = True

        @staticmethod
        def aio_backends():
            return {"libaio": "the libaio backend is not built into this zerocore", "io_uring": "not built",
                    "threadpool": None}

    monkeypatch.setattr(zaio, "_native", lambda: NoKernelAio)
    monkeypatch.setattr(_loader, "unavailable_parts", lambda: {
        "aio.libaio": "not built: libaio.h was not found at build time; install libaio-dev ...",
        "aio.io_uring": "left out of this build by ZEROCORE_URING=0"})
    usable = zaio.available_backends()
    assert "libaio.h was not found" in usable["libaio"] and "ZEROCORE_URING=0" in usable["io_uring"]
    assert zaio.auto_backend() == "threadpool"
    env = env_report.aio_backends()
    assert env["aio_backend"] == "threadpool" and env["aio_backend.threadpool"] == "usable"
    assert env["aio_backend.libaio"].startswith("unusable: not built: libaio.h")


@pytest.mark.parametrize("backend", USABLE)
@pytest.mark.parametrize("n, offset", [(1, 0), (4097, 1), ((1 << 20) + 3, 12345), (3 << 20, 4096)])
def test_round_trip_on_every_backend(tmp_path, backend, n, offset):
    h = zaio.AsyncIO(65536, 4, 2, backend=backend)
    assert h.backend == backend
    data, path = random_bytes(n, n + offset), tmp_path / f"{backend}.bin"
    h.async_pwrite(data, path, offset)
    assert h.wait() == 1 and path.stat().st_size == offset + n
    back = zaio.aligned_pinned_empty(n + 1, torch.uint8)[1:]  # unaligned memory: the bounce path
    assert h.sync_pread(back, path, offset) == n
    assert torch.equal(back, data)


@pytest.mark.parametrize("cap, direct", [(4096, "auto"), (12288, "require"), (1000, "off")])
def test_threadpool_continues_short_transfers(tmp_path, cap, direct):
    """Every pread/pwrite moves at most ``cap`` bytes (1000: not a multiple of the O_DIRECT
    alignment, so only the page cache can take it): each op is a chain of short transfers."""
    lib = zaio._native()
    lib._aio_threadpool_max_syscall_bytes(cap)
    try:
        h = zaio.AsyncIO(65536, 4, 2, backend="threadpool", direct=direct)
        for i, (n, offset) in enumerate([(100_003, 7), (1 << 20, 0), (5, 4095)]):
            data = random_bytes(n, i)
            h.sync_pwrite(data, tmp_path / "short.bin", offset)
            back = torch.empty(n, dtype=torch.uint8)
            h.sync_pread(back, tmp_path / "short.bin", offset)
            assert torch.equal(back, data), (n, offset)
    finally:
        lib._aio_threadpool_max_syscall_bytes(0)


def test_threadpool_errors_name_the_file(tmp_path):
    h = zaio.AsyncIO(65536, 4, 1, backend="threadpool")
    buf = torch.zeros(100_000, dtype=torch.uint8)
    with pytest.raises(FileNotFoundError) as info:
        h.sync_pread(buf, tmp_path / "missing.bin")
    assert info.value.filename == str(tmp_path / "missing.bin")
    h.sync_pwrite(buf, tmp_path / "f.bin")
    os.truncate(tmp_path / "f.bin", 70_000)  # shorter than the read: named, with the offset
    with pytest.raises(OSError, match="f.bin"):
        h.sync_pread(buf, tmp_path / "f.bin")
    h.async_pwrite(buf, tmp_path / "f.bin")  # still usable
    assert h.wait() == 1


# -- config --------------------------------------------------------------------------------------
def test_config_backend_key_reaches_the_swap_store(tmp_path):
    for backend in ["auto"] + USABLE:
        cfg = nv.cfg_for(tmp_path / backend)
        (tmp_path / backend).mkdir()
        cfg["aio"] = {"backend": backend}
        engine = zerocore.initialize(nv.deep(n=1), cfg)
        store = engine.offload.nvme.store
        want = zaio.auto_backend() if backend == "auto" else backend
        assert store.reader.backend == want and all(w.backend == want for w in store.writers)
        engine.destroy()
    cfg = nv.cfg_for(tmp_path)
    cfg["aio"] = {"backend": "posix"}
    with pytest.raises(ConfigError, match="aio.backend"):
        zerocore.initialize(nv.deep(n=1), cfg)


def test_checkpoint_io_on_the_threadpool_backend(tmp_path, monkeypatch):
    """The checkpoint writer/reader build their handle from the same aio section: with
    ``aio.backend: threadpool`` a save and a load go through the thread pool and round-trip."""
    from zerocore.checkpoint import save as save_mod

    made = []
    orig = zaio.AsyncIO.from_config.__func__
    monkeypatch.setattr(zaio.AsyncIO, "from_config",
                        classmethod(lambda cls, *a, **kw: made.append(orig(cls, *a, **kw)) or made[-1]))
    cfg = nv.cfg_for(tmp_path, device="cpu")
    del cfg["zero_optimization"]["sub_group_size"]  # no effect at stage 2 without NVMe (a warning)
    cfg["aio"] = {"backend": "threadpool"}  # used by the checkpoint files even without NVMe offload: no warning
    engine = zerocore.initialize(nv.deep(n=2), cfg)
    nv.train(engine, 2)
    want = nv.weights(engine)
    engine.save_checkpoint(str(tmp_path / "ck"))
    assert made and all(h.backend == "threadpool" for h in made)
    assert save_mod.aio_handle({"backend": "threadpool"}).backend == "threadpool"
    engine.destroy()
    again = zerocore.initialize(nv.deep(n=2), cfg)
    again.load_checkpoint(str(tmp_path / "ck"))
    got = nv.weights(again)
    assert all(torch.equal(got[k], want[k]) for k in want)
    again.destroy()


def test_config_translation_lives_in_config():
    from zerocore.config import aio as config_aio

    assert zaio.config_to_kwargs is config_aio.config_to_kwargs
    assert config_aio.config_to_kwargs({"backend": "threadpool", "thread_count": 2}) == dict(
        block_size=1 << 20, queue_depth=8, threads=2, single_submit=False, overlap_events=True, backend="threadpool")
    with pytest.raises(ValueError, match="aio config: backend"):
        config_aio.config_to_kwargs({"backend": "posix"})


# -- training: every backend gives the same bits -------------------------------------------------
def run_world1(path, stage: int, backend: str, steps: int = 3):
    cfg = nv.cfg_for(path, stage)
    cfg["aio"] = {"backend": backend, "block_size": 65536, "queue_depth": 4}
    engine = zerocore.initialize(nv.deep(), cfg)
    assert engine.offload.nvme.store.reader.backend == backend
    losses, norms = [], []
    for s in range(steps):
        losses += nv.train(engine, 1, seed=s)
        norms.append(engine.global_grad_norm)
    out = {"losses": losses, "norms": norms, "state": nv.weights(engine)}
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_world1_training_is_bit_identical_on_every_backend(tmp_path, stage):
    runs = {}
    for b in USABLE:
        (tmp_path / b).mkdir()
        runs[b] = run_world1(tmp_path / b, stage, b)
    assert "threadpool" in runs
    for b in USABLE[1:]:
        assert_same_bits([runs[b]], [runs[USABLE[0]]])


@dataclasses.dataclass
class BackendCase(nv.NvmeCase):
    backend: str = "auto"

    def config(self) -> dict:
        cfg = super().config()
        cfg.setdefault("aio", {})["backend"] = self.backend
        return cfg


W2_BASE = [nv.nvme("s2_fp32_clip", "mlp", 2, bucket=2000, zero=nv.SWAP, steps=3, gas=2, clip=0.05),
           nv.nvme("s3_fp32_params", "gpt", 3, zero=dict(nv.SIZE, **nv.SWAP), steps=3)]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    swap = tmp_path_factory.mktemp("backend_swap_w2")
    cases = [BackendCase(**dict({f.name: getattr(c, f.name) for f in dataclasses.fields(nv.NvmeCase)},
                                name=f"{c.name}__{b}", nvme_path=str(swap)), backend=b)
             for c in W2_BASE for b in USABLE]
    return cases, spawn_cases(cases, 2, tmp_path_factory.mktemp("backend_w2"), timeout=150)


@pytest.mark.parametrize("base", W2_BASE, ids=lambda c: c.name)
def test_world2_training_is_bit_identical_on_every_backend(world2, base):
    cases, results = world2
    first = case_results(results, cases, f"{base.name}__{USABLE[0]}")
    for b in USABLE[1:]:
        assert_same_bits(case_results(results, cases, f"{base.name}__{b}"), first)


# -- faults on the thread pool (test_offload_nvme.py's cases, with aio.backend: threadpool) -------
@pytest.fixture
def on_threadpool(monkeypatch):
    """test_offload_nvme's configs with ``aio.backend: threadpool``; checks each engine used it."""
    orig_cfg, orig_init = nv.cfg_for, zerocore.initialize
    monkeypatch.setattr(nv, "cfg_for", lambda *a, **kw: dict(orig_cfg(*a, **kw), aio={"backend": "threadpool"}))

    def initialize(*a, **kw):
        engine = orig_init(*a, **kw)
        assert engine.offload.nvme.store.reader.backend == "threadpool"
        return engine

    monkeypatch.setattr(zerocore, "initialize", initialize)


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("stage", [2, 3])
def test_threadpool_corrupt_or_truncated_swap_file(on_threadpool, tmp_path, how, stage):
    nv.test_corrupt_swap_file_raises_naming_file_offset_step_and_changes_nothing(tmp_path, how, stage)


@pytest.mark.parametrize("code,said", [(errno.ENOSPC, "the disk is full"), (errno.EROFS, "the file system is read-only")])
def test_threadpool_full_disk_or_read_only(on_threadpool, tmp_path, code, said):
    nv.test_write_failure_is_a_clear_error_and_changes_nothing(tmp_path, code, said)


def test_threadpool_read_only_swap_folder(on_threadpool, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes read-only files anyway (the injected EROFS case above covers the path)")
    nv.test_read_only_swap_folder_mid_run_is_a_clear_error(tmp_path)
