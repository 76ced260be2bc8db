"""How the native extension is found or built, and what a failure says."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from zerocore.ops import _loader, build_failure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code, env_extra, timeout=600):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def test_prebuilt_extension_is_used():
    _loader.load()
    assert _loader.status()["how"] == "prebuilt"


def _tools_here(monkeypatch, tmp_path):
    """A real C++ compiler as $CXX and a ninja on PATH (a stand-in if none is installed): the
    messages below must not blame a missing tool."""
    gxx = shutil.which("g++") or shutil.which("c++")
    if gxx is None:
        pytest.skip("no g++ here to produce a real compiler error")
    monkeypatch.setenv("CXX", gxx)
    if shutil.which("ninja") is None:
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "ninja").write_text("#!/bin/sh\nexit 0\n")
        (tmp_path / "bin" / "ninja").chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    return gxx


def _real_gxx_failure(gxx, src_dir, source):
    """What torch's JIT build raises when ninja's compile of `source` fails: its message carries
    the compiler's real output (here from compiling a tiny bad file with the real g++)."""
    bad = src_dir / "csrc" / "aio" / "bad.cpp"
    bad.parent.mkdir(parents=True)
    bad.write_text(source)
    r = subprocess.run([gxx, "-std=c++17", "-c", str(bad), "-o", os.devnull], capture_output=True, text=True)
    assert r.returncode != 0 and "error:" in r.stderr
    return RuntimeError(f"Error building extension 'zerocore_C_jit': [1/3] c++ -MMD -MF bad.o.d -c {bad} -o bad.o\n"
                        f"FAILED: bad.o\nc++ -MMD -MF bad.o.d -c {bad} -o bad.o\n{r.stderr}"
                        "ninja: build stopped: subcommand failed.\n"), r.stderr


BAD_SOURCE = "#include <vector>\n\nint f() {\n  std::vector<int> v;\n  return v.size() + undeclared_name;\n}\n"


def test_real_compile_error_names_file_line_first_error_and_compiler(monkeypatch, tmp_path):
    gxx = _tools_here(monkeypatch, tmp_path)
    # The sources lie in tmp_path here, as they lie in the repository for a real JIT build
    # (absolute paths, shown relative to the tree).
    monkeypatch.setattr(build_failure, "ROOT", str(tmp_path))
    exc, stderr = _real_gxx_failure(gxx, tmp_path, BAD_SOURCE)
    msg = str(_loader._explain_build_failure("adam", exc))
    version = subprocess.run([gxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    assert "op 'adam'" in msg
    assert "compiling csrc/aio/bad.cpp failed: csrc/aio/bad.cpp:5:" in msg
    assert "error: " in msg and "undeclared_name" in msg and "was not declared" in msg
    assert str(tmp_path) not in msg.split("(prebuilt")[0] + msg.split("JIT-build:")[1]
    assert f"failed to compile with {version} ({gxx})" in msg
    assert "this is a zerocore bug, please report it" in msg
    assert "install g++" not in msg and "apt-get install" not in msg and "To fix" not in msg
    # setup.py compiles with paths relative to the tree: the same message.
    err = build_failure.first_compile_error(stderr.replace(str(tmp_path) + "/", ""))
    assert (err.file, err.line) == ("csrc/aio/bad.cpp", 5) and "undeclared_name" in err.message


def test_setup_py_failure_quotes_the_compiler_it_captured_from_fd1(monkeypatch, tmp_path, capfd):
    """setup.py's build (torch's BuildExtension) runs ninja with the compiler's output on file
    descriptor 1, not in the exception: build_failure.CaptureFd1 keeps a copy while showing it."""
    gxx = _tools_here(monkeypatch, tmp_path)
    bad = tmp_path / "csrc" / "aio" / "bad.cpp"
    bad.parent.mkdir(parents=True)
    bad.write_text(BAD_SOURCE)
    with build_failure.CaptureFd1() as out:  # the child writes to fd 1, as ninja does
        r = subprocess.run([gxx, "-std=c++17", "-c", "csrc/aio/bad.cpp", "-o", os.devnull], cwd=tmp_path,
                           stderr=subprocess.STDOUT)
    assert r.returncode != 0
    assert "csrc/aio/bad.cpp:5:" in capfd.readouterr().out  # still shown to the user
    what, advice = build_failure.explain(out.text() + "\nError compiling objects for extension")
    assert what.startswith("compiling csrc/aio/bad.cpp failed: csrc/aio/bad.cpp:5:") and "undeclared_name" in what
    assert "this is a zerocore bug" in advice and "install" not in advice


def test_first_error_of_nvcc_and_of_a_missing_system_header():
    nvcc = ('csrc/cuda/norm.cu(4): error: namespace "std" has no member "system_error"\n'
            "1 error detected in the compilation of \"csrc/cuda/norm.cu\".\n")
    err = build_failure.first_compile_error("FAILED: norm.cuda.o\n" + nvcc)
    assert str(err) == 'csrc/cuda/norm.cu:4: error: namespace "std" has no member "system_error"'
    # An error inside torch's headers keeps its own path (it is not a zerocore file).
    torch_h = "/venv/torch/include/torch/csrc/python_headers.h:12:10: fatal error: Python.h: No such file or directory\n"
    err = build_failure.first_compile_error("warning: x\n" + torch_h)
    assert err.file == "/venv/torch/include/torch/csrc/python_headers.h" and err.message.startswith("Python.h")
    assert any("python3-dev" in h for h in build_failure.missing_tools(torch_h))


def test_missing_tools_are_named_and_only_then(monkeypatch, tmp_path):
    _tools_here(monkeypatch, tmp_path)
    assert build_failure.missing_tools("") == []
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    hints = build_failure.missing_tools("")
    assert any("apt-get install g++" in h and "no-such-g++" in h for h in hints)
    assert any("pip install ninja" in h for h in hints)
    msg = str(_loader._explain_build_failure("adam", RuntimeError("Ninja is required to load C++ extensions")))
    assert "To fix: install a C++17 compiler" in msg and "install ninja" in msg


def test_real_jit_failure_is_a_clear_error(tmp_path):
    """A compiler that does not run: the JIT path raises NativeBuildError naming the op and the
    broken compiler, at the call, not an AttributeError later."""
    cxx = tmp_path / "broken-c++"
    cxx.write_text("#!/bin/sh\necho 'broken-c++: error: this compiler is broken on purpose' >&2\nexit 1\n")
    cxx.chmod(0o755)
    r = _python("""
        import torch
        from zerocore import ops
        try:
            ops.adam_step(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3), lr=1e-3, step=1)
        except ops.NativeBuildError as e:
            print("CAUGHT", e)
        """, {"ZEROCORE_FORCE_JIT": "1", "ZEROCORE_JIT_DIR": str(tmp_path / "jit"), "CXX": str(cxx)})
    assert "CAUGHT" in r.stdout, r.stdout + r.stderr
    assert "op 'adam'" in r.stdout and "failed" in r.stdout
    assert f"To fix: repair the C++ compiler {cxx} or point CXX at a working g++" in r.stdout
    assert "zerocore bug" not in r.stdout


@pytest.mark.slow
def test_jit_build_works(tmp_path):
    r = _python("""
        import torch
        from zerocore import ops
        from zerocore.ops import _loader
        p = torch.zeros(5); ops.adam_step(p, torch.ones(5), torch.zeros(5), torch.zeros(5), lr=0.1, step=1)
        print(_loader.status()["how"], p.tolist())
        print(_loader.build_compiler())
        print(_loader.load().compiler_info()["compiler"])
        """, {"ZEROCORE_FORCE_JIT": "1", "ZEROCORE_JIT_DIR": str(tmp_path / "jit")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("jit") and "JIT-building" in r.stderr
    how, built_by, compiled_in = r.stdout.splitlines()
    assert built_by.endswith(")") and compiled_in.split()[1].split("-")[0] in built_by  # the same compiler


def test_isa_environment_variable():
    r = _python("from zerocore import ops; print(ops.active_isa())", {"ZEROCORE_CPU_ISA": "scalar"})
    assert r.stdout.strip() == "scalar", r.stderr
    r = _python("""
        from zerocore import ops
        try:
            ops.active_isa()
        except ValueError as e:
            print("CAUGHT", e)
        """, {"ZEROCORE_CPU_ISA": "sse9"})
    assert "CAUGHT ZEROCORE_CPU_ISA='sse9'" in r.stdout and "unknown CPU ISA" in r.stdout, r.stdout + r.stderr


def test_force_isa_rejects_unknown():
    from zerocore import ops

    with pytest.raises(ValueError, match="unknown CPU ISA 'neon'"):
        ops.set_isa("neon")
    assert ops.active_isa() in ops.supported_isas()
