"""The offline tools: one process, no process group. ``consolidate`` streams a checkpoint's
weights into safetensors (the header first, then each tensor's bytes as it is assembled, in
slices: peak memory is one slice plus I/O buffers, never the model); ``load_full_state_dict``
for small models; ``inspect`` summarises a checkpoint."""
from __future__ import annotations

import contextlib
import json
import os
import re

import torch

from .. import ops
from .block_writer import BlockWriter, FileSink
from .blockio import BLOCK_BYTES, IO_BYTES
from .layout import fsync_dir, locate, read_manifest
from .manifest import dtype_of
from .reader import CheckpointReader

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
_OUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_FP32 = 4


def parse_size(size) -> int:
    """``5GB``, ``500MB``, ``1.5GiB`` or a number of bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(I?)B?\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size: got {size!r}; allowed: a byte count like 5GB, 500MB or 1GiB")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))


@contextlib.contextmanager
def _one_thread():
    """torch's intra-op threads set to one while a tool streams: its casts and copies are
    memory-bound and the other cores serve the I/O, and an OpenMP team that waits between
    pieces burns CPU. Measured (fresh process, 100M-parameter checkpoint, 2 cores): consolidating to
    bf16 took 0.37-0.42 CPU-s with two threads and 0.16-0.20 with one, in the same or less time;
    load_full_state_dict 0.45-0.58 against 0.29-0.34."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _entries(manifest: dict, dtype: torch.dtype) -> list[dict]:
    """Every tensor consolidation writes: trainable parameters once (first name), then frozen
    parameters and buffers; floating tensors in ``dtype``."""
    out = []
    for p in manifest["params"]:
        out.append({"name": p["name"], "aliases": p["aliases"], "shape": p["shape"], "dtype": dtype, "param": p})
    for e in manifest["extras"]:
        src = dtype_of(e["dtype"])
        out.append({"name": e["name"], "aliases": e["aliases"], "shape": e["shape"],
                    "dtype": dtype if src.is_floating_point else src, "extra": e})
    for x in out:
        n = 1
        for d in x["shape"]:
            n *= d
        x["numel"] = n
        x["nbytes"] = n * x["dtype"].itemsize
    return out


def _write_tensors(reader: CheckpointReader, entries: list[dict], w: BlockWriter, io_bytes: int) -> None:
    """Appends every entry's bytes to ``w`` in order: the parameters' masters stream through
    (several reads in flight while each verified piece is converted and copied into the
    writer's buffers: the only copy on the way, with the output's checksum in the same pass);
    frozen parameters and buffers are read whole."""
    params = [x for x in entries if "param" in x]
    if params:
        dtype = params[0]["dtype"]
        conv = None if dtype == torch.float32 else torch.empty(io_bytes // _FP32, dtype=dtype)
        for piece in reader.stream_masters([x["name"] for x in params], piece_bytes=io_bytes):
            src = piece.view(torch.float32)
            if conv is not None and conv.numel() < src.numel():  # a checkpoint's blocks larger than io_bytes
                conv = torch.empty(src.numel(), dtype=dtype)
            # the project's cast kernel: torch's rounding (nearest even), several times its speed
            w.write(src if conv is None else ops.cast(src, conv[:src.numel()]))
    for x in entries:
        if "extra" in x:
            w.write(reader.read_extra(x["extra"]).to(x["dtype"]))


def _shard_plan(entries: list[dict], max_bytes: int) -> list[list[dict]]:
    shards, size = [[]], 0
    for x in entries:
        if shards[-1] and size + x["nbytes"] > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(x)
        size += x["nbytes"]
    return shards


def _write_safetensors(path: str, reader: CheckpointReader, entries: list[dict], metadata: dict) -> None:
    header, off = {"__metadata__": metadata}, 0
    for x in entries:
        header[x["name"]] = {"dtype": _ST_DTYPES[x["dtype"]], "shape": x["shape"], "data_offsets": [off, off + x["nbytes"]]}
        off += x["nbytes"]
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        if os.path.exists(tmp):
            os.remove(tmp)
        # the output streams through the checkpoint's own writer: aligned buffers, O_DIRECT,
        # several writes in flight (its block checksums are not needed here and cost little).
        # Memory, scaled to the largest tensor L (peak growth under 2 L): I/O buffers of L / 4 up
        # to IO_BYTES (three reads and two writes in flight, a conversion buffer), at least one
        # checksum block each.
        largest = max([x["numel"] for x in entries if "param" in x], default=1)
        io_bytes = min(IO_BYTES, max(BLOCK_BYTES, largest * 4 // 4 // BLOCK_BYTES * BLOCK_BYTES))
        w = BlockWriter(FileSink(tmp, reader.aio, ring=2), io_bytes=io_bytes)
        try:
            w.write_bytes(len(head).to_bytes(8, "little") + head)
            _write_tensors(reader, entries, w, io_bytes)
            w.close()  # fsync'ed
        except BaseException:
            w.abort()
            raise
        os.replace(tmp, path)  # a crash leaves no half file under the real name
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def consolidate(ckpt_dir: str, out: str, *, tag: str | None = None, dtype: str = "fp32",
                max_shard_size="5GB") -> list[str]:
    """Writes the checkpoint's weights (from the fp32 master; frozen parameters and buffers too)
    as safetensors under the model's own names, a tied weight once under its first name. More
    than ``max_shard_size`` bytes: ``<out stem>-0000i-of-0000n.safetensors`` files plus
    ``<out>.index.json`` (Hugging Face's layout). Returns the files written."""
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype: got {dtype!r}; allowed: {', '.join(_OUT_DTYPES)}")
    path = locate(os.fspath(ckpt_dir), tag)
    manifest = read_manifest(path)
    entries = _entries(manifest, _OUT_DTYPES[dtype])
    shards = _shard_plan(entries, parse_size(max_shard_size))
    out = os.fspath(out)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    meta = {"format": "pt", "zerocore_tag": manifest["tag"]}
    written = []
    with _one_thread(), CheckpointReader(path, manifest, {}) as reader:  # the default aio settings: O_DIRECT
        if len(shards) == 1:
            _write_safetensors(out, reader, shards[0], meta)
            written.append(out)
        else:
            stem = out.removesuffix(".safetensors")
            weight_map = {}
            for i, group in enumerate(shards):
                name = f"{os.path.basename(stem)}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                _write_safetensors(os.path.join(os.path.dirname(os.path.abspath(out)), name), reader, group, meta)
                written.append(os.path.join(os.path.dirname(os.path.abspath(out)), name))
                weight_map.update({x["name"]: name for x in group})
            index = {"metadata": {"total_size": sum(x["nbytes"] for x in entries)}, "weight_map": weight_map}
            with open(out + ".index.json", "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            written.append(out + ".index.json")
    fsync_dir(os.path.dirname(os.path.abspath(out)))
    return written


def load_full_state_dict(ckpt_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The model's full fp32 state dict from a checkpoint (every name of a tied weight, frozen
    parameters and buffers too), as ``engine.full_state_dict()`` gives. Holds the whole model:
    for big models use :func:`consolidate`."""
    path = locate(os.fspath(ckpt_dir), tag)
    manifest = read_manifest(path)
    out = {}
    entries = _entries(manifest, torch.float32)
    with _one_thread(), CheckpointReader(path, manifest, {}) as reader:
        params = [x for x in entries if "param" in x]
        flats = [torch.empty(x["numel"], dtype=torch.float32) for x in params]
        # every master streams (several reads in flight) into its tensor, one copy per byte
        dst, pos = iter(zip(params, flats)), 0
        x, flat = next(dst, (None, None))
        for piece in reader.stream_masters([p["name"] for p in params]):
            src = piece.view(torch.float32)
            while src.numel():
                while pos == flat.numel():
                    x, flat = next(dst)
                    pos = 0
                k = min(src.numel(), flat.numel() - pos)
                flat[pos:pos + k].copy_(src[:k])
                pos, src = pos + k, src[k:]
        for x, flat in zip(params, flats):
            t = flat.view(x["shape"])  # one object for every name of a tied weight, as DeepSpeed's
            for a in x["aliases"]:
                out[a] = t
        for x in entries:
            if "extra" in x:
                t = reader.read_extra(x["extra"]).to(x["dtype"])
                for a in x["aliases"]:
                    out[a] = t
    return out


def inspect(ckpt_dir: str, tag: str | None = None) -> dict:
    """What a checkpoint holds: world size, stage, dtype, steps, parameters, bytes."""
    path = locate(os.fspath(ckpt_dir), tag)
    m = read_manifest(path)
    params = sum(_entries(m, torch.float32)[i]["numel"] for i in range(len(m["params"])))
    return {"path": path, "tag": m["tag"], "format_version": m["version"], "world_size": m["world_size"],
            "stage": m["stage"], "dtype": m["dtype"], **m["counters"], "lr": m["hyper"]["lr"],
            "loss_scale": m["scaler"].get("scale"), "parameters": len(m["params"]), "trainable_elements": params,
            "frozen_and_buffers": len(m["extras"]), "files": len(m["files"]),
            "bytes": sum(f["bytes"] for f in m["files"].values()),
            "client_state": m["client_state"] is not None}
