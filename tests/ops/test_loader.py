"""How the native extension is found or built, and what a failure says."""
import os
import subprocess
import sys
import textwrap

import pytest

from zerocore.ops import NativeBuildError, _loader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code, env_extra, timeout=600):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def test_prebuilt_extension_is_used():
    _loader.load()
    assert _loader.status()["how"] == "prebuilt"


def test_build_failure_message_names_op_step_and_fix():
    fake = RuntimeError("Error building extension 'zerocore_C_jit': [1/2] c++ ...\n"
                        "FAILED: adam.o\n/src/csrc/adam/adam.cpp:12:3: error: 'foo' was not declared\n")
    err = _loader._explain_build_failure("adam", fake)
    msg = str(err)
    assert isinstance(err, NativeBuildError)
    assert "'adam'" in msg and "compiling adam.o failed" in msg and "'foo' was not declared" in msg
    assert "To fix:" in msg


def test_real_jit_failure_is_a_clear_error(tmp_path):
    """A compiler that fails: the JIT path raises NativeBuildError naming the op and the failed
    step, at the call, not an AttributeError later."""
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
    assert "op 'adam'" in r.stdout and "failed" in r.stdout and "To fix" in r.stdout


@pytest.mark.slow
def test_jit_build_works(tmp_path):
    r = _python("""
        import torch
        from zerocore import ops
        from zerocore.ops import _loader
        p = torch.zeros(5); ops.adam_step(p, torch.ones(5), torch.zeros(5), torch.zeros(5), lr=0.1, step=1)
        print(_loader.status()["how"], p.tolist())
        """, {"ZEROCORE_FORCE_JIT": "1", "ZEROCORE_JIT_DIR": str(tmp_path / "jit")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("jit") and "JIT-building" in r.stderr


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
