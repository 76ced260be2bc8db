"""benchmarks/step.py's NVMe variants (issue 13): the swap probe's per-step arithmetic, the preset,
and a tiny world-1 run whose swap bytes per step are the owned optimizer state, read and written
once, and whose refused configurations are reported, not fatal."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")))
import step  # noqa: E402
import step_variants as sv  # noqa: E402
import swap_probe  # noqa: E402

TINY = ["--dim", "32", "--layers", "2", "--heads", "2", "--ctx", "16", "--batch", "2"]


def test_per_step_sums_bytes_over_ranks_and_takes_the_slowest_rank():
    r0 = {"v": {"read_bytes": 400, "write_bytes": 400, "passes": 4, "pass_s": 2.0, "wait_s": 0.4, "groups": 2}}
    r1 = {"v": {"read_bytes": 600, "write_bytes": 300, "passes": 4, "pass_s": 3.0, "wait_s": 0.2, "groups": 2}}
    row = swap_probe.per_step([r0, r1], "v")
    assert row == {"steps_counted": 2.0, "read_bytes": 500.0, "write_bytes": 350.0, "io_pass_s": 1.5,
                   "blocked_s": 0.2}
    assert swap_probe.per_step([r0], "absent") is None


def test_nvme_preset():
    a = step.parse_args(["--preset", "nvme"])
    # zerocore's variants and DDP need nothing optional: they run on any machine
    assert {"zerocore_stage3_nvme", "zerocore_stage3_nvme_param", "zerocore_stage3", "ddp_torch_adamw"} <= set(
        a.variants)
    assert set(a.variants) | set(a.skipped) == set(sv.NVME)
    with pytest.raises(SystemExit):
        step.parse_args(["--preset", "nvme", "--variants", "zerocore_stage3"])


@pytest.mark.parametrize("preset", sorted(p for p, vs in sv.PRESETS.items() if any(v.startswith("deepspeed") for v in vs)))
def test_preset_leaves_out_peers_that_are_not_installed(preset, monkeypatch, capsys):
    """On a machine without DeepSpeed a preset runs zerocore's part and names what it left out;
    a variant asked for by name that cannot run is still an error."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    a = step.parse_args(["--preset", preset])
    deepspeed = [v for v in sv.PRESETS[preset] if v.startswith("deepspeed")]
    # the preset's variants for another device (the offload preset's speculative ones run on CUDA only)
    elsewhere = {v: why for v in sv.PRESETS[preset] if v not in deepspeed and (why := sv.unavailable(v, a.device))}
    assert all("cuda only" in why for why in elsewhere.values()), elsewhere
    assert deepspeed and a.skipped == {**{v: "needs deepspeed (not installed)" for v in deepspeed}, **elsewhere}
    assert a.variants == [v for v in sv.PRESETS[preset] if v not in deepspeed and v not in elsewhere]
    err = capsys.readouterr().err
    assert all(f"leaving out {v}: needs deepspeed (not installed)" in err for v in deepspeed)
    with pytest.raises(SystemExit):
        step.parse_args(["--variants", "zerocore_stage3", deepspeed[0]])


@pytest.mark.slow  # spawns a rank, builds three stage-3 engines: ~1 min on the loaded 2-core VM
def test_tiny_nvme_run_counts_the_swap(tmp_path):
    out = tmp_path / "step.json"
    report = step.main(["--ranks", "1", "--warmup", "1", "--steps", "2", "--rounds", "2", "--disk-probe-mb", "8",
                        "--sub-group", "4096", "--max-in-cpu", "100", "--nvme-dir", str(tmp_path), "--variants",
                        "zerocore_stage3", "zerocore_stage3_nvme", "zerocore_stage3_nvme_param", "--out", str(out)]
                       + TINY)
    assert json.loads(out.read_text())["nvme"] == report["nvme"]
    nv = report["nvme"]
    assert len(nv["disk_probes"]) == 2 and nv["engine_read_GBps"] > 0 and nv["engine_write_GBps"] > 0
    row = nv["variants"]["zerocore_stage3_nvme"]
    # every tile's record (4 KiB header + master, m, v) read once and written once per step
    assert row["read_bytes"] == row["write_bytes"] >= 12 * report["n_params"]
    assert row["read_bytes"] < 12 * report["n_params"] + 4096 * 64
    assert row["io_pass_s"] > 0 and row["io_vs_disk"] > 0
    assert "zerocore_stage3_nvme/zerocore_stage3" in report["ratios"]
    # parameter shards on NVMe: either they run (counted like the optimizer's) or the refusal is named
    if "zerocore_stage3_nvme_param" in report["results"]:
        assert "zerocore_stage3_nvme_param" in nv["variants"]
    else:
        assert "max_in_cpu" in report["args"]["skipped"]["zerocore_stage3_nvme_param"]
    left = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    assert left == [str(out)]  # the swap files and the disk probe's file are gone
