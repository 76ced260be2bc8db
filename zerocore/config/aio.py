"""The ``aio`` config section -> :class:`zerocore.ops.AsyncIO` arguments.

DeepSpeed's ``aio {block_size, queue_depth, intra_op_parallelism (thread_count), single_submit,
overlap_events}`` plus zerocore's ``backend`` and ``direct``. Torch-free: NVMe offload and the
checkpoint writer turn the validated ``AioConfig`` into handle arguments here; ``ops.aio`` keeps
only the engine (and re-exports :func:`config_to_kwargs` for ``AsyncIO.from_config``).
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping

# Every backend name AsyncIO takes. 'auto': the first of ops.aio.AUTO_ORDER usable here.
BACKENDS = ("auto", "libaio", "io_uring", "threadpool")
DIRECT_MODES = ("auto", "require", "off")

# DeepSpeed's `aio` config section (defaults from its code) -> AsyncIO arguments.
CONFIG_DEFAULTS = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                   "overlap_events": True}
_CONFIG_KEYS = set(CONFIG_DEFAULTS) | {"thread_count", "backend", "direct"}


def int_arg(name: str, value, low: int, high: int) -> int:
    """``value`` as an int in [low, high] (an integral float is taken), else TypeError/ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")
    return value


def bool_arg(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {type(value).__name__} {value!r}")
    return value


def config_to_kwargs(config: Mapping | None = None, **overrides) -> dict:
    """DeepSpeed ``aio`` section (or a whole config with an ``aio`` key) -> AsyncIO keyword
    arguments. Missing keys take DeepSpeed's defaults; unknown keys are named in a warning;
    wrong values raise an error naming the config key."""
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise TypeError(f"aio config must be a mapping, got {type(config).__name__}")
    if isinstance(config.get("aio"), Mapping):  # a whole DeepSpeed config
        config = config["aio"]
    section = {**config, **overrides}
    unknown = sorted(set(section) - _CONFIG_KEYS)
    if unknown:
        warnings.warn(f"aio config: unknown key(s) {', '.join(unknown)} ignored "
                      f"(known: {', '.join(sorted(_CONFIG_KEYS))})", stacklevel=3)
    threads = section.get("intra_op_parallelism")
    alias = section.get("thread_count")
    if threads is not None and alias is not None and threads != alias:
        raise ValueError(f"aio config: intra_op_parallelism={threads!r} and its alias thread_count={alias!r} disagree")
    threads = threads if threads is not None else alias if alias is not None else CONFIG_DEFAULTS["intra_op_parallelism"]
    out = {"block_size": section.get("block_size", CONFIG_DEFAULTS["block_size"]),
           "queue_depth": section.get("queue_depth", CONFIG_DEFAULTS["queue_depth"]),
           "threads": threads,
           "single_submit": section.get("single_submit", CONFIG_DEFAULTS["single_submit"]),
           "overlap_events": section.get("overlap_events", CONFIG_DEFAULTS["overlap_events"])}
    for key in ("backend", "direct"):
        if key in section:
            out[key] = section[key]
    # Errors name the config key, not the argument.
    names = {"threads": "intra_op_parallelism" if section.get("intra_op_parallelism") is not None else "thread_count"}
    for key, value in out.items():
        try:
            if key in ("block_size", "queue_depth", "threads"):
                int_arg(names.get(key, key), value, 1, 1 << 30)
            elif key in ("single_submit", "overlap_events"):
                bool_arg(key, value)
            elif key == "backend" and value not in BACKENDS:
                raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {value!r}")
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"aio config: {exc}") from None
    return out


def aio_settings(aio_config) -> dict:
    """The validated ``AioConfig`` section as the mapping :func:`config_to_kwargs` reads (every
    key, the backend included), for the NVMe swap store and the checkpoint writer."""
    return dataclasses.asdict(aio_config)
