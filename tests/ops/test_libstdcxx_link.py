"""The extension uses the process's shared libstdc++, whatever the compiler would link.

On the H200 image (2026-11-26) CXX=/opt/gcc/bin/g++ has libstdc++ only as a static archive: the
extension carried a private copy whose symbols the loader partly bound to the shared copy torch uses,
and every refused argument whose error message held a number killed the process (SIGSEGV in
std::ostream's number formatting; scripts/native_throw_probe.py). On this machine the same build
mangled the message instead ("pack: got" and nothing after). build_spec.shared_libstdcxx_args links
the shared library by path.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from zerocore.ops import build_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a toolchain like the H200 image's: libstdc++ only static, -lstdc++ ignored, no shared library to print
STATIC_ONLY = """#!/bin/sh
for a in "$@"; do [ "$a" = "-print-file-name=libstdc++.so" ] && { echo libstdc++.so; exit 0; }; done
args=""
for a in "$@"; do [ "$a" = "-lstdc++" ] && continue; args="$args '$a'"; done
eval exec g++ -static-libstdc++ $args
"""


def _static_only_cxx(tmp_path) -> str:
    path = tmp_path / "g++"
    path.write_text(STATIC_ONLY)
    path.chmod(0o755)
    return str(path)


def _needed(so: str) -> list[str]:
    if shutil.which("readelf"):
        out = subprocess.run(["readelf", "-dW", so], capture_output=True, text=True).stdout
        return [ln.split("[")[1].split("]")[0] for ln in out.splitlines() if "(NEEDED)" in ln]
    if shutil.which("ldd"):
        out = subprocess.run(["ldd", so], capture_output=True, text=True).stdout
        return [ln.split()[0] for ln in out.splitlines() if ln.strip()]
    pytest.skip("neither readelf nor ldd is here to read the extension's dependencies")


def test_the_loaded_shared_library_is_found_when_the_compiler_has_none(tmp_path):
    assert torch is not None  # torch is imported: it has loaded the shared libstdc++
    if shutil.which("g++") is None:
        pytest.skip("no g++ here")
    loaded = build_spec.loaded_libstdcxx()
    assert loaded and os.path.basename(loaded).startswith("libstdc++.so")
    assert build_spec._compiler_libstdcxx(_static_only_cxx(tmp_path)) is None
    assert build_spec.shared_libstdcxx_args(_static_only_cxx(tmp_path)) == [f"-Wl,--no-as-needed,{loaded},--as-needed"]
    assert build_spec.shared_libstdcxx_args("no-such-compiler-here") == [f"-Wl,--no-as-needed,{loaded},--as-needed"]


def test_the_built_extension_needs_the_shared_libstdcxx():
    from zerocore.ops import _loader

    mod = _loader.load("test")
    assert any(n.startswith("libstdc++.so") for n in _needed(mod.__file__)), mod.__file__


def test_a_refused_call_keeps_the_numbers_of_its_message():
    from zerocore.ops import _loader

    mod = _loader.load("test")
    with pytest.raises(ValueError, match=r"^pack: got 1 tensors but 2 offsets$"):
        mod.pack([torch.zeros(3)], [0, 1], torch.zeros(8))


@pytest.mark.slow
def test_a_static_only_toolchain_still_links_the_shared_libstdcxx(tmp_path):
    """The H200 case, reproduced: the whole extension built with a compiler that links libstdc++
    statically (a few minutes), then a refused call's message checked in a fresh process."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ here")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.so", "__pycache__"))
    env = dict(os.environ, CXX=_static_only_cxx(tmp_path), MAX_JOBS=str(os.cpu_count() or 2))
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=src, env=env, capture_output=True,
                       text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    so = next(str(p) for p in (src / "zerocore").glob("_C*.so"))
    assert any(n.startswith("libstdc++.so") for n in _needed(so))
    code = ("import torch, zerocore._C as C\ntry:\n    C.pack([torch.zeros(3)], [0, 1], torch.zeros(8))\n"
            "except ValueError as e:\n    print(e)")
    p = subprocess.run([sys.executable, "-c", code], cwd=src, env=dict(os.environ, PYTHONPATH=str(src)),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "pack: got 1 tensors but 2 offsets", (p.returncode, p.stdout,
                                                                                            p.stderr[-2000:])
