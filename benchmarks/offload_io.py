"""NVMe offload's swap path (zerocore.offload.nvme) beside the raw I/O engine, with and without
checksums, on one owned optimizer range of ``--elems`` fp32 elements (12 bytes each: master, m, v).

Rows, each the median of ``--repeats`` runs, interleaved so drift hits all alike:
- raw write / raw read: ``ops.AsyncIO`` moving the same bytes as one slot of the swap file
  (``tiles x record bytes``) in one request from one aligned buffer: what the disk allows with
  the engine's settings here.
- swap in (verified): every tile read into the pinned buffers and its record checked (CRC32).
- swap in+out: the step's I/O without Adam (read, verify, seal, write to the other slot).
- host step on NVMe: the whole NvmeOptimizerShard.step (I/O + Adam + parameters).
- host step in RAM: the same Adam kernel on state held in memory (CPU offload's step), the floor.
- fio write / fio read (when fio is installed): fio's own GB/s for the same bytes on the same file
  with the same settings (libaio, direct, block size, queue depth, jobs = threads), in the same
  rounds: the disk's best by a tool outside the project.
- each swap row again with the checksum switched off (its cost = the difference), and the checksum
  (CRC32C in hardware, else zlib CRC32) alone over the bytes of a step (CPU seconds), as a share of the NVMe step.

    python benchmarks/offload_io.py --dir /nvme/scratch --out benchmarks/results/offload_io_<machine>.json
    python benchmarks/offload_io.py --elems 1000000 --repeats 1      # a smoke test

On a shared VM (this project's 2-core machine) timings are noisy: compare rows of the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import types

import torch

try:  # run as a script from the repo root or from benchmarks/
    from _common import machine_info
    from swap_probe import fio_gbps
except ImportError:  # pragma: no cover
    from benchmarks._common import machine_info
    from benchmarks.swap_probe import fio_gbps

from zerocore import ops
from zerocore.offload.nvme import NvmeOptimizerShard, SwapOptions, SwapStore
from zerocore.offload.nvme import records
from zerocore.sharding.optimizer import AdamHyper


class _Group:
    """The few facts of a ShardedGroup the shard reads (one owned range, fp32 or bf16)."""

    def __init__(self, n: int, dtype: torch.dtype):
        self.lo, self.hi, self.index = 0, n, 0
        self.layout = types.SimpleNamespace(dtype=dtype)
        self.params = torch.zeros(n, dtype=dtype)
        self.partitioned = True

    def owned_params_raw(self):
        return self.params


def _time(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w, time.thread_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="directory on the drive to test (default: a temp dir)")
    ap.add_argument("--elems", type=int, default=16_000_000, help="owned fp32 elements (state = 12 bytes each)")
    ap.add_argument("--tile", type=int, default=4_000_000, help="sub_group_size (elements per tile)")
    ap.add_argument("--buffers", type=int, default=4, help="buffer_count")
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="aio intra_op_parallelism")
    ap.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    base = tempfile.mkdtemp(prefix="zc_offload_io_", dir=a.dir)
    aio = {"block_size": a.block_size, "queue_depth": a.queue_depth, "intra_op_parallelism": a.threads}
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    try:
        store = SwapStore(base, 0, aio, a.buffers)
        group = _Group(a.elems, dtype)
        opts = SwapOptions(tile=a.tile, fast_init=True, pipeline_read=True, pipeline_write=True)
        t0 = time.perf_counter()
        shard = NvmeOptimizerShard(group, torch.randn(a.elems), store=store, opts=opts, pin=False)
        init_s = time.perf_counter() - t0
        shard.grad_h.copy_(torch.randn(a.elems))
        slot = len(shard.tiles) * shard.rec_bytes  # bytes of one slot: what one pass moves each way
        raw_buf = ops.aligned_pinned_empty(slot, dtype=torch.uint8).fill_(1)
        raw_path = os.path.join(base, "raw.bin")
        h = ops.AsyncIO(**ops.aio.config_to_kwargs(aio))
        h.sync_pwrite(raw_buf, raw_path)  # allocated before timing, as the swap file is
        ram = {k: torch.randn(a.elems).abs_() for k in ("master", "m", "v")}
        hp = AdamHyper(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled=True)
        crc_bytes = torch.empty(slot, dtype=torch.uint8).numpy()
        steps = [1]

        def swap_in():
            for _ in shard._tiles_io(shard.last_step, write=False):
                pass

        def swap_inout():
            for _ in shard._tiles_io(shard.last_step, write=True):
                pass

        def nvme_step():
            steps[0] += 1
            shard.step(shard.grad_h, hp, step=steps[0], grad_scale=1.0)
            shard.last_step = steps[0]

        def ram_step():
            ops.adam_step(ram["master"], shard.grad_h, ram["m"], ram["v"], lr=1e-3, step=steps[0],
                          param_out=group.params if dtype != torch.float32 else None)

        def without_crc(fn):
            def run():
                records.Record.checksum = False
                try:
                    fn()
                finally:
                    records.Record.checksum = True
            return run

        def reseal():  # records written without a checksum: read them unchecked, write them sealed
            verify = records.Record.verify
            records.Record.verify = lambda *args: None
            try:
                swap_inout()
            finally:
                records.Record.verify = verify

        crc = records.CHECKSUMS[records.ALGO][1]

        def plain_crc():  # seal + verify over one slot each: two checksums per tile and step
            crc(crc_bytes)
            crc(crc_bytes)

        rows = {"raw write": (lambda: h.sync_pwrite(raw_buf, raw_path), slot),
                "raw read": (lambda: h.sync_pread(raw_buf, raw_path), slot),
                "swap in (verified)": (swap_in, slot),
                "swap in (no checksum)": (without_crc(swap_in), slot),
                "swap in+out": (swap_inout, 2 * slot),
                "swap in+out (no checksum)": (without_crc(swap_inout), 2 * slot),
                "host step on NVMe": (nvme_step, 2 * slot),
                "host step on NVMe (no checksum)": (without_crc(nvme_step), 2 * slot),
                "host step in RAM": (ram_step, 0),
                "checksum of a step's bytes": (plain_crc, 2 * slot)}
        wall = {k: [] for k in rows}
        cpu = {k: [] for k in rows}
        fio = {"fio write": [], "fio read": []}
        fio_aio = {"block_size": a.block_size, "queue_depth": a.queue_depth, "intra_op_parallelism": a.threads}
        for _ in range(a.repeats):
            for name in fio:
                gbs = fio_gbps(raw_path, slot, fio_aio, write=name == "fio write")
                if gbs is not None:
                    fio[name].append(gbs)
            for name, (fn, _) in rows.items():
                w, c = _time(fn)
                wall[name].append(w)
                cpu[name].append(c)
                if "no checksum" in name:
                    reseal()  # the next verified row needs real checksums
        out = {"machine": machine_info(), "args": vars(a), "backend": store.reader.backend, "slot_bytes": slot,
               "checksum": records.CHECKSUMS[records.ALGO][0],
               "tiles": len(shard.tiles), "fast_init_s": init_s, "rows": {}}
        print(f"{a.elems} elements ({12 * a.elems / 1e6:.0f} MB of state), {len(shard.tiles)} tiles of {shard.tile}, "
              f"{a.buffers} buffers, backend {store.reader.backend}, checksum {records.CHECKSUMS[records.ALGO][0]}, "
              f"fast_init swap-out {init_s:.3f} s")
        print(f"{'row':34s} {'median s':>9s} {'GB/s':>7s} {'cpu s':>7s}")
        for name, (_, nbytes) in rows.items():
            med = statistics.median(wall[name])
            gbs = nbytes / med / 1e9 if nbytes else float("nan")
            out["rows"][name] = {"wall_s": wall[name], "median_s": med, "cpu_s": statistics.median(cpu[name]),
                                 "bytes": nbytes, "GBps": gbs}
            print(f"{name:34s} {med:9.4f} {gbs:7.2f} {statistics.median(cpu[name]):7.3f}")
        r = out["rows"]
        raw_pair = r["raw write"]["median_s"] + r["raw read"]["median_s"]
        out["summary"] = {
            "swap_inout_vs_raw": raw_pair / r["swap in+out"]["median_s"],
            "crc_share_of_nvme_step": r["checksum of a step's bytes"]["cpu_s"] / r["host step on NVMe"]["median_s"],
            "checksum_step_overhead": r["host step on NVMe"]["median_s"] / r["host step on NVMe (no checksum)"][
                "median_s"] - 1,
            "nvme_step_vs_ram_step": r["host step on NVMe"]["median_s"] / r["host step in RAM"]["median_s"]}
        for name, vals in fio.items():  # fio's own rate (its start-up is not in it): time = bytes / rate
            if vals:
                med = slot / statistics.median(vals) / 1e9
                out["rows"][name] = {"GBps_runs": vals, "median_s": med, "bytes": slot, "GBps": statistics.median(vals)}
                print(f"{name:34s} {med:9.4f} {statistics.median(vals):7.2f} {'-':>7s}")
        if fio["fio write"] and fio["fio read"]:
            fio_pair = r["fio write"]["median_s"] + r["fio read"]["median_s"]
            out["summary"].update(raw_vs_fio_write=r["raw write"]["GBps"] / r["fio write"]["GBps"],
                                  raw_vs_fio_read=r["raw read"]["GBps"] / r["fio read"]["GBps"],
                                  swap_inout_vs_fio=fio_pair / r["swap in+out"]["median_s"])
        else:
            print("fio: not installed (apt-get install fio), its rows are left out")
        for k, v in out["summary"].items():
            print(f"{k}: {v:.3f}")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
        h.close()
        store.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
