"""scripts/gpu_tests.py without a GPU: real test files that abort their process, hang, fail and
skip, run through the script's command line in child processes; its JSON must name the test
that killed each process (with the signal and faulthandler's traceback) and the one that hung,
and the tests after them must still run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_tests.py")

BOOM = """\
import os, pytest

pytestmark = pytest.mark.gpu

def test_first():
    pass

def test_abort():
    os.abort()

def test_after_the_abort():
    pass

def test_wrong():
    assert 1 == 2

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass
"""

HANG = """\
import time, pytest

pytestmark = pytest.mark.gpu

def test_before():
    pass

def test_hangs():
    time.sleep(600)

def test_after_the_hang():
    pass
"""

QUIET = """\
import pytest

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="torch sees no CUDA device")
def test_needs_a_gpu():
    pass

def test_cpu_only():
    pass
"""


def _run(tmp_path, *args):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: test\n")
    out = tmp_path / "report" / "gpu.json"
    p = subprocess.run([sys.executable, SCRIPT, "--out", str(out), "--cwd", str(tmp_path), *args],
                       capture_output=True, text=True, timeout=300)
    return p, json.loads(out.read_text())


def test_a_crash_and_a_hang_are_named_and_the_rest_still_runs(tmp_path):
    (tmp_path / "test_boom.py").write_text(BOOM)
    (tmp_path / "test_hang.py").write_text(HANG)
    (tmp_path / "test_plain.py").write_text("def test_cpu():\n    pass\n")  # no gpu test: not run
    p, rep = _run(tmp_path, "--timeout", "8", ".")
    assert p.returncode == 1, p.stdout + p.stderr
    files = {f["file"]: f for f in rep["files"]}
    assert sorted(files) == ["test_boom.py", "test_hang.py"]

    boom = files["test_boom.py"]
    [crash] = boom["crashed"]
    assert crash["nodeid"] == "test_boom.py::test_abort" and crash["signal"] == "SIGABRT"
    assert "Fatal Python error: Aborted" in crash["fault"] and "test_abort" in crash["fault"]
    assert (boom["passed"], boom["failed"], boom["skipped"]) == (2, 1, 1)  # test_after_the_abort ran on the re-run
    assert boom["failed_tests"] == ["test_boom.py::test_wrong"] and len(boom["runs"]) == 2
    assert boom["skipped_reasons"] == {"Skipped: not here": 1}

    hang = files["test_hang.py"]
    [late] = hang["timed_out"]
    assert late["nodeid"] == "test_hang.py::test_hangs" and 7 <= late["after_s"] < 60
    assert "test_hangs" in late["fault"]  # SIGUSR1 before the kill: faulthandler shows where it hung
    assert hang["passed"] == 2 and not hang["crashed"] and not hang["problems"]

    assert rep["totals"]["crashed"] == 1 and rep["totals"]["timed_out"] == 1 and rep["ok"] is False
    for f in rep["files"]:  # every run's output kept beside the report
        assert all(os.path.exists(os.path.join(rep["logs"], r["log"])) for r in f["runs"])
    assert "CRASHED   test_boom.py::test_abort (SIGABRT)" in p.stdout
    assert "TIMED OUT test_hang.py::test_hangs" in p.stdout


def test_no_reruns_leaves_the_rest_unrun_and_says_so(tmp_path):
    (tmp_path / "test_boom.py").write_text(BOOM)
    p, rep = _run(tmp_path, "--reruns", "0", "--timeout", "60", "test_boom.py")
    [boom] = rep["files"]
    assert [c["nodeid"] for c in boom["crashed"]] == ["test_boom.py::test_abort"] and boom["passed"] == 1
    assert boom["problems"] == ["stopped after 0 re-run(s): any tests after test_boom.py::test_abort did not run"]
    assert p.returncode == 1


def test_without_a_gpu_everything_skips_and_that_is_ok_unless_required(tmp_path):
    (tmp_path / "test_quiet.py").write_text(QUIET)
    p, rep = _run(tmp_path, "--timeout", "60", ".")
    assert p.returncode == 0, p.stdout + p.stderr
    [quiet] = rep["files"]
    assert rep["ok"] and rep["ran"] == 0 and quiet["skipped"] == 1 and quiet["passed"] == 0  # test_cpu_only: not gpu
    assert quiet["skipped_reasons"] == {"Skipped: torch sees no CUDA device": 1}
    p, rep = _run(tmp_path, "--timeout", "60", "--require-run", ".")
    assert p.returncode == 1 and not rep["ok"]


def test_a_crash_in_teardown_names_the_test_and_one_at_exit_names_none(tmp_path):
    (tmp_path / "test_teardown.py").write_text(textwrap.dedent("""\
        import os, pytest

        pytestmark = pytest.mark.gpu

        @pytest.fixture(scope="module", autouse=True)
        def dies_in_teardown():
            yield
            os.abort()

        def test_fine():
            pass
        """))
    (tmp_path / "test_exit.py").write_text(textwrap.dedent("""\
        import atexit, os, pytest

        pytestmark = pytest.mark.gpu
        atexit.register(os.abort)  # like a CUDA context torn down badly at exit

        def test_fine():
            pass
        """))
    p, rep = _run(tmp_path, "--timeout", "60", ".")
    assert p.returncode == 1
    files = {f["file"]: f for f in rep["files"]}
    teardown = files["test_teardown.py"]  # a module fixture's teardown runs in its last test's teardown
    assert [(c["nodeid"], c["signal"]) for c in teardown["crashed"]] == [("test_teardown.py::test_fine", "SIGABRT")]
    assert teardown["passed"] == 0 and len(teardown["runs"]) == 2  # the re-run had nothing left to run
    at_exit = files["test_exit.py"]
    assert at_exit["passed"] == 1 and not at_exit["crashed"]
    assert at_exit["problems"] == ["process ended with status -6 outside a test (after test_exit.py::test_fine)"]
    assert at_exit["runs"][-1]["signal"] == "SIGABRT"
