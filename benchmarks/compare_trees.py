"""Runs one benchmark against two (or more) source trees of zerocore, interleaved in one run.

Each round runs the benchmark once per tree, the trees in a fresh random order each round, as a
subprocess whose ``PYTHONPATH`` is that tree (and its working directory too), with ``--out`` a
JSON file per run. The benchmark script itself is the one given (resolved from the directory
this is started in), so both trees are measured by the same benchmark code; only the imported
``zerocore`` differs (checked before the first round). Then, per metric, the median and min..max
over rounds for each tree, and for every tree after the first its ratio to the first: of the
medians, and per round (the two runs of a round are minutes apart at most: the per-round ratio
is what drift on a noisy machine disturbs least).

Set-up of an old tree beside the working one (each tree needs its own built extension)::

    git worktree add /tmp/before <commit>
    cp zerocore/_C*.so /tmp/before/zerocore/   # or: cd /tmp/before && python setup.py build_ext --inplace
    python benchmarks/compare_trees.py --tree before=/tmp/before --tree after=. --rounds 5 \\
        -- benchmarks/backward_overhead.py --rounds 5 --steps 10
    python benchmarks/compare_trees.py --tree before=/tmp/before --tree after=. --rounds 3 \\
        -- benchmarks/step.py --ranks 2 --variants zerocore_stage3 zerocore_stage3_offload --rounds 2 --steps 3

(copying the .so is only right when ``csrc/`` is the same in both trees). Metrics are read from
each benchmark's JSON by an extractor named after the script (``EXTRACTORS``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time


# -- metrics from each benchmark's JSON (lower is better for all of them) ---------------------
def backward_overhead_metrics(report: dict) -> dict[str, float]:
    """Per stage: backward and forward overhead over plain torch, us per parameter; and plain's
    own times (the machine's speed during the run, for reading the rest)."""
    out = {}
    for row in report["rows"]:
        v = row["variant"]
        if v == "plain":
            out["plain backward us"] = row["backward_us_median"]
            if "forward_us_median" in row:
                out["plain forward us"] = row["forward_us_median"]
            continue
        out[f"{v} backward us/param"] = row["overhead_us_per_param"]
        if "forward_overhead_us_per_param" in row:
            out[f"{v} forward us/param"] = row["forward_overhead_us_per_param"]
    return out


def step_metrics(report: dict) -> dict[str, float]:
    """Per variant: the median step time, ms."""
    return {f"{v} step ms": r["median_ms"] for v, r in report["results"].items()}


EXTRACTORS = {"backward_overhead.py": backward_overhead_metrics, "step.py": step_metrics}


# -- the summary: medians, spreads, ratios ------------------------------------------------------
def summarize(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict]:
    """``runs[tree][round]`` = that run's metrics; the first tree is the baseline. Returns per
    metric: each tree's median, min, max over rounds, and for every other tree ``ratio`` (of the
    medians; None unless both are > 0), ``diff`` (of the medians) and ``round_ratios`` (that
    round's value / the baseline's in the same round, where both are > 0)."""
    trees = list(runs)
    base = trees[0]
    metrics = list(dict.fromkeys(m for t in trees for r in runs[t] for m in r))  # every metric, first seen first
    out = {}
    for m in metrics:
        row = {}
        for t in trees:
            vals = [r[m] for r in runs[t] if m in r]
            row[t] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": vals} \
                if vals else None
        for t in trees[1:]:
            if row[t] is None or row[base] is None:
                continue
            b, a = row[base]["median"], row[t]["median"]
            per_round = [x[m] / y[m] for x, y in zip(runs[t], runs[base]) if m in x and m in y and x[m] > 0 and y[m] > 0]
            row[f"{t}/{base}"] = {"ratio": a / b if a > 0 and b > 0 else None, "diff": a - b,
                                  "round_ratios": per_round,
                                  "round_ratio_median": statistics.median(per_round) if per_round else None,
                                  "round_ratio_min": min(per_round) if per_round else None,
                                  "round_ratio_max": max(per_round) if per_round else None}
        out[m] = row
    return out


def format_table(summary: dict[str, dict], trees: list[str]) -> str:
    base = trees[0]
    head = ["metric"] + [f"{t} median (min..max)" for t in trees]
    for t in trees[1:]:
        head += [f"{t}-{base}", f"{t}/{base}", "per round (min..max)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, row in summary.items():
        cells = [m]
        for t in trees:
            s = row.get(t)
            cells.append(f"{s['median']:.4g} ({s['min']:.4g}..{s['max']:.4g})" if s else "-")
        for t in trees[1:]:
            r = row.get(f"{t}/{base}")
            if r is None:
                cells += ["-", "-", "-"]
                continue
            cells.append(f"{r['diff']:+.4g}")
            cells.append(f"{r['ratio']:.3f}x" if r["ratio"] is not None else "-")
            cells.append(f"{r['round_ratio_median']:.3f}x ({r['round_ratio_min']:.3f}..{r['round_ratio_max']:.3f})"
                         if r["round_ratio_median"] is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- running ------------------------------------------------------------------------------------
def parse_trees(specs: list[str]) -> dict[str, str]:
    trees = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"compare_trees: --tree wants NAME=PATH, got {spec!r}")
        if name in trees:
            raise SystemExit(f"compare_trees: tree name {name!r} given twice")
        path = os.path.abspath(path)
        pkg = os.path.join(path, "zerocore")
        if not os.path.isdir(pkg):
            raise SystemExit(f"compare_trees: tree {name!r}: {pkg} does not exist (not a zerocore source tree)")
        if not any(f.startswith("_C") and f.endswith(".so") for f in os.listdir(pkg)):
            raise SystemExit(f"compare_trees: tree {name!r}: no built extension zerocore/_C*.so in {pkg} "
                             "(build it there, or copy one built from the same csrc/)")
        trees[name] = path
    if len(trees) < 2:
        raise SystemExit("compare_trees: give at least two --tree NAME=PATH")
    return trees


def tree_env(path: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = path  # only the tree: a PYTHONPATH=. of the caller would shadow it
    return env


def check_import(name: str, path: str) -> None:
    """The tree's own zerocore must be the one a run imports."""
    got = subprocess.run([sys.executable, "-c", "import zerocore; print(zerocore.__file__)"], cwd=path,
                         env=tree_env(path), capture_output=True, text=True)
    where = got.stdout.strip()
    if got.returncode != 0 or not os.path.realpath(where).startswith(os.path.realpath(path) + os.sep):
        raise SystemExit(f"compare_trees: tree {name!r} ({path}) imports zerocore from {where or '?'}: "
                         f"{got.stderr.strip()[-2000:]}")


def run_once(name: str, path: str, script: list[str], out: str, log: str) -> dict:
    cmd = [sys.executable, *script, "--out", out]
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=path, env=tree_env(path), stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - t0
    if rc != 0 or not os.path.exists(out):
        with open(log) as f:
            tail = f.read()[-4000:]
        raise SystemExit(f"compare_trees: tree {name!r}: `{' '.join(cmd)}` (cwd {path}) exited {rc}:\n{tail}")
    with open(out) as f:
        report = json.load(f)
    return {"report": report, "seconds": seconds, "load_before": load0, "load_after": os.getloadavg()[0]}


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("compare_trees: put the benchmark after `--`: ... -- benchmarks/step.py --ranks 2")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                    help="a zerocore source tree with its built extension; the first is the baseline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-round orders")
    ap.add_argument("--out", default="", help="combined JSON (every run's metrics, the summary)")
    ap.add_argument("--keep", default="", help="folder for each run's JSON and log (default: a temp folder, removed)")
    args = ap.parse_args(argv[:cut])
    script = argv[cut + 1:]
    if not script:
        raise SystemExit("compare_trees: no benchmark after `--`")
    if "--out" in script or any(a.startswith("--out=") for a in script):
        raise SystemExit("compare_trees: leave --out out of the benchmark's arguments (each run gets its own)")
    script[0] = os.path.abspath(script[0])
    extract = EXTRACTORS.get(os.path.basename(script[0]))
    if extract is None:
        raise SystemExit(f"compare_trees: no metric extractor for {os.path.basename(script[0])!r}; "
                         f"known: {', '.join(EXTRACTORS)}")
    if args.rounds < 1:
        raise SystemExit("compare_trees: --rounds must be >= 1")
    trees = parse_trees(args.tree)
    for name, path in trees.items():
        check_import(name, path)

    work = args.keep or tempfile.mkdtemp(prefix="zc_compare_trees_")
    os.makedirs(work, exist_ok=True)
    runs = {t: [] for t in trees}
    log = []
    for r in range(args.rounds):
        order = list(trees)
        random.Random(args.seed + r).shuffle(order)
        for t in order:
            out = os.path.join(work, f"{t}_round{r}.json")
            res = run_once(t, trees[t], script, out, os.path.join(work, f"{t}_round{r}.log"))
            runs[t].append(extract(res["report"]))
            log.append({"round": r, "tree": t, "seconds": res["seconds"], "load_before": res["load_before"],
                        "load_after": res["load_after"]})
            print(f"round {r + 1}/{args.rounds}: {t} {res['seconds']:.0f} s, load {res['load_before']:.1f} -> "
                  f"{res['load_after']:.1f}", file=sys.stderr, flush=True)
    summary = summarize(runs)
    names = list(trees)
    loads = [e["load_before"] for e in log] + [e["load_after"] for e in log]
    print(f"{os.path.basename(script[0])} {' '.join(script[1:])}: {args.rounds} rounds, trees in a fresh random "
          f"order each round; load average {min(loads):.1f}..{max(loads):.1f}")
    for t in names:
        print(f"  {t}: {trees[t]}")
    print(format_table(summary, names))
    combined = {"script": script, "trees": trees, "rounds": args.rounds, "seed": args.seed, "runs": runs,
                "log": log, "summary": summary}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(combined, f, indent=1)
        print(f"wrote {args.out}")
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return combined


if __name__ == "__main__":
    main()
