"""``deepspeed.utils.safe_get_full_grad``: a parameter's gradient as the engine holds it."""
from __future__ import annotations

from ...runtime.gathered import owner_of


def safe_get_full_grad(param):
    """The parameter's ``.grad`` when it has one, as DeepSpeed's first answer: at stages 0 and 1
    zerocore keeps every gradient whole in ``.grad`` (a view into the flat gradient buffer: the
    micro-batches accumulated so far, times the fp16 loss scale; summed over the ranks after a
    backward that reduced, this rank's own inside ``no_sync()``). None for a parameter of no engine
    without a gradient. At stages 2 and 3 each rank keeps only its slice of the flat gradient, and
    zerocore does not assemble one parameter's full gradient: refused, naming the stage."""
    if param.grad is not None:
        return param.grad
    engine = owner_of(param)
    if engine is None:
        return None
    stage = engine.zero_optimization_stage()
    if stage >= 2:
        raise NotImplementedError(f"zerocore.deepspeed.utils.safe_get_full_grad: at ZeRO stage {stage} each rank "
                                  "keeps only its slice of the flat reduced gradient and a parameter's full gradient "
                                  "is not assembled; read engine.get_global_grad_norm(), or use stage 0/1")
    return None
