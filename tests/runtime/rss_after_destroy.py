"""Host memory (RSS) across an engine's life, in a fresh process: the model built and trained one step
with plain torch (what the process holds before any engine), the engine built and trained, then
``destroy()`` with the engine object still referenced, then ``del``. Prints one JSON line.

    python tests/runtime/rss_after_destroy.py --width 2048 --layers 14 --stage 2 --offload cpu

The default model is 14 x Linear(2048, 2048): 58.8M parameters, fp32 (issue 33's 59M case).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from memory_helpers import rss  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--offload", default="cpu", choices=["none", "cpu"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()

    import torch
    import zerocore

    gc.disable()  # what reference counting alone gives back
    torch.set_num_threads(2)
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    n = sum(p.numel() for p in model.parameters())
    x = torch.randn(args.batch, args.width)
    model(x).pow(2).mean().backward()  # torch's own first-use allocations, before any engine
    model.zero_grad(set_to_none=True)
    # a torch optimizer's first construction imports torch._dynamo (~75 MiB of modules that stay, whoever
    # made it): what any torch training script has paid before; the engine's first one would pay it too
    torch.optim.AdamW(model.parameters())
    points = {"model": rss()}
    zero = {"stage": args.stage}
    if args.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    engine = zerocore.initialize(model, {"train_micro_batch_size_per_gpu": args.batch, "zero_optimization": zero,
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    for _ in range(args.steps):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    del loss
    points["trained"] = rss()
    engine.destroy()  # `engine` stays referenced
    points["destroyed"] = rss()
    del engine
    points["deleted"] = rss()
    print(json.dumps({"params": n, "rss": points,
                      "destroyed_minus_model_MiB": (points["destroyed"] - points["model"]) / 2**20,
                      "trained_minus_model_MiB": (points["trained"] - points["model"]) / 2**20}))


if __name__ == "__main__":
    main()
