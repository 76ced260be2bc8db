"""Fails when a csrc/ source uses a standard-library name without including its header.

    python scripts/check_std_includes.py            # every source of csrc/ (CI: scripts/zc.sh test)
    python scripts/check_std_includes.py --file COPY.cpp --like csrc/aio/threadpool_context.cpp

Why this mechanism: the bug it guards against is a name (std::system_error) that libstdc++ 12
declares through other headers and newer libstdc++ releases do not, so the only reliable test is
to compile with a newer libstdc++ -- which is what users with newer compilers do. Every source
is compiled with -fsyntax-only (no code generated: about a minute for the whole tree, most of it
the three files that include torch) by a compiler using libstdc++ >= 13: the machine's own where
it is new enough (Debian 13: g++ 14), else Debian 13's g++ 14 fetched once into ~/.cache/zerocore
(scripts/newer_libstdcxx.py says how and why that way). Rejected: include-what-you-use (its clang
and mapping files disagree with libstdc++ on what is "private", and it reports style, not the
failure users meet); g++ 12 with libstdc++ 14's headers (g++ 12 cannot parse them); clang with
libc++ (does not catch the <system_error> case). It runs from scripts/zc.sh before ctest, not as
a pytest test, because it is a build check of the whole tree that needs torch's headers, nvcc and
(once) the network, and a pytest run would repeat its minute on every invocation;
tests/ops/test_std_includes.py proves it catches the real bug on one file.

What is compiled, with the macros and include paths the real builds use (zerocore/ops/build_spec.py):
- every .cpp of csrc/; the aio ones with libaio and io_uring switched on where their headers are
  installed, and io_context.cpp also without them (the thread-pool-only build);
- the files that include torch with torch.utils.cpp_extension.include_paths() and Python's headers;
  bindings.cpp with ZEROCORE_WITH_AIO and ZEROCORE_WITH_CUDA (both optional parts declared);
- every torch-free .h on its own (each header includes what it uses); .inc files through the
  isa/*.cpp that include them; .cuh files through the .cu files;
- every .cu with `nvcc -cuda` and the newer compiler as nvcc's host compiler (-ccbin): the host
  preprocessor brings in the newer libstdc++ and nvcc's front end parses host and device code.
A part that cannot be checked here (no nvcc, no torch, no liburing.h) is named in the output.

Environment: ZC_STDINC=0 skips the check (says so); ZC_STDINC_REQUIRE=1 (or --require) makes "no
newer compiler could be had" a failure instead of a loud warning; ZC_STDINC_CXX=<command> uses
that compiler.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import newer_libstdcxx  # noqa: E402  (this folder is not a package)

SPEC = runpy.run_path(os.path.join(ROOT, "zerocore", "ops", "build_spec.py"))
BACKEND_HEADERS = {"ZEROCORE_WITH_LIBAIO": "libaio.h", "ZEROCORE_WITH_URING": "liburing.h"}
BACKEND_SOURCES = {"csrc/aio/libaio_context.cpp": "ZEROCORE_WITH_LIBAIO", "csrc/aio/uring_context.cpp": "ZEROCORE_WITH_URING"}


@dataclass
class Unit:
    rel: str                      # the csrc file whose flags it uses (for messages)
    path: str                     # the file compiled (rel's, or a copy given with --file)
    note: str = ""                # which configuration, e.g. "thread pool only"
    args: list[str] = field(default_factory=list)
    nvcc: bool = False
    weight: int = 1               # compile cost, to start the slow ones first

    @property
    def label(self) -> str:
        return self.rel + (f" ({self.note})" if self.note else "")


def _find_header(name: str) -> str | None:
    return next((d for d in ("/usr/include", "/usr/local/include") if os.path.exists(os.path.join(d, name))), None)


def _nvcc() -> str | None:
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    found = next((os.path.join(h, "bin", "nvcc") for h in homes if h and os.path.exists(os.path.join(h, "bin", "nvcc"))),
                 None) or shutil.which("nvcc")
    return os.path.realpath(found) if found else None


def _torch_args() -> tuple[list[str] | None, str]:
    try:
        import sysconfig

        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        return None, f"torch is not importable ({exc})"
    dirs = cpp_extension.include_paths() + [sysconfig.get_paths()["include"]]
    return ([a for d in dirs for a in ("-isystem", d)] +
            ["-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]), ""


class Planner:
    """Which compiler flags each csrc file gets; computed once per run."""

    def __init__(self):
        self.base = list(SPEC["CXX_FLAGS"]) + ["-fsyntax-only", "-I", os.path.join(ROOT, "csrc")]
        self.backends = [m for m, h in BACKEND_HEADERS.items() if _find_header(h)]
        self.torch, self.torch_why = _torch_args()
        self.nvcc = _nvcc()
        self.cuda_include = os.path.join(os.path.dirname(os.path.dirname(self.nvcc)), "include") if self.nvcc else None
        self.skipped: list[str] = []

    def units_for(self, rel: str, path: str | None = None) -> list[Unit]:
        path = path or os.path.join(ROOT, rel)
        text = open(path, encoding="utf-8", errors="replace").read()
        if rel.endswith(".cu"):
            if not self.nvcc:
                self.skipped.append(f"{rel}: no nvcc here (looked in $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, PATH)")
                return []
            return [Unit(rel, path, "nvcc -cuda", ["-std=c++17", "-I", os.path.join(ROOT, "csrc")], nvcc=True, weight=3)]
        args = list(self.base)
        if rel.endswith(".h"):
            args = ["-x", "c++"] + args
        note, weight = "", 1
        if "<torch/" in text:
            if self.torch is None:
                self.skipped.append(f"{rel}: {self.torch_why}")
                return []
            args += self.torch + (["-DZEROCORE_WITH_AIO", "-DZEROCORE_WITH_CUDA"] if rel == "csrc/bindings.cpp" else [])
            weight = 20
        if "<cuda_runtime" in text:
            if not self.cuda_include:
                self.skipped.append(f"{rel}: no CUDA toolkit here (its cuda_runtime_api.h is needed)")
                return []
            args += ["-isystem", self.cuda_include]
        if rel.startswith("csrc/aio/") or rel == "csrc/bindings_aio.cpp":
            need = BACKEND_SOURCES.get(rel)
            if need and need not in self.backends:
                self.skipped.append(f"{rel}: {BACKEND_HEADERS[need]} is not installed (Debian: "
                                    f"{'libaio-dev' if 'LIBAIO' in need else 'liburing-dev'})")
                return []
            args += ["-DZEROCORE_WITH_AIO"] + [f"-D{m}" for m in self.backends]
            note = "with " + ", ".join(m.split("_")[-1].lower() for m in self.backends) if self.backends else ""
            if rel == "csrc/aio/io_context.cpp" and self.backends:
                return [Unit(rel, path, note, args + [path]),
                        Unit(rel, path, "thread pool only", list(self.base) + ["-DZEROCORE_WITH_AIO", path])]
        return [Unit(rel, path, note, args + [path], weight=weight)]


def tree_units(planner: Planner) -> tuple[list[Unit], list[str]]:
    """Every .cpp, .cu and torch-free-or-not .h of csrc/ (see the module docstring)."""
    rels = sorted(os.path.relpath(p, ROOT) for ext in ("cpp", "cu", "h")
                  for p in glob.glob(os.path.join(ROOT, "csrc", "**", f"*.{ext}"), recursive=True))
    units, through = [], []
    for rel in rels:
        if rel.endswith(".h") and "<torch/" in open(os.path.join(ROOT, rel)).read():
            through.append(rel)  # 10 s each on its own; compiled inside the binding files
            continue
        units += planner.units_for(rel)
    through += sorted(os.path.relpath(p, ROOT) for ext in ("inc", "cuh")
                      for p in glob.glob(os.path.join(ROOT, "csrc", "**", f"*.{ext}"), recursive=True))
    return units, through


def compile_unit(compiler: newer_libstdcxx.Compiler, ccbin: str | None, unit: Unit, tmp: str) -> tuple[bool, str]:
    if unit.nvcc:
        out = os.path.join(tmp, re.sub(r"\W", "_", unit.rel) + ".ii")
        # -allow-unsupported-compiler: a host g++ newer than this nvcc knows still parses the
        # same; only the front end runs (-cuda), nothing is generated for a GPU.
        argv = [_nvcc(), "-ccbin", ccbin, "-allow-unsupported-compiler", "-cuda", "-arch=sm_80"] + unit.args + [unit.path,
                                                                                                               "-o", out]
    else:
        argv = compiler.argv + unit.args
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return False, f"timed out after 600 s: {shlex.join(argv)}"
    return r.returncode == 0, (r.stderr + r.stdout).strip()


def first_errors(output: str, limit: int = 25) -> str:
    """The compiler output from its first error on, without the 'In file included from' chains."""
    lines = output.splitlines()
    start = next((i for i, ln in enumerate(lines) if re.search(r"\berror\b", ln)), 0)
    return "\n".join(lines[max(0, start - 1):start + limit])


def _ccbin_for(compiler: newer_libstdcxx.Compiler, tmp: str) -> str:
    if compiler.ccbin:
        return compiler.ccbin
    path = os.path.join(tmp, "ccbin", "g++")
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nexec {shlex.join(compiler.argv)} "$@"\n')
    os.chmod(path, 0o755)
    return path


def run(units: list[Unit], compiler: newer_libstdcxx.Compiler, jobs: int, log=print) -> list[tuple[Unit, str]]:
    """Compiles the units, jobs at a time; returns the failures with their compiler output."""
    failures = []
    with tempfile.TemporaryDirectory(prefix="zc-stdinc-") as tmp:
        ccbin = _ccbin_for(compiler, tmp) if any(u.nvcc for u in units) else None
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = {pool.submit(compile_unit, compiler, ccbin, u, tmp): u
                       for u in sorted(units, key=lambda u: -u.weight)}
            for fut in concurrent.futures.as_completed(futures):
                unit = futures[fut]
                ok, out = fut.result()
                if not ok:
                    failures.append((unit, out))
                    log(f"FAIL {unit.label}\n{first_errors(out)}\n")
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--file", help="check only this file (e.g. a copy), with the flags of --like")
    p.add_argument("--like", help="the csrc/ path whose flags --file gets (default: --file's own path)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--require", action="store_true", default=os.environ.get("ZC_STDINC_REQUIRE", "") == "1",
                   help="fail (exit 2) when no compiler with libstdc++ >= 13 can be had (default: warn and skip)")
    p.add_argument("--no-download", action="store_true", help="use only a compiler already here or cached")
    a = p.parse_args(argv)
    say = lambda msg: print(f"check_std_includes: {msg}", flush=True)  # noqa: E731
    if os.environ.get("ZC_STDINC", "1") == "0":
        say("SKIPPED: ZC_STDINC=0 is set; csrc/ was NOT checked against a newer libstdc++")
        return 0
    try:
        compiler = newer_libstdcxx.find(allow_download=not a.no_download, log=say)
    except newer_libstdcxx.Unavailable as exc:
        bar = "!" * 100
        print(f"{bar}\ncheck_std_includes: WARNING: csrc/ was NOT checked for missing standard includes: no "
              f"compiler with libstdc++ >= {newer_libstdcxx.MIN_GLIBCXX_RELEASE} could be had: {exc}\n"
              f"(a source that builds here may still fail with a newer g++; ZC_STDINC_REQUIRE=1 makes this an "
              f"error)\n{bar}", file=sys.stderr, flush=True)
        return 2 if a.require else 0
    say(f"compiling with {compiler.version} (libstdc++ {compiler.glibcxx}; {compiler.how})")
    planner = Planner()
    t0 = time.monotonic()
    if a.file:
        rel = a.like or os.path.relpath(os.path.abspath(a.file), ROOT)
        units, through = planner.units_for(rel, os.path.abspath(a.file)), []
    else:
        units, through = tree_units(planner)
    for why in planner.skipped:
        say(f"not checked: {why}")
    failures = run(units, compiler, a.jobs, log=lambda m: print(m, flush=True))
    secs = time.monotonic() - t0
    checked = len({u.rel for u in units})
    if failures:
        say(f"{len(failures)} of {len(units)} compilations FAILED in {secs:.0f} s: "
            + ", ".join(u.label for u, _ in failures)
            + ". A std name used without its #include is the usual cause: add the header the first error "
              "points at (e.g. <system_error> for std::system_error).")
        return 1
    say(f"OK: {len(units)} compilations of {checked} files in {secs:.0f} s"
        + (f", {len(through)} more files checked through the files that include them" if through else "")
        + (f"; {len(planner.skipped)} not checked (above)" if planner.skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
