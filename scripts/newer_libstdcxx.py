"""A C++ compiler whose libstdc++ is 13 or newer, for scripts/check_std_includes.py.

Why: libstdc++ 12 (Debian 12, this project's machines) includes <system_error>, <stdexcept>, ...
from many other headers, so a source that forgets one still compiles here and then fails on a
machine with a newer libstdc++ (csrc/aio/threadpool_context.cpp did, on a GPU machine). Newer
libstdc++ releases include less, so compiling with one finds the missing includes.

Where it comes from, in order:
1. ZC_STDINC_CXX: a compiler command given by the user (split like a shell line), used as is.
2. The machine's own compiler ($CXX, c++, g++, g++-15, g++-14, g++-13) when its libstdc++ is
   13 or newer (Debian 13, Ubuntu 24.04): nothing is downloaded.
3. Otherwise Debian 13's g++ 14, fetched with apt-get into ~/.cache/zerocore/ (no root needed):
   a private sources list for trixie and private apt state (Dir::State::Lists, Dir::Cache), so
   the machine's apt setup is not touched; `apt-get download` of the compiler, libstdc++-14-dev,
   its internal headers and the libraries it runs with; `dpkg -x` into the cache. Trixie's
   compiler needs glibc 2.38 and Debian 12 has 2.36, so it runs under trixie's own dynamic
   loader (`ld-linux-x86-64.so.2 --library-path ...`), and `-wrapper` makes the driver start
   cc1plus the same way. Its C library headers stay the machine's (/usr/include): only
   libstdc++ and the compiler are new, which is what decides which std names are declared.
   A later run finds the unpacked compiler in the cache and needs no network.

g++ 12 with libstdc++ 14's headers (-nostdinc++ -isystem) does not work: g++ 12 cannot parse
them (_Float32 in <limits>, member template partial specialisations in <bits/alloc_traits.h>).
clang with libc++ was tried and does not catch the missing <system_error>. Both were rejected.
"""
from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

# Debian 13: the release whose default compiler is g++ 14. Its packages are signed with keys
# that Debian 12's debian-archive-keyring (2023.3+deb12u2) already carries.
DEBIAN_SUITE = "trixie"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
GCC_MAJOR = 14
MIN_GLIBCXX_RELEASE = 13  # libstdc++ 13 and 14 both catch the <system_error> case (tried)


class Unavailable(RuntimeError):
    """No compiler with a new enough libstdc++ can be had here; the message says why."""


@dataclass
class Compiler:
    argv: list[str]      # the command, before any file or flag
    version: str         # first line of --version
    glibcxx: int         # _GLIBCXX_RELEASE it compiles with
    how: str             # "ZC_STDINC_CXX", "host" or "downloaded Debian 13 g++ 14"
    ccbin: str | None    # an executable nvcc can use as -ccbin (a wrapper script where needed)


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "zerocore", f"debian-{DEBIAN_SUITE}-gxx{GCC_MAJOR}")


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, **kw)


def probe(argv: list[str]) -> tuple[str, int]:
    """(first line of --version, _GLIBCXX_RELEASE) of a compiler command; raises Unavailable."""
    try:
        ver = _run(argv + ["--version"], timeout=60)
        macros = _run(argv + ["-std=c++17", "-x", "c++", "-dM", "-E", "-"], input="#include <cstddef>\n", timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"{shlex.join(argv)} does not run: {exc}") from None
    if ver.returncode != 0 or macros.returncode != 0:
        err = (ver.stderr or macros.stderr).strip().splitlines()
        raise Unavailable(f"{shlex.join(argv)} does not run: {err[0] if err else 'exit status ' + str(ver.returncode)}")
    m = re.search(r"#define _GLIBCXX_RELEASE (\d+)", macros.stdout)
    if not m:
        raise Unavailable(f"{shlex.join(argv)} does not use libstdc++ (no _GLIBCXX_RELEASE)")
    return ver.stdout.splitlines()[0].strip(), int(m.group(1))


def _host_candidates() -> list[list[str]]:
    names = [os.environ.get("CXX", ""), "c++", "g++", "g++-15", "g++-14", "g++-13"]
    seen, out = set(), []
    for n in names:
        argv = shlex.split(n)
        if argv and shutil.which(argv[0]) and tuple(argv) not in seen:
            seen.add(tuple(argv))
            out.append([shutil.which(argv[0])] + argv[1:])
    return out


def _apt_options(work: str) -> list[str]:
    """apt-get options that use only private state under `work`: the machine's sources,
    lists, pins and dpkg status are neither read nor changed."""
    os.makedirs(os.path.join(work, "lists", "partial"), exist_ok=True)
    os.makedirs(os.path.join(work, "cache", "archives", "partial"), exist_ok=True)
    os.makedirs(os.path.join(work, "sources.list.d"), exist_ok=True)
    os.makedirs(os.path.join(work, "preferences.d"), exist_ok=True)
    with open(os.path.join(work, "sources.list"), "w") as f:
        f.write(f"deb [signed-by={DEBIAN_KEYRING}] {DEBIAN_MIRROR} {DEBIAN_SUITE} main\n")
    open(os.path.join(work, "status"), "w").close()
    arch = _run(["dpkg", "--print-architecture"]).stdout.strip()
    opts = {
        "Dir::Etc::SourceList": os.path.join(work, "sources.list"),
        "Dir::Etc::SourceParts": os.path.join(work, "sources.list.d"),
        "Dir::Etc::Preferences": "/dev/null",
        "Dir::Etc::PreferencesParts": os.path.join(work, "preferences.d"),
        "Dir::State::Lists": os.path.join(work, "lists"),
        "Dir::State::status": os.path.join(work, "status"),
        "Dir::Cache": os.path.join(work, "cache"),
        "Debug::NoLocking": "1",          # private state: no lock on the machine's apt needed
        "Acquire::Languages": "none",
        "APT::Architectures": arch,
    }
    if os.geteuid() == 0:
        # As root apt drops to the user _apt for downloads, which cannot write to root's cache.
        opts["APT::Sandbox::User"] = "root"
    return [a for k, v in opts.items() for a in ("-o", f"{k}={v}")]


def _packages(triplet: str) -> list[str]:
    # The compiler driver and cc1plus; libstdc++'s headers; gcc's own headers (stddef.h,
    # immintrin.h, omp.h); trixie's C library (its loader runs the compiler) and the libraries
    # cc1plus links. A later trixie update that adds a library shows up as a failed --version
    # check below, naming the missing library.
    return [f"g++-{GCC_MAJOR}-{triplet.replace('_', '-')}", f"libstdc++-{GCC_MAJOR}-dev", f"libgcc-{GCC_MAJOR}-dev",
            "libc6", "libisl23", "libmpc3", "libmpfr6", "libgmp10", "libzstd1", "zlib1g"]


def _loader_argv(root: str, triplet: str) -> tuple[list[str], list[str]]:
    """(the command that runs the unpacked g++, the same loader prefix for -wrapper)."""
    loaders = sorted(glob.glob(os.path.join(root, "usr", "lib*", "ld-linux*.so*")) +
                     glob.glob(os.path.join(root, "usr", "lib", triplet, "ld-linux*.so*")))
    if not loaders:
        raise Unavailable(f"no dynamic loader (ld-linux*.so) in the unpacked libc6 under {root}")
    libdir = os.path.join(root, "usr", "lib", triplet)
    gxx = os.path.join(root, "usr", "bin", f"{triplet}-g++-{GCC_MAJOR}")
    if not os.path.exists(gxx):
        raise Unavailable(f"{gxx} is missing from the unpacked packages")
    prefix = [loaders[0], "--library-path", libdir]
    # -fno-use-linker-plugin: the driver otherwise insists on liblto_plugin.so (a package we
    # do not fetch) even for -fsyntax-only. -B <the machine's binutils>: the driver then names
    # `as` and `ld` by their path, which the loader under -wrapper needs (it does not search
    # PATH), so this g++ also compiles to objects (CXX=.../ccbin/g++ python setup.py build_ext
    # reproduces a newer compiler's build failure on Debian 12).
    binutils = os.path.dirname(shutil.which("as") or "/usr/bin/as") + os.sep
    return prefix + [gxx, "-wrapper", ",".join(prefix), "-fno-use-linker-plugin", "-B", binutils], prefix


def _write_ccbin(root: str, argv: list[str]) -> str:
    """A g++ script for nvcc's -ccbin (nvcc runs its host compiler as one executable)."""
    path = os.path.join(root, "ccbin", "g++")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("#!/bin/sh\n# Debian 13's g++ under its own loader (scripts/newer_libstdcxx.py)\n")
        f.write(f'exec {shlex.join(argv)} "$@"\n')
    os.chmod(path, 0o755)
    return path


def download(log=print) -> Compiler:
    """Debian 13's g++ from the cache, fetched first if need be. Raises Unavailable."""
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise Unavailable(f"{tool} not found: fetching Debian 13's g++ {GCC_MAJOR} needs Debian's apt and dpkg "
                              f"(or set ZC_STDINC_CXX to a g++ >= {MIN_GLIBCXX_RELEASE})")
    if not os.path.exists(DEBIAN_KEYRING):
        raise Unavailable(f"{DEBIAN_KEYRING} is missing (apt-get install debian-archive-keyring)")
    triplet = _run(["gcc", "-dumpmachine"]).stdout.strip() if shutil.which("gcc") else ""
    if not triplet:
        raise Unavailable("cannot tell this machine's target triplet (gcc -dumpmachine)")
    base = cache_dir()
    root = os.path.join(base, "root")
    if not os.path.exists(os.path.join(root, "READY")):
        log(f"fetching Debian 13 ({DEBIAN_SUITE}) g++ {GCC_MAJOR} and libstdc++ {GCC_MAJOR} headers into {base} "
            "(about 20 MB, once)")
        os.makedirs(base, exist_ok=True)
        work = tempfile.mkdtemp(prefix="fetch-", dir=base)
        try:
            opts = _apt_options(work)
            for step in (["update"], ["download"] + _packages(triplet)):
                r = _run(["apt-get", "-q"] + opts + step, cwd=work, timeout=300)
                if r.returncode != 0:
                    lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.startswith(("E:", "W:", "Err"))]
                    raise Unavailable(f"apt-get {step[0]} from {DEBIAN_MIRROR} {DEBIAN_SUITE} failed: "
                                      + ("; ".join(lines[:3]) or f"exit status {r.returncode}"))
            staged = os.path.join(work, "root")
            for deb in sorted(glob.glob(os.path.join(work, "*.deb"))):
                r = _run(["dpkg", "-x", deb, staged])
                if r.returncode != 0:
                    raise Unavailable(f"dpkg -x {os.path.basename(deb)} failed: {r.stderr.strip()}")
            with open(os.path.join(staged, "READY"), "w") as f:
                f.write("\n".join(sorted(os.path.basename(d) for d in glob.glob(os.path.join(work, "*.deb")))) + "\n")
            shutil.rmtree(root, ignore_errors=True)
            os.replace(staged, root)  # whole or not at all: an interrupted fetch leaves no half tree
        except subprocess.TimeoutExpired as exc:
            raise Unavailable(f"apt-get timed out after {exc.timeout} s fetching from {DEBIAN_MIRROR}") from None
        finally:
            shutil.rmtree(work, ignore_errors=True)
    argv, _ = _loader_argv(root, triplet)
    version, glibcxx = probe(argv)
    return Compiler(argv, version, glibcxx, f"downloaded Debian 13 g++ {GCC_MAJOR} (cached in {base})",
                    _write_ccbin(root, argv))


def find(allow_download: bool = True, log=print) -> Compiler:
    """The compiler to check with (see the module docstring); raises Unavailable saying why
    none can be had."""
    given = os.environ.get("ZC_STDINC_CXX", "").strip()
    if given:
        argv = shlex.split(given)
        version, glibcxx = probe(argv)
        if glibcxx < MIN_GLIBCXX_RELEASE:
            raise Unavailable(f"ZC_STDINC_CXX={given!r} uses libstdc++ {glibcxx}; the check needs "
                              f">= {MIN_GLIBCXX_RELEASE}")
        return Compiler(argv, version, glibcxx, "ZC_STDINC_CXX", shutil.which(argv[0]) if len(argv) == 1 else None)
    host_notes = []
    for argv in _host_candidates():
        try:
            version, glibcxx = probe(argv)
        except Unavailable as exc:
            host_notes.append(str(exc))
            continue
        if glibcxx >= MIN_GLIBCXX_RELEASE:
            return Compiler(argv, version, glibcxx, "host", argv[0] if len(argv) == 1 else None)
        host_notes.append(f"{argv[0]} uses libstdc++ {glibcxx}")
    if not allow_download:
        raise Unavailable("no compiler here uses libstdc++ >= "
                          f"{MIN_GLIBCXX_RELEASE} ({'; '.join(host_notes) or 'none found'}) and downloading is off")
    return download(log=log)


if __name__ == "__main__":  # prints what would be used: python scripts/newer_libstdcxx.py
    c = find()
    print(f"{c.version} (libstdc++ {c.glibcxx}, {c.how})\n  {shlex.join(c.argv)}")
