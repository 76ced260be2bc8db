"""``zerocore.debug.partitioned_reads``: each use of a stage-3 parameter while it is the empty stand-in is named with
the parameter and the call site (or raised on); training steps, ``zerocore.gathered`` and the reads whose answer
does not depend on the values name nothing; a parameter built under ``zerocore.init`` is named by what is known of
it; the mode is off outside its block. One rank, in this process."""
from __future__ import annotations

import pytest
import torch

import zerocore
from zerocore.debug import PartitionedReadError, partitioned_reads

D = 16
CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 100}}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh())
        self.head = torch.nn.Linear(D, 4)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.fixture
def engine():
    torch.manual_seed(0)
    e = zerocore.initialize(Net(), CFG)
    yield e
    e.destroy()


def _line_of(text: str) -> int:
    import inspect

    src, first = inspect.getsourcelines(_uses)
    return first + next(i for i, line in enumerate(src) if text in line)


def _uses(model, x):
    w = model.head.weight
    y = x @ w.t()  # a projection with a weight read after the forward returned (TRL's distillation loss did)
    n = w.shape[0]  # the stand-in's shape
    model.state_dict()  # empty tensors
    return y, n


def test_uses_outside_a_forward_are_named_with_their_site(engine):
    model, x = engine.module, torch.randn(3, D)
    with partitioned_reads() as log:
        for _ in range(2):  # training names nothing: the forward gathers what it reads
            engine.backward(engine(x).square().sum())
            engine.step()
        w = model.head.weight
        assert (w.dtype, w.device, w.requires_grad, w.is_leaf, w.grad, w.is_floating_point()) == (
            torch.float32, torch.device("cpu"), True, True, None, True)
        assert w.ds_shape == (4, D) and len({w, model.body[0].weight}) == 2  # DeepSpeed's attributes, hashing
        with zerocore.gathered([w]):  # gathered: its values are there
            whole = w.detach().clone()
        assert log.count == 0, str(log)
        with pytest.raises(RuntimeError):
            _uses(model, x)  # x @ w.t() of the empty stand-in fails (its shapes): named before it does
    assert [(r.param, r.what) for r in log.reads] == [("'head.weight'", "t")]
    assert log.reads[0].site.endswith(f"test_partitioned_reads.py:{_line_of('x @ w.t()')} in _uses"), str(log)
    assert whole.shape == (4, D)


def test_what_each_use_is(engine):
    model = engine.module
    w = model.head.weight
    with partitioned_reads() as log:
        w.shape
        w.numel()
        model.state_dict()
        repr(w)
    named = [(r.param, r.what) for r in log.reads]
    assert named[:2] == [("'head.weight'", "shape"), ("'head.weight'", "numel")]
    state = [n for n in named[2:] if n[1] == "detach"]
    assert sorted(p for p, _ in state) == ["'body.0.bias'", "'body.0.weight'", "'head.bias'", "'head.weight'"]
    assert named[-1] == ("'head.weight'", "__repr__")
    here = "test_partitioned_reads.py:"
    assert all(here in r.site for r in log.reads), str(log)  # the test's lines, not torch's
    assert "head.weight" in str(log) and "shape at" in str(log)


def test_raise_on_read_names_the_parameter_and_the_way_out(engine):
    w = engine.module.head.weight
    with pytest.raises(PartitionedReadError, match=r"sum of stage-3 parameter 'head.weight' at .*"
                                                   r"test_partitioned_reads.py:\d+ .*zerocore.gathered"):
        with partitioned_reads(raise_on_read=True):
            w.sum()
    w.sum()  # off outside the block


def test_a_parameter_built_under_zerocore_init_is_named_by_its_owner():
    with zerocore.init(CFG):
        model = Net()
    with partitioned_reads() as log:
        model.head.weight.sum()
        model.head.weight.dtype
    assert [str(r).split(" at ")[0] for r in log.reads] == [
        "(a Linear parameter of shape (4, 16), built under zerocore.init): sum"]


def test_whole_parameters_are_not_named():
    # below stage 3 (and persistent ones at stage 3) every parameter holds its values
    e = zerocore.initialize(Net(), {**CFG, "zero_optimization": {"stage": 2}})
    with partitioned_reads() as log:
        e.module.head.weight.sum()
        e.module.state_dict()
    assert log.count == 0
    e.destroy()
