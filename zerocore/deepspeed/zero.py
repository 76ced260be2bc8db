"""``deepspeed.zero``: ``Init`` (partition parameters while the model is built) and
``GatheredParameters`` (full parameters for a while), over ``zerocore.init`` and
``zerocore.gathered``; ``register_external_parameter`` (``zerocore.sharding.external``)."""
from __future__ import annotations

import contextlib
import functools

import torch

from ..runtime.gathered import gathered
from ..runtime.keep_in_fp32 import AUTO, keep_named_buffers_in_fp32
from ..runtime.partition_init import init as _zc_init
from ..sharding.external import register_external_parameter, unregister_external_parameter  # noqa: F401
from .tensor_overrides import (DEFAULT_TENSOR_OVERRIDES, DeepSpeedTensorOverride, TensorOverrides,
                               accelerator_device, checked_overrides)

_INIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_open_inits = 0  # enabled Inits open now; as in DeepSpeed, only the outermost one does anything


class Init:
    """``with deepspeed.zero.Init(config_dict_or_path=cfg):`` builds the model with its parameters
    partitioned across the ranks (stage 3), through ``zerocore.init``. As DeepSpeed's, it overrides
    torch's tensor constructors while open (``tensor_overrides.py``): each new floating tensor is
    made in Init's dtype on this rank's accelerator, so layers initialise their weights in that
    dtype; the buffers the config's ``data_types.keep_in_fp32_modules`` names (by default a Transformers
    model's lists) go back to fp32 (``runtime/keep_in_fp32.py``).
    ``dtype``: the config's training dtype (bf16/fp16, else fp32) without ``dtype=``; otherwise
    DeepSpeed's rule, ``dtype`` (fp16 when None) where the accelerator has fp16 and bf16 where it
    has not (see :func:`init_dtype`). An Init opened inside another changes nothing (the outer
    one's dtype holds). ``module=``: a model already built is partitioned by ``initialize`` itself,
    so the context has nothing to do for it. ``enabled=False``: a plain build. Model-parallel
    groups (``mpu``, ``data_parallel_group`` other than the world), ``remote_device`` nvme and
    quantized weights are refused."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear: bool = True, remote_device=None,
                 pin_memory: bool = False, config_dict_or_path=None, config=None, enabled: bool = True, dtype=None,
                 mpu=None, zero_param_parallel_group=None, zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False, sequence_data_parallel_group=None,
                 param_swapper=None, tensor_overrides=DEFAULT_TENSOR_OVERRIDES):
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
        overrides = checked_overrides(tensor_overrides)
        cfg = config_dict_or_path if config_dict_or_path is not None else config
        if cfg is not None:
            from .semantics import loadable

            cfg = loadable(cfg)
        self._cfg = cfg
        # the buffers kept in fp32: the config's data_types.keep_in_fp32_modules, as DeepSpeed's Init reads it
        self._keep_in_fp32 = _keep_in_fp32_setting(cfg)
        self._enabled = bool(enabled) and module is None
        self.dtype = init_dtype(cfg, dtype)
        # DeepSpeed's partitions come out in Init's dtype only through its overridden torch.empty: without
        # the dtype override a parameter keeps the dtype it was made in
        self._partition_dtype = self.dtype if DeepSpeedTensorOverride.dtype in overrides else None
        self._device = accelerator_device() if DeepSpeedTensorOverride.device in overrides else None
        self._overrides = TensorOverrides(self._partition_dtype, self._device)
        self._ctx = None  # the outermost Init's zerocore.init, while open

    def __enter__(self):
        global _open_inits
        if not self._enabled:
            return self
        if _open_inits == 0:
            # as DeepSpeed's, after each module's __init__: the buffers its Transformers lists name back to fp32
            ctx = _zc_init(self._cfg, dtype=self._partition_dtype, device=self._device,
                           after_module=functools.partial(keep_named_buffers_in_fp32, dtype=self.dtype,
                                                          setting=self._keep_in_fp32))
            ctx.__enter__()
            try:
                self._overrides.install()
            except BaseException as e:
                ctx.__exit__(type(e), e, e.__traceback__)
                raise
            self._ctx = ctx
        _open_inits += 1
        return self

    def __exit__(self, *exc):
        global _open_inits
        if not self._enabled:
            return False
        _open_inits -= 1
        ctx, self._ctx = self._ctx, None
        if ctx is None:  # an inner Init
            return False
        try:
            return ctx.__exit__(*exc)  # the last parameters are partitioned under the overrides, as DeepSpeed's
        finally:
            self._overrides.remove()


def init_dtype(cfg, dtype) -> torch.dtype:
    """DeepSpeed 0.19.8's dtype for ``Init``: with a config and no ``dtype``, the config's bf16/fp16
    training dtype, else fp32. Otherwise its ``dtype or torch.float16 if <fp16> else torch.bfloat16 if
    <bf16> else torch.float32``, which Python reads as ``(dtype or fp16) if <fp16> else bf16`` (and
    ``<bf16>`` is the method itself, always true): ``dtype`` (fp16 when None) where the accelerator
    has fp16, bf16 where it has not, whatever ``dtype`` asked."""
    if dtype is not None and dtype not in _INIT_DTYPES:
        raise ValueError(f"zerocore.deepspeed.zero.Init: dtype={dtype} is not one DeepSpeed's Init takes "
                         f"(torch.float16, torch.bfloat16, torch.float32)")
    if cfg is not None and dtype is None:
        from ..config import load_config

        c = load_config(cfg)
        return torch.bfloat16 if c.bf16.enabled else torch.float16 if c.fp16.enabled else torch.float32
    from .accelerator import get_accelerator

    return (dtype or torch.float16) if get_accelerator().is_fp16_supported() else torch.bfloat16


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


def _keep_in_fp32_setting(cfg):
    """``data_types.keep_in_fp32_modules`` of the config given to Init ("auto" without one)."""
    if cfg is None:
        return AUTO
    import warnings

    from ..config import load_config

    with warnings.catch_warnings():  # initialize warns of the config's keys; Init only reads one
        warnings.simplefilter("ignore")
        return load_config(cfg).data_types.keep_in_fp32_modules


def __getattr__(name: str):
    # ``deepspeed.zero.TiledLinear``: the class lives in runtime/zero/tiling.py, imported when first asked for
    if name in ("TiledLinear", "TiledLinearReturnBias"):
        from .runtime.zero import tiling

        return getattr(tiling, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
