"""The native per-group helpers of stage 3 (``zerocore.ops.params``) against what they replace:
``p.data = v`` per parameter, the checked ``ops.pack`` plus ``p.grad = None``, ``t.register_hook``
and nn.Module's attribute lookup."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zerocore import ops
from zerocore.ops import params as params_mod
from zerocore.ops.params import param_ops

OPS = param_ops()


def test_set_data_shows_each_value_and_keeps_the_parameter_objects():
    ps = [nn.Parameter(torch.zeros(0)), nn.Parameter(torch.zeros(0))]
    flat = torch.arange(10.0)
    views = [flat[0:6].view(2, 3), flat[6:10]]
    OPS.set_data(ps, views)
    assert ps[0].shape == (2, 3) and torch.equal(ps[0], views[0]) and torch.equal(ps[1], views[1])
    assert ps[0].data_ptr() == flat.data_ptr()  # a view, not a copy
    empty = torch.empty(0)
    OPS.set_data(ps, [empty, empty])
    assert ps[0].numel() == 0 and ps[1].numel() == 0
    with pytest.raises(ValueError, match="2 parameters but 1 values"):
        OPS.set_data(ps, [empty])


def test_pack_grads_matches_the_checked_pack_and_drops_the_grads():
    ps = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(4))]
    ps[0].grad, ps[2].grad = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0, 7.0])
    offsets = [0, 3, 9]
    want = torch.full((16,), 9.0)
    ops.pack([ps[0].grad, ps[2].grad], [0, 9], want)  # gaps (the grad-less slot, padding) zeroed
    got = torch.full((16,), 9.0)
    assert OPS.pack_grads(ps, offsets, got) is not False
    assert torch.equal(got, want)
    assert all(p.grad is None for p in ps)


def test_pack_grads_refuses_what_needs_the_checked_path_and_touches_nothing():
    p = nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    flat = torch.full((8,), 9.0, dtype=torch.float64)  # another dtype than the gradient's
    assert OPS.pack_grads([p], [0], flat) is False
    assert p.grad is not None and torch.equal(flat, torch.full((8,), 9.0, dtype=torch.float64))


def _refused(grads, offsets, flat) -> None:
    ps = [nn.Parameter(torch.zeros(g.shape)) for g in grads]
    for p, g in zip(ps, grads):
        p.grad = g
    before = flat.clone()
    assert OPS.pack_grads(ps, offsets, flat) is False
    assert all(p.grad is g for p, g in zip(ps, grads)), "a refused pack dropped a gradient"
    assert torch.equal(flat, before), "a refused pack wrote into the bucket"


def test_pack_grads_refuses_each_rule_the_cpu_and_cuda_packs_share():
    """binding_grads.h's rules, one broken at a time (the CUDA pack applies the same function)."""
    flat = torch.full((16,), 9.0)
    ok = torch.ones(4)
    _refused([ok, torch.ones(4)], [4, 2], flat)  # offsets not ascending (overlapping slots)
    _refused([ok], [14], flat)  # past the bucket's end
    _refused([torch.ones(8)[::2]], [0], flat)  # not contiguous
    _refused([torch.ones(2, 2).to_sparse()], [0], flat)  # sparse: no element array
    freed = torch.ones(4)
    freed.untyped_storage().resize_(0)  # no memory behind it (stage 3 frees storages so)
    _refused([freed], [0], flat)
    _refused([flat[4:8]], [0], flat)  # shares memory with the bucket
    _refused([ok], [0], torch.full((16,), 9.0)[::2])  # a bucket that is not contiguous


def test_call_before_node_runs_when_the_node_runs_and_raises_through_backward():
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    calls = []
    assert OPS.call_before_node(y, lambda: calls.append(x.grad))
    y.sum().backward()
    assert calls == [None]  # before the node ran (x's gradient not yet accumulated)
    assert OPS.call_before_node(x, lambda: None) is False  # a leaf: no node made it

    z = x * 3

    def fail():
        raise RuntimeError("named failure from the hook")

    OPS.call_before_node(z, fail)
    with pytest.raises(RuntimeError, match="named failure from the hook"):
        z.sum().backward()


def test_python_equivalents_match_when_the_extension_lacks_them(monkeypatch):
    monkeypatch.setattr(params_mod, "_ops", None)
    monkeypatch.setattr(params_mod._loader, "load", lambda op="": object())  # an extension without them
    py = param_ops()
    assert py.make_access_getattr is None
    ps = [nn.Parameter(torch.zeros(0))]
    py.set_data(ps, [torch.ones(2)])
    assert torch.equal(ps[0], torch.ones(2))
    ps[0].grad = torch.ones(2)
    assert py.pack_grads(ps, [0], torch.zeros(4)) is False  # the caller's checked pack does it
    y = torch.ones(2, requires_grad=True) * 2
    seen = []
    assert py.call_before_node(y, lambda: seen.append(1))
    y.sum().backward()
    assert seen == [1]


class _Gatherer:
    def __init__(self):
        self.accessed = []

    def on_access(self, p):
        self.accessed.append(p)


@pytest.mark.skipif(OPS.make_access_getattr is None, reason="the native extension predates make_access_getattr")
def test_native_access_getattr_reads_as_nn_module_and_tells_the_gatherer_of_empty_parameters():
    lin = nn.Linear(2, 2)
    lin.register_buffer("buf", torch.ones(1))
    getattr_ = OPS.make_access_getattr(nn.Module.__getattr__)
    hooked = type("Linear", (nn.Linear,), {"__getattr__": getattr_})
    lin.__class__ = hooked
    g = lin.__dict__["_zc_gatherer"] = _Gatherer()
    assert lin.weight is lin._parameters["weight"] and torch.equal(lin.buf, torch.ones(1))
    assert g.accessed == []
    lin.weight.data = torch.empty(0)  # freed: the read tells the gatherer first
    assert lin.weight is lin._parameters["weight"] and g.accessed == [lin._parameters["weight"]]
    with pytest.raises(AttributeError, match="no_such"):
        lin.no_such
    assert not hasattr(lin, "no_such")


def test_pack_grads_on_a_cpu_device_is_the_native_cpu_one():
    from zerocore.ops.params import pack_grads_on

    assert pack_grads_on(torch.device("cpu")) is OPS.pack_grads
