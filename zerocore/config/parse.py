"""Reading a config: a dict, a JSON file, or a ZeroConfig, in DeepSpeed's layout or the
ColossalAI form (``zero=dict(type='ZeroRedundancyOptimizer_Level_3', ...)``, translated by
``seed_form.py``).

An unknown key inside a known section is an error (``foreign.py`` lists the other libraries'
keys accepted with a harmless value). Everything else a user might have got wrong is reported
at once: one warning names every accepted unknown top-level key (``foreign.TOP_LEVEL``: those
that change nothing training computes; any other is an error), one every deprecated spelling,
one every value that cannot take effect.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any

from .foreign import check_top_level, check_unknown
from .options import ConfigError, default_of, is_section, spec_of, walk
from .schema import ZeroConfig
from .seed_form import translate


class ConfigWarning(UserWarning):
    """Unknown, deprecated or ineffective config keys (the config is still used)."""


# DeepSpeed's deprecated zero_optimization booleans that became offload sections.
_CPU_OFFLOAD = {
    "cpu_offload": ("offload_optimizer", "device", lambda v: "cpu" if v else "none"),
    "cpu_offload_param": ("offload_param", "device", lambda v: "cpu" if v else "none"),
}


def load_config(config: Any = None) -> ZeroConfig:
    """A ZeroConfig from a dict, a path to a JSON file, a ZeroConfig (returned as is) or None
    (all defaults)."""
    if config is None:
        return ZeroConfig()
    if isinstance(config, ZeroConfig):
        config.validate()  # fields may have been assigned since construction
        return config
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path} is a directory; give the path of a JSON file") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}); give a JSON file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path} is not valid JSON: {e}") from None
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: got a JSON {type(data).__name__}; allowed: a JSON object")
        return from_dict(data)
    if isinstance(config, dict):
        return from_dict(config)
    raise ConfigError(f"config: got a {type(config).__name__}; allowed: a dict, a path to a JSON file, or a "
                      "zerocore.ZeroConfig")


def from_dict(data: dict) -> ZeroConfig:
    unknown: list[str] = []
    deprecated: list[str] = []
    notes: list[str] = []
    given = translate(data, notes)
    cfg = _build(ZeroConfig, given, "", unknown, deprecated)
    cfg.given_sections = frozenset(given)  # which top-level keys the file had (an optimizer section, ...)
    if notes:
        warnings.warn(f"zerocore config: {'; '.join(notes)}", ConfigWarning, stacklevel=3)
    if unknown:
        warnings.warn(f"zerocore config: unknown keys ignored (they change nothing zerocore computes): "
                      f"{', '.join(unknown)}", ConfigWarning, stacklevel=3)
    if deprecated:
        warnings.warn(f"zerocore config: deprecated keys (still accepted): {', '.join(deprecated)}", ConfigWarning,
                      stacklevel=3)
    idle = ineffective(cfg)
    if idle:
        warnings.warn(f"zerocore config: these values have no effect: {'; '.join(idle)}", ConfigWarning, stacklevel=3)
    return cfg


def _build(cls, data: Any, path: str, unknown: list[str], deprecated: list[str]):
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: got {type(data).__name__}; allowed: a JSON object")
    data = dict(data)
    if cls.__name__ == "ZeroOptimizationConfig":
        data = _map_cpu_offload(data, path, deprecated)
    names: dict[str, tuple[dataclasses.Field, bool]] = {}
    for f in dataclasses.fields(cls):
        spec = spec_of(f)
        names[f.name] = (f, False)
        names.update({a: (f, False) for a in spec.aliases})
        names.update({a: (f, True) for a in spec.deprecated})
    kwargs: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else key
        if key not in names:
            if path:  # inside a known section: dropping it would train something else than asked
                check_unknown(path, key, value, [f.name for f in dataclasses.fields(cls)])
            else:  # another subsystem's setting: accepted only where it changes no result
                check_top_level(key, value)
                unknown.append(full)
            continue
        f, old = names[key]
        if old:
            deprecated.append(f"{full} (use {f.name})")
        if f.name in kwargs:
            raise ConfigError(f"{full}: given twice (as {given_as[f.name]!r} and {key!r})")
        given_as[f.name] = key
        sub = f"{path}.{f.name}" if path else f.name
        if is_section(f):
            # null, as DeepSpeed's optional sections allow (offload_optimizer: null): the defaults
            kwargs[f.name] = _build(f.default_factory, {} if value is None else value, sub, unknown, deprecated)
        else:
            kwargs[f.name] = value
    return cls(**kwargs)


def _map_cpu_offload(z: dict, path: str, deprecated: list[str]) -> dict:
    for old, (sec, key, conv) in _CPU_OFFLOAD.items():
        if old in z:
            value = z.pop(old)
            if not isinstance(value, bool):
                raise ConfigError(f"{path}.{old}: got {value!r}; allowed: true or false")
            deprecated.append(f"{path}.{old} (use {path}.{sec}.{key})")
            target = dict(z.get(sec) or z.get(sec + "_config") or {})
            target.setdefault(key, conv(value))
            z.pop(sec + "_config", None)
            z[sec] = target
    if "cpu_offload_use_pin_memory" in z:
        value = z.pop("cpu_offload_use_pin_memory")
        deprecated.append(f"{path}.cpu_offload_use_pin_memory (use {path}.offload_*.pin_memory)")
        for sec in ("offload_optimizer", "offload_param", "offload_optimizer_config", "offload_param_config"):
            if isinstance(z.get(sec), dict):  # null or absent: no offload, nothing to pin
                z[sec] = {**z[sec], "pin_memory": z[sec].get("pin_memory", value)}
    return z


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
    """Settings this config uses whose implementation has not landed yet, each with where it
    will (empty when everything asked for works)."""
    return [f"{key}={json.dumps(value)} needs {spec.pending}" for key, _, spec, value in walk(cfg)
            if spec.pending_if is not None and spec.pending_if(value)]


def require_implemented(cfg: ZeroConfig) -> None:
    """Raises NotImplementedError naming every setting that is not implemented yet."""
    missing = pending_features(cfg)
    if missing:
        raise NotImplementedError("zerocore: not implemented yet: " + "; ".join(missing)
                                  + ". Remove these settings or wait for that work.")
