"""Reading a config: a dict, a JSON file, or a ZeroConfig. A dict (DeepSpeed's layout or
ColossalAI's form) is first written in zerocore's own key names by ``compat.to_canonical``, the
one place that knows other libraries' spellings; then every section is built and validated by
the schema.

An unknown key inside a known section is an error naming the nearest known spelling (``compat``
drops the other libraries' keys whose value changes nothing, and refuses the others). Everything
else a user might have got wrong is reported at once: one warning names every accepted unknown
top-level key, one every deprecated spelling, one every value taken in another meaning than
written, one every value that cannot take effect.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import warnings
from typing import Any

from .compat import to_canonical
from .options import ConfigError, default_of, is_section, walk
from .schema import ZeroConfig


class ConfigWarning(UserWarning):
    """Unknown, deprecated or ineffective config keys (the config is still used)."""


def load_config(config: Any = None) -> ZeroConfig:
    """A ZeroConfig from a dict, a path to a JSON file, a ZeroConfig (returned as is) or None
    (all defaults)."""
    if config is None:
        return ZeroConfig()
    if isinstance(config, ZeroConfig):
        config.validate()  # fields may have been assigned since construction
        return config
    if isinstance(config, (str, os.PathLike)):
        return from_dict(read_config_file(os.fspath(config)))
    if isinstance(config, dict):
        return from_dict(config)
    raise ConfigError(f"config: got a {type(config).__name__}; allowed: a dict, a path to a JSON file, or a "
                      "zerocore.ZeroConfig")


def read_config_file(path: str) -> dict:
    """The JSON (or, with ``hjson`` installed, HJSON) object in the file at ``path``. A key given twice in one
    object is refused, naming it (``json`` would keep the last silently; DeepSpeed refuses it too)."""
    def unique(pairs: list) -> dict:
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise ConfigError(f"config file {path}: key {key!r} is given twice in one object; give it once")
            seen[key] = value
        return seen

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f, object_pairs_hook=unique)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; give the path of a JSON file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}); give a JSON file") from None
    except json.JSONDecodeError as e:
        data = _read_hjson(path, e, unique)
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: got a JSON {type(data).__name__}; allowed: a JSON object")
    return data


def _read_hjson(path: str, json_error: json.JSONDecodeError, pairs_hook):
    """DeepSpeed reads its config files as HJSON (JSON with comments, unquoted keys and trailing commas): so
    does zerocore where the ``hjson`` package is installed (DeepSpeed depends on it); without it the JSON error
    says so."""
    try:
        import hjson
    except ImportError:
        raise ConfigError(f"config file {path} is not valid JSON: {json_error} (DeepSpeed also reads HJSON config "
                          "files: pip install hjson for zerocore to read them too)") from None
    try:
        with open(path, encoding="utf-8") as f:
            return hjson.load(f, object_pairs_hook=pairs_hook)
    except hjson.HjsonDecodeError as e:
        raise ConfigError(f"config file {path} is neither JSON ({json_error}) nor HJSON ({e})") from None


def from_dict(data: dict) -> ZeroConfig:
    t = to_canonical(data)
    cfg = _build(ZeroConfig, t.config, "")
    cfg.given_sections = frozenset(t.config)  # which sections the file had (an optimizer section, ...)
    if t.notes:
        warnings.warn(f"zerocore config: {'; '.join(t.notes)}", ConfigWarning, stacklevel=3)
    if t.ignored:
        warnings.warn(f"zerocore config: unknown keys ignored (they change nothing zerocore computes): "
                      f"{', '.join(t.ignored)}", ConfigWarning, stacklevel=3)
    if t.deprecated:
        warnings.warn(f"zerocore config: deprecated keys (still accepted): {', '.join(t.deprecated)}",
                      ConfigWarning, stacklevel=3)
    idle = ineffective(cfg)
    if idle:
        warnings.warn(f"zerocore config: these values have no effect: {'; '.join(idle)}", ConfigWarning, stacklevel=3)
    return cfg


def _build(cls, data: Any, path: str):
    """The schema section ``cls`` from ``data`` (in zerocore's key names), validated."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: got {type(data).__name__}; allowed: a JSON object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        f = fields.get(key)
        full = f"{path}.{key}" if path else key
        if f is None:
            near = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{full}: unknown key{hint}; {path or 'the config'} has: {', '.join(fields)}")
        if is_section(f):
            # null, as DeepSpeed's optional sections allow (offload_optimizer: null): the defaults
            kwargs[key] = _build(f.default_factory, {} if value is None else value, full)
        else:
            kwargs[key] = value
    return cls(**kwargs)


def ineffective(cfg: ZeroConfig) -> list[str]:
    """Non-default values that change nothing in this config, with the reason."""
    out = []
    for key, f, spec, value in walk(cfg):
        if value == default_of(f):
            continue
        if spec.no_effect:
            out.append(f"{key}={json.dumps(value)} ({spec.no_effect})")
        elif spec.applies_if is not None and not spec.applies_if(cfg):
            out.append(f"{key}={json.dumps(value)} (applies only with {spec.applies})")
    return out


def pending_features(cfg: ZeroConfig) -> list[str]:
    """Settings this config uses that zerocore validates but does not implement yet, each with
    what they need (empty when everything asked for works)."""
    return [f"{key}={json.dumps(value)} needs {spec.pending}" for key, _, spec, value in walk(cfg)
            if spec.pending_if is not None and spec.pending_if(value)]


def require_implemented(cfg: ZeroConfig) -> None:
    """Raises NotImplementedError naming every setting that is not implemented yet."""
    missing = pending_features(cfg)
    if missing:
        raise NotImplementedError("zerocore: not implemented yet: " + "; ".join(missing)
                                  + ". Remove these settings or wait for that work.")
