"""The README's examples run exactly as written: its python blocks, in order, on 2 gloo ranks
under torchrun (tests/readme_runner.py; only ``MyTransformer``, which the README leaves to the
reader, is given a small definition there), then its ``zerocore ...`` shell lines on the
checkpoint they saved. A README edit that breaks an example fails here."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")


def shell_lines() -> list[str]:
    """The README's ``zerocore ...`` commands (from its bash blocks), comments stripped."""
    with open(README, encoding="utf-8") as f:
        blocks = re.findall(r"^```bash\n(.*?)^```", f.read(), flags=re.S | re.M)
    lines = [line.split("#")[0].strip() for b in blocks for line in b.splitlines()]
    return [line for line in lines if line.startswith("zerocore ")]


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("readme")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "tests", "readme_runner.py"), README, str(work)]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"the README's python blocks failed under torchrun:\n{proc.stdout}\n{proc.stderr}"
    facts = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]
    return work, env, facts


def test_python_blocks_run_on_two_ranks(readme_run):
    _, _, facts = readme_run
    assert facts[0] == facts[1]
    f = facts[0]
    assert f["blocks"] >= 4
    # the engine example's full_state_dict: every parameter of its Sequential by name
    assert f["weights_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    # the stage-3 block: rank 0's in-place edit under gathered(modifier_rank=0) reached every rank
    assert f["stage"] == 3 and f["head_shape"] == [128, 128] and f["head_abs_sum"] == 0.0
    # the checkpoint block: saved, then loaded back with its client state
    assert f["client_state"] == {"epoch": 3} and f["loaded_path"].endswith("global_step0")
    assert f["offload_cfg"]["offload_optimizer"]["device"] == "cpu"


def test_shell_lines_run_on_the_saved_checkpoint(readme_run):
    work, env, _ = readme_run
    lines = shell_lines()
    assert any(line.startswith("zerocore inspect") for line in lines)
    assert any(line.startswith("zerocore consolidate") for line in lines)
    for line in lines:
        args = line.split()[1:]  # `zerocore X` is the console script for `python -m zerocore X`
        proc = subprocess.run([sys.executable, "-m", "zerocore"] + args, cwd=work, env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, f"{line!r} failed:\n{proc.stdout}\n{proc.stderr}"
    assert (work / "model.safetensors").stat().st_size > 0
