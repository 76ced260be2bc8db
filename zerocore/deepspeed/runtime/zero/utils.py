"""``deepspeed.runtime.zero.utils.ZeRORuntimeException``, for ``except`` clauses written against
DeepSpeed. zerocore raises its own errors (each naming the problem); the cases DeepSpeed raises this
one for are accepted by zerocore: a torch optimizer with optimizer offload (zerocore steps it on the
host itself), an optimizer state saved at another data-parallel world size (zerocore reshards it)."""


class ZeRORuntimeException(Exception):
    pass
