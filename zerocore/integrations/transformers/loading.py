"""Stage-3 models loaded while partitioned, and ``generate`` with ``synced_gpus`` under stage 3.

``from_pretrained(AutoModelForCausalLM, path, config)`` builds the model from its config under
``zerocore.init`` (each rank keeps only its chunk of every parameter as it is built), then copies
the checkpoint's tensors in one module at a time inside ``zerocore.gathered(..., modifier_rank=0)``:
only one module's parameters are ever whole at once. Below stage 3 it is plain ``from_pretrained``.
"""
from __future__ import annotations

import json
import os

import torch

import zerocore
from ...runtime.gathered import owner_of
from .config import zero_stage


def from_pretrained(model_cls, pretrained_path: str, zerocore_config, *, dtype: torch.dtype | None = None,
                    **config_kwargs):
    """``model_cls.from_pretrained(pretrained_path)``, partitioned as it loads when the config is stage 3.

    ``model_cls``: an ``AutoModel*`` class or a model class; ``dtype``: the parameters' dtype
    (None: fp32, converted by the engine later for bf16/fp16 training); ``config_kwargs`` go to
    the model config (``AutoConfig.from_pretrained``)."""
    if zero_stage(zerocore_config) != 3:
        return model_cls.from_pretrained(pretrained_path, dtype=dtype, **config_kwargs) if dtype else \
            model_cls.from_pretrained(pretrained_path, **config_kwargs)
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(pretrained_path, **config_kwargs)
    from transformers.initialization import no_init_weights

    stage3 = {"zero_optimization": {"stage": 3}}  # zerocore.init reads only the stage; "auto"s stay unfilled
    # no random initialisation (every value is loaded next; as Transformers builds DeepSpeed's ZeRO-3 models)
    with no_init_weights(), zerocore.init(stage3, dtype=dtype):
        if hasattr(model_cls, "from_config"):
            model = model_cls.from_config(model_config)
        else:
            model = model_cls._from_config(model_config)
    load_pretrained_weights(model, pretrained_path)
    return model


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"zerocore: no model.safetensors (or model.safetensors.index.json) in {path!r}")


@torch.no_grad()
def load_pretrained_weights(model: torch.nn.Module, path: str) -> None:
    """Copies a ``save_pretrained`` directory's safetensors into ``model`` (whole, or partitioned by
    ``zerocore.init`` or an engine), one module's parameters gathered at a time; rank 0 reads the
    values, the others receive them. Every parameter must be found (under any of its tied names)."""
    from safetensors import safe_open

    files = [safe_open(f, framework="pt") for f in _weight_files(path)]
    where = {k: f for f in files for k in f.keys()}
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    missing, done = [], set()
    for prefix, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in done]
        if own:
            keys = {}
            for n, p in own:
                done.add(id(p))
                key = next((k for k in names[id(p)] if k in where), None)
                if key is None:
                    missing.append(names[id(p)][0])
                else:
                    keys[id(p)] = key
            params = [p for _, p in own if id(p) in keys]
            if params:
                with zerocore.gathered(params, modifier_rank=0):
                    if rank0:
                        for p in params:
                            value = where[keys[id(p)]].get_tensor(keys[id(p)])
                            if value.shape != p.shape:
                                raise ValueError(f"zerocore: {keys[id(p)]} in {path} has shape {tuple(value.shape)}; "
                                                 f"the model's is {tuple(p.shape)}")
                            p.copy_(value)
        for n, b in module.named_buffers(recurse=False):
            key = f"{prefix}.{n}" if prefix else n
            if key in where:
                b.copy_(where[key].get_tensor(key))
    if missing:
        raise ValueError(f"zerocore: {len(missing)} parameter(s) not in {path}: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))


def generate(model, *args, **kwargs):
    """``model.generate`` with ``synced_gpus=True`` when a stage-3 engine holds the model and there
    are several ranks: a rank that finishes early keeps joining the others' forward passes (each
    gathers parameters collectively) until all are done, as Transformers does for DeepSpeed. Plain
    ``model.generate`` does the same now (``zero3.py``); this stays for code written against it."""
    engine = next((owner_of(p) for p in model.parameters()), None)
    if engine is not None and engine.config.zero_optimization.stage == 3 and engine.world_size > 1:
        kwargs.setdefault("synced_gpus", True)
    return model.generate(*args, **kwargs)
