"""`zerocore demo`: train a small character-level GPT on the corpus shipped in the package, on
2 local ranks over gloo, with the ZeRO stage chosen by ``--stage``: a progress bar, the loss,
each rank's model-state memory against stage 0, and the time per step.

The ranks are started by torchrun (``python -m torch.distributed.run``), the launcher users
use too; under torchrun (RANK in the environment) this runs one rank's training instead.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

import torch
from torch import nn


def load_corpus() -> str:
    path = os.path.join(os.path.dirname(__file__), "data", "corpus.txt")
    with open(path, encoding="ascii") as f:
        return "".join(line for line in f if not line.startswith("# "))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int = 128, layers: int = 2, heads: int = 4, ctx: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(ctx, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        nn.init.normal_(self.tok.weight, std=0.02)  # N(0,1) would make the tied logits huge

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


HEADS = 4
WINDOW = 10  # steps averaged at each end of the run to judge that the loss went down
# What the model learned, shown on a line of the corpus: its guess for every next character from
# the characters before it, beside the text, before and after training. A model this small and
# this briefly trained (300 steps, ~30 s) gets words' continuations, spaces and common short words
# right and little else; a free-running sample from it (greedy: "the the the ...", or drawn at a
# temperature: near-words and long runs of indentation spaces) hides that, the guesses show it.
PASSAGE = "Assignment statements are used to (re)bind names to values and to"


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3),
                   help="ZeRO stage (default 3: parameters partitioned too, one unit per Block)")
    p.add_argument("--ranks", type=_at_least(1), default=2, help="local gloo ranks started with torchrun (default 2)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="training dtype (bf16: fp32 master)")
    p.add_argument("--steps", type=_at_least(1), default=300)
    p.add_argument("--batch", type=_at_least(1), default=8, help="sequences per rank per step")
    p.add_argument("--ctx", type=_at_least(1), default=64, help="characters per sequence")
    p.add_argument("--dim", type=_at_least(HEADS), default=128, help=f"model width (a multiple of {HEADS})")
    p.add_argument("--layers", type=_at_least(0), default=2)
    p.add_argument("--lr", type=_positive_float, default=3e-3)
    p.add_argument("--bucket", type=_positive_float, default=5e4, help="reduce_bucket_size in elements")
    p.add_argument("--seed", type=int, default=0)


def zero_config(args: argparse.Namespace, model: TinyGPT) -> dict:
    z = {"stage": args.stage, "reduce_bucket_size": int(args.bucket), "overlap_comm": True}
    if args.stage == 3:
        # This model is far below DeepSpeed's default persistence threshold (1e5 elements per
        # parameter), which would keep everything whole: partition every matrix (dim x dim and
        # larger, the embeddings) and keep only vectors (LayerNorms, biases: at most 4 x dim) whole.
        # One unit (one all-gather) per Block plus the root (embeddings, tied head), as FSDP2's
        # fully_shard per block; prefetch one block ahead.
        persist = 4 * args.dim + 1
        z["stage3_param_persistence_threshold"] = persist
        if len(model.blocks):
            block = sum(p.numel() for p in model.blocks[0].parameters() if p.numel() >= persist)
            z.update(stage3_unit_classes=["Block"], stage3_prefetch_bucket_size=block)
    return z


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with this combination of arguments (None: nothing), checked before any
    rank starts: a run that cannot fit fails here with the numbers, not in the OOM killer."""
    if args.dim % HEADS:
        return f"--dim must be a multiple of {HEADS} (the attention heads), got {args.dim}"
    corpus = os.path.getsize(os.path.join(os.path.dirname(__file__), "data", "corpus.txt"))
    if args.ctx > corpus // 2:
        return f"--ctx {args.ctx} is longer than the demo can sample from its {corpus // 1000} KB corpus (at most " \
               f"{corpus // 2})"
    need = activation_bytes(args) * args.ranks
    have = available_bytes()
    if have is not None and need > 0.8 * have:
        return (f"--ctx {args.ctx} with --batch {args.batch} needs about {need / 2**30:.1f} GiB for attention and "
                f"activations over {args.ranks} ranks, and this machine has {have / 2**30:.1f} GiB available; "
                "lower --ctx or --batch")
    return None


def activation_bytes(args: argparse.Namespace) -> int:
    """A rough upper estimate of one rank's activation memory (fp32): per layer the attention
    scores, their softmax and its gradient (batch x heads x ctx^2) and the mask (ctx^2 bytes),
    plus the token activations (about 16 x batch x ctx x dim per layer)."""
    attn = args.batch * HEADS * args.ctx ** 2 * 4 * 3 + args.ctx ** 2
    tokens = 16 * args.batch * args.ctx * args.dim * 4
    return max(1, args.layers) * (attn + tokens)


def available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run(args: argparse.Namespace) -> int:
    if "RANK" in os.environ:
        return train_rank(args)
    problem = check_arguments(args)
    if problem is not None:
        print(f"zerocore demo: error: {problem}", file=sys.stderr)
        return 2
    # Start the ranks with torchrun; each runs this same command. One thread per rank: the
    # ranks share this machine's cores.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
           "-m", "zerocore", "demo"] + [f"--{k}={v}" for k, v in vars(args).items()
                                        if k not in ("command", "ranks")]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print(f"zerocore demo: starting {args.ranks} ranks with torchrun (gloo, CPU)", flush=True)
    return subprocess.call(cmd, env=env)


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f} MB"


def guesses(engine, model: TinyGPT, stoi: dict, chars: list, ctx: int) -> tuple[str, str, int]:
    """(the text after PASSAGE's first character, the model's greedy guess for each of its
    characters from the ones before it, how many guesses are right). Every rank runs the forward
    (stage 3 gathers in it)."""
    text = PASSAGE[:ctx + 1]
    model.eval()
    with torch.no_grad():
        logits = engine(torch.tensor([[stoi[c] for c in text[:-1]]]))[0].float()
    model.train()
    guess = "".join(chars[i] for i in logits.argmax(-1).tolist())
    return text[1:], guess, sum(g == t for g, t in zip(guess, text[1:]))


def train_rank(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    import zerocore
    from zerocore.runtime.memory import formula_bytes

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    text = load_corpus()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    torch.manual_seed(args.seed)
    model = TinyGPT(len(chars), args.dim, args.layers, heads=HEADS, ctx=args.ctx)
    engine = zerocore.initialize(model, {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "bf16": {"enabled": args.dtype == "bf16"},
        "zero_optimization": zero_config(args, model),
    })
    n_params = sum(g.layout.numel for g in engine.groups)
    if rank == 0:
        print(f"{n_params / 1e6:.2f}M-parameter char GPT on {len(text) / 1e3:.0f} KB of text; ZeRO stage "
              f"{args.stage}, {world} ranks x {args.batch} sequences, {args.dtype}, {len(engine.groups)} flat groups, "
              f"{torch.get_num_threads()} thread(s) per rank", flush=True)
    # every rank draws its own batches from one seeded stream
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    before = guesses(engine, model, stoi, chars, args.ctx)
    losses, times = [], []
    bar = range(args.steps)
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(bar, desc=f"stage {args.stage}", unit="step", dynamic_ncols=True, mininterval=0.5)
    for _ in bar:
        starts = torch.randint(0, len(data) - args.ctx - 1, (args.batch,), generator=gen)
        x = torch.stack([data[s:s + args.ctx] for s in starts])
        y = torch.stack([data[s + 1:s + args.ctx + 1] for s in starts])
        t0 = time.perf_counter()
        logits = engine(x)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).to(torch.float32), y.flatten())
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        mean_loss = engine.comm.sum_floats([loss.item()])[0] / world
        losses.append(mean_loss)
        if rank == 0:
            bar.set_postfix(loss=f"{mean_loss:.3f}", ms=f"{times[-1] * 1e3:.0f}")
    mem = engine.memory_report()
    # every rank's total, collected on rank 0 in one small collective
    totals = engine.comm.sum_floats([mem["total"] if r == rank else 0.0 for r in range(world)])
    stage0 = formula_bytes(n_params, world, 0, half=dtype != torch.float32)
    # two windows that do not overlap (the first and the last steps), each at most WINDOW long
    w = min(WINDOW, len(losses) // 2)
    judged = w >= 1 and len(losses) >= WINDOW
    first = sum(losses[:max(w, 1)]) / max(w, 1)
    last = sum(losses[-max(w, 1):]) / max(w, 1)
    med = sorted(times[len(times) // 5:] or times)[len(times[len(times) // 5:] or times) // 2]  # after warm-up
    after = guesses(engine, model, stoi, chars, args.ctx)
    if rank == 0:
        bar.close()
        n = max(w, 1)
        print(f"loss (cross-entropy per character, mean over ranks; a uniform guess scores "
              f"{math.log(len(chars)):.3f}): step 1 {losses[0]:.3f}; mean of steps 1-{n} {first:.3f} -> mean of "
              f"steps {len(losses) - n + 1}-{len(losses)} {last:.3f}; median step {med * 1e3:.1f} ms")
        every = max(1, len(losses) // 10)
        print(f"loss curve (steps 1, {1 + every}, {1 + 2 * every}, ...): " +
              " ".join(f"{v:.3f}" for v in losses[::every]))
        print(f"model state held per rank (on rank 0: params {_mb(mem['params'])}, grads {_mb(mem['grads'])}, "
              f"master+m+v {_mb(mem['master'] + mem['exp_avg'] + mem['exp_avg_sq'])}"
              + (f", gradient buckets {_mb(mem['buckets'])}" if mem["buckets"] else "") +
              f"); stage 0 would hold {_mb(stage0)} (16 bytes/param) on each:")
        print("  " + ", ".join(f"rank {r} {_mb(t)} = {t / stage0:.2f}x" for r, t in enumerate(totals)))
        if engine.gatherer is not None:
            units = [u for u in engine.gatherer.units if u.padded]
            size = torch.empty((), dtype=engine.dtype).element_size()
            print(f"stage 3: {len(units)} units gathered one at a time (+ prefetch); peak gathered "
                  f"{_mb(engine.gatherer.peak_live * size)} (largest unit {_mb(max(u.padded for u in units) * size)})")
        text, _, _ = after
        print("next-character guesses on a line of the corpus (each from the characters before it; '|' = right):")
        print(f"  text:            {text}")
        for when, (_, guess, right) in (("before training:", before), ("after training: ", after)):
            shown = "".join(c if c.isprintable() else "_" for c in guess)  # a guessed newline: "_"
            print(f"  {when} {shown}  ({right}/{len(text)} right)")
        print("  right after:     " + "".join("|" if g == t else " " for g, t in zip(after[1], text)))
    ok = last < first or not judged
    if rank == 0 and not judged:
        print(f"(too few steps to judge the loss: give --steps {WINDOW} or more)")
    elif rank == 0 and not ok:
        print(f"error: the loss did not go down (mean of the first {w} steps {first:.3f}, of the last {w} {last:.3f})")
    engine.comm.sum_floats([0.0])  # no rank tears down the group while another still uses it
    dist.destroy_process_group()
    return 0 if ok else 1
