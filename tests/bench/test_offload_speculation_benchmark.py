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


def test_trace_times_each_host_adam_call_against_the_backward(tmp_path, monkeypatch):
    """--trace: per step, the host Adam calls the engines made (after the backward without speculation, during
    it with, where the threads allow), their time and how much of it ran before the backward's end."""
    monkeypatch.setenv("ZEROCORE_HOST_STEP_THREADS", "1")
    res = offload_speculation.main(["--dim", "32", "--layers", "2", "--heads", "2", "--ctx", "8", "--batch", "2",
                                    "--vocab", "64", "--bucket", "2000", "--rounds", "1", "--steps", "2", "--trace",
                                    "--variants", "no_offload", "after_backward", "speculative"])
    tr = res["trace"]
    assert tr["no_offload"]["adam_calls"] == 0 and tr["no_offload"]["fwd_bwd"] > 0
    after, spec = tr["after_backward"], tr["speculative"]
    assert after["adam_calls"] >= 1 and after["adam_sum"] > 0
    assert after["adam_before_bwd_end"] == 0  # the step's Adam starts once the backward has ended
    # (whether the speculation ran before the backward's end depends on the threads' timing: only its columns)
    assert spec["adam_calls"] >= 1 and spec["adam_sum"] > 0 and "last_adam_end_after_bwd" in spec
    # the landing's host time: every offloaded group lands once a step (the bucket makes several groups)
    for d in (after, spec):
        assert d["land_calls"] >= 2 and d["land_ms"] > 0 and d["land_wait_calls"] >= d["land_calls"]
        assert 0 < d["fwd_host"] <= d["bwd_host"] <= d["fwd_bwd"] + 1e-6
    assert "land_calls" not in tr["no_offload"]


def test_trace_at_stage_3_times_each_units_queued_step(monkeypatch):
    """Stage 3's unit steps are queued at step() and run on the worker while the next forward waits for them:
    the timeline counts them with the host Adam calls (no HostStepBatch there)."""
    monkeypatch.setenv("ZEROCORE_HOST_STEP_THREADS", "1")
    res = offload_speculation.main(["--stage", "3", "--dim", "32", "--layers", "2", "--heads", "2", "--ctx", "8",
                                    "--batch", "2", "--vocab", "64", "--bucket", "2000", "--rounds", "1", "--steps",
                                    "2", "--trace", "--variants", "after_backward"])
    after = res["trace"]["after_backward"]
    assert after["adam_calls"] >= 2 and after["adam_sum"] > 0 and after["land_calls"] >= 2


def test_sample_names_the_lines_each_thread_spends_its_steps_on(monkeypatch):
    """--sample STEPS: untraced steps of each variant with every thread's stack sampled; the training thread's
    report holds the engine's backward (on a CPU device the backward runs on it), the worker's its loop."""
    monkeypatch.setenv("ZEROCORE_HOST_STEP_THREADS", "1")
    res = offload_speculation.main(["--dim", "32", "--layers", "2", "--heads", "2", "--ctx", "8", "--batch", "2",
                                    "--vocab", "64", "--bucket", "2000", "--rounds", "1", "--steps", "1",
                                    "--variants", "after_backward", "--sample", "8"])
    rep = res["sample"]["after_backward"]
    assert rep["sweeps"] > 0 and rep["wall_s"] > 0
    main = next(v for k, v in rep["threads"].items() if k.startswith("MainThread@"))
    worker = next(v for k, v in rep["threads"].items() if k.startswith("zerocore-host-step@"))
    assert main["samples"] > 0 and "zerocore/runtime/engine.py backward" in main["inclusive"]
    assert "zerocore/offload/stepper.py _worker" in worker["inclusive"]
    assert all(0 < share <= 1 for share in main["leaves"].values())


def test_host_sampler_attributes_a_threads_time_to_its_function():
    """host_sampler.StackSampler on a thread that spends its time in one known function (spinning in Python,
    then blocked in a native sleep): both show, with shares of that thread's samples."""
    import threading
    import time

    from host_sampler import StackSampler

    def spin_here(until):
        while time.perf_counter() < until:
            pass

    def sleep_here(s):
        time.sleep(s)

    def work():
        spin_here(time.perf_counter() + 0.15)
        sleep_here(0.15)

    t = threading.Thread(target=work, name="probe")
    with StackSampler(focus=("tests/",)) as sampler:
        t.start()
        t.join()
    rep = sampler.report()
    probe = next(v for k, v in rep["threads"].items() if k.startswith("probe@"))
    inc = {k.rsplit(" ", 1)[-1]: share for k, share in probe["inclusive"].items()}
    assert inc["work"] > 0.9 and inc["spin_here"] > 0.2 and inc["sleep_here"] > 0.2
    assert any(k.endswith(" sleep_here") for k in probe["leaves"])


def test_fused_adam_benchmark_times_the_out_of_place_step_beside_the_in_place_one():
    """benchmarks/fused_adam.py's mixed case has the speculation's out-of-place step as a variant, timed over
    the same state, its bytes counted as the in-place step's."""
    import fused_adam

    c = fused_adam.run_case(5000, "tensors", True, "hot", 1, False, None, lambda: None)
    r = c["results"]
    assert {"roofline", "zerocore", "zerocore_out_of_place"} <= set(r)
    assert r["zerocore_out_of_place"]["bytes_per_param"] == r["zerocore"]["bytes_per_param"]
    assert r["zerocore_out_of_place"]["median_ms"] > 0 and "vs_zerocore_out_of_place" in c["zerocore_speedup"]


def test_profile_writes_each_variants_tables_and_copy_times(tmp_path, monkeypatch):
    """--profile DIR: each variant's steps under torch.profiler, a table per variant in DIR and per-step
    figures with the copy directions' rates (none on a CPU device: nothing is copied to a device)."""
    monkeypatch.setenv("ZEROCORE_HOST_STEP_THREADS", "1")
    res = offload_speculation.main(["--dim", "32", "--layers", "2", "--heads", "2", "--ctx", "8", "--batch", "2",
                                    "--vocab", "64", "--bucket", "2000", "--rounds", "1", "--steps", "1",
                                    "--variants", "after_backward", "speculative", "--profile", str(tmp_path)])
    for k in ("after_backward", "speculative"):
        p = res["profile"][k]
        assert p["steps"] == 2 and p["wall_ms"] > 0 and p["copy_rate_gbps"] == {"dtoh": None, "htod": None}
        assert "by self host time" in (tmp_path / f"profile_{k}.txt").read_text()


def test_pinned_rounding_counts_the_offloaded_buffers_as_a_gpu_run_allocates_them():
    """benchmarks/pinned_rounding.py: the host buffers of each case (stage 2: per group the landed gradient,
    the 16-bit staging a GPU run adds, master, m, v; stage 3 with parameter offload: the host parameter shard
    instead of the staging), what torch's power-of-two blocks would hold for them and what zerocore's do."""
    import pinned_rounding

    res = pinned_rounding.main(["--vocab", "64", "--dim", "32", "--layers", "2", "--heads", "2",
                                "--cases", "2:2000", "3p:2000"])
    two, three = res["cases"]["2:2000"], res["cases"]["3p:2000"]
    assert two["buffers"] == 5 * two["groups"] and three["buffers"] == 5 * three["groups"]
    n = two["params"]
    assert two["asked_GiB"] * 2 ** 30 == n * (2 + 2 + 4 + 4 + 4)  # bf16 gradient and staging, fp32 master/m/v
    for r in (two, three):
        assert r["torch_over_asked"] >= r["zerocore_over_asked"] >= 1.0
    assert pinned_rounding.pow2(5000) == 8192 and pinned_rounding.page(5000) == 8192 and pinned_rounding.page(4096) == 4096


def test_host_sampler_names_threads_the_threading_module_does_not_know():
    """A thread not started by ``threading`` (as autograd's device threads are, from C++) is reported as
    native@<ident>, its functions attributed as any other thread's."""
    import _thread
    import threading
    import time

    from host_sampler import StackSampler

    done = threading.Event()

    def spin_natively(until):
        while time.perf_counter() < until:
            pass
        done.set()

    with StackSampler(focus=("tests/",)) as sampler:
        _thread.start_new_thread(spin_natively, (time.perf_counter() + 0.2,))
        assert done.wait(10)
    natives = [v for k, v in sampler.report()["threads"].items() if k.startswith("native@")]
    assert any(any(k.endswith(" spin_natively") for k in v["inclusive"]) for v in natives)
