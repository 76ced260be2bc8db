"""An autograd Function whose backward raises: for tests of a backward that fails after some gradients exist."""
from __future__ import annotations

import torch


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")
