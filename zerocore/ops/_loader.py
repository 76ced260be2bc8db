"""Finds the native extension: the prebuilt ``zerocore._C`` if it imports, else a JIT build of
the same sources (``build_spec``) with torch.utils.cpp_extension and ninja, announced once.

A failed build raises :class:`NativeBuildError` naming the op that needed it, the compiler's
first error and its file, and what to install only when a tool is missing (a source that does
not compile is zerocore's bug), instead of surfacing later as an AttributeError.
"""
from __future__ import annotations

import logging
import os
import threading

from . import build_failure, build_spec

log = logging.getLogger("zerocore.ops")

_lock = threading.Lock()
_module = None
_how: str | None = None  # "prebuilt" | "jit"
_error: Exception | None = None
_prebuilt_error: str | None = None
_jit_unavailable: dict | None = None  # optional parts a JIT build left out, and why
_jit_compiler: str | None = None  # the compiler a JIT build ran: "<--version line> (<path>)"


class NativeBuildError(RuntimeError):
    """The native extension could not be imported or built."""


def _jit_dir() -> str:
    import torch

    base = os.environ.get("ZEROCORE_JIT_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "zerocore", "jit"
    )
    return os.path.join(base, "torch-" + torch.__version__.replace("+", "_"))


def _explain_build_failure(op: str, exc: BaseException) -> NativeBuildError:
    """The compiler's first error with its file (relative to the tree) and the compiler that
    gave it; tool hints only for a tool that is really missing (build_failure.explain)."""
    # A CalledProcessError (torch running the compiler itself) keeps the tool's output apart.
    out = [getattr(exc, a, None) for a in ("output", "stderr")]
    text = "\n".join([str(exc)] + [o.decode(errors="replace") if isinstance(o, bytes) else o for o in out if o])
    what, advice = build_failure.explain(text)
    return NativeBuildError(
        f"zerocore op '{op}' needs the native extension, which is not prebuilt here "
        f"({_prebuilt_error}) and failed to JIT-build: {what}. {advice}"
    )


def _jit_build(op: str):
    from torch.utils import cpp_extension

    srcs = build_spec.sources()
    missing = [s for s in srcs if not os.path.exists(s)]
    if missing:
        raise NativeBuildError(
            f"zerocore op '{op}' needs the native extension: no prebuilt one is importable "
            f"({_prebuilt_error}) and its sources are not here to JIT-build ({missing[0]} is "
            "missing). Reinstall with `pip install --no-build-isolation .`."
        )
    build_dir = _jit_dir()
    os.makedirs(build_dir, exist_ok=True)
    log.warning(
        "zerocore: no prebuilt native extension (%s); JIT-building it with ninja in %s "
        "(about a minute the first time, cached afterwards)", _prebuilt_error, build_dir,
    )
    import torch

    cfg = build_spec.extension_config(torch_has_cuda=torch.version.cuda is not None)
    global _jit_unavailable, _jit_compiler
    _jit_unavailable = cfg["unavailable"]
    _jit_compiler = build_failure.compiler_version()  # what torch runs: $CXX, else c++
    macros = [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in cfg["define_macros"]]
    libs = [f"-L{d}" for d in cfg["library_dirs"]] + [f"-l{lib}" for lib in cfg["libraries"]]
    try:
        return cpp_extension.load(
            name="zerocore_C_jit",
            sources=cfg["sources"],
            extra_include_paths=cfg["include_dirs"],
            extra_cflags=cfg["extra_compile_args"] + macros,
            extra_cuda_cflags=cfg["extra_cuda_args"] + macros,
            extra_ldflags=cfg["extra_link_args"] + libs,
            build_directory=build_dir,
            with_cuda=cfg["with_cuda"],
            verbose=False,
        )
    except Exception as exc:  # the compiler's output is in the message
        raise _explain_build_failure(op, exc) from exc


def load(op: str = "native"):
    """The extension module, built on first use if need be. ``op`` names the caller for
    error messages. A failure is remembered and re-raised: no retry storm per call."""
    global _module, _how, _error, _prebuilt_error
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise _error
        try:
            if os.environ.get("ZEROCORE_FORCE_JIT"):
                raise ImportError("ZEROCORE_FORCE_JIT is set")
            from zerocore import _C as mod  # type: ignore[attr-defined]

            _how = "prebuilt"
        except ImportError as exc:
            _prebuilt_error = f"prebuilt zerocore._C not importable: {exc}"
            try:
                mod = _jit_build(op)
                _how = "jit"
            except NativeBuildError as err:
                _error = err
                raise
        try:
            _apply_isa_env(mod)
        except ValueError as err:
            _error = err
            raise
        _module = mod
        return mod


def _apply_isa_env(mod) -> None:
    want = os.environ.get("ZEROCORE_CPU_ISA")
    if want:
        try:
            mod.set_isa(want.strip().lower())
        except ValueError as exc:
            raise ValueError(f"ZEROCORE_CPU_ISA={want!r}: {exc}") from None


def unavailable_parts() -> dict:
    """Optional parts (aio, cuda) left out of the loaded extension, with the reason."""
    if _how == "jit":
        return dict(_jit_unavailable or {})
    try:
        from zerocore import _build_info  # type: ignore[attr-defined]

        return dict(_build_info.UNAVAILABLE)
    except ImportError:
        return {}


def build_compiler() -> str | None:
    """The compiler that built the loaded extension, "<--version line> (<path>)": as setup.py
    recorded it in zerocore/_build_info.py, or as the JIT build ran it; None if not recorded
    (an extension built before zerocore recorded it). The extension's own compiler_info() says
    what was compiled in."""
    if _how == "jit":
        return _jit_compiler
    try:
        from zerocore import _build_info  # type: ignore[attr-defined]

        return getattr(_build_info, "COMPILER", None)
    except ImportError:
        return None


def status() -> dict:
    """How the extension was obtained, without triggering a build."""
    return {"loaded": _module is not None, "how": _how, "error": str(_error) if _error else None,
            "prebuilt_error": _prebuilt_error}
