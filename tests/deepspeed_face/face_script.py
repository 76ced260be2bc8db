"""What the single-rank comparison scripts share (init_values_script.py, master_init_script.py, run by
``runner.run_one_rank``): the library ``ZC_FACE=deepspeed|zerocore`` picks, and their start (``--out``, one gloo
rank)."""
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
