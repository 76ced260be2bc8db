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
     "extras": [{name, aliases, kind: frozen|buffer, shape, dtype, file, offset, nbytes}],
     "client_state": {file, offset, nbytes} | null,
     "files": {file: {bytes, block, crc32c: [per block]}}, "rng": [per rank]}

Version 2 checksums blocks with CRC32C (``crc32c``); version 1 files carry zlib's CRC-32
(``crc32``) and are still read.
"""
from __future__ import annotations

import base64
import random
import sys

import torch

FORMAT = "zerocore-checkpoint"
VERSION = 2
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
    """Frozen parameters and persistent buffers (whole on every rank): (names, kind, tensor),
    one entry per distinct tensor, in state-dict order."""
    trained = {id(p) for g in engine.groups for p in g.params}
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


def model_differences(manifest: dict, engine) -> tuple[list[str], dict[str, str]]:
    """(differences, saved name of each trainable slot). A parameter is found under any of its
    names, so a tie expressed through another first name still matches."""
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
    for p in manifest["params"]:
        if p["name"] not in used:
            diffs.append(f"checkpoint parameter '{p['name']}' {p['shape']} is not a trainable parameter of the model")
    saved_extra = {a: e for e in manifest["extras"] for a in e["aliases"]}
    for names, kind, t in extra_tensors(engine):
        e = next((saved_extra[n] for n in names if n in saved_extra), None)
        if e is None:
            diffs.append(f"{kind} '{names[0]}' {list(t.shape)} is not in the checkpoint")
        elif e["shape"] != list(t.shape):
            diffs.append(f"{kind} '{names[0]}': shape {list(t.shape)} in the model, {e['shape']} in the checkpoint")
    return diffs, match


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
