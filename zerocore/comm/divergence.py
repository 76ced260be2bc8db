"""Catching ranks that diverge, before their collectives mismatch.

Under stage 3 every rank must issue the same gathers and reductions in the same order. When one
rank runs a module another skips (mixture-of-experts routing, a generation loop that stops
early on one rank), the collectives pair up wrongly: on gloo, two all-gathers of different
sizes abort the process (SIGABRT) and an all-gather against an all-reduce hangs until the
collective timeout (both measured here); on NCCL both hang. Same-sized units pair silently and
load the wrong weights.

So before each stage-3 collective, every rank all-gathers a three-number header (what it is
about to do, on which unit/group, its collective count) and compares: any difference raises
:class:`DivergenceError` on every rank (they all see the same headers), naming the unit and
what each rank was doing, before the mismatched collective is issued. The header is fixed-size,
so headers always pair with headers. It costs one small synchronous exchange per gather or
reduction: through shared memory where every rank is on one host (``shm_headers.py``, ~8 us; the
stage-3 step of benchmarks/step.py on 2 CPU ranks pays 15 ms of ~780 for all of them, most of it
the ranks meeting), else a gloo all-gather (~0.4 ms here; 82 ms of that step);
``zero_optimization.stage3_check_divergence: false`` turns it off.

A rank that stops issuing collectives altogether cannot be compared; the header wait has a
deadline (``stage3_divergence_timeout``) after which this rank raises, naming what it waited for.
The headers travel on a gloo group of their own (the same ranks, created once per timeout and
reused), whose collectives time out inside gloo: a header that never pairs fails there and
leaves nothing pending on the training group. Waiting on the header in the training group
itself with a deadline left it pending after the error; the next collective there (the other
rank's barrier, ``destroy_process_group``) then hung for good (measured: both ranks stuck).
The headers are CPU tensors, so this also works when the training group is NCCL.
"""
from __future__ import annotations

import datetime
import enum
import weakref
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..debug.host_waits import mark_host
from . import lifetime
from .collectives import Comm
from .shm_headers import HeaderTimeout, PeerExited, ShmHeaders

def _header_comm(comm: Comm, timeout_s: float) -> Comm | None:
    """A Comm over a gloo group of ``comm``'s ranks whose collectives time out after ``timeout_s``;
    None where one cannot be made (the headers then use ``comm`` with a deadline on the wait)."""
    try:
        ranks = tuple(dist.get_process_group_ranks(comm.group)) if comm.group is not None else None
        group = lifetime.new_side_group(("headers", ranks, float(timeout_s)),
                                        list(ranks) if ranks is not None else None,
                                        timeout=datetime.timedelta(seconds=timeout_s),
                                        use_local_synchronization=ranks is not None)
        return Comm(group)
    except (RuntimeError, ValueError, AttributeError):
        return None


class DivergenceError(RuntimeError):
    """Ranks issued different collectives (or one stopped issuing them)."""


class Op(enum.IntEnum):
    """What a rank is about to do; compared across ranks together with the unit/group index."""

    GATHER = 1  # all-gather a unit's parameters
    REDUCE = 2  # reduce a group's gradients
    STEP = 3  # the optimizer step's norm / overflow check
    CONTEXT = 4  # zerocore.gathered() / full_state_dict(): a gather outside the training loop
    ORDER = 5  # the end of a forward/backward pass: the units it ran, compared as a checksum


HEADER = 5  # op, unit/group index (or order checksum), phase, collective count, order length

_ADVICE = ("Every rank must run the same modules in the same order (one rank ran a module the others "
           "skipped, as in mixture-of-experts routing or an early-stopping generation loop). Make every rank "
           "run each module (e.g. with an empty batch), or keep the modules that differ out of stage 3 "
           "partitioning (zero_optimization.stage3_param_persistence_threshold).")


class Phase(enum.IntEnum):
    """The one phase vocabulary of the engine: which pass a collective belongs to, carried in the
    headers for the message only (prefetch vs on-demand is decided identically on every rank
    from the same recorded order, but an error message should say which it was)."""

    NONE = 0
    FORWARD = 1
    BACKWARD = 2
    PREFETCH_FORWARD = 3
    PREFETCH_BACKWARD = 4
    ON_DEMAND = 5

    @property
    def text(self) -> str:
        return _PHASE_TEXT[self]


_PHASE_TEXT = {Phase.NONE: "", Phase.FORWARD: "forward", Phase.BACKWARD: "backward",
               Phase.PREFETCH_FORWARD: "prefetch (forward)", Phase.PREFETCH_BACKWARD: "prefetch (backward)",
               Phase.ON_DEMAND: "on demand"}


def _phase_text(phase: int) -> str:
    try:
        return Phase(phase).text
    except ValueError:
        return ""


class DivergenceGuard:
    def __init__(self, comm: Comm, describe: Callable[[Op, int], str], *, enabled: bool = True,
                 timeout_s: float = 30.0):
        """``describe(op, index)``: the name of the unit/group, e.g. "unit 'blocks.3'"."""
        self.comm = comm
        self.describe = describe
        self.enabled = enabled and comm.world > 1
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.count = 0  # collectives checked so far on this rank
        # host memory exchanged over gloo (named so to zerocore.debug.host_waits: reading it waits for no device)
        self._out = mark_host(torch.empty(comm.world * HEADER, dtype=torch.int64))
        self._mine = mark_host(torch.empty(HEADER, dtype=torch.int64))
        self._mine_np = None  # its numpy view, written in place at each exchange: no tensor made per collective
        # every rank builds its guard at the same point (engine construction): a collective
        self._headers = _header_comm(comm, timeout_s) if self.enabled else None
        # ranks on one host exchange the headers through shared memory (shm_headers.py; ~100x faster than gloo)
        self._shm = None
        if self._headers is not None:
            self._shm = ShmHeaders.create(self._headers.group, self._headers.rank, self._headers.world, HEADER)
            if self._shm is not None:
                weakref.finalize(self, self._shm.close)

    def check(self, op: Op, index: int, phase: int = Phase.NONE) -> None:
        """Raises DivergenceError on every rank unless all ranks are about to do the same thing."""
        if not self.enabled:
            return
        rows = self._exchange(int(op), index, int(phase))
        if all(r[0] == rows[0][0] and r[1] == rows[0][1] and r[3] == rows[0][3] for r in rows):
            return
        self._raise_mismatch(rows)

    def check_order(self, phase: int, order: list[int], name: Callable[[int], str]) -> None:
        """At the end of a pass: did every rank run the same units in the same order? A skipped
        module is not always visible in the collectives (a prefetch from the recorded order may
        already have gathered it on every rank), so the orders themselves are compared, as a
        checksum; on a mismatch the orders are exchanged to name the first unit that differs."""
        if not self.enabled:
            return
        mine = torch.tensor(order, dtype=torch.int64)
        checksum = zlib.crc32(mine.numpy().tobytes()) if order else 0
        rows = self._exchange(int(Op.ORDER), checksum, int(phase), extra=len(order))
        if all(r[0] == rows[0][0] and r[1] == rows[0][1] and r[3] == rows[0][3] and r[4] == rows[0][4]
               for r in rows):
            return
        if any(r[0] != Op.ORDER for r in rows):
            self._raise_mismatch(rows)
        longest = max(r[4] for r in rows)
        padded = torch.full((longest,), -1, dtype=torch.int64)
        padded[:len(order)] = mine
        everyone = torch.empty(longest * self.comm.world, dtype=torch.int64)
        (self._headers or self.comm).all_gather_into(everyone, padded)
        seqs = everyone.view(self.comm.world, longest).tolist()
        first = next(i for i in range(longest) if len({s[i] for s in seqs}) > 1)
        lines = [f"  rank {r}: {'ran ' + name(s[first]) if s[first] >= 0 else 'had finished'} "
                 f"({rows[r][4]} units in the pass)" for r, s in enumerate(seqs)]
        where = _phase_text(phase)
        raise DivergenceError(
            f"zerocore: ranks diverged under ZeRO stage 3: in this {where} pass, at unit #{first + 1}:\n"
            + "\n".join(lines) + "\n" + _ADVICE)

    def _exchange(self, op: int, index: int, phase: int, extra: int = 0) -> list[list[int]]:
        self.count += 1
        if self._mine_np is None:  # made on first use: a dry engine's guard (fake tensors) never exchanges
            self._mine_np = self._mine.numpy()
        self._mine_np[:] = (op, index, phase, self.count, extra)
        try:
            if self._shm is not None:
                return self._shm.exchange(self._mine_np, self.timeout_s)
            if self._headers is not None:  # gloo itself gives up after the timeout
                self._headers.all_gather_into(self._out, self._mine)
            else:
                handle = self.comm.all_gather_into(self._out, self._mine, async_op=True)
                handle.wait(timeout=self.timeout)
        except PeerExited as e:
            raise DivergenceError(f"zerocore: at collective #{self.count} ({self._what(op, index, phase)}): {e}") \
                from None
        except RuntimeError as e:
            if not isinstance(e, HeaderTimeout) and "timed out" not in str(e).lower():
                raise
            raise DivergenceError(
                f"zerocore: rank {self.comm.rank} waited {self.timeout_s:g} s for the other ranks to reach "
                f"collective #{self.count} ({self._what(op, index, phase)}); a rank stopped issuing "
                "zerocore collectives (it skipped a module, ended its loop early, or is blocked elsewhere). "
                "Raise zero_optimization.stage3_divergence_timeout if a rank is legitimately this slow.") from None
        return self._out.view(self.comm.world, HEADER).tolist()

    def _raise_mismatch(self, rows: list[list[int]]) -> None:
        lines = [f"  rank {r}: collective #{row[3]}, {self._what(row[0], row[1], row[2])}" for r, row in enumerate(rows)]
        raise DivergenceError(
            "zerocore: ranks diverged under ZeRO stage 3: they are about to issue different collectives.\n"
            + "\n".join(lines) + "\n" + _ADVICE)

    def _what(self, op: int, index: int, phase: int) -> str:
        try:
            o = Op(op)
        except ValueError:
            return f"unknown operation {op}"
        verb = {Op.GATHER: "gathering", Op.REDUCE: "reducing gradients of", Op.STEP: "optimizer step",
                Op.CONTEXT: "gathering (outside training) ", Op.ORDER: "end of pass"}[o]
        where = _phase_text(phase)
        text = verb if o in (Op.STEP, Op.ORDER) else f"{verb} {self.describe(o, index)}"
        return f"{text} ({where})" if where else text
