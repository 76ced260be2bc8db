"""Which native errors kill the process on this machine? Each case calls one binding of zerocore's
extension with input it refuses (so it throws a C++ exception), in a fresh process, and reports how
that process ended: a Python exception (fine) or a signal (the crash the GPU tests met on an H200 with
torch 2.11 + g++ 13, 2026-11-26: every refusal thrown by the CUDA binding). With ``--gdb`` the first
crashing case is run again under ``cuda-gdb``/``gdb`` for a native backtrace.

    python scripts/native_throw_probe.py [--gdb] [--out probe.json]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

PRELUDE = "import torch, zerocore; from zerocore import _C; d = 'cuda' if torch.cuda.is_available() else 'cpu'\n"

CASES = {
    # CPU binding: std::invalid_argument (ZC_CHECK_VALUE) for mismatched list lengths
    "cpu_value": "_C.pack([torch.zeros(3)], [0, 1], torch.zeros(8))",
    # CPU binding: c10::Error (TORCH_CHECK_VALUE) from set_data
    "cpu_c10": "_C.set_data([torch.nn.Parameter(torch.zeros(2))], [])",
    # pybind11's own argument conversion (no throw from zerocore's code)
    "cuda_pybind_args": "_C.cuda_pack('x', [0], torch.zeros(8, device=d), 0)",
    # CUDA binding, std::invalid_argument before touching any tensor
    "cuda_value_len": "_C.cuda_pack([torch.zeros(3, device=d)], [0, 1], torch.zeros(8, device=d), 0)",
    # CUDA binding, pybind11::type_error (ZC_CHECK_TYPE)
    "cuda_type": "_C.cuda_pack([torch.zeros(3, device=d)], [0], torch.zeros(8, device=d, dtype=torch.bfloat16), 0)",
    # CUDA binding, a check after a tensor was inspected (the GPU tests' 'pack shrunk tensor')
    "cuda_value_fit": "_C.cuda_pack([torch.zeros(3, device=d)], [7], torch.zeros(8, device=d), 0)",
}


def run_case(code: str, timeout: float = 120) -> dict:
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", PRELUDE + code], capture_output=True, text=True,
                       timeout=timeout)
    last = (p.stderr.strip().splitlines() or [""])[-1]
    return {"rc": p.returncode, "crashed": p.returncode < 0, "last_line": last[:300]}


def backtrace(code: str, timeout: float = 170) -> str:
    dbg = shutil.which("cuda-gdb") or shutil.which("gdb")
    if dbg is None:
        return "no cuda-gdb/gdb here"
    cmd = [dbg, "-q", "-batch", "-ex", "set pagination off", "-ex", "set print thread-events off", "-ex", "run",
           "-ex", "bt 40", "-ex", "info sharedlibrary", "--args", sys.executable, "-c", PRELUDE + code]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return f"{dbg} timed out after {timeout} s: {(e.stdout or '')[-4000:]}"
    return (p.stdout + p.stderr)[-20000:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gdb", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = {}
    for name, code in CASES.items():
        results[name] = run_case(code)
        print(f"{name:18} rc={results[name]['rc']:>4} {'CRASH' if results[name]['crashed'] else 'ok   '} "
              f"{results[name]['last_line']}", flush=True)
    crashed = [n for n, r in results.items() if r["crashed"]]
    if args.gdb and crashed:
        results["backtrace_of"] = crashed[0]
        results["backtrace"] = backtrace(CASES[crashed[0]])
        print(results["backtrace"][-6000:])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
