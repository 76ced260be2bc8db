"""Where a load's state comes from, and the walk both ways of writing it share: the staged load
copies each span into the engine's tiles (``load.py``), the in-place load reads each span
straight into them (``load_in_place.py``); both zero what no span covers."""
from __future__ import annotations

import bisect

_FP32 = 4


def plan_state(engine, reader, saved_name: dict[str, str], kinds) -> list[list[tuple]]:
    """Per shard, where each piece of its owned state comes from: (kind, owned-range element
    offset, parameter element, elements, file, byte offset). Kinds not loaded are absent."""
    plan = []
    for shard in engine.shards:
        g, pieces = shard.group, []
        for slot, a, b in g.layout.pieces(g.lo, g.hi):
            o = slot.offset + a - g.lo
            for k in kinds:
                for start, n, file, off in reader.ranges(saved_name[slot.name], a, b, k):
                    pieces.append((k, o + start - a, start, n, file, off))
        plan.append(pieces)
    return plan


class ShardPieces:
    """One shard's planned pieces, per kind, sorted by where they go: what lands in any tile."""

    def __init__(self, pieces: list[tuple]):
        self.kinds = sorted({p[0] for p in pieces})
        self.by_kind = {k: sorted((p for p in pieces if p[0] == k), key=lambda p: p[1]) for k in self.kinds}
        self._starts = {k: [p[1] for p in ps] for k, ps in self.by_kind.items()}

    def in_tile(self, lo: int, hi: int) -> list[tuple]:
        """The pieces' parts inside owned elements [lo, hi): (kind, tile element, elements, file,
        byte offset), per kind in order."""
        copies = []
        for k in self.kinds:
            ps, i = self.by_kind[k], max(0, bisect.bisect_right(self._starts[k], lo) - 1)
            while i < len(ps) and ps[i][1] < hi:
                _, o, _, n, file, off = ps[i]
                x, y = max(o, lo), min(o + n, hi)
                if x < y:
                    copies.append((k, x - lo, y - x, file, off + (x - o) * _FP32))
                i += 1
        return copies


def spans(copies: list[tuple], kind: str, n: int):
    """A tile of ``n`` elements of ``kind`` front to back: (tile element, elements, file, byte
    offset) for each part of ``copies`` (from :meth:`ShardPieces.in_tile`), and (element,
    elements, None, None) for what none covers (padding, and the moments when only weights load)."""
    filled = 0
    for k, x, m, file, off in copies:
        if k != kind:
            continue
        if x > filled:
            yield filled, x - filled, None, None
        yield x, m, file, off
        filled = x + m
    if filled < n:
        yield filled, n - filled, None, None
