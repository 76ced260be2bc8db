"""The ``zero_to_fp32.py`` a save leaves in its folder (zerocore/checkpoint/recovery.py), run as a
script, gives the model's full fp32 state dict; its command line is DeepSpeed's; and
``engine._change_recovery_script_permissions`` logs, not raises, as DeepSpeed's
(TestZeRONonDistributed::test_chmod_exception_handling)."""
from __future__ import annotations

import importlib.util
import os
import re
import stat
import subprocess
import sys

import pytest
import torch

import zerocore
import zerocore.deepspeed as deepspeed
from zerocore.checkpoint.recovery import NAME, SCRIPT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _engine(stage=2, face=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage}}
    engine = deepspeed.initialize(model=model, config=cfg)[0] if face else zerocore.initialize(model, cfg)
    for i in range(2):
        engine.backward(engine(torch.randn(2, 6, generator=torch.Generator().manual_seed(i))).square().mean())
        engine.step()
    return engine


def _run(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120, check=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_script_in_the_save_folder_consolidates_the_checkpoint(tmp_path, stage):
    engine = _engine(stage)
    save_dir = tmp_path / "ck"
    engine.save_checkpoint(str(save_dir))
    full = engine.full_state_dict()
    script = save_dir / NAME
    assert script.read_text() == SCRIPT and os.stat(script).st_mode & stat.S_IXUSR
    assert sorted(os.listdir(save_dir)) == ["global_step2", "latest", NAME]  # written atomically: no debris
    _run(str(script), str(save_dir), str(tmp_path / "out"))
    got = torch.load(tmp_path / "out" / "pytorch_model.bin")
    assert got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in full)
    engine.save_checkpoint(str(save_dir), tag="later")  # a second save replaces the script in place
    out = _run(str(script), str(save_dir), str(tmp_path / "st"), "-t", "global_step2", "--safe_serialization")
    from safetensors.torch import load_file

    got = load_file(out.stdout.split()[0])
    assert all(torch.equal(got[k], full[k]) for k in got) and set(got) <= set(full)


def test_the_command_line_is_deepspeeds():
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        pytest.skip("DeepSpeed is not installed")
    theirs = open(os.path.join(os.path.dirname(spec.origin), "utils", "zero_to_fp32.py"), encoding="utf-8").read()

    def options(text):
        main = text[text.index('if __name__ == "__main__":'):]
        return set(re.findall(r'"(-{1,2}\w+|\w+_dir)"', main))

    assert options(SCRIPT) == options(theirs)


def test_change_recovery_script_permissions_logs_a_failure(tmp_path, monkeypatch):
    engine = _engine(1, face=True)
    logged = []
    monkeypatch.setattr(deepspeed.utils.logger, "info", lambda msg, *a, **k: logged.append(msg))
    engine._change_recovery_script_permissions(os.path.join(str(tmp_path), "missing", NAME))
    assert len(logged) == 1 and "Could not change permissions" in logged[0]
    f = tmp_path / NAME
    f.write_text("")
    os.chmod(f, 0o644)
    engine._change_recovery_script_permissions(str(f))
    assert os.stat(f).st_mode & stat.S_IXUSR and len(logged) == 1
