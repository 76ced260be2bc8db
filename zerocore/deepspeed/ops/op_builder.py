"""``deepspeed.ops.op_builder``: the builder classes scripts ask ``is_compatible()`` (and
``deepspeed.ops.__compatible_ops__``) before choosing an optimizer. zerocore builds its own kernels
(``zerocore.ops``); an op is compatible when the face offers it backed by one of them: Adam on the
device and on the host (``deepspeed.ops.adam``) and asynchronous NVMe I/O. ``load()`` of DeepSpeed's
extension is not offered."""
from __future__ import annotations


class OpBuilder:
    NAME = "op"
    _OFFERED = False

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        return self._OFFERED

    def load(self, verbose: bool = True):
        raise NotImplementedError(f"zerocore.deepspeed: DeepSpeed's {self.NAME} extension is not part of the face; "
                                  "zerocore's kernels are in zerocore.ops (Adam: zerocore.deepspeed.ops.adam)")


def _builder(class_name: str, name: str, offered: bool) -> type:
    return type(class_name, (OpBuilder,), {"NAME": name, "_OFFERED": offered, "__module__": __name__})


AsyncIOBuilder = _builder("AsyncIOBuilder", "async_io", True)
FusedAdamBuilder = _builder("FusedAdamBuilder", "fused_adam", True)
CPUAdamBuilder = _builder("CPUAdamBuilder", "cpu_adam", True)
CPUAdagradBuilder = _builder("CPUAdagradBuilder", "cpu_adagrad", False)
CPULionBuilder = _builder("CPULionBuilder", "cpu_lion", False)
FusedLambBuilder = _builder("FusedLambBuilder", "fused_lamb", False)
FusedLionBuilder = _builder("FusedLionBuilder", "fused_lion", False)
QuantizerBuilder = _builder("QuantizerBuilder", "quantizer", False)
RandomLTDBuilder = _builder("RandomLTDBuilder", "random_ltd", False)
SparseAttnBuilder = _builder("SparseAttnBuilder", "sparse_attn", False)
TransformerBuilder = _builder("TransformerBuilder", "transformer", False)
StochasticTransformerBuilder = _builder("StochasticTransformerBuilder", "stochastic_transformer", False)
InferenceBuilder = _builder("InferenceBuilder", "transformer_inference", False)
EvoformerAttnBuilder = _builder("EvoformerAttnBuilder", "evoformer_attn", False)
FPQuantizerBuilder = _builder("FPQuantizerBuilder", "fp_quantizer", False)
GDSBuilder = _builder("GDSBuilder", "gds", False)

ALL_OPS = {b.NAME: b for b in (AsyncIOBuilder, FusedAdamBuilder, CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder,
                               FusedLambBuilder, FusedLionBuilder, QuantizerBuilder, RandomLTDBuilder,
                               SparseAttnBuilder, TransformerBuilder, StochasticTransformerBuilder, InferenceBuilder,
                               EvoformerAttnBuilder, FPQuantizerBuilder, GDSBuilder)}
