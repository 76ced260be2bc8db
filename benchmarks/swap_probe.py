"""What benchmarks/step.py needs to judge the NVMe variants' I/O against the disk, measured from
the benchmark side (zerocore.offload.nvme keeps no I/O counters, and this file changes nothing
there: it wraps a few methods in the benchmark's own processes only).

- ``SwapProbe``: per swap store (one per rank and engine, named after the variant that built it),
  the bytes every ``SwapStore.read``/``write`` moved, the time a swap pass (one group's
  ``_tiles_io``: read, verify, step the tile, seal, write, for every tile) took from its first tile
  to its last write's completion, and the time spent blocked in the store's waits. A pass is one
  group's share of one step; steps = passes / groups.
- ``disk_probe``: the raw engine (``ops.AsyncIO``) writing then reading ``nbytes`` of one aligned
  buffer with a given ``aio`` setting, and fio the same pattern when it is installed: what the disk
  allows at that setting, measured between the timed rounds of the same run.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections import defaultdict

import torch


PROBE_FILE = "disk_probe.bin"


class SwapProbe:
    def __init__(self):
        self.tag = None  # the variant being built: stores made now belong to it
        self.store_tag: dict[int, str] = {}
        self.stats = defaultdict(lambda: {"read_bytes": 0, "write_bytes": 0, "passes": 0, "pass_s": 0.0,
                                          "wait_s": 0.0, "groups": set()})
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        from zerocore.offload.nvme import shard as shard_mod
        from zerocore.offload.nvme import store as store_mod

        probe, Store, Shard = self, store_mod.SwapStore, shard_mod.NvmeOptimizerShard
        init, read, write = Store.__init__, Store.read, Store.write
        wait_r, wait_w, tiles_io = Store.wait_reads, Store.wait_writes, Shard._tiles_io

        def _stat(store):
            return probe.stats[probe.store_tag.get(id(store), "?")]

        def p_init(self, *a, **k):
            init(self, *a, **k)
            probe.store_tag[id(self)] = probe.tag

        def p_read(self, rec, path, offset, step, *a, **k):
            read(self, rec, path, offset, step, *a, **k)
            if step > 0:  # the initial swap-out (step 0) is start-up, not a step
                _stat(self)["read_bytes"] += rec.nbytes

        def p_write(self, rec, path, offset, step, *a, **k):
            write(self, rec, path, offset, step, *a, **k)
            if step > 0:
                _stat(self)["write_bytes"] += rec.nbytes

        def timed_wait(fn):
            def run(self, *a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(self, *a, **k)
                finally:
                    _stat(self)["wait_s"] += time.perf_counter() - t0
            return run

        def p_tiles_io(self, step, write, *a, **k):
            s = _stat(self.store)
            t0 = time.perf_counter()
            yield from tiles_io(self, step, write, *a, **k)
            if step > 0:
                s["pass_s"] += time.perf_counter() - t0
                s["passes"] += 1
                s["groups"].add(self.group.index)

        Store.__init__, Store.read, Store.write = p_init, p_read, p_write
        Store.wait_reads, Store.wait_writes, Shard._tiles_io = timed_wait(wait_r), timed_wait(wait_w), p_tiles_io
        self._installed = True

    def snapshot(self) -> dict:
        """Totals per variant (JSON-able)."""
        return {tag: dict(s, groups=len(s["groups"])) for tag, s in self.stats.items()}


def per_step(totals_by_rank: list[dict], variant: str) -> dict | None:
    """One variant's swap per step, from every rank's ``SwapProbe.snapshot``: bytes summed over the
    ranks (they share the disk), time the slowest rank's (the ranks step together)."""
    rows = [t[variant] for t in totals_by_rank if variant in t and t[variant]["passes"]]
    if not rows:
        return None
    steps = [r["passes"] / max(1, r["groups"]) for r in rows]
    return {"steps_counted": min(steps),
            "read_bytes": sum(r["read_bytes"] / st for r, st in zip(rows, steps)),
            "write_bytes": sum(r["write_bytes"] / st for r, st in zip(rows, steps)),
            "io_pass_s": max(r["pass_s"] / st for r, st in zip(rows, steps)),
            "blocked_s": max(r["wait_s"] / st for r, st in zip(rows, steps))}


def fio_gbps(path: str, nbytes: int, aio: dict, write: bool) -> float | None:
    """fio's GB/s for the same pattern (one file, direct, libaio, the same block size, queue depth and jobs)."""
    if shutil.which("fio") is None:
        return None
    jobs = aio.get("intra_op_parallelism", aio.get("thread_count", 1))
    cmd = ["fio", "--name=probe", f"--filename={path}", "--ioengine=libaio", "--direct=1",
           f"--rw={'write' if write else 'read'}", f"--bs={aio['block_size']}", f"--iodepth={aio['queue_depth']}",
           f"--numjobs={jobs}", f"--size={nbytes // jobs}", "--offset_increment=" + str(nbytes // jobs),
           "--group_reporting", "--output-format=json"]
    try:
        out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout)
    except (subprocess.SubprocessError, ValueError):
        return None
    job = out["jobs"][0]["write" if write else "read"]
    return job["io_bytes"] / (job["runtime"] / 1e3) / 1e9 if job["runtime"] else None


def fs_of(path: str) -> str:
    """'<fstype> on <device> (<mount>)' of the mount holding ``path`` (aio.py's reading of /proc/mounts)."""
    from aio import fs_info

    fs = fs_info(path)
    return f"{fs['fstype']} on {fs['device']} ({fs['mount']})"


def disk_probe(directory: str, nbytes: int, aio: dict, buf: torch.Tensor | None = None) -> dict:
    """Raw engine write then read of ``nbytes`` (one request from one aligned buffer, the file
    allocated first, as the swap files are) and fio's same pattern: GB/s."""
    from zerocore import ops

    path = os.path.join(directory, PROBE_FILE)
    if buf is None:
        buf = ops.aligned_pinned_empty(nbytes, dtype=torch.uint8).fill_(1)
    h = ops.AsyncIO(**ops.aio.config_to_kwargs(aio))
    try:
        if not os.path.exists(path):
            h.sync_pwrite(buf, path)
        out = {}
        for op, fn in (("write", h.sync_pwrite), ("read", h.sync_pread)):
            t0 = time.perf_counter()
            fn(buf, path)
            out[f"engine_{op}_GBps"] = nbytes / (time.perf_counter() - t0) / 1e9
        for op in ("write", "read"):
            out[f"fio_{op}_GBps"] = fio_gbps(path, nbytes, aio, op == "write")
    finally:
        h.close()
    return out

