"""``deepspeed.checkpoint``: the helpers scripts import from ``deepspeed.checkpoint.utils``, and
``ds_to_universal`` (a zerocore checkpoint's universal form: ``ds_to_universal.py``)."""
from . import ds_to_universal, utils  # noqa: F401

UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"  # DeepSpeed's client_state key (saved as any other)
