"""What a load costs in resident memory, measured from the process (VmHWM over VmRSS before it),
beside what the tensors say: a load stages the rank's state once (its bytes of fp32 master and
moments) in fresh memory and frees it after; an engine that keeps asynchronous-save buffers
stages in those and its resident memory does not grow."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import sys, torch, zerocore
from torch import nn

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

root, held = sys.argv[1], sys.argv[2] == "held"
torch.manual_seed(0)
e = zerocore.initialize(nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(8)]),
                        {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
e.backward(e(torch.randn(2, 1024, dtype=torch.bfloat16)).float().pow(2).mean())
e.step()
e.save_checkpoint(root + "/ck", tag="t")
if held:
    e.save_checkpoint(root + "/own", tag="a", async_save=True).wait()
e.load_checkpoint(root + "/ck", tag="t")  # first use: imports, the I/O pools and handles
base = rss("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
e.load_checkpoint(root + "/ck", tag="t")
state = sum(s.master.numel() for s in e.shards) * 12
print(rss("VmHWM:") - base, rss("VmRSS:") - base, state)
"""


@pytest.mark.parametrize("held", [False, True])
def test_a_load_holds_its_state_once_while_staging_and_nothing_after(tmp_path, held):
    import zerocore

    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path), "held" if held else "fresh"],
                       capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(zerocore.__file__)))
    assert r.returncode == 0, r.stderr
    peak, after, state = (int(x) for x in r.stdout.split()[-3:])
    print(f"state {state / 2**20:.1f} MiB; load peak RSS growth {peak / 2**20:.1f} MiB, after {after / 2**20:.1f} MiB")
    slack = 16 << 20  # a pooled I/O buffer and the small fetches
    if held:
        assert peak < 0.1 * state + slack, "staged in the buffers the engine keeps: no fresh memory"
    else:
        assert 0.8 * state < peak < 1.1 * state + slack, "the state staged once"
    assert after < slack, "the staging is freed when the load ends"
