"""``torch_autocast`` (DeepSpeed's section): the engine's forward under ``torch.autocast``, everything else in the
training dtype, against one-process torch AMP (``torch.optim.AdamW`` on the global batch, its forward under
``torch.autocast("cpu", bfloat16)``, fp32 parameters).

On 2 gloo ranks at stages 0-3 and stage 2 with optimizer offload, 2 micro-batches per step, clipping that bites:
every step's loss and global gradient norm, and each tensor's training delta, match torch AMP's (to bf16's
rounding of the per-rank weight-gradient products: the reference sums the whole batch in one bf16 product); the
first loss (the forward's numerics alone) equals torch AMP's to 1e-5 and is 50x farther from it without the
section. In one process: the linear layers compute in bf16
and the parameters stay fp32, an autocast the caller opened is replaced, and the section's errors.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
from zerocore.config import ConfigError, load_config
from zerocore.runtime.forward_autocast import autocast_dtype
from dist_helpers import relative_delta_error
from stage3_ranks import results, scenarios_of, spawn

D, MICRO, GAS, STEPS, LR, CLIP = 12, 2, 2, 3, 1e-2, 0.3
VARIANTS = {"stage0": (0, None), "stage1": (1, None), "stage2": (2, None), "stage3": (3, None),
            "stage2_offload": (2, "cpu")}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 24)
        self.norm = nn.LayerNorm(24)
        self.b = nn.Linear(24, D)

    def forward(self, x):
        return self.b(torch.tanh(self.norm(self.a(x))))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(step: int, micro: int, world: int):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(MICRO * world, D, generator=g), torch.randn(MICRO * world, D, generator=g)


def _cfg(stage: int, offload=None, autocast=True) -> dict:
    z = {"stage": stage}
    if stage == 3:
        z.update(stage3_param_persistence_threshold=0, stage3_unit_min_params=100)
    if offload:
        z["offload_optimizer"] = {"device": offload}
    return {"zero_optimization": z, "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "torch_autocast": {"enabled": autocast, "dtype": "bfloat16"}}


def _run(stage, offload, rank, world):
    out = {}
    for autocast in (True, False):
        engine = zerocore.initialize(_net(), _cfg(stage, offload, autocast))
        losses, norms = [], []
        for step in range(STEPS):
            total = 0.0
            for micro in range(GAS):
                x, y = _batch(step, micro, world)
                rows = slice(rank * MICRO, (rank + 1) * MICRO)
                loss = nn.functional.mse_loss(engine(x[rows]).float(), y[rows])
                engine.backward(loss)
                engine.step()
                t = loss.detach().reshape(1).double()
                torch.distributed.all_reduce(t)
                total += t.item() / world / GAS
            losses.append(total)
            norms.append(engine.get_global_grad_norm())
        out["amp" if autocast else "fp32"] = {"losses": losses, "norms": norms, "params": engine.full_state_dict()}
        engine.destroy()
    return out


scenarios_of(globals(), _run, VARIANTS)


def _torch_amp(world: int, device=torch.device("cpu"), dtype=torch.bfloat16):
    """One-process torch AMP on the global batch (also the GPU test's reference: test_torch_autocast_cuda.py)."""
    model = _net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for micro in range(GAS):
            x, y = (t.to(device) for t in _batch(step, micro, world))
            with torch.autocast(device.type, dtype=dtype):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y) / GAS
            loss.backward()
            total += loss.item()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(total)
    return losses, norms, {k: v.cpu() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn([globals()[f"sc_{n}"] for n in VARIANTS], 2, tmp_path_factory.mktemp("autocast"), timeout=300)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_trains_as_torch_amp(ranks, name):
    r = results(ranks, name)[0]
    losses, norms, want = _torch_amp(2)
    init = _net().state_dict()
    amp, fp32 = r["amp"], r["fp32"]
    assert amp["losses"] == pytest.approx(losses, rel=2e-3)
    assert amp["norms"] == pytest.approx(norms, rel=1e-2)
    assert all(n > CLIP for n in norms)  # the clip bites at every step
    for k, w in want.items():
        err = relative_delta_error(amp["params"][k], w, init[k])
        assert err < 3e-2, f"{k}: {err:.3g} from torch AMP's update"
    # the first loss is the forward's numerics alone: the same products as torch AMP's, far from fp32's
    near, far = abs(amp["losses"][0] - losses[0]), abs(fp32["losses"][0] - losses[0])
    assert near < 1e-5 * losses[0] and far > 50 * near, (near, far)


# -- one process ------------------------------------------------------------------------------------------
def _one(**section):
    cfg = _cfg(2)
    cfg["torch_autocast"] = section
    return zerocore.initialize(_net(), cfg)


def test_linear_layers_compute_in_bf16_and_parameters_stay_fp32():
    engine = _one(enabled=True, dtype="bf16")
    seen = {}
    for name in ("a", "norm", "b"):
        getattr(engine.module, name).register_forward_hook(lambda m, a, o, n=name: seen.__setitem__(n, o.dtype))
    with torch.autocast("cpu", dtype=torch.float16):  # the caller's autocast is replaced inside the engine
        out = engine(torch.randn(MICRO, D))
    assert seen["a"] == seen["b"] == out.dtype == torch.bfloat16
    plain, want = _net(), {}  # every layer's output dtype as torch AMP gives it
    for name in ("a", "norm", "b"):
        getattr(plain, name).register_forward_hook(lambda m, a, o, n=name: want.__setitem__(n, o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain(torch.randn(MICRO, D))
    assert seen == want
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())
    engine.backward(out.float().pow(2).mean())
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in engine.module.parameters())
    off = _one(enabled=False, dtype="bf16")
    seen.clear()
    for name in ("a", "norm", "b"):
        getattr(off.module, name).register_forward_hook(lambda m, a, o, n=name: seen.__setitem__(n, o.dtype))
    off(torch.randn(MICRO, D))
    assert set(seen.values()) == {torch.float32}


def test_section_errors_and_defaults():
    ac = load_config({"torch_autocast": {"enabled": True}}).torch_autocast
    assert ac.dtype is None and autocast_dtype(ac, "cpu") == torch.get_autocast_dtype("cpu")
    with pytest.raises(ConfigError, match="torch_autocast.dtype: got 'fp32'; allowed: null or one of"):
        load_config({"torch_autocast": {"enabled": True, "dtype": "fp32"}})
    with pytest.raises(ConfigError, match="torch_autocast.dtype: got 'float16' at zero_optimization.stage 0"):
        load_config({"torch_autocast": {"enabled": True, "dtype": "float16"}, "zero_optimization": {"stage": 0}})
    fp16 = load_config({"torch_autocast": {"enabled": True, "dtype": "fp16"}, "zero_optimization": {"stage": 1}})
    assert autocast_dtype(fp16.torch_autocast, "cpu") == torch.float16
    with pytest.warns(UserWarning, match="torch_autocast.lower_precision_safe_modules"):
        load_config({"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linear"]}})
