"""The divergence guard's header exchange through shared memory, for ranks on one host.

The guard (``divergence.py``) exchanges a few integers between every rank before each stage-3 collective. Over
gloo that costs one TCP round trip through gloo's worker threads: 390 us on a 2-core machine with the ranks idle
(two ranks, 2,000 exchanges back to back), 80 ms of a ~840 ms stage-3 step of benchmarks/step.py. Ranks on one
host (every rank of a one-node job) can meet in a shared page instead: each writes its record, then reads the
others' until they carry the same exchange number.

Layout: a file in /dev/shm, mapped by every rank and unlinked once all have mapped it; per rank two records (the
parity of the exchange number), each ``[number, fields..., check]`` in int64. Two records per rank because a rank
can publish exchange n+1 only after reading everyone's n, so nobody overwrites a record another still has to read.
The check (a mix of the number and the fields) makes a record read while being written fail validation and be
read again, whatever order a weakly ordered CPU makes the writes visible in.

Waiting: the first 2 ms reading in a loop that yields the core between reads (a peer sharing the core runs; on a
core of its own the waiting rank sees the peer's record within microseconds), then sleeping (50 us doubling to
0.5 ms) so a long wait does not hold a core. Most waits in a step are short: the ranks meet at each stage-3
collective, and what one waits is the other's lag in the compute between two of them. A peer that exited (its
/proc entry gone, or a zombie) is named within half a second (gloo notices a closed connection at once; shared
memory would otherwise wait out the whole timeout); the deadline is the guard's ``stage3_divergence_timeout``.

Used only where it can be checked to work: Linux (/dev/shm, /proc), every rank on the same host name, every rank
able to map the file and to see every other rank's process (same PID namespace, by pid and start time). Decided
collectively at construction over the guard's gloo group; anywhere else the guard keeps exchanging over gloo.
"""
from __future__ import annotations

import mmap
import os
import socket
import tempfile
import time

import numpy as np
import torch.distributed as dist

_MASK = (1 << 62) - 1
_YIELD_S = 2e-3  # waits this short yield the core between reads (to a peer on the same core, if any)
_NAP_MIN_S, _NAP_MAX_S = 50e-6, 500e-6  # longer ones sleep, doubling up to this (what a late wake-up costs)
_LIVENESS_S = 0.5


class PeerExited(RuntimeError):
    """A rank this one waited for has exited."""


class HeaderTimeout(RuntimeError):
    """The other ranks did not publish within the deadline."""


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat) and None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state is fields[0]
    if not fields or fields[0] in ("Z", "X", "x"):
        return None
    return fields[19] if len(fields) > 19 else None


def _check(number: int, fields) -> int:
    c = (number * 0x9E3779B97F4A7C15) & _MASK
    for v in fields:
        c = ((c ^ (int(v) & _MASK)) * 0x100000001B3 + 0x632BE59BD9B4E019) & _MASK
    return c


class ShmHeaders:
    """Every rank's ``width`` integers, exchanged through a page every rank of a one-host group maps."""

    def __init__(self, mapped: mmap.mmap, rank: int, world: int, width: int, pids: list[int], starts: list[str]):
        self.rank, self.world, self.width = rank, world, width
        self.rec = width + 2  # number, fields, check
        self._mm = mapped
        self._buf = np.frombuffer(mapped, dtype=np.int64, count=world * 2 * self.rec).reshape(world, 2, self.rec)
        self._pids, self._starts = pids, starts
        self.number = 0  # exchanges done

    # -- setup (a collective over ``group``, a gloo group of the ranks) ------------------------------------------
    @classmethod
    def create(cls, group, rank: int, world: int, width: int) -> "ShmHeaders | None":
        """The shared page when every rank can use it, else None on every rank (the decision is collective)."""
        nbytes = world * 2 * (width + 2) * 8
        path, fd = None, -1
        if rank == 0 and os.path.isdir("/dev/shm") and os.path.isdir("/proc/self"):
            try:
                fd, path = tempfile.mkstemp(prefix="zerocore-headers-", dir="/dev/shm")
                os.ftruncate(fd, nbytes)
            except OSError:
                if fd >= 0:
                    os.close(fd)
                    os.unlink(path)
                path, fd = None, -1
        try:
            return cls._agree(group, rank, world, width, path, fd, nbytes)
        finally:
            if path is not None:  # rank 0's file: the mappings stay, nothing is left in /dev/shm whatever happened
                try:
                    os.unlink(path)
                except OSError:
                    pass

    @classmethod
    def _agree(cls, group, rank: int, world: int, width: int, path, fd: int, nbytes: int) -> "ShmHeaders | None":
        me = (socket.gethostname(), os.getpid(), _start_time(os.getpid()), path)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, me, group=group)
        path = everyone[0][3]
        mapped, ok = None, False
        if path is not None and len({e[0] for e in everyone}) == 1 and all(e[2] is not None for e in everyone):
            ok = all(_start_time(e[1]) == e[2] for e in everyone)  # every rank's process visible from here
            if ok:
                try:
                    if fd < 0:
                        fd = os.open(path, os.O_RDWR)
                    mapped = mmap.mmap(fd, nbytes)
                except OSError:
                    ok = False
        if fd >= 0:
            os.close(fd)
        oks: list = [None] * world
        dist.all_gather_object(oks, ok, group=group)  # every rank mapped it (or none uses it)
        if not all(oks):
            if mapped is not None:
                mapped.close()
            return None
        return cls(mapped, rank, world, width, [e[1] for e in everyone], [e[2] for e in everyone])

    # -- the exchange ------------------------------------------------------------------------------------------------
    def exchange(self, fields, deadline_s: float) -> list[list[int]]:
        """Publishes this rank's ``fields`` and returns every rank's, in rank order. Raises HeaderTimeout when
        the others have not published theirs within ``deadline_s`` seconds, PeerExited when one exited."""
        n = self.number + 1
        p = n & 1
        mine = [int(v) for v in fields]
        rec = self._buf[self.rank, p]
        rec[1:1 + self.width] = mine
        rec[self.rec - 1] = _check(n, mine)
        rec[0] = n  # published
        rows: list = [None] * self.world
        rows[self.rank] = mine
        self._wait(n, p, rows, [q for q in range(self.world) if q != self.rank], deadline_s)
        self.number = n
        return rows

    def _collect(self, n: int, p: int, rows: list, ranks: list[int]) -> list[int]:
        """Reads exchange ``n``'s records of ``ranks`` into ``rows``; returns the ranks not published yet."""
        still = []
        for q in ranks:
            got = self._buf[q, p].tolist()
            if got[0] == n and got[-1] == _check(n, got[1:-1]):
                rows[q] = got[1:-1]
            else:
                still.append(q)
        return still

    def _wait(self, n: int, p: int, rows: list, waiting: list[int], deadline_s: float) -> None:
        """Reads the records of ``waiting`` until every one is published (how often depends on when the others
        arrive: time waited, not work, which tests/count_helpers.py leaves out of the host-work counts)."""
        waiting = self._collect(n, p, rows, waiting)
        if not waiting:
            return
        start = time.monotonic()
        nap, next_liveness = 0.0, start + _LIVENESS_S
        while waiting:
            now = time.monotonic()
            if now - start <= _YIELD_S:
                os.sched_yield()
            else:
                if now - start > deadline_s:
                    raise HeaderTimeout(f"ranks {waiting} did not publish exchange #{n} within {deadline_s:g} s")
                if now >= next_liveness:
                    next_liveness = now + _LIVENESS_S
                    for q in waiting:
                        if _start_time(self._pids[q]) != self._starts[q]:
                            raise PeerExited(f"rank {q} (pid {self._pids[q]}) exited while this rank waited for it")
                nap = min(max(nap * 2, _NAP_MIN_S), _NAP_MAX_S)
                time.sleep(nap)
            waiting = self._collect(n, p, rows, waiting)

    def close(self) -> None:
        buf, self._buf = self._buf, None
        del buf
        try:
            self._mm.close()
        except BufferError:  # a view of it still alive somewhere: the mapping goes with the last one
            pass
