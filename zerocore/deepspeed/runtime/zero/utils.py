"""``deepspeed.runtime.zero.utils.ZeRORuntimeException``, raised by the face where DeepSpeed raises
it (zerocore/deepspeed/semantics.py): a client optimizer with optimizer offload while
``zero_force_ds_cpu_optimizer`` is true, and ZeRO optimizer states saved at another data-parallel
world size (unless ``checkpoint.load_universal``). ``zerocore.initialize``'s engines accept both."""


class ZeRORuntimeException(Exception):
    pass
