"""CPU time per training step (``time.thread_time``, robust to other processes on the cores) of
zerocore stage 2 with and without ``offload_optimizer: cpu``, one process, one thread, the
step.py TinyGPT, clipping on. At stages 1/2 the host step is synchronous on the training thread,
so its thread time holds the whole pipeline's cost (gradient copy, host norm, host Adam).
Interleaved (alternating order each round), first round discarded.

    python benchmarks/offload_cpu_time.py --out benchmarks/results/offload_cpu_time.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import zerocore
from zerocore.demo import TinyGPT


def make(offload: bool):
    torch.manual_seed(0)
    model = TinyGPT(65, 256, 12, heads=8, ctx=128)
    z = {"stage": 2, "reduce_bucket_size": 2_500_000, "overlap_comm": True}
    if offload:
        z["offload_optimizer"] = {"device": "cpu"}
    return zerocore.initialize(model, {"gradient_clipping": 1.0, "zero_optimization": z,
                                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    engines = {"stage2": make(False), "stage2_offload": make(True)}
    batch = torch.randint(0, 65, (8, 129), generator=torch.Generator().manual_seed(0))
    times = {k: [] for k in engines}
    for r in range(args.rounds):
        order = list(engines.items()) if r % 2 else list(reversed(engines.items()))
        for name, engine in order:
            for _ in range(args.steps):
                t0 = time.thread_time()
                loss = torch.nn.functional.cross_entropy(engine(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
                engine.backward(loss)
                engine.step()
                if r:
                    times[name].append(time.thread_time() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["stage2_offload"] / med["stage2"]
    print(f"{'variant':<18}{'median CPU ms':>14}")
    for k, v in med.items():
        print(f"{k:<18}{v * 1e3:>14.1f}")
    print(f"stage2_offload / stage2: {ratio:.3f}x (target <= 1.05x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"median_s": med, "ratio": ratio, "times_s": times, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
