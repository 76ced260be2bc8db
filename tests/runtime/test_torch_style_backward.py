"""``loss.backward()`` through an engine (DeepSpeed >= 0.18.3's "torch-style" backward,
``zerocore/runtime/torch_backward.py``) against one-process ``torch.optim.AdamW`` on the same global batches.

On 2 gloo ranks, at stages 0-3 and stages 2/3 with optimizer offload, 2 micro-batches per step, clipping
that bites:
- the model returns a dict holding ``loss`` computed inside from ``logits`` (a Transformers ``ModelOutput``'s
  shape: one output depends on the other, so dividing each output's gradient by the accumulation steps would
  divide twice); one micro-batch calls ``out["loss"].backward()``, the other ``out["logits"].backward(grad)``
  (a non-scalar backward): every tensor's trained value and every step's global gradient norm match;
- the loss computed from ``engine.module(x)`` (no engine output on the path: the reducer's or gatherer's own
  hooks open the backward) matches too at stages 2/3; at stage 1 the window's later micro-batch cannot be
  divided and says so, and nothing is lost.

In one process: fp16 without ``engine.scale(loss)`` raises and changes nothing, with it matches
``engine.backward``; fp16 on ``engine.module(x)`` without it is scaled as it is reduced (a warning; the
gradient norms show the scale, which Adam alone would hide); stage 3 with persistent parameters only, and
activation checkpointing (reentrant or not), match ``engine.backward``; a backward that raises half-way is
undone by the next call into the engine; two engines under one shared loss each match their own AdamW;
``no_sync`` and ``backward twice`` behave as with ``engine.backward``; the output hooks keep no engine alive.
"""
from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import zerocore
from stage3_ranks import LR, MICRO, WD, batch, results, scenarios_of, spawn

D, GAS = 16, 2
CLIP = 0.05  # the global norms here are 0.2-0.5: the clip bites at every step
STEPS = 3
# (stage, optimizer offload, how the loss reaches the engine: through its outputs, or from engine.module(x))
VARIANTS = {"stage0": (0, None, "outputs"), "stage1": (1, None, "outputs"), "stage2": (2, None, "outputs"),
            "stage3": (3, None, "outputs"), "stage2_offload": (2, "cpu", "outputs"),
            "stage3_offload": (3, "cpu", "outputs"), "module_stage2": (2, None, "module"),
            "module_stage3": (3, None, "module")}


class Net(nn.Module):
    """Returns ``{"loss", "logits"}`` when given targets (the loss computed from the logits), else the logits."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 29)
        self.b = nn.Linear(29, 23)
        self.c = nn.Linear(23, D)

    def forward(self, x, y=None):
        logits = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        if y is None:
            return logits
        return {"loss": nn.functional.mse_loss(logits, y), "logits": logits}


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _cfg(stage: int, offload=None, **extra) -> dict:
    z = {"stage": stage, "reduce_bucket_size": 400}  # several flat groups
    if stage == 3:
        z.update(stage3_param_persistence_threshold=0, stage3_unit_min_params=100)
    if offload:
        z["offload_optimizer"] = {"device": offload}
    return {"zero_optimization": z, "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            **extra}


def _micro(step: int, micro: int, rank: int, world: int):
    """This rank's rows of micro-batch ``micro`` of global step ``step``."""
    x, y = batch(step * GAS + micro, MICRO * world, D)
    return x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]


def _train(engine, rank, world, how: str) -> dict:
    norms = []
    for step in range(STEPS):
        for micro in range(GAS):
            x, y = _micro(step, micro, rank, world)
            if how == "outputs":
                out = engine(x, y)
                if micro == 0:
                    out["loss"].backward()
                else:  # non-scalar: d mse / d logits
                    logits = out["logits"]
                    logits.backward(2 * (logits.detach() - y) / logits.numel())
            else:  # "module": no engine output on the path
                nn.functional.mse_loss(engine.module(x), y).backward()
            engine.step()
        norms.append(engine.global_grad_norm)
    return {"params": {k: v.clone() for k, v in engine.full_state_dict().items()}, "norms": norms}


def _scenario(stage, offload, how, rank, world) -> dict:
    engine = zerocore.initialize(_net(), _cfg(stage, offload))
    try:
        return _train(engine, rank, world, how)
    finally:
        engine.destroy()


def sc_module_stage1(rank, world):
    """Stage 1, engine.module(x): the window's first micro-batch is divided exactly; the second is refused
    (its gradients were summed into the first's before the engine saw it), step() refuses the mixed window,
    and after zero_grad() the micro-batch through the engine steps as the reference does."""
    engine = zerocore.initialize(_net(), _cfg(1))
    try:
        x, y = _micro(0, 0, rank, world)
        nn.functional.mse_loss(engine.module(x), y).backward()
        engine.step()
        x, y = _micro(0, 1, rank, world)
        out = {}
        try:
            nn.functional.mse_loss(engine.module(x), y).backward()
        except RuntimeError as e:
            out["refused"] = str(e)
        try:
            engine.step()
        except RuntimeError as e:
            out["step_refused"] = str(e)
        engine.zero_grad()
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        out.update(params=engine.full_state_dict(), norm=engine.global_grad_norm, steps=engine.optimizer_steps)
        return out
    finally:
        engine.destroy()


SCENARIOS = scenarios_of(globals(), _scenario, VARIANTS) + [sc_module_stage1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(SCENARIOS, 2, tmp_path_factory.mktemp("torch_backward"), timeout=400)


def _reference(steps=STEPS, world=2) -> tuple[dict, list[float]]:
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(GAS):
            x, y = batch(step * GAS + micro, MICRO * world, D)
            (nn.functional.mse_loss(model(x), y) / GAS).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    assert min(norms) > 2 * CLIP  # the clip bites
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _close(got: dict, want: dict, what: str) -> None:
    init = _net().state_dict()
    for k, w in want.items():
        moved = (w - init[k]).abs().max()
        assert moved > 1e-3, f"{k} did not train"
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{what}, {k}: {m}")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_loss_backward_trains_as_adamw(ranks, name):
    want, norms = _reference()
    for rank, r in enumerate(results(ranks, name)):
        _close(r["params"], want, f"{name} rank {rank}")
        assert r["norms"] == pytest.approx(norms, rel=1e-5), f"{name} rank {rank}: global gradient norms"


def test_module_call_at_stage1_is_divided_or_refused(ranks):
    model = _net()  # the reference: micro-batch 1 of step 0 only (zero_grad() dropped micro-batch 0), over GAS
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    x, y = batch(1, MICRO * 2, D)
    (nn.functional.mse_loss(model(x), y) / GAS).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    opt.step()
    for r in results(ranks, "module_stage1"):
        assert "cannot be divided by gradient_accumulation_steps" in r["refused"] and "zero_grad()" in r["refused"]
        assert "cannot be restored" in r["step_refused"]
        assert r["steps"] == 1
        _close(r["params"], model.state_dict(), "stage 1 after the refused micro-batch")
        assert r["norm"] == pytest.approx(norm, rel=1e-5)


# -- one process ----------------------------------------------------------------------------------------
def _one(stage=2, gas=GAS, **extra):
    cfg = _cfg(stage, **extra)
    cfg["gradient_accumulation_steps"] = gas
    return zerocore.initialize(_net(), cfg)


FP16 = {"fp16": {"enabled": True, "initial_scale_power": 8}}


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_needs_scale_and_scaled_matches_engine_backward(stage):
    a, b = _one(stage, **FP16), _one(stage, **FP16)
    x, y = batch(0, MICRO, D)
    before = b.full_state_dict()
    with pytest.raises(RuntimeError, match=r"engine.scale\(loss\).backward\(\)"):
        b(x.half(), y.half())["loss"].backward()
    # the loss computed outside the model: at stage 3 the last unit's own hook on the output fires first
    with pytest.raises(RuntimeError, match=r"engine.scale\(loss\).backward\(\)"):
        nn.functional.mse_loss(b(x.half()), y.half()).backward()
    with pytest.raises(RuntimeError, match="without backward"):
        b.step()  # the refused backward left nothing behind
    assert b.loss_scale == 256.0
    assert b.optimizer.needs_scaler()  # DeepSpeed's question, asked of the optimizer
    assert b.optimizer.dynamic_loss_scale and b.optimizer.cur_scale == b.optimizer.loss_scaler.loss_scale == 256.0
    static = _one(stage, fp16={"enabled": True, "loss_scale": 138.0})  # DeepSpeed's TestZeroStaticScale reads these
    assert not static.optimizer.dynamic_loss_scale and static.optimizer.loss_scaler.loss_scale == 138.0
    static.destroy()
    from zerocore.deepspeed.runtime.base_optimizer import ZeROOptimizer
    assert isinstance(b.optimizer, ZeROOptimizer)
    for micro in range(GAS):
        x, y = batch(micro, MICRO, D)
        a.backward(a(x.half(), y.half())["loss"])
        a.step()
        scaled = b.scale(b(x.half(), y.half())["loss"])
        assert scaled.dtype == torch.float32
        scaled.backward()
        b.step()
    assert a.global_grad_norm == pytest.approx(b.global_grad_norm, rel=1e-6)
    got, want = b.full_state_dict(), a.full_state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k
        assert not torch.equal(got[k], before[k]), k
    with pytest.raises(ValueError, match="scalar tensor with grad_fn"):
        b.scale(b(x.half(), y.half())["logits"])
    with pytest.raises(AssertionError, match="scalar tensor"):  # what DeepSpeed's scale() raises
        b.scale(torch.ones(()))
    a.destroy()
    b.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_module_call_without_scale_is_scaled_as_it_is_reduced(stage):
    """engine.module(x) under fp16 without engine.scale(): DeepSpeed reduces such gradients unscaled and still
    divides them by the loss scale; here they are scaled as they are added in (one warning), so the update is
    engine.backward's up to fp16's rounding."""
    a, b = _one(stage, gas=1, **FP16), _one(stage, gas=1, **FP16)
    for step in range(2):
        x, y = batch(step, MICRO, D)
        a.backward(a(x.half(), y.half())["loss"])
        a.step()
        with pytest.warns(RuntimeWarning, match="without engine.scale") if step == 0 else warnings.catch_warnings():
            if step:
                warnings.simplefilter("error", RuntimeWarning)  # once per engine
            nn.functional.mse_loss(b.module(x.half()), y.half()).backward()
        b.step()
        assert b.global_grad_norm == pytest.approx(a.global_grad_norm, rel=2e-3)
    got, want, init = b.full_state_dict(), a.full_state_dict(), _net().state_dict()
    for k in want:
        moved = (want[k] - init[k]).abs().max()
        assert (got[k] - want[k]).abs().max() < 0.05 * moved, k
    a.destroy()
    b.destroy()


def test_stage3_persistent_parameters_only_module_call():
    """Stage 3 where every parameter is persistent (below stage3_param_persistence_threshold: no unit, so no
    gatherer hook) and the loss is computed from engine.module(x): the reducer's own check opens the backward."""
    cfg = _cfg(3)
    del cfg["zero_optimization"]["stage3_param_persistence_threshold"]  # the default: all of Net is persistent
    a, b = zerocore.initialize(_net(), cfg), zerocore.initialize(_net(), cfg)
    assert not any(g.partitioned for g in b.groups)
    for step in range(2):
        for micro in range(GAS):
            x, y = batch(step * GAS + micro, MICRO, D)
            a.backward(a(x, y)["loss"])
            a.step()
            nn.functional.mse_loss(b.module(x), y).backward()
            b.step()
        assert b.global_grad_norm == pytest.approx(a.global_grad_norm, rel=1e-6)
    _same_training(b, a)


def _same_training(got_engine, want_engine) -> None:
    """The two engines' trained weights agree (to fp32 rounding); both are destroyed."""
    got, want = got_engine.full_state_dict(), want_engine.full_state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    got_engine.destroy()
    want_engine.destroy()


class Checkpointed(Net):
    """Net with its first layer under activation checkpointing (reentrant: a backward inside the backward)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x, y=None):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=self.reentrant)
        logits = self.c(torch.tanh(self.b(h)))
        return {"loss": nn.functional.mse_loss(logits, y), "logits": logits}


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_activation_checkpointing(stage, reentrant):
    """A checkpointed block re-runs its forward inside the backward (with use_reentrant, under a backward of its
    own): loss.backward() trains as engine.backward does."""
    cfg = _cfg(stage)
    engines = []
    for _ in range(2):
        torch.manual_seed(0)
        engines.append(zerocore.initialize(Checkpointed(reentrant), cfg))
    a, b = engines
    for step in range(2):
        for micro in range(GAS):
            x, y = batch(step * GAS + micro, MICRO, D)
            x = x.requires_grad_(reentrant)  # (reentrant checkpointing needs an input that requires grad)
            a.backward(a(x, y)["loss"])
            a.step()
            b(x, y)["loss"].backward()
            b.step()
        assert b.global_grad_norm == pytest.approx(a.global_grad_norm, rel=1e-6)
    _same_training(b, a)


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_backward_that_raises_is_undone_by_the_next_call(stage):
    """Micro-batch 1's backward raises after the engine opened it (stages 0/1: after every other gradient
    landed; stages 2/3: before a reduction, since one added into the window cannot be taken out, as with
    engine.backward): its queued finish never runs; the next forward finds it open and aborts it, so redoing
    the micro-batch steps as the reference does."""
    engine, ref = _one(stage), _one(stage)
    for micro in range(GAS):
        x, y = batch(micro, MICRO, D)
        ref.backward(ref(x, y)["loss"])
        ref.step()
    x, y = batch(0, MICRO, D)
    engine(x, y)["loss"].backward()
    engine.step()
    x, y = batch(1, MICRO, D)
    out = engine(x, y)

    def boom(_):
        raise Boom("a failure inside backward")
    where = engine.module.a.weight if stage <= 1 else out["logits"]
    h = where.register_hook(boom)
    with pytest.raises(Boom):
        out["loss"].backward()
    h.remove()
    engine(x, y)["loss"].backward()  # the next forward aborted the failed backward first
    engine.step()
    assert engine.optimizer_steps == 1
    assert engine.global_grad_norm == pytest.approx(ref.global_grad_norm, rel=1e-6)
    _same_training(engine, ref)


def _trained_as_references(*pairs) -> None:
    """Each (engine, reference model) pair holds the same weights; the engines are destroyed."""
    for e, r in pairs:
        got = e.full_state_dict()
        for k, w in r.state_dict().items():
            torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
        e.destroy()


def test_two_engines_under_one_loss():
    """DeepSpeed's test_multiple_models with a shared loss: one loss over two engines' outputs, one backward;
    each engine matches its own AdamW (DeepSpeed < 0.18.3 scripts call ``_backward_epilogue()`` after it: a no-op)."""
    e1, e2 = _one(2, gas=1), _one(1, gas=1)
    r1, r2 = _net(), _net()
    o1 = torch.optim.AdamW(r1.parameters(), lr=LR, weight_decay=WD)
    o2 = torch.optim.AdamW(r2.parameters(), lr=LR, weight_decay=WD)
    for step in range(2):
        x, y = batch(step, MICRO, D)
        (e1(x, y)["loss"] + e2(x, y)["loss"] / 2).backward()
        e1._backward_epilogue()
        e2._backward_epilogue()
        e1.step()
        e2.step()
        for o in (o1, o2):
            o.zero_grad()
        (nn.functional.mse_loss(r1(x), y) + nn.functional.mse_loss(r2(x), y) / 2).backward()
        for e, r, o in ((e1, r1, o1), (e2, r2, o2)):
            norm = float(torch.nn.utils.clip_grad_norm_(r.parameters(), CLIP))
            assert e.global_grad_norm == pytest.approx(norm, rel=1e-5)
            o.step()
    _trained_as_references((e1, r1), (e2, r2))


def test_engine_backward_on_a_loss_through_two_engines():
    """e1.backward(loss) where the loss also went through e2 (each with its own accumulation steps): e1 divides the
    loss by its steps; e2's backward, opened by its outputs, takes that back out and divides by its own."""
    e1, e2 = _one(2, gas=2), _one(3, gas=3)
    r1, r2 = _net(), _net()
    o1 = torch.optim.AdamW(r1.parameters(), lr=LR, weight_decay=WD)
    o2 = torch.optim.AdamW(r2.parameters(), lr=LR, weight_decay=WD)
    for micro in range(6):  # e1 steps at micro 1, 3, 5; e2 at 2, 5
        x, y = batch(micro, MICRO, D)
        e1.backward(e1(x, y)["loss"] + e2(x, y)["loss"])
        e1.step()
        e2.step()
        (nn.functional.mse_loss(r1(x), y) / 2).backward()
        (nn.functional.mse_loss(r2(x), y) / 3).backward()
        for e, r, o, gas in ((e1, r1, o1, 2), (e2, r2, o2, 3)):
            if micro % gas == gas - 1:  # (the norms show a wrong gradient scale, which clipping and Adam hide)
                norm = float(torch.nn.utils.clip_grad_norm_(r.parameters(), CLIP))
                assert e.global_grad_norm == pytest.approx(norm, rel=1e-5), (micro, gas)
                o.step()
                o.zero_grad()
    _trained_as_references((e1, r1), (e2, r2))


def test_no_sync_and_twice_without_step():
    engine = _one(1, gas=1)
    assert not engine.optimizer.needs_scaler()  # fp32: a plain loss.backward() is enough
    x, y = batch(0, MICRO, D)
    with engine.no_sync():
        engine(x, y)["loss"].backward()
    engine(x, y)["loss"].backward()
    with pytest.raises(RuntimeError, match="called twice without step"):
        engine(x, y)["loss"].backward()
    engine.step()
    assert engine.optimizer_steps == 1
    engine.destroy()


def test_outputs_keep_no_engine_alive():
    """Freed by reference counting while the user keeps the hooked outputs (no cycle for the collector)."""
    gc.collect()
    gc.disable()
    try:
        engine = _one(2, gas=1)
        x, y = batch(0, MICRO, D)
        out = engine(x, y)  # its tensors carry the engine's hook
        ref = weakref.ref(engine)
        engine.destroy()
        del engine
        assert ref() is None, "the output hook kept the engine alive"
    finally:
        gc.enable()
    assert out["loss"].requires_grad
