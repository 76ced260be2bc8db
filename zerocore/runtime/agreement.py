"""Ranks that disagree are refused at start.

Every rank must build the same model (parameter names, shapes, dtypes, requires_grad, in order;
buffers too) with the same config: otherwise rank 0's initial-value broadcast lands at shifted
offsets, collectives of different sizes pair up (gloo aborts or hangs) or ranks silently train
different things (another lr, another clipping). So ``zerocore.initialize`` first exchanges a
digest of both through the process group's store (``comm.group.exchange_via_store``: not a
collective, so a rank that never arrives is named after ``zero_optimization.agreement_timeout``
instead of leaving a collective pending). On a mismatch a second exchange carries the full
descriptions, and every rank raises the same :class:`AgreementError` naming the first differing
parameter or config key and each rank's value.

A rank whose own checks fail (bad config, meta parameters...) still takes part: it raises its
own error and the others raise an AgreementError quoting it, so no rank is left waiting.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

import torch

from ..comm import Comm
from ..comm.group import RanksMissing, exchange_via_store
from ..config import ZeroConfig
from ..config.options import walk
from ..sharding.records import full_shape

# Keys that may differ between ranks: where each node keeps its swap files.
_PER_RANK_KEYS = ("zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.nvme_path",
                  "zero_optimization.agreement_timeout", "zero_optimization.comm_timeout")


_AGREED = [0]  # agreements reached in this process (the same count on every rank of a run)


class AgreementError(RuntimeError):
    """The ranks' models or configs differ, or a rank failed or never arrived at initialize."""


def model_facts(module: torch.nn.Module) -> list[list]:
    """[kind, name, shape, dtype, requires_grad] of every parameter then every buffer, in order."""
    facts = [["parameter", n, list(full_shape(p)), str(p.dtype).replace("torch.", ""), bool(p.requires_grad)]
             for n, p in module.named_parameters(remove_duplicate=False)]
    facts += [["buffer", n, list(b.shape), str(b.dtype).replace("torch.", ""), False]
              for n, b in module.named_buffers(remove_duplicate=False)]
    return facts


def config_facts(cfg: ZeroConfig) -> list[list]:
    return [[key, value] for key, _, _, value in walk(cfg) if key not in _PER_RANK_KEYS]


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, default=str).encode()).hexdigest()[:16]


def agree(comm: Comm, module: torch.nn.Module, cfg: ZeroConfig, local_checks: Callable[[], None]) -> str:
    """Runs ``local_checks`` then compares model and config with every other rank; raises the
    same error on every rank when anything differs. Returns a name for the engine being built,
    the same on every rank (for keys it leaves in the store)."""
    error: BaseException | None = None
    model = conf = None
    try:
        local_checks()
        model, conf = model_facts(module), config_facts(cfg)
    except Exception as e:  # noqa: BLE001 - re-raised below, after the others have been told
        error = e
    if comm.world == 1:
        if error is not None:
            raise error
        return "single"
    timeout = cfg.zero_optimization.agreement_timeout if isinstance(cfg, ZeroConfig) else 120.0
    mine = {"error": f"{type(error).__name__}: {error}" if error else None,
            "model": _digest(model), "config": _digest(conf)}
    rows = _exchange(comm, "agree", mine, timeout)
    if error is not None:
        raise error
    failed = [(r, row["error"]) for r, row in enumerate(rows) if row["error"]]
    if failed:
        r, msg = failed[0]
        raise AgreementError(f"zerocore.initialize: rank {r} failed its own checks, so every rank stops here: {msg}")
    if all(row["model"] == rows[0]["model"] and row["config"] == rows[0]["config"] for row in rows):
        _AGREED[0] += 1
        return f"engine{_AGREED[0]}"
    full = _exchange(comm, "agree-full", {"model": model, "config": conf}, timeout)
    problems = []
    if any(row["model"] != rows[0]["model"] for row in rows):
        problems.append(_first_model_difference([f["model"] for f in full]))
    if any(row["config"] != rows[0]["config"] for row in rows):
        problems.append(_first_config_difference([f["config"] for f in full]))
    raise AgreementError("zerocore.initialize: the ranks disagree, so none of them starts (every rank must build "
                         "the same model with the same config):\n" + "\n".join(problems))


def _exchange(comm: Comm, tag: str, obj: dict, timeout: float) -> list[dict]:
    try:
        raw = exchange_via_store(comm, tag, json.dumps(obj, default=str).encode(), timeout)
    except RanksMissing as e:
        raise AgreementError(f"zerocore.initialize: rank {comm.rank} waited {timeout:g} s for every rank to "
                             f"reach zerocore.initialize; {e} (it failed before it, is still building its "
                             "model, or runs other code). Raise zero_optimization.agreement_timeout if a rank "
                             "is legitimately this slow.") from None
    return [json.loads(b) for b in raw]


def _describe(fact) -> str:
    if fact is None:
        return "nothing (fewer entries)"
    kind, name, shape, dtype, grad = fact
    return f"{kind} '{name}' shape {tuple(shape)} {dtype}" + (f" requires_grad={grad}" if kind == "parameter" else "")


def _first_model_difference(per_rank: list[list]) -> str:
    longest = max(len(m) for m in per_rank)
    for i in range(longest):
        entries = [m[i] if i < len(m) else None for m in per_rank]
        if any(e != entries[0] for e in entries):
            lines = [f"    rank {r}: {_describe(e)}" for r, e in enumerate(entries)]
            counts = ", ".join(f"rank {r}: {len(m)}" for r, m in enumerate(per_rank))
            return (f"  model: entry #{i + 1} (parameters, then buffers) differs ({counts} entries):\n"
                    + "\n".join(lines))
    return "  model: the descriptions differ"


def _first_config_difference(per_rank: list[list]) -> str:
    for i in range(len(per_rank[0])):
        values = [c[i][1] for c in per_rank]
        if any(v != values[0] for v in values):
            key = per_rank[0][i][0]
            lines = [f"    rank {r}: {json.dumps(v, default=str)}" for r, v in enumerate(values)]
            return f"  config: {key} differs:\n" + "\n".join(lines)
    return "  config: the resolved settings differ"
