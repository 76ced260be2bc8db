"""Pieces every integration shares that need no client library: the module a trainer calls in
place of DDP, and reading a config dict or JSON file."""
from __future__ import annotations

import copy
import json
import os

from torch import nn


class EngineModule(nn.Module):
    """What a trainer calls as its wrapped model: forward through the engine (no DDP around it);
    other attributes are the model's."""

    def __init__(self, engine):
        super().__init__()
        self.module = engine.module
        self.__dict__["_zc_engine"] = engine  # not a submodule

    def forward(self, *args, **kwargs):
        return self._zc_engine(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the gradients of a window that has not stepped, as ``zero_grad`` on DDP drops ``.grad``: a trainer
        that starts training again after an error inside a window (Transformers' ``auto_find_batch_size`` retries
        at a smaller batch after an out-of-memory error) would otherwise add them to its first update. After an
        update there is nothing to drop (the engine cleared them) and nothing is zeroed again."""
        engine = self._zc_engine
        reducer = getattr(engine, "reducer", None)
        if reducer is not None and (engine._backward_done or reducer.holds_gradients()):
            engine.zero_grad()

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["module"], name)


def read_config(config) -> dict:
    """A deep copy of a config dict, or the dict in a JSON file (the error names the file)."""
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"zerocore config file {os.fspath(config)!r}: {e}") from e
    if not isinstance(config, dict):
        raise TypeError(f"zerocore config: expected a dict or a JSON path, got {type(config).__name__}")
    return copy.deepcopy(config)
