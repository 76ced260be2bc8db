"""`zerocore demo` runs and says what its numbers are: the headline loss names its windows (and
matches the curve it prints), each rank's memory is one entry, and the model's next-character
guesses on a line of the corpus are shown before and after training with how many are right."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from zerocore.demo import PASSAGE


def run_demo(*args: str, timeout: int = 300) -> str:
    r = subprocess.run([sys.executable, "-m", "zerocore", "demo", *args], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def parse(out: str, ctx: int) -> dict:
    lines = out.splitlines()
    head = next(ln for ln in lines if ln.startswith("loss (cross-entropy per character"))
    m = re.search(r"step 1 ([\d.]+); mean of steps 1-(\d+) ([\d.]+) -> mean of steps (\d+)-(\d+) ([\d.]+)", head)
    assert m, head
    curve = [float(v) for v in next(ln for ln in lines if ln.startswith("loss curve")).split(":", 1)[1].split()]
    text = next(ln for ln in lines if ln.startswith("  text:"))
    before = next(ln for ln in lines if ln.startswith("  before training:"))
    after = next(ln for ln in lines if ln.startswith("  after training:"))
    right = [int(re.search(r"\((\d+)/(\d+) right\)$", ln).group(1)) for ln in (before, after)]
    assert text.split(":", 1)[1].strip() == PASSAGE[1:ctx + 1]
    assert all(ln.endswith(f"/{min(ctx, len(PASSAGE) - 1)} right)") for ln in (before, after))
    return {"step1": float(m[1]), "n": int(m[2]), "first": float(m[3]), "last_from": int(m[4]),
            "last_to": int(m[5]), "last": float(m[6]), "curve": curve, "right": right, "lines": lines}


def test_short_demo_output_says_what_each_number_is():
    out = run_demo("--steps", "10", "--dim", "32", "--ctx", "32", "--stage", "3")
    p = parse(out, 32)
    # 10 steps: the curve shows every step; the windows are steps 1-5 and 6-10, and do not overlap
    assert len(p["curve"]) == 10 and p["n"] == 5 and (p["last_from"], p["last_to"]) == (6, 10)
    assert p["step1"] == p["curve"][0]
    assert abs(p["first"] - sum(p["curve"][:5]) / 5) < 2e-3 and abs(p["last"] - sum(p["curve"][5:]) / 5) < 2e-3
    # one memory entry per rank, in one line
    mem = [ln for ln in p["lines"] if re.search(r"rank \d [\d.]+ MB = [\d.]+x", ln)]
    assert len(mem) == 1 and mem[0].count("rank 0 ") == 1 and mem[0].count("rank 1 ") == 1
    assert sum(ln.count("x stage 0") for ln in p["lines"]) == 0  # the stage-0 reference is said once, above


@pytest.mark.slow  # the default run: 300 steps, ~30 s on a quiet 2-core machine
def test_default_demo_learns_the_text():
    p = parse(run_demo(), 64)
    assert p["last"] < p["first"] < p["step1"] + 0.5
    before, after = p["right"]
    # untrained: about one guess in the 65 characters is right; trained: word endings, spaces,
    # short words (25 of 64 in a run here)
    assert before <= 4 and after >= 16
