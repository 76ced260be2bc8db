"""``Comm.all_gather`` / ``all_gather_into`` give every rank every chunk, exactly, whichever way
they run: on gloo a large gather runs as one broadcast per rank (faster there, see
benchmarks/all_gather.py), a small one as the backend's all-gather, and the two agree with each
other and with the chunks each rank put in. Odd chunk sizes, bf16 and fp32, sync and async,
several gathers in flight, and a subgroup whose ranks are not the global ones (a broadcast names
its source by global rank)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from dist_helpers import spawn_cases
from zerocore.comm import Comm
from zerocore.comm import collectives

BIG = collectives.BROADCAST_GATHER_MIN_BYTES // 2 + 3  # elements per rank: at 2 bytes and 2+ ranks, over it


class GatherCase:
    def __init__(self, name: str, dtype: torch.dtype, per_rank: int, into: bool, subgroup: bool = False):
        self.name, self.dtype, self.per_rank, self.into, self.subgroup = name, dtype, per_rank, into, subgroup


CASES = [GatherCase(f"{'into' if into else 'flat'}-{str(dt)[6:]}-{n}{'-sub' if sub else ''}", dt, n, into, sub)
         for dt in (torch.bfloat16, torch.float32) for n in (5, BIG) for into in (False, True) for sub in (False, True)]


def chunk_values(rank: int, n: int, salt: int, dtype) -> torch.Tensor:
    """What rank ``rank`` contributes: distinct per rank, element and gather."""
    return (torch.arange(n, dtype=torch.float64) * 0.5 + 1000 * rank + 7 * salt).to(dtype)


def run_gather(case: GatherCase, rank: int, world: int) -> dict:
    group = dist.new_group(list(range(1, world))) if case.subgroup else None  # every rank creates it
    if case.subgroup and rank == 0:
        return {"skipped": True}
    out = {}
    for via in (True, False):
        comm = Comm(group, all_gather_via_broadcast=via)
        calls = {"broadcast": 0}
        real = dist.broadcast

        def counting(*a, **kw):
            calls["broadcast"] += 1
            return real(*a, **kw)

        dist.broadcast = counting
        try:
            n, flats, handles = case.per_rank, [], []
            for salt in range(3):  # three in flight at once, as a refresh of three groups
                flat = torch.full((n * comm.world,), -1.0, dtype=case.dtype)
                mine = chunk_values(comm.rank, n, salt, case.dtype)
                if case.into:
                    handles.append(comm.all_gather_into(flat, mine, async_op=salt != 2))
                else:
                    comm.chunk(flat).copy_(mine)
                    handles.append(comm.all_gather(flat, async_op=salt != 2))
                flats.append(flat)
            for h in handles:
                h.wait()
                h.wait()  # idempotent
        finally:
            dist.broadcast = real
        out[via] = {"flats": flats, "broadcasts": calls["broadcast"], "world": comm.world,
                    "chose_broadcast": comm._broadcasts(flats[0])}
    return out


def test_all_gather_fills_every_chunk_either_way(tmp_path):
    world = 3
    results = spawn_cases(CASES, world, tmp_path, timeout=300, run=run_gather)
    for i, case in enumerate(CASES):
        for rank in range(world):
            r = results[rank][i]
            assert "error" not in r, f"rank {rank}, {case.name}:\n{r['error']}"
            if r.get("skipped"):
                continue
            for via in (True, False):
                got = r[via]
                w = got["world"]
                assert w == (world - 1 if case.subgroup else world)
                for salt, flat in enumerate(got["flats"]):
                    want = torch.cat([chunk_values(q, case.per_rank, salt, case.dtype) for q in range(w)])
                    assert torch.equal(flat, want), f"rank {rank}, {case.name}, via_broadcast={via}, gather {salt}"
                big = case.per_rank * w * case.dtype.itemsize >= collectives.BROADCAST_GATHER_MIN_BYTES
                assert got["chose_broadcast"] == (via and big), (case.name, via)
                # the broadcast path really ran (one per rank per gather), and only where chosen
                assert got["broadcasts"] == (3 * w if via and big else 0), (case.name, via, got["broadcasts"])
