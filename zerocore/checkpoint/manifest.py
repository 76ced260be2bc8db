"""The manifest: one JSON file, written by rank 0 last, that describes every byte of a checkpoint
in terms that do not depend on how the saving engine laid out its groups.

Trainable parameters are described by name (+ aliases of tied weights), shape and dtype; every
saved chunk of a parameter is a range [start, stop) of *that parameter's own flattened
elements* with the file and byte offset of its fp32 master, exp_avg and exp_avg_sq. Any engine
(another stage, world size, bucket size or unit plan) maps its owned ranges onto parameters
with ``FlatGroup.pieces`` and reads the chunks that overlap them.

    {"format": "zerocore-checkpoint", "version": 1, "tag", "world_size", "stage", "dtype",
     "counters": {micro_steps, global_steps, optimizer_steps, skipped_steps},
     "scaler": {...LossScaler fields}, "hyper": {lr, betas, eps, weight_decay, decoupled},
     "config": {...the ZeroConfig saved with}, "params": [{name, aliases, shape, dtype}],
     "chunks": {name: [[start, stop, file, master_off, exp_avg_off, exp_avg_sq_off], ...]},
     "extras": [{name, aliases, kind: frozen|buffer, shape, dtype, file, offset, nbytes}
                | {name, aliases, kind: frozen, shape, dtype, chunks: [[start, stop, file, offset], ...]}],
     "client_state": {file, offset, nbytes} | null,
     "files": {file: {bytes, block, crc32c: [per block]}}, "rng": [per rank]}

Version 2 checksums blocks with CRC32C (``crc32c``); version 1 files carry zlib's CRC-32
(``crc32``) and are still read. Version 3 adds extras saved in ``chunks``: frozen parameters that
stage 3 partitions are written by the ranks that own them, each chunk a range [start, stop) of the
parameter's flattened elements in its saved dtype at a byte offset of a rank's file (a whole
extra is one chunk [0, numel) at ``offset``: ``extra_chunks``).
"""
from __future__ import annotations

import base64
import random
import sys

import torch

FORMAT = "zerocore-checkpoint"
VERSION = 3
KINDS = ("master", "exp_avg", "exp_avg_sq")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
           "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"zerocore checkpoint: unsupported dtype {name!r} in the manifest") from None


def trainable_records(engine) -> list[dict]:
    return [{"name": s.name, "aliases": list(s.aliases), "shape": list(s.shape), "dtype": dtype_name(s.dtype)}
            for g in engine.groups for s in g.layout.slots]


def extra_tensors(engine) -> list[tuple[list[str], str, torch.Tensor]]:
    """Frozen parameters and persistent buffers whole on every rank: (names, kind, tensor), one
    entry per distinct tensor, in state-dict order (stage 3's partitioned frozen parameters are
    ``partitioned_frozen``'s)."""
    trained = {id(p) for g in engine.groups + engine.frozen_groups for p in g.params}
    params = {id(p) for p in engine.module.parameters()}
    seen: dict[int, tuple[list[str], str, torch.Tensor]] = {}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in trained:
            continue
        if id(t) in seen:
            seen[id(t)][0].append(name)
        else:
            seen[id(t)] = ([name], "frozen" if id(t) in params else "buffer", t)
    return list(seen.values())


def partitioned_frozen(engine) -> list[tuple[object, object]]:
    """(frozen group, slot) of every frozen parameter stage 3 partitioned (``engine.frozen_groups``)."""
    return [(g, s) for g in engine.frozen_groups for s in g.layout.slots]


def frozen_records(engine) -> list[dict]:
    """What the manifest says of each partitioned frozen parameter besides its chunks."""
    return [{"name": s.name, "aliases": list(s.aliases), "kind": "frozen", "shape": list(s.shape),
             "dtype": dtype_name(s.dtype)} for _, s in partitioned_frozen(engine)]


def extra_chunks(entry: dict) -> list[list]:
    """An extra's chunks, [start, stop, file, byte offset] in its flattened elements: a whole one
    (versions 1-2, and tensors kept whole) is a single chunk."""
    if "chunks" in entry:
        return entry["chunks"]
    n = 1
    for d in entry["shape"]:
        n *= d
    return [[0, n, entry["file"], entry["offset"]]]


def model_differences(manifest: dict, engine) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """(differences, saved name of each trainable slot, saved name of each frozen parameter the checkpoint
    holds as a trainable one). A parameter is found under any of its names, so a tie expressed through
    another first name still matches. A frozen parameter (whole, or partitioned at stage 3) comes from the
    checkpoint's frozen tensors, or else from its trainable ones (their fp32 master): an engine that trains
    nothing (an evaluation) reads a training checkpoint's weights, as DeepSpeed's inference engine does."""
    saved = {}
    for p in manifest["params"]:
        for a in p["aliases"]:
            saved[a] = p
    diffs, match, used = [], {}, set()
    for g in engine.groups:
        for s in g.layout.slots:
            p = next((saved[a] for a in s.aliases if a in saved), None)
            if p is None:
                diffs.append(f"trainable parameter '{s.name}' {list(s.shape)} is not in the checkpoint")
                continue
            used.add(p["name"])
            if list(s.shape) != p["shape"]:
                diffs.append(f"'{s.name}': shape {list(s.shape)} in the model, {p['shape']} in the checkpoint")
            match[s.name] = p["name"]
    saved_extra = {a: e for e in manifest["extras"] for a in e["aliases"]}
    wanted = [(names, kind, list(t.shape)) for names, kind, t in extra_tensors(engine)]
    wanted += [(list(s.aliases), "frozen", list(s.shape)) for _, s in partitioned_frozen(engine)]
    trained = {}
    for names, kind, shape in wanted:
        e = next((saved_extra[n] for n in names if n in saved_extra), None)
        if e is None and kind == "frozen":
            p = next((saved[n] for n in names if n in saved and saved[n]["name"] not in used), None)
            if p is not None:  # trained in the checkpoint, frozen here
                used.add(p["name"])
                trained[names[0]] = p["name"]
                e = p
        if e is None:
            diffs.append(f"{kind} '{names[0]}' {shape} is not in the checkpoint")
        elif e["shape"] != shape:
            diffs.append(f"{kind} '{names[0]}': shape {shape} in the model, {e['shape']} in the checkpoint")
    for p in manifest["params"]:
        if p["name"] not in used:
            diffs.append(f"checkpoint parameter '{p['name']}' {p['shape']} is not a parameter of the model")
    return diffs, match, trained


# -- RNG states ------------------------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict:
    st = {"torch": _b64(torch.get_rng_state()), "python": _jsonable(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    np = sys.modules.get("numpy")
    if np is not None:
        st["numpy"] = _jsonable(np.random.get_state())
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(_unb64(st["torch"]))
    random.setstate(_tupled(st["python"]))
    if "cuda" in st and torch.cuda.is_available():
        states = [_unb64(s) for s in st["cuda"]]
        for i, s in enumerate(states[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in st:
        kind, keys, pos, has_gauss, gauss = st["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def _jsonable(x):
    if isinstance(x, (tuple, list)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "tolist"):
        return x.tolist()
    return x


def _tupled(x):
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x
