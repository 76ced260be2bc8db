"""``deepspeed.runtime.zero``: the names DeepSpeed scripts import from here."""
from . import offload_config  # noqa: F401
