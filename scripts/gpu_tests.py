#!/usr/bin/env python
"""The GPU tests, each test file in its own process, naming a test that kills its process.

    python scripts/gpu_tests.py --out gpu_tests.json --timeout 240

Why: under ``pytest -m gpu -n 3`` a test that crashes its worker (a segfault, an abort, a CUDA
fault ending the process) is replaced by xdist, and the crashing test's name can be lost with the
output the crash cut. Here:

1. ``pytest --collect-only -q -m gpu`` over the given paths (default ``tests``) lists the files
   that hold gpu-marked tests;
2. each file runs in its own ``python -X faulthandler -m pytest -m gpu -p no:cacheprovider -v -rs``
   process with the plugin ``scripts/zc_test_progress.py``, which appends every test's start and
   end to a file fsynced before the test runs, and points faulthandler at a file of its own: a test
   started and not finished when the process ended is the one that crashed it, with the signal
   and faulthandler's traceback; a process still running after ``--timeout`` seconds gets SIGUSR1
   (faulthandler dumps where it hangs), then SIGKILL, and its running test is named as timed out;
3. after a crash or a timeout the file is run again without the tests already run and the culprit
   (at most ``--reruns`` times), so the tests after it still run;
4. a JSON report (``--out``; logs of every run beside it) and a printed table: per file passed,
   failed, skipped, crashed and timed-out tests and seconds.

Exit status 1 when a test failed, crashed or timed out, a file could not be run or collection
failed; with ``--require-run`` also when no test ran (all skipped: no GPU, or zerocore without its
CUDA part). On a machine without a GPU every gpu test skips and the report says so, status 0.
Standard library only: the tests run in child processes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PLUGIN = "zc_test_progress"  # scripts/zc_test_progress.py, importable in the child through PYTHONPATH
_NODE = re.compile(r"^(\S+?\.py)::\S")


def _env(extra: dict) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


def collect(paths: list[str], marker: str, cwd: str) -> tuple[list[str], dict]:
    """The files holding tests with ``marker``, in collection order, and what collection said."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marker, "-p", "no:cacheprovider", *paths]
    p = subprocess.run(cmd, cwd=cwd, env=_env({}), capture_output=True, text=True)
    out = p.stdout + p.stderr
    files: list[str] = []
    for line in out.splitlines():
        m = _NODE.match(line.strip())
        if m and m.group(1) not in files:
            files.append(m.group(1))
    errors = [ln.strip() for ln in out.splitlines() if ln.startswith("ERROR ")]
    info = {"command": cmd, "status": p.returncode, "errors": errors}
    if p.returncode not in (0, 5) or errors:  # 5: nothing selected
        info["output_tail"] = out[-3000:]
    return files, info


def _read_events(path: str) -> list[dict]:
    events = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by a kill: the events before it stand
                    break
    return events


def _signal_name(status: int) -> str | None:
    if status >= 0:
        return None
    try:
        return signal.Signals(-status).name
    except ValueError:
        return f"signal {-status}"


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def run_once(path: str, *, marker: str, cwd: str, timeout: float, deselect: list[str], log: str,
             work: str) -> dict:
    """One pytest process over one file: its status, every test's events, the test it ended in."""
    progress, fault, skip = (os.path.join(work, n) for n in ("progress.jsonl", "fault.txt", "deselect.txt"))
    for f in (progress, fault):
        if os.path.exists(f):
            os.remove(f)
    with open(skip, "w") as f:
        f.write("".join(d + "\n" for d in deselect))
    cmd = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-m", marker, "-p", "no:cacheprovider",
           "-p", "no:faulthandler", "-p", PLUGIN, "-v", "-rs", path]
    env = _env({"ZC_PROGRESS_FILE": progress, "ZC_FAULT_FILE": fault, "ZC_DESELECT_FILE": skip})
    t0 = time.time()
    timed_out = False
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        # A session of its own: a timeout ends the test process and whatever it started, nothing else.
        child = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = child.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            _signal_group(child.pid, getattr(signal, "SIGUSR1", signal.SIGTERM))  # faulthandler: where it hangs
            try:
                child.wait(timeout=3)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(child.pid, signal.SIGKILL)
            status = child.wait()
    seconds = time.time() - t0
    events = _read_events(progress)
    started, finished = [], set()
    for e in events:
        if e["event"] == "start":
            started.append(e["nodeid"])
        elif e["event"] == "finish":
            finished.add(e["nodeid"])
    running = next((n for n in reversed(started) if n not in finished), None)
    fault_text = ""
    if os.path.exists(fault):
        with open(fault, errors="replace") as f:
            fault_text = f.read()[-4000:]
    return {"status": status, "timed_out": timed_out, "seconds": seconds, "events": events, "running": running,
            "fault": fault_text, "log": log}


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the child's own session (start_new_session): only what this run started
    except (ProcessLookupError, PermissionError):
        pass


def _outcomes(events: list[dict]) -> dict[str, dict]:
    """node id -> {'outcome': passed | failed | error | skipped | xfailed, 'reason'} from reports."""
    res: dict[str, dict] = {}
    for e in events:
        if e["event"] != "report":
            continue
        cur = res.setdefault(e["nodeid"], {"outcome": "passed"})
        o, when = e["outcome"], e["when"]
        if o == "failed":
            cur.update(outcome="failed" if when == "call" else "error", reason=e.get("reason", ""))
        elif o == "skipped" and cur["outcome"] == "passed":
            cur.update(outcome="xfailed" if e.get("xfail") else "skipped", reason=e.get("reason", ""))
    return res


def run_file(path: str, *, marker: str, cwd: str, timeout: float, reruns: int, logs: str,
             deadline: float | None = None) -> dict:
    """Every gpu test of one file: runs it, and after a crash or timeout runs the rest again."""
    t0 = time.time()
    done: dict[str, dict] = {}
    crashed, timed_out, runs, problems = [], [], [], []
    stem = re.sub(r"\W+", "_", path).strip("_")
    with tempfile.TemporaryDirectory(prefix="zc-gpu-tests-") as work:
        attempt = 0
        while True:
            left = timeout if deadline is None else min(timeout, deadline - time.time())
            if left <= 0:
                problems.append("not (fully) run: the --budget was spent")
                break
            attempt += 1
            log = os.path.join(logs, f"{stem}.run{attempt}.log")
            r = run_once(path, marker=marker, cwd=cwd, timeout=left, deselect=sorted(done), log=log, work=work)
            runs.append({"status": r["status"], "seconds": round(r["seconds"], 2), "log": os.path.relpath(log, logs),
                         "timed_out": r["timed_out"]})
            done.update(_outcomes(r["events"]))
            culprit = r["running"]
            if culprit is None and not r["timed_out"] and r["status"] in (0, 1, 5):
                break  # ran to the end (5: nothing left to run)
            where = {"status": r["status"], "signal": _signal_name(r["status"]), "fault": r["fault"],
                     "log_tail": _tail(log)}
            if culprit is None:  # ended between tests (module teardown, exit) or before the first one
                last = next((e["nodeid"] for e in reversed(r["events"]) if e["event"] == "finish"), None)
                what = "timed out" if r["timed_out"] else f"process ended with status {r['status']}"
                problems.append(f"{what} outside a test ({'after ' + last if last else 'before any test started'})")
                runs[-1].update(where)
                break
            if r["timed_out"]:
                timed_out.append({"nodeid": culprit, "after_s": round(r["seconds"], 1), "fault": r["fault"],
                                  "log_tail": where["log_tail"]})
                done[culprit] = {"outcome": "timed out"}
            else:
                crashed.append({"nodeid": culprit, **where})
                done[culprit] = {"outcome": "crashed"}
            if attempt > reruns:
                problems.append(f"stopped after {reruns} re-run(s): any tests after {culprit} did not run")
                break
    counts = {k: 0 for k in ("passed", "failed", "errors", "skipped", "xfailed")}
    key = {"passed": "passed", "failed": "failed", "error": "errors", "skipped": "skipped", "xfailed": "xfailed"}
    skipped_reasons: dict[str, int] = {}
    for res in done.values():
        if res["outcome"] in key:
            counts[key[res["outcome"]]] += 1
        if res["outcome"] == "skipped":
            skipped_reasons[res.get("reason", "")] = skipped_reasons.get(res.get("reason", ""), 0) + 1
    return {"file": path, **counts, "crashed": crashed, "timed_out": timed_out,
            "failed_tests": sorted(n for n, r in done.items() if r["outcome"] in ("failed", "error")),
            "skipped_reasons": skipped_reasons, "problems": problems, "runs": runs,
            "seconds": round(time.time() - t0, 2)}


def table(files: list[dict]) -> str:
    head = ("file", "passed", "failed", "skipped", "crashed", "timed out", "seconds")
    rows = [head] + [(f["file"], str(f["passed"]), str(f["failed"] + f["errors"]), str(f["skipped"]),
                      str(len(f["crashed"])), str(len(f["timed_out"])), f"{f['seconds']:.1f}") for f in files]
    width = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(width[i]) if i == 0 else c.rjust(width[i]) for i, c in enumerate(r)) for r in rows]
    for f in files:
        lines += [f"CRASHED   {c['nodeid']} ({c['signal'] or 'exit status ' + str(c['status'])})" for c in f["crashed"]]
        lines += [f"TIMED OUT {t['nodeid']} (after {t['after_s']} s)" for t in f["timed_out"]]
        lines += [f"FAILED    {n}" for n in f["failed_tests"]]
        lines += [f"PROBLEM   {f['file']}: {p}" for p in f["problems"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", default=["tests"], help="test files or folders (default: tests)")
    ap.add_argument("--out", default="gpu_tests.json", help="the JSON report (logs go to <out stem>_logs/ beside it)")
    ap.add_argument("--timeout", type=float, default=600,
                    help="seconds one pytest process (one run of a file) may take")
    ap.add_argument("--reruns", type=int, default=3, help="re-runs of a file after a crash or a timeout")
    ap.add_argument("--budget", type=float, default=None, help="seconds for everything: no run starts after it")
    ap.add_argument("--marker", default="gpu", help="the pytest marker expression selecting the tests")
    ap.add_argument("--cwd", default=ROOT, help="where pytest runs (default: the repository)")
    ap.add_argument("--require-run", action="store_true", help="fail when no test ran (all skipped)")
    args = ap.parse_args(argv)
    t0 = time.time()
    deadline = None if args.budget is None else t0 + args.budget
    out = os.path.abspath(args.out)
    logs = os.path.splitext(out)[0] + "_logs"
    os.makedirs(logs, exist_ok=True)
    files, collection = collect(args.paths, args.marker, args.cwd)
    print(f"{len(files)} file(s) with '{args.marker}' tests: {' '.join(files)}", flush=True)
    results = []
    for f in files:
        res = run_file(f, marker=args.marker, cwd=args.cwd, timeout=args.timeout, reruns=args.reruns, logs=logs,
                       deadline=deadline)
        results.append(res)
        print(f"  {f}: {res['passed']} passed, {res['failed'] + res['errors']} failed, {res['skipped']} skipped, "
              f"{len(res['crashed'])} crashed, {len(res['timed_out'])} timed out in {res['seconds']:.0f} s", flush=True)
    totals = {k: sum(r[k] for r in results) for k in ("passed", "failed", "errors", "skipped", "xfailed")}
    totals["crashed"] = sum(len(r["crashed"]) for r in results)
    totals["timed_out"] = sum(len(r["timed_out"]) for r in results)
    ran = totals["passed"] + totals["failed"] + totals["errors"] + totals["crashed"] + totals["timed_out"]
    bad = (totals["failed"] or totals["errors"] or totals["crashed"] or totals["timed_out"] or not files
           or any(r["problems"] for r in results) or collection["status"] not in (0, 5) or collection["errors"])
    ok = not bad and (ran > 0 or not args.require_run)
    report = {"ok": ok, "ran": ran, "totals": totals, "files": results, "collection": collection,
              "command": [sys.executable] + sys.argv, "cwd": args.cwd, "marker": args.marker,
              "timeout_s": args.timeout, "reruns": args.reruns, "budget_s": args.budget,
              "started": datetime.datetime.fromtimestamp(t0).isoformat(timespec="seconds"),
              "seconds": round(time.time() - t0, 2), "logs": logs}
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(table(results))
    if not files:
        print(f"no test file holds '{args.marker}' tests", file=sys.stderr)
    if collection["status"] not in (0, 5) or collection["errors"]:
        print(f"collection failed (status {collection['status']}): {collection['errors']}", file=sys.stderr)
    print(f"{ran} ran, {totals['skipped']} skipped; {'ok' if ok else 'NOT ok'}; report: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
