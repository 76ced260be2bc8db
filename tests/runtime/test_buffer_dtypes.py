"""The dtype floating buffers train in (runtime/buffer_dtypes.py), in one process. The DeepSpeed
face follows DeepSpeed 0.19.8: under bf16/fp16 an fp32 buffer stays fp32 unless
data_types.buffer_dtype names a dtype; zerocore.initialize keeps a Transformers model's buffers and
casts other buffers to the training dtype unless buffer_dtype says "keep" or names one. Under "keep"
a normalization layer's running statistics follow its 16-bit weights (its kernels need that). In
both the buffers data_types.keep_in_fp32_modules names stay fp32 whatever buffer_dtype says, and the
parameters train in the training dtype; stages 1-3 (the values against DeepSpeed itself:
deepspeed_face/test_buffers_against_deepspeed.py)."""
import copy
import warnings

import pytest
import torch
from torch import nn

import zerocore
import zerocore.deepspeed as deepspeed

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Model(nn.Module):
    _keep_in_fp32_modules_strict = ["bias_fp32"]  # Transformers' class lists ("auto")
    _keep_in_fp32_modules = ["half_only"]  # kept under fp16 only

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.randn(4))  # randn: zero.Init makes it bf16
        self.register_buffer("bias_fp32", torch.randn(4).half())  # arrives 16-bit: upcast, as DeepSpeed does
        self.register_buffer("half_only", torch.randn(4))
        self.register_buffer("steps", torch.zeros(1, dtype=torch.long))

    def forward(self, x):
        return self.lin(x) * self.inv_freq.to(x.dtype)


def _engine(face, train, stage, data_types=None, make=None):
    cfg = {"train_micro_batch_size_per_gpu": 1, train: {"enabled": True}, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if data_types is not None:
        cfg["data_types"] = data_types
    torch.manual_seed(0)
    model = (make or Model)()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if face == "deepspeed":
            engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
        else:
            engine = zerocore.initialize(model, cfg)
    x = torch.rand(2, 4).to(DTYPES[train])
    engine.backward(engine(x).float().sum())
    engine.step()  # the dtypes hold through a step
    return model


def _dtypes(model):
    return {n: b.dtype for n, b in model.named_buffers()}


@pytest.mark.parametrize("face, data_types", [("deepspeed", None), ("zerocore", {"buffer_dtype": "keep"}),
                                              ("deepspeed", {"buffer_dtype": "keep"})])
@pytest.mark.parametrize("train", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_buffers_keep_their_dtype_in_the_face_by_default_and_with_keep(face, data_types, train, stage):
    model = _engine(face, train, stage, data_types)
    got = _dtypes(model)
    assert got["inv_freq"] == got["half_only"] == got["bias_fp32"] == torch.float32
    assert got["steps"] == torch.long
    assert all(p.dtype == DTYPES[train] for p in model.parameters())


@pytest.mark.parametrize("train", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [1, 3])
def test_zerocore_initialize_casts_buffers_by_default_but_the_kept(train, stage):
    # BatchNorm's kernels refuse bf16/fp16 weights beside fp32 running statistics: the native default
    got = _dtypes(_engine("zerocore", train, stage))
    assert got["inv_freq"] == DTYPES[train] and got["bias_fp32"] == torch.float32
    assert got["half_only"] == (torch.float32 if train == "fp16" else torch.bfloat16)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = zerocore.initialize(model, {"train_micro_batch_size_per_gpu": 2, train: {"enabled": True}})
    engine.backward(engine(torch.rand(2, 4).to(DTYPES[train])).float().sum())  # runs


@pytest.mark.parametrize("face", ["zerocore", "deepspeed"])
@pytest.mark.parametrize("train", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [2, 3])
def test_buffer_dtype_casts_all_but_the_kept(face, train, stage):
    got = _dtypes(_engine(face, train, stage, {"buffer_dtype": train}))
    assert got["inv_freq"] == DTYPES[train] and got["bias_fp32"] == torch.float32  # "auto": the strict list
    assert got["half_only"] == (torch.float32 if train == "fp16" else torch.bfloat16)  # fp16 also keeps this list
    assert got["steps"] == torch.long


@pytest.mark.parametrize("face", ["zerocore", "deepspeed"])
def test_keep_in_fp32_modules_list_and_none(face):
    got = _dtypes(_engine(face, "bf16", 2, {"buffer_dtype": "bf16", "keep_in_fp32_modules": ["inv_*"]}))
    assert got["inv_freq"] == torch.float32  # the list replaces the class lists
    assert got["bias_fp32"] == got["half_only"] == torch.bfloat16
    got = _dtypes(_engine(face, "bf16", 2, {"buffer_dtype": "fp16", "keep_in_fp32_modules": []}))
    assert got["inv_freq"] == got["bias_fp32"] == got["half_only"] == torch.float16  # any dtype: DeepSpeed's


def test_fp32_training_upcasts_buffers():
    # zerocore trains a 16-bit model in fp32 by upcasting it (parameters and buffers; DeepSpeed refuses it)
    model = Model().bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zerocore.initialize(model, {"train_micro_batch_size_per_gpu": 1, "data_types": {"buffer_dtype": "bf16"}})
    assert all(b.dtype == torch.float32 for n, b in model.named_buffers() if n != "steps")


def test_zero_init_keeps_named_buffers_fp32_through_initialize():
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "data_types": {"buffer_dtype": "bf16"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = Model()
        got = _dtypes(model)  # Init builds every floating buffer in bf16 but the named ones
        assert got["inv_freq"] == torch.bfloat16 and got["bias_fp32"] == torch.float32
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert _dtypes(model)["bias_fp32"] == torch.float32 and _dtypes(model)["inv_freq"] == torch.bfloat16
    cfg["data_types"] = {"keep_in_fp32_modules": ["inv_freq"]}  # Init reads the config's list too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = Model()
    assert _dtypes(model)["inv_freq"] == torch.float32 and _dtypes(model)["bias_fp32"] != torch.float32


def _llama():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192))


class Holder(nn.Module):
    """A Transformers model inside a model of the user's, beside a buffer of the user's."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.register_buffer("scale", torch.full((1,), 1.5))

    def forward(self, **kw):
        return self.inner(**kw).logits * self.scale


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("held", [False, True])
def test_zerocore_initialize_keeps_a_transformers_models_buffers(stage, held):
    llama = _llama()
    plain = copy.deepcopy(llama)
    model = Holder(llama) if held else llama
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = zerocore.initialize(model, {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                             "zero_optimization": {"stage": stage}})
    rotary = llama.model.rotary_emb
    assert rotary.inv_freq.dtype == rotary.original_inv_freq.dtype == torch.float32
    if held:
        assert model.scale.dtype == torch.bfloat16  # the user's own buffer: the training dtype, as before
    # the logits are the model's with bf16 parameters and its fp32 buffers (torch AMP and DeepSpeed keep them),
    # at positions thousands apart, where a bf16 inv_freq moves the angles between tokens by tenths of a radian
    ids, pos = torch.randint(0, 64, (1, 8)), 500 * torch.arange(8)[None]
    for p in plain.parameters():
        p.data = p.data.bfloat16()
    with torch.no_grad():
        got = engine(input_ids=ids, position_ids=pos)
        got = got if held else got.logits
        want = plain(input_ids=ids, position_ids=pos).logits * (1.5 if held else 1.0)
        assert torch.equal(got, want)
        plain.model.rotary_emb.inv_freq = plain.model.rotary_emb.inv_freq.bfloat16()
        rounded = plain(input_ids=ids, position_ids=pos).logits * (1.5 if held else 1.0)
    assert (rounded.float() - want.float()).abs().max() > 10 * (got.float() - want.float()).abs().max() + 1e-3


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.stats_only = nn.BatchNorm1d(6, affine=False)  # no weights: its kernel takes fp32 statistics
        self.register_buffer("table", torch.randn(6))

    def forward(self, x):
        return self.stats_only(self.bn(self.lin(x))) * self.table.to(x.dtype)


@pytest.mark.parametrize("face, data_types", [("deepspeed", None), ("zerocore", {"buffer_dtype": "keep"})])
@pytest.mark.parametrize("train", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [2, 3])
def test_keep_gives_normalization_statistics_their_weights_dtype(face, data_types, train, stage):
    # DeepSpeed 0.19.8 keeps BatchNorm's statistics fp32 beside bf16 weights and fails at its first forward
    model = _engine(face, train, stage, data_types, make=Normed)  # a forward, backward and step ran
    got = _dtypes(model)
    assert got["bn.running_mean"] == got["bn.running_var"] == DTYPES[train]
    assert got["stats_only.running_mean"] == got["table"] == torch.float32
    assert got["bn.num_batches_tracked"] == torch.long
    assert model.bn.running_mean.abs().sum() > 0  # the statistics moved (they start at zero)
