"""Stage 3's ``engine.compile()`` compiles each unit's forward on its own (FSDP2's recipe): the gather/free hooks
stay eager around the units' graphs, units of one class share one graph, and nothing recompiles from step to
step (issue 35). Counted with Dynamo's own counters (benchmarks/compile_stage3.py's ``DynamoCounts``); the
compiled run trains as the eager one (losses and parameters). World 1, four units of one class.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

import zerocore

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from compile_stage3 import DynamoCounts  # noqa: E402

UNITS = 4
STEPS = 4


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.lin(self.norm(x)))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), *[Block(16) for _ in range(UNITS)], nn.Linear(16, 4))


def config(offload: bool) -> dict:
    z = {"stage": 3, "stage3_unit_classes": ["Block"], "stage3_param_persistence_threshold": 0}
    if offload:
        z.update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    return {"train_micro_batch_size_per_gpu": 4, "zero_optimization": z,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def counted_steps(engine, x, y):
    """STEPS steps on one batch: the losses and Dynamo's counts of each step."""
    counts = DynamoCounts()
    losses, per_step = [], []
    try:
        for _ in range(STEPS):
            counts.clear()
            loss = (engine(x) - y).square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            per_step.append(counts.read())
    finally:
        counts.close()
    return losses, per_step


def train(offload: bool, compiled: bool, backend: str = "inductor"):
    """Losses, final full parameters and Dynamo's counts (first step, each later step)."""
    torch._dynamo.reset()
    model = make_model()
    engine = zerocore.initialize(model, config(offload))
    if compiled:
        engine.compile(backend=backend)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    losses, per_step = counted_steps(engine, x, y)
    params = [t.clone() for t in engine.full_state_dict().values()]
    blocks = [m for m in model if isinstance(m, Block)]
    engine.destroy()
    # the model given back: each block's own forward, every module its own class
    assert all("forward" not in b.__dict__ for b in blocks)
    assert all(type(m) in (nn.Sequential, Block, nn.Linear, nn.LayerNorm) for m in model.modules())
    return losses, params, per_step


def check(offload: bool, backend: str = "inductor") -> None:
    want_losses, want_params, _ = train(offload, compiled=False)
    losses, params, per_step = train(offload, compiled=True, backend=backend)
    first, later = per_step[0], per_step[1:]
    assert first["unique_graphs"] == 1, first  # the four units share their forward's graph
    assert first["graph_breaks"] <= UNITS, first
    assert sum(c["recompiles"] for c in per_step) == 0, [c["recompile_reasons"] for c in per_step]
    assert all(c["frames_compiled"] == 0 and c["graph_breaks"] == 0 for c in later), later
    assert losses == pytest.approx(want_losses, rel=1e-4, abs=1e-6)
    assert losses[-1] < losses[0]
    for got, want in zip(params, want_params):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_stage3_units_compiled_once():
    """Dynamo's graphs, guards and AOT autograd's backward without Inductor's code generation (seconds); the slow
    tests below compile with Inductor."""
    check(offload=False, backend="aot_eager")


def test_stage3_compiled_accumulation_and_eval():
    """Gradient accumulation recompiles nothing; an eval-mode no-grad forward compiles its graph once (Dynamo guards
    the grad mode), and training and eval then alternate without compiling again."""
    torch._dynamo.reset()
    engine = zerocore.initialize(make_model(), {**config(False), "gradient_accumulation_steps": 2})
    engine.compile(backend="aot_eager")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    counts, seen = DynamoCounts(), []
    try:
        for _ in range(2):
            for _ in range(2):  # an optimizer step of two micro-batches
                counts.clear()
                for _ in range(2):
                    engine.backward(engine(x).square().mean())
                    engine.step()
                seen.append(("train", counts.read()))
            counts.clear()
            engine.eval()
            with torch.no_grad():
                engine(x)
            engine.train()
            seen.append(("eval", counts.read()))
    finally:
        counts.close()
        engine.destroy()
    frames = [(what, c["frames_compiled"], c["recompiles"]) for what, c in seen]
    assert frames == [("train", 1, 0), ("train", 0, 0), ("eval", 1, 1), ("train", 0, 0), ("train", 0, 0),
                      ("eval", 0, 0)], [(w, c["recompile_reasons"]) for w, c in seen]
    assert "grad_mode" in seen[2][1]["recompile_reasons"][0]

@pytest.mark.slow
def test_stage3_units_compiled_once_inductor():
    check(offload=False)


@pytest.mark.slow
def test_stage3_units_compiled_once_with_cpu_offload():
    check(offload=True)


@pytest.mark.slow
def test_stage3_compiled_unit_reading_another_units_parameter():
    """NestedNet's head reads the input layer's weight (another unit, sharded then: no prefetch): in the head's
    compiled forward that read calls the gatherer eagerly (one graph break), and the run trains as eager.
    Units of several classes and shapes compile in the first step only."""
    from dist_helpers import NestedNet

    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
            "stage3_unit_classes": ["Middle", "Inner", "Head", "Linear"]}
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        engine = zerocore.initialize(NestedNet(), {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
                                                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
        units = engine.gatherer.compile_units() if compiled else []
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(4, 37, generator=g), torch.randn(4, 11, generator=g)
        losses, per_step = counted_steps(engine, x, y)
        runs.append((losses, [t.clone() for t in engine.full_state_dict().values()], per_step, units))
        engine.destroy()
    (want_losses, want_params, _, _), (losses, params, per_step, units) = runs
    assert "head" in units and "inp" in units and "mids.0" not in units  # Middle holds a unit: eager
    assert 1 <= per_step[0]["graph_breaks"] <= len(units), per_step[0]
    assert all(c["recompiles"] == 0 and c["frames_compiled"] == 0 for c in per_step[1:]), per_step[1:]
    assert losses == pytest.approx(want_losses, rel=1e-4, abs=1e-6)
    for got, want in zip(params, want_params):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def run_world(case, rank: int, world: int) -> dict:
    """One rank of ``case`` (dist_helpers.Case; its name ends in ``compiled``: ``engine.compile()``)."""
    from dist_helpers import loss_fn, make_batch
    from dist_helpers import make_model as make_case_model

    torch._dynamo.reset()
    engine = zerocore.initialize(make_case_model(case.model, case.seed), case.config())
    if case.name.endswith("compiled"):
        engine.compile()
    counts, losses, per_step = DynamoCounts(), [], []
    try:
        for step in range(case.steps):
            x, y = make_batch(case.model, step, case.micro * world, case.seed)
            lo = rank * case.micro
            counts.clear()
            loss = loss_fn(case.model, engine(x[lo:lo + case.micro]), y[lo:lo + case.micro])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            per_step.append(counts.read())
    finally:
        counts.close()
    out = {"losses": losses, "state": engine.full_state_dict(), "dynamo": per_step}
    engine.destroy()
    return out


@pytest.mark.slow
def test_stage3_compiled_units_world2(tmp_path):
    """Two gloo ranks, TinyGPT with a unit per Block, also with every block under activation checkpointing (the
    compiled forward re-run in backward): compiled trains as eager on every rank, nothing recompiles after the
    first step."""
    from dist_helpers import Case, case_results, spawn_cases

    zero = {"stage3_unit_classes": ["Block"], "stage3_param_persistence_threshold": 0}
    cases = [Case(f"{m}_{w}", m, 3, steps=STEPS, zero=zero) for m in ("gpt", "gpt_ckpt") for w in ("eager", "compiled")]
    results = spawn_cases(cases, 2, tmp_path, run=run_world)
    for m in ("gpt", "gpt_ckpt"):
        eager, compiled = case_results(results, cases, f"{m}_eager"), case_results(results, cases, f"{m}_compiled")
        for e, c in zip(eager, compiled):
            assert c["losses"] == pytest.approx(e["losses"], rel=1e-4, abs=1e-6), m
            for k in e["state"]:
                got, want = c["state"][k], e["state"][k]
                if k.endswith("attn.in_proj_bias"):
                    # the key bias's gradient is zero but for rounding (softmax ignores a shift): compiled
                    # kernels round differently, Adam turns either noise into +-lr steps. Query and value only.
                    d = got.numel() // 3
                    got, want = torch.cat([got[:d], got[2 * d:]]), torch.cat([want[:d], want[2 * d:]])
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{m} {k}")
            first, later = c["dynamo"][0], c["dynamo"][1:]
            assert first["unique_graphs"] == 1 and first["graph_breaks"] <= 2, (m, first)  # two Block units, one graph
            assert all(s["recompiles"] == 0 and s["frames_compiled"] == 0 for s in later), (m, later)


def test_unit_compile_turns_inductors_generated_code_checks_off_unless_the_caller_says_otherwise():
    """Each unit's graph runs once per unit per pass: Inductor's size/alignment/scalar checks in its generated code
    are off by default there (5% of a host-bound compiled step); the caller's options win, and a ``mode`` (which
    torch.compile refuses beside options) or another backend is passed through untouched."""
    from zerocore.sharding.gatherer import unit_compile_kwargs

    off = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
    assert unit_compile_kwargs({}) == {"options": off}
    assert unit_compile_kwargs({"backend": "inductor", "dynamic": False}) == {"backend": "inductor", "dynamic": False,
                                                                             "options": off}
    assert unit_compile_kwargs({"options": {"size_asserts": True, "max_autotune": True}}) == {
        "options": {**off, "size_asserts": True, "max_autotune": True}}
    assert unit_compile_kwargs({"mode": "max-autotune"}) == {"mode": "max-autotune"}
    assert unit_compile_kwargs({"backend": "aot_eager"}) == {"backend": "aot_eager"}


def test_unit_compile_passes_its_arguments_to_torch_compile(monkeypatch):
    """What engine.compile() hands torch.compile for the units: the options above, once per unit class."""
    calls = []
    real = torch.compile

    def recording(fn, **kwargs):
        calls.append(kwargs)
        return real(fn, backend="eager")

    monkeypatch.setattr(torch, "compile", recording)
    engine = zerocore.initialize(make_model(), config(False))
    try:
        engine.compile(compile_kwargs={"dynamic": False})
        assert calls == [{"dynamic": False, "options": {"size_asserts": False, "alignment_asserts": False,
                                                         "scalar_asserts": False}}]
    finally:
        engine.destroy()
