"""``zerocore estimate``: the planner on the command line."""
from __future__ import annotations

import argparse
import json
import sys
import time


def _size(text: str) -> int:
    """Bytes from '80GiB', '512MiB', '1e9' or a plain number."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "b": 1}
    t = text.strip().lower()
    for u, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(u):
            t, scale = t[: -len(u)], mult
            break
    else:
        scale = 1
    try:
        v = float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 80GiB, 512MiB, 1e9)") from None
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive size, got {text!r}")
    return int(v)


def _count(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return v


def _positive(text: str) -> int:
    v = _count(text)
    if v != int(v):
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}")
    return int(v)


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("the model (one of)")
    src.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or its directory)")
    src.add_argument("--params", type=_count, help="parameters (with --layers and --hidden: a GPT of that shape)")
    src.add_argument("--layers", type=_positive)
    src.add_argument("--hidden", type=_positive)
    p.add_argument("--config", metavar="JSON", help="a zerocore/DeepSpeed config file (default: every sensible one)")
    p.add_argument("--ranks-per-node", type=_positive, default=None, help="default: the GPUs here, else 1")
    p.add_argument("--nodes", type=_positive, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="the training device (default: cuda "
                   "if present)")
    p.add_argument("--device-memory", type=_size, default=None, help="per rank (default: read from the GPU)")
    p.add_argument("--host-memory", type=_size, default=None, help="per node (default: this machine's)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="bf16", help="for generated configs")
    p.add_argument("--micro-batch", type=_positive, default=None)
    p.add_argument("--seq-len", type=_positive, default=None)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing on")
    p.add_argument("--nvme-path", default="/local_nvme", help="for generated NVMe configs")
    p.add_argument("--json", metavar="PATH", help="also write every plan and the recommendation as JSON")


def run(args) -> int:
    from ..config import ConfigError
    from .api import estimate
    from .report import render

    t0 = time.perf_counter()
    try:
        plans, advice = estimate(
            hf=args.hf_config, params=args.params, layers=args.layers, hidden=args.hidden, config=args.config,
            ranks_per_node=args.ranks_per_node, nodes=args.nodes, device=args.device,
            device_memory=args.device_memory, host_memory=args.host_memory, dtype=args.dtype,
            micro_batch=args.micro_batch, seq_len=args.seq_len, checkpointing=args.checkpointing,
            nvme_path=args.nvme_path, with_recommendation=True)
    except (ConfigError, ValueError, TypeError, FileNotFoundError, NotImplementedError) as e:
        print(f"zerocore estimate: error: {e}", file=sys.stderr)
        return 2
    print(render(plans, advice))
    print(f"planned in {time.perf_counter() - t0:.1f} s")
    if args.json:
        from ..cli_common import write_atomically

        write_atomically(args.json, json.dumps({"plans": plans, "recommendation": advice}, indent=1))
    return 0
