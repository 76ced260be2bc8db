"""``deepspeed.zero``: ``Init`` (partition parameters while the model is built) and
``GatheredParameters`` (full parameters for a while), over ``zerocore.init`` and
``zerocore.gathered``."""
from __future__ import annotations

import contextlib

import torch

from ..runtime.gathered import gathered
from ..runtime.partition_init import init as _zc_init


class Init:
    """``with deepspeed.zero.Init(config_dict_or_path=cfg):`` builds the model with its parameters
    partitioned across the ranks (stage 3), through ``zerocore.init``. ``module=``: a model already built is partitioned by
    ``initialize`` itself, so the context has nothing to do for it. ``enabled=False``: a plain
    build. ``dtype``: what the parameters are converted to before partitioning; by default, as in
    DeepSpeed, the config's training dtype (bf16/fp16, else fp32), and fp16 when no config is given.
    Model-parallel groups (``mpu``, ``data_parallel_group`` other than the world), ``remote_device``
    nvme and quantized weights are refused."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear: bool = True, remote_device=None,
                 pin_memory: bool = False, config_dict_or_path=None, config=None, enabled: bool = True, dtype=None,
                 mpu=None, zero_param_parallel_group=None, zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False, sequence_data_parallel_group=None,
                 param_swapper=None, **_tensor_overrides):
        if mpu is not None or zero_param_parallel_group is not None or sequence_data_parallel_group is not None:
            raise ValueError("zerocore.deepspeed.zero.Init: model-parallel groups (mpu, zero_param_parallel_group, "
                             "sequence_data_parallel_group) are not supported; zerocore partitions over the world")
        if data_parallel_group is not None and data_parallel_group is not torch.distributed.group.WORLD:
            raise ValueError("zerocore.deepspeed.zero.Init: data_parallel_group other than the world is not "
                             "supported")
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise ValueError("zerocore.deepspeed.zero.Init: quantized weights (ZeRO++) are not implemented")
        if remote_device not in (None, "none", "cpu"):
            raise ValueError(f"zerocore.deepspeed.zero.Init: remote_device={remote_device!r} is not supported at "
                             "build time; set zero_optimization.offload_param in the config (applied at initialize)")
        cfg = config_dict_or_path if config_dict_or_path is not None else config
        if cfg is not None:
            from .semantics import loadable

            cfg = loadable(cfg)
        self._enabled = bool(enabled) and module is None
        self.dtype = dtype if dtype is not None else _init_dtype(cfg)
        self._ctx = _zc_init(cfg, dtype=self.dtype) if self._enabled else contextlib.nullcontext()

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def _init_dtype(cfg) -> torch.dtype:
    """DeepSpeed's dtype for parameters partitioned by ``Init``: the config's bf16/fp16 training
    dtype, fp32 without either; without a config fp16 (bf16, fp32 where the accelerator lacks it)."""
    if cfg is None:
        from .accelerator import get_accelerator

        acc = get_accelerator()
        return torch.float16 if acc.is_fp16_supported() else torch.bfloat16 if acc.is_bf16_supported() else \
            torch.float32
    from ..config import load_config

    c = load_config(cfg)
    return torch.bfloat16 if c.bf16.enabled else torch.float16 if c.fp16.enabled else torch.float32


class GatheredParameters:
    """``with deepspeed.zero.GatheredParameters(params, modifier_rank=0):`` full values of ``params``
    inside the context; the modifier rank's edits are kept on exit (``zerocore.gathered``).
    ``enabled=False``: nothing is gathered. ``fwd_module`` is accepted (zerocore registers
    nothing on the module for gathered parameters)."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        params = [p for p in params if p is not None]
        self._ctx = gathered(params, modifier_rank) if enabled and params else contextlib.nullcontext()

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)
