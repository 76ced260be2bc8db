"""NVMe I/O throughput: zerocore.ops.AsyncIO beside fio and plain synchronous O_DIRECT.

Sequential write, then read, of one file (default 1 GiB) for a sweep of block size x queue
depth x threads, for each backend (libaio, io_uring, threadpool). At every setting fio runs the
same pattern on the same file in the same run (ioengine libaio and io_uring, direct=1, numjobs =
threads each covering its own contiguous slice, iodepth = queue depth; for threadpool, ioengine
psync with threads x queue depth jobs of depth 1: the same number of blocking threads), interleaved with
zerocore's runs so drift hits both alike; a plain synchronous O_DIRECT pwrite/pread loop
(one block at a time, Python os.pwrite/os.preadv) runs once per block size. The file is
written once before timing (so every timed write overwrites allocated blocks, for both), and
deleted at the end.

Then a head to head: zerocore's and fio's best settings from the sweep run again, interleaved,
medians compared (one lucky run decides a best-of on a noisy machine); at fio's setting
zerocore also runs fio's memory pattern (one small buffer of queue_depth x block_size per
thread, reused), since a small hot buffer is faster to move on some machines (a VM's host
side), which is not the engine.

Prints a table, writes JSON (--out), and prints the best zerocore setting as an ``aio``
config block to paste into a DeepSpeed-style config (chosen by the geometric mean of read
and write GB/s; the best for each alone is printed too).

    python benchmarks/aio.py --dir /nvme/scratch --out benchmarks/results/aio_<machine>.json
    python benchmarks/aio.py --quick            # one setting per backend, a smoke test

Numbers on a shared VM are noisy: compare rows of the same run, and repeat (--repeats).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

try:  # run as a script from the repo root or from benchmarks/
    from _common import machine_info
except ImportError:  # pragma: no cover
    from benchmarks._common import machine_info

from zerocore.ops import aio as zaio


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def human(n: int) -> str:
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def fs_info(path: str) -> dict:
    """Mount point, file system type and device of `path`."""
    best = ("", "", "")
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                    best = (dev, mnt, fstype)
    except OSError:
        pass
    return {"device": best[0], "mount": best[1], "fstype": best[2]}


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# CPU seconds per GB (all threads of this process) of the last run_zerocore: on a disk-bound
# machine the backends' throughputs tie, and what tells them apart is the CPU they burn doing it.
last_cpu_s_per_gb = [0.0]


def run_zerocore(buf: torch.Tensor, path: str, bs: int, qd: int, threads: int, backend: str, write: bool) -> float:
    h = zaio.AsyncIO(bs, qd, threads, backend=backend, direct="require")
    c0 = time.process_time()
    t0 = time.perf_counter()
    if write:
        h.async_pwrite(buf, path)
    else:
        h.async_pread(buf, path)
    h.wait()
    dt = time.perf_counter() - t0
    last_cpu_s_per_gb[0] = (time.process_time() - c0) / (buf.numel() / 1e9)
    h.close()
    return gbps(buf.numel(), dt)


def run_zerocore_ring(ring: torch.Tensor, size: int, path: str, bs: int, qd: int, threads: int, backend: str,
                      write: bool) -> float:
    """fio's memory pattern: the same small buffer (queue_depth x block_size per thread, as fio
    allocates) written to / read from successive offsets, all requests in flight at once."""
    h = zaio.AsyncIO(bs, qd, threads, backend=backend, direct="require")
    step = ring.numel()
    t0 = time.perf_counter()
    for off in range(0, size, step):
        piece = ring[:min(step, size - off)]
        (h.async_pwrite if write else h.async_pread)(piece, path, off)
    h.wait()
    dt = time.perf_counter() - t0
    h.close()
    return gbps(size, dt)


def run_fio(path: str, size: int, bs: int, qd: int, threads: int, engine: str, write: bool) -> float:
    """fio on the same pattern. zerocore's thread pool (queue_depth blocking threads per worker) is
    matched by fio's psync engine with threads x queue_depth jobs of depth 1, each its own slice."""
    jobs, depth = (threads * qd, 1) if engine == "threadpool" else (threads, qd)
    engine = "psync" if engine == "threadpool" else engine
    per_job = size // jobs // 4096 * 4096
    cmd = ["fio", "--name=zc", f"--filename={path}", f"--rw={'write' if write else 'read'}", f"--bs={bs}",
           f"--iodepth={depth}", f"--numjobs={jobs}", f"--size={per_job}", f"--offset_increment={per_job}",
           "--direct=1", f"--ioengine={engine}", "--thread", "--group_reporting", "--output-format=json",
           "--invalidate=1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed: {' '.join(cmd)}\n{out.stderr.strip()}")
    data = json.loads(out.stdout[out.stdout.index("{"):])
    return data["jobs"][0]["write" if write else "read"]["bw_bytes"] / 1e9


def run_sync(buf: torch.Tensor, path: str, bs: int, write: bool) -> float:
    """One block at a time with plain pwrite/preadv on an O_DIRECT descriptor."""
    mv = memoryview(buf.numpy())
    size = buf.numel()
    fd = os.open(path, (os.O_WRONLY if write else os.O_RDONLY) | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        for off in range(0, size, bs):
            chunk = mv[off:off + bs]
            n = os.pwrite(fd, chunk, off) if write else os.preadv(fd, [chunk], off)
            if n != len(chunk):
                raise OSError(f"short {'write' if write else 'read'} of {path} at offset {off}: {n} bytes")
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return gbps(size, dt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the test file goes (the NVMe to tune)")
    ap.add_argument("--size", default="1G", help="file size (default 1G; at least 1G for published numbers)")
    ap.add_argument("--block-sizes", default="256K,1M,4M")
    ap.add_argument("--queue-depths", default="4,8,32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--backends", default="libaio,io_uring,threadpool",
                    help="zerocore backends to run (fio runs the same engine; psync jobs for threadpool)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds over the whole sweep (best and median kept)")
    ap.add_argument("--no-fio", action="store_true", help="skip fio")
    ap.add_argument("--final-rounds", type=int, default=3,
                    help="interleaved rounds of the head-to-head of each side's best setting (0: skip)")
    ap.add_argument("--quick", action="store_true", help="256M, one setting (1M x 8 x 1)")
    ap.add_argument("--out", help="write JSON here")
    args = ap.parse_args(argv)

    why = zaio.aio_unavailable()
    if why:
        print(f"zerocore NVMe I/O is not available: {why}", file=sys.stderr)
        return 2
    if args.quick:
        args.size, args.block_sizes, args.queue_depths, args.threads = "256M", "1M", "8", "1"
    size = parse_size(args.size)
    block_sizes = [parse_size(s) for s in args.block_sizes.split(",")]
    qds = [int(s) for s in args.queue_depths.split(",")]
    threads_list = [int(s) for s in args.threads.split(",")]
    usable = zaio.available_backends()
    backends = [b for b in args.backends.split(",") if usable.get(b, "unknown backend") is None]
    for b in args.backends.split(","):
        if b not in backends:
            print(f"note: backend {b} skipped: {usable.get(b, 'unknown backend')}")
    lcm = math.lcm(*block_sizes, *[4096 * t for t in threads_list])
    size = (size + lcm - 1) // lcm * lcm  # whole blocks per thread slice, for fio and us alike
    fio = None if args.no_fio else shutil.which("fio")
    if not args.no_fio and fio is None:
        print("note: fio not found (Debian: apt-get install fio); its columns are skipped")
    fio_version = subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip() if fio else None

    workdir = tempfile.mkdtemp(prefix="zerocore_aio_bench_", dir=args.dir)
    path = os.path.join(workdir, "bench.bin")
    info = {"machine": machine_info(), "kernel": os.uname().release, "file_system": fs_info(workdir),
            "dir": args.dir, "size_bytes": size, "fio": fio_version, "repeats": args.repeats,
            "load_avg_start": os.getloadavg(),
            "protocol": ("sequential write then read of one file per setting; zerocore (AsyncIO.async_pwrite/"
                         "async_pread of one aligned locked buffer + wait) and fio (same bs/iodepth/numjobs "
                         "slices, direct=1) interleaved setting by setting; sync = one O_DIRECT pwrite/preadv "
                         "per block; the file is written once before timing; GB/s = 1e9 bytes/s")}
    print(f"file {path} ({human(size)}) on {info['file_system']}; {fio_version or 'no fio'}; "
          f"load {info['load_avg_start'][0]:.1f}")

    buf = zaio.aligned_pinned_empty(size, torch.uint8)
    g = torch.Generator().manual_seed(0)
    buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g))
    zaio.AsyncIO(1 << 20, 8, 1).sync_pwrite(buf, path)  # lay the file out once

    rows: dict[tuple, dict] = {}

    def record(kind: str, backend: str, bs: int, qd: int, t: int, op: str, value: float) -> None:
        key = (kind, backend, bs, qd, t)
        row = rows.setdefault(key, {"kind": kind, "backend": backend, "block_size": bs, "queue_depth": qd,
                                    "threads": t, "write": [], "read": [], "write_cpu": [], "read_cpu": []})
        row[op].append(value)
        if kind == "zerocore":
            row[op + "_cpu"].append(last_cpu_s_per_gb[0])

    t_start = time.perf_counter()
    try:
        for rep in range(args.repeats):
            for bs in block_sizes:
                for op in ("write", "read"):
                    record("sync", "pwrite/pread", bs, 1, 1, op, run_sync(buf, path, bs, op == "write"))
                for qd in qds:
                    for t in threads_list:
                        for op in ("write", "read"):
                            w = op == "write"
                            for b in backends:
                                record("zerocore", b, bs, qd, t, op, run_zerocore(buf, path, bs, qd, t, b, w))
                                if fio:
                                    record("fio", b, bs, qd, t, op, run_fio(path, size, bs, qd, t, b, w))
                        last = {k: v for k, v in rows.items() if k[2:] == (bs, qd, t)}
                        print(f"[{rep + 1}/{args.repeats}] bs={human(bs):>4} qd={qd:<3} threads={t}: " + "  ".join(
                            f"{k[0]}-{k[1]} w {v['write'][-1]:.2f} r {v['read'][-1]:.2f}" for k, v in last.items()),
                            flush=True)
        # Head to head: one-off spikes decide a best-of sweep on a noisy machine, so each side's
        # best setting from the sweep is run again, interleaved, and medians are compared.
        # fio moves data through a buffer of iodepth x bs per job, reused (hot in caches, and on
        # a VM possibly on the host side too); zerocore above moves one big tensor, as offload
        # does. So zerocore also runs fio's memory pattern at fio's best setting, to tell buffer
        # locality from engine overhead.
        head = []
        if fio and args.final_rounds > 0:
            for op in ("write", "read"):
                w = op == "write"
                zbest = max((r for r in rows.values() if r["kind"] == "zerocore"), key=lambda r: max(r[op]))
                fbest = max((r for r in rows.values() if r["kind"] == "fio"), key=lambda r: max(r[op]))
                zs = (zbest["block_size"], zbest["queue_depth"], zbest["threads"], zbest["backend"])
                fs = (fbest["block_size"], fbest["queue_depth"], fbest["threads"], fbest["backend"])
                ring = zaio.aligned_pinned_empty(fs[0] * fs[1] * fs[2], torch.uint8)
                ring.copy_(buf[:ring.numel()])
                entry = {"op": op, "zerocore_setting": dict(zip(("block_size", "queue_depth", "threads", "backend"), zs)),
                         "fio_setting": dict(zip(("block_size", "queue_depth", "threads", "backend"), fs)),
                         "zerocore": [], "fio": [], "zerocore_ring_at_fio_setting": []}
                for _ in range(args.final_rounds):
                    entry["zerocore"].append(run_zerocore(buf, path, *zs, w))
                    entry["fio"].append(run_fio(path, size, *fs, w))
                    entry["zerocore_ring_at_fio_setting"].append(run_zerocore_ring(ring, size, path, *fs, w))
                for k in ("zerocore", "fio", "zerocore_ring_at_fio_setting"):
                    entry[k + "_median"] = statistics.median(entry[k])
                entry["ratio"] = entry["zerocore_median"] / entry["fio_median"]
                head.append(entry)
                print(f"head to head, {op}, medians of {args.final_rounds} interleaved rounds: zerocore "
                      f"{entry['zerocore_median']:.2f} GB/s ({zs[3]} bs={human(zs[0])} qd={zs[1]} threads={zs[2]}, "
                      f"{human(size)} tensor) vs fio {entry['fio_median']:.2f} ({fs[3]} bs={human(fs[0])} qd={fs[1]} "
                      f"threads={fs[2]}): ratio {entry['ratio']:.2f}; zerocore with fio's small reused buffer at "
                      f"fio's setting {entry['zerocore_ring_at_fio_setting_median']:.2f}", flush=True)
        info["head_to_head"] = head
    finally:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(workdir)
    info["seconds"] = time.perf_counter() - t_start
    info["load_avg_end"] = os.getloadavg()

    results = []
    for r in rows.values():
        r = dict(r)
        for op in ("write", "read"):
            v = r.pop(op)
            r[f"{op}_gbps_best"] = max(v)
            r[f"{op}_gbps_median"] = statistics.median(v)
            r[f"{op}_gbps_all"] = v
            cpu = r.pop(f"{op}_cpu")
            r[f"{op}_cpu_s_per_gb_median"] = statistics.median(cpu) if cpu else None
        results.append(r)

    # Table.
    print()
    print(f"{'kind':<9} {'backend':<13} {'bs':>5} {'qd':>3} {'thr':>3}  {'write GB/s':>10} {'read GB/s':>10}"
          f"  {'CPU s/GB w':>10} {'CPU s/GB r':>10}")
    for r in sorted(results, key=lambda r: (r["block_size"], r["queue_depth"], r["threads"], r["kind"], r["backend"])):
        cpu = "".join(f"  {r[f'{op}_cpu_s_per_gb_median']:>10.3f}" if r[f"{op}_cpu_s_per_gb_median"] is not None
                      else f"  {'':>10}" for op in ("write", "read"))
        print(f"{r['kind']:<9} {r['backend']:<13} {human(r['block_size']):>5} {r['queue_depth']:>3} "
              f"{r['threads']:>3}  {r['write_gbps_best']:>10.3f} {r['read_gbps_best']:>10.3f}{cpu}")

    def best(kind: str, op: str, backend: str | None = None):
        c = [r for r in results if r["kind"] == kind and (backend is None or r["backend"] == backend)]
        return max(c, key=lambda r: r[f"{op}_gbps_best"]) if c else None

    summary = {}
    print()
    for op in ("write", "read"):
        zc, fi, sy = best("zerocore", op), best("fio", op), best("sync", op)
        summary[op] = {"zerocore_best": zc[f"{op}_gbps_best"], "zerocore_setting": _setting(zc),
                       "fio_best": fi[f"{op}_gbps_best"] if fi else None, "fio_setting": _setting(fi) if fi else None,
                       "sync_best": sy[f"{op}_gbps_best"] if sy else None}
        if fi:
            summary[op]["ratio_zerocore_to_fio"] = zc[f"{op}_gbps_best"] / fi[f"{op}_gbps_best"]
            # Less sensitive to one lucky run: the best setting's median against fio's.
            zm = max(r[f"{op}_gbps_median"] for r in results if r["kind"] == "zerocore")
            fm = max(r[f"{op}_gbps_median"] for r in results if r["kind"] == "fio")
            summary[op]["ratio_of_best_medians"] = zm / fm
        print(f"best {op}: zerocore {zc[f'{op}_gbps_best']:.3f} GB/s ({_setting(zc)})"
              + (f", fio {fi[f'{op}_gbps_best']:.3f} ({_setting(fi)}), ratio "
                 f"{summary[op]['ratio_zerocore_to_fio']:.2f} (of best medians "
                 f"{summary[op]['ratio_of_best_medians']:.2f})" if fi else "")
              + (f", sync O_DIRECT {sy[f'{op}_gbps_best']:.3f}" if sy else ""))
    for e in info.get("head_to_head", []):
        summary[e["op"]]["head_to_head_ratio"] = e["ratio"]
        print(f"head to head {e['op']}: zerocore {e['zerocore_median']:.3f} vs fio {e['fio_median']:.3f} GB/s "
              f"(medians), ratio {e['ratio']:.2f} (target >= 0.9)")
    zc_rows = [r for r in results if r["kind"] == "zerocore"]
    pick = max(zc_rows, key=lambda r: math.sqrt(r["write_gbps_best"] * r["read_gbps_best"]))
    summary["recommended"] = _setting(pick)
    block = {"aio": {"block_size": pick["block_size"], "queue_depth": pick["queue_depth"],
                     "intra_op_parallelism": pick["threads"], "single_submit": False, "overlap_events": True,
                     "backend": pick["backend"]}}
    print(f"\nbest zerocore setting for both (geometric mean of read and write: write "
          f"{pick['write_gbps_best']:.3f}, read {pick['read_gbps_best']:.3f} GB/s, backend {pick['backend']}):")
    print(json.dumps(block, indent=2))
    auto = zaio.auto_backend(usable)
    if pick["backend"] != auto:
        print(f'(backend "auto" would pick {auto} here: keep "backend": "{pick["backend"]}" in the aio section)')

    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"info": info, "results": results, "summary": summary, "aio_config": block}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


def _setting(r: dict | None) -> str:
    if r is None:
        return ""
    return f"{r['backend']} bs={human(r['block_size'])} qd={r['queue_depth']} threads={r['threads']}"


if __name__ == "__main__":
    sys.exit(main())
