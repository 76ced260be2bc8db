"""scripts/check_std_includes.py: the CI check that csrc/ includes every standard header it uses.

The whole-tree check runs in scripts/zc.sh (about a minute); here it is proved on the bug that
motivated it: csrc/aio/threadpool_context.cpp used std::system_error without <system_error>,
compiled with libstdc++ 12 (Debian 12) and failed with a newer g++. The check must fail on that
file without the include and pass on it with the include. Needs a compiler with libstdc++ >= 13:
the machine's, or Debian 13's g++ 14 that the check fetches once into ~/.cache/zerocore (skipped,
saying why, where neither can be had).
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import sys

import pytest

from zerocore.ops import build_spec

ROOT = build_spec.repo_root()
SCRIPTS = os.path.join(ROOT, "scripts")
TARGET = "csrc/aio/threadpool_context.cpp"


def _load(name: str):
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)  # check_std_includes imports newer_libstdcxx by name
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


check = _load("check_std_includes")
newer = check.newer_libstdcxx


@pytest.fixture(scope="module")
def compiler():
    try:
        return newer.find(log=lambda m: None)
    except newer.Unavailable as exc:
        pytest.skip(f"no compiler with libstdc++ >= {newer.MIN_GLIBCXX_RELEASE} can be had here: {exc}")


def test_fails_without_system_error_and_passes_with_it(compiler, tmp_path):
    assert compiler.glibcxx >= newer.MIN_GLIBCXX_RELEASE
    source = open(os.path.join(ROOT, TARGET)).read()
    assert "#include <system_error>\n" in source and "std::system_error" in source
    broken = tmp_path / "threadpool_context.cpp"
    broken.write_text(source.replace("#include <system_error>\n", ""))
    planner = check.Planner()

    failures = check.run(planner.units_for(TARGET, str(broken)), compiler, jobs=1, log=lambda m: None)
    assert len(failures) == 1
    out = failures[0][1]
    # The compiler's first error is on the line that names std::system_error, in the copy.
    first = next(ln for ln in out.splitlines() if re.search(r":\d+:\d+: error:", ln))
    line_no = int(re.search(r"threadpool_context\.cpp:(\d+):\d+: error:", first).group(1))
    assert first.startswith(str(broken))
    assert "std::system_error" in broken.read_text().splitlines()[line_no - 1]

    assert check.run(planner.units_for(TARGET), compiler, jobs=1, log=lambda m: None) == []


def test_every_source_is_checked_or_named():
    """A new .cpp or .cu in csrc/ cannot escape the check: it is compiled, or the output names
    it with the reason (no nvcc, no torch, a backend's header missing)."""
    planner = check.Planner()
    units, through = check.tree_units(planner)
    compiled = {u.rel for u in units}
    named = {why.split(":")[0] for why in planner.skipped}
    for ext in ("cpp", "cu"):
        for p in glob.glob(os.path.join(ROOT, "csrc", "**", f"*.{ext}"), recursive=True):
            rel = os.path.relpath(p, ROOT)
            assert rel in compiled or rel in named, rel
    assert "csrc/bindings.cpp" in compiled or "csrc/bindings.cpp" in named
    assert all(f.endswith((".inc", ".cuh", ".h")) for f in through)
    # The thread-pool-only aio build is checked besides the one with every backend found here.
    io_ctx = [u.note for u in units if u.rel == "csrc/aio/io_context.cpp"]
    assert io_ctx and (len(io_ctx) == 2 or not planner.backends)


def test_no_compiler_warns_loudly_or_fails_when_required(monkeypatch, capsys):
    monkeypatch.setenv("ZC_STDINC_CXX", "/nonexistent/g++")
    assert check.main(["--file", os.path.join(ROOT, TARGET)]) == 0
    err = capsys.readouterr().err
    assert "WARNING: csrc/ was NOT checked" in err and "/nonexistent/g++" in err
    assert check.main(["--require", "--file", os.path.join(ROOT, TARGET)]) == 2
