"""Reads parameters' element ranges out of a checkpoint, in the parameters' own coordinates,
touching only the bytes of the saved chunks that overlap the range (plus the checksum blocks
around them). Used by ``load_checkpoint`` (each rank fetches what it now owns, all of it verified
before any of it is used) and by the offline tools (consolidation reads a slice at a time)."""
from __future__ import annotations

import bisect
import io
import os

import torch

from .blockio import HANDLES, IO_BYTES, RING, BlockFile, Fetch, aio_handles, read_into, stream
from .layout import CheckpointError
from .manifest import KINDS, dtype_of, extra_chunks

_FP32 = 4


class CheckpointReader:
    def __init__(self, path: str, manifest: dict, aio: dict | None = None):
        """``aio``: AsyncIO settings (the config's ``aio`` section) for O_DIRECT reads; None:
        the page cache."""
        self.path = path
        self.aio = aio
        self.manifest = manifest
        self.params = {p["name"]: p for p in manifest["params"]}
        # per parameter: chunks sorted by start, and their starts for bisection
        self.chunks = {name: sorted(cs) for name, cs in manifest["chunks"].items()}
        self._starts = {name: [c[0] for c in cs] for name, cs in self.chunks.items()}
        # every file's presence and size, before any byte is used
        self.files = {name: BlockFile(os.path.join(path, name), rec) for name, rec in manifest["files"].items()}
        self._handles: list | None = None

    def check_complete(self, names) -> None:
        """Every element of every parameter in ``names`` is in some saved chunk (checked before a
        load reads anything)."""
        for name in names:
            n, pos = _numel(self.params[name]["shape"]), 0
            for c in self.chunks.get(name, []):
                if c[0] > pos:
                    break
                pos = max(pos, c[1])
            if pos < n:
                raise CheckpointError(f"zerocore checkpoint: {self.path}: no saved chunk holds element {pos} of "
                                      f"'{name}'; the manifest is incomplete")

    def close(self) -> None:
        if self._handles is not None:
            HANDLES.give(self.aio, self._handles)
        self._handles = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def read_into(self, targets: list[tuple[str, int, torch.Tensor]]) -> None:
        """Each (file, byte offset, uint8 tensor) filled with the file's verified bytes, in place
        where its memory lines up with the file's pages (``blockio.read_into``)."""
        if self._handles is None:
            self._handles = aio_handles(self.aio, RING)
        read_into(self.files, self._handles, targets)

    def fetch(self, **kw) -> Fetch:
        if self._handles is None:  # made once per reader: each has its own worker threads
            self._handles = aio_handles(self.aio, RING)
        return Fetch(self.files, self._handles, **kw)

    def _file(self, name: str) -> str:
        if name not in self.files:
            raise CheckpointError(f"zerocore checkpoint: {self.path}: the manifest refers to file {name!r} "
                                  "but does not record it")
        return name

    def ranges(self, name: str, start: int, stop: int, kind: str) -> list[tuple[int, int, str, int]]:
        """Where elements [start, stop) of parameter ``name``'s flattened ``kind`` (master /
        exp_avg / exp_avg_sq, or a client optimizer's kinds as the manifest lists them) are: (first element, elements, file, byte offset) pieces."""
        k = 3 + self.manifest.get("kinds", KINDS).index(kind)
        chunks, starts = self.chunks.get(name, []), self._starts.get(name, [])
        out, pos = [], start
        i = max(0, bisect.bisect_right(starts, start) - 1)
        while pos < stop:
            if i >= len(chunks) or chunks[i][0] > pos or chunks[i][1] <= pos:
                raise CheckpointError(f"zerocore checkpoint: {self.path}: no saved chunk holds element {pos} of "
                                      f"'{name}' ({kind}); the manifest is incomplete")
            c = chunks[i]
            end = min(stop, c[1])
            out.append((pos, end - pos, self._file(c[2]), c[k] + (pos - c[0]) * _FP32))
            pos = end
            i += 1
        return out

    def read_param(self, name: str, start: int, stop: int, kind: str, out: torch.Tensor,
                   piece_bytes: int = IO_BYTES) -> None:
        """Fills ``out`` (fp32, contiguous, on CPU, ``stop - start`` elements) with elements
        [start, stop) of parameter ``name``'s flattened ``kind``, verified; ``piece_bytes`` at a
        time (it holds at most two buffers of that size)."""
        step = max(1, piece_bytes // _FP32)
        for lo in range(start, stop, step):
            hi = min(stop, lo + step)
            pieces = self.ranges(name, lo, hi, kind)
            f = self.fetch(piece_bytes=piece_bytes)
            try:
                for _, n, file, off in pieces:
                    f.add(file, off, n * _FP32)
                f.run()
                for a, n, file, off in pieces:
                    f.copy_into(file, off, out[a - start:a - start + n])
            finally:
                f.release()

    def stream_masters(self, names: list[str], piece_bytes: int = IO_BYTES):
        """The fp32 masters of parameters ``names``, whole, one after the other, as verified
        byte views in order (see ``blockio.stream``: several reads in flight while the caller
        uses each view; a view is valid until the next is asked for)."""
        if self._handles is None:
            self._handles = aio_handles(self.aio, RING)
        ranges = []
        for name in names:
            ranges.extend((file, off, n * _FP32)
                          for _, n, file, off in self.ranges(name, 0, _numel(self.params[name]["shape"]), "master"))
        return stream(self.files, self._handles, ranges, piece_bytes)

    def read_master(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        n = self.params[name]
        stop = _numel(n["shape"]) if stop is None else stop
        out = torch.empty(stop - start, dtype=torch.float32)
        self.read_param(name, start, stop, "master", out)
        return out

    def extra_pieces(self, entry: dict, start: int, stop: int) -> list[tuple[int, int, str, int]]:
        """Where elements [start, stop) of a frozen parameter or buffer (``entry`` of the manifest's
        extras, whole or in chunks) are: (first element, elements, file, byte offset) pieces."""
        size = dtype_of(entry["dtype"]).itemsize
        out, pos = [], start
        for a, b, file, off in sorted(extra_chunks(entry)):
            if pos >= stop:
                break
            if b <= pos:
                continue
            if a > pos:
                break
            end = min(stop, b)
            out.append((pos, end - pos, self._file(file), off + (pos - a) * size))
            pos = end
        if pos < stop:
            raise CheckpointError(f"zerocore checkpoint: {self.path}: no saved chunk holds element {pos} of "
                                  f"'{entry['name']}' ({entry['kind']}); the manifest is incomplete")
        return out

    def add_extra(self, fetch: Fetch, entry: dict, start: int = 0, stop: int | None = None) -> None:
        """Asks ``fetch`` for elements [start, stop) (all by default) of a frozen parameter or buffer."""
        size = dtype_of(entry["dtype"]).itemsize
        for _, n, file, off in self.extra_pieces(entry, start, _numel(entry["shape"]) if stop is None else stop):
            fetch.add(file, off, n * size)

    def extra_from(self, fetch: Fetch, entry: dict, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """A frozen parameter or buffer in its saved dtype (out of a run fetch): whole, in its shape,
        or elements [start, stop) of it flattened."""
        dtype = dtype_of(entry["dtype"])
        whole = stop is None
        stop = _numel(entry["shape"]) if whole else stop
        pieces = self.extra_pieces(entry, start, stop)
        if len(pieces) == 1:
            t = fetch.tensor(pieces[0][2], pieces[0][3], (stop - start) * dtype.itemsize, dtype)
        else:
            t = torch.empty(stop - start, dtype=dtype)
            for x, n, file, off in pieces:
                t[x - start:x - start + n] = fetch.tensor(file, off, n * dtype.itemsize, dtype)
        return t.reshape(entry["shape"]) if whole else t

    def read_extra(self, entry: dict) -> torch.Tensor:
        f = self.fetch()
        try:
            self.add_extra(f, entry)
            f.run()
            return self.extra_from(f, entry)
        finally:
            f.release()

    def add_client_state(self, fetch: Fetch) -> None:
        rec = self.manifest.get("client_state")
        if rec is not None:
            fetch.add(self._file(rec["file"]), rec["offset"], rec["nbytes"])

    def client_state_from(self, fetch: Fetch):
        rec = self.manifest.get("client_state")
        if rec is None:
            return {}
        data = fetch.tensor(rec["file"], rec["offset"], rec["nbytes"], torch.uint8)
        # the user's own pickled objects (DeepSpeed's client_state is arbitrary too)
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)

    def read_client_state(self):
        f = self.fetch()
        try:
            self.add_client_state(f)
            f.run()
            return self.client_state_from(f)
        finally:
            f.release()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
