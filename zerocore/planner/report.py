"""The terminal table of ``zerocore estimate``: one row per configuration, per rank."""
from __future__ import annotations


def _g(n) -> str:
    return "-" if n is None else f"{n / 2**30:8.2f}"


def _offload(p: dict) -> str:
    o = p["offload_optimizer"]
    if p["offload_param"] != "none":
        o += f"+p:{p['offload_param']}"
    return o


def render(plans: list[dict], advice: dict | None = None) -> str:
    cols = ("stage", "offload", "states dev", "states host", "nvme", "gathered", "buckets", "grads", "activ.",
            "rounding", "PEAK", "between", "fits")
    lines = ["per rank, GiB (peak = states + gathered units/prefetch + reduce buckets + gradients not yet bucketed "
             "+ activations at the step's peak)",
             f"{cols[0]:>5} {cols[1]:>11} " + " ".join(f"{c:>8}" for c in cols[2:])]
    for p in plans:
        b, pk = p["between_steps"], p["peak"]
        dev_states = sum(v for k, v in b["device"].items() if k not in ("gathered", "staged", "buckets"))
        host_states = sum(b["host"].values())
        fit = p.get("fit", {}).get("fits")
        lines.append(f"{p['stage']:>5} {_offload(p):>11} {_g(dev_states)} {_g(host_states)} {_g(b['nvme'])} "
                     f"{_g(pk.get('gathered', 0))} {_g(pk.get('buckets', 0))} {_g(pk.get('grads_in_flight', 0))} "
                     f"{_g(pk.get('activations', 0))} {_g(pk.get('allocator_rounding', 0))} {_g(pk['total'])} "
                     f"{_g(b['total'])} {'yes' if fit else ('no' if fit is not None else '-'):>8}")
    p0 = plans[0]
    scaled = f"; traced {p0['traced_layers']} blocks, scaled to the full depth" if p0.get("traced_layers") else ""
    lines.append(f"{p0['world']} ranks, micro-batch {p0['micro_batch']} x {p0['seq_len']} tokens, {p0['dtype']}, "
                 f"activation checkpointing {'on' if p0['checkpointing'] else 'off'}, device {p0['device']}{scaled}")
    if advice is not None:
        lines.append(("recommended: " if advice["fits"] else "") + advice["line"])
    return "\n".join(lines)
