"""CPU offload (zero_optimization.offload_optimizer / offload_param, device cpu) on 1, 2 and 4
gloo ranks, against single-process torch.optim.AdamW with test_stages.py's tolerances and the
global gradient norm every step, and against the same run without offload: with ``ratio`` 1 the
host step is the same kernel on the same values, so every loss, norm and weight must be equal
bit for bit (ratio 0.5 splits each owned range's norm sum in two: tolerances only).

The three ways users ask for it: DeepSpeed's sections, the deprecated ``cpu_offload: true``, and
ColossalAI's form ``zero=dict(offload_optimizer_config=..., offload_param_config=...)``.
"""
from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

import zerocore
from dist_helpers import Case, case_results, make_batch, make_model, loss_fn, reference, run_case, spawn_cases
from test_stages import check_against_reference
from zerocore.config import ConfigError

SIZE = {"stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 100}


@dataclasses.dataclass
class OffCase(Case):
    """A Case whose config asks for offload in one of the three forms users write."""

    form: str = "ds"  # ds | deprecated | colossal
    ratio: float = 1.0
    params: bool = False  # stage 3: offload_param too
    max_in_cpu: int | None = None

    def config(self) -> dict:
        cfg = super().config()
        z = cfg.pop("zero_optimization")
        opt = {"device": "cpu", "pin_memory": True}
        if self.ratio != 1.0:
            opt["ratio"] = self.ratio
        par = {"device": "cpu", "pin_memory": True}
        if self.max_in_cpu is not None:
            par["max_in_cpu"] = self.max_in_cpu
        if self.form == "deprecated":
            z["cpu_offload"] = True
            if self.params:
                z["cpu_offload_param"] = True
        elif self.form == "colossal":  # ColossalAI's spelling: a `zero` dict with *_config sections
            z["offload_optimizer_config"] = dict(opt, fast_init=True)
            if self.params:
                z["offload_param_config"] = par
        else:
            z["offload_optimizer"] = opt
            if self.params:
                z["offload_param"] = par
        cfg["zero" if self.form == "colossal" else "zero_optimization"] = z
        return cfg


def base_of(case: OffCase) -> Case:
    """The same run without offload."""
    fields = {f.name: getattr(case, f.name) for f in dataclasses.fields(Case)}
    return Case(**dict(fields, name=case.name + "__base"))


def offloaded(name, model, stage, *, form="ds", ratio=1.0, params=None, **kw) -> OffCase:
    # bf16 runs 10 steps as in test_stages.py (its 0.15 relative-update bound is calibrated there)
    steps = kw.pop("steps", 10 if kw.get("dtype") in ("bf16", "fp16") else 5)
    return OffCase(name, model, stage, form=form, ratio=ratio, params=stage == 3 if params is None else params,
                   steps=steps, **kw)


CLIP = dict(gas=2, clip=0.05)  # clip 0.05 is below every step's norm (asserted below)
W2_OFF = [
    offloaded("s1_fp32_acc2_clip_ds", "mlp_frozen_unused", 1, bucket=500, overlap=True, **CLIP),
    offloaded("s2_fp32_acc2_clip_deprecated", "mlp_frozen_unused", 2, form="deprecated", bucket=700, overlap=True,
              **CLIP),
    offloaded("s3_fp32_acc2_clip_colossal_params", "nested", 3, form="colossal", zero=SIZE, **CLIP),
    offloaded("s1_bf16_colossal", "gpt", 1, form="colossal", dtype="bf16", lr=3e-3, bucket=5000),
    offloaded("s2_bf16_ds", "gpt", 2, dtype="bf16", lr=3e-3, bucket=3000, overlap=True),
    offloaded("s3_bf16_ds_params", "gpt", 3, dtype="bf16", lr=3e-3, zero={"stage3_unit_classes": ["Block"]}),
    offloaded("s3_fp32_acc2_clip_optimizer_only", "gpt", 3, params=False, zero=SIZE, **CLIP),
    offloaded("s2_fp32_acc2_clip_ratio_half", "mlp_frozen_unused", 2, ratio=0.5, bucket=700, overlap=True, **CLIP),
    offloaded("s3_bf16_params_ratio_half", "gpt", 3, ratio=0.5, dtype="bf16", lr=3e-3, zero=SIZE),
    offloaded("s2_fp16_deprecated", "gpt", 2, form="deprecated", dtype="fp16", lr=3e-3,
              fp16={"initial_scale_power": 10}),
]
MEM = dict(dtype="bf16", memory_only=True, bucket=300_000, overlap=True)
MEM3 = {"stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 100}
W2_MEM = [
    offloaded("memory_s2", "mlp_big", 2, **MEM),
    offloaded("memory_s3_params", "mlp_big", 3, zero=MEM3, **MEM),
]
W2 = [c for off in W2_OFF + W2_MEM for c in (off, base_of(off))]
W4_OFF = [
    offloaded("s2_fp32_acc2_clip_ds", "mlp_frozen_unused", 2, bucket=700, overlap=True, **CLIP),
    offloaded("s3_fp32_params_ratio_half", "nested", 3, ratio=0.5, gas=2, zero=SIZE),
    offloaded("s1_bf16_deprecated", "gpt", 1, form="deprecated", dtype="bf16", lr=3e-3, bucket=3000),
]
W4 = [c for off in W4_OFF for c in (off, base_of(off))]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn_cases(W2, 2, tmp_path_factory.mktemp("off_w2"), timeout=300)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return spawn_cases(W4, 4, tmp_path_factory.mktemp("off_w4"), timeout=300)


def assert_same_bits(got: list[dict], want: list[dict]):
    for a, b in zip(got, want):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        for k in b["state"]:
            assert torch.equal(a["state"][k], b["state"][k]), k


def check(case: OffCase, world: int, results, cases):
    per_rank = case_results(results, cases, case.name)
    check_against_reference(case, world, per_rank)
    base = case_results(results, cases, case.name + "__base")
    if case.ratio == 1.0:
        assert_same_bits(per_rank, base)
    for r in per_rank:  # the state really went to the host (ratio 1: none of it stayed on the device)
        mem = r["memory"]
        assert mem["host_exp_avg"] > 0 and mem["host_exp_avg_sq"] > 0
        if case.ratio == 1.0:
            assert mem["master"] == mem["exp_avg"] == mem["exp_avg_sq"] == 0


@pytest.mark.parametrize("case", W2_OFF, ids=lambda c: c.name)
def test_world2_offload_matches_adamw_and_the_device_run(world2, case):
    check(case, 2, world2, W2)


@pytest.mark.parametrize("case", W4_OFF, ids=lambda c: c.name)
def test_world4_offload_matches_adamw_and_the_device_run(world4, case):
    check(case, 4, world4, W4)


def test_world1_offload_matches_adamw_and_the_device_run():
    for case in (offloaded("w1_s2_acc2_clip", "mlp_frozen_unused", 2, bucket=500, overlap=True, **CLIP),
                 offloaded("w1_s3_params_acc2", "gpt", 3, zero=SIZE, steps=4, gas=2)):
        got, base = run_case(case, 0, 1), run_case(base_of(case), 0, 1)
        check_against_reference(case, 1, [got])
        assert_same_bits([got], [base])


def test_clipping_really_clips():
    for case, world in [(c, 2) for c in W2_OFF] + [(c, 4) for c in W4_OFF]:
        if case.clip > 0:
            assert min(reference(case, world)["norms"]) > case.clip, case.name


@pytest.mark.parametrize("world", [2])
def test_memory_moves_to_the_host(world2, world):
    """Optimizer offload: the training device holds 14 bytes per owned parameter less (fp32 master,
    m, v, and the reduced 16-bit gradient slice, given back once it landed on the host: stages 2/3) and
    the host holds them (the landed gradient as ``host_grads``). Parameter offload (stage 3): the device
    holds no parameter bytes between steps, only buckets."""
    for name in ("memory_s2", "memory_s3_params"):
        off = case_results(world2, W2, name)
        base = case_results(world2, W2, name + "__base")
        for o, b in zip(off, base):
            owned = o["padded"] / world  # elements of the owned ranges (padded to the world)
            mo, mb = o["memory"], b["memory"]
            for role in ("master", "exp_avg", "exp_avg_sq"):
                assert mo[role] == 0 and mo["host_" + role] == mb[role]
            assert mo["grads"] == 0 and mb["grads"] == pytest.approx(2 * owned, rel=0.01)
            assert mb["total"] - mo["total"] == pytest.approx(14 * owned + (mb["params"] if "s3" in name else 0),
                                                              rel=0.01)
            assert mo["host_grads"] == pytest.approx(2 * owned, rel=0.01)
            if "s3" in name:
                assert mo["params"] == 0 and mo["gathered"] == 0 and mo["host_params"] == mb["params"]
                assert mo["total"] == mo["grads"] + mo["buckets"]
            assert mo["host_total"] == pytest.approx(14 * owned + (2 * owned if "s3" in name else 0), rel=0.01)


# -- in one process (world 1): the pipeline, overflow, bad input ----------------------------------------
def _train(engine, kind, steps, rows=2, seed=0, dtype=torch.float32, before_step=None):
    losses = []
    for step in range(steps):
        x, y = make_batch(kind, step, rows, seed)
        if before_step is not None:
            before_step(step)
        loss = loss_fn(kind, engine(x.to(dtype) if x.is_floating_point() else x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def deep_model() -> torch.nn.Module:
    """Eight equal units: the host step of the later ones takes long enough to be seen running
    under the forward of the first ones."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh()) for _ in range(8)])


def _train_deep(engine, steps, before_step=None):
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2, 512, generator=g), torch.randn(2, 512, generator=g)
        if before_step is not None:
            before_step(step)
        loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_the_next_forward_overlaps_the_host_step_and_never_reads_stale_parameters():
    """Stage 3, optimizer and parameter offload: the host step of step k runs on the worker while
    step k+1's forward runs; a unit starts only after its own group's step finished, and before
    the last group's did (so the step is not one block in front of the forward). The device copy
    is poisoned with NaN before each host step: a unit reading it early would NaN."""
    cfg = OffCase("pipe", "deep", 3, params=True, dtype="bf16", zero={**SIZE, "sub_group_size": 50_000}).config()
    engine = zerocore.initialize(deep_model(), cfg)
    for shard in engine.offload.shards.values():
        _poison_before_host_step(shard)
    trace = _trace_host_steps(engine.offload.stepper, delay_s=0.02)  # a slow host (timings alone are noise here)
    starts = []
    units = {u.module: u.group.index for u in engine.gatherer.units if u.group is not None}
    # registered after the engine's own pre-forward hook: runs once the unit is gathered, as its forward starts
    for m, gi in units.items():
        m.register_forward_pre_hook(lambda mod, args, gi=gi: starts.append((gi, time.perf_counter())))
    steps = 6
    step_marks = []
    losses = _train_deep(engine, steps, before_step=lambda s: step_marks.append(len(starts)))
    assert all(math.isfinite(v) for v in losses)
    # every step's first forward unit waited for its own update and ran before the last update landed
    overlapped = 0
    for k in range(1, steps):
        fwd = starts[step_marks[k]:step_marks[k] + len(units)]  # this step's forward gathers
        done = {gi: t for gi, t in trace[(k - 1) * len(units):k * len(units)]}
        assert len(done) == len(units)
        first_gi, first_t = fwd[0]
        for gi, t in fwd:
            assert t >= done[gi], f"step {k}: unit of group {gi} ran before its host step finished"
        overlapped += first_t < max(done.values())
        # the worker stepped the groups in the order the forward needs them
        assert [gi for gi, _ in trace[(k - 1) * len(units):k * len(units)]] == [gi for gi, _ in fwd]
    assert overlapped >= steps // 2, f"the forward started before the host step ended in {overlapped} of {steps - 1}"
    # and the result is the plain stage-3 run's, bit for bit
    ref = zerocore.initialize(deep_model(), Case("b", "deep", 3, dtype="bf16",
                                                 zero={**SIZE, "sub_group_size": 50_000}).config())
    assert _train_deep(ref, steps) == losses
    got, want = engine.full_state_dict(), ref.full_state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _poison_before_host_step(shard) -> None:
    """NaN into the device copy of the owned parameters as each step is handed over (the host part
    covers the whole owned range here: ratio 1), so a read before the host step lands would NaN."""
    step = shard.step

    def poisoned(grad, hp, **kw):
        target = shard.group.owned_params_raw()
        if shard.param_swap is None and shard.master_h.data_ptr() != target.data_ptr():
            target[:shard.split].fill_(float("nan"))
        return step(grad, hp, **kw)

    shard.step = poisoned


def _trace_host_steps(stepper, delay_s: float) -> list[tuple[int, float]]:
    """(group index, perf_counter) of every finished host step; each sleeps ``delay_s`` first."""
    trace, submit = [], stepper.submit

    def traced(gi, fn, ready):
        def run():
            time.sleep(delay_s)
            ev = fn()
            trace.append((gi, time.perf_counter()))
            return ev
        submit(gi, run, ready)

    stepper.submit = traced
    return trace


def _host_state(engine):
    for _s in engine.offload.shards.values():
        _s.ready.wait()  # stage 3: the worker may still be stepping
    return [t.clone() for s in engine.offload.shards.values()
            for t in (s.master_h, s.exp_avg_h, s.exp_avg_sq_h, s.master_d, s.exp_avg_d, s.exp_avg_sq_d)]


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_overflow_skips_the_step_and_leaves_the_host_state_alone(stage):
    case = OffCase("ovf", "mlp", stage, dtype="fp16", ratio=0.5, params=stage == 3, zero=SIZE if stage == 3 else {},
                   fp16={"initial_scale_power": 8, "hysteresis": 1})
    engine = zerocore.initialize(make_model("mlp", 0), case.config())
    _train(engine, "mlp", 2, dtype=torch.float16)
    before = _host_state(engine)
    params_before = [p.detach().clone() for p in engine.full_state_dict().values()]
    h = engine.module.out.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    _train(engine, "mlp", 1, dtype=torch.float16)
    h.remove()
    assert engine.skipped_steps == 1 and math.isinf(engine.global_grad_norm) and engine.loss_scale == 128.0
    for a, b in zip(before, _host_state(engine)):
        assert torch.equal(a, b)
    for a, b in zip(params_before, engine.full_state_dict().values()):
        assert torch.equal(a, b)
    _train(engine, "mlp", 1, dtype=torch.float16)  # and training goes on
    assert engine.skipped_steps == 1 and math.isfinite(engine.global_grad_norm)


@pytest.mark.parametrize("cfg,error,named", [
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, ConfigError,
     "zero_optimization.offload_param.device.*needs stage 3"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}}, ConfigError,
     "zero_optimization.offload_optimizer.ratio"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": -0.1}}}, ConfigError,
     "zero_optimization.offload_optimizer.ratio"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "max_in_cpu": 100}, **SIZE}}, ConfigError,
     "zero_optimization.offload_param.max_in_cpu: 100 elements cannot hold"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, ConfigError,
     "zero_optimization.offload_optimizer.device.*stage 1, 2 or 3"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp", "max_in_cpu": 100,
                                                          "buffer_size": 10}, **SIZE}}, ConfigError,
     "zero_optimization.offload_param.buffer_size: 10 elements is smaller than group"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp", "max_in_cpu": 100,
                                                          "buffer_count": 1}, **SIZE}}, ConfigError,
     "zero_optimization.offload_param.buffer_count: 1; parameter shards on NVMe need at least 2"),
])
def test_bad_offload_settings_name_the_key(cfg, error, named):
    with pytest.raises(error, match=named):
        zerocore.initialize(make_model("mlp", 0), cfg)


def test_large_pinned_buffers_come_from_the_page_sized_allocator(monkeypatch):
    """host_memory.host_empty: a page-locked buffer of EXACT_PIN_BYTES or more comes from zerocore's allocator
    sized to the page (torch's pin_memory rounds to a power of two); a smaller or unpinned one from torch; and
    where zerocore's allocator is unavailable (no CUDA extension), torch pins it (not reached here: this CPU
    cannot pin)."""
    from zerocore.offload import host_memory

    asked = []

    class Pool:  # stands in for ops.cuda.PinnedBufferPool(cache=False)
        def empty(self, n, dtype):
            asked.append((n, dtype))
            return torch.full((n,), 7, dtype=dtype)

    monkeypatch.setattr(host_memory, "_exact_pool", Pool())
    big = host_memory.EXACT_PIN_BYTES // 2  # bf16 elements: exactly the threshold
    t = host_memory.host_empty(big, torch.bfloat16, True)
    assert asked == [(big, torch.bfloat16)] and t.numel() == big and bool((t == 7).all())
    assert host_memory.host_zeros(big, torch.bfloat16, True).abs().sum() == 0  # zeros, from the pool too
    assert len(asked) == 2
    host_memory.host_empty(big, torch.bfloat16, False)  # not pinned: plain torch memory
    host_memory.host_empty(big // 2 - 1, torch.float32, False)
    assert len(asked) == 2
    monkeypatch.setattr(host_memory, "_exact_pool", False)  # (unavailable: torch's pin_memory, tried here only
    assert host_memory._exact_pinned(big, torch.bfloat16) is None  # where it would not need CUDA)


def test_cpu_only_machine_uses_plain_host_memory_without_error(caplog):
    engine = zerocore.initialize(make_model("mlp", 0), OffCase("pin", "mlp", 2).config())
    for s in engine.offload.shards.values():
        assert not s.master_h.is_pinned() or torch.cuda.is_available()
    _train(engine, "mlp", 2)
