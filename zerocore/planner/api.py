"""``zerocore.estimate``: per-rank memory of one or every sensible configuration, and which to use.

Each configuration goes through zerocore's own config parser and the engine's start-up checks
(a config the engine refuses raises the same error here), then ``core.plan_one``.
"""
from __future__ import annotations

import copy

import torch

from ..config import ZeroConfig, load_config
from ..runtime.preflight import check_config
from . import core, model_source
from .recommend import recommend

DTYPES = ("fp32", "bf16", "fp16")  # of the generated configs
CANDIDATES = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (1, "cpu"), (2, "cpu"), (3, "cpu"),
              (1, "nvme"), (2, "nvme"), (3, "nvme")]  # fastest first: least offload, then least sharding


def host_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("cannot read MemTotal from /proc/meminfo; pass host_memory=")


def candidate_config(stage: int, offload: str, *, micro_batch: int, dtype: str, nvme_path: str) -> dict:
    z: dict = {"stage": stage}
    if offload != "none":
        z["offload_optimizer"] = {"device": offload}
        if offload == "nvme":
            z["offload_optimizer"]["nvme_path"] = nvme_path
        if stage == 3:
            z["offload_param"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": z}
    if dtype in ("bf16", "fp16"):
        cfg[dtype] = {"enabled": True}
    return cfg


def _default_seq(meta) -> int:
    cfg = getattr(meta, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        if cfg is not None and getattr(cfg, key, None):
            return min(2048, int(getattr(cfg, key)))
    pos = getattr(meta, "pos", None)
    return int(pos.shape[0]) if isinstance(pos, torch.Tensor) else 1024


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"zerocore estimate: {name} must be a positive integer, got {v!r}")
    return v


def plan_config(meta, cfg: ZeroConfig, *, world: int, micro_batch: int, seq_len: int, checkpointing: bool,
                device: torch.device, max_traced_layers: int) -> dict:
    check_config(cfg)  # the engine's own checks first: the same errors
    plan = core.plan_one(meta, cfg, world=world, micro_batch=micro_batch, seq_len=seq_len,
                         checkpointing=checkpointing, device=device, max_traced_layers=max_traced_layers)
    z = cfg.zero_optimization
    b = plan.between
    host_roles = {k: v for k, v in b.items() if k.startswith("host_") and k != "host_total"}
    dev_roles = {k: v for k, v in b.items() if not k.startswith("host_") and k != "total"}
    on_cpu = device.type == "cpu"
    peak = dict(plan.at_peak)
    peak["allocator_rounding"] = plan.rounding
    peak["total"] = plan.peak
    out = {
        "stage": z.stage, "offload_optimizer": z.offload_optimizer.device, "offload_param": z.offload_param.device,
        "dtype": {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[core.dtype_of(cfg)],
        "world": world, "micro_batch": micro_batch, "seq_len": seq_len, "checkpointing": checkpointing,
        "device": str(device),
        "between_steps": {"device": dev_roles, "host": host_roles, "nvme": plan.nvme_bytes,
                          "total": b["total"] + b["host_total"]},
        "peak": peak,
        "peak_device": plan.peak - (0 if on_cpu else b["host_total"]),
        "peak_host": b["host_total"] if not on_cpu else plan.peak,
        "traced_layers": plan.traced_layers,
        "gloo_allgather_scratch": plan.comm_scratch,
    }
    return out


def estimate(model=None, config=None, *, hf=None, params=None, layers=None, hidden=None, world=None, ranks_per_node=None,
             nodes: int = 1, micro_batch=None, seq_len=None, checkpointing: bool = False, device=None,
             device_memory=None, host_memory=None, dtype: str = "bf16", nvme_path: str = "/local_nvme",
             headroom: float = 0.05, max_traced_layers: int = 4, with_recommendation: bool = False):
    """Per-rank memory of training ``model`` with ``config`` (or, with ``config=None``, every
    sensible configuration: stages 0-3 x optimizer offload none/cpu/nvme, parameter offload to the
    host at stage 3 with offload) on ``ranks_per_node`` x ``nodes`` ranks. Returns the list of
    plans (dicts); with ``with_recommendation`` also the recommendation: ``(plans, advice)``."""
    meta = model_source.resolve(model, hf=hf, params=params, layers=layers, hidden=hidden)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if world is not None:  # all on one node unless said otherwise
        ranks_per_node = ranks_per_node or _positive_int("world", world) // _positive_int("nodes", nodes)
    if ranks_per_node is None:
        ranks_per_node = torch.cuda.device_count() if dev.type == "cuda" and torch.cuda.is_available() else 1
    world = _positive_int("ranks_per_node", ranks_per_node) * _positive_int("nodes", nodes)
    if dtype not in DTYPES:
        raise ValueError(f"zerocore estimate: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not 0 <= headroom < 1:
        raise ValueError(f"zerocore estimate: headroom must be a fraction in [0, 1), got {headroom!r}")
    if config is not None:
        cfgs = [load_config(copy.deepcopy(config) if isinstance(config, dict) else config)]
        mb = micro_batch if micro_batch is not None else (cfgs[0].batch_sizes(world)[1] or 1)
    else:
        mb = _positive_int("micro_batch", micro_batch if micro_batch is not None else 1)
        cfgs = [load_config(candidate_config(s, o, micro_batch=mb, dtype=dtype, nvme_path=nvme_path))
                for s, o in CANDIDATES]
    mb = _positive_int("micro_batch", mb)
    seq = _positive_int("seq_len", seq_len if seq_len is not None else _default_seq(meta))
    plans = [plan_config(meta, c, world=world, micro_batch=mb, seq_len=seq, checkpointing=checkpointing, device=dev,
                         max_traced_layers=max_traced_layers) for c in cfgs]
    if not with_recommendation:
        return plans
    host = host_memory if host_memory is not None else host_memory_bytes()
    if dev.type == "cuda" and device_memory is None and torch.cuda.is_available():
        device_memory = torch.cuda.get_device_properties(0).total_memory
    for name, v in (("device_memory", device_memory), ("host_memory", host)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise ValueError(f"zerocore estimate: {name} must be a positive number of bytes, got {v!r}")
    advice = recommend(plans, device_memory=device_memory, host_memory=host, ranks_per_node=ranks_per_node,
                       headroom=headroom, on_cpu=dev.type == "cpu")
    return plans, advice


__all__ = ["estimate", "host_memory_bytes", "CANDIDATES"]
