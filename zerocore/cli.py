"""The `zerocore` command (also `python -m zerocore`)."""
from __future__ import annotations

import argparse
import json
import sys

from .cli_common import write_atomically


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zerocore", description="ZeRO sharded data parallelism for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="versions, which ops are prebuilt / JIT / unavailable and why")
    env.add_argument("--json", action="store_true", help="machine-readable output")
    docs = sub.add_parser("config-docs", help="print the config reference table (docs/config.md) from the schema")
    docs.add_argument("--write", metavar="PATH", help="write it to PATH instead of printing")
    demo = sub.add_parser("demo", help="a small demo training run")
    from . import demo as demo_mod

    demo_mod.add_arguments(demo)
    from .checkpoint import cli as checkpoint_cli
    from .planner import cli as planner_cli

    planner_cli.add_arguments(sub.add_parser("estimate", help="per-rank memory of a training run, and which "
                                             "configuration fits"))

    checkpoint_cli.add_subcommands(sub)
    args = parser.parse_args(argv)
    if args.command == "env":
        from .env_report import collect, render

        info = collect()
        print(json.dumps(info, indent=2) if args.json else render(info))
        return 0
    if args.command == "config-docs":
        from .config.docs import render

        if args.write:
            try:
                write_atomically(args.write, render())
            except OSError as e:
                print(f"zerocore config-docs: error: cannot write {args.write}: {e.strerror or e}", file=sys.stderr)
                return 2
        else:
            sys.stdout.write(render())
        return 0
    if args.command == "demo":
        return demo_mod.run(args)
    if args.command == "estimate":
        return planner_cli.run(args)
    if args.command in ("consolidate", "inspect"):
        return checkpoint_cli.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
