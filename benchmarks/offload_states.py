"""``engine.offload_states()`` / ``reload_states()`` round trips beside the pinned copy rate of the same
machine, in one run: per stage, the device memory the offload frees (``torch.cuda.memory_allocated``),
the bytes moved each way and their rate, the round trip's bit-exactness (every moved storage compared
with a device copy taken before), and the ratio to a plain pinned-memory copy of the same bytes.

Model: zerocore.demo.TinyGPT, bf16, trained two steps first (the moments and gradients exist).

    python benchmarks/offload_states.py --device cuda --vocab 32768 --dim 1024 --layers 24 --heads 16 --ctx 1024 \
        --batch 8 --stages 0 1 2 3 --out benchmarks/results/offload_states_h100.json
    python benchmarks/offload_states.py --device cpu --dim 64 --layers 2 --heads 2 --ctx 32 --vocab 256   # the logic
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_variants as sv  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def pinned_copy_rate(nbytes: int, device: torch.device, repeats: int = 3) -> dict:
    """GB/s of one device<->pinned-host copy of ``nbytes`` (the ceiling the round trip is set against)."""
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(device)
            times.append(time.perf_counter() - t0)
        out[name + "_GBps"] = nbytes / statistics.median(times) / 1e9
    del host, dev
    return out


def _engine(stage: int, args, device: torch.device):
    import zerocore

    model = sv.build_model("gpt", args, args.vocab).to(device)
    z = {"stage": stage}
    if stage == 3:
        z.update(sv.stage3_config(model, sv.UNIT_CLASS["gpt"], args.persist))
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": 1.0, "zero_optimization": z,
           "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    return zerocore.initialize(model, cfg)


def one_stage(stage: int, args, device: torch.device) -> dict:
    _sync(device)
    base = _allocated(device)
    engine = _engine(stage, args, device)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        b = torch.randint(0, args.vocab, (args.batch, args.ctx + 1), generator=gen).to(device)
        logits = engine(b[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
    del logits, loss
    _sync(device)
    held = _allocated(device)
    # the bytes of every storage the offload will move, copied on the device (for the exactness check)
    engine.offload_states()
    aside = engine.__dict__["_zc_states_aside"]
    moved_bytes = sum(m.nbytes for m in aside.moved)
    after_offload = _allocated(device)
    engine.reload_states()
    copies = [(m.storage, torch.empty(0, dtype=torch.uint8, device=device).set_(m.storage).clone())
              for m in aside.moved]
    del aside
    rounds = []
    for _ in range(args.rounds):
        _sync(device)
        t0 = time.perf_counter()
        engine.offload_states()
        _sync(device)
        t1 = time.perf_counter()
        freed = held - _allocated(device) if device.type == "cuda" else 0
        engine.reload_states()
        _sync(device)
        t2 = time.perf_counter()
        rounds.append({"offload_s": t1 - t0, "reload_s": t2 - t1, "freed_bytes": freed})
    exact = all(torch.equal(torch.empty(0, dtype=torch.uint8, device=device).set_(st), c) for st, c in copies)
    del copies
    # training goes on after the round trips
    b = torch.randint(0, args.vocab, (args.batch, args.ctx + 1), generator=gen).to(device)
    loss = torch.nn.functional.cross_entropy(engine(b[:, :-1]).float().flatten(0, 1), b[:, 1:].flatten())
    engine.backward(loss)
    engine.step()
    finite = bool(torch.isfinite(loss).item())
    engine.destroy()
    del engine, loss
    _sync(device)
    left = _allocated(device) - base
    off = statistics.median(r["offload_s"] for r in rounds)
    rel = statistics.median(r["reload_s"] for r in rounds)
    return {"stage": stage, "moved_GiB": moved_bytes / 2**30, "held_GiB": (held - base) / 2**30,
            "after_offload_GiB": (after_offload - base) / 2**30, "offload_s": off, "reload_s": rel,
            "offload_GBps": moved_bytes / off / 1e9, "reload_GBps": moved_bytes / rel / 1e9,
            "round_trip_GBps": 2 * moved_bytes / (off + rel) / 1e9, "exact": exact, "trains_after": finite,
            "left_after_destroy_GiB": left / 2**30, "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--persist", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    results = []
    for stage in args.stages:
        r = one_stage(stage, args, device)
        results.append(r)
        gc.collect()
        print(json.dumps({k: v for k, v in r.items() if k != "rounds"}), flush=True)
    ceiling = pinned_copy_rate(int(max(r["moved_GiB"] for r in results) * 2**30) or 1 << 20, device)
    print(f"\npinned copy rate ({args.device}): device->host {ceiling['d2h_GBps']:.1f} GB/s, "
          f"host->device {ceiling['h2d_GBps']:.1f} GB/s")
    print(f"{'stage':>5} {'moved GiB':>9} {'held GiB':>8} {'offloaded':>9} {'off GB/s':>8} {'rel GB/s':>8} "
          f"{'vs pinned':>9} {'exact':>5}")
    for r in results:
        r["vs_pinned"] = (r["offload_GBps"] / ceiling["d2h_GBps"] + r["reload_GBps"] / ceiling["h2d_GBps"]) / 2
        print(f"{r['stage']:>5} {r['moved_GiB']:>9.2f} {r['held_GiB']:>8.2f} {r['after_offload_GiB']:>9.2f} "
              f"{r['offload_GBps']:>8.1f} {r['reload_GBps']:>8.1f} {r['vs_pinned']:>9.2f} {str(r['exact']):>5}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "args": vars(args), "pinned": ceiling, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
