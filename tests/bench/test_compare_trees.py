"""benchmarks/compare_trees.py: the metrics read from the benchmarks' JSON and the summary's
medians and ratios (no benchmark is run here)."""
from __future__ import annotations

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
sys.path.insert(0, BENCH)
import compare_trees as ct  # noqa: E402


def test_summary_medians_spread_and_ratios():
    runs = {"before": [{"a": 10.0, "z": 1.0}, {"a": 12.0, "z": -1.0}, {"a": 20.0, "z": 2.0}],
            "after": [{"a": 5.0, "z": 0.5}, {"a": 6.0, "z": 1.0}, {"a": 40.0, "z": 1.0}]}
    s = ct.summarize(runs)
    assert s["a"]["before"]["median"] == 12.0 and s["a"]["before"]["min"] == 10.0 and s["a"]["before"]["max"] == 20.0
    r = s["a"]["after/before"]
    assert r["ratio"] == pytest.approx(6.0 / 12.0) and r["diff"] == pytest.approx(-6.0)
    assert r["round_ratios"] == pytest.approx([0.5, 0.5, 2.0]) and r["round_ratio_median"] == pytest.approx(0.5)
    # a metric that can be zero or negative (an overhead): no ratio where it is not positive
    z = s["z"]["after/before"]
    assert z["ratio"] == pytest.approx(1.0 / 1.0) and z["round_ratios"] == pytest.approx([0.5, 0.5])
    assert ct.summarize({"before": [{"z": -1.0}], "after": [{"z": 2.0}]})["z"]["after/before"]["ratio"] is None
    table = ct.format_table(s, ["before", "after"])
    assert "| a | 12 (10..20) | 6 (5..40) | -6 | 0.500x | 0.500x (0.500..2.000) |" in table


def test_a_metric_missing_in_one_tree_is_shown_as_missing():
    s = ct.summarize({"before": [{"a": 1.0}], "after": [{"a": 2.0, "b": 3.0}]})
    assert s["b"]["before"] is None and "after/before" not in s["b"]
    assert "| b | - | 3 (3..3) | - | - | - |" in ct.format_table(s, ["before", "after"])


@pytest.mark.parametrize("script, result", [("backward_overhead.py", "backward_overhead_fwd_bwd.json"),
                                            ("step.py", "step_gloo_w2.json")])
def test_extractors_read_the_committed_results(script, result):
    with open(os.path.join(BENCH, "results", result)) as f:
        m = ct.EXTRACTORS[script](json.load(f))
    assert m and all(isinstance(v, float) for v in m.values())
    if script == "step.py":
        assert "zerocore_stage3 step ms" in m
    else:
        assert {"stage3 backward us/param", "stage3 forward us/param", "plain backward us"} <= set(m)


def test_bad_trees_are_named(tmp_path):
    with pytest.raises(SystemExit, match="NAME=PATH"):
        ct.parse_trees(["before"])
    with pytest.raises(SystemExit, match="not a zerocore source tree"):
        ct.parse_trees([f"before={tmp_path}", "after=."])
    (tmp_path / "zerocore").mkdir()
    with pytest.raises(SystemExit, match="no built extension"):
        ct.parse_trees([f"before={tmp_path}", "after=."])
