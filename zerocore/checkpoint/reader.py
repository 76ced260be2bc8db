"""Reads parameters' element ranges out of a checkpoint, in the parameters' own coordinates,
touching only the bytes of the saved chunks that overlap the range (plus the checksum blocks
around them). Used by ``load_checkpoint`` (each rank reads what it now owns) and by the offline
tools (consolidation reads one parameter at a time)."""
from __future__ import annotations

import bisect
import io
import os

import torch

from .blockio import BlockReader, byte_view
from .layout import CheckpointError
from .manifest import KINDS, dtype_of

_FP32 = 4


class CheckpointReader:
    def __init__(self, path: str, manifest: dict, aio=None):
        """``aio``: a :class:`zerocore.ops.AsyncIO` for the large reads (None: the page cache)."""
        self.path = path
        self._aio = aio
        self.manifest = manifest
        self.params = {p["name"]: p for p in manifest["params"]}
        # per parameter: chunks sorted by start, and their starts for bisection
        self.chunks = {name: sorted(cs) for name, cs in manifest["chunks"].items()}
        self._starts = {name: [c[0] for c in cs] for name, cs in self.chunks.items()}
        self._files: dict[str, BlockReader] = {}
        for name in manifest["files"]:  # every file's presence and size, before any byte is used
            self._open(name)

    def check_complete(self, names) -> None:
        """Every element of every parameter in ``names`` is in some saved chunk (checked before a
        load writes anything)."""
        for name in names:
            n, pos = _numel(self.params[name]["shape"]), 0
            for c in self.chunks.get(name, []):
                if c[0] > pos:
                    break
                pos = max(pos, c[1])
            if pos < n:
                raise CheckpointError(f"zerocore checkpoint: {self.path}: no saved chunk holds element {pos} of "
                                      f"'{name}'; the manifest is incomplete")

    def _open(self, name: str) -> BlockReader:
        r = self._files.get(name)
        if r is None:
            if name not in self.manifest["files"]:
                raise CheckpointError(f"zerocore checkpoint: {self.path}: the manifest refers to file {name!r} "
                                      "but does not record it")
            r = self._files[name] = BlockReader(os.path.join(self.path, name), self.manifest["files"][name],
                                                      self._aio)
        return r

    def close(self) -> None:
        for r in self._files.values():
            r.close()
        self._files.clear()
        if self._aio is not None:
            self._aio.close()
            self._aio = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def read_param(self, name: str, start: int, stop: int, kind: str, out: torch.Tensor) -> None:
        """Fills ``out`` (fp32, contiguous, on CPU, ``stop - start`` elements) with elements
        [start, stop) of parameter ``name``'s flattened ``kind`` (master / exp_avg / exp_avg_sq)."""
        k = 3 + self.manifest.get("kinds", KINDS).index(kind)
        chunks, starts = self.chunks.get(name, []), self._starts.get(name, [])
        dst = byte_view(out)
        pos = start
        i = max(0, bisect.bisect_right(starts, start) - 1)
        while pos < stop:
            if i >= len(chunks) or chunks[i][0] > pos or chunks[i][1] <= pos:
                raise CheckpointError(f"zerocore checkpoint: {self.path}: no saved chunk holds element {pos} of "
                                      f"'{name}' ({kind}); the manifest is incomplete")
            c = chunks[i]
            end = min(stop, c[1])
            self._open(c[2]).read_into(dst[(pos - start) * _FP32:(end - start) * _FP32],
                                       c[k] + (pos - c[0]) * _FP32)
            pos = end
            i += 1

    def read_master(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        n = self.params[name]
        stop = _numel(n["shape"]) if stop is None else stop
        out = torch.empty(stop - start, dtype=torch.float32)
        self.read_param(name, start, stop, "master", out)
        return out

    def read_extra(self, entry: dict) -> torch.Tensor:
        """A frozen parameter or buffer, whole, in its saved dtype."""
        buf = bytearray(entry["nbytes"])
        self._open(entry["file"]).read_into(buf, entry["offset"])
        t = torch.frombuffer(buf, dtype=dtype_of(entry["dtype"])) if buf else torch.empty(
            0, dtype=dtype_of(entry["dtype"]))
        return t.reshape(entry["shape"])

    def read_client_state(self):
        rec = self.manifest.get("client_state")
        if rec is None:
            return {}
        buf = bytearray(rec["nbytes"])
        self._open(rec["file"]).read_into(buf, rec["offset"])
        # the user's own pickled objects (DeepSpeed's client_state is arbitrary too)
        return torch.load(io.BytesIO(bytes(buf)), weights_only=False)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
