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


# Optional parts of the extension. Each returns a dict with keys: sources (repo-relative),
# define_macros [(name, value)], extra_compile_args (cxx), extra_link_args, libraries,
# library_dirs, include_dirs, and "unavailable" (None when built, else the reason, which
# `zerocore env` reports). Each is owned by its concern so the parts evolve independently.


def aio_config(root: str) -> dict:
    """NVMe I/O (csrc/aio). Not built yet."""
    return dict(sources=[], define_macros=[], extra_compile_args=[], extra_link_args=[], libraries=[],
                library_dirs=[], include_dirs=[], unavailable="the NVMe I/O op is not part of this build yet")


def cuda_config(root: str, torch_has_cuda: bool) -> dict:
    """CUDA kernels (csrc/cuda). Not built yet."""
    return dict(sources=[], define_macros=[], extra_compile_args=[], extra_link_args=[], libraries=[],
                library_dirs=[], include_dirs=[], unavailable="CUDA kernels are not part of this build yet")


def extension_config(root: str | None = None, torch_has_cuda: bool = False) -> dict:
    """Everything needed to build the extension: the CPU core plus whichever optional parts
    can be built here. Used by setup.py and the JIT loader alike."""
    root = root or repo_root()
    cfg = dict(sources=sources(root), include_dirs=include_dirs(root), define_macros=[],
               extra_compile_args=list(CXX_FLAGS), extra_cuda_args=[], extra_link_args=list(LINK_FLAGS),
               libraries=[], library_dirs=[], unavailable={}, with_cuda=False)
    for name, part in (("aio", aio_config(root)), ("cuda", cuda_config(root, torch_has_cuda))):
        if part["unavailable"]:
            cfg["unavailable"][name] = part["unavailable"]
            continue
        cfg["sources"] += [os.path.join(root, p) for p in part["sources"]]
        cfg["include_dirs"] += part["include_dirs"]
        cfg["define_macros"] += part["define_macros"]
        cfg["extra_compile_args"] += part["extra_compile_args"]
        cfg["extra_cuda_args"] += part.get("extra_cuda_args", [])
        cfg["extra_link_args"] += part["extra_link_args"]
        cfg["libraries"] += part["libraries"]
        cfg["library_dirs"] += part["library_dirs"]
        cfg["with_cuda"] = cfg["with_cuda"] or name == "cuda"
    return cfg


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sources(root: str | None = None) -> list[str]:
    root = root or repo_root()
    return [os.path.join(root, p) for p in KERNEL_SOURCES + [BINDING_SOURCE]]


def include_dirs(root: str | None = None) -> list[str]:
    return [os.path.join(root or repo_root(), "csrc")]
