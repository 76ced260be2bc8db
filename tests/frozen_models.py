"""Models with a frozen part for the tests of stage 3's partitioned frozen parameters
(tests/sharding/test_stage3_frozen.py, tests/checkpoint/test_checkpoint_frozen.py): the shape of a
LoRA model (a frozen base Linear with a trainable low-rank update in every block), a frozen input
layer (a unit with only frozen parameters), a frozen LayerNorm (small: stays whole) and a trainable
head; plus the one-process reference and the engine's training loop over the same global batches."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

LR, WD, MICRO, D_IN, D = 1e-2, 0.05, 2, 13, 32


class Adapted(nn.Module):
    """A frozen base Linear plus a trainable low-rank update (LoRA's shape)."""

    def __init__(self, d: int, r: int = 4):
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.down = nn.Linear(d, r, bias=False)
        self.up = nn.Linear(r, d, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.up(self.down(x)))


class FrozenNet(nn.Module):
    """embed (frozen, a unit of its own) -> norm (frozen, small) -> blocks (Adapted) -> head.
    ``frozen_blocks``: blocks frozen whole (units with only frozen parameters that backward passes
    through)."""

    def __init__(self, n: int = 4, d: int = D, d_in: int = D_IN, d_out: int = 5, frozen_blocks=(1, 2)):
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        self.embed.requires_grad_(False)
        self.norm = nn.LayerNorm(d)
        self.norm.requires_grad_(False)
        self.blocks = nn.ModuleList(Adapted(d) for _ in range(n))
        for i in frozen_blocks:
            self.blocks[i].requires_grad_(False)
        self.head = nn.Linear(d, d_out)

    def forward(self, x):
        h = self.norm(self.embed(x))
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def frozen_net(seed: int = 0, **kw) -> FrozenNet:
    torch.manual_seed(seed)
    return FrozenNet(**kw)


def config(stage: int = 3, dtype: str = "fp32", gas: int = 1, clip: float = 0.0, **zero) -> dict:
    z = {"stage": stage, "reduce_bucket_size": 2000}
    if stage == 3:  # every Linear weight partitioned; vectors of 32 elements and less (biases, norm) whole
        z.update(stage3_param_persistence_threshold=40, stage3_unit_min_params=100, stage3_divergence_timeout=30)
    z.update(zero)
    return {"zero_optimization": z, "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "gradient_clipping": clip, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "bf16": {"enabled": dtype == "bf16"}}


def batch(step: int, rows: int, d_in: int = D_IN, d_out: int = 5):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, d_in, generator=g), torch.randn(rows, d_out, generator=g)


def train(engine, steps: int, rank: int, world: int, first: int = 0, gas: int = 1,
          dtype=torch.float32) -> tuple[list[float], list[float]]:
    """``steps`` optimizer steps of ``gas`` micro-batches on the global batch of each step; returns
    (the mean loss over ranks of each micro-batch, the engine's gradient norm of each step)."""
    losses, norms = [], []
    for step in range(first, first + steps):
        x, y = batch(step, MICRO * world * gas)
        for k in range(gas):
            lo = (k * world + rank) * MICRO
            loss = nn.functional.mse_loss(engine(x[lo:lo + MICRO].to(dtype)).float(), y[lo:lo + MICRO])
            engine.backward(loss)
            engine.step()
            t = loss.detach().reshape(1).double()
            if dist.is_initialized():
                dist.all_reduce(t)
            losses.append(t.item() / world)
        norms.append(engine.global_grad_norm)
    return losses, norms


def reference(model: nn.Module, steps: int, world: int, first: int = 0, gas: int = 1,
              clip: float = 0.0) -> tuple[list[float], list[float]]:
    """One process, fp32 torch.optim.AdamW over the trainable parameters on the same batches:
    (the loss of each micro-batch, the gradient norm of each step before clipping)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    losses, norms = [], []
    for step in range(first, first + steps):
        x, y = batch(step, MICRO * world * gas)
        opt.zero_grad()
        for k in range(gas):
            rows = slice(k * world * MICRO, (k + 1) * world * MICRO)
            loss = nn.functional.mse_loss(model(x[rows]), y[rows])
            (loss / gas).backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf")).item())
        opt.step()
    return losses, norms


def frozen_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not p.requires_grad]
