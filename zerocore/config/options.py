"""How one config key is declared: its default, type, allowed values and documentation live
in one place (dataclass field metadata), so the parser, the validator and the generated docs
table all read the same facts and cannot drift apart."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any


class ConfigError(ValueError):
    """A config value has the wrong type or is out of range; the message names the key."""


@dataclasses.dataclass(frozen=True)
class Spec:
    """What the schema knows about one key."""

    doc: str
    kind: type | None = None  # bool, int, float, str, list; None for a nested section
    choices: tuple | None = None  # allowed values (str keys are matched case-insensitively)
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    optional: bool = False  # None (JSON null) allowed
    # Other libraries' spellings of a key are not declared here: ``compat`` maps them.
    # A predicate on the value telling whether this config *uses* a feature that zerocore
    # validates but does not implement yet, and what that feature is (named in the error).
    pending_if: Callable[[Any], bool] | None = None
    pending: str = ""
    # Accepted for compatibility but changes nothing in zerocore: setting a non-default value
    # warns with this reason instead of being silently ignored.
    no_effect: str = ""
    # Only meaningful with another setting (e.g. stage 3): a predicate on the whole config and
    # the reason, used to warn when a non-default value cannot take effect.
    applies_if: Callable[[Any], bool] | None = None
    applies: str = ""
    allowed: str = ""  # overrides the generated description of allowed values
    # "auto" is one of this key's own values (DeepSpeed's data_types.keep_in_fp32_modules), not the
    # Hugging Face integration's placeholder that is refused for every other non-string key
    auto_is_value: bool = False
    one_is_list: bool = False  # (kind list) a single string is a list of one (DeepSpeed's leaf_module lists)
    # (kind float) a string holding a number is that number: DeepSpeed's validator of this key calls float() on
    # it (fp16.loss_scale), so a config that trains there must read the same here
    number_in_string: bool = False


def option(default, doc: str, **spec) -> Any:
    """A schema field with its default and its :class:`Spec`."""
    s = Spec(doc=doc, **spec)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata={"spec": s})
    return dataclasses.field(default=default, metadata={"spec": s})


def section(cls, doc: str, **spec) -> Any:
    """A nested config section (another schema dataclass)."""
    return dataclasses.field(default_factory=cls, metadata={"spec": Spec(doc=doc, **spec)})


def spec_of(field: dataclasses.Field) -> Spec:
    return field.metadata["spec"]


def is_section(field: dataclasses.Field) -> bool:
    return isinstance(field.default_factory, type) and dataclasses.is_dataclass(field.default_factory)


def _allowed(spec: Spec) -> str:
    if spec.allowed:
        return spec.allowed
    if spec.choices is not None:
        text = ", ".join(repr(c) for c in spec.choices)
    else:
        text = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
                list: "a list", dict: "an object"}.get(spec.kind, str(spec.kind))
        bounds = []
        if spec.ge is not None:
            bounds.append(f">= {spec.ge:g}")
        if spec.gt is not None:
            bounds.append(f"> {spec.gt:g}")
        if spec.le is not None:
            bounds.append(f"<= {spec.le:g}")
        if bounds:
            text += " " + " and ".join(bounds)
    return text + (" or null" if spec.optional else "")


def allowed_text(spec: Spec) -> str:
    """Human-readable description of the values a key accepts (used in errors and docs)."""
    return _allowed(spec)


def coerce(key: str, value: Any, spec: Spec) -> Any:
    """Checks and normalises one value; raises ConfigError naming ``key`` and what is allowed."""

    def bad(why: str = "", must: str = ""):
        got = repr(value)
        if isinstance(value, str) and spec.kind is not str:
            got = f"the string {value!r}"  # '3' and 3 print alike in a message: say which it was
        elif type(value) not in (int, float, bool, str, type(None)):
            got = f"{got} (a {type(value).__name__})"
        lead = f"{key} {must}" if must else key  # "must be a number" where the value is not one at all
        return ConfigError(f"{lead}: got {got}{' (' + why + ')' if why else ''}; allowed: {_allowed(spec)}")

    if value is None:
        if spec.optional:
            return None
        raise bad()
    if isinstance(value, str) and value.strip().lower() == "auto" and spec.kind is not str and \
            not spec.auto_is_value:
        raise ConfigError(f"{key}: 'auto' is a placeholder that the Hugging Face integration fills in; give a "
                          f"value ({_allowed(spec)})")
    kind = spec.kind
    if kind is bool:
        if not isinstance(value, bool):
            raise bad()
    elif kind is int:
        # JSON users write sizes as 5e8; accept floats with an integral value.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        if isinstance(value, float):
            if not math.isfinite(value) or value != int(value):
                raise bad("not an integer")
        if abs(value) >= 2**63:
            raise bad("too large")
        value = int(value)
    elif kind is float:
        if spec.number_in_string and isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise bad(must="must be a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(must="must be a number")
        value = float(value)
        if not math.isfinite(value):
            raise bad("not finite")
    elif kind is str:
        if not isinstance(value, str):
            raise bad()
    elif kind is list:
        if spec.one_is_list and isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise bad()
        value = list(value)
    elif kind is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise bad()
        value = dict(value)
    if spec.choices is not None:
        if isinstance(value, str):
            match = [c for c in spec.choices if isinstance(c, str) and c.lower() == value.lower()]
            if not match:
                raise bad()
            value = match[0]
        elif value not in spec.choices:
            raise bad()
    if spec.ge is not None and value < spec.ge:
        raise bad()
    if spec.gt is not None and value <= spec.gt:
        raise bad()
    if spec.le is not None and value > spec.le:
        raise bad()
    return value


def walk(obj, prefix: str = ""):
    """Yields (dotted key, field, spec, value) for every scalar key of a schema instance (or of
    a schema class, with the defaults as values), depth first in declaration order."""
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if is_section(f):
            yield from walk(getattr(obj, f.name) if not isinstance(obj, type) else f.default_factory, key)
        else:
            value = getattr(obj, f.name) if not isinstance(obj, type) else default_of(f)
            yield key, f, spec_of(f), value


def default_of(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default
