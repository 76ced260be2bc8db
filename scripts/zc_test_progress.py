"""pytest plugin of scripts/gpu_tests.py (loaded there with ``-p zc_test_progress``): the test
that kills its process is named from a file written through to disk, not from output a crash cuts.

- ``$ZC_PROGRESS_FILE``: one JSON line per event, appended with ``os.write`` and ``os.fsync``
  before pytest goes on: ``start`` (before the test's setup), ``report`` (each phase that did not
  simply pass, and the call phase), ``finish``. A test with a ``start`` and no ``finish`` is the
  one that was running when the process died or was killed.
- ``$ZC_FAULT_FILE``: faulthandler writes there (every thread) on a fatal signal and on SIGUSR1,
  which gpu_tests.py sends a test that runs past its time before killing it: where it hung.
- ``$ZC_DESELECT_FILE``: node ids, one a line, deselected (a re-run skips the tests that already
  ran and the one that crashed).

Imports nothing beyond the standard library: it runs inside the test process.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal

_fd: int | None = None
_fault = None  # kept open for faulthandler, which writes to its file descriptor


def _write(record: dict) -> None:
    if _fd is None:
        return
    os.write(_fd, (json.dumps(record) + "\n").encode())
    os.fsync(_fd)  # on disk before the test runs: a crash cannot lose it


def pytest_configure(config) -> None:
    global _fd, _fault
    path = os.environ.get("ZC_PROGRESS_FILE")
    if path:
        _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    fault = os.environ.get("ZC_FAULT_FILE")
    if fault:
        _fault = open(fault, "w")  # noqa: SIM115 - open for the process's lifetime
        faulthandler.enable(file=_fault, all_threads=True)
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, file=_fault, all_threads=True)


def pytest_collection_modifyitems(config, items) -> None:
    path = os.environ.get("ZC_DESELECT_FILE")
    if not path or not os.path.exists(path):
        return
    with open(path) as f:
        drop = {line.strip() for line in f if line.strip()}
    keep = [it for it in items if it.nodeid not in drop]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[it for it in items if it.nodeid in drop])
        items[:] = keep


def pytest_runtest_logstart(nodeid, location) -> None:
    _write({"event": "start", "nodeid": nodeid})


def _reason(report) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:  # a skip: (file, line, reason)
        return str(lr[2])
    text = str(lr) if lr is not None else ""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def pytest_runtest_logreport(report) -> None:
    if report.when != "call" and report.outcome == "passed":
        return
    rec = {"event": "report", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}
    if hasattr(report, "wasxfail"):
        rec["xfail"] = True
    if report.outcome != "passed":
        rec["reason"] = _reason(report)
    _write(rec)


def pytest_runtest_logfinish(nodeid, location) -> None:
    _write({"event": "finish", "nodeid": nodeid})
