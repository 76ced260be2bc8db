"""Training cases with hyper-parameter groups, a schedule or a client optimizer, run on gloo
ranks through ``zerocore.initialize`` and, as the reference, in one process with the torch
optimizer itself (same groups, same schedule) on the concatenated global batch."""
from __future__ import annotations

import dataclasses
import math

import torch

import zerocore
from dist_helpers import loss_fn, make_batch, make_model, spawn_cases


@dataclasses.dataclass
class GCase:
    name: str
    model: str = "mlp"
    stage: int = 2
    steps: int = 6
    micro: int = 2
    gas: int = 1
    clip: float = 0.0
    offload: str = "none"  # none | cpu | nvme
    nvme_path: str = ""
    split: str = "decay"  # how parameters are grouped (see groups_of)
    schedule: dict | None = None  # the config's scheduler section
    client: str | None = None  # a client optimizer: "AdamW", "Adam", "SGD", "Adagrad", "RMSprop"
    units: bool = False  # stage 3: every parameter partitioned in units (none persistent): pieces of both groups
    bucket: int = 500_000_000
    zero: dict = dataclasses.field(default_factory=dict)
    save: tuple[int, str] | None = None  # (after this many steps, into this directory)
    load: str | None = None  # resume from this directory's latest checkpoint first

    def config(self) -> dict:
        z = {"stage": self.stage, "reduce_bucket_size": self.bucket, **self.zero}
        if self.units:
            z.update(stage3_param_persistence_threshold=0, stage3_unit_min_params=100)
        if self.offload != "none":
            z["offload_optimizer"] = {"device": self.offload}
            if self.offload == "nvme":
                z["offload_optimizer"]["nvme_path"] = self.nvme_path
        cfg = {"zero_optimization": z, "gradient_accumulation_steps": self.gas, "gradient_clipping": self.clip,
               "train_micro_batch_size_per_gpu": self.micro}
        if self.client is None:
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}}
        if self.schedule is not None:
            cfg["scheduler"] = self.schedule
        return cfg


def groups_of(case: GCase, model) -> list[dict]:
    """decay: weight decay on matrices only, a smaller lr for the rest (every LLM recipe's split);
    frozen: the same, with the output bias in no group (not trained)."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.ndim >= 2]
    rest = [p for n, p in named if p.ndim < 2 and not (case.split == "frozen" and n == "out.bias")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}]


def client_optimizer(case: GCase, groups):
    kinds = {"AdamW": lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.05),
             "Adam": lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=0.05),
             "SGD": lambda g: torch.optim.SGD(g, lr=5e-2, momentum=0.9, weight_decay=0.01),
             "Adagrad": lambda g: torch.optim.Adagrad(g, lr=5e-2, weight_decay=0.01),
             "RMSprop": lambda g: torch.optim.RMSprop(g, lr=1e-3, momentum=0.5)}
    return kinds[case.client](groups)


def run_gcase(case: GCase, rank: int, world: int) -> dict:
    model = make_model(case.model, 0)
    groups = groups_of(case, model)
    if case.client is not None:
        engine = zerocore.initialize(model, case.config(), optimizer=client_optimizer(case, groups))
    else:
        engine = zerocore.initialize(model, case.config(), model_parameters=groups)
    rows = case.micro * case.gas * world
    out = {"losses": [], "norms": [], "lrs": []}
    start = 0
    if case.load is not None:
        engine.load_checkpoint(case.load)
        start = engine.global_steps
    for step in range(start, case.steps):
        if case.save is not None and case.save[0] == step:
            engine.save_checkpoint(case.save[1])
        x, y = make_batch(case.model, step, rows, 0)
        out["lrs"].append(engine.get_lr())
        for k in range(case.gas):
            lo = (k * world + rank) * case.micro
            loss = loss_fn(case.model, engine(x[lo:lo + case.micro]), y[lo:lo + case.micro])
            engine.backward(loss)
            out["losses"].append(loss.item())
            engine.step()
        out["norms"].append(engine.global_grad_norm)
    out["state"] = engine.full_state_dict()
    engine.destroy()
    return out


def reference(case: GCase, world: int) -> dict:
    model = make_model(case.model, 0)
    groups = groups_of(case, model)
    trained = [p for g in groups for p in g["params"]]
    if case.client is not None:
        opt = client_optimizer(case, groups)
    else:
        opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05)
    sched = None
    if case.schedule is not None:
        from zerocore.schedules import from_config

        sched = from_config(case.schedule["type"], case.schedule.get("params", {}), opt)
    rows = case.micro * case.gas * world
    out = {"losses": [], "norms": [], "lrs": []}
    for step in range(case.steps):
        x, y = make_batch(case.model, step, rows, 0)
        out["lrs"].append([g["lr"] for g in opt.param_groups])
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        loss = loss_fn(case.model, model(x), y)
        loss.backward()
        for p in trained:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        out["losses"].append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(trained, case.clip if case.clip > 0 else math.inf)
        out["norms"].append(norm.item())
        opt.step()
        if sched is not None:
            sched.step()
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["init"] = make_model(case.model, 0).state_dict()
    return out


def spawn_gcases(cases: list[GCase], world: int, tmp_dir, timeout: float = 900) -> dict[str, list[dict]]:
    """{case name: [rank results]} (a failed case's entry raises with its traceback when read)."""
    per_rank = spawn_cases(cases, world, tmp_dir, timeout=timeout, run=run_gcase)
    out = {}
    for i, c in enumerate(cases):
        out[c.name] = [rs[i] if i < len(rs) else {"error": "an earlier case failed"} for rs in per_rank]
    return out


# fp32 machine epsilon, 2**-23: the spacing (ulp) of fp32 numbers near x is at most F32_EPS * |x|.
F32_EPS = torch.finfo(torch.float32).eps


def allowed_delta_error(want: torch.Tensor, init: torch.Tensor, steps: int, delta_rtol: float) -> float:
    """How far ``got - init`` may be from ``want - init`` (the update over ``steps`` steps, L2 norm)
    for a correct data-parallel run: ``delta_rtol`` of the update, plus what fp32 storage of the
    parameter itself can add.

    The ranks' gradient is the mean of per-rank sums, the reference's one sum over the whole batch:
    they differ by fp32 reduction order (measured: 4e-8 to 2.4e-7 relative per step). Through the
    optimizer that moves the update by as little, but it can also flip how ``p + update`` rounds
    when the update is a few ulps of ``p``. A flip moves an element by one ulp, which later steps
    carry along (the same update added to a neighbour rounds to the neighbour of the result), so
    flips add up to at most one ulp per element and step: ``steps * F32_EPS * ||p||`` over the run
    (every element flipping at every step: a worst case). The term matters only where the update
    is tiny next to the parameter. Measured case: client SGD (lr 3e-3, momentum 0.9),
    ``mids.1.inner.lin.bias`` of the nested model: ||p|| = 0.552, ||update|| = 5.47e-5 over 6
    steps (about 10 ulps of its elements per step). On an AVX-512 machine with torch's MKL, one
    element (-0.1602, ulp 1.49e-8) rounds the other way at step 4, which alone is a relative
    delta error of 1.49e-8 / 5.47e-5 = 2.7e-4 (with MKL held to SSE4.2 it does not flip: 0); the
    ranks' end state is bit for bit that of the same torch SGD stepping the per-rank-mean
    gradients in one process (``data_parallel``), and stages 1, 2 and 3 all end there. The floor
    here is 6 * 1.19e-7 * 0.552 = 3.9e-7, 7e-3 of the update; a real error (a missed, doubled or
    misplaced gradient piece) moves the update by tens of percent (``test_check_catches_a_missed_gradient``:
    one rank's part missed at the last step alone is 0.14)."""
    d_ref = (want - init).double()
    scale = torch.maximum(want.abs(), init.abs()).double().norm()
    return float(delta_rtol * d_ref.norm() + steps * F32_EPS * scale)


def check(case: GCase, world: int, per_rank: list[dict], delta_rtol: float = 1e-4) -> None:
    for r in per_rank:
        assert "error" not in r, f"case {case.name}:\n{r['error']}"
    ref = reference(case, world)
    for r in per_rank:
        assert r["lrs"] == [list(map(float, x)) for x in ref["lrs"]] or all(
            math.isclose(a, b, rel_tol=1e-12) for x, y in zip(r["lrs"], ref["lrs"]) for a, b in zip(x, y)), \
            f"{case.name}: lrs {r['lrs']} vs {ref['lrs']}"
        for step, (got, want) in enumerate(zip(r["norms"], ref["norms"])):
            assert math.isclose(got, want, rel_tol=1e-5), f"{case.name} step {step}: grad norm {got} vs {want}"
    first = per_rank[0]
    for name, want in ref["state"].items():
        got, init = first["state"][name], ref["init"][name]
        if torch.equal(want, init):
            assert torch.equal(got, want), f"{case.name}: {name} is not trained and moved"
            continue
        if name.endswith("attn.in_proj_bias"):  # the key bias: zero true gradient, its update is rounding noise
            d = want.numel() // 3
            keep = torch.ones_like(want, dtype=torch.bool)
            keep[d:2 * d] = False
            got, want, init = got[keep], want[keep], init[keep]
        d_ref = (want - init).double()
        err = float(((got - init).double() - d_ref).norm())
        allowed = allowed_delta_error(want, init, case.steps, delta_rtol)
        assert err <= allowed, (f"{case.name}: {name}: delta error {err:.3g} (relative {err / float(d_ref.norm()):.3g})"
                                f" > allowed {allowed:.3g} ({delta_rtol:g} of the update + fp32 rounding of the "
                                f"parameter over {case.steps} steps)")


def data_parallel(case: GCase, world: int, drop: tuple[int, str] | None = None) -> dict:
    """What ``run_gcase`` returns for a correct run, computed in this process: each rank's
    gradient on its rows (``case.gas`` 1, no clipping), their mean, the same torch optimizer.
    ``drop``: (step, name): at that step the optimizer gets that parameter's mean gradient without
    the last rank's part (a missed contribution after a correct norm: for the tests of ``check``)."""
    assert case.gas == 1 and case.clip == 0 and case.client is not None and case.schedule is None
    assert case.split == "decay", "every parameter trained"
    model = make_model(case.model, 0)
    opt = client_optimizer(case, groups_of(case, model))
    params = dict(model.named_parameters())
    out = {"losses": [], "norms": [], "lrs": []}
    for step in range(case.steps):
        x, y = make_batch(case.model, step, case.micro * world, 0)
        out["lrs"].append([float(g["lr"]) for g in opt.param_groups])
        per_rank = []
        for rank in range(world):
            model.zero_grad(set_to_none=True)
            lo = rank * case.micro
            loss = loss_fn(case.model, model(x[lo:lo + case.micro]), y[lo:lo + case.micro])
            loss.backward()
            out["losses"].append(loss.item())
            per_rank.append({n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in params.items()})
        for n, p in params.items():
            p.grad = sum(g[n] for g in per_rank) / world
        out["norms"].append(torch.nn.utils.clip_grad_norm_(list(params.values()), math.inf).item())
        if drop is not None and drop[0] == step:
            params[drop[1]].grad = sum(g[drop[1]] for g in per_rank[:-1]) / world
        opt.step()
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out
