"""``engine.load_checkpoint``: each rank reads the byte ranges of the saved chunks that overlap
what it owns now (any world size, stage, bucket size or unit plan), verified block by block,
writes them into its optimizer state through ``OptimizerShard.state_tiles(write=True)``, then
re-derives its 16-bit parameters from the master and (stages 0-2) re-gathers full parameters.
No rank ever holds more than its own shard plus one tile.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

from ..sharding import ParamState
from . import engine_state
from .layout import CheckpointError, read_manifest, resolve
from .manifest import model_differences, set_rng_state
from .reader import CheckpointReader
from .save import TILE_ELEMS, _agree, aio_handle

MAX_LISTED = 10


def load_checkpoint(engine, load_dir: str, tag=None, load_optimizer_states: bool = True,
                    load_module_only: bool = False, load_lr_scheduler_states: bool = True):
    path = resolve(load_dir, tag)
    if path is None:
        return None, None
    manifest = read_manifest(path)
    diffs, saved_name = model_differences(manifest, engine)
    if diffs:
        more = f"\n  ... and {len(diffs) - MAX_LISTED} more" if len(diffs) > MAX_LISTED else ""
        raise CheckpointError(f"zerocore checkpoint: {path} is of a different model ({len(diffs)} differences):\n  "
                              + "\n  ".join(diffs[:MAX_LISTED]) + more)
    with_state = load_optimizer_states and not load_module_only
    err, client_state, writing = None, None, False
    try:
        aio = aio_handle(dataclasses.asdict(engine.config.aio))
        with CheckpointReader(path, manifest, aio) as reader:  # checks every file's presence and size
            reader.check_complete(saved_name.values())
            writing = True
            _read_state(engine, reader, saved_name, engine_state.kinds_to_read(engine, manifest, with_state))
            _read_extras(engine, reader)
            if not load_module_only:
                client_state = reader.read_client_state()
    except Exception as e:
        err = e
    _agree(engine.comm, err is not None, f"loading {path}")
    if err is not None:
        if writing:
            raise CheckpointError(f"{err}\n(the engine's optimizer state and weights were partly overwritten; "
                                  "load a good checkpoint before training on)") from err
        raise err
    _refresh_params(engine)
    if not load_module_only:
        _restore_counters(engine, manifest, with_state)
        engine_state.restore(engine, manifest, load_lr_scheduler_states, with_state)
    return path, (client_state if not load_module_only else {})


@torch.no_grad()
def _read_state(engine, reader: CheckpointReader, saved_name: dict[str, str], kinds) -> None:
    for shard in engine.shards:
        g = shard.group
        for lo, hi, state in shard.state_tiles(TILE_ELEMS, write=True):
            base = g.lo + lo
            for k, dst in state.items():
                host = dst if dst.device.type == "cpu" and dst.is_contiguous() else torch.empty(
                    dst.shape, dtype=torch.float32)
                host.zero_()  # padding, and the moments when only weights are loaded
                if k in kinds:
                    for slot, a, b in g.layout.pieces(base, g.lo + hi):
                        o = slot.offset + a - base
                        reader.read_param(saved_name[slot.name], a, b, k, host[o:o + b - a])
                if host is not dst:
                    dst.copy_(host)


@torch.no_grad()
def _read_extras(engine, reader: CheckpointReader) -> None:
    saved = {a: e for e in reader.manifest["extras"] for a in e["aliases"]}
    from .manifest import extra_tensors

    for names, _, t in extra_tensors(engine):
        e = next(saved[n] for n in names if n in saved)
        t.detach().copy_(reader.read_extra(e).to(t.dtype))


@torch.no_grad()
def _refresh_params(engine) -> None:
    """16-bit owned parameters from the master; then full parameters where they stay gathered."""
    gather = engine.policy.shard_optimizer and engine.comm.world > 1
    for g, shard in zip(engine.groups, engine.shards):
        shard.refresh_params()
        if gather and not g.partitioned:  # stage 3 units gather at their next forward
            g.param_state.to(ParamState.SHARDED)
            g.param_state.to(ParamState.GATHERING)
            engine.comm.all_gather(g.param_flat)
            g.param_state.to(ParamState.GATHERED)


def _restore_counters(engine, manifest: dict, with_state: bool) -> None:
    c = manifest["counters"]
    # at an accumulation boundary also when the accumulation steps changed
    engine.micro_steps = c["micro_steps"] if c["micro_steps"] % engine.gas == 0 else c["global_steps"] * engine.gas
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
