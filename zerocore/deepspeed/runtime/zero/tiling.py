"""``deepspeed.runtime.zero.tiling`` (``deepspeed.zero.TiledLinear``): a linear layer built from a grid of
smaller ones, so that under stage 3 each tile is gathered on its own (a unit of its own where
``stage3_unit_min_params`` or ``stage3_unit_classes`` make it one) and a layer too large to gather whole
still runs.

Tile ``[o][i]`` maps input columns ``in_parts[i]:in_parts[i+1]`` to output rows ``out_parts[o]:out_parts[o+1]``;
only the last tile of each output row has a bias. The forward sums each output row's tiles and joins the rows,
so it computes what one ``Linear`` with the joined weight and bias computes. Splits are as even as possible, the
first ones one element larger (DeepSpeed's ``partition_uniform``)."""
from __future__ import annotations

import torch
from torch import nn


def even_parts(items: int, parts: int) -> list[int]:
    """The ``parts + 1`` boundaries of ``items`` split into ``parts`` runs, the first ``items % parts`` one longer."""
    size, extra = divmod(items, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + size + (1 if i < extra else 0))
    return bounds


class TiledLinear(nn.Module):
    """``nn.Linear(in_features, out_features, bias)`` as ``out_splits`` x ``in_splits`` tiles of ``linear_cls``
    (extra keyword arguments go to it). ``input_is_already_split``: ``forward`` takes the input's column runs
    as a list; ``combine_out_splits=False``: it returns the output's row runs as a list. ``init_linear``: a
    linear layer whose weight (and bias) the tiles copy."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls=nn.Linear, init_linear=None, **kwargs):
        super().__init__()
        if not 1 <= in_splits <= in_features:
            raise RuntimeError(f"TiledLinear: in_splits must be in [1, in_features={in_features}]; got {in_splits}")
        if not 1 <= out_splits <= out_features:
            raise RuntimeError(f"TiledLinear: out_splits must be in [1, out_features={out_features}]; got "
                               f"{out_splits}")
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split, self.combine_out_splits = input_is_already_split, combine_out_splits
        self.in_parts = even_parts(in_features, in_splits)
        self.out_parts = even_parts(out_features, out_splits)
        self.linears = nn.ModuleList(
            nn.ModuleList(linear_cls(self.in_parts[i + 1] - self.in_parts[i], self.out_parts[o + 1] - self.out_parts[o],
                                     bias=bias and i == in_splits - 1, **kwargs) for i in range(in_splits))
            for o in range(out_splits))
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_):
        if self.in_splits == 1:
            inputs = [input_]
        elif self.input_is_already_split:
            inputs = list(input_)
            if len(inputs) != self.in_splits:
                raise ValueError(f"TiledLinear: got {len(inputs)} input splits; in_splits is {self.in_splits}")
        else:
            sizes = [b - a for a, b in zip(self.in_parts, self.in_parts[1:])]
            inputs = self._split_global_input(input_, sizes)
        outputs = []
        for o in range(self.out_splits):
            out = None
            for i in range(self.in_splits):
                out = self._reduce_local_output(i, o, out, self.linears[o][i](inputs[i]))
            outputs.append(out)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _split_global_input(self, input, split_sizes):
        """The input's column runs (override for other input types)."""
        return torch.split(input, split_sizes, dim=-1)

    def _reduce_local_output(self, in_id, out_id, current_out, new_out):
        """``new_out`` (tile ``[out_id][in_id]``'s output) added to the row's sum so far (override to combine
        other output types)."""
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs):
        """The output rows joined along the last dimension (override to join other output types)."""
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other) -> None:
        """Copies ``other``'s weight (and bias) into the tiles. Under stage 3 a collective: every rank calls it,
        rank 0's values are the ones kept (``GatheredParameters(..., modifier_rank=0)`` per tile)."""
        from ...zero import GatheredParameters

        want = (self.out_features, self.in_features)
        if tuple(other.weight.shape) != want:
            raise ValueError(f"TiledLinear.copy_params_from: weight of shape {tuple(other.weight.shape)}; this layer "
                             f"is {want}")
        if self.use_bias != (getattr(other, "bias", None) is not None):
            raise ValueError(f"TiledLinear.copy_params_from: this layer has {'a' if self.use_bias else 'no'} bias, "
                             f"the source {'has' if getattr(other, 'bias', None) is not None else 'has none'}")
        for o, row in enumerate(self.linears):
            r0, r1 = self.out_parts[o], self.out_parts[o + 1]
            for i, tile in enumerate(row):
                c0, c1 = self.in_parts[i], self.in_parts[i + 1]
                with GatheredParameters(tile.weight, modifier_rank=0):
                    tile.weight.copy_(other.weight[r0:r1, c0:c1])
                if tile.bias is not None:
                    with GatheredParameters(tile.bias, modifier_rank=0):
                        tile.bias.copy_(other.bias[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """Tiles of a ``linear_cls`` returning ``(output, bias)`` (Megatron-LM's layers): the outputs are summed and
    joined as ``TiledLinear``'s, the biases (one per output row, from its tile that has one) joined."""

    def _reduce_local_output(self, in_id, out_id, current_out, new_out):
        tensor, bias = new_out
        old_tensor, old_bias = current_out if current_out is not None else (None, None)
        return super()._reduce_local_output(in_id, out_id, old_tensor, tensor), (old_bias if bias is None else bias)

    def _combine_output_splits(self, outputs):
        tensor = super()._combine_output_splits([t for t, _ in outputs])
        biases = [b for _, b in outputs if b is not None]
        return tensor, (super()._combine_output_splits(biases) if biases else None)


__all__ = ["TiledLinear", "TiledLinearReturnBias", "even_parts"]
