"""Parameter all-gather, in place on a rank-major flat buffer (what stages 1-2 run after every
step and after a checkpoint load, and stage 3 per unit), in the style of nccl-tests:

- raw_all_gather: the backend's own ``all_gather_into_tensor`` of one buffer;
- broadcast_per_rank: ``world`` broadcasts, rank r's chunk from rank r, all in flight;
- zerocore: ``Comm.all_gather`` (which picks one of the two by backend and size).

Each variant gathers ``--buffers`` buffers of the total size, all in flight (as the refresh of a
model's groups does). Wall time and this rank's CPU time (all threads), interleaved rounds,
median and range; algbw = total bytes / time, busbw = algbw x (N-1)/N. gloo on CPU tensors here,
NCCL with --device cuda.

    python benchmarks/all_gather.py --ranks 2 --out benchmarks/results/all_gather_gloo_w2.json
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (backend_of, collective_parser, finish_rank, init_rank, spawn_ranks,  # noqa: E402
                     write_collective_json)

_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

VARIANTS = ["raw_all_gather", "broadcast_per_rank", "zerocore"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def worker(rank: int, world: int, init: str, args, out: str) -> None:
    device, sync = init_rank(rank, world, init, args.device)
    from zerocore.comm import Comm

    comm = Comm()
    results = []
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for mib in args.sizes_mib:
            per = int(mib * 2**20) // dtype.itemsize // args.buffers // world * world
            flats = [torch.zeros(per, dtype=dtype, device=device) for _ in range(args.buffers)]
            for f in flats:
                comm.chunk(f).fill_(rank + 1)

            def raw():
                for h in [_ag(f, comm.chunk(f), async_op=True) for f in flats]:
                    h.wait()

            def bcast():
                hs = [dist.broadcast(comm.chunk(f, r), src=r, async_op=True) for f in flats for r in range(world)]
                for h in hs:
                    h.wait()

            def zc():
                for h in [comm.all_gather(f, async_op=True) for f in flats]:
                    h.wait()

            cases = {"raw_all_gather": raw, "broadcast_per_rank": bcast, "zerocore": zc}
            wall = {v: [] for v in args.variants}
            cpu = {v: [] for v in args.variants}
            for v in args.variants:  # warm-up, and every variant gathers the same bytes
                cases[v]()
                sync()
                want = torch.arange(1, world + 1, dtype=dtype, device=device).repeat_interleave(per // world)
                if not all(torch.equal(f, want) for f in flats):
                    raise AssertionError(f"{v} gathered wrong bytes")
                for f in flats:
                    f.zero_()
                    comm.chunk(f).fill_(rank + 1)
            for _ in range(args.iters):
                for v in args.variants:
                    sync()
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    cases[v]()
                    sync()
                    wall[v].append(time.perf_counter() - t0)
                    cpu[v].append(time.process_time() - c0)
            nbytes = per * args.buffers * dtype.itemsize
            for v in args.variants:
                t = statistics.median(wall[v])
                results.append({"variant": v, "dtype": dname, "bytes": nbytes, "buffers": args.buffers,
                                "time_us": t * 1e6, "min_us": min(wall[v]) * 1e6, "max_us": max(wall[v]) * 1e6,
                                "cpu_us": statistics.median(cpu[v]) * 1e6, "algbw_GBps": nbytes / t / 1e9,
                                "busbw_GBps": nbytes / t / 1e9 * (world - 1) / world})
    finish_rank(rank, out, results)


def main() -> None:
    ap = collective_parser(__doc__, VARIANTS)
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 8, 64, 200])
    ap.add_argument("--buffers", type=int, default=6, help="buffers gathered at once (a model's groups)")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    args = ap.parse_args()
    rows = spawn_ranks(worker, args.ranks, args)
    backend = backend_of(args)
    print(f"# {backend}, {args.ranks} ranks, {args.buffers} buffers in flight, median (min-max) of {args.iters} "
          "interleaved rounds; CPU = rank 0's process")
    print(f"{'dtype':>5} {'bytes':>11} {'variant':<20}{'time us':>10}{'min-max us':>18}{'CPU us':>10}"
          f"{'busbw GB/s':>11}{'vs raw':>8}")
    for key in sorted({(r["dtype"], r["bytes"]) for r in rows}):
        sel = [r for r in rows if (r["dtype"], r["bytes"]) == key]
        raw = next((r["time_us"] for r in sel if r["variant"] == "raw_all_gather"), None)
        for r in sel:
            r["speed_vs_raw"] = raw / r["time_us"] if raw else None
            rel = f"{r['speed_vs_raw']:.2f}x" if raw else "-"
            print(f"{key[0]:>5} {key[1]:>11} {r['variant']:<20}{r['time_us']:>10.0f}"
                  f"{r['min_us']:>9.0f}-{r['max_us']:<8.0f}{r['cpu_us']:>10.0f}{r['busbw_GBps']:>11.3f}{rel:>8}")
    write_collective_json(args, rows)


if __name__ == "__main__":
    main()
