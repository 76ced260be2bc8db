"""Fused Adam microbenchmark: zerocore against torch.optim.AdamW (foreach and fused),
DeepSpeed's DeepSpeedCPUAdam when installed, and the machine's memory roofline, measured in
the same run with the variants interleaved.

Cases: N parameters (default 10M and 100M) as one flat tensor and as ~200 tensors of mixed
sizes; fp32 (28 bytes/param: read p,g,m,v, write p,m,v) and mixed precision (bf16 grads in,
fp32 master/m/v, bf16 params out). zerocore's mixed path is one pass (28 B/param), also out of place
(``zerocore_out_of_place``: the host speculation's step, writing a second master/m/v); its peers
do it "the usual way": up-cast the grads, an fp32 step, down-cast the params (40 B/param).
The roofline is a stream kernel of ours reading four fp32 arrays and writing three (28 B).

Protocols: "hot" repeats the step on the same memory; "cold" streams 1 GiB of other memory
before each step (as in training, where forward/backward ran in between). Hugepages: off
unless --thp (THP is madvise-only here).

    python benchmarks/fused_adam.py --out benchmarks/results/fused_adam_cpu.json
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from zerocore import ops

try:
    from _common import ColdFlusher, advise_hugepages, machine_info, summary
except ImportError:  # run as a module
    from benchmarks._common import ColdFlusher, advise_hugepages, machine_info, summary

BYTES_ONE_PASS = 28  # read p, g, m, v (4 B each) and write p, m, v
BYTES_USUAL_MIXED = 40  # + grad up-cast (2 read, 4 write) + param down-cast (4 read, 2 write)


def mixed_sizes(total: int, count: int, seed: int = 0) -> list[int]:
    """~count tensor sizes summing to total: a few big matrices, many small vectors, like a
    transformer's parameter list."""
    rng = random.Random(seed)
    weights = [rng.lognormvariate(0, 2.0) for _ in range(count)]
    scale = total / sum(weights)
    sizes = [max(1, int(w * scale)) for w in weights]
    sizes[0] += total - sum(sizes)
    return sizes


class State:
    """Parameters, gradients and Adam state shared by every variant of one case, so each
    variant touches the same physical memory."""

    def __init__(self, sizes: list[int], mixed: bool, thp: bool):
        gen = torch.Generator().manual_seed(0)
        self.params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
        self.m = [torch.randn(n, generator=gen) * 0.01 for n in sizes]
        self.v = [torch.rand(n, generator=gen) * 1e-4 + 1e-8 for n in sizes]
        self.g32 = [torch.randn(n, generator=gen) * 0.01 for n in sizes]
        self.g16 = [g.bfloat16() for g in self.g32] if mixed else None
        self.p16 = [p.detach().bfloat16() for p in self.params] if mixed else None
        for p, g in zip(self.params, self.g32):
            p.grad = g
        total = sum(sizes)
        self.stream = [torch.rand(total, generator=gen) for _ in range(4)]  # the roofline's own arrays
        if thp:
            for t in self.all_tensors():
                advise_hugepages(t)

    def all_tensors(self):
        yield from (p.data for p in self.params)
        for group in (self.m, self.v, self.g32, self.g16 or [], self.p16 or [], self.stream):
            yield from group

    def adopt(self, opt: torch.optim.Optimizer, step_as_tensor: bool) -> torch.optim.Optimizer:
        """Point the optimizer's state at the shared m/v (as if it had been training)."""
        for p, m, v in zip(self.params, self.m, self.v):
            opt.state[p] = {"step": torch.tensor(10.0) if step_as_tensor else 10, "exp_avg": m, "exp_avg_sq": v}
        return opt


def make_variants(st: State, mixed: bool, deepspeed_cls) -> dict:
    hp = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    a, b, c, d = st.stream
    variants = {"roofline": (lambda: ops._loader.load().stream_rw4(a, b, c, d, 0.5), BYTES_ONE_PASS)}
    peers = {
        "torch_fused": st.adopt(torch.optim.AdamW(st.params, fused=True, **hp), True),
        "torch_foreach": st.adopt(torch.optim.AdamW(st.params, foreach=True, **hp), True),
    }
    if deepspeed_cls is not None:
        peers["deepspeed"] = st.adopt(deepspeed_cls(st.params, adamw_mode=True, **hp), False)
    if not mixed:
        zc = st.adopt(ops.FusedAdam(st.params, **hp), True)
        variants["zerocore"] = (zc.step, BYTES_ONE_PASS)
        for name, opt in peers.items():
            variants[name] = (opt.step, BYTES_ONE_PASS)
        return variants
    counter = {"step": 10}

    def zerocore_one_pass():
        counter["step"] += 1
        ops.adam_step_multi([p.data for p in st.params], st.g16, st.m, st.v, steps=[counter["step"]] * len(st.m),
                            param_outs=st.p16, adamw_mode=True, **hp)

    variants["zerocore"] = (zerocore_one_pass, BYTES_ONE_PASS)
    # The same step out of place (offload/speculation.py's speculative step): reads this state, writes a
    # second set of master/m/v (not in cache: the kernel streams its stores); the same bytes moved.
    spare = [[torch.empty_like(t) for t in group] for group in ([p.data for p in st.params], st.m, st.v)]
    for group in spare:
        for t in group:
            t.zero_()  # first touch here, not in the timed calls

    def zerocore_out_of_place():
        counter["step"] += 1
        ops.adam_step_multi(spare[0], st.g16, spare[1], spare[2], steps=[counter["step"]] * len(st.m),
                            param_outs=st.p16, adamw_mode=True, sources=([p.data for p in st.params], st.m, st.v),
                            **hp)

    variants["zerocore_out_of_place"] = (zerocore_out_of_place, BYTES_ONE_PASS)
    for name, opt in peers.items():
        if name == "torch_foreach":
            continue  # the usual way is built on the fastest fp32 step; foreach is far slower

        def usual(opt=opt):
            torch._foreach_copy_(st.g32, st.g16)  # grads up-cast into the fp32 .grad buffers
            opt.step()
            torch._foreach_copy_(st.p16, [p.data for p in st.params])  # params down-cast
        variants[name + "_usual"] = (usual, BYTES_USUAL_MIXED)
    return variants


def run_case(numel: int, layout: str, mixed: bool, protocol: str, reps: int, thp: bool, deepspeed_cls,
             flusher) -> dict:
    sizes = [numel] if layout == "flat" else mixed_sizes(numel, 200)
    st = State(sizes, mixed, thp)
    variants = make_variants(st, mixed, deepspeed_cls)
    names = list(variants)
    for name in names:  # warm-up: first-touch, JIT, thread pools
        variants[name][0]()
    times = {name: [] for name in names}
    rng = random.Random(1)
    for _ in range(reps):
        rng.shuffle(names)  # interleaved, in a fresh order each round, so drift hits all alike
        for name in names:
            if protocol == "cold":
                flusher()
            t0 = time.perf_counter()
            variants[name][0]()
            times[name].append(time.perf_counter() - t0)
    roof = summary(times["roofline"])["median_ms"]
    results = {}
    for name, (_, bpp) in variants.items():
        s = summary(times[name])
        s["bytes_per_param"] = bpp
        s["gbps"] = numel * bpp / (s["median_ms"] * 1e-3) / 1e9
        s["pct_of_roofline"] = 100.0 * roof / s["median_ms"]
        results[name] = s
    zc = results["zerocore"]["median_ms"]
    ratios = {f"vs_{n}": results[n]["median_ms"] / zc for n in results if n not in ("zerocore", "roofline")}
    return {"numel": numel, "layout": layout, "tensors": len(sizes), "precision": "mixed" if mixed else "fp32",
            "protocol": protocol, "results": results, "zerocore_speedup": ratios}


def print_case(c: dict) -> None:
    print(f"\n{c['numel'] / 1e6:.0f}M params, {c['layout']} ({c['tensors']} tensors), {c['precision']}, "
          f"{c['protocol']}")
    print(f"  {'variant':<22}{'median ms':>10}{'min-max ms':>18}{'B/param':>9}{'GB/s':>8}{'% roof':>8}")
    for name, r in sorted(c["results"].items(), key=lambda kv: kv[1]["median_ms"]):
        print(f"  {name:<22}{r['median_ms']:>10.2f}{r['min_ms']:>9.2f}-{r['max_ms']:<8.2f}"
              f"{r['bytes_per_param']:>9}{r['gbps']:>8.1f}{r['pct_of_roofline']:>7.0f}%")
    print("  zerocore speed-up: " + ", ".join(f"{k[3:]} {v:.2f}x" for k, v in c["zerocore_speedup"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e7,1e8", help="comma-separated parameter counts")
    ap.add_argument("--layouts", default="flat,tensors")
    ap.add_argument("--precisions", default="fp32,mixed")
    ap.add_argument("--protocols", default="hot,cold")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--thp", action="store_true", help="madvise(MADV_HUGEPAGE) every benchmark tensor")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--out", help="write JSON here")
    args = ap.parse_args()
    deepspeed_cls = None
    ds_note = "not installed (pip install --no-build-isolation deepspeed)"
    if not args.no_deepspeed:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])  # JIT-builds its op now, not mid-run
            deepspeed_cls = DeepSpeedCPUAdam
            import deepspeed

            ds_note = deepspeed.__version__
        except Exception as exc:  # optional peer
            ds_note = f"unavailable: {type(exc).__name__}: {str(exc)[:200]}"
    info = machine_info()
    info.update(zerocore_isa=ops.active_isa(), deepspeed=ds_note, thp_advised=args.thp, reps=args.reps)
    print("fused Adam benchmark:", json.dumps(info))
    flusher = ColdFlusher() if "cold" in args.protocols else None
    cases = []
    for size in (int(float(s)) for s in args.sizes.split(",")):
        for layout in args.layouts.split(","):
            for precision in args.precisions.split(","):
                for protocol in args.protocols.split(","):
                    c = run_case(size, layout, precision == "mixed", protocol, args.reps, args.thp,
                                 deepspeed_cls, flusher)
                    print_case(c)
                    cases.append(c)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "cases": cases}, f, indent=1)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
