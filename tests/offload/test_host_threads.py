"""The host optimizer step's thread count (zerocore/offload/host_threads.py) and stages 1/2 handing
their host step to the worker thread (what they do on a GPU, forced here on the CPU with
``ZEROCORE_HOST_STEP_THREADS``): same bits as the inline step and as the run without offload, the
kernel really runs on the worker, and its error reaches the training thread as raised."""
from __future__ import annotations

import threading

import pytest
import torch

from dist_helpers import run_case, spawn_cases
from test_offload import CLIP, assert_same_bits, base_of, offloaded
from test_stages import check_against_reference
from zerocore import ops
from zerocore.offload import host_threads
from zerocore.offload.host_threads import ENV, cores_of_this_rank, host_step_threads, worker_at_stages_1_2

CUDA = torch.device("cuda", 0)  # only its type is read: nothing touches a GPU


def test_cpu_device_takes_the_training_threads_count(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert host_step_threads(torch.device("cpu")) == 3
    assert not worker_at_stages_1_2(torch.device("cpu"))


def test_gpu_device_takes_the_ranks_share_of_the_cores_not_torchs_count(monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 in every rank: the host step must not inherit it."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(host_threads.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(host_threads.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert host_step_threads(CUDA) == 15  # every core but the training thread's
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cores_of_this_rank() == 4 and host_step_threads(CUDA) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")  # more ranks than cores: still one thread
    assert host_step_threads(CUDA) == 1
    # a launcher bound this rank to 6 cores: they are its own, whatever the ranks
    monkeypatch.setattr(host_threads.os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    assert cores_of_this_rank() == 6 and host_step_threads(CUDA) == 5
    assert worker_at_stages_1_2(CUDA)


def test_env_sets_the_count_and_bad_values_name_it(monkeypatch):
    monkeypatch.setenv(ENV, "7")
    assert host_step_threads(torch.device("cpu")) == 7 and host_step_threads(CUDA) == 7
    assert worker_at_stages_1_2(torch.device("cpu"))
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            host_step_threads(torch.device("cpu"))


def _recording(fn, threads_seen: set):
    def recording(*a, **kw):
        threads_seen.add(threading.current_thread().name)
        return fn(*a, **kw)

    return recording


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_2_on_the_worker_give_the_same_bits(monkeypatch, stage):
    """The host Adam on the worker thread: the same kernel on the same values as inline, so losses,
    norms and weights equal the run without offload bit for bit (as test_offload.py asserts of the
    inline step), and every host Adam call ran on the worker."""
    monkeypatch.setenv(ENV, "2")
    case = offloaded(f"w1_s{stage}_worker_acc2_clip", "mlp_frozen_unused", stage, bucket=500, overlap=True, **CLIP)
    base = run_case(base_of(case), 0, 1)  # (its device-resident Adam runs on this thread)
    threads_seen = set()
    for name in ("adam_step", "adam_step_multi"):  # a group's own step, a batch of groups' (host_batch.py)
        monkeypatch.setattr(ops, name, _recording(getattr(ops, name), threads_seen))
    got = run_case(case, 0, 1)
    check_against_reference(case, 1, [got])
    assert_same_bits([got], [base])
    assert threads_seen == {"zerocore-host-step"}


def test_a_failing_host_step_on_the_worker_reaches_step(monkeypatch):
    import zerocore

    monkeypatch.setenv(ENV, "1")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    engine = zerocore.initialize(model, {"train_micro_batch_size_per_gpu": 2,
                                         "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})

    def broken(*a, **kw):
        raise RuntimeError("host kernel broke")

    monkeypatch.setattr(ops, "adam_step", broken)
    monkeypatch.setattr(ops, "adam_step_multi", broken)  # the groups' batch (offload/host_batch.py)
    engine.backward(engine(torch.randn(2, 8)).sum())
    with pytest.raises(RuntimeError, match="host kernel broke"):  # raised as if run here
        engine.step()
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_2_on_the_worker_at_world_2_gather_the_stepped_slices(monkeypatch, tmp_path, stage):
    """At world 2 each group's host step runs on the worker and its all-gather follows it: the gathered
    parameters are the stepped ones, bit for bit the run without offload's, and both match the reference."""
    monkeypatch.setenv(ENV, "2")  # the spawned ranks inherit it
    case = offloaded(f"w2_s{stage}_worker_clip", "mlp_frozen_unused", stage, bucket=500, overlap=True, **CLIP)
    res = spawn_cases([case, base_of(case)], 2, tmp_path, timeout=300)  # res[rank][case]
    got, base = [r[0] for r in res], [r[1] for r in res]
    check_against_reference(case, 2, got)
    assert_same_bits(got, base)


def test_a_failing_host_step_stops_the_rest_of_its_step_and_a_retry_steps_them(monkeypatch):
    """Each batch of groups' host step runs on the worker and is waited for; when one fails the later ones
    are not run (the batches before it stepped), the error reaches step(), and the next step runs every
    group. One group per batch here (HOST_BATCH_ELEMS below every group's size)."""
    import zerocore
    import zerocore.runtime.engine as engine_mod

    monkeypatch.setenv(ENV, "1")
    monkeypatch.setattr(engine_mod, "HOST_BATCH_ELEMS", 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    engine = zerocore.initialize(model, {"train_micro_batch_size_per_gpu": 2,
                                         "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                                               "reduce_bucket_size": 4096},
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert len(engine.groups) >= 3, "the test needs several groups"
    adam, calls = ops.adam_step_multi, []

    def second_breaks(*a, **kw):
        calls.append(threading.current_thread().name)
        if len(calls) == 2:
            raise RuntimeError("host kernel broke")
        return adam(*a, **kw)

    monkeypatch.setattr(ops, "adam_step_multi", second_breaks)
    before = [p.detach().clone() for p in model.parameters()]
    engine.backward(engine(torch.randn(2, 64)).sum())
    with pytest.raises(RuntimeError, match="host kernel broke"):
        engine.step()
    assert len(calls) == 2, f"the groups after the failed one ran: {len(calls)} host steps"
    changed = [not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters())]
    assert any(changed) and not all(changed), "the first group steps, the ones after the failure do not"
    calls.clear()
    monkeypatch.setattr(ops, "adam_step_multi", adam)
    engine.backward(engine(torch.randn(2, 64)).sum())
    engine.step()
    engine.destroy()
