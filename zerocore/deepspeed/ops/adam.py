"""``deepspeed.ops.adam.FusedAdam`` and ``DeepSpeedCPUAdam``: zerocore's fused Adam with DeepSpeed's
signatures and defaults (``weight_decay`` 0, AdamW unless ``adam_w_mode``/``adamw_mode`` is
false). As client optimizers of an engine, zerocore steps them with its own kernel on the
flat shards. Options zerocore's Adam has no path for are refused, not dropped."""
from __future__ import annotations

from ...ops import FusedAdam as _ZerocoreAdam


def _refuse(where: str, bias_correction: bool, amsgrad: bool) -> None:
    if not bias_correction:
        raise ValueError(f"{where}: bias_correction=False is not supported (zerocore's Adam always corrects bias)")
    if amsgrad:
        raise ValueError(f"{where}: amsgrad=True is not supported by zerocore's Adam")


class FusedAdam(_ZerocoreAdam):
    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True):
        _refuse("FusedAdam", bias_correction, amsgrad)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adam_w_mode)


class DeepSpeedCPUAdam(_ZerocoreAdam):
    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True):
        _refuse("DeepSpeedCPUAdam", bias_correction, amsgrad)
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdam: fp32_optimizer_states=False is not supported (zerocore keeps the "
                             "optimizer state in fp32)")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode)


__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]
