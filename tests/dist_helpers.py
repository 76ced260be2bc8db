"""Multi-rank test plumbing: spawn gloo ranks on this machine, run training cases in them, and
train the single-process torch.optim.AdamW reference on the same global batches.

One spawn runs a whole list of cases (importing torch in a fresh process costs seconds on
this 2-core machine), so tests share a spawn through a module-scoped fixture.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

import zerocore
from forked_ranks import start_ranks


# -- models -------------------------------------------------------------------------------------
class AwkwardMLP(nn.Module):
    """Odd sizes (nothing divides 2 or 4), a frozen layer, and a layer that is never used."""

    def __init__(self, frozen_and_unused: bool = False, width: int = 53):
        super().__init__()
        self.inp = nn.Linear(37, width)
        self.mid = nn.Linear(width, 29)
        self.out = nn.Linear(29, 11)
        self.extra = frozen_and_unused
        if frozen_and_unused:
            self.frozen = nn.Linear(29, 29)
            self.frozen.requires_grad_(False)
            self.unused = nn.Linear(7, 3)  # trainable, never called

    def forward(self, x):
        h = torch.nn.functional.gelu(self.inp(x))
        h = torch.tanh(self.mid(h))
        if self.extra:
            h = h + 0.5 * torch.tanh(self.frozen(h))
        return self.out(h)


class Inner(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Middle(nn.Module):
    """A unit with a unit inside it (with stage3_unit_classes ["Middle", "Inner"])."""

    def __init__(self, d: int):
        super().__init__()
        self.inner = Inner(d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return x + self.proj(self.inner(x))


class Head(nn.Module):
    """Reads another module's weight without registering it (a parameter used by a module other
    than its owner): the output projection uses the input embedding's matrix."""

    def __init__(self, emb: nn.Linear):
        super().__init__()
        self._emb = [emb]  # a list hides it from module registration
        self.bias = nn.Parameter(torch.zeros(emb.in_features))

    def forward(self, h):
        return nn.functional.linear(h, self._emb[0].weight.t()) + self.bias


class NestedNet(nn.Module):
    """Nested units, a module called twice in one forward, and a parameter read by a non-owner."""

    def __init__(self, d: int = 24):
        super().__init__()
        self.inp = nn.Linear(37, d)
        self.mids = nn.ModuleList(Middle(d) for _ in range(2))
        self.shared = Inner(d)  # called twice
        self.head = Head(self.inp)  # uses inp.weight (37 x d) transposed: d -> 37
        self.out = nn.Linear(37, 11)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for m in self.mids:
            h = m(h)
        h = self.shared(h)
        h = self.shared(h * 0.5)
        return self.out(torch.tanh(self.head(h)))


class SwapNet(NestedNet):
    """Runs its two middle blocks in the opposite order on every other forward: the recorded
    prefetch order goes wrong each step, so stage 3 must fall back to gathering on demand."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.inp(x))
        for m in (self.mids if self.calls % 2 else list(reversed(self.mids))):
            h = m(h)
        return self.out(torch.tanh(self.head(self.shared(h))))


def make_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return AwkwardMLP()
    if kind == "mlp_frozen_unused":
        return AwkwardMLP(frozen_and_unused=True)
    if kind == "nested":
        return NestedNet()
    if kind == "swap":
        return SwapNet()
    if kind == "mlp_big":  # ~1.1M parameters, for the memory checks
        return nn.Sequential(nn.Linear(513, 1023), nn.GELU(), nn.Linear(1023, 511), nn.GELU(), nn.Linear(511, 67))
    if kind == "gpt":
        from zerocore.demo import TinyGPT

        return TinyGPT(vocab=29, dim=32, layers=2, heads=2, ctx=12)
    if kind == "gpt_ckpt":  # every block under activation checkpointing (recomputed in backward)
        from zerocore.demo import TinyGPT

        class CheckpointedGPT(TinyGPT):
            def forward(self, idx):
                from torch.utils.checkpoint import checkpoint

                x = self.tok(idx) + self.pos[: idx.shape[1]]
                for b in self.blocks:
                    x = checkpoint(b, x, use_reentrant=False)
                return self.head(self.ln(x))

        return CheckpointedGPT(vocab=29, dim=32, layers=2, heads=2, ctx=12)
    raise ValueError(kind)


def make_batch(kind: str, step: int, rows: int, seed: int):
    """The global batch of one optimizer step: (inputs, targets), ``rows`` samples."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    if kind.startswith("gpt"):
        tokens = torch.randint(0, 29, (rows, 13), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    d_in, d_out = (513, 67) if kind == "mlp_big" else (37, 11)  # mlp, nested, swap: 37 -> 11
    return torch.randn(rows, d_in, generator=g), torch.randn(rows, d_out, generator=g)


def loss_fn(kind: str, out, y):
    if kind.startswith("gpt"):
        return nn.functional.cross_entropy(out.flatten(0, 1).float(), y.flatten())
    return nn.functional.mse_loss(out.float(), y)


# -- cases --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    name: str
    model: str
    stage: int
    steps: int = 10
    micro: int = 2  # samples per rank per micro-batch
    gas: int = 1
    clip: float = 0.0
    dtype: str = "fp32"  # fp32 | bf16 | fp16
    bucket: int = 500_000_000
    overlap: bool | None = None
    reduce_scatter: bool = True
    lr: float = 1e-2
    weight_decay: float = 0.05
    seed: int = 0
    inject_inf: tuple[int, int] | None = None  # (optimizer step, rank): an Inf gradient there
    fp16: dict = dataclasses.field(default_factory=dict)
    memory_only: bool = False  # one step, then report bytes held
    native_rs: bool = False  # the backend's own reduce-scatter even on gloo (the NCCL code path)
    zero: dict = dataclasses.field(default_factory=dict)  # more zero_optimization keys (stage 3's)
    init: bool = False  # build the model under zerocore.init (stage 3 construction-time partitioning)
    sample_peak: bool = False  # sample bytes held at every module's forward hooks (stage 3 peaks)
    generate: bool = False  # after training: eval + no_grad forwards (a greedy generation loop for gpt)

    def config(self) -> dict:
        z = {"stage": self.stage, "reduce_bucket_size": self.bucket, "reduce_scatter": self.reduce_scatter,
             **self.zero}
        if self.overlap is not None:
            z["overlap_comm"] = self.overlap
        return {"zero_optimization": z, "gradient_accumulation_steps": self.gas, "gradient_clipping": self.clip,
                "train_micro_batch_size_per_gpu": self.micro,
                "optimizer": {"type": "AdamW", "params": {"lr": self.lr, "weight_decay": self.weight_decay}},
                "bf16": {"enabled": self.dtype == "bf16"},
                "fp16": {"enabled": self.dtype == "fp16", **self.fp16}}


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def run_case(case: Case, rank: int, world: int) -> dict:
    """Trains ``case`` on this rank through zerocore.initialize; returns what the tests compare."""
    baseline = gc_tensor_bytes() if case.memory_only else 0
    if case.init:
        with zerocore.init(case.config()):
            model = make_model(case.model, case.seed)
    else:
        model = make_model(case.model, case.seed)
    if case.native_rs:
        from zerocore.comm import Comm
        from zerocore.config import load_config

        engine = zerocore.Engine(model, load_config(case.config()), Comm(dist.group.WORLD,
                                                                         reduce_scatter_via_all_reduce=False))
    else:
        engine = zerocore.initialize(model, case.config())
    dtype = DTYPES[case.dtype]
    rows = case.micro * case.gas * world
    out = {"losses": [], "norms": [], "scales": [], "skipped": []}
    peaks = {"gathered": 0, "gc": 0}
    if case.sample_peak:
        def sample(*_):
            peaks["gathered"] = max(peaks["gathered"], engine.memory_report()["gathered"])
            peaks["gc"] = max(peaks["gc"], gc_tensor_bytes() - baseline)
        for m in engine.module.modules():  # prepend: before the engine frees a unit after its forward
            m.register_forward_pre_hook(sample)
            m.register_forward_hook(sample, prepend=True)
    steps = 1 if case.memory_only else case.steps
    for step in range(steps):
        x, y = make_batch(case.model, step, rows, case.seed)
        for k in range(case.gas):
            lo = (k * world + rank) * case.micro
            xb, yb = x[lo:lo + case.micro], y[lo:lo + case.micro]
            if xb.is_floating_point():
                xb = xb.to(dtype)
            handle = None
            if case.inject_inf == (step, rank) and k == case.gas - 1:
                p = engine.module.out.weight  # an Inf in one gradient element on one rank only
                handle = p.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
            loss = loss_fn(case.model, engine(xb), yb)
            engine.backward(loss)
            if handle is not None:
                handle.remove()
            out["losses"].append(loss.item())
            engine.step()
        out["norms"].append(engine.global_grad_norm)
        out["scales"].append(engine.loss_scale)
        out["skipped"].append(engine.skipped_steps)
    out["peaks"] = peaks
    if case.generate:
        out["generated"] = generate(engine, case, dtype)
    out["memory"] = engine.memory_report()
    out["numel"] = sum(g.layout.numel for g in engine.groups)
    out["padded"] = sum(g.layout.padded for g in engine.groups)
    out["groups"] = len(engine.groups)
    out["bucket_numel"] = engine.reducer.pool.numel if engine.reducer.pool is not None else 0
    # everything alive now that was not before the model existed: the engine's tensors plus
    # this step's batch (a few KB)
    out["gc_bytes"] = gc_tensor_bytes() - baseline if case.memory_only else None
    if not case.memory_only:
        out["state"] = engine.full_state_dict()
    engine.reducer.remove_hooks()
    return out


@torch.no_grad()
def generate(engine, case: Case, dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) pairs of eval-mode, no-grad forwards of different shapes through the engine
    (for gpt: a greedy generation loop, one token at a time)."""
    engine.eval()
    pairs = []
    if case.model == "gpt":
        idx = torch.tensor([[1, 2, 3]])
        for _ in range(5):
            logits = engine(idx)
            pairs.append((idx.clone(), logits.float()))
            idx = torch.cat([idx, logits[:, -1].float().argmax(-1, keepdim=True)], dim=1)
    else:
        x, _ = make_batch(case.model, 999, 3, case.seed)
        for rows in (1, 3):
            pairs.append((x[:rows].clone(), engine(x[:rows].to(dtype)).float()))
    engine.train()
    return pairs


def gc_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process, found through the garbage
    collector: a count independent of the engine's own bookkeeping."""
    import gc

    gc.collect()  # engines of earlier cases (reference cycles) must not count as alive
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            try:
                st = obj.untyped_storage()
                st.data_ptr()
            except RuntimeError:  # (no storage of its own: a compiler's fake or functional tensor)
                continue
            if st.data_ptr() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


# -- the reference --------------------------------------------------------------------------------
def reference(case: Case, world: int) -> dict:
    """One process, fp32, torch.optim.AdamW on the concatenated global batch with a mean loss.
    Parameters unused in a step get a zero gradient (DeepSpeed's semantics, which zerocore
    follows: they still decay), instead of being skipped as torch does for ``grad is None``."""
    model = make_model(case.model, case.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=case.lr, weight_decay=case.weight_decay)
    rows = case.micro * case.gas * world
    losses, norms = [], []
    for step in range(case.steps):
        x, y = make_batch(case.model, step, rows, case.seed)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(case.model, model(x), y)
        loss.backward()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(params, case.clip if case.clip > 0 else math.inf)
        norms.append(norm.item())
        if case.inject_inf is not None and case.inject_inf[0] == step:
            norms[-1] = math.inf
            continue  # the engine skips this update; so does the reference
        opt.step()
    return {"losses": losses, "norms": norms, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "init": make_model(case.model, case.seed).state_dict()}


# -- spawning -------------------------------------------------------------------------------------
def _entry(rank: int, world: int, init_file: str, out_dir: str, cases: list, run=None) -> None:
    """One rank: every case through ``run(case, rank, world)`` (``run_case`` by default), each
    result (or the traceback of its failure) saved for the parent."""
    run = run_case if run is None else run
    torch.set_num_threads(1)  # ranks share 2 cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = []
        for case in cases:
            t0 = time.perf_counter()
            try:
                r = run(case, rank, world)
            except Exception:
                r = {"error": traceback.format_exc()}
            r["seconds"] = time.perf_counter() - t0
            results.append(r)
            if "error" in r:
                break  # the other ranks may be stuck in a collective; stop here
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn_cases(cases: list, world: int, tmp_dir, timeout: float = 600, run=None) -> list[list[dict]]:
    """Runs ``cases`` on ``world`` gloo ranks, each through ``run(case, rank, world)`` (a
    module-level function; ``run_case`` by default); returns results[rank][case]."""
    tmp_dir = str(tmp_dir)
    init_file = os.path.join(tmp_dir, "pg_init")
    ctx = start_ranks(_entry, (world, init_file, tmp_dir, cases, run), world)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"{world} ranks did not finish {len(cases)} cases in {timeout:.0f} s")
    return [torch.load(os.path.join(tmp_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def case_results(results: list[list[dict]], cases: list[Case], name: str) -> list[dict]:
    """Every rank's result of the case called ``name`` (fails with the rank's traceback if it raised)."""
    i = [c.name for c in cases].index(name)
    per_rank = []
    for rank, rs in enumerate(results):
        if i >= len(rs):
            raise AssertionError(f"rank {rank} stopped before case {name!r} (an earlier case failed)")
        if "error" in rs[i]:
            raise AssertionError(f"rank {rank} failed in case {name!r}:\n{rs[i]['error']}")
        per_rank.append(rs[i])
    return per_rank


def relative_delta_error(got: torch.Tensor, want: torch.Tensor, init: torch.Tensor) -> float:
    """|| (got - init) - (want - init) || / || want - init ||: how far the training update of a
    whole tensor is from the reference's, relative to that update."""
    d_ref = (want - init).double()
    return float(((got - init).double() - d_ref).norm() / d_ref.norm().clamp_min(1e-30))


def copy_case(case: Case, **changes) -> Case:
    return dataclasses.replace(copy.deepcopy(case), **changes)
