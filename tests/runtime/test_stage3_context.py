"""Stage 3 outside the training loop, on spawned gloo ranks: ``zerocore.init`` (parameters
partitioned as the model is built), ``zerocore.gathered`` (full parameters visible for a while,
optionally edited by one rank), and the divergence guard (ranks that issue different stage-3
collectives, or stop issuing them, get a DivergenceError instead of a hang or a SIGABRT).

One spawn of 2 ranks runs every world-2 scenario (a fresh process costs seconds here); each
scenario returns plain results that the tests below check. The spawn is bounded in time and
fails if a rank exits abnormally, so "the ranks exit cleanly after a DivergenceError" is part
of every test that uses it.
"""
from __future__ import annotations

import math
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import zerocore
from dist_helpers import gc_tensor_bytes, relative_delta_error

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


class Parent(nn.Module):
    """Initializes its child's weight in its own __init__: the trap zerocore.init catches, and
    (``fixed``) the way out: the change made under zerocore.gathered(modifier_rank=0)."""

    def __init__(self, d: int = 32, fixed: bool = False):
        super().__init__()
        self.child = nn.Linear(d, d)
        self.head = nn.Linear(d, d)
        if fixed:
            with zerocore.gathered([self.child.weight], modifier_rank=0):
                nn.init.normal_(self.child.weight, std=0.3)
        else:
            nn.init.normal_(self.child.weight, std=0.3)

    def forward(self, x):
        return self.head(torch.tanh(self.child(x)))


SAMPLES: list[int] = []  # gc_tensor_bytes() taken while a model is built / trained


def _sample():
    SAMPLES.append(gc_tensor_bytes())


class SampledLinear(nn.Linear):
    """A Linear that records the bytes alive at the end of its __init__ (its weight still whole:
    zerocore.init partitions it when this __init__ returns)."""

    def __init__(self, d: int):
        super().__init__(d, d)
        _sample()


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


# -- world-2 scenarios (each runs on every rank; returns what the tests check) ----------------------
MEM_N, MEM_D, MEM_STEPS = 32, 256, 2
# stage-3 limits for the memory run: about two units gathered ahead, three resident
MEM_ZERO = {"stage3_prefetch_bucket_size": 2 * (MEM_D + 1) * MEM_D, "stage3_max_live_parameters": 3 * (MEM_D + 1) * MEM_D}


def sc_init_memory(rank: int, world: int) -> dict:
    """A 32 x Linear(256, 256) model (8.4 MB of fp32 parameters) built under zerocore.init and
    trained at stage 3, against the same model built whole (and trained at stage 0). Bytes alive
    (gc) are sampled at the end of some blocks' __init__ (their weight still whole), after the
    build, and while training: before/after some blocks' forward, when their gradient is
    ready, after each step."""
    out = {}
    sampled = {MEM_N // 2 - 1, MEM_N - 1}

    def block(i):
        return SampledLinear(MEM_D) if i in sampled else nn.Linear(MEM_D, MEM_D)

    def build(partitioned: bool, seed: int):
        SAMPLES.clear()
        base = gc_tensor_bytes()
        torch.manual_seed(seed)
        if partitioned:
            with zerocore.init(config(**MEM_ZERO)):
                model = Stack(MEM_N, MEM_D, block=block)
        else:
            model = Stack(MEM_N, MEM_D, block=block)
        _sample()
        return model, base, max(SAMPLES) - base

    def run(model, cfg, base, sample: bool):
        SAMPLES.clear()
        engine = zerocore.initialize(model, cfg)
        _sample()
        hooks = []
        if sample:
            for i in (0, MEM_N // 2, MEM_N - 1):
                b = model.blocks[i]
                hooks += [b.register_forward_pre_hook(lambda *a: _sample()), b.register_forward_hook(lambda *a: _sample()),
                          b.weight.register_post_accumulate_grad_hook(lambda p: _sample())]
        losses = train(engine, MEM_STEPS, rank, world, MEM_D, hook=_sample)
        for h in hooks:
            h.remove()
        peak = max(SAMPLES) - base
        state = engine.full_state_dict()
        _drop(engine)
        return losses, peak, state

    # rank r seeds with r: zerocore.init must give every rank rank 0's values
    model, base, out["build_peak_init"] = build(True, seed=rank)
    out["empty_after_build"] = all(p.numel() == 0 for p in model.parameters())
    out["shapes"] = {n: tuple(p._zc_init.shape) for n, p in model.named_parameters()}
    out["losses_init"], out["train_peak_init"], out["state_init"] = run(model, config(**MEM_ZERO), base, True)
    del model
    model, base, out["build_peak_whole"] = build(False, seed=0)
    out["losses_whole"], _, out["state_whole"] = run(model, config(**MEM_ZERO), base, False)
    del model
    model, base, _ = build(False, seed=0)
    out["losses_stage0"], out["train_peak_stage0"], _ = run(model, config(stage=0), base, False)
    out["psi"] = sum(p.numel() for p in model.parameters())
    del model
    return out


def sc_init_trap(rank: int, world: int) -> dict:
    out = {}
    # a parent's __init__ changing its child's (already partitioned) weight
    try:
        with zerocore.init(config()):
            Parent()
        out["parent"] = None
    except RuntimeError as e:
        out["parent"] = str(e)
    # TinyGPT does exactly that (nn.init.normal_(self.tok.weight) at the end of TinyGPT.__init__)
    from zerocore.demo import Block, TinyGPT

    try:
        with zerocore.init(config()):
            TinyGPT(vocab=29, dim=32, layers=1, heads=2, ctx=12)
        out["tinygpt"] = None
    except RuntimeError as e:
        out["tinygpt"] = str(e)
    # ... but its blocks are fine: nn.MultiheadAttention zeroes out_proj.bias right after building
    # out_proj (a child initialized by its parent before anything else is built)
    torch.manual_seed(rank)
    with zerocore.init(config()):
        blocks = nn.Sequential(Block(32, 2), Block(32, 2))
    engine = zerocore.initialize(blocks, config())
    out["blocks_state"] = engine.full_state_dict()
    _drop(engine)
    torch.manual_seed(0)
    out["blocks_ref"] = {k: v.detach().clone() for k, v in nn.Sequential(Block(32, 2), Block(32, 2)).state_dict().items()}
    # a change made after construction, before initialize: caught by initialize
    for kind in ("inplace", "assign"):
        torch.manual_seed(0)
        with zerocore.init(config()):
            model = Stack()
        if kind == "inplace":
            with torch.no_grad():
                model.blocks[2].bias.add_(1.0)
        else:
            model.blocks[2].weight.data = torch.ones(32, 32)
        try:
            engine = zerocore.initialize(model, config())
            _drop(engine)
            out[kind] = None
        except RuntimeError as e:
            out[kind] = str(e)
    # the fix: the parent's change made under gathered(modifier_rank=0); rank r seeds with r
    torch.manual_seed(rank)
    with zerocore.init(config()):
        model = Parent(fixed=True)
    out["fixed_empty"] = all(p.numel() == 0 for p in model.parameters())
    engine = zerocore.initialize(model, config())
    out["fixed_state"] = engine.full_state_dict()
    out["fixed_losses"] = train(engine, 3, rank, world, 32)
    _drop(engine)
    torch.manual_seed(0)
    ref = Parent(fixed=False)  # what rank 0 built, without zerocore.init
    out["ref_state"] = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    out["ref_losses"], _ = reference(ref, 3, world, 32)
    return out


def sc_gathered_engine(rank: int, world: int) -> dict:
    """fp32: read, discard, and rank 0's edit written back; training goes on from the edit."""
    out = {}
    model = stack()
    engine = zerocore.initialize(model, config())
    train(engine, 2, rank, world, 32)
    sd = engine.full_state_dict()
    names = dict(model.named_parameters())
    seen_full, seen_equal = {}, {}
    with zerocore.gathered(list(model.parameters())) as ps:
        out["yields_params"] = [id(p) for p in ps] == [id(p) for p in model.parameters()]
        for n, p in names.items():
            seen_full[n] = tuple(p.shape)
            seen_equal[n] = torch.equal(p.detach(), sd[n])
        # in the context full_state_dict still works (and agrees)
        sd_inside = engine.full_state_dict()
        out["inside_sd_equal"] = all(torch.equal(sd_inside[n], sd[n]) for n in sd)
        with torch.no_grad():
            for p in ps:
                p.add_(1.0)  # no modifier_rank: discarded
    out["seen_full"], out["seen_equal"] = seen_full, seen_equal
    out["shape_after"] = {n: tuple(p.shape) for n, p in names.items()}
    sd_discard = engine.full_state_dict()
    out["discarded"] = all(torch.equal(sd_discard[n], sd[n]) for n in sd)
    # rank 0 zeroes row 0 and adds 1 to row 1 of blocks.1.weight; rank 1 makes another change
    w = model.blocks[1].weight
    with zerocore.gathered([w], modifier_rank=0):
        with torch.no_grad():
            if rank == 0:
                w[0].zero_()
                w[1].add_(1.0)
            else:
                w.mul_(3.0)
    out["before_edit"] = sd
    out["after_edit"] = engine.full_state_dict()
    out["losses_after"] = train(engine, 3, rank, world, 32, first=2)
    out["state_end"] = engine.full_state_dict()
    _drop(engine)
    # the reference: the same edit at the same point
    ref = stack()
    losses, opt = reference(ref, 2, world, 32)
    with torch.no_grad():
        ref.blocks[1].weight[0].zero_()
        ref.blocks[1].weight[1].add_(1.0)
    out["ref_losses_after"], _ = reference(ref, 3, world, 32, first=2, opt=opt)
    out["ref_state_end"] = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return out


def sc_gathered_bf16(rank: int, world: int) -> dict:
    """bf16: the fp32 master of the edited parameter takes the edit; the others (also those in
    the same unit) keep their full fp32 values."""
    out = {}
    model = stack()
    engine = zerocore.initialize(model, config("bf16"))
    train(engine, 2, rank, world, 32, dtype=torch.bfloat16)
    out["before"] = engine.full_state_dict()
    w = model.blocks[1].weight
    with zerocore.gathered([w], modifier_rank=0):
        out["inside_dtype"] = str(w.dtype)
        out["inside"] = w.detach().clone()
        with torch.no_grad():
            if rank == 0:
                w[0].add_(1.0)
            else:
                w.zero_()
    out["after"] = engine.full_state_dict()
    out["losses"] = train(engine, 2, rank, world, 32, first=2, dtype=torch.bfloat16)
    _drop(engine)
    ref = stack()  # fp32, the same edit at the same point
    _, opt = reference(ref, 2, world, 32)
    with torch.no_grad():
        ref.blocks[1].weight[0].add_(1.0)
    out["ref_losses"], _ = reference(ref, 2, world, 32, first=2, opt=opt)
    return out


def sc_gathered_persistent(rank: int, world: int) -> dict:
    """Persistent (never partitioned) parameters: the biases (32 < threshold 100)."""
    out = {}
    for dtype in ("fp32", "bf16"):
        model = stack()
        engine = zerocore.initialize(model, config(dtype, stage3_param_persistence_threshold=100))
        tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        train(engine, 1, rank, world, 32, dtype=tdtype)
        before = engine.full_state_dict()
        b, w = model.blocks[0].bias, model.blocks[0].weight
        with zerocore.gathered([b, w]):
            with torch.no_grad():
                b.add_(1.0)  # no modifier_rank: discarded
                w.add_(1.0)
        out[f"{dtype}_discard"] = engine.full_state_dict()
        out[f"{dtype}_discard_local"] = b.detach().float().clone()
        with zerocore.gathered([b], modifier_rank=0):
            with torch.no_grad():
                b.fill_(0.5 if rank == 0 else -7.0)
        out[f"{dtype}_before"] = before
        out[f"{dtype}_modified"] = engine.full_state_dict()
        out[f"{dtype}_modified_local"] = b.detach().float().clone()
        out[f"{dtype}_losses"] = train(engine, 1, rank, world, 32, first=1, dtype=tdtype)
        _drop(engine)
    return out


class Peeking(Stack):
    """Reads a parameter of another unit under zerocore.gathered() in its own forward (from a
    list captured before initialize, so no attribute access gathers it first)."""

    def forward(self, x, skip=None):
        if self.__dict__.get("peek"):
            self.__dict__["state"] = self.__dict__["probe"]()
            with zerocore.gathered(self.__dict__["peek"]) as ps:
                self.__dict__["seen"] = [p.detach().clone() for p in ps]
        return super().forward(x, skip)


def sc_gathered_in_forward(rank: int, world: int) -> dict:
    """In the second step the root's pre-forward hook prefetches the blocks (recorded order):
    gathered() on blocks.1.weight inside the root's forward meets a gather in flight."""
    out = {}
    for peek in (False, True):
        torch.manual_seed(0)
        model = Peeking()
        w = model.blocks[1].weight
        engine = zerocore.initialize(model, config())
        train(engine, 1, rank, world, 32)
        sd = engine.full_state_dict()
        model.__dict__["peek"] = [w] if peek else None
        group = engine.groups[engine.param_index[id(w)][0]]
        model.__dict__["probe"] = lambda: str(group.param_state.value)
        count = engine.guard.count
        losses = train(engine, 1, rank, world, 32, first=1)
        out[f"headers_{peek}"] = engine.guard.count - count
        out[f"losses_{peek}"] = losses
        if peek:
            out["state_inside_forward"] = model.__dict__["state"]
            out["seen"] = model.__dict__["seen"][0]
            out["want"] = sd["blocks.1.weight"]
            out["empty_after"] = w.numel() == 0
        _drop(engine)
    return out


def sc_check_disabled(rank: int, world: int) -> dict:
    out = {}
    for check in (True, False):
        model = mixed()
        engine = zerocore.initialize(model, config(stage3_check_divergence=check))
        out[f"losses_{check}"] = train(engine, 4, rank, world, 32)
        out[f"state_{check}"] = engine.full_state_dict()
        out[f"guard_{check}"] = engine.guard.enabled
        _drop(engine)
    ref = mixed()
    out["ref_losses"], _ = reference(ref, 4, world, 32)
    out["ref_state"] = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return out


def sc_init_values(rank: int, world: int) -> dict:
    """zerocore.init with rank r seeding r, against the whole build of rank 0's seed."""
    out = {}
    torch.manual_seed(rank)
    with zerocore.init(config()):
        model = mixed_unseeded()
    out["chunks"] = [p._zc_init.chunk.numel() * world >= p._zc_init.numel for p in model.parameters()]
    engine = zerocore.initialize(model, config())
    out["state_init"] = engine.full_state_dict()
    out["losses_init"] = train(engine, 2, rank, world, 32)
    _drop(engine)
    engine = zerocore.initialize(mixed(), config())
    out["state_whole"] = engine.full_state_dict()
    out["losses_whole"] = train(engine, 2, rank, world, 32)
    _drop(engine)
    return out


def _diverge(rank: int, world: int, model: Stack, skip_rank: int, skip: int, at_step: int, **zero) -> dict:
    engine = zerocore.initialize(model, config(**zero))
    t0 = time.perf_counter()
    out = {"error": None, "step": None}
    try:
        for step in range(at_step + 1):
            x, _ = batch(step, MICRO * world, 32)
            t0 = time.perf_counter()
            y = engine(x[rank * MICRO:(rank + 1) * MICRO], skip=skip if (rank == skip_rank and step == at_step)
                       else None)
            engine.backward(y.square().mean())
            engine.step()
    except zerocore.DivergenceError as e:
        out["error"], out["step"] = str(e), step
    out["seconds"] = time.perf_counter() - t0
    # after the error the process group still works: one more collective, then the next scenario
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    out["after"] = t.item()
    _drop(engine)
    return out


def sc_diverge_same_size(rank: int, world: int) -> dict:
    # rank 1 skips blocks.1 in its first forward: rank 0 gathers blocks.1, rank 1 blocks.2
    return _diverge(rank, world, stack(), skip_rank=1, skip=1, at_step=0)


def sc_diverge_other_size(rank: int, world: int) -> dict:
    # blocks.1 is twice the size of the others; without the check the mismatched all-gathers abort gloo
    model = stack(block=lambda i: Wide(32) if i == 1 else nn.Linear(32, 32))
    return _diverge(rank, world, model, skip_rank=1, skip=1, at_step=0)


def sc_diverge_later_step(rank: int, world: int) -> dict:
    # in the third step (orders recorded), without prefetch: the skip shows at the next gather
    return _diverge(rank, world, stack(), skip_rank=1, skip=2, at_step=2, stage3_prefetch_bucket_size=0)


def sc_diverge_prefetched(rank: int, world: int) -> dict:
    """The default config (prefetch on): rank 1 skips blocks.1 in the third step only; the steps
    after it run the same modules on both ranks."""
    engine = zerocore.initialize(stack(), config())
    out = {"error": None, "step": None}
    try:
        for step in range(5):
            x, _ = batch(step, MICRO * world, 32)
            y = engine(x[rank * MICRO:(rank + 1) * MICRO], skip=1 if (rank == 1 and step == 2) else None)
            engine.backward(y.square().mean())
            engine.step()
    except zerocore.DivergenceError as e:
        out["error"], out["step"] = str(e), step
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    out["after"] = t.item()
    _drop(engine)
    return out


def sc_diverge_stop(rank: int, world: int) -> dict:
    """Rank 1 stops issuing zerocore collectives (it leaves the loop and waits on a barrier):
    rank 0 raises after stage3_divergence_timeout, then meets rank 1 at that barrier."""
    model = stack()
    engine = zerocore.initialize(model, config(stage3_divergence_timeout=3))
    out = {"error": None}
    t0 = time.perf_counter()
    if rank == 0:
        try:
            x, _ = batch(0, MICRO * world, 32)
            engine(x[:MICRO])
        except zerocore.DivergenceError as e:
            out["error"] = str(e)
    out["seconds"] = time.perf_counter() - t0
    dist.barrier()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    out["after"] = t.item()
    _drop(engine)
    return out


SCENARIOS = {f.__name__[3:]: f for f in [
    sc_init_memory, sc_init_trap, sc_gathered_engine, sc_gathered_bf16, sc_gathered_persistent, sc_gathered_in_forward,
    sc_check_disabled, sc_init_values,
    sc_diverge_same_size, sc_diverge_other_size, sc_diverge_later_step, sc_diverge_prefetched, sc_diverge_stop]}


# -- spawning ---------------------------------------------------------------------------------------
def _entry(rank: int, world: int, init_file: str, out_dir: str, names: list[str]) -> None:
    torch.set_num_threads(1)  # ranks share 2 cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {}
        for name in names:
            t0 = time.perf_counter()
            try:
                r = SCENARIOS[name](rank, world)
            except Exception:
                r = {"exception": traceback.format_exc()}
            r["wall"] = time.perf_counter() - t0
            results[name] = r
            torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
            if "exception" in r:
                break  # the other ranks may be stuck in a collective
    finally:
        dist.destroy_process_group()


def spawn(names: list[str], world: int, tmp_dir, timeout: float = SPAWN_TIMEOUT) -> list[dict]:
    """Runs the scenarios on ``world`` gloo ranks; fails if a rank exits abnormally (a SIGABRT
    raises ProcessExitedException) or the whole run takes longer than ``timeout``."""
    tmp_dir = str(tmp_dir)
    ctx = mp.start_processes(_entry, args=(world, os.path.join(tmp_dir, "pg"), tmp_dir, names), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
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


W4 = ["init_values", "diverge_same_size"]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn([n for n in SCENARIOS if n != "init_values"], 2, tmp_path_factory.mktemp("s3ctx2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return spawn(W4, 4, tmp_path_factory.mktemp("s3ctx4"))


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
    """fp32 against the reference, as tests/test_stages.py: each element within rtol 1e-5 (atol
    1e-6), except up to 1% of a tensor (elements whose gradient is near zero, where summation
    order is noise that Adam scales up to lr-sized steps), with the tensor's training delta
    within 1e-4 of the reference's."""
    assert got.keys() == want.keys()
    for k in want:
        bad = ~torch.isclose(got[k], want[k], rtol=1e-5, atol=1e-6)
        if bad.any():
            rd = relative_delta_error(got[k], want[k], init[k])
            assert bad.float().mean() <= 0.01 and rd <= 1e-4, f"{k}: {int(bad.sum())} elements off, delta error {rd:.3g}"


# -- 1. zerocore.init: memory while building and training; values from rank 0 -----------------------
def test_init_keeps_memory_under_the_limit(world2):
    for r in results(world2, "init_memory"):
        full_params = 4 * r["psi"]  # fp32
        stage0_state = 16 * r["psi"]  # a whole (stage 0) run: fp32 params, grads, Adam m and v
        # building: rank's share (1/2) plus a block or two whole; a whole build holds all of it
        assert r["build_peak_init"] <= 0.6 * full_params, (r["build_peak_init"], full_params)
        assert r["build_peak_whole"] > 0.6 * full_params  # the limit means something
        assert r["empty_after_build"]
        assert set(r["shapes"].values()) == {(MEM_D, MEM_D), (MEM_D,)}
        # training: sharded states plus the units gathered at a time, against a whole run
        assert r["train_peak_init"] <= 0.6 * stage0_state, (r["train_peak_init"], stage0_state)
        assert r["train_peak_stage0"] > 0.6 * stage0_state


def test_init_does_not_change_values(world2):
    rs = results(world2, "init_memory")
    state = same_on_every_rank(rs, "state_init")
    for r in rs:
        # rank r seeded with r under zerocore.init: rank 0's values, exactly as a whole build
        assert r["losses_init"] == r["losses_whole"]
        for k, v in r["state_whole"].items():
            assert torch.equal(state[k], v), k
        assert_losses(r["losses_init"], r["losses_stage0"])


# -- 2. the in-place-after-partition trap, and the way out ----------------------------------------------
def test_change_after_partition_raises_naming_the_parameter(world2):
    for r in results(world2, "init_trap"):
        assert r["parent"] is not None and "'child.weight'" in r["parent"] and "modified in place" in r["parent"]
        assert "zerocore.gathered" in r["parent"]
        assert r["tinygpt"] is not None and "'tok.weight'" in r["tinygpt"]
        assert r["inplace"] is not None and "'blocks.2.bias'" in r["inplace"]
        assert r["assign"] is not None and "'blocks.2.weight'" in r["assign"] and ".data replaced" in r["assign"]


def test_parent_initializing_a_child_just_built_works(world2):
    # nn.MultiheadAttention zeroes out_proj.bias in its own __init__: not lost, not an error
    rs = results(world2, "init_trap")
    state = same_on_every_rank(rs, "blocks_state")
    ref = rs[0]["blocks_ref"]
    assert state.keys() == ref.keys()
    for k in ref:
        assert torch.equal(state[k], ref[k].float()), k
    assert torch.count_nonzero(state["0.attn.out_proj.bias"]) == 0
    assert torch.count_nonzero(state["0.attn.out_proj.weight"]) > 0


def test_gathered_modifier_fixes_the_trap(world2):
    rs = results(world2, "init_trap")
    state = same_on_every_rank(rs, "fixed_state")
    ref = rs[0]["ref_state"]
    for r in rs:
        assert r["fixed_empty"]
    for k in ref:  # rank 0's normal_ draw (std 0.3), on every rank, exactly
        assert torch.equal(state[k], ref[k]), k
    assert 0.2 < state["child.weight"].std() < 0.4
    assert_losses(rs[0]["fixed_losses"], rs[0]["ref_losses"])


# -- 3. gathered() on a stage-3 engine ----------------------------------------------------------------
def test_gathered_shows_full_params_and_discards_edits(world2):
    for r in results(world2, "gathered_engine"):
        assert r["yields_params"]
        for n, shape in r["seen_full"].items():
            assert shape == tuple(r["before_edit"][n].shape) and shape != (0,)
            assert r["seen_equal"][n], f"{n} inside gathered() differs from full_state_dict()"
            assert r["shape_after"][n] == (0,)  # partitioned again
        assert r["inside_sd_equal"]
        assert r["discarded"]


def test_gathered_modifier_rank_edit_reaches_every_rank_and_training(world2):
    rs = results(world2, "gathered_engine")
    after = same_on_every_rank(rs, "after_edit")
    before = rs[0]["before_edit"]
    want = before["blocks.1.weight"].clone()
    want[0] = 0.0
    want[1] += 1.0
    assert torch.equal(after["blocks.1.weight"], want)  # rank 0's edit; rank 1's (x3) discarded
    for k in before:
        if k != "blocks.1.weight":
            assert torch.equal(after[k], before[k]), k
    r = rs[0]
    assert_losses(r["losses_after"], r["ref_losses_after"])
    assert_states_close(same_on_every_rank(rs, "state_end"), r["ref_state_end"], stack().state_dict())


def test_gathered_bf16_edit_goes_into_the_fp32_master_of_that_param_only(world2):
    rs = results(world2, "gathered_bf16")
    after = same_on_every_rank(rs, "after")
    before = rs[0]["before"]
    inside = rs[0]["inside"]
    assert rs[0]["inside_dtype"] == "torch.bfloat16"
    assert torch.equal(inside.float(), before["blocks.1.weight"].bfloat16().float())
    want = inside.clone()
    want[0] += 1.0  # in bf16, as rank 0 did
    assert torch.equal(after["blocks.1.weight"], want.float())
    for k in before:
        if k == "blocks.1.weight":
            continue
        assert torch.equal(after[k], before[k]), k  # full fp32 values kept, also blocks.1.bias (same unit)
        assert not torch.equal(before[k], before[k].bfloat16().float()), f"{k}: no fp32 precision to lose?"
    assert_losses(rs[0]["losses"], rs[0]["ref_losses"], rtol=3e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gathered_persistent_params(world2, dtype):
    rs = results(world2, "gathered_persistent")
    before = rs[0][f"{dtype}_before"]
    discard = same_on_every_rank(rs, f"{dtype}_discard")
    modified = same_on_every_rank(rs, f"{dtype}_modified")
    for k in before:  # no modifier_rank: the whole (persistent) bias is restored too
        assert torch.equal(discard[k], before[k]), k
    for r in rs:
        assert torch.equal(r[f"{dtype}_discard_local"], before["blocks.0.bias"].to(DTYPE[dtype]).float())
        assert torch.equal(r[f"{dtype}_modified_local"], torch.full((32,), 0.5))
    assert torch.equal(modified["blocks.0.bias"], torch.full((32,), 0.5))  # rank 0's value, in the master too
    for k in before:
        if k != "blocks.0.bias":
            assert torch.equal(modified[k], before[k]), k
    assert rs[0][f"{dtype}_losses"] == rs[1][f"{dtype}_losses"] and all(map(math.isfinite, rs[0][f"{dtype}_losses"]))


DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


# -- 4. divergence -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, ranks_doing", [
    ("diverge_same_size", ("gathering unit 'blocks.1' (forward)", "gathering unit 'blocks.2' (forward)")),
    ("diverge_other_size", ("gathering unit 'blocks.1.up' (forward)", "gathering unit 'blocks.2' (forward)")),
    ("diverge_later_step", ("gathering unit 'blocks.2' (forward)", "gathering unit 'blocks.3' (forward)")),
])
def test_divergence_raises_on_every_rank(world2, name, ranks_doing):
    rs = results(world2, name)
    for r in rs:
        msg = r["error"]
        assert msg is not None, "no DivergenceError"
        assert "ranks diverged" in msg
        for rank, doing in enumerate(ranks_doing):
            assert f"rank {rank}: collective #" in msg and doing in msg, msg
        assert r["seconds"] < 30
        assert r["after"] == 1.0  # the process group still works afterwards
    assert rs[0]["error"] == rs[1]["error"]  # every rank names the same thing
    assert rs[0]["step"] == rs[1]["step"] == (2 if name == "diverge_later_step" else 0)


def test_divergence_with_prefetch_is_caught_in_the_step_it_happens(world2):
    for r in results(world2, "diverge_prefetched"):
        assert r["after"] == 1.0  # caught somewhere, on both ranks, the group still works (holds today)
        assert r["error"] is not None
        assert r["step"] == 2, f"caught in step {r['step']}, not the step rank 1 skipped a block in:\n{r['error']}"
        # caught by the end-of-forward order check, naming the first unit that differs on each rank
        assert "forward pass" in r["error"] and "rank 0: ran unit 'blocks.1'" in r["error"], r["error"]
        assert "rank 1: ran unit 'blocks.2'" in r["error"], r["error"]


def test_rank_that_stops_issuing_collectives_times_out(world2):
    r0, r1 = results(world2, "diverge_stop")
    assert r0["error"] is not None and "waited 3 s" in r0["error"] and "stage3_divergence_timeout" in r0["error"]
    assert "gathering unit 'blocks.0'" in r0["error"]
    assert 2.5 < r0["seconds"] < 30
    assert r1["error"] is None
    # both then met at rank 1's barrier and did one more collective: nothing left pending
    assert r0["after"] == r1["after"] == 1.0


# -- 5. the check disabled -----------------------------------------------------------------------------
def test_training_matches_reference_with_and_without_the_check(world2):
    rs = results(world2, "check_disabled")
    r = rs[0]
    assert r["guard_True"] and not r["guard_False"]
    for check in (True, False):
        assert_losses(r[f"losses_{check}"], r["ref_losses"])
        assert_states_close(same_on_every_rank(rs, f"state_{check}"), r["ref_state"], mixed().state_dict())


def test_gathered_inside_forward_waits_for_the_prefetch_in_flight(world2):
    for r in results(world2, "gathered_in_forward"):
        assert r["state_inside_forward"] == "ParamState.GATHERING"  # the case this covers
        assert torch.equal(r["seen"], r["want"])
        assert r["empty_after"]
        # no extra collective (the prefetched gather is used, not redone), same training
        assert r["headers_True"] == r["headers_False"]
        assert r["losses_True"] == r["losses_False"]


# -- world 4 -------------------------------------------------------------------------------------------
def test_world4_init_values_and_divergence(world4):
    rs = results(world4, "init_values")
    state = same_on_every_rank(rs, "state_init")
    for r in rs:
        assert all(r["chunks"])
        assert r["losses_init"] == r["losses_whole"]
        for k, v in r["state_whole"].items():
            assert torch.equal(state[k], v), k
    rs = results(world4, "diverge_same_size")
    for r in rs:  # rank 1 skipped blocks.1; the three others name it, and rank 1 names blocks.2
        msg = r["error"]
        assert msg is not None and msg == rs[0]["error"]
        for rank in range(4):
            doing = "blocks.2" if rank == 1 else "blocks.1"
            assert f"rank {rank}: collective #2, gathering unit '{doing}' (forward)" in msg, msg
        assert r["after"] == 6.0  # 0 + 1 + 2 + 3: the group still works
