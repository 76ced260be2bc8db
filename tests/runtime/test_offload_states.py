"""``engine.offload_states()`` / ``reload_states()`` (DeepSpeed's methods, issue 33): the state leaves
the device and comes back bit for bit, and training goes on as if nothing happened.

On this CPU machine the "device" is host memory: the moves still happen (each storage's bytes to a
fresh host buffer, the original resized to zero bytes), so the checks below are the real code path:
the storages are released, the model stays readable from the host copies, and the round trip between
steps leaves losses and weights identical to a run without it, at every stage, with offload configs,
fp16's dynamic loss scale, a client optimizer. tests/runtime/gpu (the GPU run) checks the device memory.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
from zerocore.runtime.offload_states import OffloadStateType

ALL = [t.value for t in OffloadStateType]


def _model(frozen: bool = False) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 48), nn.GELU(), nn.Linear(48, 16))
    if frozen:
        m[2].requires_grad_(False)
    return m


CASES = {
    "stage0": ({"stage": 0}, torch.float32, None),
    "stage1_bf16": ({"stage": 1}, torch.bfloat16, None),
    "stage2": ({"stage": 2}, torch.float32, None),
    "stage2_fp16": ({"stage": 2}, torch.float16, None),
    "stage3_bf16": ({"stage": 3}, torch.bfloat16, None),
    "stage3_persistent": ({"stage": 3, "stage3_param_persistence_threshold": 100}, torch.float32, None),
    "stage2_cpu_ratio": ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, torch.bfloat16, None),
    "stage3_cpu_params": ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
                          torch.bfloat16, None),
    "stage1_client_sgd": ({"stage": 1}, torch.float32, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    "stage2_frozen": ({"stage": 2}, torch.float32, "frozen"),
}


def _engine(case: str):
    zero, dtype, client = CASES[case]
    if zero["stage"] == 3:
        zero = {"stage3_param_persistence_threshold": 0, **zero}
    model = _model(frozen=client == "frozen")
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": zero,
           "bf16": {"enabled": dtype == torch.bfloat16},
           "fp16": {"enabled": dtype == torch.float16, "initial_scale_power": 24}}  # overflows: the scaler moves
    opt = None
    if callable(client):
        opt = client(model.parameters())
    else:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    return zerocore.initialize(model, cfg, optimizer=opt), model, dtype


def _train(case: str, round_trip_after: set[int], include=None, steps: int = 6):
    engine, model, dtype = _engine(case)
    losses, scales = [], []
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(4, 16, generator=gen).to(dtype)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        scales.append(engine.loss_scale)
        if i in round_trip_after:
            engine.offload_states(include=include)
            engine.reload_states()
    state = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.destroy()
    return losses, scales, state


@pytest.mark.parametrize("case", list(CASES))
def test_round_trips_between_steps_change_nothing(case):
    want = _train(case, set())
    got = _train(case, {0, 2, 3})
    assert got[0] == want[0] and got[1] == want[1], case  # losses and loss scales, bit for bit
    for name, t in want[2].items():
        assert torch.equal(got[2][name], t), f"{case}: {name}"


@pytest.mark.parametrize("case", ["stage1_bf16", "stage2", "stage3_bf16", "stage2_cpu_ratio", "stage2_frozen"])
def test_the_states_leave_their_storage_and_the_model_stays_readable(case):
    engine, model, dtype = _engine(case)
    x = torch.randn(4, 16).to(dtype)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.numel()}
    held = [t for g in engine.groups for t in (g.tensors()["params"], g.tensors()["grads"])]
    held += [t for s in engine.shards for r, t in s.tensors().items()
             if r in ("master", "exp_avg", "exp_avg_sq") and t is not None and t.numel()]
    held = [t for t in held if t.untyped_storage().resizable()]  # not: the CPU's page-aligned optimizer state
    assert held
    sizes = [t.untyped_storage().nbytes() for t in held]
    engine.offload_states()
    assert all(t.untyped_storage().nbytes() == 0 for t in held), "every device storage was released"
    for n, p in model.named_parameters():  # read from the host copies meanwhile (stage 3: chunks, as before)
        if n in before:
            assert torch.equal(p.detach(), before[n]), n
    for call, what in ((lambda: engine(x), "forward"), (lambda: engine.step(), r"step\(\)"),
                       (lambda: engine.full_state_dict(), r"full_state_dict\(\)"),
                       (lambda: engine.save_checkpoint("/nonexistent"), r"save_checkpoint\(\)")):
        with pytest.raises(RuntimeError, match=rf"reload_states\(\) before {what}"):
            call()
    engine.offload_states()  # again: nothing left to move, nothing changes
    engine.reload_states()
    assert [t.untyped_storage().nbytes() for t in held] == sizes
    engine.reload_states()  # nothing offloaded: a no-op
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    engine.destroy()


def test_include_moves_only_the_named_states_and_a_second_call_the_rest():
    engine, model, _ = _engine("stage2")
    engine.backward(engine(torch.randn(4, 16)).float().pow(2).mean())
    engine.step()
    g = engine.groups[0]
    engine.offload_states(include=["lp_grads"])
    assert g.grad_shard.untyped_storage().nbytes() == 0 and g.param_flat.untyped_storage().nbytes() > 0
    engine.offload_states(include=[OffloadStateType.lp_params])
    assert g.param_flat.untyped_storage().nbytes() == 0
    engine.reload_states()
    assert g.param_flat.untyped_storage().nbytes() > 0 and g.grad_shard.untyped_storage().nbytes() > 0
    engine.destroy()


def test_bad_arguments_are_named():
    engine, _, _ = _engine("stage2")
    with pytest.raises(ValueError, match="unknown state type 'moments'"):
        engine.offload_states(include=["moments"])
    with pytest.raises(ValueError, match="nvme"):
        engine.offload_states(device="nvme")
    with pytest.warns(RuntimeWarning, match="nothing moved"):
        engine.offload_states(device="none")
    engine.backward(engine(torch.randn(4, 16)).float().pow(2).mean())  # nothing was moved: trains on
    engine.step()
    engine.destroy()


def test_deepspeed_face_takes_deepspeeds_enums():
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (its enum is compared by value)")
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    from zerocore.deepspeed.runtime.zero import offload_config as face

    assert [t.value for t in face.OffloadStateTypeEnum] == [t.value for t in OffloadStateTypeEnum]
    assert {t.value for t in face.OffloadDeviceEnum} <= {t.value for t in OffloadDeviceEnum}
    want = _train("stage2", set())
    engine, model, _ = _engine("stage2")
    gen = torch.Generator().manual_seed(1)
    for i in range(6):
        x = torch.randn(4, 16, generator=gen)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        if i == 1:  # DeepSpeed's own enum members, as RL trainers pass them
            engine.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.lp_params],
                                  device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True)
            engine.reload_states(non_blocking=True)
    got = engine.full_state_dict()
    engine.destroy()
    for name, t in want[2].items():
        assert torch.equal(got[name], t), name
