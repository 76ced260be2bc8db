"""The models and the variants of benchmarks/step.py.

A variant is a builder ``(model, ctx) -> step`` registered under its name with the devices it
runs on and the package it needs; add one with ``@variant(...)`` (the offload variants go here
too). ``ctx`` carries the device, the world size and the arguments. The step is a ``TorchStep``
or an ``EngineStep``: ``step(x, y) -> loss`` runs one training step, ``step.close()`` tears the
variant down (its library's teardown, then every reference the step holds dropped) so that the
runner can free it and check that its memory came back (benchmarks/step_cuda.py).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass
class Ctx:
    device: torch.device
    world: int
    args: object  # the parsed command line

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class Variant:
    name: str
    build: Callable
    devices: tuple
    needs: str | None  # an importable package, or None


REGISTRY: dict[str, Variant] = {}


def variant(name: str, devices=("cpu", "cuda"), needs: str | None = None):
    def register(fn):
        REGISTRY[name] = Variant(name, fn, tuple(devices), needs)
        return fn
    return register


def unavailable(name: str, device: str) -> str | None:
    """Why ``name`` cannot run on ``device`` here (None: it can)."""
    v = REGISTRY[name]
    if device not in v.devices:
        return f"runs on {', '.join(v.devices)} only"
    if v.needs and importlib.util.find_spec(v.needs) is None:
        return f"needs {v.needs} (not installed)"
    return None


# ---- models -----------------------------------------------------------------------------------
MODELS = ("gpt", "hf-gpt2", "hf-llama")
UNIT_CLASS = {"gpt": "Block", "hf-gpt2": "GPT2Block", "hf-llama": "LlamaDecoderLayer"}


def build_model(kind: str, args, vocab: int) -> torch.nn.Module:
    """The benchmark's model, seeded: zerocore's TinyGPT (tied embeddings, pre-LN blocks), or a
    Hugging Face GPT-2 / Llama (GQA, half the heads for keys/values) built from a config."""
    torch.manual_seed(0)
    if kind == "gpt":
        from zerocore.demo import TinyGPT

        return TinyGPT(vocab, args.dim, args.layers, heads=args.heads, ctx=args.ctx)
    if kind == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=args.ctx, n_embd=args.dim, n_layer=args.layers,
                                          n_head=args.heads))
    if kind == "hf-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=args.dim, intermediate_size=int(2.75 * args.dim) // 8 * 8,
            num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.ctx))
    raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {kind!r}")


def blocks_of(model) -> list:
    """The repeated blocks (FSDP2 wraps each; zerocore stage 3 makes each a unit)."""
    for path in ("blocks", "transformer.h", "model.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return list(obj)
    raise ValueError(f"no blocks found in {type(model).__name__}")


def logits(model, x):
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def loss_of(model, x, y):
    return F.cross_entropy(logits(model, x).flatten(0, 1).float(), y.flatten())


# ---- variants ---------------------------------------------------------------------------------
LR, WD = 1e-3, 0.01


class TorchStep:
    """A torch model and optimizer (DDP, FSDP2, torch AMP). Torch has no teardown method for
    them: ``close()`` drops both, and with them the parameters, gradients and optimizer state."""

    def __init__(self, model, opt, autocast: bool = False):
        self.model, self.opt, self.autocast = model, opt, autocast

    def __call__(self, x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            loss = loss_of(self.model, x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def close(self, failed: bool = False) -> None:
        self.model = self.opt = None


class EngineStep:
    """A zerocore engine (the native one or its DeepSpeed face): backward and step through it.
    ``close()`` = ``engine.destroy()``, zerocore's documented teardown (hooks off, workers and
    swap stores closed), then the engine dropped; after a failure (``failed``) without the
    stage-3 gather, a collective the other ranks may not join."""

    def __init__(self, engine):
        self.engine = engine

    def __call__(self, x, y):
        loss = loss_of(self.engine, x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss

    def close(self, failed: bool = False) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            self._destroy(engine, failed)

    @staticmethod
    def _destroy(engine, failed: bool) -> None:
        engine.destroy(collective=not failed)


class DeepSpeedStep(EngineStep):
    """DeepSpeed's engine: ``close()`` calls its ``destroy()`` (no arguments; versions without one
    are only dropped)."""

    @staticmethod
    def _destroy(engine, failed: bool) -> None:
        destroy = getattr(engine, "destroy", None)
        if destroy is not None:
            destroy()


def _ddp(model, ctx: Ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[ctx.device.index] if ctx.cuda else None)


@variant("ddp_torch_adamw", devices=("cpu",))
def _ddp_torch_adamw(model, ctx):
    ddp = _ddp(model, ctx)
    return TorchStep(ddp, torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WD))


@variant("ddp_fused_adam", devices=("cpu",))
def _ddp_fused_adam(model, ctx):
    import zerocore

    ddp = _ddp(model, ctx)
    return TorchStep(ddp, zerocore.FusedAdam(ddp.parameters(), lr=LR, weight_decay=WD))


@variant("torch_amp", devices=("cuda",))
def _torch_amp(model, ctx):
    """fp32 parameters, bf16 autocast, torch's fused AdamW (DDP when there are several GPUs)."""
    m = _ddp(model, ctx) if ctx.world > 1 else model
    return TorchStep(m, torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD, fused=True), autocast=True)


@variant("fsdp2")
def _fsdp2(model, ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if ctx.cuda
          else MixedPrecisionPolicy())
    for b in blocks_of(model):
        fully_shard(b, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return TorchStep(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=ctx.cuda or None))


def stage3_config(model, unit_class: str, persist: int) -> dict:
    """Stage 3 wrapped like FSDP2: a unit per block + the root, prefetch one block ahead."""
    block_elems = sum(p.numel() for p in blocks_of(model)[0].parameters() if p.numel() >= persist)
    return {"stage3_unit_classes": [unit_class], "stage3_param_persistence_threshold": persist,
            "stage3_prefetch_bucket_size": block_elems}


def _offload_keys(stage: int) -> dict:
    """Optimizer state and step on the host; at stage 3 the parameter shards too."""
    z = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if stage == 3:
        z["offload_param"] = {"device": "cpu", "pin_memory": True}
    return z


def nvme_dir(a, name: str) -> str:
    """A fresh folder for one variant's swap files under ``--nvme-dir`` (step.py removes it)."""
    import os

    path = os.path.join(a.nvme_dir, name)
    os.makedirs(path, exist_ok=True)
    return path


def aio_section(a) -> dict:
    """The ``aio`` section both libraries get (DeepSpeed's key names; zerocore reads them too)."""
    return {"block_size": a.aio_block_size, "queue_depth": a.aio_queue_depth, "thread_count": a.aio_threads,
            "single_submit": False, "overlap_events": True}


def _nvme_keys(a, name: str, params: bool, buffers: int) -> dict:
    """NVMe offload: the optimizer state (and with ``params`` the stage-3 parameter shards beyond
    ``max_in_cpu``) in swap files under the variant's folder; the DeepSpeed form, for both.
    ``buffers``: a zerocore buffer holds a whole tile (master, m and v: 12 bytes per element), a
    DeepSpeed buffer one tensor of a sub-group (4 bytes per element; fp32, m, v and the gradient
    of a sub-group in flight, twice with pipelining), hence the separate counts."""
    z = {"sub_group_size": int(a.sub_group),
         "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir(a, name), "pin_memory": True,
                               "buffer_count": buffers, "pipeline_read": True, "pipeline_write": True,
                               "fast_init": True}}
    if params:
        z["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir(a, name), "pin_memory": True,
                              "buffer_count": 5, "buffer_size": int(a.param_buffer), "max_in_cpu": int(a.max_in_cpu)}
    return z


def decay_groups(model) -> list[dict]:
    """Two hyper-parameter groups as LLM recipes make them: decay on matrices, none (and half the
    lr) on biases and norms."""
    ps = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in ps if p.ndim >= 2]},
            {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0, "lr": LR / 2}]


def _zerocore(stage: int, check: bool = True, offload: bool = False, nvme: str | None = None,
              groups: bool = False, sgd: bool = False, nan_check: bool = True, host_batch: bool = True,
              speculative: bool = False):
    """``nvme``: None, "opt" (optimizer state on NVMe) or "param" (and the parameter shards).
    ``groups``: two hyper-parameter groups and a WarmupLR schedule; ``sgd``: a client
    torch.optim.SGD with momentum instead of the config's AdamW. ``nan_check`` False:
    ``bf16.check_grad_overflow: false`` (no host read of the Inf/NaN flag per step: torch AMP's and
    FSDP2's behaviour; the default, true, is DeepSpeed's and skips such a step). ``host_batch`` False:
    each offloaded group's host step handed to the worker on its own, as before offload/host_batch.py
    (an A/B of that change in one run). ``speculative``: offload_optimizer.speculative_step (the host Adam
    started during the backward, offload/speculation.py)."""
    def build(model, ctx):
        import zerocore

        a = ctx.args
        z = {"stage": stage, "reduce_bucket_size": int(a.bucket), "overlap_comm": True}
        if stage == 3:
            z.update(stage3_config(model, UNIT_CLASS[a.model], a.persist), stage3_check_divergence=check)
        if offload:
            z.update(_offload_keys(stage))
            if speculative:
                z["offload_optimizer"] = {**z["offload_optimizer"], "speculative_step": True}
        cfg = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
               "zero_optimization": z}
        if nvme:
            z.update(_nvme_keys(a, f"zerocore_stage{stage}_nvme_{nvme}", nvme == "param", a.buffer_count))
            cfg["aio"] = aio_section(a)
        if ctx.cuda:
            cfg["bf16"] = {"enabled": True, "check_grad_overflow": nan_check}
        kw = {}
        if groups:
            cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 1000, "warmup_max_lr": LR}}
            kw["model_parameters"] = decay_groups(model)
        if sgd:
            del cfg["optimizer"]
            kw["optimizer"] = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=WD)
        if host_batch:
            engine = zerocore.initialize(model, cfg, **kw)
        else:
            import zerocore.runtime.engine as engine_module

            batchable, engine_module.batchable = engine_module.batchable, lambda shard: False
            try:
                engine = zerocore.initialize(model, cfg, **kw)
            finally:
                engine_module.batchable = batchable
        return EngineStep(engine)
    return build


for _s in range(4):
    variant(f"zerocore_stage{_s}")(_zerocore(_s))
variant("zerocore_stage3_nocheck")(_zerocore(3, check=False))
for _s in (2, 3):  # bf16 without the per-step Inf/NaN read (cuda: the CPU runs fp32, which has none)
    variant(f"zerocore_stage{_s}_no_nan_check", devices=("cuda",))(_zerocore(_s, nan_check=False))
for _s in (1, 2, 3):
    variant(f"zerocore_stage{_s}_groups")(_zerocore(_s, groups=True))
variant("zerocore_stage2_sgd")(_zerocore(2, sgd=True))
variant("zerocore_stage2_offload")(_zerocore(2, offload=True))
variant("zerocore_stage2_offload_per_group")(_zerocore(2, offload=True, host_batch=False))
# bf16 (cuda): fp32 on a CPU device has its master as the parameter, which a speculative step may not write
for _s in (2, 3):
    variant(f"zerocore_stage{_s}_offload_speculative", devices=("cuda",))(_zerocore(_s, offload=True, speculative=True))
variant("zerocore_stage3_offload")(_zerocore(3, offload=True))
variant("zerocore_stage3_nvme")(_zerocore(3, nvme="opt"))
variant("zerocore_stage3_nvme_param")(_zerocore(3, nvme="param"))


def deepspeed_env(ctx: Ctx) -> None:
    """What a launcher would have set and DeepSpeed reads when the script made the process group
    itself (as step.py does): ``LOCAL_RANK`` (its engine refuses to start without it: "DeepSpeed
    requires the LOCAL_RANK environment variable"), ``RANK``, ``WORLD_SIZE``; on the CPU its CPU
    accelerator. Values a launcher set are kept. ``MASTER_ADDR``/``MASTER_PORT`` are not needed:
    DeepSpeed reads them only to create the group, and it finds one. The ranks are one machine's
    (step.py spawns them), so the local rank is the GPU's index, or the rank on the CPU."""
    import os

    local = ctx.device.index if ctx.cuda and ctx.device.index is not None else dist.get_rank()
    if not ctx.cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("LOCAL_RANK", local), ("RANK", dist.get_rank()), ("WORLD_SIZE", dist.get_world_size())):
        os.environ.setdefault(key, str(value))


def _deepspeed(stage: int, offload: bool = False, nvme: str | None = None):
    def build(model, ctx):
        deepspeed_env(ctx)
        import deepspeed

        a = ctx.args
        z = {"stage": stage, "reduce_bucket_size": int(a.bucket), "overlap_comm": True}
        if stage == 3:
            z.update(stage3_param_persistence_threshold=a.persist,
                     stage3_prefetch_bucket_size=stage3_config(model, UNIT_CLASS[a.model],
                                                               a.persist)["stage3_prefetch_bucket_size"])
        if offload:
            z.update(_offload_keys(stage))
        if nvme:
            z.update(_nvme_keys(a, f"deepspeed_stage{stage}_nvme_{nvme}", nvme == "param", a.ds_buffer_count))
        cfg = {"train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
               "zero_optimization": z, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}
        if nvme:
            cfg["aio"] = aio_section(a)
        if ctx.cuda:
            cfg["bf16"] = {"enabled": True}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                          dist_init_required=not dist.is_initialized())
        return DeepSpeedStep(engine)
    return build


for _s in (1, 2, 3):
    variant(f"deepspeed_stage{_s}", needs="deepspeed")(_deepspeed(_s))
variant("deepspeed_stage2_offload", needs="deepspeed")(_deepspeed(2, offload=True))
variant("deepspeed_stage3_offload", needs="deepspeed")(_deepspeed(3, offload=True))
variant("deepspeed_stage3_nvme", needs="deepspeed")(_deepspeed(3, nvme="opt"))
variant("deepspeed_stage3_nvme_param", needs="deepspeed")(_deepspeed(3, nvme="param"))


def _face(stage: int, client_sgd: bool = False):
    """Through ``zerocore.deepspeed.initialize`` as a DeepSpeed script calls it: two hyper-parameter
    groups (decay on matrices, none on biases and norms) and a WarmupLR schedule whose warm-up is
    over (so the lr equals the single-group variant's), or a client torch SGD with momentum."""
    def build(model, ctx):
        import zerocore.deepspeed as deepspeed

        a = ctx.args
        z = {"stage": stage, "reduce_bucket_size": int(a.bucket), "overlap_comm": True}
        if stage == 3:
            z.update(stage3_config(model, UNIT_CLASS[a.model], a.persist))
        cfg = {"train_micro_batch_size_per_gpu": a.batch, "gradient_clipping": 0.0, "zero_optimization": z,
               "steps_per_print": 10 ** 9}
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}]
        if client_sgd:
            cfg["zero_allow_untested_optimizer"] = True  # (DeepSpeed refuses SGD at a ZeRO stage without it)
            engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                              optimizer=torch.optim.SGD(groups, lr=LR, momentum=0.9))
            return EngineStep(engine)
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                           "warmup_num_steps": 1}}
        if ctx.cuda:
            cfg["bf16"] = {"enabled": True}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
        return EngineStep(engine)
    return build


for _s in (1, 2, 3):
    variant(f"zerocore_face_stage{_s}")(_face(_s))
variant("zerocore_face_sgd_stage2", devices=("cpu",))(_face(2, client_sgd=True))


@variant("ddp_torch_sgd", devices=("cpu",))
def _ddp_torch_sgd(model, ctx):
    ddp = _ddp(model, ctx)
    return TorchStep(ddp, torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9, weight_decay=WD))


CPU_DEFAULT = ["ddp_torch_adamw", "ddp_fused_adam", "fsdp2", "zerocore_stage0", "zerocore_stage1", "zerocore_stage2",
               "zerocore_stage3", "zerocore_stage3_nocheck"]
CUDA_DEFAULT = ["torch_amp", "fsdp2", "deepspeed_stage1", "deepspeed_stage2", "deepspeed_stage3", "zerocore_stage0",
                "zerocore_stage1", "zerocore_stage2", "zerocore_stage3"]
# CPU offload: zerocore's stage 2 with the optimizer on the host beside the same stage without it and DeepSpeed's same configuration
OFFLOAD = ["zerocore_stage2", "zerocore_stage2_offload", "zerocore_stage2_offload_speculative", "deepspeed_stage2",
           "deepspeed_stage2_offload", "zerocore_stage3", "zerocore_stage3_offload",
           "zerocore_stage3_offload_speculative", "deepspeed_stage3_offload"]
# NVMe offload: stage 3 with the optimizer state (and the parameter shards) on NVMe beside DeepSpeed's same
# configuration, with stage 3 in memory and DDP for scale
NVME = ["ddp_torch_adamw", "zerocore_stage3", "zerocore_stage3_nvme", "deepspeed_stage3_nvme",
        "zerocore_stage3_nvme_param", "deepspeed_stage3_nvme_param"]
# the DeepSpeed face: groups + schedule vs the single-group engine; a client SGD vs DDP with SGD
FACE = ["zerocore_stage1", "zerocore_face_stage1", "zerocore_stage2", "zerocore_face_stage2", "zerocore_stage3",
        "zerocore_face_stage3", "ddp_torch_sgd", "zerocore_face_sgd_stage2"]
# two hyper-parameter groups + a schedule beside one group (the cost of groups), and a client SGD
# at stage 2 beside DDP with the same SGD
GROUPS = ["zerocore_stage1", "zerocore_stage1_groups", "zerocore_stage2", "zerocore_stage2_groups",
          "zerocore_stage3", "zerocore_stage3_groups", "ddp_torch_sgd", "zerocore_stage2_sgd"]
PRESETS = {"offload": OFFLOAD, "nvme": NVME, "face": FACE, "groups": GROUPS}
