"""``zerocore consolidate`` and ``zerocore inspect``: the offline checkpoint tools on the command
line (registered in ``zerocore/cli.py``)."""
from __future__ import annotations

import argparse
import json


def add_subcommands(sub) -> None:
    c = sub.add_parser("consolidate", help="write a checkpoint's weights as safetensors (one process, streaming)")
    c.add_argument("ckpt_dir", help="the save_dir (its 'latest' tag, or --tag) or a tag directory")
    c.add_argument("--tag", default=None)
    c.add_argument("--out", required=True, help="FILE.safetensors (sharded: FILE-0000i-of-0000n.safetensors "
                                                "and FILE.safetensors.index.json)")
    c.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    c.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB (default 5GB)")
    i = sub.add_parser("inspect", help="what a checkpoint holds: world size, stage, dtype, steps, parameters, bytes")
    i.add_argument("ckpt_dir")
    i.add_argument("--tag", default=None)
    i.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from .offline import consolidate, inspect

    if args.command == "consolidate":
        for path in consolidate(args.ckpt_dir, args.out, tag=args.tag, dtype=args.dtype,
                                max_shard_size=args.max_shard_size):
            print(path)
        return 0
    info = inspect(args.ckpt_dir, tag=args.tag)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for k, v in info.items():
            print(f"{k:<{width}}  {v}")
    return 0
