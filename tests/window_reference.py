"""The reference for tests whose engines end an accumulation window where the caller says (unmanaged accumulation,
coalesce_grad_reduction): one process, torch's AdamW, windows of ``n`` micro-batches of the 2-rank global batch,
each loss divided by its window's ``n``, gradients clipped; and the check of each rank's result against it (every
step's global gradient norm, every tensor)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from stage3_ranks import LR, MICRO, WD, batch, results


def adamw_windows(net, windows, d: int, clip: float, world: int = 2):
    """(state dict, each window's global norm before clipping) of AdamW over ``windows`` on ``net()``."""
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms, i = [], 0
    for n in windows:
        opt.zero_grad()
        for _ in range(n):
            x, y = batch(i, MICRO * world, d)
            (nn.functional.mse_loss(model(x), y) / n).backward()
            i += 1
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    assert min(norms) > 2 * clip  # the clip bites
    return model.state_dict(), norms


def assert_ranks_match(ranks, name: str, want: dict, norms: list[float]) -> list[dict]:
    """Each rank's ``norms`` and ``params`` against the reference; the ranks' records, for more checks."""
    rs = results(ranks, name)
    for rank, r in enumerate(rs):
        assert r["norms"] == pytest.approx(norms, rel=1e-5), f"{name} rank {rank}: global gradient norms"
        for k, w in want.items():
            torch.testing.assert_close(r["params"][k], w, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k: f"{name} rank {rank}, {k}: {m}")
    return rs
