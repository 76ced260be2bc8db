"""Checkpoint throughput: ``engine.save_checkpoint`` / ``load_checkpoint`` per rank against the
disk's own bandwidth (measured in the same run, aio.py's plain synchronous O_DIRECT method, both
ranks at once) and against ``torch.save`` / ``torch.load`` of the same tensors; then offline
consolidation to safetensors: time and peak memory against the largest tensor.

The model: ``--layers`` x Linear(``--dim``, ``--dim``) (default 6 x 4096^2 = 100.7M parameters),
bf16 with an fp32 master, ZeRO stage ``--stage`` on ``--ranks`` gloo ranks, one training step
before saving. Every round runs, interleaved, on every rank at the same time: an O_DIRECT write
and read of this rank's byte count, zerocore save, torch.save (+fsync), zerocore load, zerocore
resume, torch.load. Saves include fsync and the atomic publish (durable); loads start cold: the files'
pages are evicted first (``posix_fadvise(DONTNEED)`` on our own files only). GB/s = 1e9 bytes/s
of this rank's bytes (12 bytes per owned element: master, exp_avg, exp_avg_sq) over the wall
time between barriers, and the CPU seconds each operation costs the rank's process, also per GB
(what bounds it on a busy machine). Each round also saves asynchronously: the training thread's
stall (until ``save_checkpoint(..., async_save=True)`` returns) against the time until the tag is
published and against a synchronous save, and the time of the training step that follows the call
(whose update waits for the state's copy) against a step without a save (the first round's
includes allocating the host buffers the engine then keeps; the ratios are medians of the later
rounds). Loads into the trained engine are staged (a failed one changes nothing); those after the
first stage in the buffers kept by that save; each round's CPU is printed. Each round also times a
resume: a new, untrained engine loading the same checkpoint, which reads it in place (no staging;
``checkpoint/load_in_place.py``), after the load in rounds 1, 3, 5 and before it in rounds 2, 4. Consolidation's rate
is compared with the O_DIRECT rates of the same run and with the disk's own time for reading the
masters while writing the output (the two directions share a virtual disk's bandwidth). A shared 2-core VM is noisy: every round is
printed, medians of ``--rounds``, load average recorded. Last, ``load_full_state_dict`` in a fresh
process: time, CPU and peak memory, against the disk reading the same masters alone.

    python benchmarks/checkpoint.py --out benchmarks/results/checkpoint_gloo_w2.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, spawn_ranks  # noqa: E402
from aio import fs_info, run_sync  # noqa: E402


def _evict(path: str) -> None:
    """Drops this file's (or every file's under this directory) pages from the page cache."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


CPU: dict[str, list[float]] = {}  # CPU seconds of this process (all its threads) per operation


def _timed(fn, name: str) -> float:
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    c1 = time.process_time()
    dist.barrier()
    CPU.setdefault(name, []).append(c1 - c0)
    return time.perf_counter() - t0


def _worker(rank: int, world: int, init_file: str, args, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import zerocore
    from zerocore.ops import aio as zaio

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers)])
    cfg = {"zero_optimization": {"stage": args.stage}, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
           "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    e = zerocore.initialize(model, cfg)
    e.backward(e(torch.randn(1, args.dim, dtype=torch.bfloat16)).float().pow(2).mean())
    e.step()
    mine = sum(s.master.numel() for s in e.shards)
    nbytes = mine * 12
    ckpt = os.path.join(args.dir, "ckpt")
    tsave = os.path.join(args.dir, f"torch_rank{rank}.pt")
    raw = os.path.join(args.dir, f"direct_rank{rank}.bin")
    buf = zaio.aligned_pinned_empty(nbytes // (1 << 20) * (1 << 20), torch.uint8, lock=False)
    buf.fill_(7)
    state = {f"{i}.{k}": t for i, s in enumerate(e.shards) for k, t in s.tensors().items()}
    rows = {k: [] for k in ("direct_write", "direct_read", "zc_save", "torch_save", "zc_load", "zc_resume",
                            "torch_load")}
    stall = {"call_s": [], "written_s": [], "call_cpu_s": [], "plain_step_s": [], "next_step_s": []}
    # what a load does beyond reading: the cast of the master into the bf16 parameters and (stage
    # 2) the all-gather of the full parameters, timed apart (torch.load of a shard does neither)
    from zerocore.checkpoint import load as zload

    refresh = {"s": [], "cpu_s": []}
    refresh_resume = {"s": [], "cpu_s": []}
    into = [refresh]  # where the next load's refresh is recorded
    depth = [0]

    def timed(fn, first: bool):
        """The refresh's visible time per load: the cast and the collectives' launch, and the
        wait for them (after the moments' copy that overlaps them, where the load does that)."""
        def run(*a, **kw):
            depth[0] += 1
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                depth[0] -= 1
                if depth[0] == 0:  # not inside another timed call
                    rec = into[0]
                    if first:
                        rec["s"].append(0.0)
                        rec["cpu_s"].append(0.0)
                    rec["s"][-1] += time.perf_counter() - t0
                    rec["cpu_s"][-1] += time.process_time() - c0
        return run

    zload._refresh_params = timed(zload._refresh_params, True)
    zload._finish_gathers = timed(zload._finish_gathers, False)
    ckpt_async = os.path.join(args.dir, "ckpt_async")

    x = torch.randn(1, args.dim, dtype=torch.bfloat16)

    def train_step() -> float:
        t0 = time.perf_counter()
        e.backward(e(x).float().pow(2).mean())
        e.step()
        return time.perf_counter() - t0

    def async_save():
        """The training thread's stall (until save_checkpoint returns) against the whole save,
        and what the save costs the next training step (its update waits for the state's copy)
        against a step without a save, in the same round."""
        dist.barrier()
        stall["plain_step_s"].append(train_step())
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        h = e.save_checkpoint(ckpt_async, tag="bench", async_save=True)
        stall["call_s"].append(time.perf_counter() - t0)
        stall["call_cpu_s"].append(time.process_time() - c0)
        stall["next_step_s"].append(train_step())
        h.wait()
        stall["written_s"].append(time.perf_counter() - t0)
        dist.barrier()

    def torch_save():
        torch.save(state, tsave)
        with open(tsave, "rb") as f:
            os.fsync(f.fileno())

    with open(raw, "wb") as f:  # allocated once, untimed: every timed write overwrites (as aio.py does)
        f.truncate(buf.numel())
    run_sync(buf, raw, 1 << 20, True)
    for _ in range(args.rounds):
        rows["direct_write"].append(buf.numel() / _timed(lambda: run_sync(buf, raw, 1 << 20, True), "direct_write") / 1e9)
        rows["direct_read"].append(buf.numel() / _timed(lambda: run_sync(buf, raw, 1 << 20, False), "direct_read") / 1e9)
        rows["zc_save"].append(nbytes / _timed(lambda: e.save_checkpoint(ckpt, tag="bench"), "zc_save") / 1e9)
        rows["torch_save"].append(nbytes / _timed(torch_save, "torch_save") / 1e9)
        _evict(tsave)
        # a job resuming: a new engine (untrained) loads the checkpoint, read in place; before the
        # staged load in even rounds, after it in odd ones (a virtual disk may cache what was read last)
        torch.manual_seed(1)
        fresh = zerocore.initialize(torch.nn.Sequential(
            *[torch.nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers)]), cfg)
        for which in (("resume", "load") if len(rows["zc_load"]) % 2 else ("load", "resume")):
            if rank == 0:
                _evict(ckpt)
            if which == "load":
                rows["zc_load"].append(nbytes / _timed(lambda: e.load_checkpoint(ckpt, tag="bench"), "zc_load") / 1e9)
                continue
            into[0] = refresh_resume
            rows["zc_resume"].append(
                nbytes / _timed(lambda: fresh.load_checkpoint(ckpt, tag="bench"), "zc_resume") / 1e9)
            into[0] = refresh
        fresh.destroy()
        del fresh
        rows["torch_load"].append(nbytes / _timed(lambda: torch.load(tsave, weights_only=True), "torch_load") / 1e9)
        async_save()
    # what a training step's re-gather of the parameters costs (the same collectives, all in flight):
    # the floor of the load's refresh
    from zerocore.sharding import ParamState

    step_gather = {"s": [], "cpu_s": []}
    if e.policy.shard_optimizer and world > 1:
        for _ in range(args.rounds):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            hs = []
            for g in e.groups:
                if not g.partitioned:
                    g.param_state.to(ParamState.SHARDED)
                    g.param_state.to(ParamState.GATHERING)
                    hs.append((e.comm.all_gather(g.param_flat, async_op=True), g))
            for h, g in hs:
                h.wait()
                g.param_state.to(ParamState.GATHERED)
            step_gather["s"].append(time.perf_counter() - t0)
            step_gather["cpu_s"].append(time.process_time() - c0)
    os.remove(raw)
    os.remove(tsave)
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "bytes": nbytes, "gbps": rows, "cpu_s": CPU, "async": stall,
                                      "refresh": refresh, "refresh_resume": refresh_resume,
                                      "step_gather": step_gather})
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"ranks": gathered, "params": sum(g.layout.numel for g in e.groups)}, f)
    dist.destroy_process_group()


_PEAK = r"""
import json, sys, time, zerocore.checkpoint as ck
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
ck.inspect(sys.argv[1])
base = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
t0, c0 = time.perf_counter(), time.process_time()
extra = {}
if sys.argv[3] == "full":  # load_full_state_dict: the whole fp32 model in this process
    sd = ck.load_full_state_dict(sys.argv[1])
    extra["bytes"] = sum(t.numel() * t.element_size() for t in {id(t): t for t in sd.values()}.values())
else:
    ck.consolidate(sys.argv[1], sys.argv[2], dtype=sys.argv[3])
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
                  "peak_rss_growth": status("VmHWM:") - base, **extra}))
"""


def _mixed_io_floor(ckpt: str, read_bytes: int, write_bytes: int, scratch: str) -> float:
    """The disk's own time for what a consolidation moves: ``read_bytes`` read from the rank files
    (cold) while ``write_bytes`` are written to a new file and fsync'ed, 16 MiB requests, each side
    on its own AsyncIO handle with all requests in flight; no CPU work. A virtual disk shares its
    bandwidth between the two directions, so this, not the write rate alone, bounds consolidation."""
    from zerocore import ops
    from zerocore.ops import aio as zaio

    piece = 16 << 20
    tag = os.path.join(ckpt, open(os.path.join(ckpt, "latest")).read().strip())
    files = sorted(os.path.join(tag, f) for f in os.listdir(tag) if f.endswith(".bin"))
    _evict(tag)
    reads, left = [], read_bytes
    for f in files:
        size = os.path.getsize(f) // piece * piece
        for off in range(0, size, piece):
            if left <= 0:
                break
            reads.append((f, off))
            left -= piece
    rbuf = ops.aligned_pinned_empty(piece * max(1, len(reads)), torch.uint8, lock=False)
    wn = -(-write_bytes // piece)
    wbuf = ops.aligned_pinned_empty(piece * max(1, wn), torch.uint8, lock=False)
    rbuf.fill_(0)
    wbuf.fill_(1)
    hr, hw = zaio.AsyncIO.from_config({}), zaio.AsyncIO.from_config({})
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        t0 = time.perf_counter()
        for i, (f, off) in enumerate(reads):
            hr.async_pread(rbuf[i * piece:(i + 1) * piece], f, off)
        for i in range(wn):
            hw.async_pwrite(wbuf[i * piece:(i + 1) * piece], scratch, i * piece)
        hr.wait()
        hw.wait()
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.remove(scratch)
        hr.close()
        hw.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    own = args.dir is None
    args.dir = tempfile.mkdtemp(prefix="zc_ckpt_bench_") if own else args.dir
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    try:
        res = spawn_ranks(_worker, args.ranks, args)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        cons = {}
        for dt in ("fp32", "bf16"):
            r = subprocess.run([sys.executable, "-c", _PEAK, os.path.join(args.dir, "ckpt"),
                                os.path.join(args.dir, f"model_{dt}.safetensors"), dt],
                               capture_output=True, text=True, cwd=root, check=True)
            cons[dt] = json.loads(r.stdout.strip().splitlines()[-1])
            cons[dt]["out_bytes"] = os.path.getsize(os.path.join(args.dir, f"model_{dt}.safetensors"))
            cons[dt]["read_bytes"] = res["params"] * 4  # the fp32 masters, whatever the output dtype
            cons[dt]["disk_floor_s"] = [_mixed_io_floor(os.path.join(args.dir, "ckpt"), cons[dt]["read_bytes"],
                                                        cons[dt]["out_bytes"], os.path.join(args.dir, "floor.bin"))
                                        for _ in range(2)]
        r = subprocess.run([sys.executable, "-c", _PEAK, os.path.join(args.dir, "ckpt"), "-", "full"],
                           capture_output=True, text=True, cwd=root, check=True)
        full = json.loads(r.stdout.strip().splitlines()[-1])
        full["read_bytes"] = res["params"] * 4
        # the disk reading the same bytes alone, one process (the per-rank O_DIRECT rates above are
        # measured with every rank reading at once)
        full["disk_read_s"] = [_mixed_io_floor(os.path.join(args.dir, "ckpt"), full["read_bytes"], 0,
                                               os.path.join(args.dir, "floor.bin")) for _ in range(2)]
    finally:
        if own:
            shutil.rmtree(args.dir, ignore_errors=True)
    largest = args.dim * args.dim * 4

    def read_rates(rk):
        """Per round: the load's rate without the parameters' refresh (cast + all-gather)."""
        return [rk["bytes"] / 1e9 / (rk["bytes"] / 1e9 / g - r) for g, r in zip(rk["gbps"]["zc_load"], rk["refresh"]["s"])]

    med = {k: statistics.median(v) for k, v in res["ranks"][0]["gbps"].items()}
    rows = []
    for rk in res["ranks"]:
        m = {k: statistics.median(v) for k, v in rk["gbps"].items()}
        gb = rk["bytes"] / 1e9
        a = rk["async"]
        rows.append({"rank": rk["rank"], "bytes": rk["bytes"], **{f"{k}_gbps": v for k, v in m.items()},
                     "save_vs_disk_write": m["zc_save"] / m["direct_write"],
                     "load_vs_disk_read": m["zc_load"] / m["direct_read"],
                     "save_vs_torch_save": m["zc_save"] / m["torch_save"],
                     "load_vs_torch_load": m["zc_load"] / m["torch_load"],
                     **{f"{k}_cpu_s": statistics.median(v) for k, v in rk["cpu_s"].items()},
                     **{f"{k}_cpu_s_per_gb": statistics.median(v) / gb for k, v in rk["cpu_s"].items()},
                     **{f"{k}_cpu_s_per_gb_rounds": [x / gb for x in v] for k, v in rk["cpu_s"].items()},
                     # per round: a sync save's time is its bytes over its rate
                     "load_refresh_s": statistics.median(rk["refresh"]["s"]),
                     "load_refresh_s_rounds": rk["refresh"]["s"],
                     # the checkpoint's part of a load: reading, verifying, writing into the engine
                     "load_read_gbps": statistics.median(read_rates(rk)),
                     "load_read_gbps_rounds": read_rates(rk),
                     "load_read_vs_disk_read": statistics.median(read_rates(rk)) / m["direct_read"],
                     "load_read_vs_torch_load": statistics.median(read_rates(rk)) / m["torch_load"],
                     "step_allgather_s": statistics.median(rk["step_gather"]["s"]) if rk["step_gather"]["s"] else None,
                     "step_allgather_cpu_s": statistics.median(rk["step_gather"]["cpu_s"]) if rk["step_gather"]["s"]
                     else None,
                     "load_refresh_cpu_s_per_gb": statistics.median(rk["refresh"]["cpu_s"]) / gb,
                     "resume_vs_disk_read": m["zc_resume"] / m["direct_read"],
                     "resume_vs_torch_load": m["zc_resume"] / m["torch_load"],
                     "resume_refresh_s_rounds": rk["refresh_resume"]["s"],
                     "resume_refresh_cpu_s_per_gb": statistics.median(rk["refresh_resume"]["cpu_s"]) / gb,
                     "async_stall_s": a["call_s"], "async_written_s": a["written_s"],
                     "async_call_cpu_s": a["call_cpu_s"],
                     "plain_step_s": a["plain_step_s"], "step_after_async_save_s": a["next_step_s"],
                     # what the save adds to the next step (its update waits for the copy), median of rounds 2+
                     "async_next_step_delay_s": statistics.median(
                         [n - p for n, p in zip(a["next_step_s"], a["plain_step_s"])][1:]
                         or [n - p for n, p in zip(a["next_step_s"], a["plain_step_s"])]),
                     "sync_save_s": [rk["bytes"] / 1e9 / r for r in rk["gbps"]["zc_save"]],
                     "async_stall_vs_sync_save": statistics.median(a["call_s"][1:] or a["call_s"])
                     / statistics.median([rk["bytes"] / 1e9 / r for r in rk["gbps"]["zc_save"]])})
    print(f"{res['params'] / 1e6:.1f}M parameters, bf16 + fp32 master, stage {args.stage}, {args.ranks} ranks; "
          f"{rows[0]['bytes'] / 1e9:.2f} GB per rank; medians of {args.rounds} rounds (GB/s per rank)")
    print(f"{'rank':>4} {'O_DIRECT w':>10} {'zc save':>8} {'torch.save':>10} {'save/disk':>9} {'save/torch':>10} | "
          f"{'O_DIRECT r':>10} {'zc load':>8} {'torch.load':>10} {'load/disk':>9} {'load/torch':>10}")
    for r in rows:
        print(f"{r['rank']:>4} {r['direct_write_gbps']:>10.2f} {r['zc_save_gbps']:>8.2f} {r['torch_save_gbps']:>10.2f} "
              f"{r['save_vs_disk_write']:>9.2f} {r['save_vs_torch_save']:>10.2f} | {r['direct_read_gbps']:>10.2f} "
              f"{r['zc_load_gbps']:>8.2f} {r['torch_load_gbps']:>10.2f} {r['load_vs_disk_read']:>9.2f} "
              f"{r['load_vs_torch_load']:>10.2f}")
    print(f"{'rank':>4} {'O_DIRECT r':>10} {'zc resume':>9} {'torch.load':>10} {'resume/disk':>11} "
          f"{'resume/torch':>12}   (a new, untrained engine loading: read in place)")
    for r in rows:
        print(f"{r['rank']:>4} {r['direct_read_gbps']:>10.2f} {r['zc_resume_gbps']:>9.2f} {r['torch_load_gbps']:>10.2f} "
              f"{r['resume_vs_disk_read']:>11.2f} {r['resume_vs_torch_load']:>12.2f}")
    print("every round, rank 0 (GB/s; the disk is noisy):")
    g = res["ranks"][0]["gbps"]
    for i in range(args.rounds):
        print(f"  round {i + 1}: save {g['zc_save'][i]:.2f} / disk {g['direct_write'][i]:.2f} = "
              f"{g['zc_save'][i] / g['direct_write'][i]:.2f}x, torch.save {g['torch_save'][i]:.2f}; "
              f"load {g['zc_load'][i]:.2f} / disk {g['direct_read'][i]:.2f} = {g['zc_load'][i] / g['direct_read'][i]:.2f}x, "
              f"torch.load {g['torch_load'][i]:.2f} ({g['zc_load'][i] / g['torch_load'][i]:.2f}x); resume "
              f"{g['zc_resume'][i]:.2f} = {g['zc_resume'][i] / g['direct_read'][i]:.2f}x disk, "
              f"{g['zc_resume'][i] / g['torch_load'][i]:.2f}x torch.load")
    print("CPU seconds per GB (this rank's process, all threads; medians): "
          + ", ".join(f"{k} {rows[0][f'{k}_cpu_s_per_gb']:.3f}" for k in res["ranks"][0]["cpu_s"]))
    r0 = rows[0]
    print("  per round, save / load: " + ", ".join(
        f"{s_:.3f} / {l_:.3f}" for s_, l_ in zip(r0["zc_save_cpu_s_per_gb_rounds"], r0["zc_load_cpu_s_per_gb_rounds"]))
          + " (round 1's load stages in fresh memory; later loads in the buffers the engine kept from its "
            "asynchronous save of the round before)")
    print("  resume per round: " + ", ".join(f"{x:.3f}" for x in r0["zc_resume_cpu_s_per_gb_rounds"])
          + f"; of it the parameters' cast + all-gather {r0['resume_refresh_cpu_s_per_gb']:.3f} CPU s/GB (median), "
          f"the checkpoint's reading and verifying {r0['zc_resume_cpu_s_per_gb'] - r0['resume_refresh_cpu_s_per_gb']:.3f}")
    print(f"  of zc_load's: the cast to bf16 + all-gather of the parameters (the part not overlapped with copying the "
          f"moments) {r0['load_refresh_cpu_s_per_gb']:.3f} CPU s/GB, "
          f"{r0['load_refresh_s']:.3f} s; the checkpoint's reading and verifying "
          f"{r0['zc_load_cpu_s_per_gb'] - r0['load_refresh_cpu_s_per_gb']:.3f} CPU s/GB")
    print(f"load without the refresh (reading, verifying, copying into the engine), rank 0: "
          f"{r0['load_read_gbps']:.2f} GB/s = {r0['load_read_vs_disk_read']:.2f}x the O_DIRECT read, "
          f"{r0['load_read_vs_torch_load']:.2f}x torch.load; per round "
          + ", ".join(f"{x:.2f}" for x in r0["load_read_gbps_rounds"]) + "; refresh per round "
          + ", ".join(f"{x:.3f}" for x in r0["load_refresh_s_rounds"]) + " s")
    if r0["step_allgather_s"] is not None:
        print(f"a training step's all-gather of the same parameters: {r0['step_allgather_s']:.3f} s, "
              f"{r0['step_allgather_cpu_s']:.3f} CPU s (median of {args.rounds})")
    print("async save, rank 0, per round: save_checkpoint returned after "
          + ", ".join(f"{x:.3f}" for x in r0["async_stall_s"]) + " s; written after "
          + ", ".join(f"{x:.3f}" for x in r0["async_written_s"]) + " s; a synchronous save took "
          + ", ".join(f"{x:.3f}" for x in r0["sync_save_s"]) + " s; stall / sync save (median of rounds 2+) "
          f"{r0['async_stall_vs_sync_save']:.3f}")
    print("  the training step right after the call took " + ", ".join(f"{x:.3f}" for x in r0["step_after_async_save_s"])
          + " s, a step without a save " + ", ".join(f"{x:.3f}" for x in r0["plain_step_s"])
          + f" s: the save delays the next step by {r0['async_next_step_delay_s']:.3f} s (median of rounds 2+; "
            "its update waits for the state's copy, which overlaps the forward and backward)")
    for dt, c in cons.items():
        rate = c["out_bytes"] / c["seconds"] / 1e9
        c["vs_disk_write"] = rate / med["direct_write"]
        c["vs_disk_read"] = rate / med["direct_read"]
        floor = min(c["disk_floor_s"])
        c["vs_disk_floor"] = floor / c["seconds"]
        print(f"consolidate --dtype {dt}: {c['seconds']:.2f} s for {c['out_bytes'] / 1e9:.2f} GB "
              f"({rate:.2f} GB/s = {c['vs_disk_write']:.2f}x the O_DIRECT write, {c['vs_disk_read']:.2f}x the read; "
              f"{c['cpu_seconds']:.2f} s CPU), peak RSS growth {c['peak_rss_growth'] / 2**20:.1f} MiB "
              f"= {c['peak_rss_growth'] / largest:.2f} x the largest tensor ({largest / 2**20:.0f} MiB fp32)")
        print(f"  the disk alone reading its {c['read_bytes'] / 1e9:.2f} GB while writing its output (no CPU work): "
              + ", ".join(f"{x:.2f}" for x in c["disk_floor_s"]) + f" s; consolidation runs at "
              f"{c['vs_disk_floor']:.2f}x that floor ({c['out_bytes'] / floor / 1e9 / med['direct_write']:.2f}x the "
              "O_DIRECT write is the most the floor allows)")
    floor = min(full["disk_read_s"])
    full["vs_disk_read_alone"] = floor / full["seconds"]
    print(f"load_full_state_dict: {full['seconds']:.2f} s for {full['read_bytes'] / 1e9:.2f} GB of masters read "
          f"({full['read_bytes'] / full['seconds'] / 1e9:.2f} GB/s = {full['vs_disk_read_alone']:.2f}x the disk reading "
          f"them alone in one process, " + ", ".join(f"{x:.2f}" for x in full["disk_read_s"]) + f" s; "
          f"{full['cpu_seconds']:.2f} s CPU = {full['cpu_seconds'] / (full['read_bytes'] / 1e9):.2f} s/GB), peak RSS "
          f"growth {full['peak_rss_growth'] / 2**20:.1f} MiB = {full['peak_rss_growth'] / full['bytes']:.2f} x the "
          "state dict it returns")
    print(f"load average: start {load0[0]:.2f}, end {os.getloadavg()[0]:.2f}")
    out = {"machine": machine_info(), "file_system": fs_info(args.dir), "args": vars(args), "params": res["params"],
           "load_avg_start": load0, "load_avg_end": os.getloadavg(), "seconds": time.perf_counter() - t0,
           "rows": rows, "rank0_rounds": res["ranks"][0]["gbps"], "medians_rank0": med, "consolidate": cons,
           "load_full_state_dict": full,
           "largest_tensor_bytes": largest}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
