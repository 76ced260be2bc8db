"""Run by test_host_heap.py in a fresh process: the resident set before and after an engine is built over a model
whose parameters came from the heap (glibc's mmap threshold raised first, as any earlier large free raises it).
Prints one JSON line."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from memory_helpers import rss  # noqa: E402

import zerocore  # noqa: E402
import zerocore.runtime.engine as engine_module  # noqa: E402

if sys.argv[1] == "off":  # what the build leaves without giving the freed pages back
    engine_module.give_back_freed = lambda: False


def rss_mib() -> float:
    return rss() / 2**20


cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
warm = zerocore.initialize(torch.nn.Linear(4, 4), cfg, frozen=True)  # the libraries and the process group loaded
warm.destroy()
del warm
x = torch.empty(20 << 20, dtype=torch.uint8)
del x  # glibc raises its mmap threshold to 20 MiB: the parameters below come from the heap
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])  # 64 MiB of fp32 parameters
before = rss_mib()
engine = zerocore.initialize(model, cfg, frozen=True)  # a 32 MiB bf16 copy kept, the fp32 originals freed
print(json.dumps({"delta_mib": rss_mib() - before, "held_mib": engine.memory_report()["total"] / 2**20}))
