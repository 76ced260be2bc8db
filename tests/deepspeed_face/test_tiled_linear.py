"""``deepspeed.zero.TiledLinear`` / ``TiledLinearReturnBias`` (``zerocore/deepspeed/runtime/zero/tiling.py``):
the tiles hold the slices of the linear layer they replace (DeepSpeed's split rule), compute what it computes
forward and backward on odd sizes, and at stage 3 each tile is partitioned and gathered on its own while the
model trains as the same tiled model under torch.optim.AdamW; ``copy_params_from`` works on a stage-3 model."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zerocore
import zerocore.deepspeed as deepspeed
from zerocore.deepspeed.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias, even_parts


def test_even_parts_match_deepspeeds_partition_uniform():
    assert even_parts(23, 5) == [0, 5, 10, 15, 19, 23]
    assert even_parts(40, 32) == [0] + [i + min(i, 8) for i in range(1, 33)]
    assert even_parts(7, 7) == list(range(8)) and even_parts(9, 1) == [0, 9]
    assert deepspeed.zero.TiledLinear is TiledLinear  # (the face's names)


@pytest.mark.parametrize("in_splits, out_splits", [(1, 1), (2, 2), (5, 5), (32, 32), (3, 7)])
def test_tiles_hold_the_slices_of_the_layer(in_splits, out_splits):
    torch.manual_seed(0)
    base = nn.Linear(32, 40)
    tiled = TiledLinear(32, 40, in_splits=in_splits, out_splits=out_splits, init_linear=copy.deepcopy(base))
    for o in range(out_splits):
        r = slice(tiled.out_parts[o], tiled.out_parts[o + 1])
        for i in range(in_splits):
            tile = tiled.linears[o][i]
            assert isinstance(tile, nn.Linear)
            assert torch.equal(tile.weight, base.weight[r, tiled.in_parts[i]:tiled.in_parts[i + 1]])
            if i == in_splits - 1:
                assert torch.equal(tile.bias, base.bias[r])
            else:
                assert tile.bias is None


@pytest.mark.parametrize("in_splits, out_splits", [(0, 1), (33, 1), (1, 0), (1, 41)])
def test_split_counts_out_of_range_are_refused(in_splits, out_splits):
    with pytest.raises(RuntimeError, match="splits must be in"):
        TiledLinear(32, 40, in_splits=in_splits, out_splits=out_splits)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_f, out_f, in_splits, out_splits", [(32, 32, 2, 2), (23, 29, 3, 4), (29, 23, 5, 1)])
def test_forward_and_backward_equal_the_layer(in_f, out_f, in_splits, out_splits, bias):
    torch.manual_seed(1)
    base = nn.Linear(in_f, out_f, bias=bias).double()
    tiled = TiledLinear(in_f, out_f, bias=bias, in_splits=in_splits, out_splits=out_splits,
                        init_linear=copy.deepcopy(base)).double()
    x = torch.randn(3, 5, in_f, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    want, got = base(x), tiled(x2)
    assert torch.allclose(got, want, atol=1e-12)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    assert torch.allclose(x2.grad, x.grad, atol=1e-12)
    for o, row in enumerate(tiled.linears):
        r = slice(tiled.out_parts[o], tiled.out_parts[o + 1])
        for i, tile in enumerate(row):
            assert torch.allclose(tile.weight.grad, base.weight.grad[r, tiled.in_parts[i]:tiled.in_parts[i + 1]])
            if tile.bias is not None:
                assert torch.allclose(tile.bias.grad, base.bias.grad[r])
    # the input given as its column runs, the output returned as its row runs
    split = TiledLinear(in_f, out_f, bias=bias, in_splits=in_splits, out_splits=out_splits,
                        input_is_already_split=True, combine_out_splits=False, init_linear=base).double()
    runs = list(torch.split(x.detach(), [b - a for a, b in zip(split.in_parts, split.in_parts[1:])], dim=-1))
    assert torch.allclose(torch.cat(split(runs), dim=-1), want.detach(), atol=1e-12)


class ReturnsBias(nn.Linear):
    """Megatron-LM's shape: (x @ W.T, bias), the bias not added."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight), self.bias


def test_return_bias_variant():
    torch.manual_seed(2)
    base = nn.Linear(12, 10)
    tiled = TiledLinearReturnBias(12, 10, in_splits=3, out_splits=2, linear_cls=ReturnsBias, init_linear=base)
    x = torch.randn(4, 12)
    out, bias = tiled(x)
    assert torch.allclose(out, nn.functional.linear(x, base.weight), atol=1e-6) and torch.equal(bias, base.bias)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 48)
        self.tiled = TiledLinear(48, 40, in_splits=2, out_splits=3)
        self.out = nn.Linear(40, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.tiled(torch.tanh(self.inp(x)))))


def test_stage3_gathers_each_tile_and_trains_as_the_tiled_model():
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_unit_min_params": 1}}
    torch.manual_seed(3)
    model = Net()
    plain = copy.deepcopy(model)
    engine = zerocore.initialize(model, cfg)
    tiles = [t for row in model.tiled.linears for t in row]
    assert all(t.weight.numel() == 0 for t in tiles)  # partitioned: each tile gathered when it runs
    seen = []
    for t in tiles:
        t.register_forward_pre_hook(lambda m, a: seen.append(m.weight.numel()))
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)  # (the config's: DeepSpeed's default)
    for step in range(3):
        torch.manual_seed(10 + step)
        x, y = torch.randn(4, 16), torch.randn(4, 4)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        opt.zero_grad()
        want = nn.functional.mse_loss(plain(x), y)
        want.backward()
        opt.step()
        assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert seen and all(n > 0 for n in seen)
    got = engine.full_state_dict()
    for k, v in plain.state_dict().items():
        assert torch.allclose(got[k], v, atol=1e-6), k
    # copy_params_from on the partitioned model: every tile takes its slice
    source = nn.Linear(48, 40)
    model.tiled.copy_params_from(source)
    got = engine.full_state_dict()
    assert torch.equal(got["tiled.linears.1.0.weight"], source.weight[14:27, 0:24])
    assert torch.equal(got["tiled.linears.2.1.bias"], source.bias[27:40])
    assert all(t.weight.numel() == 0 for t in tiles)
