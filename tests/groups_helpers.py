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
        err = float(((got - init).double() - d_ref).norm() / d_ref.norm())
        assert err <= delta_rtol, f"{case.name}: {name}: relative delta error {err:.3g}"
