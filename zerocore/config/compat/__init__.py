"""Other libraries' config forms -> zerocore's canonical dict (the schema's own key names), in
one place: ``load_config`` calls :func:`to_canonical` once, before the schema validates.

colossalai.py   ColossalAI 0.0.x's ``zero=dict(type='ZeroRedundancyOptimizer_Level_3', ...)`` form
deepspeed.py    DeepSpeed's other and deprecated spellings, and its keys zerocore has no field for
translation.py  what both share: the result, renaming keys, accepting harmless foreign keys

The translators run in that order (ColossalAI's form may carry DeepSpeed's keys, as ColossalAI
passed them on to DeepSpeed); each is a pure function of a dict.
"""
from __future__ import annotations

from . import colossalai, deepspeed
from .translation import ANY, Translation

__all__ = ["ANY", "Translation", "to_canonical", "other_spellings", "accepted_keys", "top_level_keys"]


def to_canonical(data: dict) -> Translation:
    """``data`` (DeepSpeed's layout or ColossalAI's form) in zerocore's key names, with what to
    tell the user (notes, deprecated spellings, top-level keys ignored)."""
    return Translation(dict(data)).then(colossalai.translate).then(deepspeed.translate)


def other_spellings() -> dict[str, list[tuple[str, str]]]:
    """Dotted zerocore key -> the other spellings accepted for it, each as (spelling, whose: e.g.
    "DeepSpeed, deprecated"), for the generated docs."""
    out: dict[str, list[tuple[str, str]]] = {}
    for table, label in ((colossalai.ALIASES, "ColossalAI"), (deepspeed.ALIASES, "DeepSpeed"),
                         (deepspeed.DEPRECATED, "DeepSpeed, deprecated")):
        for path, names in table.items():
            for other, key in names.items():
                out.setdefault(f"{path}.{key}" if path else key, []).append((other, label))
    return out


def accepted_keys() -> dict[str, dict[str, tuple]]:
    """Section path -> other libraries' keys zerocore accepts there -> (values honoured, why)."""
    out: dict[str, dict[str, tuple]] = {}
    for table in (deepspeed.ACCEPTED, colossalai.ACCEPTED):
        for path, keys in table.items():
            out.setdefault(path, {}).update(keys)
    return out


def top_level_keys() -> dict[str, tuple]:
    """DeepSpeed's top-level keys zerocore accepts without a field -> (values honoured, why)."""
    return dict(deepspeed.TOP_LEVEL)
