"""What every translator shares: its result (``Translation``), renaming a section's keys, and
accepting another library's keys that ask for what zerocore does anyway.

Translators are pure: they read a dict and return a new one (the input is never changed), plus
what the user should be told about it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..options import ConfigError

ANY = object()  # every value is harmless (a performance or logging knob of the other library)


@dataclasses.dataclass(frozen=True)
class Translation:
    """A config in zerocore's own key names, and what translating it found."""

    config: dict
    notes: tuple[str, ...] = ()  # values taken in another meaning than written: one warning
    deprecated: tuple[str, ...] = ()  # old spellings, each "key (use new key)": one warning
    ignored: tuple[str, ...] = ()  # top-level keys accepted although they change nothing: one warning

    def then(self, step: Callable[[dict], "Translation"]) -> "Translation":
        """This translation followed by ``step`` on its config; the findings of both, in order."""
        nxt = step(self.config)
        return Translation(nxt.config, self.notes + nxt.notes, self.deprecated + nxt.deprecated,
                           self.ignored + nxt.ignored)


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def section_at(data: dict, path: str) -> dict | None:
    """The section at dotted ``path`` ("" is ``data``), or None where it is absent or not a JSON
    object (the parser names a section of the wrong type)."""
    node = data
    for part in path.split(".") if path else ():
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def with_section(data: dict, path: str, section: dict) -> dict:
    """A copy of ``data`` with the section at ``path`` replaced (the sections above it copied)."""
    if not path:
        return section
    head, _, rest = path.partition(".")
    return {**data, head: with_section(data[head], rest, section)}


def rename(section: dict, path: str, names: dict[str, str], old: dict[str, str] | None = None,
           deprecated: list[str] | None = None) -> dict:
    """``section`` with each key of ``names`` (another library's spelling) or of ``old`` (a
    deprecated spelling, listed in ``deprecated``) written as zerocore's key, in the given
    order. A key given in two spellings is an error naming both."""
    old = old or {}
    out: dict = {}
    given_as: dict[str, str] = {}
    for key, value in section.items():
        new = names.get(key) or old.get(key) or key
        if new in out:
            raise ConfigError(f"{join(path, new)}: given twice (as {given_as[new]!r} and {key!r}); give one of them")
        if key in old and deprecated is not None:
            deprecated.append(f"{join(path, key)} (use {new})")
        out[new] = value
        given_as[new] = key
    return out


def rename_at(data: dict, path: str, names: dict[str, str], old: dict[str, str] | None = None,
              deprecated: list[str] | None = None) -> dict:
    section = section_at(data, path)
    if section is None:
        return data
    return with_section(data, path, rename(section, path, names, old, deprecated))


def matches(value, allowed) -> bool:
    """``value`` is one of ``allowed`` (True is not 1; an int equals its float)."""
    return any(value == a and type(value) is type(a) or
               (isinstance(a, float) and not isinstance(value, bool) and value == a) for a in allowed)


def refusal(key: str, value, allowed, why: str) -> ConfigError:
    return ConfigError(f"{key}: got {value!r}; zerocore cannot honour it ({why}); allowed: "
                       f"{' or '.join(repr(a) for a in allowed)}, or remove the key")


def drop_accepted(data: dict, table: dict[str, dict[str, tuple]]) -> dict:
    """``data`` without the keys ``table`` lists (section path -> key -> (values zerocore honours,
    what zerocore does)) where they have a value zerocore honours; any other value is an error
    naming the key and why."""
    for path, keys in table.items():
        section = section_at(data, path)
        if section is None or not keys.keys() & section.keys():
            continue
        kept = {}
        for key, value in section.items():
            entry = keys.get(key)
            if entry is None:
                kept[key] = value
                continue
            allowed, why = entry
            if allowed is not ANY and not matches(value, allowed):
                raise refusal(join(path, key), value, allowed, why)
        data = with_section(data, path, kept)
    return data
