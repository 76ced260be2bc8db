"""torch.compile asked the way each trainer asks it reaches the engine, as Accelerate's DeepSpeed route hands it to
DeepSpeed (``engine.compile(backend, compile_kwargs)``): the Trainer's ``torch_compile`` /
``torch_compile_backend`` and ``Accelerator(dynamo_backend=...)`` (both Accelerate's ``TorchDynamoPlugin``). Before,
the integrations skipped Accelerate's own model preparation, and with it the compile: the run was eager, silently.
The ``eager`` backend keeps these quick: it traces each unit's forward with Dynamo and runs the graph as it is, so
the numbers are the eager run's bit for bit."""
from __future__ import annotations

import pytest
import torch

from integration_launch import max_diff, run_in

pytest.importorskip("accelerate", reason="accelerate is not installed")


def _run(tmp, name, *opts):
    return run_in("hf_run.py", tmp, name, *opts, nproc=1)


@pytest.mark.slow  # (15 s: two Trainer runs; the in-process Accelerator test below covers the same hand-over in CI)
def test_trainer_torch_compile_compiles_each_stage3_unit(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed")
    opts = ("stage=3", "steps=4", "unit_min=1000")  # units: the embedding, each decoder layer, the head
    eager = _run(tmp_path, "eager", *opts)
    compiled = _run(tmp_path, "compiled", *opts, "compile=eager")
    assert compiled["compiled"] is True
    # one graph per unit class (embedding, decoder layer, head), none made again in later steps
    assert compiled["unique_graphs"] == 3
    for key in ("lrs", "losses", "grad_norms", "weights"):
        assert max_diff(eager[key], compiled[key]) == 0.0, key


class Net(torch.nn.Module):
    # a model class of the user's: Dynamo skips the frames of torch.nn's own modules (an nn.Sequential's
    # Module.compile() traces nothing)
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.fixture
def fresh_accelerator_state():
    # Accelerate keeps one AcceleratorState per process (its dynamo plugin included): an Accelerator built earlier
    # in this process would decide the backend; Accelerate's own tests reset it the same way
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerator_dynamo_backend_compiles_the_engine(stage, fresh_accelerator_state):
    from torch._dynamo.utils import counters

    from zerocore.integrations.accelerate import ZeroAccelerator

    torch.manual_seed(0)
    model = Net()
    acc = ZeroAccelerator(cpu=True, dynamo_backend="eager", zerocore_config={
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage, "stage3_unit_min_params": 1, "stage3_param_persistence_threshold": 0}})
    wrapped, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert acc.zerocore_engine.is_compiled
    before = counters["stats"]["calls_captured"]
    acc.backward(wrapped(torch.randn(3, 8)).square().sum())
    assert counters["stats"]["calls_captured"] > before  # Dynamo traced the forward
    acc.free_memory()
