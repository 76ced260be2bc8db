"""DeepSpeed's tensor-fragment functions (``deepspeed.utils.safe_get_full_fp32_param`` and its siblings, over
``zerocore/runtime/param_fragments.py``) on 2 gloo ranks, at stages 0-3 and stages 2/3 with optimizer offload,
against one-process ``torch.optim.AdamW`` on the same global batches:

- after a step, every parameter's full fp32 master is the reference's parameter, its full ``exp_avg`` /
  ``exp_avg_sq`` the reference optimizer's state; after the next backward, its full gradient the reference's
  gradient (the mean over the global batch);
- each rank's local pieces are the parts of the full tensors it owns, and together they cover each parameter
  once;
- written values reach the step: every gradient halved through ``safe_update_full_grad_vectorized`` gives the
  reference's step with halved gradients, clipped by their norm (clipping bites); a master and a moment set whole (``safe_set_full_*``) and pieces set
  locally read back as written;
- a gradient read outside a boundary's backward raises naming the state at stages 2/3; at stages 0/1 inside
  ``no_sync()`` it is this rank's own gradient (DeepSpeed's ``.grad`` there); a frozen or foreign parameter
  gives None; an unknown state key is named.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
from stage3_ranks import LR, MICRO, WD, batch, results, scenarios_of, spawn
from zerocore.deepspeed import utils as ds_utils
from zerocore.runtime import param_fragments

D = 24
# Clipping that bites (the global norms here are 0.3-0.6): the step after a gradient write must clip by the
# written gradients' norm (with optimizer offload: the norm computed as the gradient lands, landed again)
CLIP = 0.05
VARIANTS = {"stage0": (0, None), "stage1": (1, None), "stage2": (2, None), "stage3": (3, None),
            "stage2_offload": (2, "cpu"), "stage3_offload": (3, "cpu")}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 37)
        self.b = nn.Linear(37, D)
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + 0.1 * self.frozen(x)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _cfg(stage: int, offload) -> dict:
    z = {"stage": stage, "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 100,
         "reduce_bucket_size": 500}  # several flat groups, parameters cut across ranks' ranges
    if offload:
        z["offload_optimizer"] = {"device": offload}
    return {"zero_optimization": z, "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}


def _backward(engine, step, rank, world):
    x, y = batch(step, MICRO * world, D)
    lo = rank * MICRO
    engine.backward(nn.functional.mse_loss(engine(x[lo:lo + MICRO]), y[lo:lo + MICRO]))


def _scenario(stage, offload, rank, world) -> dict:
    model = _net()
    engine = zerocore.initialize(model, _cfg(stage, offload))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    out = {"names": names}
    _backward(engine, 0, rank, world)
    engine.step()
    out["fp32"] = {n: ds_utils.safe_get_full_fp32_param(params[n]).cpu() for n in names}
    out["exp_avg"] = {n: ds_utils.safe_get_full_optimizer_state(params[n], "exp_avg").cpu() for n in names}
    out["exp_avg_sq"] = {n: ds_utils.safe_get_full_optimizer_state(params[n], "exp_avg_sq").cpu() for n in names}
    try:
        ds_utils.safe_get_full_grad(params["a.weight"]) if stage >= 2 else None
        out["grad_outside"] = None
    except RuntimeError as e:
        out["grad_outside"] = str(e)
    _backward(engine, 1, rank, world)
    out["grad"] = {n: ds_utils.safe_get_full_grad(params[n]).float().cpu() for n in names}
    # local pieces and where they sit in the whole
    out["local"] = {}
    for n in names:
        f = param_fragments.locate(params[n])
        pieces = {k: ds_utils.safe_get_local_optimizer_state(params[n], k).cpu() for k in ("exp_avg", "exp_avg_sq")}
        pieces["fp32"] = ds_utils.safe_get_local_fp32_param(params[n]).cpu()
        pieces["grad"] = ds_utils.safe_get_local_grad(params[n]).cpu()
        out["local"][n] = (f.x - f.offset, f.y - f.offset, pieces)
    out["frozen"] = ds_utils.safe_get_full_fp32_param(params["frozen.weight"])
    out["foreign"] = ds_utils.safe_get_full_fp32_param(nn.Parameter(torch.ones(2)))
    try:
        ds_utils.safe_get_full_optimizer_state(params["a.weight"], "momentum")
    except ValueError as e:
        out["bad_key"] = str(e)
    # halve every gradient, then step: the reference steps with halved gradients
    ds_utils.safe_update_full_grad_vectorized([params[n] for n in names], lambda g, p: g * 0.5)
    engine.step()
    out["after_halved"] = {n: ds_utils.safe_get_full_fp32_param(params[n]).cpu() for n in names}
    # writes read back: a whole master and moment, and local pieces
    w = params["b.weight"]
    shape = out["fp32"]["b.weight"].shape  # (at stage 3 the parameter itself is empty between uses)
    new = torch.arange(shape.numel(), dtype=torch.float32).reshape(shape) / 100
    ds_utils.safe_set_full_fp32_param(w, new)
    ds_utils.safe_set_full_optimizer_state(w, new * 2, "exp_avg")
    n_local = ds_utils.safe_get_local_optimizer_state(params["a.bias"], "exp_avg_sq").numel()
    ds_utils.safe_set_local_optimizer_state(params["a.bias"], torch.full((n_local,), 7.0), "exp_avg_sq")
    out["written"] = (ds_utils.safe_get_full_fp32_param(w).cpu(), new,
                      ds_utils.safe_get_full_optimizer_state(w, "exp_avg").cpu(),
                      ds_utils.safe_get_full_optimizer_state(params["a.bias"], "exp_avg_sq").cpu())
    try:
        ds_utils.safe_set_local_fp32_param(w, torch.zeros(n_local + 1000))
    except ValueError as e:
        out["bad_size"] = str(e)
    if stage <= 1:  # inside no_sync(): this rank's own gradient, not reduced (DeepSpeed's .grad there)
        ref = _net()
        ref.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
        with engine.no_sync():
            _backward(engine, 5, rank, world)
            x, y = batch(5, MICRO * world, D)
            nn.functional.mse_loss(ref(x[rank * MICRO:(rank + 1) * MICRO]), y[rank * MICRO:(rank + 1) * MICRO]).backward()
            out["no_sync"] = (ds_utils.safe_get_full_grad(params["a.weight"]).cpu(), ref.a.weight.grad.clone())
    engine.destroy()
    return out


SCENARIOS = scenarios_of(globals(), _scenario, VARIANTS)  # sc_<variant>, module-level: the spawn pickles by name


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(SCENARIOS, 2, tmp_path_factory.mktemp("fragments"), timeout=400)


def _reference(world=2):
    """(params after step 1, Adam state after step 1, grads of step 2, params after step 2 with halved grads)."""
    model = _net()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in trained], lr=LR, weight_decay=WD)

    def grads(step):
        x, y = batch(step, MICRO * world, D)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()

    params = [p for _, p in trained]
    grads(0)
    norms = [float(torch.nn.utils.clip_grad_norm_(params, CLIP))]
    opt.step()
    params1 = {n: p.detach().clone() for n, p in trained}
    state1 = {n: {k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")} for n, p in trained}
    grads(1)
    grads2 = {n: p.grad.clone() for n, p in trained}
    for _, p in trained:
        p.grad.mul_(0.5)
    norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
    assert min(norms) > 2 * CLIP  # (the clip bites at both steps)
    opt.step()
    return params1, state1, grads2, {n: p.detach().clone() for n, p in trained}


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_full_values_are_the_references(ranks, name):
    rs = results(ranks, name)
    params1, state1, grads2, params2 = _reference()
    for rank, r in enumerate(rs):
        for n in r["names"]:
            _close(r["fp32"][n], params1[n], f"rank {rank} fp32 {n}")
            _close(r["exp_avg"][n], state1[n]["exp_avg"], f"rank {rank} exp_avg {n}")
            _close(r["exp_avg_sq"][n], state1[n]["exp_avg_sq"], f"rank {rank} exp_avg_sq {n}")
            _close(r["grad"][n], grads2[n], f"rank {rank} grad {n}")
            _close(r["after_halved"][n], params2[n], f"rank {rank} after the halved step {n}")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_local_pieces_cover_each_parameter_once(ranks, name):
    rs = results(ranks, name)
    for n in rs[0]["names"]:
        covered = 0
        for r in rs:
            a, b, pieces = r["local"][n]
            covered += b - a
            assert pieces["fp32"].shape == (b - a,) and pieces["grad"].shape == (b - a,)
            for kind in ("fp32", "exp_avg", "exp_avg_sq", "grad"):  # (the master: read after step 1, as the whole)
                _close(pieces[kind], r[kind][n].flatten()[a:b], f"local {kind} {n}")
        stage, _ = VARIANTS[name]
        numel = rs[0]["grad"][n].numel()
        assert covered == (numel if stage >= 1 else 2 * numel), (n, covered)  # stage 0: every rank holds it all


@pytest.mark.parametrize("name", list(VARIANTS))
def test_writes_read_back_and_errors_name_the_problem(ranks, name):
    stage, _ = VARIANTS[name]
    for r in results(ranks, name):
        got_fp32, new, got_m, got_v = r["written"]
        _close(got_fp32, new, "set fp32")
        _close(got_m, new * 2, "set exp_avg")
        _close(got_v, torch.full_like(got_v, 7.0), "set local exp_avg_sq")
        assert r["frozen"] is None and r["foreign"] is None
        assert "'momentum'" in r["bad_key"] and "exp_avg" in r["bad_key"]
        assert "elements of the parameter" in r["bad_size"]
        if stage >= 2:
            assert "not held now" in r["grad_outside"] and "engine.backward()" in r["grad_outside"]
        else:
            _close(*r["no_sync"], "the gradient inside no_sync()")
