"""Stage 3 under non-reentrant activation checkpointing, the cases DeepSpeed's own
``test_zero_activation_checkpoint_lifecycle.py`` builds (its checks read DeepSpeed's parameter
attributes; here: the numbers and the units' states): one module called recursively inside the
checkpoint, frozen weights in the recomputed region, ``set_checkpoint_early_stop``, an embedding
with no gradient consumer; and recoveries: an exception in the recompute, and one in the backward,
each followed by a clean retry. Each trains beside one-process torch AdamW (losses per step, every
tensor after) and leaves no unit gathered."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from test_external_params import D, _engine, _gathered, _same_tensors, _train_beside_adamw


def _frozen_linear():
    lin = torch.nn.Linear(D, D)
    lin.requires_grad_(False)
    return lin


class Recursive(torch.nn.Module):
    """One frozen block called three times deep inside one checkpoint."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(D, D) / D ** 0.5, requires_grad=False)

    def forward(self, x, depth):
        x = torch.tanh(F.linear(x, self.weight))
        return self(x, depth - 1) if depth else x


class RecursiveModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.shared, self.head = Recursive(), torch.nn.Linear(D, D)

    def forward(self, x):
        return self.head(checkpoint(self.shared, x, 2, use_reentrant=False))


class FrozenInside(torch.nn.Module):
    """A frozen and a trainable layer recomputed in backward; ``early_stop``: torch stops the recompute
    once the tensors backward needs exist (the rest of the function is not run again)."""

    def __init__(self, early_stop=False):
        super().__init__()
        self.frozen, self.trainable, self.head = _frozen_linear(), torch.nn.Linear(D, D), torch.nn.Linear(D, 1)
        self.early_stop = early_stop
        self.fail_recompute = False
        self.fail_backward = False
        self.recomputed = [0, 0]  # recomputes begun, recomputes that reached the tail

    def _body(self, x):
        in_recompute = torch._C._current_graph_task_id() != -1
        if self.fail_recompute and in_recompute:
            raise RuntimeError("injected recompute failure")
        self.recomputed[0] += in_recompute
        x = self.trainable(torch.tanh(self.frozen(x)))
        torch.cos(x.detach())  # a tail the early stop skips
        self.recomputed[1] += in_recompute
        return FailOnce.apply(x, self) if self.fail_backward else x

    def forward(self, x):
        with set_checkpoint_early_stop(self.early_stop):
            return self.head(checkpoint(self._body, x, use_reentrant=False))


class FailOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, owner):
        ctx.owner = owner
        return x

    @staticmethod
    def backward(ctx, grad):
        if ctx.owner.fail_backward:
            ctx.owner.fail_backward = False
            raise RuntimeError("injected backward failure")
        return grad, None


class FrozenEmbedding(torch.nn.Module):
    """A frozen embedding no gradient flows into, beside a trainable vector, inside the checkpoint."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(16, D)
        self.embedding.weight.requires_grad_(False)
        self.token = torch.nn.Parameter(torch.zeros(D))
        self.proj, self.head = torch.nn.Linear(D, D), torch.nn.Linear(D, 1)

    def _body(self, idx):
        return self.proj(self.embedding(idx) + self.token)

    def forward(self, idx):
        return self.head(torch.tanh(checkpoint(self._body, idx, use_reentrant=False)))


@pytest.mark.parametrize("make,inputs", [
    (RecursiveModel, lambda: torch.randn(2, D)),
    (FrozenInside, lambda: torch.randn(2, D)),
    (lambda: FrozenInside(early_stop=True), lambda: torch.randn(2, D, requires_grad=True)),
    (FrozenEmbedding, lambda: torch.randint(0, 16, (2, 4))),
], ids=["recursive", "frozen", "early_stop", "frozen_embedding"])
def test_checkpointed_regions_train_as_the_plain_model(make, inputs):
    torch.manual_seed(0)
    model = make()
    _train_beside_adamw(model, make_input=inputs).destroy()
    if getattr(model, "early_stop", False):  # the case is what it says: recomputed each step, tail skipped
        assert model.recomputed == [3, 0]


@pytest.mark.parametrize("where", ["recompute", "backward"])
def test_a_failure_inside_the_checkpointed_backward_leaves_a_clean_retry(where):
    torch.manual_seed(0)
    model = FrozenInside()
    ref = copy.deepcopy(model)
    engine = _engine(model)
    setattr(model, f"fail_{where}", True)
    with pytest.raises(RuntimeError, match=f"injected {where} failure"):
        engine.backward(engine(torch.randn(2, D)).sum())
    assert _gathered(engine) == []
    model.fail_recompute = False
    x = torch.randn(2, D, requires_grad=True)
    loss = engine(x).sum()
    loss.backward()  # torch's own backward, as DeepSpeed's test retries
    engine.step()
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    xr = x.detach().clone().requires_grad_(True)
    want = ref(xr).sum()
    want.backward()
    opt.step()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(x.grad, xr.grad)
    _same_tensors(engine, ref)
    assert _gathered(engine) == []
    engine.destroy()
