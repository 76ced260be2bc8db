"""Records the NVMe transfers of a SwapStore or a ParamSwap by wrapping their methods on the
instance (the objects' own calls go through the wrappers too); pytest's monkeypatch puts the
methods back at the end of the test."""
from __future__ import annotations


def trace_store(monkeypatch, store, trace: list | None = None) -> list:
    """(op, lane or None, offset) of every transfer ("read", "write": once issued) and wait
    ("wait_read", "wait_write": before it waits) of ``store``, appended to ``trace``."""
    trace = [] if trace is None else trace
    write, read, wait_writes, wait_reads = store.write, store.read, store.wait_writes, store.wait_reads

    def traced_write(rec, path, offset, step, lane=0):
        write(rec, path, offset, step, lane=lane)
        trace.append(("write", lane, offset))

    def traced_read(rec, path, offset, step):
        read(rec, path, offset, step)
        trace.append(("read", None, offset))

    def traced_wait_writes(step, lane=None):
        trace.append(("wait_write", lane, None))
        wait_writes(step, lane)

    def traced_wait_reads(step):
        trace.append(("wait_read", None, None))
        wait_reads(step)

    monkeypatch.setattr(store, "write", traced_write)
    monkeypatch.setattr(store, "read", traced_read)
    monkeypatch.setattr(store, "wait_writes", traced_wait_writes)
    monkeypatch.setattr(store, "wait_reads", traced_wait_reads)
    return trace


def trace_param_swap(monkeypatch, swap, trace: list | None = None) -> list:
    """("read" | "write", group) of every shard transfer ``swap`` issues, appended to ``trace``."""
    trace = [] if trace is None else trace
    read, write = swap._read, swap._write

    def traced_read(sw, b):
        read(sw, b)
        trace.append(("read", sw.group.index))

    def traced_write(sw, b):
        write(sw, b)
        trace.append(("write", sw.group.index))

    monkeypatch.setattr(swap, "_read", traced_read)
    monkeypatch.setattr(swap, "_write", traced_write)
    return trace


def trace_gathers(monkeypatch, swap, trace: list) -> None:
    """("gather", group) appended to ``trace`` at every gather ``swap`` is told of."""
    on_gather = swap.on_gather

    def traced(gi):
        trace.append(("gather", gi))
        on_gather(gi)

    monkeypatch.setattr(swap, "on_gather", traced)
