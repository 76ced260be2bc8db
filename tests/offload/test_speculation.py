"""offload_optimizer.speculative_step (zerocore/offload/speculation.py): stages 1/2's host Adam started while
the backward runs, kept at step() when it is the update asked for, else dropped. Whatever happens, the
training is bit for bit the training without it: the out-of-place kernel against the in-place one, and
engines with and without speculation side by side through clipping that bites on some steps and not on
others, an lr schedule, gradient accumulation, a skipped Inf step and a checkpoint load between backward and
step."""
from __future__ import annotations

import warnings

import pytest
import torch

import zerocore
from zerocore import ops
from zerocore.config.options import ConfigError
from zerocore.offload import speculation
from zerocore.offload.host_batch import HostStepBatch


# -- the out-of-place kernel ---------------------------------------------------------------------------
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("with_out", [False, True])
def test_out_of_place_adam_writes_the_in_place_bits_and_leaves_the_sources(gdtype, adamw, with_out):
    g = torch.Generator().manual_seed(3)
    sizes = [1, 17, 1000, 4099, 65537]  # odd sizes: vector tails, several chunks
    src = [tuple(torch.randn(n, generator=g) * s for s in (1.0, 0.1, 0.0)) for n in sizes]
    src = [(p, m, v.abs() + torch.rand(v.shape, generator=g) * 1e-3) for p, m, v in src]
    grads = [torch.randn(n, generator=g).to(gdtype) for n in sizes]
    kw = dict(steps=[3] * len(sizes), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, adamw_mode=adamw,
              grad_scale=0.5)
    # in place on copies
    ref = [tuple(t.clone() for t in s) for s in src]
    ref_out = [torch.empty(n, dtype=torch.bfloat16) for n in sizes] if with_out else None
    ops.adam_step_multi([r[0] for r in ref], grads, [r[1] for r in ref], [r[2] for r in ref], param_outs=ref_out, **kw)
    # out of place
    keep = [tuple(t.clone() for t in s) for s in src]
    dst = [tuple(torch.full_like(t, float("nan")) for t in s) for s in src]
    out = [torch.empty(n, dtype=torch.bfloat16) for n in sizes] if with_out else None
    ops.adam_step_multi([d[0] for d in dst], grads, [d[1] for d in dst], [d[2] for d in dst], param_outs=out,
                        sources=([s[0] for s in src], [s[1] for s in src], [s[2] for s in src]), **kw)
    for r, d, s, k in zip(ref, dst, src, keep):
        for a, b in zip(r, d):
            assert torch.equal(a, b)
        for a, b in zip(s, k):  # the sources as they were
            assert torch.equal(a, b)
    if with_out:
        for a, b in zip(ref_out, out):
            assert torch.equal(a, b)


@pytest.mark.parametrize("kernel_isa", ops.supported_isas())
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offsets", [(0, 0, 0, 0), (3, 3, 3, 3), (0, 5, 0, 0), (1, 1, 1, 2)])
def test_out_of_place_adam_streams_long_spans_with_the_same_bits(kernel_isa, out_dtype, offsets):
    """Long out-of-place spans write with streaming stores where the destinations share the master's
    alignment (adam_range): destination views at offsets that align them all, some, or none the same way
    (then the ordinary stores), each against the in-place step's bits, on every ISA this CPU runs."""
    g = torch.Generator().manual_seed(5)
    n = 300_007  # > kStreamMinElems per thread chunk, an odd tail
    p0, m0 = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
    v0 = torch.rand(n, generator=g) * 1e-2
    grad = torch.randn(n, generator=g).bfloat16()
    kw = dict(steps=[7], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw_mode=True, grad_scale=0.25)

    def view(off, dtype=torch.float32):  # n elements starting `off` elements into a fresh buffer
        return torch.full((n + 16,), float("nan"), dtype=dtype)[off:off + n]

    with ops.force_isa(kernel_isa):
        ref = [t.clone() for t in (p0, m0, v0)]
        ref_out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
        ops.adam_step_multi([ref[0]], [grad], [ref[1]], [ref[2]], param_outs=None if ref_out is None else [ref_out], **kw)
        dst = [view(off) for off in offsets[:3]]
        out = None if out_dtype is None else view(offsets[3], out_dtype)
        ops.adam_step_multi([dst[0]], [grad], [dst[1]], [dst[2]], param_outs=None if out is None else [out],
                            sources=([p0], [m0], [v0]), **kw)
    for a, b in zip(ref, dst):
        assert torch.equal(a, b)
    if out is not None:
        assert torch.equal(ref_out, out)


def test_out_of_place_adam_refuses_sources_it_cannot_use():
    p, m, v, gr = (torch.zeros(8) for _ in range(4))
    kw = dict(steps=[1], lr=1e-3)
    with pytest.raises(ValueError, match="source params has 2 tensors"):
        ops.adam_step_multi([p], [gr], [m], [v], sources=([p, p], [m], [v]), **kw)
    with pytest.raises(ValueError, match="source exp_avgs"):  # a size that does not match
        ops.adam_step_multi([p], [gr], [m], [v], sources=([torch.zeros(8)], [torch.zeros(7)], [torch.zeros(8)]), **kw)
    with pytest.raises(ValueError, match="overlap|share"):  # a source that is a destination
        ops.adam_step_multi([p], [gr], [m], [v], sources=([torch.zeros(8)], [m], [torch.zeros(8)]), **kw)
    with pytest.raises(TypeError, match="three lists"):
        ops.adam_step_multi([p], [gr], [m], [v], sources=[p], **kw)


# -- the engine ----------------------------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 4))


def _engine(spec: bool, *, stage=2, bf16=True, clip=2.0, gas=1, scheduler=False, check=False, **zero):
    z = {"stage": stage, "reduce_bucket_size": 2048,
         "offload_optimizer": {"device": "cpu", "speculative_step": spec}, **zero}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "zero_optimization": z, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    if bf16:
        cfg["bf16"] = {"enabled": True, "check_grad_overflow": check}  # check: skip an Inf/NaN update
    if scheduler:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                            "warmup_num_steps": 5}}
    return zerocore.initialize(_model(), cfg)


def _speculations(engine):
    """Each batch's speculation (stages 1/2, stage 3's whole-kept groups) and each stage-3 unit's."""
    return list(engine._speculations)


def _run(engine, steps, *, gas=1, scale=1.0, bad_at=None, between=None):
    g = torch.Generator().manual_seed(1)
    dtype = next(engine.module.parameters()).dtype
    norms = []
    for k in range(steps * gas):
        x, y = torch.randn(4, 32, generator=g, dtype=dtype), torch.randn(4, 4, generator=g)
        loss = (engine(x).float() * (scale if k % 2 else 1.0) - y).square().mean()
        if bad_at == k:
            loss = loss * float("inf")
        engine.backward(loss)
        if between is not None:
            between(engine, k)
        _drain(engine)
        engine.step()
        if (k + 1) % gas == 0:
            norms.append(float(engine.get_global_grad_norm()))
    return norms


def _drain(engine):
    """Lets the worker run what is queued (the speculations) before step(). On this CPU a tiny model's
    backward can end before the worker thread gets the GIL, and stage 3's step() would then withdraw every
    speculation (test_stage3_withdraws_...): the tests of kept and dropped speculations make them run."""
    if engine._speculations:
        from zerocore.offload.stepper import Ready

        done = Ready()
        engine.offload.stepper.submit(0, lambda: None, done)  # one worker, in submission order
        done.wait()


def _params(engine):
    return [p.detach().clone() for p in engine.module.parameters()]


@pytest.fixture
def worker(monkeypatch):
    """A worker thread steps the host shards on this CPU device (on a GPU there always is one); batches of
    about two groups, so that several speculate, each starting as its own gradients land."""
    monkeypatch.setenv("ZEROCORE_HOST_STEP_THREADS", "1")
    monkeypatch.setattr(speculation, "SPECULATIVE_BATCH_ELEMS", 4096)


@pytest.mark.parametrize("stage, param_offload", [(1, False), (2, False), (3, False), (3, True)])
@pytest.mark.parametrize("bf16", [True, False])
def test_speculation_trains_the_same_bits_as_without(worker, stage, param_offload, bf16):
    extra = {"stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 100} if stage == 3 else {}
    if param_offload:
        extra["offload_param"] = {"device": "cpu"}
    if not bf16:  # fp32 on a CPU device: the master is the parameter, which the speculation may not write
        with pytest.warns(UserWarning, match=r"speculative_step \(DeepSpeed: super_offload\) is set but no host step"):
            e = _engine(True, stage=stage, bf16=False, **extra)
        e.destroy()
        return
    runs = {}
    for spec in (False, True):
        e = _engine(spec, stage=stage, scheduler=True, **extra)
        try:
            # every other step's loss scaled up so that the clip bites there and not on the others
            norms = _run(e, 8, scale=6.0)
            runs[spec] = (norms, _params(e), _speculations(e))
        finally:
            e.destroy()
    (n0, p0, _), (n1, p1, specs) = runs[False], runs[True]
    assert n0 == n1
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)
    assert len(specs) > 1, "several batches should speculate"
    kept = sum(s.kept for s in specs)
    dropped = sum(s.dropped for s in specs)
    assert kept > 0 and dropped > 0, (kept, dropped)  # both paths ran
    assert any(n > 2.0 for n in n0) and any(n < 2.0 for n in n0), n0  # the clip bit on some steps only


STAGE3 = {"stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 100}


@pytest.mark.parametrize("stage", [2, 3])
def test_speculation_with_accumulation_a_skipped_step_and_a_load_between_backward_and_step(worker, tmp_path, stage):
    saved = {}

    def between(engine, k):
        if k == 3 and engine.is_gradient_accumulation_boundary():
            engine.save_checkpoint(str(tmp_path / f"c{id(engine)}"), tag="t")
            saved[id(engine)] = True
        if k == 7:  # a load between a boundary's backward and its step: the speculation read the old state
            engine.load_checkpoint(str(tmp_path / f"c{id(engine)}"), tag="t", load_module_only=False)

    runs = {}
    for spec in (False, True):
        e = _engine(spec, gas=2, clip=0.0, check=True, stage=stage, **(STAGE3 if stage == 3 else {}))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the skipped step's warning
                norms = _run(e, 6, gas=2, bad_at=5, between=between)
            runs[spec] = (norms, _params(e), e.skipped_steps, _speculations(e))
        finally:
            e.destroy()
    (n0, p0, s0, _), (n1, p1, s1, specs) = runs[False], runs[True]
    assert s0 == s1  # (the load at micro-step 7 restored the count saved before the skip)
    assert n0 == n1 and n0[2] == float("inf"), n0  # micro-step 5's boundary was skipped
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)
    assert sum(s.kept for s in specs) > 0 and sum(s.dropped for s in specs) >= 2  # the skip and the load


def test_stage3_withdraws_speculations_not_started_by_step_and_steps_those_units_in_forward_order(worker):
    """Stage 3: a unit's speculation the worker has not started when step() queues the unit's step is
    withdrawn (else it would run first and hold back the next forward's first units, whose gradients land
    last); that unit takes its own host step instead. On alternate steps the worker is held busy through the
    backward, so every speculation of that step is still queued at step(): all withdrawn, the same bits."""
    import threading

    from zerocore.offload.stepper import Ready

    runs = {}
    for spec in (False, True):
        e = _engine(spec, stage=3, clip=0.0, **STAGE3)
        g = torch.Generator().manual_seed(1)
        try:
            for k in range(6):
                x, y = torch.randn(4, 32, generator=g, dtype=torch.bfloat16), torch.randn(4, 4, generator=g)
                loss = (e(x).float() - y).square().mean()
                gate = threading.Event()
                if k % 2:  # the worker busy until after step(): nothing of this backward's speculation starts
                    e.offload.stepper.submit(0, gate.wait, Ready())
                e.backward(loss)
                if not k % 2:
                    _drain(e)  # every speculation has run: kept
                e.step()
                gate.set()
            runs[spec] = (_params(e), _speculations(e))
        finally:
            e.destroy()
    (p0, _), (p1, specs) = runs[False], runs[True]
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)
    assert len(specs) > 1
    withdrawn, kept = sum(s.withdrawn for s in specs), sum(s.kept for s in specs)
    assert withdrawn == 3 * len(specs), (withdrawn, kept)  # every unit on each of the 3 held steps
    assert kept == 3 * len(specs) and sum(s.dropped for s in specs) == 0  # and kept on the others


def test_speculation_refuses_what_it_cannot_serve(tmp_path):
    with pytest.raises(ConfigError,
                       match=r"speculative_step \(DeepSpeed: super_offload\): not with offload_param.device 'nvme'"):
        _engine(True, stage=3, stage3_param_persistence_threshold=0,
                offload_param={"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 1})


@pytest.mark.parametrize("stage, zero", [(2, {}), (3, {"offload_param": {"device": "cpu"}})])
def test_the_second_state_is_held_counted_and_predicted(worker, stage, zero):
    """12 bytes per owned parameter more host memory (the spare master, m, v; and the spare 16-bit output on a
    CPU device): in the engine's held bytes by role, and in the planner's prediction of them."""
    from zerocore.demo import TinyGPT

    def meta():
        with torch.device("meta"):
            return TinyGPT(512, 64, 2, heads=4, ctx=32)

    reps = {}
    for spec in (False, True):
        torch.manual_seed(0)
        cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "speculative_step": spec},
                                     **zero}}
        engine = zerocore.initialize(TinyGPT(512, 64, 2, heads=4, ctx=32), cfg)
        try:
            rep = engine.memory_report(predicted=True, micro_batch=2, seq_len=32, meta_model=meta())
            for role, value in rep["predicted"].items():
                assert value == rep[role], (spec, role)
            reps[spec] = rep
            owned = sum(g.hi - g.lo for g in engine.groups)
        finally:
            engine.destroy()
    spare = sum(reps[True][r] for r in ("host_spare_master", "host_spare_exp_avg", "host_spare_exp_avg_sq"))
    assert spare >= 12 * owned  # (padded shards: at least)
    assert reps[True]["host_spare_out"] >= 2 * owned  # bf16 on a CPU device: its own 16-bit output
    assert reps[False]["host_spare_master"] == 0
    assert reps[True]["host_total"] - reps[False]["host_total"] == spare + reps[True]["host_spare_out"]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_clip_that_bites_every_step_stops_the_speculation_and_one_that_stops_biting_brings_it_back(worker, stage):
    def train(engine, steps, mult):
        g = torch.Generator().manual_seed(2)
        for _ in range(steps):
            x, y = torch.randn(4, 32, generator=g, dtype=torch.bfloat16), torch.randn(4, 4, generator=g)
            engine.backward((engine(x).float() - y).square().mean() * mult)
            _drain(engine)
            engine.step()

    runs = {}
    for spec in (False, True):
        e = _engine(spec, clip=1e-3, stage=stage, **(STAGE3 if stage == 3 else {}))
        try:
            train(e, 8, 1.0)  # the clip bites on every step
            specs = _speculations(e)
            early = (sum(s.kept for s in specs), sum(s.dropped for s in specs))
            train(e, 6, 1e-6)  # gradients far below the clip: the guess holds from now on
            runs[spec] = (_params(e), early, sum(s.kept for s in specs), len(specs))
        finally:
            e.destroy()
    (p0, *_), (p1, (kept_early, dropped), kept, batches) = runs[False], runs[True]
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)
    assert kept_early == 0
    assert dropped == batches  # the first wrong guess dropped each batch's once; then no more speculation
    assert kept > 0  # back once the guesses held


def test_deepspeeds_super_offload_config_runs_as_the_speculative_step(worker):
    """A DeepSpeed script's config with ``super_offload: true`` (DeepSpeed: stage 3 on CUDA only) through
    ``zerocore.deepspeed.initialize``: the units speculate, and the training is the bits of the same config
    without it (DeepSpeed's own SuperOffload computes its usual step when nothing overflows)."""
    import zerocore.deepspeed as deepspeed

    runs = {}
    for super_offload in (False, True):
        cfg = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "gradient_clipping": 2.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
               "zero_optimization": {"stage": 3, **STAGE3, "offload_optimizer": {
                   "device": "cpu", "super_offload": super_offload, "cpuadam_cores_perc": 0.8}}}
        engine, *_ = deepspeed.initialize(model=_model(), config=cfg)
        try:
            norms = _run(engine, 6, scale=6.0)
            runs[super_offload] = (norms, _params(engine), _speculations(engine))
        finally:
            engine.destroy()
    assert runs[False][0] == runs[True][0]
    for a, b in zip(runs[False][1], runs[True][1]):
        assert torch.equal(a, b)
    assert not runs[False][2] and sum(s.kept for s in runs[True][2]) > 0


# -- two gloo ranks --------------------------------------------------------------------------------------
def _w2_cases():
    from dist_helpers import Case

    out = []
    for stage, extra in ((1, {}), (2, {}), (3, {**STAGE3, "offload_param": {"device": "cpu"}})):
        for spec in (False, True):
            out.append(Case(f"s{stage}_{'spec' if spec else 'base'}", "gpt", stage, steps=6, gas=2, clip=1.0,
                            dtype="bf16", lr=3e-3, bucket=3000, overlap=True,
                            zero={"offload_optimizer": {"device": "cpu", "speculative_step": spec}, **extra}))
    return out


def _run_with_worker(case, rank: int, world: int) -> dict:
    """dist_helpers.run_case with a host-step worker on this CPU rank (stages 1/2 speculate on one), and
    the counts of kept and dropped speculations."""
    import os

    import dist_helpers

    os.environ["ZEROCORE_HOST_STEP_THREADS"] = "1"
    engines = []
    real = zerocore.initialize

    def initialize(*a, **kw):
        engine = real(*a, **kw)
        engines.append(engine)
        return engine

    dist_helpers.zerocore.initialize = initialize
    try:
        out = dist_helpers.run_case(case, rank, world)
    finally:
        dist_helpers.zerocore.initialize = real
    out["kept_dropped"] = [(s.kept, s.dropped) for s in engines[0]._speculations] if engines else []
    return out


def test_two_ranks_train_the_same_bits_with_and_without_speculation(tmp_path):
    """Every rank decides alone (the guess is checked against the global clip coefficient each rank computed
    from the same all-reduced norm), so the ranks keep and drop together and the all-gathers after the update
    (stages 1/2) carry the same values as without speculation."""
    from dist_helpers import case_results, spawn_cases

    cases = _w2_cases()
    results = spawn_cases(cases, 2, tmp_path, timeout=300, run=_run_with_worker)
    for stage in (1, 2, 3):
        base = case_results(results, cases, f"s{stage}_base")
        spec = case_results(results, cases, f"s{stage}_spec")
        for a, b in zip(spec, base):
            assert a["losses"] == b["losses"] and a["norms"] == b["norms"], stage
            for k in b["state"]:
                assert torch.equal(a["state"][k], b["state"][k]), (stage, k)
        per_rank = [sorted(r["kept_dropped"]) for r in spec]
        assert per_rank[0] == per_rank[1], per_rank  # the ranks kept and dropped the same steps
        assert sum(k for k, _ in per_rank[0]) > 0, (stage, per_rank)
