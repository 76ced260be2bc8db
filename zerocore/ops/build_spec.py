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
    "csrc/checksum/crc32c.cpp",
    "csrc/bench/stream.cpp",
]
BINDING_SOURCE = "csrc/bindings.cpp"

# Which kernel sources serve which op, for error messages and `zerocore env`.
OP_SOURCES = {
    "adam": ["csrc/adam/adam.cpp", "csrc/isa/"],
    "flatten": ["csrc/flatten/flatten.cpp"],
    "cast": ["csrc/cast/cast.cpp", "csrc/isa/"],
    "norm": ["csrc/norm/norm.cpp", "csrc/isa/"],
    "checksum": ["csrc/checksum/crc32c.cpp"],
}

# No -march=native: ISA-specific code is confined to csrc/isa/{avx2,avx512}.cpp (target
# pragmas) and chosen at run time. -ffp-contract=off keeps mul+add unfused so every ISA path
# rounds the same way; -fno-math-errno lets sqrt vectorise.
CXX_FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-Wno-psabi"]
LINK_FLAGS = ["-fopenmp"]


def shared_libstdcxx_args(cxx: str | None = None) -> list[str]:
    """Link flags that make the extension use the shared libstdc++, the one torch and the process use.

    The GPU image's CXX=/opt/gcc/bin/g++ ships libstdc++ only as a static archive, so it linked a private
    copy into the extension (its NEEDED entries had no libstdc++), whose exported symbols the loader
    partly bound to the process's shared copy: std::locale facets of one copy then reached the other's
    streams, and formatting a number into an error message crashed the process (H200, 2026-11-26: every
    refused argument whose message held a number; scripts/native_throw_probe.py). The shared library,
    given to the linker by path ahead of the driver's own libraries, resolves every libstdc++ reference
    to it, whatever the driver adds after. Which one: the compiler's own (``-print-file-name``), else the
    one this process has loaded (setup.py and the JIT build import torch first, which loads it).
    [] when neither is found (then the compiler decides, as before)."""
    path = _compiler_libstdcxx(cxx or os.environ.get("CXX") or "c++") or loaded_libstdcxx()
    return [f"-Wl,--no-as-needed,{path},--as-needed"] if path else []


def _compiler_libstdcxx(cxx: str) -> str | None:
    import shutil
    import subprocess

    if not cxx or shutil.which(cxx.split()[0]) is None:
        return None
    try:
        path = subprocess.run([*cxx.split(), "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    # a compiler that has no shared libstdc++ echoes the bare name back
    return os.path.realpath(path) if os.path.isabs(path) and os.path.exists(path) else None


def loaded_libstdcxx(maps: str = "/proc/self/maps") -> str | None:
    """The libstdc++.so this process has mapped (torch's), or None."""
    try:
        with open(maps) as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if os.path.basename(path).startswith("libstdc++.so") and os.path.exists(path):
                    return path
    except OSError:
        pass
    return None


# Optional parts of the extension. Each returns a dict with keys: sources (repo-relative),
# define_macros [(name, value)], extra_compile_args (cxx), extra_link_args, libraries,
# library_dirs, include_dirs, and "unavailable" (None when built, else the reason, which
# `zerocore env` reports). Each is owned by its concern so the parts evolve independently.


def aio_config(root: str) -> dict:
    """NVMe I/O (csrc/aio): the engine and its thread-pool backend (POSIX only, always built),
    plus libaio and io_uring where their headers and static libraries are installed. Those are
    linked statically (the full path of the .a, symbols kept out of the extension's exports),
    so the built extension needs neither library at run time. ZEROCORE_AIO=0 leaves the part
    out; ZEROCORE_LIBAIO=0 / ZEROCORE_URING=0 leave out one backend, as if its headers were
    missing (how the build of a machine without them is tested here). ``backends_unavailable``
    says why each left-out backend is, for ``aio_backends()`` and ``zerocore env``."""
    import sysconfig

    def off(var: str) -> bool:
        return os.environ.get(var, "").strip().lower() in ("0", "false", "no", "off")

    def find(header: str, archive: str) -> tuple[str | None, str | None]:
        inc_dirs = ["/usr/include", "/usr/local/include"]
        multiarch = sysconfig.get_config_var("MULTIARCH") or ""
        lib_dirs = [os.path.join(d, multiarch) for d in ("/usr/lib", "/usr/local/lib") if multiarch]
        lib_dirs += ["/usr/lib64", "/usr/lib", "/usr/local/lib64", "/usr/local/lib"]
        inc = next((d for d in inc_dirs if os.path.exists(os.path.join(d, header))), None)
        lib = next((os.path.join(d, archive) for d in lib_dirs if os.path.exists(os.path.join(d, archive))), None)
        return inc, lib

    none = dict(sources=[], define_macros=[], extra_compile_args=[], extra_link_args=[], libraries=[],
                library_dirs=[], include_dirs=[], backends_unavailable={})
    if off("ZEROCORE_AIO"):
        return dict(none, unavailable="left out of this build by ZEROCORE_AIO=0")
    sources = ["csrc/aio/io_error.cpp", "csrc/aio/aligned_buffer.cpp", "csrc/aio/file.cpp",
               "csrc/aio/io_context.cpp", "csrc/aio/threadpool_context.cpp", "csrc/aio/worker.cpp",
               "csrc/aio/io_engine.cpp"]
    macros = [("ZEROCORE_WITH_AIO", None)]
    archives, incs, why_not = [], [], {}
    for backend, var, header, archive, source, macro, package in (
            ("libaio", "ZEROCORE_LIBAIO", "libaio.h", "libaio.a", "libaio_context.cpp", "ZEROCORE_WITH_LIBAIO",
             "libaio-dev (Fedora: libaio-devel)"),
            ("io_uring", "ZEROCORE_URING", "liburing.h", "liburing.a", "uring_context.cpp", "ZEROCORE_WITH_URING",
             "liburing-dev (Fedora: liburing-devel)")):
        inc, lib = find(header, archive)
        if off(var):
            why_not[backend] = f"left out of this build by {var}=0"
        elif inc is None or lib is None:
            missing = header if inc is None else f"the static library {archive}"
            why_not[backend] = (f"not built: {missing} was not found at build time; install {package} and rebuild "
                                "(`pip install --no-build-isolation .`)")
        else:
            sources.append(f"csrc/aio/{source}")
            macros.append((macro, None))
            archives.append(lib)
            if inc != "/usr/include":
                incs.append(inc)
    out = dict(none, sources=sources + ["csrc/bindings_aio.cpp"], define_macros=macros,
               include_dirs=sorted(set(incs)), backends_unavailable=why_not, unavailable=None)
    if archives:
        excluded = ":".join(os.path.basename(a) for a in archives)
        out["extra_link_args"] = [f"-Wl,--exclude-libs,{excluded}"] + archives
    return out


def cuda_config(root: str, torch_has_cuda: bool) -> dict:
    """CUDA kernels (csrc/cuda/*.cu and the binding csrc/bindings_cuda.cpp): built when the torch
    we build against is a CUDA build and nvcc is found. Architectures come from
    TORCH_CUDA_ARCH_LIST ("8.0;9.0", "8.0 9.0+PTX", "9.0a", ...), default "8.0;9.0+PTX" (sm_80 and
    sm_90 binaries, plus sm_90 PTX that newer GPUs JIT-compile). ZEROCORE_CUDA=0 leaves the
    part out. The .cu files include no torch header, so they compile in seconds."""
    none = dict(sources=[], define_macros=[], extra_compile_args=[], extra_cuda_args=[], extra_link_args=[],
                libraries=[], library_dirs=[], include_dirs=[])
    if os.environ.get("ZEROCORE_CUDA", "").strip().lower() in ("0", "false", "no", "off"):
        return dict(none, unavailable="left out of this build by ZEROCORE_CUDA=0")
    if not torch_has_cuda:
        return dict(none, unavailable="the torch this was built against is a CPU-only build (torch.version.cuda "
                                      "is None); install a CUDA build of torch and nvcc, then rebuild "
                                      "(`pip install --no-build-isolation .`)")
    import shutil

    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = next((os.path.join(h, "bin", "nvcc") for h in homes if h and os.path.exists(os.path.join(h, "bin", "nvcc"))),
                None) or shutil.which("nvcc")
    if nvcc is None:
        return dict(none, unavailable="nvcc was not found at build time (looked in $CUDA_HOME, $CUDA_PATH, "
                                      "/usr/local/cuda and PATH); install the CUDA toolkit matching torch.version.cuda "
                                      "and rebuild")
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip() or "8.0;9.0+PTX"
    gencode = []
    for item in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        if not item:
            continue
        arch, ptx = (item[:-4], True) if item.upper().endswith("+PTX") else (item, False)
        major, _, minor = arch.partition(".")
        suffix = minor[1:] if len(minor) > 1 else ""
        if not (major.isdigit() and minor[:1].isdigit() and suffix in ("", "a", "f")):
            raise ValueError(f"TORCH_CUDA_ARCH_LIST={arch_list!r}: cannot read {item!r}; expected entries like "
                             "8.0, 9.0, 9.0a or 9.0+PTX separated by ';' or spaces")
        num = f"{major}{minor[0]}{suffix}"
        gencode.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            gencode.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    if not gencode:
        raise ValueError(f"TORCH_CUDA_ARCH_LIST={arch_list!r} names no architecture")
    cu = sorted(os.path.relpath(os.path.join(dp, f), root)
                for dp, _, fs in os.walk(os.path.join(root, "csrc", "cuda")) for f in fs if f.endswith(".cu"))
    # -std=c++17 here keeps torch from adding its own -std (nvcc refuses two); no fast-math:
    # the kernels round exactly like the CPU ones.
    return dict(none, sources=cu + ["csrc/bindings_cuda.cpp"], define_macros=[("ZEROCORE_WITH_CUDA", None)],
                extra_cuda_args=["-O3", "-std=c++17"] + list(dict.fromkeys(gencode)), unavailable=None)


def extension_config(root: str | None = None, torch_has_cuda: bool = False) -> dict:
    """Everything needed to build the extension: the CPU core plus whichever optional parts
    can be built here. Used by setup.py and the JIT loader alike."""
    root = root or repo_root()
    cfg = dict(sources=sources(root), include_dirs=include_dirs(root), define_macros=[],
               extra_compile_args=list(CXX_FLAGS), extra_cuda_args=[],
               extra_link_args=list(LINK_FLAGS) + shared_libstdcxx_args(),
               libraries=[], library_dirs=[], unavailable={}, with_cuda=False)
    for name, part in (("aio", aio_config(root)), ("cuda", cuda_config(root, torch_has_cuda))):
        if part["unavailable"]:
            cfg["unavailable"][name] = part["unavailable"]
            continue
        for backend, why in part.get("backends_unavailable", {}).items():  # "aio.libaio": why
            cfg["unavailable"][f"{name}.{backend}"] = why
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
