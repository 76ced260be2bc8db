"""What a failed native build tells the user: the compiler's first error (its file relative to
the source tree), the compiler that produced it, and a tool hint only when a tool is really
missing. A source that does not compile with a compiler zerocore supports is zerocore's bug
(e.g. a standard #include that an older libstdc++ happened to supply), not the user's setup.

Shared by the JIT loader (zerocore.ops._loader) and setup.py; imports nothing from zerocore or
torch, so setup.py can load it by path as it does build_spec.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass

# gcc / clang: "path:line:col: error: msg" (col optional, "fatal error" too);
# nvcc's front end: "path(line): error: msg".
_GCC_ERROR = re.compile(r"^(?P<file>[^\s:][^:\n]*):(?P<line>\d+):(?:(?P<col>\d+):)? (?:fatal )?error: (?P<msg>.+)$",
                        re.M)
_NVCC_ERROR = re.compile(r"^(?P<file>[^\s(][^(\n]*)\((?P<line>\d+)\): (?:catastrophic )?error: (?P<msg>.+)$", re.M)
# A tool's own complaint: "c++: error: ...", "/usr/bin/ld: cannot find -laio", "ld: ...: undefined
# reference to ...", "collect2: error: ld returned 1 exit status".
_TOOL_ERROR = re.compile(r"^(?P<tool>[^\s:]+): (?:(?:fatal )?error\b.*|cannot find\b.*|.*undefined reference.*)$", re.M)
# The tree the sources lie in (this file is zerocore/ops/build_failure.py).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class CompileError:
    file: str   # relative to the source tree where it lies in one ("csrc/aio/x.cpp")
    line: int
    col: int | None
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:" + (f"{self.col}:" if self.col else "") + f" error: {self.message}"


def source_path(path: str) -> str:
    """A compiler's file name as the user knows it: relative to the source tree for zerocore's
    own files ("csrc/aio/file.cpp"), unchanged for anything else (torch's or the system's)."""
    if not os.path.isabs(path):
        return path  # setup.py compiles from the tree's root with relative paths
    rel = os.path.relpath(os.path.normpath(path), ROOT)
    return path if rel.startswith("..") else rel


def first_compile_error(text: str) -> CompileError | None:
    """The earliest 'file:line[:col]: error: ...' (gcc, clang) or 'file(line): error: ...' (nvcc)."""
    found = [m for m in (_GCC_ERROR.search(text), _NVCC_ERROR.search(text)) if m]
    if not found:
        return None
    m = min(found, key=lambda m: m.start())
    col = m.groupdict().get("col")
    return CompileError(source_path(m.group("file")), int(m.group("line")), int(col) if col else None,
                        m.group("msg").strip())


def first_tool_error(text: str) -> str | None:
    m = _TOOL_ERROR.search(text)
    return m.group(0).strip() if m else None


def cxx_command() -> str:
    """The C++ compiler torch.utils.cpp_extension runs on Linux: $CXX, else c++."""
    return os.environ.get("CXX", "").strip() or "c++"


def _version_line(path: str, extra: list[str]) -> str | None:
    try:
        r = subprocess.run([path] + extra + ["--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None


def compiler_version(command: str | None = None) -> str:
    """'<first line of --version> (<path>)' of the compiler, or what is known of it."""
    argv = shlex.split(command or cxx_command())
    path = shutil.which(argv[0]) if argv else None
    if path is None:
        return f"{argv[0] if argv else command!r} (not found)"
    first = _version_line(path, argv[1:])
    return f"{first} ({path})" if first else f"{path} (its --version failed)"


def missing_tools(text: str = "") -> list[str]:
    """Install hints for the tools a build needs and that are not here or do not run (empty:
    all present)."""
    hints = []
    argv = shlex.split(cxx_command())
    path = shutil.which(argv[0]) if argv else None
    if path is None:
        which = f"CXX={cxx_command()!r} is" if os.environ.get("CXX", "").strip() else "c++ is"
        hints.append(f"install a C++17 compiler with OpenMP ({which} not found; Debian: `apt-get install g++`)")
    elif _version_line(path, argv[1:]) is None:
        hints.append(f"repair the C++ compiler {path} or point CXX at a working g++ (`{path} --version` fails)")
    if shutil.which("ninja") is None or "Ninja is required" in text:
        hints.append("install ninja (`pip install ninja`)")
    if re.search(r"Python\.h: No such file", text):
        hints.append("install the Python development headers (Debian: `apt-get install python3-dev`)")
    return hints


def explain(text: str) -> tuple[str, str]:
    """(what failed, what to do) for the output of a failed build."""
    err = first_compile_error(text)
    ours = err is not None and not os.path.isabs(err.file)  # in zerocore's sources, not torch's/the system's
    failed = re.findall(r"FAILED: (\S+)", text)
    if ours:
        what = f"compiling {err.file} failed: {err}"
    elif err is not None:
        what = ("compiling " + failed[0] + " failed: " if failed else "") + str(err)
    else:
        step = "compiling " + failed[0] if failed else ("linking" if "collect2" in text or "ld:" in text else "building")
        last = text.strip().splitlines()[-1] if text.strip() else "no output"
        what = f"{step} failed: {(first_tool_error(text) or last).rstrip('.')}"
    hints = missing_tools(text)
    if hints:
        return what, "To fix: " + "; ".join(hints) + "; then retry, or reinstall with `pip install --no-build-isolation .`."
    if ours:
        return what, (f"A source file failed to compile with {compiler_version()}; this is a zerocore bug, "
                      "please report it with this message.")
    return what, (f"The build failed with {compiler_version()} although the compiler and ninja are here; "
                  "this is probably a zerocore bug, please report it with this message.")


class CaptureFd1:
    """Copies what is written to file descriptor 1 into memory while still showing it. setup.py's
    build runs ninja with its output (and the compiler's) on fd 1 directly, not through
    sys.stdout nor into the exception, so this is how a failure can quote the compiler."""

    def __enter__(self):
        sys.stdout.flush()
        self._shown = os.dup(1)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 1)
        os.close(write_end)
        self._chunks = []

        def pump():
            while True:
                data = os.read(read_end, 1 << 16)
                if not data:
                    break
                self._chunks.append(data)
                view = memoryview(data)
                while view:
                    view = view[os.write(self._shown, view):]
            os.close(read_end)

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        os.dup2(self._shown, 1)  # drops the pipe's last write end: the pump sees its end
        self._pump.join()
        os.close(self._shown)

    def text(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")
