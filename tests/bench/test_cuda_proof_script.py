"""benchmarks/gpu_proof.py's logic that runs without a GPU: the install decision, naming a test
that kills its pytest process (a real crashing test in a child process), and the report parsing."""
from __future__ import annotations

import importlib.util
import os
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def proof():
    spec = importlib.util.spec_from_file_location("gpu_proof", os.path.join(ROOT, "benchmarks", "gpu_proof.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_install_decision(proof, tmp_path):
    here = os.path.join(str(tmp_path), "zerocore")
    built = {"built": True, "package": here}
    assert proof.install_needed(built, str(tmp_path)) is None
    assert proof.install_needed(built, str(tmp_path), rebuild=True) == "--rebuild"
    # The failure seen on the H100: the JIT build made the checkout "built", but nothing was installed.
    assert "not installed" in proof.install_needed({"built": False, "importable": False, "reason": "No module"},
                                                   str(tmp_path))
    assert "not this checkout" in proof.install_needed({"built": True, "package": "/elsewhere/zerocore"},
                                                       str(tmp_path))
    assert "no CUDA part" in proof.install_needed({"built": False, "package": here, "reason": "CPU torch"},
                                                  str(tmp_path))


def test_probe_runs_outside_the_checkout(proof, monkeypatch):
    seen = {}

    def fake_run(cmd, **kw):
        seen.update(kw)
        return 1, "ModuleNotFoundError: No module named 'zerocore'", 0.0

    monkeypatch.setattr(proof, "run", fake_run)
    info = proof.build_info_subprocess()
    assert not info["built"] and "No module" in info["reason"]
    assert os.path.realpath(seen["cwd"]) != os.path.realpath(ROOT)


def test_crashed_test_named_from_the_h100_output(proof):
    out = textwrap.dedent("""\
        tests/test_cuda.py::test_pack_unpack_equal_cpu[dtype3] PASSED            [ 82%]
        tests/test_cuda.py::test_pack_unpack_equal_cpu[dtype4] PASSED            [ 83%]
        tests/test_cuda.py::test_pack_misaligned_views_and_errors Fatal Python error: Segmentation fault

        Current thread 0x00007fb276a64140 (most recent call first):
          File "zerocore/ops/cuda/kernels.py", line 100 in pack
          File "tests/test_cuda.py", line 202 in test_pack_misaligned_views_and_errors
        """)
    assert proof.crashed_test(out) == "tests/test_cuda.py::test_pack_misaligned_views_and_errors"
    assert proof.crashed_test("tests/a.py::test_x PASSED [100%]\n") is None
    # -q output (no ids printed): faulthandler's traceback names it
    assert proof.crashed_test('Fatal Python error: Segmentation fault\n  File "tests/t.py", line 3 in test_boom\n') \
        == "tests/t.py::test_boom"


def test_a_crashing_test_is_named_and_the_rest_of_its_file_still_runs(proof, tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: test\n")
    (tmp_path / "test_boom.py").write_text(textwrap.dedent("""\
        import faulthandler, pytest

        pytestmark = pytest.mark.gpu

        def test_fine():
            pass

        def test_crash():
            faulthandler._sigsegv()

        def test_wrong():
            assert 1 == 2

        @pytest.mark.skip(reason="not here")
        def test_skipped():
            pass
        """))
    (tmp_path / "test_cpu_only.py").write_text("def test_plain():\n    pass\n")
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    assert proof.gpu_test_files(env, cwd=str(tmp_path), tests_dir=".") == ["test_boom.py"]
    res = proof.run_test_file("test_boom.py", str(tmp_path / "r.xml"), env=env, cwd=str(tmp_path), timeout=120)
    assert res["crashed"] == ["test_boom.py::test_crash"]
    assert res["failed"] == ["test_boom::test_wrong"]
    assert res["tests"] == 3 and res["skipped"] == 1 and res["status"] == 1
