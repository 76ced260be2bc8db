"""zerocore.debug.host_waits on a GPU: the steady-state steps of test_host_waits_engine.py's scenarios
with the engine on one CUDA device (a one-rank NCCL group), the mode watching real CUDA tensors,
synchronisations and events. Targets: 0 waits per step after two warm-up steps (fp16 and
bf16.check_grad_overflow: 1, the overflow decision); event waits are reported (the offloaded
host step's wait on its gradients' copies). Skipped without a GPU or zerocore's CUDA kernels.
"""
from __future__ import annotations

import pytest
import torch

import zerocore
from zerocore.debug import host_waits

from dist_helpers import DTYPES, Case, loss_fn, make_batch, make_model
from test_host_waits_engine import CASES, READS_OVERFLOW, SCENARIOS, STEPS, WARMUP, config

# the GPU marks and the one-rank NCCL group of the engine's other GPU tests
from test_cuda_engine import nccl_world_of_one, pytestmark  # noqa: E402,F401


@pytest.mark.parametrize("name, stage", CASES, ids=[f"{n}-stage{s}" for n, s in CASES])
def test_steady_state_steps_on_a_gpu(nccl_world_of_one, name, stage):
    _, kw, zero = SCENARIOS[name]
    kw = dict(kw)
    case = Case(name, kw.pop("model", "mlp"), stage, zero=zero, **kw)
    engine = zerocore.initialize(make_model(case.model, 0).cuda(), config(case))
    dtype, logs = DTYPES[case.dtype], []
    for step in range(STEPS):
        x, y = make_batch(case.model, step, case.micro * case.gas, 0)
        with host_waits() as log:
            for k in range(case.gas):
                xb, yb = x[k * case.micro:(k + 1) * case.micro], y[k * case.micro:(k + 1) * case.micro]
                xb = (xb.to(dtype) if xb.is_floating_point() else xb).cuda()
                engine.backward(loss_fn(case.model, engine(xb), yb.cuda()))
                engine.step()
        logs.append(log)
    torch.cuda.synchronize()
    engine.destroy()
    steady = logs[WARMUP:]
    want = 1 if name in READS_OVERFLOW else 0
    assert [log.count for log in steady] == [want] * len(steady), "\n".join(map(str, steady))
    print(name, stage, "event waits per step:", [len(log.events) for log in steady])
