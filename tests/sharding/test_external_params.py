"""Stage 3 with parameters used outside their owning unit's forward, against one-process torch AdamW:

- a parameter (or a view of one) returned by its owner and read by the caller (``return out, self.bias``,
  DeepSpeed's "dangling" external parameter; DeepSpeed keeps it for the caller by itself): one level and
  two levels up, under non-reentrant activation checkpointing, under ``no_grad``;
- a parameter reached by reference (a list), registered with ``register_external_parameter`` (DeepSpeed's
  call): before or after ``initialize``; and the call's refusals.

Each: every step's loss and each tensor after three steps equal the plain model's, and no unit is left
gathered after the step. World 1 (the parameters are freed to empty stand-ins as on several ranks; the
gathers these paths add are the on-demand ones stage 3's 2-rank tests run)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import zerocore
from zerocore.runtime.misuse import EMPTY_PARAMETER_NOTE
from zerocore.sharding.state import ParamState

D = 8


def _engine(model):
    z = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 1}
    return zerocore.initialize(model, {"zero_optimization": z, "gradient_clipping": 0,
                                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}})


def _gathered(engine) -> list:
    return [g.index for g in engine.groups + engine.frozen_groups if g.param_state.value is not ParamState.SHARDED]


def _train_beside_adamw(model, steps=3, make_input=lambda: torch.randn(2, D)):
    """Trains ``model`` under zerocore and a copy under torch AdamW on the same inputs; checks each
    step's loss, each tensor after, and that nothing stays gathered. Returns the engine (alive)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    engine = _engine(model)
    torch.manual_seed(1)
    for step in range(steps):
        x = make_input()
        loss = engine(x.clone()).sum()
        engine.backward(loss)
        engine.step()
        want = ref(x.clone()).sum()
        want.backward()
        opt.step()
        opt.zero_grad()
        assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6), step
        assert _gathered(engine) == [], step
    _same_tensors(engine, ref)
    return engine


def _same_tensors(engine, ref) -> None:
    """Every tensor of the engine's model equals the reference model's."""
    got = engine.full_state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


class ReturnsBias(torch.nn.Linear):
    """Returns its own bias (or a view of its weight) beside its output."""

    def __init__(self, view=False):
        super().__init__(D, D)
        self.view = view

    def forward(self, x):
        return super().forward(x), (self.weight.t() if self.view else self.bias)


class PassesItOn(torch.nn.Module):
    """A unit that calls ReturnsBias and returns the parameter further up (two levels)."""

    def __init__(self, view=False):
        super().__init__()
        self.inner = ReturnsBias(view)
        self.own = torch.nn.Linear(D, D)

    def forward(self, x):
        out, p = self.inner(torch.tanh(self.own(x)))
        return out, p


class Returned(torch.nn.Module):
    def __init__(self, levels=1, ckpt=False, view=False):
        super().__init__()
        self.first = torch.nn.Linear(D, D)
        self.mid = ReturnsBias(view) if levels == 1 else PassesItOn(view)
        self.head = torch.nn.Linear(D, 1)
        self.ckpt, self.view = ckpt, view

    def _body(self, x):
        out, p = self.mid(torch.tanh(self.first(x)))
        return torch.tanh(out @ p if self.view else out + p)  # the parameter read after its owner's forward

    def forward(self, x):
        h = checkpoint(self._body, x, use_reentrant=False) if self.ckpt else self._body(x)
        return self.head(h)


@pytest.mark.parametrize("levels,ckpt,view", [(1, False, False), (2, False, False), (1, True, False),
                                              (2, True, False), (1, False, True), (2, True, True)])
def test_a_parameter_returned_by_its_owner_is_kept_for_the_caller(levels, ckpt, view):
    torch.manual_seed(0)
    model = Returned(levels, ckpt, view)
    engine = _train_beside_adamw(model)
    with torch.no_grad():  # no autograd hooks: the caller still reads the whole parameter
        x = torch.randn(2, D)
        want = engine.full_state_dict()
        plain = Returned(levels, ckpt, view)
        plain.load_state_dict(want)
        torch.testing.assert_close(engine(x), plain(x))
    assert _gathered(engine) == []
    engine.destroy()


class ByReference(torch.nn.Module):
    """Uses another module's weight through a list: no attribute of the owner is read."""

    def __init__(self, weight):
        super().__init__()
        self.refs = [weight]
        self.own = torch.nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(F.linear(self.own(x), self.refs[0]))


class Borrowing(torch.nn.Module):
    def __init__(self, register=True):
        super().__init__()
        self.owner = torch.nn.Linear(D, D)
        self.user = ByReference(self.owner.weight)
        self.head = torch.nn.Linear(D, 1)
        if register:
            zerocore.register_external_parameter(self.user, self.owner.weight)

    def forward(self, x):
        return self.head(self.user(torch.tanh(self.owner(x))))


def test_a_registered_external_parameter_is_gathered_for_its_user():
    torch.manual_seed(0)
    _train_beside_adamw(Borrowing()).destroy()


def test_without_the_registration_the_parameter_is_empty_there():
    """What the registration is for: the reference holds the empty stand-in while its owner is sharded."""
    torch.manual_seed(0)
    engine = _engine(Borrowing(register=False))
    with pytest.raises(RuntimeError, match=r"vec \(0\)") as info:
        engine(torch.randn(2, D))
    # the error is torch's; a note under it says what a size of 0 at stage 3 likely is and what to do
    assert info.value.__notes__ == [EMPTY_PARAMETER_NOTE]
    engine.destroy()
    plain = zerocore.initialize(Borrowing(register=False), {"zero_optimization": {"stage": 2}})
    # an empty input at stage 2: the same kind of message ("2x0"), and no partitioned parameter to note
    with pytest.raises(RuntimeError, match=r"\(2x0 and") as info:
        plain(torch.randn(2, 0))
    assert not getattr(info.value, "__notes__", None)
    plain.destroy()


def test_a_registration_made_after_initialize_reaches_the_engine():
    torch.manual_seed(0)
    model = Borrowing(register=False)
    ref = copy.deepcopy(model)
    engine = _engine(model)
    zerocore.register_external_parameter(model.user, model.owner.weight)
    zerocore.register_external_parameter(model.user, model.owner.weight)  # twice is once
    assert zerocore.sharding.external.external_parameters(model.user) == [model.owner.weight]
    x = torch.randn(2, D)
    want = ref(x)
    torch.testing.assert_close(engine(x), want)
    engine.destroy()


def test_register_and_unregister_refuse_what_they_cannot_mean():
    lin, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="not a torch.nn.Parameter"):
        zerocore.register_external_parameter(lin, torch.zeros(2))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        zerocore.register_external_parameter(object(), other.weight)
    with pytest.raises(RuntimeError, match="not a registered external parameter"):
        zerocore.unregister_external_parameter(lin, other.weight)
    zerocore.register_external_parameter(lin, other.weight)
    zerocore.unregister_external_parameter(lin, other.weight)
    assert zerocore.sharding.external.external_parameters(lin) == []


def test_deepcopy_of_a_registering_module_registers_the_copy():
    """The record holds the parameters, not their ids: a deep copy's record names the copy's parameter."""
    model = Borrowing()
    twin = copy.deepcopy(model)
    assert zerocore.sharding.external.external_parameters(twin.user)[0] is twin.owner.weight


def test_the_deepspeed_face_has_the_calls():
    from zerocore.deepspeed import zero
    from zerocore.deepspeed.runtime import zero as runtime_zero
    from zerocore.deepspeed.runtime.zero import partition_parameters

    assert zero.register_external_parameter is zerocore.register_external_parameter
    assert runtime_zero.register_external_parameter is zerocore.register_external_parameter
    assert partition_parameters.unregister_external_parameter is zerocore.unregister_external_parameter
