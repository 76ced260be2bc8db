"""``engine.load_checkpoint``: each rank reads the byte ranges of the saved chunks that overlap
what it owns now (any world size, stage, bucket size or unit plan) and verifies every block of
them; only when every rank has all of its bytes verified (a failure anywhere: a corrupt block, a
truncated or missing file, an unreadable client state, another model) does any rank write them
into its optimizer state through ``OptimizerShard.state_tiles(write=True)``; then it re-derives
its 16-bit parameters from the master and (stages 0-2) re-gathers full parameters. A load that
fails leaves every engine exactly as it was, except a load that read in place
(``load_in_place.py``: by default only into an engine that has not trained, a job resuming).

Each block is read once: into one staging region (``staging.py``; the buffers the engine keeps
for asynchronous saves where it has them), verified there while the next reads proceed, and after
the agreement copied from there into the engine. A rank whose state is
larger than the staging budget reads twice instead: once to verify it all, then (after the
agreement) tile by tile through a few pooled I/O buffers, verified again, into the engine.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

from ..runtime.checkpoint_marks import mark_written
from ..sharding import OptimizerShard, ParamState
from . import engine_state, load_in_place, staging
from .agreement import agree
from .blockio import ChecksumError
from .layout import CheckpointError, read_manifest, resolve
from .load_plan import ShardPieces, plan_state, spans
from .manifest import extra_tensors, model_differences, set_rng_state
from .reader import CheckpointReader

_FP32 = 4
LOAD_TILE_ELEMS = 1 << 20  # per kind and tile: 12 MiB of fp32 state read (and copied) at a time

MAX_LISTED = 10


def load_checkpoint(engine, load_dir: str, tag=None, load_optimizer_states: bool = True,
                    load_module_only: bool = False, load_lr_scheduler_states: bool = True, in_place=None):
    """``in_place``: read straight into the optimizer state (``load_in_place.py``): None where
    the engine has nothing to lose, True always, False never (a failed load then changes nothing)."""
    # a deferred Inf/NaN decision (runtime/deferred_skip.py) settled first: taking a skipped step back
    # restores the schedule's earlier state, which must not land over the loaded one
    engine._settle_skip()
    path = resolve(load_dir, tag)
    if path is None:
        return None, None
    manifest = read_manifest(path)
    diffs, saved_name, trained = model_differences(manifest, engine)
    if diffs:
        more = f"\n  ... and {len(diffs) - MAX_LISTED} more" if len(diffs) > MAX_LISTED else ""
        raise CheckpointError(f"zerocore checkpoint: {path} is of a different model ({len(diffs)} differences):\n  "
                              + "\n  ".join(diffs[:MAX_LISTED]) + more)
    with_state = load_optimizer_states and not load_module_only
    ts = engine._torch_step
    load_kinds_before = None if ts is None else ts.load_kinds
    err, reader, small, staged, client_state, wrote = None, None, None, None, None, False
    try:
        kinds = engine_state.kinds_to_read(engine, manifest, with_state)
        reader = CheckpointReader(path, manifest, dataclasses.asdict(engine.config.aio))  # files present, sizes
        reader.check_complete([*saved_name.values(), *trained.values()])
        extras = _extras(engine, reader, trained)
        frozen = _frozen_pieces(engine, reader, trained)  # only what this rank owns of partitioned frozen ones
        plan = plan_state(engine, reader, saved_name, kinds)
        direct = None
        if ts is None and in_place is not False and (in_place or load_in_place.nothing_to_lose(engine)):
            direct = load_in_place.targets(engine, plan)
        if direct is not None:
            wrote = True
            engine._zc_state_lost = path  # until this load succeeds: the state is being overwritten
            load_in_place.read(reader, direct)  # every block of this rank's state, verified in place
        else:
            staged = reader.fetch()
            for pieces in plan:
                for _, _, _, n, file, off in pieces:
                    staged.add(file, off, n * _FP32)
            arena = _staging_for(engine, staged)
            if arena is not None:
                staged.run(arena=arena)  # every block of this rank's state, read once and checked
            else:
                staged.run(keep=False)  # every block checked, and read again below
                staged = None
        small = reader.fetch()
        for _, e, _ in extras:
            if e is not None:
                reader.add_extra(small, e)
        for _, _, e, a, b, _ in frozen:
            if e is not None:
                reader.add_extra(small, e, a, b)
        masters = _trained_values(reader, extras, frozen)  # read and verified now, written after the agreement
        if not load_module_only:
            reader.add_client_state(small)
        small.run()
        if not load_module_only:
            client_state = reader.client_state_from(small)
    except Exception as e:
        err = e
    # nothing of the engine was changed so far (unless it read in place): a failure on any rank
    # leaves every engine as it was
    agree(engine.comm, err is not None, f"loading {path}", _LOST if wrote else
           "Nothing was loaded; the engine is unchanged")
    if err is not None:
        if ts is not None:
            ts.load_kinds = load_kinds_before
        for f in (small, staged):
            if f is not None:
                f.release()
        if reader is not None:
            reader.close()
        if wrote:
            raise CheckpointError(f"{err}\n{_LOST}") from err
        raise err
    # With the state staged and resident (its tiles are views), the masters go in first and the
    # parameters' all-gathers run while the other kinds are copied. Read in place, it is there.
    first = ("master",) if staged is not None and ts is None and all(
        type(s) is OptimizerShard for s in engine.shards) else None
    gathers = None
    try:
        if not wrote:
            _write_state(engine, reader, plan, staged, only=first)
        if first is not None:
            gathers = _refresh_params(engine, wait=False)
            _write_state(engine, reader, plan, staged, skip=first)
        for i, (t, e, _) in enumerate(extras):
            value = reader.extra_from(small, e) if e is not None else masters[("whole", i)].view(t.shape)
            t.detach().copy_(value.to(t.dtype))
        for i, (owned, at, e, a, b, _) in enumerate(frozen):
            value = reader.extra_from(small, e, a, b) if e is not None else masters[("part", i)]
            owned[at:at + b - a] = value.to(owned.dtype)
    except ChecksumError as e:  # verified a moment ago (two-pass path): the file changed during the load
        engine._zc_state_lost = path
        raise CheckpointError(f"{e}\n(it was verified earlier in this load: the file changed while it was loaded; "
                              "the engine's state was partly overwritten: load a good checkpoint before training "
                              "on)") from e
    finally:
        for f in (small, staged):
            if f is not None:
                f.release()
        reader.close()
        if gathers is not None:
            _finish_gathers(gathers)
    if gathers is None:
        _refresh_params(engine)
    return _finish_load(engine, path, manifest, with_state, load_module_only, load_lr_scheduler_states, client_state)


_LOST = ("The load read into the engine's optimizer state in place (load_checkpoint(in_place=...), by default "
         "where the engine had not trained), so that state is now partly overwritten: the engine refuses "
         "step() and save_checkpoint() until a load succeeds; its 16-bit weights are unchanged (with fp32 "
         "training the master is the weights' owned slice: overwritten too). Load a good checkpoint (or pass "
         "in_place=False to keep the engine unchanged when a load fails).")


def _finish_load(engine, path, manifest, with_state, load_module_only, load_lr_scheduler_states, client_state):
    """The counters, schedule and scaler; the engine's state is whole again (see load_in_place)."""
    engine._zc_state_lost = None
    mark_written(engine)
    if not load_module_only:
        _restore_counters(engine, manifest, with_state)
        engine_state.restore(engine, manifest, load_lr_scheduler_states, with_state)
    return path, (client_state if not load_module_only else {})


def _staging_for(engine, staged):
    """Where this load keeps its verified bytes until the agreement: the buffers the engine
    already holds where it has them (fresh ones for the rest, within the budget), else one fresh
    region within the budget, else None (the state is read twice)."""
    held = staging.held_buffers(engine)
    if held:
        arena = staging.HeldArena(held, staged.piece_bytes)
        if arena.fresh_bytes(staged.planned_reads()) <= staging.budget():
            return arena
    need = staged.planned_bytes()
    if need > staging.budget():
        return None
    try:
        return staging.Arena(need)
    except MemoryError:  # the memory went elsewhere since the budget was read: read twice
        return None


@torch.no_grad()
def _write_state(engine, reader: CheckpointReader, plan: list[list[tuple]], staged=None, only=None,
                 skip=()) -> None:
    """The verified state into the engine, tile by tile (state on NVMe streams through its
    tiles): copied from ``staged`` (a run Fetch holding all of it), or where that is None each
    tile's bytes fetched again (verified again) into pooled I/O buffers and copied. ``only`` /
    ``skip``: the kinds written (all by default)."""
    for shard, pieces in zip(engine.shards, plan):
        planned = ShardPieces(pieces)
        for lo, hi, state in shard.state_tiles(LOAD_TILE_ELEMS, write=True):
            copies = planned.in_tile(lo, hi)
            fetch = staged if staged is not None else reader.fetch()
            try:
                if staged is None:
                    for _, _, n, file, off in copies:
                        fetch.add(file, off, n * _FP32)
                    fetch.run()
                for k, dst in state.items():  # Adam's m and v, or a client optimizer's kinds
                    if k in skip or (only is not None and k not in only):
                        continue
                    host = dst if dst.device.type == "cpu" and dst.is_contiguous() else torch.empty(
                        dst.shape, dtype=torch.float32)
                    for x, n, file, off in spans(copies, k, hi - lo):
                        if file is None:
                            host[x:x + n].zero_()
                        else:
                            fetch.copy_into(file, off, host[x:x + n])
                    if host is not dst:
                        dst.copy_(host)
            finally:
                if staged is None:
                    fetch.release()


def _extras(engine, reader: CheckpointReader, trained: dict[str, str]) -> list[tuple]:
    """(tensor, saved extra, None) of each frozen parameter kept whole and each buffer; (tensor, None, saved
    trainable name) of a frozen parameter the checkpoint trained (``model_differences``)."""
    saved = {a: e for e in reader.manifest["extras"] for a in e["aliases"]}
    out = []
    for names, _, t in extra_tensors(engine):
        e = next((saved[n] for n in names if n in saved), None)
        out.append((t, e, None) if e is not None else (t, None, trained[names[0]]))
    return out


def _frozen_pieces(engine, reader: CheckpointReader, trained: dict[str, str]) -> list[tuple]:
    """The parts of stage 3's partitioned frozen parameters this rank owns: (its owned chunk, flat
    position in it, the saved extra, start, stop in the parameter's elements, None), or with the saved
    extra None, the name of the trainable parameter holding it in the checkpoint last. The saved extra
    (or master) may be whole or in chunks, of any world size."""
    saved = {a: e for e in reader.manifest["extras"] for a in e["aliases"]}
    out = []
    for g in engine.frozen_groups:
        owned = g.owned_params()
        for slot, a, b in g.layout.pieces(g.lo, g.hi):
            e = next((saved[n] for n in slot.aliases if n in saved), None)
            if e is None:
                name = trained[slot.aliases[0]]
                reader.ranges(name, a, b, "master")  # every element saved: checked before anything is read
                out.append((owned, slot.offset + a - g.lo, None, a, b, name))
                continue
            reader.extra_pieces(e, a, b)  # every element saved: checked before anything is read
            out.append((owned, slot.offset + a - g.lo, e, a, b, None))
    return out


def _trained_values(reader: CheckpointReader, extras: list[tuple], frozen: list[tuple]) -> dict:
    """The fp32 masters of the frozen parameters the checkpoint trained (whole, or this rank's pieces), read and
    verified: {("whole", i) or ("part", i): values} by their index in ``extras`` / ``frozen``."""
    out = {}
    for i, (_, e, name) in enumerate(extras):
        if e is None:
            out[("whole", i)] = reader.read_master(name)
    for i, (_, _, e, a, b, name) in enumerate(frozen):
        if e is None:
            out[("part", i)] = reader.read_master(name, a, b)
    return out


@torch.no_grad()
def _refresh_params(engine, wait: bool = True):
    """16-bit owned parameters from the master; then full parameters where they stay gathered:
    one in-place collective per group, all in flight at once (what a step's re-gather costs).
    ``wait=False``: returns the collectives in flight, for :func:`_finish_gathers`."""
    gather = engine.policy.shard_optimizer and engine.comm.world > 1
    inflight = []
    for g, shard in zip(engine.groups, engine.shards):
        shard.refresh_params()
        if gather and not g.partitioned:  # stage 3 units gather at their next forward
            g.param_state.to(ParamState.SHARDED)
            g.param_state.to(ParamState.GATHERING)
            inflight.append((engine.comm.all_gather(g.param_flat, async_op=True), g))
    if not wait:
        return inflight
    _finish_gathers(inflight)
    return None


def _finish_gathers(inflight) -> None:
    for h, g in inflight:
        h.wait()
        g.param_state.to(ParamState.GATHERED)


def _restore_counters(engine, manifest: dict, with_state: bool) -> None:
    c = manifest["counters"]
    # at an accumulation boundary also when the accumulation steps changed
    engine.micro_steps = c["micro_steps"] if c["micro_steps"] % engine.gas == 0 else c["global_steps"] * engine.gas
    engine._window_start = None  # a window starts here: at a multiple of the accumulation steps
    engine.global_steps = c["global_steps"]
    engine.skipped_steps = c["skipped_steps"]
    batch = engine.train_batch_size()
    engine.global_samples = c.get("global_samples", c["global_steps"] * (batch or 0))
    # Adam's bias correction counts the updates the moments have seen: none when they start afresh
    engine.optimizer_steps = c["optimizer_steps"] if with_state else 0
    saved = manifest["scaler"]
    s = engine.scaler
    if saved.get("dynamic") and s.dynamic:
        for k, v in saved.items():
            setattr(s, k, v)
    elif saved.get("dynamic") != s.dynamic:
        warnings.warn("zerocore checkpoint: the loss scaler's kind changed (saved "
                      f"{'dynamic' if saved.get('dynamic') else 'static'}, now "
                      f"{'dynamic' if s.dynamic else 'static'}); its saved state is not restored", UserWarning,
                      stacklevel=4)
    rngs = manifest["rng"]
    if engine.comm.rank < len(rngs):
        set_rng_state(rngs[engine.comm.rank])
