"""Sets two runs of ``run.py`` side by side: zerocore.deepspeed's results against the installed
DeepSpeed's on the same tests (and, optionally, an earlier zerocore run), per file and per test.

    python scripts/ds_unit/compare.py --zerocore /tmp/ds_zc --deepspeed /tmp/ds_ref [--before /tmp/ds_base]

A test "applies" when DeepSpeed itself did not skip it on this machine and it is not one of the
features the face leaves out (pipeline, MoE, ZeRO++, MiCS: named by ``LEFT_OUT``). The summary gives
zerocore's pass rate over the tests that apply, and over those DeepSpeed itself passes.
"""
from __future__ import annotations

import argparse
import glob
import os
import re

from run import _read_junit

# test ids (regular expressions) of features zerocore.deepspeed does not offer
LEFT_OUT = {
    "MiCS": r"MiCS",
    "ZeRO++": r"ZeROPP|[Zz]eropp",
    "pipeline": r"PipelineModule|PipeModel|test_pipe_",  # (not ZeRO-3's pipeline_loading_checkpoint option)
    "MoE": r"MoE",
}


def _results(folder: str | None) -> dict[str, dict[str, tuple[str, str]]]:
    """{file: {test id: (outcome, first line)}} of a run folder (files without a report: absent)."""
    out: dict[str, dict[str, tuple[str, str]]] = {}
    if folder is None:
        return out
    for junit in sorted(glob.glob(os.path.join(folder, "*.xml"))):
        rel = os.path.basename(junit)[:-len(".py.xml")].replace("__", "/") + ".py"
        out[rel] = {name: (o, line) for name, o, line in _read_junit(junit)}
    return out


def left_out(test: str) -> str | None:
    for feature, pattern in LEFT_OUT.items():
        if re.search(pattern, test):
            return feature
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zerocore", required=True)
    ap.add_argument("--deepspeed", required=True)
    ap.add_argument("--before", default=None, help="an earlier zerocore run, for before/after counts")
    ap.add_argument("--out", default=None, help="write the markdown here too")
    args = ap.parse_args()
    zc, ds, before = _results(args.zerocore), _results(args.deepspeed), _results(args.before)
    lines = ["| file | zerocore before: pass / fail / skip | zerocore now | DeepSpeed 0.19.8 (CPU) |",
             "|---|---|---|---|"]

    def counts(rows) -> str:
        if rows is None:
            return "-"
        vals = [o for o, _ in rows.values()]
        return (f"{vals.count('passed')} / {vals.count('failed') + vals.count('error')} / "
                f"{vals.count('skipped')}")

    applies = passes = ds_pass = ds_pass_zc_pass = 0
    failures = []
    for rel in sorted(set(zc) | set(ds)):
        lines.append(f"| {rel} | {counts(before.get(rel))} | {counts(zc.get(rel))} | {counts(ds.get(rel))} |")
        for test, (o, line) in zc.get(rel, {}).items():
            d = ds.get(rel, {}).get(test, ("missing", ""))
            if d[0] == "skipped" or o == "skipped" and d[0] == "missing" or left_out(test):
                continue
            applies += 1
            passes += o == "passed"
            if d[0] == "passed":
                ds_pass += 1
                ds_pass_zc_pass += o == "passed"
            if o != "passed":
                failures.append((test, d[0], line))
    lines += ["", f"Tests that apply (DeepSpeed does not skip them here; not {', '.join(LEFT_OUT)}): {applies}; "
              f"zerocore passes {passes} ({100 * passes / max(applies, 1):.1f}%). Of the {ds_pass} DeepSpeed itself "
              f"passes, zerocore passes {ds_pass_zc_pass} ({100 * ds_pass_zc_pass / max(ds_pass, 1):.1f}%).", "",
              "| test failing on zerocore | on DeepSpeed | zerocore's first error line |", "|---|---|---|"]
    lines += [f"| {t} | {d} | {line.replace('|', '/')[:200]} |" for t, d, line in failures]
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
