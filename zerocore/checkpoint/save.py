"""``engine.save_checkpoint``: every rank writes what it owns, rank 0 publishes atomically.

1. rank 0 removes debris of killed saves (``.tmp-*``) and creates ``.tmp-<tag>``; barrier.
2. each rank streams its optimizer state, tile by tile through ``OptimizerShard.state_tiles``
   (so state resting on host or NVMe is never materialised whole), into ``rank<r>.bin``,
   recording each parameter piece in the parameter's own coordinates and a CRC per block; each rank
   writes its owned chunks of the frozen parameters stage 3 partitioned; rank 0 also writes the
   frozen parameters kept whole, buffers and the client state. Host state that is resident (the
   tiles are views of it) goes to disk from where it is, read only by its CRC32C; other tensors
   (device state, NVMe tiles, small ones) are copied once into aligned I/O buffers, the CRC32C in
   the same pass. The writes go through ``zerocore.ops.AsyncIO`` (O_DIRECT, the config's ``aio``
   settings, several in flight; the page cache where it is unavailable) while the next are
   prepared (``block_writer.py``). The file is fsync'ed and a
   small per-rank index (chunks, checksums, RNG state) written beside it; barrier, which also
   tells every rank whether any rank failed (then all raise, nothing is published).
3. rank 0 merges the indexes into ``manifest.json`` (fsync'ed), renames ``.tmp-<tag>`` to
   ``<tag>`` and then replaces ``latest``; barrier, so no rank returns before the commit.

A kill at any moment leaves the previous tag and ``latest`` intact and nothing under a real tag
but a complete checkpoint. At stage 0 (or world 1) the state is replicated and only rank 0 writes.
Saving a tag that exists swaps the new directory with the old one atomically (Linux
``renameat2(RENAME_EXCHANGE)``); where that is unavailable the old one is moved aside
(``.tmp-old-<tag>``) first, and a crash between those two renames leaves ``latest`` naming a
missing tag (the old copy stays in that directory until the next save removes it).
"""
from __future__ import annotations

import atexit
import dataclasses
import io
import json
import os
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator

import torch

from .block_writer import BlockWriter, FileSink
from .blockio import aio_handles
from .layout import (LATEST, MANIFEST, TMP_PREFIX, CheckpointError, check_tag, exchange, fsync_dir, rank_file,
                     write_atomic)
from .recovery import write_recovery_script
from ..runtime.checkpoint_marks import check_state_whole
from ..sharding import FlatGroup
from .agreement import agree
from . import engine_state
from .manifest import (FORMAT, KINDS, VERSION, dtype_name, extra_tensors, frozen_records, rng_state,
                       trainable_records)

TILE_ELEMS = 1 << 22  # 16 MiB of fp32 per state tensor per write
_FP32 = 4

# Tests set this to a callable(rank, what) run between the pieces each rank writes (to kill a
# rank in the middle of a save).
between_writes = None


def _hook(rank: int, what: str) -> None:
    if between_writes is not None:
        between_writes(rank, what)


# Removing a tag's previous content (freeing a rank file's extents costs about 0.15 s per GB on
# ext4) runs beside the training once the new content is published; the next save (before it
# looks for debris) and the interpreter's exit wait for it.
_removals: list[threading.Thread] = []
_removals_lock = threading.Lock()


def _remove_later(path: str) -> None:
    t = threading.Thread(target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True},
                         name="zerocore-checkpoint-remove", daemon=True)
    t.start()
    with _removals_lock:
        _removals.append(t)


def finish_removals() -> None:
    with _removals_lock:
        pending = list(_removals)
        _removals.clear()
    for t in pending:
        t.join()


atexit.register(finish_removals)


@dataclasses.dataclass
class SavePlan:
    """Everything one rank's save needs, taken from the engine when ``save_checkpoint`` is called
    (so an asynchronous save writes the state of that moment while training goes on)."""

    comm: object  # the Comm whose barriers order the save (async: a group of its own)
    tag: str
    writes_state: bool  # stage 0 / world 1: the state is replicated and only rank 0 writes it
    # (layout, flat lo, flat hi, state views, whether they keep their contents until the tiles end)
    tiles: Callable[[], Iterator[tuple[FlatGroup, int, int, dict[str, torch.Tensor], bool]]]
    extras: list  # (names, kind, tensor): frozen parameters kept whole and buffers (rank 0)
    # stage 3's partitioned frozen parameters: (layout, flat lo, flat hi, this rank's owned chunk), and
    # (rank 0) what the manifest says of each besides its chunks
    frozen: list
    frozen_records: list
    client_bytes: bytes | None
    meta: dict  # the manifest's fields that describe the engine
    rng: dict
    aio: dict | None  # AsyncIO settings (the config's aio section); None: the page cache
    save_latest: bool = True  # replace save_dir/latest with this tag once published


def live_tiles(engine):
    """The optimizer state as it is now, tile by tile: (layout, flat lo, flat hi, state views,
    ``tiles_kept``: whether a file writer may write the views from where they are)."""
    def tiles():
        for shard in engine.shards:
            g = shard.group
            for lo, hi, state in shard.state_tiles(TILE_ELEMS):
                yield g.layout, g.lo + lo, g.lo + hi, state, shard.tiles_kept
    return tiles


def aio_handle(settings: dict | None):
    """An AsyncIO handle for checkpoint files from the config's ``aio`` section (one of the
    process's pooled ones), or None (the page cache) where none can be made."""
    (h,) = aio_handles(settings, 1)
    return h


def make_plan(engine, tag: str, client_state, comm, tiles, use_aio: bool = True, save_latest: bool = True) -> SavePlan:
    client = None
    if client_state is not None and engine.comm.rank == 0:
        buf = io.BytesIO()
        torch.save(client_state, buf)
        client = buf.getvalue()
    s = engine.scaler
    frozen = [(g.layout, g.lo, g.hi, g.owned_params()) for g in engine.frozen_groups]
    meta = {
        # version 3 only where it is needed (chunked extras): older zerocore reads the others
        "format": FORMAT, "version": VERSION if frozen else 2, "tag": tag, "world_size": engine.comm.world,
        "stage": engine.policy.stage, "dtype": dtype_name(engine.dtype),
        "counters": {"micro_steps": engine.micro_steps, "global_steps": engine.global_steps,
                     "optimizer_steps": engine.optimizer_steps, "skipped_steps": engine.skipped_steps,
                     "global_samples": engine.global_samples},
        "scaler": {k: v for k, v in vars(s).items() if isinstance(v, (bool, int, float)) and not k.startswith("_")},
        "hyper": {**dataclasses.asdict(engine.hyper), "betas": list(engine.hyper.betas)},
        **engine_state.saved(engine),
        "config": dataclasses.asdict(engine.config),
        "params": trainable_records(engine),
    }
    return SavePlan(comm=comm, tag=tag, writes_state=engine.policy.partitions(engine.comm.world) > 1
                    or engine.comm.rank == 0, tiles=tiles,
                    extras=extra_tensors(engine) if engine.comm.rank == 0 else [], frozen=frozen,
                    frozen_records=frozen_records(engine) if engine.comm.rank == 0 else [], client_bytes=client, meta=meta,
                    rng=rng_state(), aio=dataclasses.asdict(engine.config.aio) if use_aio else None,
                    save_latest=save_latest)


def _write_rank(plan: SavePlan, tmp: str | None, sink=None) -> dict:
    """Writes this rank's file into ``tmp`` (or its bytes into ``sink``, an ImageSink, to be
    written later); returns its index (what the manifest needs from this rank)."""
    rank = plan.comm.rank
    index = {"rank": rank, "rng": plan.rng, "chunks": [], "extras": [], "frozen": [], "client_state": None,
             "file": None}
    if not plan.writes_state:
        return index
    name = rank_file(rank)
    w = BlockWriter(sink if sink is not None else FileSink(os.path.join(tmp, name), plan.aio))
    try:
        for layout, lo, hi, state, kept in plan.tiles():
            offs = []
            for k in plan.meta.get("kinds", KINDS):  # Adam's, or a client optimizer's state kinds
                offs.append(w.write(state[k], kept=kept, paged=True))
                _hook(rank, f"group {layout.index} {k}")
            for slot, a, b in layout.pieces(lo, hi):
                skip = (slot.offset + a - lo) * _FP32
                index["chunks"].append([slot.name, a, b, name] + [o + skip for o in offs])
        for layout, lo, hi, chunk in plan.frozen:  # this rank's chunks of partitioned frozen parameters
            off = w.write(chunk, paged=True)
            for slot, a, b in layout.pieces(lo, hi):
                index["frozen"].append([slot.name, a, b, name, off + (slot.offset + a - lo) * chunk.element_size()])
            _hook(rank, f"frozen group {layout.index}")
        for names, kind, t in plan.extras:
            off = w.write(t)
            index["extras"].append({"name": names[0], "aliases": names, "kind": kind, "shape": list(t.shape),
                                    "dtype": dtype_name(t.dtype), "file": name, "offset": off,
                                    "nbytes": t.numel() * t.element_size()})
        if plan.client_bytes is not None:
            index["client_state"] = {"file": name, "offset": w.write_bytes(plan.client_bytes),
                                     "nbytes": len(plan.client_bytes)}
        index["file"] = name
        index["record"] = w.close()
    except BaseException:
        w.abort()
        raise
    return index


def _manifest(plan: SavePlan, indexes: list[dict]) -> dict:
    chunks: dict[str, list] = {}
    files = {}
    for ix in indexes:
        for c in ix["chunks"]:
            chunks.setdefault(c[0], []).append(c[1:])
        if ix["file"] is not None:
            files[ix["file"]] = ix["record"]
    frozen: dict[str, list] = {}
    for ix in indexes:
        for c in ix.get("frozen", []):
            frozen.setdefault(c[0], []).append(c[1:])
    rank0 = indexes[0]
    extras = rank0["extras"] + [{**rec, "chunks": sorted(frozen.get(rec["name"], []))} for rec in plan.frozen_records]
    return {**plan.meta, "chunks": chunks, "extras": extras, "client_state": rank0["client_state"],
            "files": files, "rng": [ix["rng"] for ix in indexes]}


class TagMismatch(CheckpointError, AssertionError):
    """save_checkpoint was given different tags on different ranks, with checkpoint.tag_validation
    FAIL (an AssertionError too: DeepSpeed asserts there)."""


def check_can_save(engine, tag):
    """The tag this save writes (the same on every rank). A save in the middle of an accumulation
    window is allowed, as DeepSpeed's is, with a warning: the window's gradients are not saved, and a
    resume starts the window again (``load.py`` resets the micro-step counter to its start)."""
    check_state_whole(engine, "save_checkpoint()")
    if engine._mid_window():
        warnings.warn(f"zerocore: save_checkpoint in the middle of gradient accumulation (micro step "
                      f"{engine.micro_steps}, accumulation {engine.gas}): the gradients accumulated so far are not "
                      "saved; a resume starts this accumulation window again", RuntimeWarning, stacklevel=4)
    return agreed_tag(engine, check_tag(f"global_step{engine.global_steps}" if tag is None else tag))


def agreed_tag(engine, tag: str) -> str:
    """Rank 0's tag, on every rank. Ranks given another tag (a per-rank tag, a step counter that
    differs) are told as ``checkpoint.tag_validation`` says: WARN (the default, as DeepSpeed's) warns
    and saves under rank 0's tag, IGNORE saves under it silently, FAIL raises on every rank."""
    comm = engine.comm
    if comm.world == 1:
        return tag
    mine = tag.encode()
    (size,) = comm.sum_floats([float(len(mine)) if comm.rank == 0 else 0.0])
    first = torch.zeros(int(size), dtype=torch.uint8, device=engine.device)
    if comm.rank == 0:
        first.copy_(torch.frombuffer(bytearray(mine), dtype=torch.uint8))
    comm.broadcast(first, src=0)
    chosen = bytes(first.cpu().tolist()).decode()
    (differ,) = comm.sum_floats([float(chosen != tag)])
    if not differ:
        return tag
    mode = engine.config.checkpoint.tag_validation.upper()
    if mode == "FAIL":
        raise TagMismatch(f"zerocore checkpoint: save_checkpoint was given different tags on different ranks "
                          f"({int(differ)} rank(s) differ from rank 0's {chosen!r}; this rank's: {tag!r}); with "
                          "checkpoint.tag_validation FAIL nothing is saved. Pass the same tag on every rank")
    if mode == "WARN" and chosen != tag:
        warnings.warn(f"zerocore checkpoint: this rank was given tag {tag!r}, rank 0 {chosen!r}: the checkpoint is "
                      "saved under rank 0's tag (checkpoint.tag_validation WARN)", RuntimeWarning, stacklevel=4)
    return chosen


def save_checkpoint(engine, save_dir: str, tag=None, client_state=None, save_latest: bool = True) -> str:
    tag = check_can_save(engine, tag)
    return run_save(make_plan(engine, tag, client_state, engine.comm, live_tiles(engine), save_latest=save_latest),
                    os.fspath(save_dir))


def run_save(plan: SavePlan, save_dir: str, prepared: tuple | BaseException | None = None) -> str:
    """The save protocol (see the module docstring) for one rank. ``prepared``: (index, image) of
    this rank's file made beforehand by ``_write_rank`` into an ImageSink (asynchronous save), or
    the error that making it raised."""
    comm, tag = plan.comm, plan.tag
    tmp = os.path.join(save_dir, TMP_PREFIX + tag)
    rank = comm.rank
    err = None
    if rank == 0:
        try:
            finish_removals()  # a previous save's old content is gone before debris is looked for
            os.makedirs(save_dir, exist_ok=True)
            for d in os.listdir(save_dir):
                if d.startswith(TMP_PREFIX):  # a save that was killed: never a checkpoint
                    warnings.warn(f"zerocore checkpoint: removing {os.path.join(save_dir, d)}, left by an "
                                  "interrupted save", RuntimeWarning, stacklevel=4)
                    shutil.rmtree(os.path.join(save_dir, d))
            os.makedirs(tmp)
        except Exception as e:
            err = e
    agree(comm, err is not None, f"preparing {tmp}")
    if err is not None:
        raise err
    try:
        if prepared is None:
            index = _write_rank(plan, tmp)
        elif isinstance(prepared, BaseException):  # the image's copy failed: every rank learns of it below
            raise prepared
        else:
            index, image = prepared
            if index["file"] is not None:
                image.write_file(os.path.join(tmp, index["file"]), plan.aio)
        # no fsync: rank 0 folds it into the manifest, which is fsync'ed before anything is published
        with open(os.path.join(tmp, f"rank{rank:05d}.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(index))  # dumps: C's encoder, one write (json.dump encodes in Python)
    except Exception as e:
        err = e
    agree(comm, err is not None, f"writing {tmp}")
    if err is not None:
        raise err
    old = None
    if rank == 0:
        try:
            old = _publish(plan, save_dir, tmp)
        except Exception as e:
            err = e
    agree(comm, err is not None, f"publishing {os.path.join(save_dir, tag)}")
    if err is not None:
        raise err
    if old is not None:  # the tag's previous content, replaced; nothing waits for its removal
        _remove_later(old)
    return os.path.join(save_dir, tag)


def _publish(plan: SavePlan, save_dir: str, tmp: str) -> str | None:
    """Rank 0: the manifest, then the rename, then ``latest``. Returns the directory holding the
    tag's previous content when the tag was saved before (to be removed)."""
    tag = plan.tag
    indexes = []
    for r in range(plan.comm.world):
        with open(os.path.join(tmp, f"rank{r:05d}.json"), encoding="utf-8") as f:
            indexes.append(json.load(f))
    manifest = _manifest(plan, indexes)
    for r in range(plan.comm.world):
        os.remove(os.path.join(tmp, f"rank{r:05d}.json"))
    with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:  # not yet published: no rename needed
        f.write(json.dumps(manifest, default=str))
        f.flush()
        os.fsync(f.fileno())
    _hook(0, "manifest written")
    fsync_dir(tmp)
    final = os.path.join(save_dir, tag)
    old = None
    if os.path.exists(final):  # saving a tag again: swap atomically; the old content leaves under tmp's name
        if exchange(tmp, final):
            old = tmp
        else:  # no atomic swap here: the old one goes aside first (see the module docstring)
            old = os.path.join(save_dir, f"{TMP_PREFIX}old-{tag}")
            os.rename(final, old)
            os.rename(tmp, final)
    else:
        os.rename(tmp, final)
    fsync_dir(save_dir)
    if plan.save_latest:
        write_atomic(os.path.join(save_dir, LATEST), tag.encode())
    write_recovery_script(save_dir)  # zero_to_fp32.py, as DeepSpeed leaves one (checkpoint/recovery.py)
    return old
