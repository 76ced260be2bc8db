"""`zerocore env`: what this installation can do and why not, in one screen."""
from __future__ import annotations

import os
import platform

from .ops import _loader
from .ops.build_spec import OP_SOURCES


def collect() -> dict:
    import torch

    info: dict = {
        "zerocore": __import__("zerocore").__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "openmp_threads": torch.get_num_threads(),
        "ZEROCORE_CPU_ISA": os.environ.get("ZEROCORE_CPU_ISA"),
    }
    ops: dict = {}
    try:
        lib = _loader.load("env")
        how = _loader.status()["how"]
        info["extension"] = how
        if how == "jit":
            info["prebuilt_missing_because"] = _loader.status()["prebuilt_error"]
        info["cpu_isa_active"] = lib.active_isa()
        info["cpu_isas_supported"] = list(lib.supported_isas())
        info["extension_compiler"] = compiled_with(lib)
        info["extension_built_by"] = _loader.build_compiler() or (
            "not recorded (built before zerocore recorded its compiler; rebuild to see it)")
        if hasattr(lib, "crc32c_hardware"):
            info["crc32c"] = "SSE4.2 crc32 instruction" if lib.crc32c_hardware() else "table (no SSE4.2)"
        for op in OP_SOURCES:
            ops[op] = how
        unavailable = _loader.unavailable_parts()
        ops["aio"] = how if getattr(lib, "WITH_AIO", False) else "unavailable: " + unavailable.get("aio", "not built")
        ops["cuda"] = how if getattr(lib, "WITH_CUDA", False) else "unavailable: " + unavailable.get("cuda", "not built")
    except Exception as exc:  # report, never crash: env is what people run when things break
        info["extension"] = f"unavailable: {exc}"
        for op in list(OP_SOURCES) + ["aio", "cuda"]:
            ops[op] = "unavailable (see extension)"
    info["ops"] = ops
    try:  # what the CUDA part was compiled for and which code each visible GPU would run
        from .ops.cuda import build_info

        info["cuda_build"] = build_info()
    except Exception as exc:  # never let a report crash
        info["cuda_build"] = f"unknown: {exc}"
    info.update(aio_backends())
    info["libaio_headers"] = os.path.exists("/usr/include/libaio.h")
    info["liburing_headers"] = os.path.exists("/usr/include/liburing.h")
    return info


def compiled_with(lib) -> str:
    """The compiler, C++ library and C++ standard compiled into the extension (its own macros:
    true whoever built it), e.g. 'gcc 12.2.0, libstdc++ 12 (20230707), C++ 201703'."""
    if not hasattr(lib, "compiler_info"):
        return "unknown (this extension predates compiler_info; rebuild to see it)"
    c = lib.compiler_info()
    return f"{c.get('compiler', 'unknown')}, {c.get('stdlib', 'unknown')}, C++ {c.get('cplusplus', '?')}"


def aio_backends() -> dict:
    """Which I/O backend the NVMe engine's ``backend='auto'`` (the config's default) uses here,
    and each backend's status: 'usable' or why not."""
    try:
        from .ops import aio

        if aio.aio_unavailable() is not None:
            return {"aio_backend": "none: " + aio.aio_unavailable()}
        usable = aio.available_backends()
        picked = aio.auto_backend(usable)
        out = {"aio_backend": picked or "none usable here"}
        out.update({f"aio_backend.{b}": "usable" if why is None else f"unusable: {why}" for b, why in usable.items()})
        return out
    except Exception as exc:  # never let a report crash
        return {"aio_backend": f"unknown: {exc}"}


def render(info: dict) -> str:
    lines = ["zerocore environment", "-" * 60]
    for key, value in info.items():
        if key == "ops":
            continue
        lines.append(f"{key:<26} {value}")
    lines.append("ops:")
    for op, how in info["ops"].items():
        lines.append(f"  {op:<24} {how}")
    return "\n".join(lines)
