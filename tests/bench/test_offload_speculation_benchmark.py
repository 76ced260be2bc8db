"""benchmarks/offload_speculation.py on a tiny model (one round, stages 2 and 3): every variant timed, T_host
measured, the ratios against the step as before and against max(T_device, T_host) written, and the counts that
say the speculation was kept where the clip does not bite and stopped where it always does."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")))
import offload_speculation  # noqa: E402


@pytest.mark.parametrize("stage", [2, 3])
def test_tiny_run_reports_every_variant_and_the_speculations(stage, tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROCORE_HOST_STEP_THREADS", "1")  # the benchmark sets it: put back after the test
    out = tmp_path / "spec.json"
    res = offload_speculation.main(["--stage", str(stage), "--dim", "32", "--layers", "2", "--heads", "2", "--ctx",
                                    "8", "--batch", "2", "--vocab", "64", "--bucket", "2000", "--rounds", "1",
                                    "--steps", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert set(saved["step"]) == set(offload_speculation.VARIANTS)
    assert saved["t_host"]["median_ms"] > 0
    assert saved["ratios"]["after_backward"]["vs_after_backward"] == 1.0
    assert saved["ratios"]["speculative"]["vs_max_device_host"] > 0
    kept, dropped = res["speculations_kept_dropped"]["speculative"]
    assert kept > 0 and dropped == 0
    kept, dropped = res["speculations_kept_dropped"]["speculative_dropped"]
    assert kept == 0 and dropped > 0
