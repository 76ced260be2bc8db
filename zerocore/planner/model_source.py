"""What the planner plans for, as a module on the meta device: a module the caller built there
(under ``torch.device("meta")`` or ``zerocore.init``), a Hugging Face config (a config object or
a ``config.json`` path; the model is built on the meta device, nothing downloaded or allocated),
or a shape (``params``, ``layers``, ``hidden``: a GPT of that shape)."""
from __future__ import annotations

import json
import math
import os

import torch
from torch import nn

COPY_LIMIT = 1 << 30  # bytes of a real module the planner will copy to the meta device itself


def _check_positive(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"zerocore estimate: {name} must be a positive number, got {value!r}")


def from_module(module: nn.Module) -> nn.Module:
    """A meta-device module as it is; a small real one copied to the meta device; a large real one
    refused (a copy would need its memory again)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"zerocore estimate: model must be a torch.nn.Module, a Hugging Face config or a config.json "
                        f"path, got {type(module).__name__}")
    tensors = list(module.parameters()) + list(module.buffers())
    real = [t for t in tensors if t.device.type != "meta" and not hasattr(t, "_zc_init")]  # chunks copy cheaply
    size = sum(t.numel() * t.element_size() for t in real)
    if real and size > COPY_LIMIT:
        name = next(n for n, p in module.named_parameters() if p.device.type != "meta")
        raise ValueError(f"zerocore estimate: the model is not on the meta device (parameter '{name}' is on "
                         f"{real[0].device}) and holds {size / 2**20:.1f} MiB, more than the {COPY_LIMIT / 2**20:.0f} MiB the "
                         "planner copies to the meta device itself; build it "
                         "under `with torch.device('meta'):` (or pass its Hugging Face config)")
    if not real and not any(hasattr(t, "_zc_init") for t in tensors):
        return module
    return _meta_copy(module)


def _meta_copy(module: nn.Module) -> nn.Module:
    """The module with every parameter and buffer an empty meta tensor of its full shape (a
    parameter partitioned by ``zerocore.init`` holds only this rank's chunk: its full shape is
    recorded on it); shared tensors stay shared."""
    from ..sharding.records import full_shape

    memo: dict[int, torch.Tensor] = {}

    def meta_of(t, param: bool):
        if id(t) not in memo:
            e = torch.empty(full_shape(t), dtype=t.dtype, device="meta")
            memo[id(t)] = nn.Parameter(e, requires_grad=t.requires_grad) if param else e
        return memo[id(t)]

    saved = {}
    for m in module.modules():  # swap in meta tensors for the copy, then give the originals back
        saved[m] = (dict(m._parameters), dict(m._buffers))
        for k, p in m._parameters.items():
            if p is not None:
                m._parameters[k] = meta_of(p, True)
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = meta_of(b, False)
    try:
        import copy

        return copy.deepcopy(module)
    finally:
        for m, (params, buffers) in saved.items():
            m._parameters.update(params)
            m._buffers.update(buffers)


def hf_config(source):
    """A transformers config from an object, a config.json path or a directory holding one."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"zerocore estimate: no config.json at {path}")
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"zerocore estimate: {path} is not valid JSON: {e}") from None
    if "model_type" not in data:
        raise ValueError(f"zerocore estimate: {path} has no 'model_type'; it is not a Hugging Face model config")
    return AutoConfig.for_model(**data)


def from_hf_config(source) -> nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = hf_config(source)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def from_shape(params: float, layers: int, hidden: int, ctx: int = 2048) -> nn.Module:
    """zerocore's demo GPT (pre-LN blocks, tied embedding) with ``layers`` blocks of width
    ``hidden``; the vocabulary makes up the rest of ``params``."""
    for name, v in (("params", params), ("layers", layers), ("hidden", hidden)):
        _check_positive(name, v)
    from ..demo import TinyGPT

    h, n_layers = int(hidden), int(layers)
    per_layer = 12 * h * h + 13 * h  # attention 4h^2+4h, MLP 8h^2+5h, two LayerNorms 4h
    vocab = int((params - n_layers * per_layer - ctx * h - 2 * h) // h)
    if vocab < 2:
        raise ValueError(f"zerocore estimate: {params:.3g} parameters cannot make {n_layers} layers of width {h} "
                         f"(the layers alone have {n_layers * per_layer:.3g}); lower --layers or --hidden")
    with torch.device("meta"):
        return TinyGPT(vocab, h, n_layers, heads=max(1, h // 64), ctx=ctx)


def resolve(model=None, *, hf=None, params=None, layers=None, hidden=None) -> nn.Module:
    """The meta-device module to plan for from exactly one of the three inputs."""
    given = [x is not None for x in (model, hf, params)]
    if sum(given) != 1:
        raise ValueError("zerocore estimate: give exactly one of a model, a Hugging Face config, or params/layers/hidden")
    if model is not None:
        if isinstance(model, (str, os.PathLike)):
            return from_hf_config(model)
        if type(model).__name__.endswith("Config") and hasattr(model, "to_dict"):
            return from_hf_config(model)
        return from_module(model)
    if hf is not None:
        return from_hf_config(hf)
    if layers is None or hidden is None:
        raise ValueError("zerocore estimate: --params needs --layers and --hidden")
    return from_shape(params, layers, hidden)
