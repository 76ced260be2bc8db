"""Builds and runs csrc/bench/cuda_variants.cu on a GPU machine: device time of zerocore's cast and
Adam kernels beside alternative launch layouts and cudaMemcpy, no torch or Python in the timed region
(what each variant is: that file's header). Needs nvcc and a GPU.

    python benchmarks/cuda_variants.py [--rounds 20] [--out results.json]

Prints the table and writes the JSON (with the build's nvcc flags and the device name)."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(out_dir: str) -> str:
    sys.path.insert(0, os.path.join(ROOT, "zerocore", "ops"))
    import build_spec  # by path: no torch import needed

    cfg = build_spec.cuda_config(ROOT, True)
    if cfg["unavailable"]:
        raise SystemExit(f"cuda_variants: {cfg['unavailable']}")
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    exe = os.path.join(out_dir, "cuda_variants")
    host_flags = [f for f in build_spec.CXX_FLAGS if not f.startswith("-std")]
    srcs = [os.path.join(ROOT, s) for s in cfg["sources"] if s.endswith(".cu")]
    srcs += [os.path.join(ROOT, s) for s in build_spec.KERNEL_SOURCES]
    srcs.append(os.path.join(ROOT, "csrc", "bench", "cuda_variants.cu"))
    cmd = [nvcc, *cfg["extra_cuda_args"], "-I", os.path.join(ROOT, "csrc"), "-Xcompiler", ",".join(host_flags),
           *srcs, "-o", exe, "-lgomp"]
    subprocess.run(cmd, check=True)
    return exe


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out_dir = os.path.join(ROOT, "build", "cuda-variants")
    os.makedirs(out_dir, exist_ok=True)
    exe = build(out_dir)
    run = subprocess.run([exe, str(args.rounds)], capture_output=True, text=True)
    sys.stdout.write(run.stdout)
    sys.stderr.write(run.stderr)
    if run.returncode != 0:
        raise SystemExit(run.returncode)
    results = json.loads(run.stdout.strip().splitlines()[-1])
    gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
    report = {"device": re.sub(r" \(UUID.*", "", gpu), "rounds": args.rounds, "results": results}
    cast, copy = results.get("cast_zerocore"), results.get("memcpy_fp32_array")
    if cast and copy:
        best = max((v for k, v in results.items() if k.startswith("cast_") and v["ok"] == "bit-exact"),
                   key=lambda v: v["gbps"])
        report["cast_best_gbps"] = best["gbps"]
        print(f"zerocore cast {cast['gbps']:.0f} GB/s; best bit-exact layout {best['gbps']:.0f} GB/s")
    if copy:
        # the production call on each layout (flat, and the 200 tensors packed, 512-byte aligned, whole chunks)
        report["adam_pct_of_copy"] = {k[len("adam_fp32_"):]: 100 * v["gbps"] / copy["gbps"]
                                      for k, v in results.items() if k.startswith("adam_fp32_")}
        if "200_tensors" in report["adam_pct_of_copy"]:
            report["adam_200_pct_of_copy"] = report["adam_pct_of_copy"]["200_tensors"]  # the name stops 40-43 used
        print("zerocore Adam, % of the copy rate: "
              + ", ".join(f"{k} {v:.1f}" for k, v in report["adam_pct_of_copy"].items()))
    variants = {k: v for k, v in results.items() if k.startswith("adam_200_") and v["ok"].endswith("bit-exact")}
    if variants and copy:
        report["adam_variants_pct_of_copy"] = {k: 100 * v["gbps"] / copy["gbps"] for k, v in variants.items()}
        print("bit-exact variants, % of the copy rate (\"packed\": the 16-byte layout, else the 512-byte one): "
              + ", ".join(f"{k[len('adam_200_'):]} {p:.1f}" for k, p in report["adam_variants_pct_of_copy"].items()))
        on512 = {k: p for k, p in report["adam_variants_pct_of_copy"].items() if "packed" not in k}
        if on512:
            best = max(on512, key=on512.get)
            report["adam_200_best_lookup"] = {"name": best, "pct_of_copy": on512[best]}  # (512-byte layout)
    wrong = sorted(k for k, v in results.items() if v["ok"] == "WRONG")
    if wrong:
        print("WRONG (not the production kernel's bytes): " + ", ".join(wrong))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
