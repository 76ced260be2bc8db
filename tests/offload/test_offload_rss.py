"""NVMe offload takes the optimizer state out of host memory for real: the process's RSS (read
from /proc in a fresh process per variant, so peaks never mix), not the tensors the engine
reports, is below CPU offload's by m and v (8 bytes a parameter at fp32 on a CPU device, where
the master is the parameter itself) less the pinned tile buffers."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks", "offload_rss.py")
MIB = 1 << 20


def run(variant, swap, width=1230, layers=4, sub_group=1 << 16, buffers=4):
    env = dict(os.environ, PYTHONPATH=ROOT, MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    cmd = [sys.executable, BENCH, "--child", variant, "--swap", str(swap), "--width", str(width), "--layers",
           str(layers), "--steps", "2", "--sub-group", str(sub_group), "--buffer-count", str(buffers)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_nvme_offload_rss_is_below_cpu_offload_by_the_moments(tmp_path):
    cpu, nvme = run("cpu", tmp_path), run("nvme", tmp_path)
    n = cpu["params"]  # about 6M parameters: m and v are 46 MiB
    buffers = 4 * (4096 + 12 * (1 << 16))
    expected = 8 * n - buffers
    for point, key in [("step2", "VmRSS"), ("step2", "VmHWM"), ("step1", "VmRSS")]:
        saved = cpu["points"][point][key] - nvme["points"][point][key]
        assert saved >= expected - 6 * MIB, (point, key, saved / MIB, expected / MIB)
    # after the first step NVMe's RSS does not grow (no fp32 staging copy of the parameters appears). Counted in
    # anonymous memory, where such a copy would be: the first step also maps in more of torch's own code (file
    # pages, 7-8 MiB with torch's CPU build, 14.5 with its CUDA build on a machine without a GPU)
    grown = nvme["points"]["step2"]["RssAnon"] - nvme["points"]["initialized"]["RssAnon"]
    assert grown < 2 * n, grown / MIB


def test_a_step_failing_mid_pass_puts_the_parameters_back(tmp_path, monkeypatch):
    """fp32 parameters in host memory take each tile's new values at once (no staging copy): a write
    failing after some tiles were stepped puts those tiles back from the committed records, and the
    next step gives what a run that never failed gives."""
    import torch

    import zerocore
    from zerocore.offload.nvme import SwapError

    def make():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
        return zerocore.initialize(m, {"train_micro_batch_size_per_gpu": 2, "optimizer": {
            "type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 2, "sub_group_size": 4096,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2}}})

    def step(engine, seed):
        g = torch.Generator().manual_seed(seed)
        engine.backward(engine(torch.randn(2, 64, generator=g)).pow(2).mean())
        engine.step()

    engine, twin = make(), make()
    for s in range(2):
        step(engine, s)
        step(twin, s)
    shard = engine.offload.shards[0]
    assert shard.staging is None and len(shard.tiles) >= 4
    before = engine.groups[0].owned_params_raw().clone()
    store, writes = shard.store, []
    real = store.write

    def failing(*args, **kwargs):
        writes.append(1)
        if len(writes) == 3:  # tiles 0..2 stepped and in the parameters, tile 2's write fails
            raise SwapError("injected write failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "write", failing)
    with pytest.raises(SwapError, match="injected"):
        step(engine, 2)
    assert torch.equal(engine.groups[0].owned_params_raw(), before)
    monkeypatch.setattr(store, "write", real)
    engine.zero_grad()
    step(engine, 2)
    step(twin, 2)
    for a, b in zip(engine.groups, twin.groups):
        assert torch.equal(a.owned_params_raw(), b.owned_params_raw())


def test_giving_the_device_gradient_back_lowers_the_rss(tmp_path):
    """Stage 2 with CPU offload gives the reduced gradient's memory back once it landed on the host
    (ShardedGroup.release_grad): the process holds 4 bytes a parameter less (fp32 on a CPU device) after a
    step, and its peak is no higher, against the same run keeping it."""
    keep, cpu = run("cpu_keep_grad", tmp_path), run("cpu", tmp_path)
    n = cpu["params"]
    saved = keep["points"]["step2"]["VmRSS"] - cpu["points"]["step2"]["VmRSS"]
    assert saved >= 4 * n - 6 * MIB, (saved / MIB, 4 * n / MIB)
    assert cpu["points"]["step2"]["VmHWM"] <= keep["points"]["step2"]["VmHWM"] + 2 * MIB
