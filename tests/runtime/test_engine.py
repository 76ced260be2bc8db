"""The engine's API and its building blocks in one process (world of one): the fp16 loss scaler,
misuse errors, settings not implemented yet. The sharding records and state machine are tested in
tests/sharding/test_records_and_states.py."""
import math
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist

import zerocore
from zerocore.config import FP16Config
from zerocore.runtime.loss_scale import LossScaler


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def test_loss_scaler_follows_deepspeed_and_never_aborts():
    sc = LossScaler(FP16Config(enabled=True, initial_scale_power=4, hysteresis=2, loss_scale_window=3,
                               min_loss_scale=4))
    assert sc.scale == 16
    sc.update(True)
    assert sc.scale == 16  # hysteresis 2: the first overflow only uses up one
    sc.update(True)
    assert sc.scale == 8
    sc.update(True)
    assert sc.scale == 4
    with pytest.warns(RuntimeWarning, match="minimum"):
        sc.update(True)  # at the minimum: warn, keep going
    assert sc.scale == 4
    for _ in range(3):
        sc.update(False)
    assert sc.scale == 4  # loss_scale_window clean steps after an overflow: not yet (DeepSpeed >= 0.17.1)
    sc.update(False)
    assert sc.scale == 8  # doubled at the end of the window + 1'th
    for _ in range(2):
        sc.update(False)
    assert sc.scale == 8
    sc.update(False)
    assert sc.scale == 16  # then every loss_scale_window clean steps
    assert LossScaler(FP16Config(enabled=True, loss_scale=128)).scale == 128
    assert LossScaler(None).scale == 1.0


def test_loss_scaler_at_stage_0_halves_at_every_overflow():
    """DeepSpeed's stage-0 fp16 optimizers have no hysteresis; its ZeRO optimizers do (default 2)."""
    fp16 = FP16Config(enabled=True, initial_scale_power=4, loss_scale_window=2)
    zero, stage0 = LossScaler(fp16), LossScaler(fp16, hysteresis=False)
    zero.update(True)
    stage0.update(True)
    assert (zero.scale, stage0.scale) == (16, 8)
    for _ in range(3):  # the first raise: window + 1 clean steps after the overflow, hysteresis or not
        zero.update(False)
        stage0.update(False)
    assert (zero.scale, stage0.scale) == (32, 16)


def test_world_of_one_end_to_end_bf16_names_and_lr():
    from zerocore.demo import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=11, dim=16, layers=1, heads=2, ctx=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = zerocore.initialize(model, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
                                         "optimizer": {"params": {"lr": 1e-2}}})
    assert engine.world_size == 1 and engine.module is model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    x = torch.randint(0, 11, (2, 8))
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(engine(x).flatten(0, 1).float(), x.flatten())
        engine.backward(loss)
        engine.step()
    assert engine.optimizer_steps == 2 and engine.skipped_steps == 0 and engine.loss_scale == 1.0
    assert engine.global_grad_norm > 0
    sd = engine.full_state_dict()
    assert list(sd) == list(before)  # the model's own names, tied head.weight included
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in sd.values())
    assert torch.equal(sd["head.weight"], sd["tok.weight"])
    assert not torch.equal(sd["tok.weight"], before["tok.weight"])
    engine.lr = 0.0  # a schedule can set the learning rate; lr 0 with no decay moves nothing
    loss = torch.nn.functional.cross_entropy(engine(x).flatten(0, 1).float(), x.flatten())
    engine.backward(loss)
    engine.step()
    assert torch.equal(engine.full_state_dict()["tok.weight"], sd["tok.weight"])


def test_misuse_is_named():
    engine = zerocore.initialize(small_model(), {"zero_optimization": {"stage": 1}})
    x = torch.randn(4, 5)
    with pytest.raises(RuntimeError, match="step\\(\\) without backward"):
        engine.step()
    engine.backward(engine(x).sum())
    with pytest.raises(RuntimeError, match="backward\\(\\) called twice"):
        engine.backward(engine(x).sum())
    engine.step()
    with pytest.raises(ValueError, match="no trainable parameters .*pass frozen=True"):
        zerocore.initialize(small_model().requires_grad_(False), {})


def test_round_robin_gradients_is_accepted_and_says_why_it_changes_nothing():
    """DeepSpeed's round_robin_gradients spreads the gradient copies to the host over the ranks; zerocore's
    layout always does (every group is split evenly over the ranks): a warning says so, nothing is refused."""
    cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "round_robin_gradients": True}}
    with pytest.warns(zerocore.config.ConfigWarning, match="round_robin_gradients=true .*split evenly over the ranks"):
        engine = zerocore.initialize(small_model(), cfg)
    engine.backward(engine(torch.randn(2, 5)).sum())
    engine.step()


def test_accumulation_updates_only_at_the_boundary():
    model = small_model()
    engine = zerocore.initialize(model, {"gradient_accumulation_steps": 3, "zero_optimization": {"stage": 2}})
    w0 = model[0].weight.detach().clone()
    for i in range(3):
        engine.backward(engine(torch.randn(2, 5)).pow(2).mean())
        engine.step()
        assert torch.equal(model[0].weight, w0) == (i < 2)
    assert engine.global_steps == 1 and engine.micro_steps == 3


def test_torchrun_environment_initializes_the_default_group(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    assert not dist.is_initialized()
    try:
        engine = zerocore.initialize(small_model(), {})
        assert dist.is_initialized() and dist.get_backend() == "gloo" and engine.comm.backend == "gloo"
        engine.backward(engine(torch.randn(2, 5)).sum())
        engine.step()
        assert math.isfinite(engine.global_grad_norm)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert "RANK" in os.environ


# CI runs the demo on 2 ranks in tests/cli/test_demo.py (stage 3) and tests/project (the README's command);
# stages 2 and 3 training alike is tests/sharding's; this one runs both stages' demos before a release
@pytest.mark.slow
def test_demo_runs_two_ranks_with_torchrun():
    import subprocess
    import sys

    curves = {}
    for stage in (2, 3):
        r = subprocess.run([sys.executable, "-m", "zerocore", "demo", "--stage", str(stage), "--steps", "30",
                            "--dim", "32", "--ctx", "32"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        out = r.stdout
        assert f"ZeRO stage {stage}, 2 ranks" in out and "median step" in out
        assert "rank 0 " in out and "rank 1 " in out and "stage 0 would hold" in out and "after training:" in out
        line = next(ln for ln in out.splitlines() if ln.startswith("loss curve"))
        curves[stage] = [float(v) for v in line.split(":", 1)[1].split()]
    # stage 3 really partitions (one unit per Block + the root) and trains like stage 2
    assert "stage 3: 3 units" in out
    assert len(curves[3]) == len(curves[2]) == 10
    assert all(abs(a - b) < 1e-3 for a, b in zip(curves[2], curves[3])), curves


def test_unused_parameters_do_not_pin_buckets():
    """A group waiting for an unused parameter launches at the end of backward, and the groups
    after it wait in order; their gradients wait in ``.grad`` (what plain backward holds), not in
    buckets: at most two buckets (overlap_comm) exist during backward and none between steps."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            # registered first, so its group is launched first (groups follow reverse registration)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(9, 9) for _ in range(5))
            self.unused = torch.nn.Linear(9, 9)

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), {"zero_optimization": {"stage": 2, "reduce_bucket_size": 90,
                                                               "overlap_comm": True}})
    pool = engine.reducer.pool
    most, take = [0], pool.take

    def counting_take():
        b = take()
        most[0] = max(most[0], len(pool.all))
        return b

    pool.take = counting_take
    for _ in range(3):
        engine.backward(engine(torch.randn(3, 9)).square().mean())
        assert pool.all == [] and all(p.grad is None for p in engine.module.parameters())
        unused = engine.groups[0]  # the unused Linear's group: reduced as zeros
        assert unused.layout.slots[0].name.startswith("unused") and not unused.owned_grad().any()
        engine.step()
    assert most[0] == 2


@pytest.mark.parametrize("stage", [1, 2])
def test_reduce_dtype_fp32_reduces_bf16_gradients_in_fp32(stage):
    """zero_optimization.reduce_dtype: "fp32": the collective sums an fp32 copy; at world 1 the
    sum is the identity, so the step matches the bf16 reduction bit for bit."""
    results = []
    for reduce in (None, "fp32"):
        torch.manual_seed(0)
        engine = zerocore.initialize(small_model(), {"zero_optimization": {"stage": stage, "reduce_dtype": reduce},
                                                     "bf16": {"enabled": True}})
        seen = []
        reduce_fn = engine.reducer._reduce
        engine.reducer._reduce = lambda flat, async_op: (seen.append(flat.dtype), reduce_fn(flat, async_op=async_op))[1]
        x = torch.randn(4, 5, dtype=torch.bfloat16)
        for _ in range(2):
            engine.backward(engine(x).float().square().mean())
            engine.step()
        assert set(seen) == {torch.float32 if reduce else torch.bfloat16}
        assert engine.memory_report()["buckets"] == 0  # the fp32 copies are transient
        results.append(engine.full_state_dict())
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k


@pytest.mark.parametrize("low,key", [(torch.float16, "fp16.enabled"), (torch.bfloat16, "bf16.enabled")])
def test_a_16bit_model_under_an_fp32_config_is_named_at_initialize_and_at_the_failing_forward(low, key):
    model = small_model().to(low)
    with pytest.warns(UserWarning, match=f"parameters are {str(low)[6:]} .*trains them in float32.*Set {key}: true"):
        engine = zerocore.initialize(model, {"zero_optimization": {"stage": 2}})
    with pytest.raises(RuntimeError, match=f"model was {str(low)[6:]}: with neither fp16.enabled nor bf16.enabled.*"
                                           f"set {key}: true.*input #0 of the forward is {str(low)[6:]}"):
        engine(torch.randn(2, 5).to(low))
    engine.backward(engine(torch.randn(2, 5)).sum())  # float32 inputs train as the warning says
    engine.step()
