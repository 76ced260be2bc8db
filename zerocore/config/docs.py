"""Generates docs/config.md from the schema itself, so the documented keys, defaults and
allowed values are the ones the code uses (a test checks the committed file matches)."""
from __future__ import annotations

import json

from .options import allowed_text, walk
from .schema import ZeroConfig

HEADER = """# zerocore configuration

Generated from the schema in `zerocore/config/schema.py` by `zerocore config-docs`; do not
edit by hand (a test checks that this file matches the generator).

A config is a dict, a path to a JSON file, or a `zerocore.ZeroConfig`, in DeepSpeed's
`ds_config.json` layout. Also accepted: the aliases listed below, DeepSpeed's deprecated
`zero_optimization.cpu_offload` / `cpu_offload_param` / `cpu_offload_use_pin_memory` (mapped
onto the offload sections, with a warning), and the ColossalAI form
`zero=dict(level=..., offload_optimizer_config=dict(...), offload_param_config=dict(...))`,
including the seed's `optimizer=dict(type='Adam', lr=0.001, weight_decay=0)` and
`zero=dict(type='ZeroRedundancyOptimizer_Level_3', dynamic_loss_scale=True, clip_grad=1.0)`:
`type` ZeroRedundancyOptimizer_Level_N is stage N, flat optimizer keys go to `optimizer.params`
(flat `type='Adam'` is torch.optim.Adam: `adam_w_mode` false), `dynamic_loss_scale` is fp16 with
dynamic loss scaling (`static_loss_scale`: a static one; `dynamic_loss_args` its knobs),
`clip_grad` is `gradient_clipping`. A number given as `offload_param_config.fast_init` (the
seed's slip) is taken as `max_in_cpu`, with a warning.

Unknown top-level keys are named in one warning (a DeepSpeed file carries other subsystems'
settings there). An unknown key inside a known section is an error naming it (with the nearest
known spelling); DeepSpeed keys that zerocore has no field for are accepted only with the value
that asks for what zerocore does anyway (e.g. `ignore_unused_parameters: true`,
`zero_quantized_weights: false`). A wrong type or value raises `ConfigError` naming the
key and what is allowed. Settings whose implementation has not landed raise
`NotImplementedError` from `zerocore.initialize` naming them, instead of being ignored.

Gradient reduction on gloo: with `reduce_scatter: true` each rank receives only its reduced
slice. gloo's own reduce-scatter took 1.8-2.9x (2 ranks) and 1.1-1.8x (4 ranks) as long as an
all-reduce of the same buffer on this project's 2-core test machine (4-64 MiB, see
`benchmarks/results/reduce_scatter*`), so on gloo zerocore runs an in-place all-reduce of
the bucket and keeps its slice; the memory held is the same. On NCCL it uses the native
reduce-scatter.

"""


def _fmt(value) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int) and value >= 10_000_000 and value % 1_000_000 == 0:
        return f"{value:.0e}".replace("e+0", "e").replace("e+", "e")
    return json.dumps(value)


def render() -> str:
    rows = ["| key | default | allowed | meaning | status |", "|---|---|---|---|---|"]
    for key, _, spec, default in walk(ZeroConfig):
        names = list(spec.aliases) + [f"{d} (deprecated)" for d in spec.deprecated]
        meaning = spec.doc + (f" Also accepted as: {', '.join(names)}." if names else "")
        if spec.pending:
            status = f"validated; values that need {spec.pending} raise NotImplementedError until it lands"
        elif spec.no_effect:
            status = f"accepted; {spec.no_effect}"
        elif spec.applies:
            status = f"only with {spec.applies}"
        else:
            status = "works"
        rows.append(f"| `{key}` | `{_fmt(default)}` | {allowed_text(spec)} | {meaning} | {status} |")
    sections = []
    for key, f, spec, _ in _sections(ZeroConfig, ""):
        if spec.aliases:
            sections.append(f"- `{key}` is also accepted as `{'`, `'.join(spec.aliases)}`.")
    text = HEADER + "\n".join(rows) + "\n"
    if sections:
        text += "\nSection aliases:\n" + "\n".join(sections) + "\n"
    return text + _foreign_table()


def _foreign_table() -> str:
    from .foreign import ANY, FOREIGN

    rows = ["", "Other libraries' keys accepted inside these sections (any other value is an error):", "",
            "| key | accepted | why |", "|---|---|---|"]
    for path, keys in FOREIGN.items():
        for key, (allowed, why) in keys.items():
            accepted = "any value" if allowed is ANY else " or ".join(f"`{_fmt(a)}`" for a in allowed)
            rows.append(f"| `{path}.{key}` | {accepted} | {why} |")
    return "\n".join(rows) + "\n"


def _sections(cls, prefix):
    import dataclasses

    from .options import is_section, spec_of

    for f in dataclasses.fields(cls):
        if is_section(f):
            key = f"{prefix}.{f.name}" if prefix else f.name
            yield key, f, spec_of(f), None
            yield from _sections(f.default_factory, key)
