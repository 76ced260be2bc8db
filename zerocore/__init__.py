"""zerocore: ZeRO sharded data parallelism for PyTorch, with native kernels.

The kernels are available now as ``zerocore.ops`` (fused Adam, packing, casts, norms).
"""
__version__ = "0.1.0"

from . import ops  # noqa: E402
from .ops import FusedAdam  # noqa: E402
from .config import ConfigError, ZeroConfig  # noqa: E402
from .runtime import Engine, gathered, init, initialize  # noqa: E402
from .comm.divergence import DivergenceError  # noqa: E402
from .sharding.external import register_external_parameter, unregister_external_parameter  # noqa: E402
from . import _wiring  # noqa: E402,F401 - gives the runtime the checkpoint package's and the planner's entry points



def estimate(*args, **kwargs):
    """Per-rank memory of a training run before anything is allocated: ``zerocore.planner.estimate``."""
    from .planner import estimate as plan

    return plan(*args, **kwargs)


__all__ = ["estimate", "ops", "FusedAdam", "initialize", "init", "gathered", "Engine", "ZeroConfig", "ConfigError",
           "DivergenceError", "register_external_parameter", "unregister_external_parameter", "__version__"]
