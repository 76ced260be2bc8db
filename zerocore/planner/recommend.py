"""Which configuration to use: the first that fits, in order of throughput (least offload first,
then least sharding: stage 0 communicates least), keeping ``headroom`` of each memory free; when
none fits, the smallest change that would make the most frugal one fit, in one line."""
from __future__ import annotations

import math

_OFFLOAD_RANK = {"none": 0, "cpu": 1, "nvme": 2}


def _order(plan: dict) -> tuple:
    return (_OFFLOAD_RANK[plan["offload_optimizer"]], plan["stage"])


def _needs(plan: dict, ranks_per_node: int, on_cpu: bool) -> tuple[int, int]:
    """(per-rank device bytes, per-node host bytes) at the peak."""
    if on_cpu:  # the training device is host memory: every rank's whole peak is the node's RAM
        return 0, plan["peak"]["total"] * ranks_per_node
    return plan["peak_device"], plan["peak_host"] * ranks_per_node


def fits(plan: dict, *, device_memory, host_memory, ranks_per_node: int, headroom: float, on_cpu: bool) -> dict:
    dev, host = _needs(plan, ranks_per_node, on_cpu)
    ok_dev = on_cpu or device_memory is None or dev <= device_memory * (1 - headroom)
    ok_host = host_memory is None or host <= host_memory * (1 - headroom)
    return {"fits": bool(ok_dev and ok_host), "device_needed": dev, "host_needed": host,
            "device_headroom": None if on_cpu or device_memory is None else device_memory - dev,
            "host_headroom": None if host_memory is None else host_memory - host}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def recommend(plans: list[dict], *, device_memory, host_memory, ranks_per_node: int, headroom: float,
              on_cpu: bool) -> dict:
    for p in plans:
        p["fit"] = fits(p, device_memory=device_memory, host_memory=host_memory, ranks_per_node=ranks_per_node,
                        headroom=headroom, on_cpu=on_cpu)
    ok = sorted((p for p in plans if p["fit"]["fits"]), key=_order)
    if ok:
        best = ok[0]
        room = best["fit"]["host_headroom"] if on_cpu else best["fit"]["device_headroom"]
        where = "host memory" if on_cpu else "device memory"
        line = (f"use stage {best['stage']} with optimizer offload {best['offload_optimizer']}: peak "
                f"{_gib(best['peak']['total'])} per rank, {_gib(room) if room is not None else 'unknown'} of "
                f"{where} left")
        return {"fits": True, "choice": _name(best), "line": line}
    return {"fits": False, "choice": None, "line": _smallest_change(plans, device_memory, host_memory, ranks_per_node,
                                                                    headroom, on_cpu)}


def _name(p: dict) -> dict:
    return {k: p[k] for k in ("stage", "offload_optimizer", "offload_param", "dtype", "micro_batch", "checkpointing")}


def _smallest_change(plans, device_memory, host_memory, ranks_per_node, headroom, on_cpu) -> str:
    """The most frugal plan (least device memory) and what would make it fit: the figures of its
    breakdown scaled (activations with the micro-batch; sharded model states with the ranks)."""
    key = (lambda p: p["peak"]["total"]) if on_cpu else (lambda p: p["peak_device"])
    p = min(plans, key=key)
    limit = (host_memory / ranks_per_node if on_cpu else device_memory) * (1 - headroom)
    need = key(p)
    act = p["peak"].get("activations", 0)
    over = need - limit
    if p["micro_batch"] > 1 and act > 0:
        mb = p["micro_batch"]
        while mb > 1 and need - act * (1 - mb / p["micro_batch"]) > limit:
            mb //= 2
        if need - act * (1 - mb / p["micro_batch"]) <= limit:
            return (f"nothing fits (best: stage {p['stage']}, offload {p['offload_optimizer']}, short by {_gib(over)}); "
                    f"a micro-batch of {mb} instead of {p['micro_batch']} would fit")
    if not p["checkpointing"] and act > 0.2 * need:
        return (f"nothing fits (best: stage {p['stage']}, offload {p['offload_optimizer']}, short by {_gib(over)}); "
                "turn on activation checkpointing (activations are "
                f"{_gib(act)} of the {_gib(need)} peak) and estimate again")
    states = p["peak"].get("model_states", 0)
    if states > over > 0 and p["stage"] == 3:
        world = p["world"]
        factor = states / max(1.0, states - over)
        return (f"nothing fits (best: stage 3, offload {p['offload_optimizer']}, short by {_gib(over)}); about "
                f"{math.ceil(world * factor)} ranks instead of {world} would fit (model states shrink with the ranks)")
    if p["offload_optimizer"] != "nvme":
        return (f"nothing fits (short by {_gib(over)}); offload the optimizer state to NVMe (stage 3, "
                "offload_optimizer.device 'nvme')")
    return f"nothing fits (best short by {_gib(over)}); add ranks or use a smaller model"
