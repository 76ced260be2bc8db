"""The engine under zerocore.debug.host_waits: ZEROCORE_DEBUG_HOST_WAITS=count|raise and the waits of
a steady-state step (issue 35).

The engine runs on this machine's CPU, and the mode counts its own CPU tensors as device tensors
(``device=engine.device``): an ``.item()`` of the engine's own tensors is where the same engine on a
GPU waits. Targets, per step after two warm-up steps: 0 at stages 0-3 with bf16 and clipping,
gradient accumulation, CPU optimizer offload, stage-3 parameter offload; at most 1 per boundary with
fp16 (the overflow decision, as torch's GradScaler). And the training result is the same bits with
the mode on as off.
"""
from __future__ import annotations

import pytest
import torch

import zerocore
from dist_helpers import DTYPES, Case, loss_fn, make_batch, make_model
from zerocore.debug import HostWaitError

ENV = "ZEROCORE_DEBUG_HOST_WAITS"


class Chatty(torch.nn.Module):
    """A model whose forward reads a value on the host (a user's wait the engine's count shows)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 1e9:  # the model's own wait
            y = y * 0
        return y


def _cfg(**kw) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **kw}


def test_count_mode_keeps_each_windows_waits_with_their_call_sites(monkeypatch):
    monkeypatch.setenv(ENV, "count")
    torch.manual_seed(0)
    e = zerocore.initialize(Chatty(), _cfg(gradient_accumulation_steps=2))
    assert e.host_waits_last_step is None
    for step in range(2):
        for _ in range(2):
            e.backward(e(torch.randn(2, 4)).pow(2).mean())
            e.step()
        log = e.host_waits_last_step
        assert log.count == 2, str(log)  # one per micro-batch's forward
        assert all(w.kind == "item" and w.site.endswith("in forward") and "test_host_waits_engine.py" in w.site
                   for w in log.waits)
    e.destroy()


def test_raise_mode_raises_at_the_wait(monkeypatch):
    monkeypatch.setenv(ENV, "raise")
    e = zerocore.initialize(Chatty(), _cfg())
    with pytest.raises(HostWaitError, match=r"test_host_waits_engine.py:\d+ in forward"):
        e(torch.randn(2, 4))
    e.destroy()


def test_unset_wraps_nothing(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    e = zerocore.initialize(Chatty(), _cfg())
    assert not {"forward", "backward", "step"} & e.__dict__.keys() and e.host_waits_last_step is None
    e.destroy()
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(ValueError, match="ZEROCORE_DEBUG_HOST_WAITS='sometimes': expected one of count, raise"):
        zerocore.initialize(Chatty(), _cfg())
