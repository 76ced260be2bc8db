"""What the comparison scripts share: the library ``ZC_FACE=deepspeed|zerocore`` picks; the single-rank scripts'
start (init_values_script.py, master_init_script.py, run by ``runner.run_one_rank``: ``--out``, one gloo rank); and
the multi-rank scripts' case loop (no_optimizer_script.py, run by ``runner.launch``: ``each_case``)."""
import argparse
import datetime
import os


def library():
    """``deepspeed`` itself, or ``zerocore.deepspeed`` under ``ZC_FACE=zerocore``: nothing else differs."""
    if os.environ.get("ZC_FACE") == "zerocore":
        import zerocore.deepspeed as deepspeed
    else:
        import deepspeed
    return deepspeed


def start(deepspeed) -> str:
    """Parses ``--out`` and joins the one-rank gloo group; returns the path to save the values to."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # 120 s, not gloo's default: a rank that never joins a collective (DeepSpeed's own stage-3 trace check
    # once hung so in CI) fails the run in two minutes instead of costing CI ten
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
    return args.out


def each_case(deepspeed, run) -> None:
    """The multi-rank scripts' protocol (``runner.launch``): ``--out`` and ``--cases`` (a JSON list of objects with a
    "name"), the gloo group joined (120 s timeout, as ``start``), and ``run(case, rank)``'s record written as JSON to
    ``<out>/<name>/rank<r>.json`` for each case."""
    import json

    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
    rank = torch.distributed.get_rank()
    for case in json.loads(args.cases):
        rec = run(case, rank)
        os.makedirs(os.path.join(args.out, case["name"]), exist_ok=True)
        with open(os.path.join(args.out, case["name"], f"rank{rank}.json"), "w") as f:
            json.dump(rec, f)
