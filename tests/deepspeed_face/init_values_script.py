"""Builds one small model (Linear, Conv2d, Embedding, LayerNorm, BatchNorm1d, a module making its
tensors with ``torch.Tensor(...)``, ``torch.rand`` and ``torch.arange``, one naming buffers for fp32
as Transformers models do) under ``deepspeed.zero.Init`` in several ways (config with bf16 / fp16 /
neither, no config, ``dtype=``, nested Inits, ``tensor_overrides``, an accelerator without fp16),
with the same seed each time, and saves each parameter's full value and each buffer (values and
dtypes) to ``--out``, with what each tensor constructor makes inside Init, after it, and after an
Init left by an exception. ``ZC_FACE=deepspeed|zerocore`` picks the library, nothing else differs.
One process, one rank (gloo): the values do not depend on the world size (every rank takes rank 0's)."""
import torch
import torch.nn as nn

from face_script import library, start

deepspeed = library()

OVERRIDE = deepspeed.runtime.zero.partition_parameters.DeepSpeedTensorOverride


class OldStyle(nn.Module):
    """Tensors made the ways Init overrides (torch.Tensor(sizes), torch.arange) and does not (torch.rand)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.Tensor(3, 4))
        nn.init.normal_(self.w)
        self.r = nn.Parameter(torch.rand(5))
        self.register_buffer("steps", torch.arange(4.0))
        self.register_buffer("noise", torch.rand(2))
        self.register_buffer("count", torch.tensor(3))


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.register_buffer("e_score_correction_bias", torch.full((4,), 0.1))
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("half_only", torch.full((2,), 0.1))


class Routed(nn.Module):
    """Names buffers for fp32 as Transformers models do (fp16 also keeps those in _keep_in_fp32_modules)."""

    _keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight"]
    _keep_in_fp32_modules = ["half_*"]

    def __init__(self):
        super().__init__()
        self.gate = Gate()


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 33), nn.Conv2d(3, 5, 3), nn.Embedding(11, 6), nn.LayerNorm(9),
                         nn.BatchNorm1d(4), OldStyle(), Routed())


def _cfg(precision=None):
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    if precision:
        cfg[precision] = {"enabled": True}
    return cfg


def _no_fp16(acc):
    acc.is_fp16_supported = lambda: False


CASES = {  # name: [(Init kwargs, outer to inner)], what to do to the accelerator first
    "cfg_bf16": ([{"config_dict_or_path": _cfg("bf16")}], None),
    "cfg_fp16": ([{"config_dict_or_path": _cfg("fp16")}], None),
    "cfg_neither": ([{"config_dict_or_path": _cfg()}], None),
    "no_cfg": ([{}], None),
    "dtype_fp32": ([{"dtype": torch.float32}], None),
    "dtype_bf16": ([{"dtype": torch.bfloat16}], None),
    "dtype_fp16": ([{"dtype": torch.float16}], None),
    "cfg_bf16_dtype_fp32": ([{"config_dict_or_path": _cfg("bf16"), "dtype": torch.float32}], None),
    "nested_bf16_then_fp16": ([{"config_dict_or_path": _cfg("bf16")}, {"config_dict_or_path": _cfg("fp16")}], None),
    "nested_fp32_then_bf16": ([{"config_dict_or_path": _cfg()}, {"dtype": torch.bfloat16}], None),
    "overrides_none": ([{"config_dict_or_path": _cfg("bf16"), "tensor_overrides": []}], None),
    "overrides_dtype": ([{"config_dict_or_path": _cfg("bf16"), "tensor_overrides": [OVERRIDE.dtype]}], None),
    "no_fp16_dtype_fp32": ([{"dtype": torch.float32}], _no_fp16),
    "no_fp16_no_cfg": ([{}], _no_fp16),
}


def build(inits):
    if not inits:
        return model()
    with deepspeed.zero.Init(**inits[0]):
        return build(inits[1:])


MADE = {  # what each overridden constructor (and one that is not) makes, explicit dtypes and integers included
    "tensor float": lambda: torch.tensor([1.5]), "tensor int": lambda: torch.tensor([1]),
    "tensor bool": lambda: torch.tensor([True]), "tensor float64": lambda: torch.tensor([1.5], dtype=torch.float64),
    "empty": lambda: torch.empty(2), "empty float32": lambda: torch.empty(2, dtype=torch.float32),
    "zeros": lambda: torch.zeros(2), "zeros long": lambda: torch.zeros(2, dtype=torch.long),
    "zeros complex": lambda: torch.zeros(2, dtype=torch.complex64), "ones": lambda: torch.ones(2),
    "full float": lambda: torch.full((2,), 1.5), "full int": lambda: torch.full((2,), 7),
    "arange int": lambda: torch.arange(3), "arange float": lambda: torch.arange(3.0), "eye": lambda: torch.eye(2),
    "randn": lambda: torch.randn(2), "rand": lambda: torch.rand(2), "Tensor()": lambda: torch.Tensor(),
    "Tensor(2, 3)": lambda: torch.Tensor(2, 3), "Parameter()": lambda: nn.Parameter(),
    "tensor requires_grad": lambda: torch.tensor([1.0], requires_grad=True),
}


def made() -> dict:
    out = {}
    for name, make in MADE.items():
        t = make()
        out[name] = (str(t.dtype), t.device.type, tuple(t.shape), type(t).__name__, t.requires_grad, t.is_leaf)
    return out


def constructors() -> dict:
    """What the constructors make inside Init (bf16, then fp16 config), after it, and after an Init left by an
    exception."""
    out = {}
    for precision in ("bf16", "fp16"):
        with deepspeed.zero.Init(config_dict_or_path=_cfg(precision)):
            out["inside " + precision] = made()
    out["after"] = made()
    try:
        with deepspeed.zero.Init(config_dict_or_path=_cfg("bf16")):
            raise KeyError("in the model")
    except KeyError:
        pass
    out["after an exception"] = made()
    return out


def values(m) -> dict:
    out = {}
    with deepspeed.zero.GatheredParameters(list(m.parameters())):
        for name, p in m.named_parameters():
            out["param:" + name] = p.detach().clone()
    for name, b in m.named_buffers():
        out["buffer:" + name] = b.detach().clone()
    return out


def main():
    out = start(deepspeed)
    acc = deepspeed.accelerator.get_accelerator()
    result = {}
    for name, (inits, accelerator_change) in CASES.items():
        saved = acc.__dict__.get("is_fp16_supported")
        if accelerator_change is not None:
            accelerator_change(acc)
        try:
            result[name] = values(build(inits))
        finally:
            if saved is None:
                acc.__dict__.pop("is_fp16_supported", None)
            else:
                acc.is_fp16_supported = saved
    result["fp16_supported"] = bool(acc.is_fp16_supported())
    result["constructors"] = constructors()
    torch.save(result, out)


if __name__ == "__main__":
    main()
