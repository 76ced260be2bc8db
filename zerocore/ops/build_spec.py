"""What the native extension is built from, and how.

The single source of truth for ``setup.py`` (ahead-of-time build) and for the JIT fallback in
``zerocore.ops._loader``: both read these lists, so the two builds cannot drift. This module
imports nothing from zerocore or torch so setup.py can load it by path.
"""
from __future__ import annotations

import os

# Repository-relative paths. Kernel sources include no torch headers (they compile in about
# a second each); only the binding file sees torch.
KERNEL_SOURCES = [
    "csrc/isa/dispatch.cpp",
    "csrc/isa/scalar.cpp",
    "csrc/isa/avx2.cpp",
    "csrc/isa/avx512.cpp",
    "csrc/adam/adam.cpp",
    "csrc/cast/cast.cpp",
    "csrc/norm/norm.cpp",
    "csrc/flatten/flatten.cpp",
    "csrc/bench/stream.cpp",
]
BINDING_SOURCE = "csrc/bindings.cpp"

# Which kernel sources serve which op, for error messages and `zerocore env`.
OP_SOURCES = {
    "adam": ["csrc/adam/adam.cpp", "csrc/isa/"],
    "flatten": ["csrc/flatten/flatten.cpp"],
    "cast": ["csrc/cast/cast.cpp", "csrc/isa/"],
    "norm": ["csrc/norm/norm.cpp", "csrc/isa/"],
}

# No -march=native: ISA-specific code is confined to csrc/isa/{avx2,avx512}.cpp (target
# pragmas) and chosen at run time. -ffp-contract=off keeps mul+add unfused so every ISA path
# rounds the same way; -fno-math-errno lets sqrt vectorise.
CXX_FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-Wno-psabi"]
LINK_FLAGS = ["-fopenmp"]


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sources(root: str | None = None) -> list[str]:
    root = root or repo_root()
    return [os.path.join(root, p) for p in KERNEL_SOURCES + [BINDING_SOURCE]]


def include_dirs(root: str | None = None) -> list[str]:
    return [os.path.join(root or repo_root(), "csrc")]
