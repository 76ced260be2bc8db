"""Cost of checksumming NVMe swap tiles: ops.crc32c's throughput, and its time as a fraction of
a CPU Adam step over the same parameters (a tile holds fp32 master, m and v: 12 bytes per
parameter, checksummed once when written and once when read back: 24 bytes per parameter per
step; the Adam step moves 28). Variants interleaved, one thread, ``time.thread_time``.

    python benchmarks/checksum_speed.py --out benchmarks/results/crc32c_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info  # noqa: E402

from zerocore import ops  # noqa: E402
from zerocore.ops import _loader  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=4_000_000, help="parameters per tile")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(1)
    n = a.params
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    tile = torch.cat([p, m, v])  # the bytes a tile checksums
    lib = _loader.load()
    variants = {
        "adam_step": lambda: ops.adam_step(p, g, m, v, lr=1e-3, step=1),
        "crc32c_x2": lambda: (ops.crc32c(tile), ops.crc32c(tile)),
        "crc32c_table_x2": lambda: (lib.crc32c(tile, 0, False), lib.crc32c(tile, 0, False)),
    }
    times = {k: [] for k in variants}
    for r in range(a.reps):
        for k in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            t0 = time.thread_time()
            variants[k]()
            times[k].append(time.thread_time() - t0)
    med = {k: statistics.median(t) for k, t in times.items()}
    tile_bytes = tile.numel() * 4
    res = {"params": n, "hardware": ops.checksum.crc32c_uses_hardware(), "median_s": med,
           "crc32c_GBps": 2 * tile_bytes / med["crc32c_x2"] / 1e9,
           "crc32c_table_GBps": 2 * tile_bytes / med["crc32c_table_x2"] / 1e9,
           "crc_over_adam": med["crc32c_x2"] / med["adam_step"]}
    print(f"{n:,} params, 1 thread; SSE4.2 crc32: {res['hardware']}")
    print(f"adam_step {med['adam_step'] * 1e3:.2f} ms; crc32c of the tile written + read "
          f"({2 * tile_bytes / 1e6:.0f} MB) {med['crc32c_x2'] * 1e3:.2f} ms = {res['crc32c_GBps']:.1f} GB/s "
          f"(table: {res['crc32c_table_GBps']:.2f} GB/s); checksums cost {100 * res['crc_over_adam']:.1f}% of the "
          "Adam step (target < 5%)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(a), **res}, f, indent=2)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
