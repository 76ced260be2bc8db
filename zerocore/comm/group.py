"""Which ranks take part: the default torch.distributed process group, one that torchrun's
environment describes, or a world of one (no process group at all); and the one exchange that
goes through the group's store instead of a collective (agreement at start)."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from . import lifetime
from .collectives import Comm


def default_comm(device: torch.device | None = None, timeout_s: float | None = None) -> Comm:
    """A :class:`Comm` over the default process group.

    If none is initialized but the environment names a rank (``torchrun`` sets RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the default group is initialized from it: NCCL for
    CUDA models, gloo otherwise, with collectives timing out after ``timeout_s`` (torch's
    default, 10-30 minutes, leaves a user watching a rank that stopped for that long); zerocore
    then owns it and destroys it at ``engine.destroy()`` (the last engine's) and at interpreter
    exit (``zerocore.comm.lifetime``). With neither, training runs as a world of one.
    """
    if dist.is_available() and dist.is_initialized():
        comm = Comm()
    elif dist.is_available() and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # zerocore owns this group: it is torn down at engine.destroy() and at interpreter exit
        lifetime.init_default("nccl" if device is not None and device.type == "cuda" else "gloo", timeout_s)
        comm = Comm()
    else:
        comm = Comm.single()
    error = contradicting_single_rank_error(comm.world, None, os.environ)
    if error is not None:
        raise RuntimeError(error)
    return comm


def contradicting_single_rank_error(world: int, explicit_group, env) -> str | None:
    """Why a group of one rank contradicts the launcher (``WORLD_SIZE`` in ``env`` says more processes run), or
    None: each process would train a model of its own, nothing sharded or averaged, and nothing would say so. A
    group the caller chose explicitly is taken as meant; a ``WORLD_SIZE`` that is no integer says nothing."""
    if world != 1 or explicit_group is not None:
        return None
    try:
        launched = int(env.get("WORLD_SIZE"))
    except (TypeError, ValueError):
        return None
    if launched <= 1:
        return None
    return (f"zerocore: the launcher started this process as one of WORLD_SIZE={launched}, but its process group "
            "has 1 rank, so every process would train a model of its own (nothing sharded, no gradient averaged). "
            "Initialize the group over all the processes before building the engine "
            "(torch.distributed.init_process_group(), or deepspeed.init_distributed() through zerocore.deepspeed; "
            "with RANK and WORLD_SIZE set and no group, zerocore initializes it), or unset WORLD_SIZE for a "
            "one-process run.")


class RanksMissing(RuntimeError):
    """Some ranks did not reach an exchange before its deadline."""

    def __init__(self, missing: list[int], waited_s: float):
        self.missing = missing
        super().__init__(f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not arrive "
                         f"within {waited_s:g} s")


_EXCHANGES: dict[tuple, int] = {}  # (tag, ranks) -> exchanges so far in this process


def exchange_via_store(comm: Comm, tag: str, payload: bytes, timeout_s: float) -> list[bytes]:
    """Every rank's ``payload``, in rank order, through the process group's key-value store
    instead of a collective: a rank that never arrives cannot leave a collective pending, and
    the ranks that did arrive learn which ones are missing (:class:`RanksMissing`) after
    ``timeout_s``. Works the same under gloo and NCCL (the store is TCP or a file). Every rank
    of ``comm`` must call it the same number of times with the same ``tag``."""
    if comm.world == 1:
        return [payload]
    store = dist.distributed_c10d._get_default_store()
    ranks = tuple(dist.get_process_group_ranks(comm.group or dist.group.WORLD))
    seq = _EXCHANGES.get((tag, ranks), 0)
    _EXCHANGES[(tag, ranks)] = seq + 1
    prefix = f"zerocore/{tag}/{'-'.join(map(str, ranks))}/{seq}/"
    keys = [prefix + str(r) for r in range(comm.world)]
    store.set(keys[comm.rank], payload)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
            raise
        raise RanksMissing([r for r, k in enumerate(keys) if not store.check([k])], timeout_s) from None
    return [store.get(k) for k in keys]


def _store():
    return dist.distributed_c10d._get_default_store()


def record_failure(comm: Comm, tag: str, micro_step: int, text: str) -> None:
    """Leaves word in the store that this rank's engine raised at ``micro_step`` (so a rank
    that then waits in a collective for it can say why). Best effort: never raises."""
    if comm.world == 1:
        return
    try:
        _store().set(f"zerocore/failed/{tag}/{comm.rank}", f"{micro_step}\n{text}".encode())
    except Exception:  # noqa: BLE001 - the error being raised matters more than this note
        pass


def recorded_failures(comm: Comm, tag: str, micro_step: int) -> dict[int, str]:
    """The other ranks' failures recorded at ``micro_step`` (without waiting)."""
    out = {}
    try:
        store = _store()
        for r in range(comm.world):
            key = f"zerocore/failed/{tag}/{r}"
            if r != comm.rank and store.check([key]):
                step, text = store.get(key).decode().split("\n", 1)
                if int(step) == micro_step:
                    out[r] = text
    except Exception:  # noqa: BLE001 - a store that cannot be read leaves the plain timeout error
        pass
    return out


def side_comm(comm: Comm) -> Comm:
    """A Comm over a new gloo group of ``comm``'s ranks, for collectives issued from another
    thread (an asynchronous checkpoint's barriers): on a group of their own they never interleave
    with training's collectives on ``comm``. Creating it is a collective: call it on every rank,
    from the main thread."""
    if comm.world == 1:
        return Comm.single()
    ranks = dist.get_process_group_ranks(comm.group) if comm.group is not None else None
    return Comm(lifetime.new_side_group(None, ranks))
