"""Gradient reduction, in the style of nccl-tests: bytes, time, algbw, busbw, for

- raw_reduce_scatter: one ``reduce_scatter_single`` of a flat buffer (the backend's own);
- raw_all_reduce: one ``all_reduce`` of the same buffer (why zerocore uses it on gloo);
- zerocore_bucketed: zerocore's GradReducer (stage 2, overlap_comm) reducing a ~200-tensor
  model of the same total bytes, including packing every gradient into the buckets and
  keeping the owned slice: the hooks are driven directly, without autograd;
- zerocore_bucketed_native_rs: the same, forcing the backend's reduce-scatter;
- per_tensor_all_reduce / per_tensor_reduce_scatter: one collective per tensor (the latter
  pads each tensor to a multiple of the ranks).

algbw = total bytes / time; busbw = algbw x (N-1)/N for reduce-scatter, x 2(N-1)/N for
all-reduce (nccl-tests' definitions, so numbers compare across N). Variants interleaved,
``--iters`` rounds, median. gloo on CPU tensors here; NCCL when run with --device cuda.

    python benchmarks/reduce_scatter.py --ranks 2 --out benchmarks/results/reduce_scatter_gloo_w2.json
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (backend_of, collective_parser, finish_rank, init_rank, spawn_ranks,  # noqa: E402
                     write_collective_json)

_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

VARIANTS = ["raw_reduce_scatter", "raw_all_reduce", "zerocore_bucketed", "zerocore_bucketed_native_rs",
            "per_tensor_all_reduce", "per_tensor_reduce_scatter"]


def tensor_sizes(total: int, count: int, seed: int = 0) -> list[int]:
    """~count sizes summing to total: a few big matrices and many small vectors."""
    rng = random.Random(seed)
    w = [rng.lognormvariate(0, 2.0) for _ in range(count)]
    sizes = [max(1, int(x * total / sum(w))) for x in w]
    sizes[0] += total - sum(sizes)
    return sizes


class BucketedCase:
    """A stage-2 engine's GradReducer over ``sizes`` parameters; one run = one backward's worth
    of gradients arriving in reverse order, as hooks would deliver them."""

    def __init__(self, sizes, bucket: int, native_rs: bool, device):
        from zerocore.comm import Comm
        from zerocore.sharding import GradReducer, ShardedGroup, build_groups, policy_for

        world = dist.get_world_size()
        comm = Comm(dist.group.WORLD, reduce_scatter_via_all_reduce=False if native_rs else None)
        self.params = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in sizes]
        order = list(reversed(list(enumerate(self.params))))
        layouts = build_groups([((f"p{i}",), p) for i, p in order], bucket_elems=bucket, world=world,
                               dtype=torch.float32)
        groups, k = [], 0
        for lay in layouts:
            groups.append(ShardedGroup(lay, [p for _, p in order[k:k + len(lay.slots)]], policy_for(2), comm.rank,
                                       device))
            k += len(lay.slots)
        self.groups = groups
        self.reducer = GradReducer(groups, comm, overlap=True, reduce_scatter=True, device=device)
        # what each parameter's post-accumulate-grad hook calls (driven here without autograd)
        self.hooks = {id(q): self.reducer._make_hook(k) for k, g in enumerate(groups) for q in g.params}
        gen = torch.Generator().manual_seed(dist.get_rank())
        self.grads = [torch.randn(n, generator=gen).to(device) for n in sizes]

    def run(self):
        r = self.reducer
        r.begin_backward(boundary=True)
        for i in reversed(range(len(self.params))):
            p = self.params[i]
            p.grad = self.grads[i]
            self.hooks[id(p)](p)
        r.finish_backward()
        r.clear()


def worker(rank: int, world: int, init: str, args, out: str) -> None:
    device, sync = init_rank(rank, world, init, args.device)
    results = []
    for mib in args.sizes_mib:
        total = int(mib * 2**20) // 4 // world * world
        sizes = tensor_sizes(total, args.tensors)
        flat = torch.randn(total, device=device)
        out_chunk = torch.empty(total // world, device=device)
        tensors = [torch.randn(n, device=device) for n in sizes]
        padded = [torch.zeros(-(-n // world) * world, device=device) for n in sizes]
        cases = {
            "raw_reduce_scatter": lambda: _rs(out_chunk, flat),
            "raw_all_reduce": lambda: dist.all_reduce(flat),
            "per_tensor_all_reduce": lambda: [dist.all_reduce(t) for t in tensors],
            "per_tensor_reduce_scatter": lambda: [
                _rs(p[:p.numel() // world], p) for p in padded],
        }
        for name, native in (("zerocore_bucketed", False), ("zerocore_bucketed_native_rs", True)):
            if name in args.variants:
                cases[name] = BucketedCase(sizes, int(args.bucket), native, device).run
        times = {v: [] for v in args.variants}
        for v in args.variants:  # warm-up
            cases[v]()
        for _ in range(args.iters):
            for v in args.variants:
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                cases[v]()
                sync()
                times[v].append(time.perf_counter() - t0)
        for v in args.variants:
            t = statistics.median(times[v])
            nbytes = total * 4
            algbw = nbytes / t / 1e9
            factor = 2 * (world - 1) / world if "all_reduce" in v else (world - 1) / world
            results.append({"variant": v, "bytes": nbytes, "tensors": 1 if v.startswith("raw") else len(sizes),
                            "time_us": t * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * factor,
                            "min_us": min(times[v]) * 1e6, "max_us": max(times[v]) * 1e6})
    finish_rank(rank, out, results)


def main() -> None:
    ap = collective_parser(__doc__, VARIANTS)
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[4, 16, 64])
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--bucket", type=float, default=2.5e6, help="zerocore reduce_bucket_size (elements)")
    args = ap.parse_args()
    rows = spawn_ranks(worker, args.ranks, args)
    backend = backend_of(args)
    print(f"# {backend}, {args.ranks} ranks, fp32, {args.tensors} tensors for the bucketed/per-tensor variants, "
          f"zerocore bucket {args.bucket:.3g} elements, median of {args.iters} interleaved rounds")
    print(f"{'bytes':>12} {'variant':<30}{'time us':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}{'vs raw RS':>10}")
    for nbytes in sorted({r["bytes"] for r in rows}):
        sel = [r for r in rows if r["bytes"] == nbytes]
        raw_rs = next((r["time_us"] for r in sel if r["variant"] == "raw_reduce_scatter"), None)
        for r in sel:
            r["speed_vs_raw_reduce_scatter"] = raw_rs / r["time_us"] if raw_rs else None
            rel = f"{r['speed_vs_raw_reduce_scatter']:.2f}x" if raw_rs else "-"
            print(f"{nbytes:>12} {r['variant']:<30}{r['time_us']:>12.0f}{r['algbw_GBps']:>12.3f}"
                  f"{r['busbw_GBps']:>12.3f}{rel:>10}")
    write_collective_json(args, rows)


if __name__ == "__main__":
    main()
