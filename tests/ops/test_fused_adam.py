"""FusedAdam as a drop-in torch optimizer, against torch.optim.AdamW / Adam.

Elementwise comparisons feed both optimizers the same fixed gradients for 20 steps: fp32
rtol 1e-6, atol 1e-7 (one fp32 ulp at |p|~1: torch's vectorised lerp/addcmul contract into
FMAs, ours do not). A model-driven run also checks the whole-tensor relative change, since a
gradient that depends on the weights amplifies last-bit differences near ReLU kinks.
"""
import copy

import pytest
import torch

from zerocore.ops import FusedAdam, _loader

SHAPES = [(33, 17), (33,), (5, 33), (5,), (1000,), (1,), (2**16 + 3,)]


def _params(gen):
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _run(opt_a, opt_b, pa, pb, steps=20, gen=None, before_step=None):
    gen = gen or torch.Generator().manual_seed(99)
    for i in range(steps):
        if before_step:
            before_step(i)
        for p, q in zip(pa, pb):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()


def _assert_params_close(pa, pb):
    for p, q in zip(pa, pb):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("adamw, torch_cls, wd", [(True, torch.optim.AdamW, 0.01), (True, torch.optim.AdamW, 0.3),
                                                  (False, torch.optim.Adam, 0.0), (False, torch.optim.Adam, 0.05)])
def test_matches_torch_elementwise(adamw, torch_cls, wd):
    base = _params(torch.Generator().manual_seed(0))
    pa = [torch.nn.Parameter(t.clone()) for t in base]
    pb = [torch.nn.Parameter(t.clone()) for t in base]
    a = FusedAdam(pa, lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=wd, adamw_mode=adamw)
    b = torch_cls(pb, lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=wd)
    _run(a, b, pa, pb)
    _assert_params_close(pa, pb)
    for p, q in zip(pa, pb):
        sa, sb = a.state[p], b.state[q]
        assert sa["step"].item() == sb["step"].item() == 20
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=1e-6, atol=1e-9)


def test_default_weight_decay_follows_mode():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert FusedAdam(p).defaults["weight_decay"] == torch.optim.AdamW(p).defaults["weight_decay"]
    assert FusedAdam(p, adamw_mode=False).defaults["weight_decay"] == torch.optim.Adam(p).defaults["weight_decay"]


def test_param_groups_lr_changes_and_scheduler():
    base = _params(torch.Generator().manual_seed(1))
    pa = [torch.nn.Parameter(t.clone()) for t in base]
    pb = [torch.nn.Parameter(t.clone()) for t in base]
    a = FusedAdam([{"params": pa[:3], "lr": 3e-3}, {"params": pa[3:], "weight_decay": 0.2}], lr=1e-2)
    b = torch.optim.AdamW([{"params": pb[:3], "lr": 3e-3}, {"params": pb[3:], "weight_decay": 0.2}], lr=1e-2)
    sa = torch.optim.lr_scheduler.StepLR(a, step_size=3, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(b, step_size=3, gamma=0.5)

    def before(i):
        if i:
            sa.step()
            sb.step()
        if i == 10:  # a manual change between steps
            a.param_groups[1]["lr"] = b.param_groups[1]["lr"] = 7e-3

    _run(a, b, pa, pb, before_step=before)
    assert a.param_groups[0]["lr"] == b.param_groups[0]["lr"] < 3e-3
    _assert_params_close(pa, pb)


def test_group_adamw_mode_key():
    base = _params(torch.Generator().manual_seed(2))
    pa = [torch.nn.Parameter(t.clone()) for t in base]
    pb = [torch.nn.Parameter(t.clone()) for t in base]
    a = FusedAdam([{"params": pa[:2], "adamw_mode": False}, {"params": pa[2:]}], lr=1e-2, weight_decay=0.1)
    assert [g["decoupled_weight_decay"] for g in a.param_groups] == [False, True]
    b1 = torch.optim.Adam(pb[:2], lr=1e-2, weight_decay=0.1)
    b2 = torch.optim.AdamW(pb[2:], lr=1e-2, weight_decay=0.1)

    class Both:
        def step(self):
            b1.step()
            b2.step()

    _run(a, Both(), pa, pb)
    _assert_params_close(pa, pb)


@pytest.mark.parametrize("first", ["torch", "zerocore"])
def test_state_dict_round_trip(first):
    """Train 5 steps with one optimizer, move its state into the other, train 5 more; the
    result equals 10 steps of torch AdamW alone."""
    base = _params(torch.Generator().manual_seed(3))
    pa = [torch.nn.Parameter(t.clone()) for t in base]
    pref = [torch.nn.Parameter(t.clone()) for t in base]
    make = {"torch": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
            "zerocore": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1)}
    second = "zerocore" if first == "torch" else "torch"
    ref = torch.optim.AdamW(pref, lr=1e-2, weight_decay=0.1)
    opt1 = make[first](pa)
    gen = torch.Generator().manual_seed(5)
    _run(opt1, ref, pa, pref, steps=5, gen=gen)
    opt2 = make[second](pa)
    opt2.load_state_dict(copy.deepcopy(opt1.state_dict()))
    assert opt2.state_dict()["param_groups"][0]["decoupled_weight_decay"] is True
    _run(opt2, ref, pa, pref, steps=5, gen=gen)
    _assert_params_close(pa, pref)
    assert opt2.state[pa[0]]["step"].item() == 10


def test_state_layout_is_torch_layout():
    p = torch.nn.Parameter(torch.randn(4))
    q = torch.nn.Parameter(p.detach().clone())
    a, b = FusedAdam([p]), torch.optim.AdamW([q])
    p.grad, q.grad = torch.ones(4), torch.ones(4)
    a.step()
    b.step()
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"][0].keys() == sb["param_groups"][0].keys()
    assert sa["state"][0].keys() == sb["state"][0].keys()
    assert sa["state"][0]["step"].dtype == sb["state"][0]["step"].dtype


def test_model_training_matches_adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(17, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    ref = copy.deepcopy(model)
    init = copy.deepcopy(model)
    a = FusedAdam(model.parameters(), lr=1e-2)
    b = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        x = torch.randn(8, 17, generator=gen)
        for mod, opt in ((model, a), (ref, b)):
            opt.zero_grad()
            mod(x).pow(2).mean().backward()
            opt.step()
    for p, q, p0 in zip(model.parameters(), ref.parameters(), init.parameters()):
        delta_a, delta_b = p - p0, q - p0
        assert (delta_a - delta_b).norm() <= 1e-5 * delta_b.norm()


def test_params_without_grad_and_noncontiguous():
    w = torch.nn.Parameter(torch.randn(6, 4).t())  # non-contiguous parameter
    idle = torch.nn.Parameter(torch.randn(3))
    w_ref = torch.nn.Parameter(w.detach().clone())
    a = FusedAdam([w, idle], lr=0.1)
    b = torch.optim.AdamW([w_ref], lr=0.1)
    before = idle.detach().clone()
    for _ in range(3):
        g = torch.randn(4, 6)
        w.grad, w_ref.grad = g.clone(), g.clone()
        a.step()
        b.step()
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)
    assert not w.is_contiguous() and torch.equal(idle, before) and idle not in a.state


def test_one_native_call_per_group(monkeypatch):
    lib = _loader.load()
    calls = []

    class Spy:
        def __getattr__(self, name):
            fn = getattr(lib, name)
            if name == "adam_step_multi":
                return lambda *a: (calls.append(len(a[0])), fn(*a))
            return fn

    monkeypatch.setattr(_loader, "load", lambda op="native": Spy())
    ps = [torch.nn.Parameter(torch.randn(7)) for _ in range(200)]
    opt = FusedAdam([{"params": ps[:150]}, {"params": ps[150:], "lr": 1e-4}])
    for p in ps:
        p.grad = torch.randn(7)
    opt.step()
    assert calls == [150, 50]


def test_closure():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = FusedAdam([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p ** 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 5.0
    assert p.abs().sum() < 3.0


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(lr=float("nan")), ValueError, "lr"),
    (dict(lr=-0.1), ValueError, "lr"),
    (dict(betas=(0.9, 1.5)), ValueError, r"betas\[1\]"),
    (dict(betas=0.9), TypeError, "betas"),
    (dict(eps=float("nan")), ValueError, "eps"),
    (dict(weight_decay=-1), ValueError, "weight_decay"),
    (dict(amsgrad=True), ValueError, "amsgrad"),
    (dict(maximize=True), ValueError, "maximize"),
])
def test_bad_construction_args(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        FusedAdam([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_bad_params_at_step():
    p16 = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    p16.grad = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"params'\]\[0\] has dtype torch.bfloat16"):
        FusedAdam([p16]).step()
    pm = torch.nn.Parameter(torch.zeros(3, device="meta"))
    pm.grad = torch.zeros(3, device="meta")
    with pytest.raises(ValueError, match="is on meta"):
        FusedAdam([pm]).step()
    ps = torch.nn.Parameter(torch.zeros(3))
    ps.grad = torch.zeros(3).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        FusedAdam([ps]).step()
    pg = torch.nn.Parameter(torch.zeros(3))
    opt = FusedAdam([pg])
    opt.param_groups[0]["lr"] = float("nan")  # changed after construction
    pg.grad = torch.zeros(3)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: lr"):
        opt.step()
    assert torch.equal(pg, torch.zeros(3))  # nothing was changed by the failed step


def test_failed_step_changes_nothing():
    """A bad parameter in the second group: the first group is not stepped either, and no
    step counter moves; after fixing the input, training goes on normally."""
    good = torch.nn.Parameter(torch.ones(4))
    bad = torch.nn.Parameter(torch.ones(4))
    opt = FusedAdam([{"params": [good]}, {"params": [bad]}], lr=0.1)
    good.grad = torch.ones(4)
    opt.step()
    snapshot = good.detach().clone()
    good.grad, bad.grad = torch.ones(4), torch.ones(4).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        opt.step()
    assert torch.equal(good, snapshot) and opt.state[good]["step"].item() == 1 and bad not in opt.state
    bad.grad = torch.ones(4)
    opt.step()
    assert opt.state[good]["step"].item() == 2 and opt.state[bad]["step"].item() == 1


def _python_calls(fn) -> int:
    import sys

    calls = [0]

    def prof(frame, event, arg):
        if event == "call":
            calls[0] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[0]


def test_python_work_per_step_does_not_grow_with_parameters():
    """After its first step a group reuses its checked plan: the Python calls of a step are the
    same for 20 and for 200 parameters (one native call, step counts bumped by one add_)."""
    counts = {}
    for n in (20, 200):
        ps = [torch.nn.Parameter(torch.randn(9)) for _ in range(n)]
        opt = FusedAdam(ps, lr=1e-3)
        for _ in range(2):
            for p in ps:
                p.grad = torch.randn(9)
            opt.step()
        counts[n] = _python_calls(opt.step)
    assert counts[20] == counts[200] <= 60, counts


def test_plan_follows_changes_and_keeps_torch_state():
    """The plan is dropped when gradients appear/disappear, the state is loaded, or a gradient
    is refused; results stay equal to torch.optim.AdamW throughout, step counts included."""
    gen = torch.Generator().manual_seed(5)
    base = [torch.randn(6, generator=gen) for _ in range(4)]
    pa = [torch.nn.Parameter(t.clone()) for t in base]
    pb = [torch.nn.Parameter(t.clone()) for t in base]
    a, b = FusedAdam(pa, lr=0.05), torch.optim.AdamW(pb, lr=0.05)

    def both(mask, g_fn=lambda g: g):
        for p, q, m in zip(pa, pb, mask):
            g = torch.randn(6, generator=gen)
            p.grad, q.grad = (g_fn(g.clone()), g.clone()) if m else (None, None)
        a.step()
        b.step()

    for mask in ([1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1, 1], [1, 0, 1, 1], [1, 1, 1, 1]):
        both(mask)
    _assert_params_close(pa, pb)
    assert [a.state[p]["step"].item() for p in pa] == [b.state[q]["step"].item() for q in pb] == [5, 3, 5, 5]
    both([1, 1, 1, 1], g_fn=lambda g: torch.stack([g, g], 1)[:, 0])  # a non-contiguous gradient: refused by
    _assert_params_close(pa, pb)                                     # the plan's binding, stepped by the full path
    a.load_state_dict(copy.deepcopy(b.state_dict()))  # (torch's load keeps same-device tensors: not shared)
    both([1, 1, 1, 1])
    both([1, 1, 1, 1])
    _assert_params_close(pa, pb)
    assert a.state[pa[1]]["step"].item() == b.state[pb[1]]["step"].item() == 6
    pa[2].grad = torch.zeros(6).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        a.step()


def test_plan_on_cuda_is_one_binding_call(monkeypatch):
    from fake_cuda import fake, install_recorder

    rec = install_recorder(monkeypatch)
    ps = [torch.nn.Parameter(fake(5)) for _ in range(70)]
    opt = FusedAdam(ps, lr=0.01)
    for step in range(3):
        for p in ps:
            p.grad = fake(5)
        opt.step()
    calls = [c for c in rec.calls if c[0] == "cuda_adam_step_multi"]
    assert len(calls) == 3 and all(len(c[1][0]) == 70 for c in calls)
    assert [c[1][5][0] for c in calls] == [1, 2, 3] and calls[2][1][0][0] is ps[0]
