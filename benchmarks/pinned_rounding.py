"""Pinned host memory of CPU offload: the bytes an engine's offloaded state asks for, against what torch's
pinned-memory allocator (``pin_memory=True``) would hold for them (it rounds every block up to the next power
of two) and what zerocore's page-sized allocator holds (zerocore/offload/host_memory.py: buffers of
``EXACT_PIN_BYTES`` and more sized to the 4 KiB page; smaller ones still torch's).

The engines are built on this machine's CPU with the offload configuration a GPU run would use; the host
buffers' sizes do not depend on the device (on a CPU device nothing is pinned, so this counts, it does not
allocate pinned memory). What a GPU process holds is measured by step.py's ``pinned`` and ``host`` columns.

    python benchmarks/pinned_rounding.py --out benchmarks/results/cpu_2026-11-27_issue35_stop43/pinned_rounding.json
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, write_json  # noqa: E402

PAGE = 4096


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def page(n: int) -> int:
    return -(-n // PAGE) * PAGE


def host_buffer_bytes(engine) -> list[int]:
    """The sizes of the engine's offloaded host buffers as a GPU run allocates them, each once: every CPU
    tensor held by an offloaded optimizer shard (landed gradient, master, m, v, the speculation's second set),
    the host-resident parameter shards of stage-3 parameter offload, and the 16-bit staging buffer a GPU run
    adds where the parameters are on the device (on a CPU device the host step writes them directly)."""
    seen, out = set(), []

    def add(t):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append(t.numel() * t.element_size())

    for shard in engine.offload.shards.values():
        for v in vars(shard).values():
            add(v)
            if isinstance(v, (list, tuple)):
                for x in v:
                    for t in (x if isinstance(x, (list, tuple)) else (x,)):
                        add(t)
        g = shard.group
        if getattr(shard, "half", False) and getattr(shard, "out_h", 0) is None and not g.params_on_host:
            out.append(shard.split * g.layout.dtype.itemsize)  # (HostOptimizerShard.out_h on a GPU)
    for g in engine.groups:
        if getattr(g, "params_on_host", False):
            add(g.param_shard)
    return out


def count(engine) -> dict:
    from zerocore.offload.host_memory import EXACT_PIN_BYTES

    sizes = host_buffer_bytes(engine)
    zerocore = sum(page(n) if n >= EXACT_PIN_BYTES else pow2(n) for n in sizes)
    asked, torch_pow2 = sum(sizes), sum(pow2(n) for n in sizes)
    return {"buffers": len(sizes), "asked_GiB": asked / 2 ** 30, "torch_pin_memory_GiB": torch_pow2 / 2 ** 30,
            "zerocore_GiB": zerocore / 2 ** 30, "torch_over_asked": torch_pow2 / asked,
            "zerocore_over_asked": zerocore / asked}


def main(argv=None) -> dict:
    import zerocore
    from zerocore.demo import TinyGPT

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--cases", nargs="+", default=["2:2.5e6", "2:2.5e7", "2:5e8", "3:2.5e6", "3p:2.5e6"],
                    help="stage:reduce_bucket_size (3p: stage 3 with parameter offload too); 5e8 is DeepSpeed's default")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = {}
    for case in args.cases:
        stage_s, bucket = case.split(":")
        stage, params = int(stage_s[0]), stage_s.endswith("p")
        torch.manual_seed(0)
        model = TinyGPT(args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, ctx=64)
        z = {"stage": stage, "reduce_bucket_size": int(float(bucket)), "offload_optimizer": {"device": "cpu"}}
        if stage == 3:
            z.update({"stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 1})
        if params:
            z["offload_param"] = {"device": "cpu"}
        engine = zerocore.initialize(model, {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                             "zero_optimization": z,
                                             "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
        try:
            rows[case] = dict(count(engine), groups=len(engine.groups),
                              params=sum(g.hi - g.lo for g in engine.groups))
        finally:
            engine.destroy()
        del engine, model
    print(f"{'case (stage:bucket)':<22}{'groups':>7}{'buffers':>8}{'asked GiB':>11}{'torch pin_memory':>18}"
          f"{'zerocore':>14}")
    for case, r in rows.items():
        print(f"{case:<22}{r['groups']:>7}{r['buffers']:>8}{r['asked_GiB']:>11.2f}"
              f"{r['torch_pin_memory_GiB']:>10.2f} ({r['torch_over_asked']:.2f}x)"
              f"{r['zerocore_GiB']:>8.2f} ({r['zerocore_over_asked']:.3f}x)")
    res = {"machine": machine_info(), "args": vars(args), "cases": rows}
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
