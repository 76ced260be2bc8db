"""Jobs end cleanly: the process groups zerocore creates, its workers and its NVMe swap stores are
torn down at engine.destroy() and at interpreter exit, so a two-rank job that trained correctly
exits 0 (it used to end in SIGABRT, "terminate called without an active exception", in 3 to 6
runs of 10). The repeated torchrun runs are how it failed; the in-process tests check what each
teardown leaves."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

import zerocore
from zerocore.comm import Comm, lifetime

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "exit_job.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def run_job(stage: int, offload: str, destroy: int, nodes: int, swap_dir: str, timeout: float = 240) -> list:
    """Exit codes and output of one two-rank job: one torchrun with two ranks, or two torchruns of
    one rank each meeting over c10d rendezvous (two "nodes" on this machine)."""
    args = [JOB, str(stage), offload, str(destroy), swap_dir]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        cmds = [torchrun + ["--nproc_per_node", "2", "--master_port", str(free_port())] + args]
    else:
        rdzv = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"exit{os.getpid()}"]
        cmds = [torchrun + rdzv + args for _ in range(2)]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
             for c in cmds]
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            text += "\n(timed out)"
        out.append((p.returncode, text))
    return out


def assert_clean(results, what):
    for rc, text in results:
        assert rc == 0, f"{what}: exit code {rc}\n{text[-3000:]}"
        assert "terminate called" not in text, f"{what}\n{text[-3000:]}"
        assert "round 0 loss" in text, f"{what}: the job did not train\n{text[-3000:]}"


# -- the way it failed: whole jobs, repeated ---------------------------------------------------
def test_two_rank_jobs_exit_cleanly_quick(tmp_path):
    """Stage 3 with CPU offload, never destroyed; stage 2 destroyed and re-initialized."""
    assert_clean(run_job(3, "cpu", 0, 1, str(tmp_path)), "stage 3, cpu offload, no destroy()")
    assert_clean(run_job(2, "none", 2, 1, str(tmp_path)), "stage 2, destroy() then a second engine")


def test_a_rank_dying_of_an_exception_with_a_collective_queued_exits_at_once(tmp_path):
    """Exit does not destroy the groups after an uncaught exception (gloo would first run the queued
    collective, waiting up to the group's 120 s timeout): both ranks end well before that."""
    import time

    t0 = time.perf_counter()
    (rc, text), = run_job(2, "none", 3, 1, str(tmp_path), timeout=130)
    assert rc != 0 and "rank 0 fails after training" in text and "(timed out)" not in text, text[-3000:]
    assert time.perf_counter() - t0 < 120  # rank 1 sleeps 150 s: torchrun stopped it when rank 0 ended


MATRIX = [(s, off, d, n) for n in (1, 2) for s in (0, 1, 2, 3) for off in ("none", "cpu", "nvme") for d in (0, 1)
          if not (s == 0 and off != "none") and not (n == 2 and off == "nvme")]


@pytest.mark.slow
@pytest.mark.parametrize("stage,offload,destroy,nodes", MATRIX)
def test_two_rank_jobs_exit_cleanly(stage, offload, destroy, nodes, tmp_path):
    for _ in range(int(os.environ.get("ZC_EXIT_REPEATS", "2"))):
        assert_clean(run_job(stage, offload, destroy, nodes, str(tmp_path)),
                     f"stage {stage}, offload {offload}, destroy {destroy}, {nodes} node(s)")


# -- what each teardown leaves ------------------------------------------------------------------
def small():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def train(engine, steps=2):
    for _ in range(steps):
        engine.backward(engine(torch.randn(4, 5)).pow(2).mean())
        engine.step()


@pytest.fixture
def torchrun_env(monkeypatch):
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    lifetime._R.base_store = None  # the next test's group gets a store of its own


def test_destroy_tears_down_the_group_zerocore_created_and_a_new_engine_creates_it_again(torchrun_env):
    engine = zerocore.initialize(small(), {"zero_optimization": {"stage": 2}})
    assert dist.is_initialized() and lifetime.owns_default()
    other = zerocore.initialize(small(), {"zero_optimization": {"stage": 1}})
    train(engine)
    engine.destroy()
    assert dist.is_initialized()  # another engine still uses it
    other.destroy()
    assert not dist.is_initialized()
    again = zerocore.initialize(small(), {"zero_optimization": {"stage": 3}})  # on the same store
    assert dist.is_initialized() and lifetime.owns_default()
    train(again)
    again.destroy()
    assert not dist.is_initialized()


def test_a_group_the_script_created_is_left_to_the_script(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        engine = zerocore.initialize(small(), {"zero_optimization": {"stage": 3}})
        train(engine)
        assert not lifetime.owns_default()
        side = Comm(lifetime.new_side_group(("test",), None))  # as the stage-3 header group is made on 2+ ranks
        engine.destroy()
        assert dist.is_initialized()
        assert len(dist.distributed_c10d._world.pg_map) == 2  # side groups are kept for the next engine
        lifetime.teardown()  # what interpreter exit runs: zerocore's side group goes, the script's group stays
        assert list(dist.distributed_c10d._world.pg_map) == [dist.distributed_c10d._get_default_group()]
        assert side.group is lifetime.RELEASED
    finally:
        dist.destroy_process_group()


def test_destroy_stops_the_host_step_worker(tmp_path):
    engine = zerocore.initialize(small(), {"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}}})
    train(engine)
    assert any(t.name == "zerocore-host-step" for t in threading.enumerate())
    engine.destroy()
    assert not any(t.name == "zerocore-host-step" for t in threading.enumerate())


@pytest.mark.parametrize("stage", [2, 3])
def test_destroy_closes_the_nvme_swap_stores(tmp_path, stage):
    z = {"stage": stage, "sub_group_size": 4096,
         "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2}}
    if stage == 3:
        z.update(stage3_param_persistence_threshold=0, offload_param={
            "device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0, "buffer_count": 2})
    engine = zerocore.initialize(small(), {"zero_optimization": z})
    train(engine)
    stores = [engine.offload.nvme.store] + ([engine.offload.param_swap.store] if stage == 3 else [])
    dirs = [s.dir for s in stores]
    assert all(os.listdir(d) for d in dirs)
    model = engine.module
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.destroy()
    for s, d in zip(stores, dirs):
        assert not os.path.exists(d), f"{d} still there after destroy()"
        for h in (s.reader, *s.writers):
            with pytest.raises(ValueError, match="closed"):
                h.wait()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the model came back with its values
