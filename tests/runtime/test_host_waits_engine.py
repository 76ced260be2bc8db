"""The engine under zerocore.debug.host_waits: ZEROCORE_DEBUG_HOST_WAITS=count|raise and the waits of
a steady-state step (issue 35).

The engine runs on this machine's CPU, and the mode counts its own CPU tensors as device tensors
(``device=engine.device``): an ``.item()`` of the engine's own tensors is where the same engine on a
GPU waits. Targets, per step after two warm-up steps: 0 at stages 0-3 with bf16 and clipping,
gradient accumulation, CPU optimizer offload, stage-3 parameter offload; at most 1 per boundary with
fp16 (the overflow decision, as torch's GradScaler). And the training result is the same bits with
the mode on as off.
"""
from __future__ import annotations

import math

import pytest
import torch

import zerocore
from dist_helpers import DTYPES, Case, case_results, loss_fn, make_batch, make_model, spawn_cases
from zerocore.debug import HostWaitError

ENV = "ZEROCORE_DEBUG_HOST_WAITS"


class Chatty(torch.nn.Module):
    """A model whose forward reads a value on the host (a user's wait the engine's count shows)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 1e9:  # the model's own wait
            y = y * 0
        return y


def _cfg(**kw) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **kw}


def test_count_mode_keeps_each_windows_waits_with_their_call_sites(monkeypatch):
    monkeypatch.setenv(ENV, "count")
    torch.manual_seed(0)
    e = zerocore.initialize(Chatty(), _cfg(gradient_accumulation_steps=2))
    assert e.host_waits_last_step is None
    for step in range(2):
        for _ in range(2):
            e.backward(e(torch.randn(2, 4)).pow(2).mean())
            e.step()
        log = e.host_waits_last_step
        assert log.count == 2, str(log)  # one per micro-batch's forward
        assert all(w.kind == "item" and w.site.endswith("in forward") and "test_host_waits_engine.py" in w.site
                   for w in log.waits)
    e.destroy()


def test_raise_mode_raises_at_the_wait(monkeypatch):
    monkeypatch.setenv(ENV, "raise")
    e = zerocore.initialize(Chatty(), _cfg())
    with pytest.raises(HostWaitError, match=r"test_host_waits_engine.py:\d+ in forward"):
        e(torch.randn(2, 4))
    e.destroy()


def test_unset_wraps_nothing(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    e = zerocore.initialize(Chatty(), _cfg())
    assert not {"forward", "backward", "step"} & e.__dict__.keys() and e.host_waits_last_step is None
    e.destroy()
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(ValueError, match="ZEROCORE_DEBUG_HOST_WAITS='sometimes': expected one of count, raise"):
        zerocore.initialize(Chatty(), _cfg())


# -- a steady-state step waits for nothing (world 1) ---------------------------------------------------
WARMUP, STEPS = 2, 4
CPU_OPT = {"offload_optimizer": {"device": "cpu"}}
SCENARIOS = {  # name: (stages, Case keywords, zero_optimization additions)
    "bf16_clip": ((0, 1, 2, 3), dict(dtype="bf16", clip=0.05), {}),
    "fp32_clip_gas2": ((0, 1, 2, 3), dict(clip=0.05, gas=2), {}),
    "bf16_clip_cpu_offload": ((1, 2, 3), dict(dtype="bf16", clip=0.05), CPU_OPT),
    # the host step started during the backward (kept where the clip does not bite), on the worker thread
    "bf16_clip_cpu_offload_speculative": ((1, 2, 3), dict(dtype="bf16", clip=50.0),
                                          {"offload_optimizer": {"device": "cpu", "speculative_step": True}}),
    "bf16_clip_param_offload": ((3,), dict(dtype="bf16", clip=0.05, model="gpt"),
                                {"offload_param": {"device": "cpu"}}),
    "bf16_clip_param_and_cpu_offload": ((3,), dict(dtype="bf16", clip=0.05, gas=2),
                                        {"offload_param": {"device": "cpu"}, **CPU_OPT}),
    "fp16_dynamic": ((0, 1, 2, 3), dict(dtype="fp16", clip=0.05), {}),
    "fp16_dynamic_cpu_offload": ((2,), dict(dtype="fp16", clip=0.05), CPU_OPT),
    "bf16_clip_check_grad_overflow": ((1, 3), dict(dtype="bf16", clip=0.05), {}),
}
# one read per boundary: fp16's skip decision (its loss scale needs it). bf16's check (DeepSpeed's default) is decided
# on the device and read a step later, when its event is complete (runtime/deferred_skip.py): no wait in the step
READS_OVERFLOW = {"fp16_dynamic"}
CASES = [(name, stage) for name, (stages, _, _) in SCENARIOS.items() for stage in stages]


def config(case: Case) -> dict:
    """bf16 checks its gradients for Inf/NaN by default (DeepSpeed's default: one read per boundary); the
    scenarios without that read say ``check_grad_overflow: false``."""
    cfg = case.config()
    if "bf16" in cfg and not case.name.endswith("check_grad_overflow"):
        cfg["bf16"]["check_grad_overflow"] = False
    return cfg


def train(name: str, stage: int, monkeypatch, mode: str | None, inf_at: int | None = None) -> dict:
    """STEPS optimizer steps of scenario ``name``; each boundary's wait log when ``mode`` is set.
    ``inf_at``: an Inf in one gradient element at that step."""
    _, kw, zero = SCENARIOS[name]
    kw = dict(kw)
    case = Case(name, kw.pop("model", "mlp"), stage, zero=zero, **kw)
    if zero.get("offload_optimizer", {}).get("speculative_step"):  # needs the worker thread (a GPU has one)
        monkeypatch.setenv("ZEROCORE_HOST_STEP_THREADS", "1")
    if mode is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, mode)
    engine = zerocore.initialize(make_model(case.model, 0), config(case))
    dtype, out = DTYPES[case.dtype], {"logs": [], "norms": [], "losses": [], "skipped": []}
    for step in range(STEPS):
        x, y = make_batch(case.model, step, case.micro * case.gas, 0)
        for k in range(case.gas):
            xb, yb = x[k * case.micro:(k + 1) * case.micro], y[k * case.micro:(k + 1) * case.micro]
            loss = loss_fn(case.model, engine(xb.to(dtype) if xb.is_floating_point() else xb), yb)
            hook = None
            if step == inf_at:
                hook = engine.module.out.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
            engine.backward(loss)
            if hook is not None:
                hook.remove()
            engine.step()
            out["losses"].append(loss.item())
        out["logs"].append(engine.host_waits_last_step)
        out["norms"].append(engine.global_grad_norm)  # read lazily, here: the user's wait, not the step's
        out["skipped"].append(engine.skipped_steps)
    out["state"] = engine.full_state_dict()
    engine.destroy()
    return out


@pytest.mark.parametrize("name, stage", CASES, ids=[f"{n}-stage{s}" for n, s in CASES])
def test_steady_state_steps_wait_for_nothing_and_train_the_same(name, stage, monkeypatch):
    on = train(name, stage, monkeypatch, "count")
    steady = on["logs"][WARMUP:]
    if name in READS_OVERFLOW:  # the overflow decision: one read per boundary, in the step (GradScaler's)
        for log in steady:
            assert log.count == 1, str(log)
            # (the boundary's coefficient, computed for step(): zerocore/runtime/update_coef.py)
            assert all(w.site.endswith(" in boundary_coef") and "update_coef.py" in w.site for w in log.waits), str(log)
    else:  # fp16 with offload included: the overflow flag is host data there
        assert [log.count for log in steady] == [0] * len(steady), "\n".join(map(str, steady))
    assert all(not log.events for log in steady)  # a CPU device records no events
    off = train(name, stage, monkeypatch, None)
    assert on["losses"] == off["losses"] and on["norms"] == off["norms"]
    assert all(torch.equal(on["state"][k], off["state"][k]) for k in off["state"])


def table() -> str:
    """The counts per steady-state step (``python tests/runtime/test_host_waits_engine.py``)."""
    mp = pytest.MonkeyPatch()
    rows = ["| scenario | stage | waits per steady step | event waits |", "|---|---|---|---|"]
    try:
        for name, stage in CASES:
            logs = train(name, stage, mp, "count")["logs"][WARMUP:]
            rows.append(f"| {name} | {stage} | {max(log.count for log in logs)} | "
                        f"{max(len(log.events) for log in logs)} |")
    finally:
        mp.undo()
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())


@pytest.mark.parametrize("name, stage", [("bf16_clip", 3), ("bf16_clip_cpu_offload", 2), ("fp32_clip_gas2", 1)])
def test_raise_mode_trains_through_without_a_wait(name, stage, monkeypatch):
    assert [log.count for log in train(name, stage, monkeypatch, "raise")["logs"]] == [0] * STEPS


def test_raise_mode_names_fp16s_overflow_read(monkeypatch):
    with pytest.raises(HostWaitError, match=r"zerocore/runtime/update_coef.py:\d+ in boundary_coef"):
        train("fp16_dynamic", 2, monkeypatch, "raise")


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_applies_an_inf_gradient_unless_asked_to_check(stage, monkeypatch):
    """bf16.check_grad_overflow false (torch.optim's behaviour): no host read, the step with an Inf gradient is
    applied and the lazily read norm is inf. true (the default, DeepSpeed's): skipped, as fp16 skips, decided on
    the device: no wait in the step either (skipped_steps, read after each step here, settles it)."""
    free = train("bf16_clip", stage, monkeypatch, "count", inf_at=2)
    assert free["skipped"] == [0] * STEPS and free["norms"][2] == float("inf")
    assert [log.count for log in free["logs"]] == [0] * STEPS
    with pytest.warns(RuntimeWarning, match="the update was skipped"):
        checked = train("bf16_clip_check_grad_overflow", stage, monkeypatch, "count", inf_at=2)
    assert checked["skipped"] == [0, 0, 1, 1] and checked["norms"][2] == float("inf")
    assert [log.count for log in checked["logs"]] == [0] * STEPS
    assert all(map(math.isfinite, checked["norms"][3:])) and all(map(math.isfinite, checked["losses"]))


# -- two gloo ranks -------------------------------------------------------------------------------------
W2 = [Case("w2_s2_bf16_clip", "mlp", 2, dtype="bf16", clip=0.05, steps=STEPS),
      Case("w2_s3_bf16_clip_gas2", "gpt", 3, dtype="bf16", clip=0.05, gas=2, steps=STEPS),
      Case("w2_s1_bf16_clip_cpu_offload", "mlp", 1, dtype="bf16", clip=0.05, steps=STEPS, zero=CPU_OPT)]


def run_counted(case: Case, rank: int, world: int) -> dict:
    """One rank of a W2 case (ZEROCORE_DEBUG_HOST_WAITS inherited from the parent): each step's waits."""
    engine = zerocore.initialize(make_model(case.model, 0), config(case))
    dtype, logs = DTYPES[case.dtype], []
    for step in range(case.steps):
        x, y = make_batch(case.model, step, case.micro * case.gas * world, 0)
        for k in range(case.gas):
            lo = (k * world + rank) * case.micro
            xb, yb = x[lo:lo + case.micro], y[lo:lo + case.micro]
            engine.backward(loss_fn(case.model, engine(xb.to(dtype) if xb.is_floating_point() else xb), yb))
            engine.step()
        logs.append([str(w) for w in engine.host_waits_last_step.waits if w.kind != "event"])
    engine.destroy()
    return {"logs": logs}


def test_two_ranks_steady_state_steps_wait_for_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "count")
    results = spawn_cases(W2, 2, tmp_path, run=run_counted)
    for case in W2:
        for r in case_results(results, W2, case.name):
            assert r["logs"][WARMUP:] == [[]] * (STEPS - WARMUP), (case.name, r["logs"])
