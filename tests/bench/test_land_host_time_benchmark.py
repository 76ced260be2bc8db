"""benchmarks/land_host_time.py on the CPU (part 2: the per-line host time of the offload's gradient landing) and
its line timer: every call of the timed function counted, each line's time attributed to that line, the timer
detached afterwards."""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")))
import land_host_time  # noqa: E402


def _slow_middle(x):
    a = x + 1
    time.sleep(0.003)
    return a


def test_line_timer_puts_the_time_on_the_line_that_spent_it():
    timer = land_host_time.LineTimer(_slow_middle)
    with timer:
        for i in range(4):
            _slow_middle(i)
    _slow_middle(0)  # after the block: not counted
    rows = {r["source"]: r["us_per_call"] for r in timer.table()}
    assert timer.calls == 4
    assert rows["time.sleep(0.003)"] >= 2500
    assert rows["a = x + 1"] < 1000 and rows["return a"] < 1000


def test_tiny_run_times_each_line_of_land(tmp_path):
    out = tmp_path / "land.json"
    res = land_host_time.main(["--dim", "32", "--layers", "2", "--heads", "2", "--ctx", "8", "--batch", "2",
                               "--vocab", "64", "--bucket", "2000", "--steps", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    lines = saved["lines"]
    assert lines["calls_per_step"] >= 1 and lines["land_us_per_call"] > 0
    sources = " ".join(r["source"] for r in lines["per_line"])
    assert "LandedNorm(grad)" in sources and "grad_h.copy_" in sources  # the lines of HostSteppedShard.land
    assert "calls" not in res  # part 1 is for a CUDA device
