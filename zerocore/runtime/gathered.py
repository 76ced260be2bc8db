"""``with zerocore.gathered(params, modifier_rank=None):`` — full parameters, visible for a while.

Inside the context the given parameters hold their full values on every rank (stage 3 gathers
their units; parameters partitioned by ``zerocore.init`` and not yet in an engine are gathered
one by one). With ``modifier_rank`` set, that rank's edits are what counts: on exit they are
broadcast to every rank and written back into the shards, including the fp32 master copy of
the optimizer (only for the parameters named, so the others keep their full fp32 precision).
Inside the block gradient mode is off when ``modifier_rank`` is given, so
``model.head.weight.zero_()`` edits the parameter in place as written (DeepSpeed's
``GatheredParameters`` leaves the mode as it is, and its own ``weight.zero_()`` example needs an
outer ``torch.no_grad()``); outside it, torch would refuse an in-place change of a leaf that
requires grad. An exception inside the block on one rank is agreed on at exit: that rank
re-raises it, the others raise a ``RuntimeError`` naming it, and nothing is broadcast or written
back (no rank is left waiting for the write-back's broadcast; at stage 3 the gathered copies,
with any partial edit, are dropped; at stages 0-2 the parameters are the live ones, so a partial
edit stays on the rank that made it). Without ``modifier_rank`` edits are
discarded on exit (reading is what the context is for): gathered copies
are dropped, and a stage-3 parameter that was whole already (a persistent one, or a unit
gathered by a forward under way) is restored from a copy taken on entry; such a discarded edit is
not silent: a RuntimeWarning names the parameters (seen by their version counters, so only an
in-place change), or with ``zero_optimization.enable_sanity_checks`` a RuntimeError does (DeepSpeed's
rule there; without it DeepSpeed is silent). At stages 0-2 the parameters are always whole and
nothing is gathered or copied: edit them only with ``modifier_rank``. A collective: every rank must
enter with the same parameters.

Forwards inside the block find the stage-3 units it gathered whole and leave them so: the whole model
gathered once serves every forward of a ``generate`` (DeepSpeed removes its module hooks for that:
``unwrap_model_for_generation``), where a forward outside gathers and frees each unit. The end of a backward
inside the block hands the units back to the engine (the step then changes the chunks; later forwards in the
block gather as usual).
"""
from __future__ import annotations

import contextlib
import warnings
import weakref

import torch
from torch import nn

from ..comm import default_comm
from ..comm.divergence import Op
from ..sharding import ParamState
from .checkpoint_marks import mark_written
from .frozen_groups import group_at, shard_at
from .partition_init import InitShard, cut_chunk, gather_full

# engines alive in this process, to find which one owns a parameter
_ENGINES: "weakref.WeakSet" = weakref.WeakSet()


def register_engine(engine) -> None:
    _ENGINES.add(engine)


def unregister_engine(engine) -> None:
    _ENGINES.discard(engine)


def owner_of(p: nn.Parameter):
    """The live engine that holds ``p`` in one of its groups, or None."""
    return owner_and_slot(p)[0]


def owner_and_slot(p: nn.Parameter):
    """(the live engine holding ``p``, (its group's index, its slot in the group)), or (None, None)."""
    for e in _ENGINES:
        hit = e.param_index.get(id(p))
        if hit is not None:
            return e, hit
    return None, None


def describe(p: nn.Parameter) -> str:
    """A stage-3 parameter for a message: its name in its engine's model, or what ``zerocore.init`` knows of it."""
    engine, hit = owner_and_slot(p)
    if engine is not None:
        return f"'{group_at(engine, hit[0]).layout.slots[hit[1]].name}'"
    rec = p.__dict__.get("_zc_init")
    if rec is not None:
        return f"(a {rec.owner} parameter of shape {tuple(rec.shape)}, built under zerocore.init)"
    shape = p.__dict__.get("ds_shape")
    return f"(of shape {tuple(shape)})" if shape is not None else f"(of shape {tuple(p.shape)})"


@contextlib.contextmanager
def gathered(params, modifier_rank: int | None = None):
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    engine_groups: dict[tuple[int, int], tuple[object, int, list[int]]] = {}
    loose: list[nn.Parameter] = []
    for p in params:
        engine, hit = owner_and_slot(p)
        if engine is None:
            loose.append(p)
        else:
            gi, si = hit
            engine_groups.setdefault((id(engine), gi), (engine, gi, []))[2].append(si)
    engine_groups = _with_unit_siblings(engine_groups)
    comm = next(iter(e for e, _, _ in engine_groups.values()), None)
    comm = comm.comm if comm is not None else default_comm()
    if modifier_rank is not None and not 0 <= modifier_rank < comm.world:
        raise ValueError(f"zerocore.gathered: modifier_rank={modifier_rank} is not a rank of this {comm.world}-rank "
                         "group")
    opened = []  # (engine, group, its unit) of the stage-3 groups this context gathered (freed on exit)
    inits: list[tuple[nn.Parameter, InitShard]] = []
    saved: list[tuple[nn.Parameter, torch.Tensor, int]] = []  # whole already: restored on exit if changed
    try:
        for engine, gi, slots in engine_groups.values():
            g = group_at(engine, gi)  # a trainable group, or a unit's frozen parameters (stage 3)
            state = g.param_state.value
            if g.partitioned and state is ParamState.SHARDED:
                engine.guard.check(Op.CONTEXT, gi, 0)
                g.start_gather(comm, async_op=False)
                g.finish_gather()
                unit = engine.gatherer.by_group.get(gi) if engine.gatherer is not None else None
                if unit is not None:  # a forward inside the block leaves it whole (generation: one gather)
                    unit.held = True
                opened.append((engine, g, unit))
                continue
            if g.partitioned and state is ParamState.GATHERING:  # a prefetch in flight (inside forward)
                engine.gatherer.finish_prefetch(gi)  # the gatherer still owns it (and frees it)
            if modifier_rank is None and engine.config.zero_optimization.stage == 3:
                saved += [(g.params[si], g.params[si].detach().clone(), g.params[si]._version) for si in slots]
        for p in loose:
            rec = getattr(p, "_zc_init", None)
            if rec is not None:
                p.data = gather_full(p, comm).clone()
                rec.open = True
                inits.append((p, rec))
        if modifier_rank is None:
            watched = _discarded_on_exit(engine_groups, inits)
            versions = [p._version for p, _, _ in watched]
            yield params
            _report_discarded_edits([(name, strict) for (p, name, strict), v in zip(watched, versions)
                                     if p._version != v])
        else:
            raised = None
            try:
                with torch.no_grad():  # the edit is no operation of any graph
                    yield params
            except Exception as exc:  # noqa: BLE001 - agreed with the other ranks, then re-raised
                raised = exc
            failed = _ranks_that_raised(comm, raised is not None)
            if raised is not None:
                raise raised
            if failed:
                raise RuntimeError(
                    f"zerocore.gathered: rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} raised "
                    "an exception inside the block (its error says which); the edits were discarded on every rank")
            with torch.no_grad():
                for engine, gi, slots in engine_groups.values():
                    if not slots:  # a sibling gathered along (see _with_unit_siblings): nothing of it was named
                        continue
                    _write_back(engine, gi, slots, modifier_rank)
                    mark_written(engine)  # a failed load may no longer overwrite its state in place
                for p in loose:
                    comm.broadcast(p.data, src=modifier_rank)
                for p, rec in inits:
                    cut_chunk(p.data.reshape(-1), rec.chunk, comm.rank)
    finally:
        with torch.no_grad():
            for p, value, version in saved:
                if p._version != version:  # untouched ones stay untouched (autograd may have saved them)
                    p.copy_(value)
        for p, rec in inits:
            p.data = torch.empty(0, dtype=rec.chunk.dtype, device=rec.chunk.device)
            p._zc_init = rec
            rec.version = p._version
            rec.open = False
        for engine, g, unit in opened:
            # (a unit whose hold a backward's end released is the gatherer's again: freed there, or by its next pass)
            if g.param_state.value is ParamState.GATHERED and (unit is None or unit.held):
                g.free_full_keeping_aliases()  # what the user took from the parameters stays valid
        for engine, g, unit in opened:
            if unit is not None:
                unit.held = False


def _discarded_on_exit(engine_groups: dict, inits: list) -> list[tuple[nn.Parameter, str, bool]]:
    """(parameter, name, whether its config asks for DeepSpeed's sanity checks) of those named whose in-place edit
    a read-only context drops on exit: stage-3 ones (gathered copies, or restored from the entry copy) and those
    partitioned by ``zerocore.init``."""
    out = []
    for engine, gi, slots in engine_groups.values():
        z = engine.config.zero_optimization
        if z.stage == 3:  # (stages 0-2: the live parameters, edits stay)
            g = group_at(engine, gi)
            out += [(g.params[si], g.layout.slots[si].name, z.enable_sanity_checks) for si in slots]
    out += [(p, f"a {rec.owner} parameter of shape {tuple(rec.shape)}", rec.sanity_checks) for p, rec in inits]
    return out


def _report_discarded_edits(edited: list[tuple[str, bool]]) -> None:
    """A RuntimeWarning naming the discarded edits, or (``enable_sanity_checks``, DeepSpeed's rule) an error."""
    if not edited:
        return
    names = [name for name, _ in edited]
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    msg = (f"zerocore.gathered: in-place modification of {shown} inside a block without modifier_rank was discarded "
           "on exit (the block is for reading; pass modifier_rank=<rank> to keep one rank's edit)")
    if any(strict for _, strict in edited):
        raise RuntimeError(msg + " [zero_optimization.enable_sanity_checks]")
    warnings.warn(msg, RuntimeWarning, stacklevel=4)


def _with_unit_siblings(engine_groups: dict) -> dict:
    """The groups to gather, with the other group of each stage-3 unit that has two (its trainable and
    its frozen parameters are gathered together), right after it: a forward run inside the context
    finds the unit whole, never half gathered. Same order on every rank (the order of ``params``)."""
    out = {}
    for key, (engine, gi, slots) in engine_groups.items():
        out.setdefault(key, (engine, gi, slots))
        unit = engine.gatherer.by_group.get(gi) if engine.gatherer is not None else None
        for g in unit.groups() if unit is not None else ():
            out.setdefault((key[0], g.index), engine_groups.get((key[0], g.index), (engine, g.index, [])))
    return out


def _ranks_that_raised(comm, raised: bool) -> list[int]:
    """Every rank learns which ranks left the block by an exception, in one small collective, so
    no rank waits in the write-back's broadcast for a rank that will never come."""
    flags = comm.sum_floats([1.0 if raised and r == comm.rank else 0.0 for r in range(comm.world)])
    return [r for r, f in enumerate(flags) if f]


def _write_back(engine, gi: int, slots: list[int], src: int) -> None:
    """The modifier's values of group ``gi`` to every rank, and into this rank's shards (a frozen
    group has only its owned chunk: no fp32 master)."""
    g, shard = group_at(engine, gi), shard_at(engine, gi)
    engine.comm.broadcast(g.param_flat, src=src)
    for si in slots:
        s = g.layout.slots[si]
        a, b = max(s.offset, g.lo), min(s.end, g.hi)
        if a >= b:
            continue
        if g.partitioned:
            g.owned_params()[a - g.lo:b - g.lo] = g.param_flat[a:b]  # (offload: made resident first)
        if shard is not None and shard.master.data_ptr() != g.owned_params().data_ptr():  # a separate fp32 master
            shard.load_master(a - g.lo, b - g.lo, g.param_flat[a:b].float())
