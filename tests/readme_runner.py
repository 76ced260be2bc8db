"""Runs the README's python code blocks exactly as written, in order and in one namespace (as a
reader pasting them into one script would: the checkpoint block uses the ``engine`` of the blocks
before it), on every rank of a torchrun job, then records what they left behind in
``<out>/rank<N>.json`` for tests/project/test_readme_examples.py.

The only names the README leaves to the reader are given here, and nothing else is changed:
``MyTransformer`` is a small model with ``Block`` units (the class name the stage-3 block's
``stage3_unit_classes`` names) large enough to be partitioned (each matrix above the block's
``stage3_param_persistence_threshold``) and a ``head``.

    torchrun --nproc-per-node 2 tests/readme_runner.py README.md OUT_DIR
"""
from __future__ import annotations

import json
import os
import re
import sys

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int = 128):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class MyTransformer(nn.Module):
    """The README's placeholder for the user's model."""

    def __init__(self, dim: int = 128, layers: int = 2):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(dim) for _ in range(layers)))
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        return self.head(self.blocks(x))


def python_blocks(readme: str) -> list[str]:
    with open(readme, encoding="utf-8") as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)


def main(readme: str, out_dir: str) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    ns = {"__name__": "__readme__", "MyTransformer": MyTransformer}
    blocks = python_blocks(readme)
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md python block {i + 1}", "exec"), ns)
    engine = ns["engine"]
    head = engine.full_state_dict()["head.weight"]
    facts = {"blocks": len(blocks), "stage": engine.config.zero_optimization.stage,
             "head_abs_sum": float(head.abs().sum()), "head_shape": list(head.shape),
             "client_state": ns.get("client_state"), "loaded_path": ns.get("path"),
             "offload_cfg": ns["cfg"]["zero_optimization"], "weights_keys": sorted(ns["weights"])}
    # a clean end for torchrun: the engine gives the model back, then the group is torn down
    engine.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
