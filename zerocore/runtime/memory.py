"""Bytes of model state one rank actually holds, counted from the engine's tensors (each
underlying storage once, under the first role that holds it), not from a formula."""
from __future__ import annotations

from . import provided

ROLES = ("params", "frozen", "gathered", "staged", "grads", "master", "exp_avg", "exp_avg_sq", "buckets")
# "frozen": parameters held but not trained (frozen ones: stage 3's owned chunks of them, whole
# ones elsewhere); "gathered": stage 3's full parameter buffers while gathered (zero bytes between
# steps); "staged": the device copy of a host-resident parameter shard while its all-gather runs
HOST_ROLES = ("host_params", "host_frozen", "host_grads", "host_master", "host_exp_avg", "host_exp_avg_sq",
              "host_staging", "host_swap",  # host_swap: NVMe offload's pinned swap buffers (the optimizer state)
              # offload_optimizer.speculative_step's second master, m, v and its own 16-bit output
              "host_spare_master", "host_spare_exp_avg", "host_spare_exp_avg_sq", "host_spare_out")
# Host memory of CPU offload (zerocore.offload). "total" sums the training device's roles,
# "host_total" the host's; on a CPU-only machine both are the same RAM, the split says where
# the engine put each byte.


def held_bytes(engine, storage_key=None) -> dict[str, int]:
    """``engine``: anything with ``groups``, ``shards`` and ``reducer`` as the engine has them (and
    ``frozen_groups``, ``module`` where it has those); ``storage_key``: what identifies a storage
    (its address; the planner's fake tensors have none)."""
    seen: set[int] = set()
    out = dict.fromkeys(ROLES + HOST_ROLES, 0)
    key_of = storage_key or (lambda st: st.data_ptr())

    def count(role, t):
        if t is None:
            return
        st = t.untyped_storage()
        key = key_of(st)
        if st.nbytes() == 0 or key in seen:
            return
        seen.add(key)
        out[role] += st.nbytes()

    for g, shard in zip(engine.groups, engine.shards):
        for role, t in g.tensors().items():
            count(role, t)
        for role, t in shard.tensors().items():
            count(role, t)
    for g in getattr(engine, "frozen_groups", ()):  # stage 3's partitioned frozen parameters
        for role, t in g.tensors().items():
            count(role, t)
    module = getattr(engine, "module", None)
    if module is not None:  # parameters no group holds (frozen ones kept whole): their own tensors
        grouped = {id(p) for g in engine.groups for p in g.params}
        device = engine.groups[0].param_flat.device if engine.groups else None
        for p in module.parameters():
            if id(p) not in grouped:
                count("host_frozen" if device is not None and p.device != device else "frozen", p)
    for b in engine.reducer.bucket_tensors():
        count("buckets", b)
    out["total"] = sum(out[r] for r in ROLES)
    out["host_total"] = sum(out[r] for r in HOST_ROLES)
    return out


def formula_bytes(numel: int, world: int, stage: int, half: bool) -> int:
    """ZeRO's per-rank model-state bytes for ``numel`` trainable parameters (Adam), without buckets:
    16-bit params + fp32 master: 2+2+12 split per stage; fp32: the master is the parameter."""
    p, g, opt = (2, 2, 12) if half else (4, 4, 8)
    if stage == 0:
        return (p + g + opt) * numel
    if stage == 1:
        return (p + g) * numel + opt * numel // world
    if stage == 2:
        return p * numel + (g + opt) * numel // world
    return (p + g + opt) * numel // world


def with_prediction(engine, held: dict, micro_batch=None, seq_len=None, meta_model=None) -> dict:
    """``held`` with the planner's figures beside it (``zerocore/planner/engine_view.py``: the
    planner sits above the runtime, which reaches it through ``provided``)."""
    return provided.call("predict_memory", engine, held, micro_batch, seq_len, meta_model)
