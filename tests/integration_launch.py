"""Runs a script of tests/integrations/ under torchrun on CPU ranks and reads the JSON it writes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "integrations")
ROOT = os.path.dirname(os.path.dirname(HERE))


def torchrun(script: str, args: list[str], out: str, nproc: int = 2, timeout: float = 900) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(HERE, script), *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=os.path.dirname(out))
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    with open(out) as f:
        return json.load(f)


def run_in(script: str, tmp, name: str, *opts: str, nproc: int = 2, timeout: float = 900) -> dict:
    """``script`` under torchrun in a new folder ``name`` of ``tmp``, its ``out.json`` the first argument (the
    scripts' convention), ``opts`` after it; the JSON it wrote."""
    d = tmp / name
    d.mkdir()
    out = str(d / "out.json")
    return torchrun(script, [out, *opts], out, nproc=nproc, timeout=timeout)


def same_run(ref: dict, got: dict, tol: float = 1e-5) -> None:
    """Two runs' records (the Trainer scripts'): the same logged steps, every learning rate equal, the losses,
    gradient norms and weights within ``tol`` of the reference's scale (``max_rel_diff``)."""
    assert ref["steps"] == got["steps"]
    assert max_diff(ref["lrs"], got["lrs"]) == 0.0
    for key in ("losses", "grad_norms", "weights"):
        assert max_rel_diff(ref[key], got[key]) < tol, key


def max_diff(a, b) -> float:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        return max(max_diff(a[k], b[k]) for k in a)
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def max_rel_diff(a, b) -> float:
    """``max_diff`` relative to the reference's scale: of each list (a curve, a weight tensor) its
    largest difference over its largest magnitude."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        return max(max_rel_diff(a[k], b[k]) for k in a)
    return max_diff(a, b) / max(max((abs(x) for x in a), default=0.0), 1e-30)
