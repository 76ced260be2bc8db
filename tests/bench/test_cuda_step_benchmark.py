"""benchmarks/step.py without a GPU: the command line (device, ranks, variants skipped when their
package or device is missing), the models from configs, and the JSON of a tiny CPU run."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")))
import step  # noqa: E402
import step_variants as sv  # noqa: E402

TINY = ["--dim", "32", "--layers", "2", "--heads", "2", "--ctx", "16", "--batch", "2"]


def test_cpu_defaults():
    a = step.parse_args([])
    assert a.device == "cpu" and a.ranks == 2 and a.vocab == 65 and a.variants == sv.CPU_DEFAULT and not a.skipped


def test_cuda_arguments(monkeypatch):
    with pytest.raises(SystemExit):
        step.parse_args(["--device", "cuda"])  # no GPU here: a clear error, not a crash
    with pytest.raises(SystemExit):
        step.parse_args(["--ranks", "all"])  # 'all' is for GPUs
    with pytest.raises(SystemExit):
        step.parse_args(["--variants", "torch_amp"])  # a GPU-only variant on the CPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    a = step.parse_args(["--device", "cuda"])
    assert a.ranks == 1 and a.vocab == 32768
    assert step.parse_args(["--device", "cuda", "--ranks", "all"]).ranks == 4
    monkeypatch.setattr(sv.importlib.util, "find_spec", lambda name: None if name == "deepspeed" else True)
    a = step.parse_args(["--device", "cuda"])
    assert set(a.skipped) == {"deepspeed_stage1", "deepspeed_stage2", "deepspeed_stage3"}
    assert "deepspeed" in a.skipped["deepspeed_stage2"] and "torch_amp" in a.variants and "zerocore_stage3" in a.variants
    with pytest.raises(SystemExit):
        step.parse_args(["--device", "cuda", "--variants", "deepspeed_stage3"])


@pytest.mark.parametrize("kind", sv.MODELS)
def test_models_from_configs(kind):
    if kind.startswith("hf") and sv.importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers not installed")
    args = step.parse_args(["--model", kind] + TINY)
    model = sv.build_model(kind, args, 50)
    assert len(sv.blocks_of(model)) == 2
    assert type(sv.blocks_of(model)[0]).__name__ == sv.UNIT_CLASS[kind]
    x = torch.randint(0, 50, (2, 16))
    assert sv.logits(model, x).shape == (2, 16, 50)
    assert sv.loss_of(model, x, x).dim() == 0


@pytest.mark.slow  # spawns a rank and builds two variants: ~1-2 min on the loaded 2-core VM
def test_tiny_cpu_run_writes_the_table_json(tmp_path):
    out = tmp_path / "step.json"
    report = step.main(["--ranks", "1", "--warmup", "1", "--steps", "2", "--rounds", "1", "--variants",
                        "ddp_torch_adamw", "zerocore_stage2", "--out", str(out)] + TINY)
    saved = json.loads(out.read_text())
    assert saved["device"] == "cpu" and saved["world"] == 1 and saved["n_params"] > 0
    for v in ("ddp_torch_adamw", "zerocore_stage2"):
        r = saved["results"][v]
        assert r["median_ms"] > 0 and r["tokens_per_s"] > 0 and len(r["times_ms"]) == 1 and len(r["times_ms"][0]) == 2
        assert r["peak_GiB"] is None and r["between_steps_GiB"] is None  # measured on GPUs only
        assert r["final_loss"] == pytest.approx(r["final_loss"])  # finite
    assert "zerocore_stage2/ddp_torch_adamw" in saved["ratios"] and report["results"].keys() == saved["results"].keys()


# ---- the GPU runner (step_cuda.py) with stand-ins for the allocator and the variants ------------
import argparse  # noqa: E402
import gc  # noqa: E402
import types  # noqa: E402
import weakref  # noqa: E402

import torch.distributed as dist  # noqa: E402

import step_cuda  # noqa: E402

MIB = 1 << 20


class FakeMemory:
    """Stands in for step_cuda.CudaMemory: 'device memory' is what live Blocks hold."""

    def __init__(self, workspace_mib=0):
        self.used = self.top = 0
        self.workspace_mib = workspace_mib

    def take(self, n):
        self.used += n
        self.top = max(self.top, self.used)

    def give(self, n):
        self.used -= n

    def sync(self):
        pass

    def allocated(self):
        return self.used

    def peak(self):
        return self.top

    def reset_peak(self):
        self.top = self.used

    def empty_cache(self):
        pass

    # page-locked host bytes handed out (CudaMemory.pinned); None: a torch that does not count them
    pinned_bytes = None

    def pinned(self):
        return self.pinned_bytes

    rss_bytes = None  # the process's resident memory (CudaMemory.host_rss); None: not read

    def host_rss(self):
        return self.rss_bytes

    # torch's per-process library memory (cuBLAS workspaces): made by the first matrix product, kept for good
    workspace = None

    def library_workspace(self):
        if self.workspace is None:
            self.workspace = Block(self, self.workspace_mib)

    def prime(self):
        self.library_workspace()


class Block:
    """``mib`` MiB of stand-in device memory, held while the object lives."""

    def __init__(self, mem, mib):
        self.mem, self.n = mem, mib * MIB
        mem.take(self.n)

    def __del__(self):
        self.mem.give(self.n)


class StandIn:
    """A variant's step: 100 MiB of weights, 50 MiB of activations during a step. ``fail_at``:
    the call that runs out of memory; ``cycle``: close() keeps the weights and the step sits in
    a reference cycle (what the H200 run saw of zerocore's engines); ``leak_to``: close() hands
    the weights to a list that outlives the variant (a true leak)."""

    def __init__(self, mem, log, fail_at=None, cycle=False, leak_to=None):
        self.mem, self.log, self.fail_at, self.cycle, self.leak_to = mem, log, fail_at, cycle, leak_to
        self.weights, self.calls = Block(mem, 100), 0
        if cycle:
            self.me = self

    def __call__(self, x, y):
        self.calls += 1
        self.mem.library_workspace()  # (the process's first matrix product makes it; none by default)
        activations = Block(self.mem, 50)  # noqa: F841 - held by the frame, as a failed step's traceback holds it
        if self.calls == self.fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return x.float().mean()

    def close(self, failed=False):
        self.log.append(("close", failed))
        if self.leak_to is not None:
            self.leak_to.append(self.weights)
        if not self.cycle:
            self.weights = None


@pytest.fixture
def group(tmp_path):
    """A one-rank gloo group (the runner agrees with its peers through it); the cyclic collector
    off, so that only the runner's gc.collect() frees a cycle."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        dist.destroy_process_group()


def _standins(mem, log, leaked):
    def refused():
        held = Block(mem, 30)  # noqa: F841 - taken before the refusal: must come back
        raise ValueError("stage 9 does not exist")
    return {"refused": refused,
            "clean": lambda: StandIn(mem, log),
            "oom": lambda: StandIn(mem, log, fail_at=1),
            "cycle": lambda: StandIn(mem, log, cycle=True),
            "leak": lambda: StandIn(mem, log, leak_to=leaked),
            "after": lambda: StandIn(mem, log)}


def test_the_libraries_own_memory_is_made_before_the_first_baseline(group):
    """torch's cuBLAS workspaces appear at the process's first matrix product and stay: the runners make
    them before the first baseline (CudaMemory.prime), so the first variant is not reported as leaking them."""
    for runner in (step_cuda.run_variants, step_cuda.run_interleaved):
        mem, log = FakeMemory(workspace_mib=64), []
        args = argparse.Namespace(warmup=1, steps=1, rounds=1)
        res = runner(["clean", "after"], lambda v: StandIn(mem, log), [torch.zeros(2, 9, dtype=torch.long)], args,
                     mem, 0, 1)
        assert mem.workspace is not None
        for v, m in res["memory"].items():
            assert not step_cuda.leak_warnings(v, m), (runner.__name__, v, m)


def test_runner_reports_the_pinned_host_memory_a_variant_holds(group):
    """pinned_GiB: the page-locked host memory held during the timed steps, net of what was pinned before the
    variant was built (CPU offload's buffers); host_GiB: the process's resident memory likewise; absent where
    they cannot be read."""
    class Pinning(StandIn):
        def __init__(self, mem, log, mib):
            super().__init__(mem, log)
            mem.pinned_bytes += mib * MIB
            mem.rss_bytes += 2 * mib * MIB  # its pinned buffers and as much unpinned host state
            self.mib = mib

        def close(self, failed=False):
            super().close(failed)
            self.mem.pinned_bytes -= self.mib * MIB
            self.mem.rss_bytes -= 2 * self.mib * MIB

    mem, log = FakeMemory(), []
    mem.pinned_bytes, mem.rss_bytes = 5 * MIB, 700 * MIB  # before the run (the batches' staging, the interpreter)
    args = argparse.Namespace(warmup=1, steps=1, rounds=1)
    sizes = {"small": 30, "large": 300}
    res = step_cuda.run_variants(list(sizes), lambda v: Pinning(mem, log, sizes[v]),
                                 [torch.zeros(2, 9, dtype=torch.long)], args, mem, 0, 1)
    assert {v: round(res["memory"][v]["pinned_GiB"] * step_cuda.GIB / MIB) for v in sizes} == sizes
    assert {v: round(res["memory"][v]["host_GiB"] * step_cuda.GIB / MIB) for v in sizes} == {"small": 60, "large": 600}
    mem.pinned_bytes = mem.rss_bytes = None
    res = step_cuda.run_variants(["small"], lambda v: StandIn(mem, log), [torch.zeros(2, 9, dtype=torch.long)], args,
                                 mem, 0, 1)
    assert "pinned_GiB" not in res["memory"]["small"] and "host_GiB" not in res["memory"]["small"]


def test_runner_skips_failures_frees_and_measures_net_of_the_baseline(group, capsys):
    mem, log, leaked = FakeMemory(), [], []
    batches = [torch.zeros(2, 9, dtype=torch.long)]
    mem.take(10 * MIB)  # the batches: the baseline
    build = _standins(mem, log, leaked)
    args = argparse.Namespace(warmup=1, steps=2, rounds=2)
    res = step_cuda.run_variants(list(build), lambda v: build[v](), batches, args, mem, 0, 1)
    gib = lambda mib: mib * MIB / step_cuda.GIB  # noqa: E731

    assert res["not_built"] == {"refused": "failed to build: ValueError: stage 9 does not exist",
                                "oom": "failed in warm-up: OutOfMemoryError: CUDA out of memory. Tried to allocate "
                                       "2.00 GiB"}
    assert set(res["times"]) == {"clean", "cycle", "leak", "after"}  # the run went on after each failure
    assert [len(r) for r in res["times"]["clean"]] == [2, 2] and len(res["losses"]["clean"]) == 4
    m = res["memory"]
    assert m["clean"] == {"baseline_GiB": gib(10), "peak_GiB": gib(150), "between_steps_GiB": gib(100),
                          "left_after_del_GiB": 0.0, "left_after_gc_GiB": 0.0}
    # a failed build or warm-up gave back what it took, and its step was closed as failed
    assert m["refused"]["left_after_del_GiB"] == m["oom"]["left_after_del_GiB"] == 0.0
    assert ("close", True) in log and log.count(("close", False)) == 4
    # a cycle holds the weights until the collection; a leak outlives it and raises the next baseline
    assert (m["cycle"]["left_after_del_GiB"], m["cycle"]["left_after_gc_GiB"]) == (gib(100), 0.0)
    assert (m["leak"]["left_after_del_GiB"], m["leak"]["left_after_gc_GiB"]) == (gib(100), gib(100))
    assert m["after"]["baseline_GiB"] == gib(110) and m["after"]["peak_GiB"] == gib(150)
    assert [step_cuda.leak_warnings(v, m[v]) for v in ("refused", "oom", "clean", "after")] == [[]] * 4
    err = capsys.readouterr().err
    assert "rank 0: WARNING: cycle held 0.098 GiB after close() and del until gc.collect()" in err
    assert "rank 0: WARNING: leak LEAKED 0.098 GiB" in err and "rank 0: skipped oom: failed in warm-up" in err
    assert "WARNING: clean" not in err and "WARNING: after" not in err


def test_runner_reports_a_failed_timed_step_and_a_failed_close(group):
    mem, log = FakeMemory(), []

    class BadClose(StandIn):
        def close(self, failed=False):
            self.weights = None
            raise RuntimeError("workers did not stop")

    build = {"timed": lambda: StandIn(mem, log, fail_at=2), "bad_close": lambda: BadClose(mem, log)}
    args = argparse.Namespace(warmup=1, steps=1, rounds=1)
    res = step_cuda.run_variants(list(build), lambda v: build[v](), [torch.zeros(1, 3, dtype=torch.long)], args,
                                 mem, 0, 1)
    assert res["not_built"] == {"timed": "failed in a timed step: OutOfMemoryError: CUDA out of memory. Tried to "
                                         "allocate 2.00 GiB"}
    assert res["memory"]["bad_close"]["close_error"] == "RuntimeError: workers did not stop"
    assert step_cuda.leak_warnings("bad_close", res["memory"]["bad_close"]) == [
        "WARNING: bad_close: close() raised RuntimeError: workers did not stop"]
    assert mem.used == 0 and list(res["times"]) == ["bad_close"]


def test_cuda_table_and_json_carry_skips_and_leftovers(group, monkeypatch, tmp_path, capsys):
    """step.main on "cuda" with the ranks' run replaced by the runner over stand-ins."""
    mem, log = FakeMemory(), []
    mem.take(10 * MIB)
    build = _standins(mem, log, [])
    names = {"torch_amp": "clean", "zerocore_stage1": "refused", "zerocore_stage2": "cycle"}

    def ranks(worker, n, args):
        res = step_cuda.run_variants(args.variants, lambda v: build[names[v]](), [torch.zeros(2, 9, dtype=torch.long)],
                                     args, mem, 0, 1)
        return json.loads(json.dumps({**res, "n_params": 1000}))  # as the file from rank 0 reads

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "stand-in GPU")
    monkeypatch.setattr(step, "spawn_ranks", ranks)
    out = tmp_path / "step.json"
    step.main(["--device", "cuda", "--variants", *names, "--warmup", "1", "--steps", "2", "--rounds", "1",
               "--out", str(out)])
    text = capsys.readouterr().out
    assert "skipped zerocore_stage1: failed to build: ValueError: stage 9 does not exist" in text
    assert "WARNING: zerocore_stage2 held 0.098 GiB after close() and del until gc.collect() freed it" in text
    saved = json.loads(out.read_text())
    amp = saved["results"]["torch_amp"]
    assert (amp["baseline_GiB"], amp["peak_GiB"], amp["left_after_gc_GiB"]) == (10 / 1024, 150 / 1024, 0.0)
    assert saved["results"]["zerocore_stage2"]["left_after_del_GiB"] == 100 / 1024
    assert saved["skipped"]["zerocore_stage1"]["why"].startswith("failed to build: ValueError")
    assert saved["skipped"]["zerocore_stage1"]["left_after_gc_GiB"] == 0.0 and "zerocore_stage1" not in saved["results"]


# ---- DeepSpeed's environment and every variant's teardown ---------------------------------------
def test_deepspeed_variant_sets_local_rank_before_deepspeed_starts(group, monkeypatch):
    seen = {}

    class FakeEngine:
        def destroy(self):
            seen["destroyed"] = True

    def initialize(**kw):
        seen.update({k: os.environ.get(k) for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "DS_ACCELERATOR")})
        return FakeEngine(), None, None, None

    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(initialize=initialize))
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "DS_ACCELERATOR"):
        monkeypatch.setenv(key, "unset")  # recorded, so that the test's end removes what the build sets
        monkeypatch.delenv(key)
    args = step.parse_args(TINY)
    ctx = sv.Ctx(device=torch.device("cuda", 3), world=1, args=args)  # the benchmark's rank on GPU 3
    stepper = sv.REGISTRY["deepspeed_stage1"].build(sv.build_model("gpt", args, 50), ctx)
    assert seen == {"LOCAL_RANK": "3", "RANK": "0", "WORLD_SIZE": "1", "DS_ACCELERATOR": None}
    stepper.close()
    assert seen["destroyed"] and stepper.engine is None
    monkeypatch.setenv("LOCAL_RANK", "5")  # a launcher's value stays
    sv.REGISTRY["deepspeed_stage2"].build(sv.build_model("gpt", args, 50), ctx)
    assert seen["LOCAL_RANK"] == "5"


@pytest.mark.parametrize("name", ["ddp_torch_adamw", "ddp_fused_adam", "fsdp2", "zerocore_stage1", "zerocore_stage3",
                                  "zerocore_face_stage2", "zerocore_face_sgd_stage2"])
def test_closed_step_holds_nothing(group, name):
    """After a step and close(), the step keeps nothing of the variant: a collection frees the model
    while the runner still holds the closed step."""
    args = step.parse_args(TINY)
    model = sv.build_model("gpt", args, 50)
    alive = weakref.ref(model)
    stepper = sv.REGISTRY[name].build(model, sv.Ctx(device=torch.device("cpu"), world=1, args=args))
    del model
    x = torch.randint(0, 50, (2, 17))
    assert stepper(x[:, :-1], x[:, 1:]).item() > 0
    stepper.close()
    gc.collect()
    assert alive() is None


def test_runner_profiles_each_variant_after_its_timed_steps(group, tmp_path):
    """--profile: after the timing, a few more steps under torch.profiler (the CPU activity here),
    the table and the gzipped Chrome trace written per variant, the per-step figures in the JSON."""
    import gzip

    mem, log = FakeMemory(), []
    batches = [torch.zeros(2, 9, dtype=torch.long)]
    args = argparse.Namespace(warmup=1, steps=1, rounds=1, profile=str(tmp_path / "prof"), profile_steps=2)
    res = step_cuda.run_variants(["clean"], lambda v: StandIn(mem, log), batches, args, mem, 0, 1)
    p = res["memory"]["clean"]["profile"]
    assert p["steps"] == 2 and p["wall_ms"] > 0 and p["device_busy_ms"] == 0 and p["launches"] == 0
    assert "by self host time" in (tmp_path / "prof" / "profile_clean.txt").read_text()
    assert json.loads(gzip.open(tmp_path / "prof" / "trace_clean.json.gz").read())["traceEvents"]


def test_profile_summary_counts_per_step():
    """Device busy time is the union of the device intervals (streams overlap); launches and the
    host-blocking runtime calls are counted per step; asynchronous memcpys do not block."""
    import step_profile

    def ev(name, start=0, end=0, device=False):
        return types.SimpleNamespace(name=name, device_type="DeviceType.CUDA" if device else "DeviceType.CPU",
                                     time_range=types.SimpleNamespace(start=start, end=end))

    events = [ev("gemm", 0, 1000, True), ev("nccl", 500, 1500, True), ev("Memcpy DtoH (Device -> Pinned)", 3000,
                                                                          3500, True),
              ev("cudaLaunchKernel"), ev("cudaLaunchKernel"), ev("cudaStreamSynchronize"), ev("cudaMemcpyAsync"),
              ev("cudaMemcpy"), ev("aten::mm")]
    s = step_profile.summarize(events, n=2, wall_s=0.004)
    assert s["wall_ms"] == 2.0 and s["device_busy_ms"] == 1.0 and s["device_idle_share"] == 0.5
    assert s["launches"] == 1 and s["blocking_calls"] == {"cudaMemcpy": 0.5, "cudaStreamSynchronize": 0.5}
    assert s["memcpy"] == {"Memcpy DtoH (Device -> Pinned)": 0.5}
    assert s["memcpy_ms"] == {"Memcpy DtoH (Device -> Pinned)": 0.25}  # 500 us over 2 steps


def test_interleaved_runner_times_every_variant_each_round_and_frees_them_all(group):
    """--interleave: every variant alive at once, one block of steps per variant per round, a failed
    build skipped with its reason, everything given back at the end (the run's memory figures)."""
    mem, log, leaked = FakeMemory(), [], []
    batches = [torch.zeros(2, 9, dtype=torch.long)]
    build = _standins(mem, log, leaked)
    args = argparse.Namespace(warmup=1, steps=2, rounds=3)
    names = ["clean", "refused", "oom", "after"]
    res = step_cuda.run_interleaved(names, lambda v: build[v](), batches, args, mem, 0, 1)
    assert set(res["not_built"]) == {"refused", "oom"} and "stage 9 does not exist" in res["not_built"]["refused"]
    assert set(res["times"]) == {"clean", "after"}
    assert [len(r) for r in res["times"]["clean"]] == [2, 2, 2] and len(res["losses"]["after"]) == 6
    run = res["memory"]["run"]
    assert run["peak_GiB"] == 250 * MIB / step_cuda.GIB  # both variants' weights + one step's activations
    assert run["left_after_del_GiB"] == run["left_after_gc_GiB"] == 0.0
    assert log.count(("close", False)) == 2 and ("close", True) in log
