"""``torch_autocast`` on a GPU (skips without CUDA): the engine's forward under ``torch.autocast("cuda", ...)``
against one-process torch AMP on the same device, world 1 over NCCL, the model and batches of
test_torch_autocast.py (which runs the same comparison on 2 CPU ranks).

bf16 at stages 0-3 and stage 2 with optimizer offload: every step's loss and clipped global norm, each tensor's
training delta as torch AMP's; fp16 autocast (no loss scale, as DeepSpeed runs it at stages 1-3) at stages 2 and
3: the linear layers compute in fp16, parameters and gradients stay fp32, and the losses follow torch AMP's."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
from dist_helpers import relative_delta_error
from test_cuda_engine import nccl_world_of_one, pytestmark  # noqa: F401 - the GPU marks and the NCCL world
from test_torch_autocast import GAS, STEPS, _batch, _cfg, _net, _torch_amp

VARIANTS = {"stage0": (0, None), "stage1": (1, None), "stage2": (2, None), "stage3": (3, None),
            "stage2_offload": (2, "cpu")}


def _cuda_cfg(stage, offload, dtype: str) -> dict:
    cfg = _cfg(stage, offload)
    cfg["torch_autocast"]["dtype"] = dtype
    return cfg


def _engine_run(stage, offload, dtype: str, device: torch.device) -> dict:
    engine = zerocore.initialize(_net().to(device), _cuda_cfg(stage, offload, dtype))
    seen = set()
    engine.module.a.register_forward_hook(lambda m, a, o: seen.add(o.dtype))
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(GAS):
            x, y = (t.to(device) for t in _batch(step, micro, 1))
            loss = nn.functional.mse_loss(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / GAS
        losses.append(total)
        norms.append(engine.get_global_grad_norm())
    params = {k: v.cpu() for k, v in engine.full_state_dict().items()}
    kinds = {p.dtype for p in engine.module.parameters()}
    engine.destroy()
    return {"losses": losses, "norms": norms, "params": params, "linear_out": seen, "param_dtypes": kinds}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_bf16_autocast_trains_as_torch_amp_on_the_gpu(nccl_world_of_one, name):
    stage, offload = VARIANTS[name]
    device = torch.device("cuda", 0)
    got = _engine_run(stage, offload, "bfloat16", device)
    losses, norms, want = _torch_amp(1, device, torch.bfloat16)
    init = _net().state_dict()
    assert got["linear_out"] == {torch.bfloat16} and got["param_dtypes"] == {torch.float32}
    assert got["losses"] == pytest.approx(losses, rel=2e-3)
    assert got["norms"] == pytest.approx(norms, rel=1e-2)
    for k, w in want.items():
        err = relative_delta_error(got["params"][k], w, init[k])
        assert err < 3e-2, f"{name} {k}: {err:.3g} from torch AMP's update"


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_autocast_computes_in_fp16_and_trains_as_torch_amp(nccl_world_of_one, stage):
    device = torch.device("cuda", 0)
    got = _engine_run(stage, None, "float16", device)
    losses, _, _ = _torch_amp(1, device, torch.float16)
    assert got["linear_out"] == {torch.float16} and got["param_dtypes"] == {torch.float32}
    assert all(torch.isfinite(torch.tensor(got["losses"])))
    assert got["losses"] == pytest.approx(losses, rel=2e-3)
