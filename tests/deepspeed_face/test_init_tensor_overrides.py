"""``deepspeed.zero.Init`` overrides torch's tensor constructors while it is open, as DeepSpeed 0.19.8's
does (zerocore/deepspeed/tensor_overrides.py): what each one makes inside the context, torch's own
again after it (also after an exception), nested Inits, ``tensor_overrides``, the dtype rule, and an
engine built inside the context. ``test_init_against_deepspeed.py`` compares the values with DeepSpeed's."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
import zerocore.deepspeed as deepspeed
from zerocore.deepspeed.runtime.zero.partition_parameters import DeepSpeedTensorOverride

BF16 = torch.bfloat16


def _cfg(precision=None, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, **extra}
    if precision:
        cfg[precision] = {"enabled": True}
    return cfg


# (what is made, its dtype inside Init with bf16, its dtype with torch's own constructors)
MADE = [
    ("torch.tensor float", lambda: torch.tensor([1.5]), BF16, torch.float32),
    ("torch.tensor int", lambda: torch.tensor([1]), torch.int64, torch.int64),
    ("torch.tensor bool", lambda: torch.tensor([True]), torch.bool, torch.bool),
    ("torch.empty", lambda: torch.empty(2, 3), BF16, torch.float32),
    ("torch.empty dtype=float32", lambda: torch.empty(2, dtype=torch.float32), BF16, torch.float32),
    ("torch.zeros dtype=float64", lambda: torch.zeros(2, dtype=torch.float64), BF16, torch.float64),
    ("torch.zeros dtype=long", lambda: torch.zeros(2, dtype=torch.long), torch.int64, torch.int64),
    ("torch.zeros complex", lambda: torch.zeros(2, dtype=torch.complex64), torch.complex64, torch.complex64),
    ("torch.ones", lambda: torch.ones(2), BF16, torch.float32),
    ("torch.full float", lambda: torch.full((2,), 1.5), BF16, torch.float32),
    ("torch.full int", lambda: torch.full((2,), 7), torch.int64, torch.int64),
    ("torch.arange int", lambda: torch.arange(3), torch.int64, torch.int64),
    ("torch.arange float", lambda: torch.arange(3.0), BF16, torch.float32),
    ("torch.eye", lambda: torch.eye(2), BF16, torch.float32),
    ("torch.randn", lambda: torch.randn(2), BF16, torch.float32),
    ("torch.rand (not overridden)", lambda: torch.rand(2), torch.float32, torch.float32),
    ("torch.Tensor()", lambda: torch.Tensor(), BF16, torch.float32),
    ("torch.Tensor(2, 3)", lambda: torch.Tensor(2, 3), BF16, torch.float32),
    ("nn.Parameter()", lambda: nn.Parameter(), BF16, torch.float32),
]


def _dtypes():
    return {name: make().dtype for name, make, _, _ in MADE}


def test_constructors_inside_and_after_init():
    with deepspeed.zero.Init(config_dict_or_path=_cfg("bf16")):
        inside = _dtypes()
        shaped = torch.Tensor(2, 3).shape
        leaf = torch.tensor([1.0], requires_grad=True)
        on_meta = torch.empty(2, device="meta")
    assert inside == {name: want for name, _, want, _ in MADE}
    assert shaped == (2, 3)
    assert leaf.dtype == BF16 and leaf.is_leaf and leaf.requires_grad  # the same object, converted in place
    assert on_meta.device.type == "meta" and on_meta.dtype == BF16  # an explicit device is kept
    assert _dtypes() == {name: want for name, _, _, want in MADE}


def test_constructors_made_on_the_accelerator():
    """A tensor made without a device goes to this rank's accelerator, whatever torch's default device."""
    want = torch.device(deepspeed.accelerator.get_accelerator().device_name(0))
    with deepspeed.zero.Init(config_dict_or_path=_cfg("bf16")), torch.device("meta"):
        made = {torch.empty(2).device, torch.tensor([1]).device, torch.Tensor(2).device,
                torch.zeros(2, device=None).device}
        rand = torch.rand(2).device  # not overridden: torch's default device
    assert made == {want} and rand.type == "meta"


def test_torch_is_restored_after_an_exception_inside():
    before = {name: getattr(torch, name) for name in ("tensor", "empty", "zeros", "ones", "full", "arange", "eye",
                                                       "randn")}
    had_new = "__new__" in torch.Tensor.__dict__
    with pytest.raises(KeyError):
        with deepspeed.zero.Init(config_dict_or_path=_cfg("bf16")):
            assert torch.empty(1).dtype == BF16
            raise KeyError("in the user's model")
    assert {name: getattr(torch, name) for name in before} == before
    assert ("__new__" in torch.Tensor.__dict__) == had_new
    assert _dtypes() == {name: want for name, _, _, want in MADE}
    with deepspeed.zero.Init(config_dict_or_path=_cfg("fp16")):  # and a later Init overrides them again
        assert torch.empty(1).dtype == torch.float16


def test_nested_inits_keep_the_outer_ones_dtype():
    with deepspeed.zero.Init(config_dict_or_path=_cfg("bf16")):
        with deepspeed.zero.Init(config_dict_or_path=_cfg("fp16")):
            assert torch.empty(1).dtype == BF16  # the inner Init changes nothing, as in DeepSpeed
            inner = nn.Linear(3, 4)
        assert torch.empty(1).dtype == BF16  # still open: the outer one's overrides stay
        with deepspeed.zero.Init(config_dict_or_path=_cfg(), enabled=False):
            assert torch.empty(1).dtype == BF16
        with pytest.raises(ValueError):
            with deepspeed.zero.Init(dtype=torch.float32):
                raise ValueError("inner")
        assert torch.empty(1).dtype == BF16
        outer = nn.Linear(3, 4)
    assert torch.empty(1).dtype == torch.float32
    assert inner.weight.ds_tensor.dtype == outer.weight.ds_tensor.dtype == BF16


@pytest.mark.parametrize("config, dtype, fp16_supported, want", [
    (_cfg("bf16"), None, True, BF16),
    (_cfg("fp16"), None, True, torch.float16),
    (_cfg(), None, True, torch.float32),
    (None, None, True, torch.float16),
    (None, torch.float32, True, torch.float32),
    (_cfg("bf16"), torch.float32, True, torch.float32),  # dtype= wins over the config
    # DeepSpeed's `(dtype or fp16) if <fp16> else bf16`: without fp16, bf16 whatever was asked
    (None, None, False, BF16),
    (None, torch.float32, False, BF16),
    (_cfg(), torch.float16, False, BF16),
])
def test_init_dtype_is_deepspeeds(monkeypatch, config, dtype, fp16_supported, want):
    monkeypatch.setattr(type(deepspeed.accelerator.get_accelerator()), "is_fp16_supported",
                        lambda self: fp16_supported)
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=dtype) as init:
        made = torch.empty(1, dtype=torch.float64).dtype
        layer = nn.Linear(3, 4)
    assert init.dtype == made == layer.weight.ds_tensor.dtype == want


def test_fp32_init_keeps_fp32_values():
    """Config without bf16/fp16: the values are those of a plain fp32 build (float64 tensors come out fp32)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Embedding(4, 3))
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=_cfg()):
        built = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Embedding(4, 3))
        assert torch.zeros(1, dtype=torch.float64).dtype == torch.float32
    with deepspeed.zero.GatheredParameters(list(built.parameters())):
        for (name, want), got in zip(plain.named_parameters(), built.parameters()):
            assert got.dtype == torch.float32 and torch.equal(got, want), name


def test_zerocore_init_leaves_constructors_alone():
    """zerocore's own Init converts the finished parameters only when asked (dtype=), as before."""
    empty, had_new = torch.empty, "__new__" in torch.Tensor.__dict__
    with zerocore.init(_cfg()):
        assert torch.empty is empty and ("__new__" in torch.Tensor.__dict__) == had_new
        assert torch.zeros(1, dtype=torch.float64).dtype == torch.float64
        layer = nn.Linear(3, 4)
    assert layer.weight._zc_init.chunk.dtype == torch.float32


def test_tensor_overrides():
    with deepspeed.zero.Init(config_dict_or_path=_cfg("bf16"), tensor_overrides=[]):
        assert torch.empty(1).dtype == torch.float32
        plain = nn.Linear(3, 4)
    assert plain.weight.ds_tensor.dtype == torch.float32  # DeepSpeed's partitions too keep the made dtype
    with deepspeed.zero.Init(config_dict_or_path=_cfg("bf16"), tensor_overrides=[DeepSpeedTensorOverride.dtype]):
        assert torch.empty(1).dtype == BF16
    with deepspeed.zero.Init(config_dict_or_path=_cfg("bf16"), tensor_overrides=[DeepSpeedTensorOverride.device]):
        assert torch.empty(1).dtype == torch.float32


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="tensor_overrides takes DeepSpeedTensorOverride"):
        deepspeed.zero.Init(tensor_overrides=["dtype"])
    with pytest.raises(TypeError, match="tensor_overrides must be a list"):
        deepspeed.zero.Init(tensor_overrides=3)
    with pytest.raises(ValueError, match="dtype=torch.float64 is not one DeepSpeed's Init takes"):
        deepspeed.zero.Init(dtype=torch.float64)
    with pytest.raises(TypeError):
        deepspeed.zero.Init(tensor_overides=[])  # a misspelt keyword is no longer swallowed


def _losses(initialize_inside: bool) -> list[float]:
    cfg = _cfg("bf16")
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = nn.Sequential(nn.Linear(5, 9), nn.Linear(9, 3))
        if initialize_inside:
            engine = deepspeed.initialize(model=model, config=cfg)[0]
            assert torch.empty(1).dtype == BF16  # the overrides are back after initialize
    if not initialize_inside:
        engine = deepspeed.initialize(model=model, config=cfg)[0]
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        loss = engine(torch.randn(4, 5, generator=g).to(BF16)).float().pow(2).sum()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


def test_initialize_inside_init_builds_with_torchs_constructors():
    """As DeepSpeed's initialize lifts Init's overrides while it runs: the engine's fp32 master is fp32."""
    assert _losses(initialize_inside=True) == _losses(initialize_inside=False)


class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("e_score_correction_bias", torch.full((3,), 0.1))
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("half_only", torch.ones(3))


class _Routed(nn.Module):  # names buffers for fp32 as Transformers models do
    _keep_in_fp32_modules_strict = ["e_score_*"]
    _keep_in_fp32_modules = ["half_only"]

    def __init__(self):
        super().__init__()
        self.gate = _Gate()


@pytest.mark.parametrize("precision, kept", [("bf16", {"e_score_correction_bias"}),
                                              ("fp16", {"e_score_correction_bias", "half_only"}), (None, set())])
def test_buffers_named_for_fp32_stay_fp32(precision, kept):
    with deepspeed.zero.Init(config_dict_or_path=_cfg(precision)) as init:
        gate = _Routed().gate
        # already inside the context: after the __init__ of the module naming them, as in DeepSpeed
        assert gate.e_score_correction_bias.dtype == (torch.float32 if kept else init.dtype)
    everything = {n for n, _ in gate.named_buffers()}
    assert {n for n, b in gate.named_buffers() if b.dtype == torch.float32} == (kept or everything)
    # the value is the one made in Init's dtype (DeepSpeed converts it back after the model's __init__)
    assert gate.e_score_correction_bias[0].item() == torch.tensor(0.1, dtype=init.dtype).item()
