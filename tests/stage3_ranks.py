"""Stage-3 scenarios on spawned gloo ranks, shared by tests/runtime/test_partition_init.py,
tests/runtime/test_gathered.py and tests/comm/test_divergence.py: the models, the config, the
training loop and its one-process reference, and the spawn that runs named scenarios on every rank.

A scenario is a module-level function ``sc_<name>(rank, world) -> dict`` of a test module; one spawn
runs all of a module's scenarios in turn (a fresh process costs seconds here) and the tests check
the plain results each returned. The spawn is bounded in time and fails if a rank exits abnormally,
so "the ranks exit cleanly" is part of every test that uses it.
"""
from __future__ import annotations

import os
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

from dist_helpers import relative_delta_error
from forked_ranks import start_ranks

LR, WD, MICRO = 1e-2, 0.05, 2
SPAWN_TIMEOUT = 150  # seconds for a whole spawn (every scenario of it)



# -- models ------------------------------------------------------------------------------------------
class Stack(nn.Module):
    """Blocks applied in turn; ``skip`` leaves one out (what a rank that diverges does)."""

    def __init__(self, n: int = 4, d: int = 32, block=None):
        super().__init__()
        block = block or (lambda i: nn.Linear(d, d))
        self.blocks = nn.ModuleList(block(i) for i in range(n))

    def forward(self, x, skip: int | None = None):
        for i, b in enumerate(self.blocks):
            if i != skip:
                x = torch.tanh(b(x))
        return x



class Wide(nn.Module):
    """d -> 2d -> d: a unit of a different size from a Linear(d, d)."""

    def __init__(self, d: int):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))



def config(dtype: str = "fp32", **zero) -> dict:
    z = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 100,
         "stage3_divergence_timeout": 30, **zero}
    return {"zero_optimization": z, "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "bf16": {"enabled": dtype == "bf16"}}



def batch(step: int, rows: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)



def train(engine, steps: int, rank: int, world: int, d: int, first: int = 0, dtype=torch.float32,
          hook=None) -> list[float]:
    """``steps`` optimizer steps; returns the mean loss over ranks of each step."""
    losses = []
    for step in range(first, first + steps):
        x, y = batch(step, MICRO * world, d)
        lo = rank * MICRO
        loss = nn.functional.mse_loss(engine(x[lo:lo + MICRO].to(dtype)).float(), y[lo:lo + MICRO])
        engine.backward(loss)
        engine.step()
        if hook is not None:
            hook()
        t = loss.detach().reshape(1).double()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses



def reference(model: nn.Module, steps: int, world: int, d: int, first: int = 0, opt=None):
    """One process, fp32 torch.optim.AdamW on the global batch (mean loss); returns (losses, opt)."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for step in range(first, first + steps):
        x, y = batch(step, MICRO * world, d)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, opt



def stack(n=4, d=32, seed=0, **kw) -> Stack:
    torch.manual_seed(seed)
    return Stack(n, d, **kw)



def mixed_unseeded() -> Stack:
    """Units of two sizes: Linear(32, 32) and Wide(32) (split into its up and down units)."""
    return Stack(6, 32, block=lambda i: Wide(32) if i % 3 == 1 else nn.Linear(32, 32))



def mixed() -> Stack:
    torch.manual_seed(0)
    return mixed_unseeded()



def _drop(engine) -> None:
    engine.reducer.remove_hooks()
    if engine.gatherer is not None:
        engine.gatherer.remove_hooks()



# -- spawning ---------------------------------------------------------------------------------------
def scenarios_of(module_globals: dict, run, variants: dict) -> list:
    """One scenario ``sc_<name>(rank, world) = run(*variants[name], rank, world)`` per variant, defined in the
    calling test module (``module_globals``: its ``globals()``), so the spawn pickles each by name."""
    out = []
    for name, args in variants.items():
        def scenario(rank, world, _args=tuple(args)):
            return run(*_args, rank, world)
        scenario.__name__ = scenario.__qualname__ = f"sc_{name}"
        scenario.__module__ = module_globals["__name__"]
        module_globals[scenario.__name__] = scenario
        out.append(scenario)
    return out


def _entry(rank: int, world: int, init_file: str, out_dir: str, scenarios: list) -> None:
    torch.set_num_threads(1)  # ranks share 2 cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {}
        for scenario in scenarios:
            name = scenario.__name__[3:]
            t0 = time.perf_counter()
            try:
                r = scenario(rank, world)
            except Exception:
                r = {"exception": traceback.format_exc()}
            r["wall"] = time.perf_counter() - t0
            results[name] = r
            torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
            if "exception" in r:
                break  # the other ranks may be stuck in a collective
    finally:
        dist.destroy_process_group()


def spawn(scenarios: list, world: int, tmp_dir, timeout: float = SPAWN_TIMEOUT, fresh: bool = False) -> list[dict]:
    """Runs the scenarios (``sc_<name>`` functions, results keyed by ``<name>``) on ``world`` gloo
    ranks; fails if a rank exits abnormally (a SIGABRT raises ProcessExitedException) or the whole
    run takes longer than ``timeout``. ``fresh``: ranks in new interpreters (``forked_ranks.start_ranks``)."""
    tmp_dir = str(tmp_dir)
    ctx = start_ranks(_entry, (world, os.path.join(tmp_dir, "pg"), tmp_dir, scenarios), world, fresh=fresh)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            names = [s.__name__[3:] for s in scenarios]
            raise TimeoutError(f"{world} ranks did not finish {names} in {timeout:.0f} s")
    return [torch.load(os.path.join(tmp_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def results(per_rank: list[dict], name: str) -> list[dict]:
    out = []
    for rank, rs in enumerate(per_rank):
        if name not in rs:
            raise AssertionError(f"rank {rank} never ran {name!r} (an earlier scenario failed)")
        if "exception" in rs[name]:
            raise AssertionError(f"rank {rank} failed in {name!r}:\n{rs[name]['exception']}")
        out.append(rs[name])
    return out



def same_on_every_rank(rs: list[dict], key: str) -> dict:
    first = rs[0][key]
    for r in rs[1:]:
        assert r[key].keys() == first.keys()
        for k in first:
            assert torch.equal(r[key][k], first[k]), f"{key}: ranks differ on {k}"
    return first



def assert_losses(got: list[float], want: list[float], rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=rtol, atol=atol)



def assert_states_close(got: dict, want: dict, init: dict):
    """fp32 against the reference, as tests/sharding/test_stages.py: each element within rtol 1e-5 (atol
    1e-6), except up to 1% of a tensor (elements whose gradient is near zero, where summation
    order is noise that Adam scales up to lr-sized steps), with the tensor's training delta
    within 1e-4 of the reference's."""
    assert got.keys() == want.keys()
    for k in want:
        bad = ~torch.isclose(got[k], want[k], rtol=1e-5, atol=1e-6)
        if bad.any():
            rd = relative_delta_error(got[k], want[k], init[k])
            assert bad.float().mean() <= 0.01 and rd <= 1e-4, f"{k}: {int(bad.sum())} elements off, delta error {rd:.3g}"

