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
`ds_config.json` layout. Other spellings are written in zerocore's key names before the schema
checks them (`zerocore/config/compat/`):

- DeepSpeed's: the aliases listed below and its deprecated `zero_optimization.cpu_offload` /
  `cpu_offload_param` / `cpu_offload_use_pin_memory` (mapped onto the offload sections, with a
  warning).
- ColossalAI's form: `zero=dict(level=..., offload_optimizer_config=dict(...),
  offload_param_config=dict(...))`, and ColossalAI's `optimizer=dict(type='Adam', lr=0.001,
  weight_decay=0)` with `zero=dict(type='ZeroRedundancyOptimizer_Level_3',
  dynamic_loss_scale=True, clip_grad=1.0)`: `type` ZeroRedundancyOptimizer_Level_N is stage N,
  flat optimizer keys go to `optimizer.params` (flat `type='Adam'` is torch.optim.Adam:
  `adam_w_mode` false), `dynamic_loss_scale` is fp16 with dynamic loss scaling
  (`static_loss_scale`: a static one; `dynamic_loss_args` its knobs), `clip_grad` is
  `gradient_clipping`. `offload_param_config` has no `fast_init`; a number written there is
  taken as `max_in_cpu` (the host-memory bound of the parameter shards), with a warning.

Defaults are DeepSpeed 0.19's: a DeepSpeed config trains the same under zerocore. The column
"DeepSpeed 0.19" gives DeepSpeed's default for each key (read from the installed DeepSpeed by
a test); where zerocore's differs, the table below the main one says why that changes no
result. `gradient_clipping` defaults to 1.0 in both (DeepSpeed 0.19's
`GRADIENT_CLIPPING_DEFAULT`; older DeepSpeed releases defaulted to 0, off): write
`"gradient_clipping": 0` to train unclipped.

Top-level keys zerocore has no field for: those that change nothing training computes
(DeepSpeed's logging, monitoring and profiling sections such as `steps_per_print`,
`wall_clock_breakdown`, `tensorboard`, `wandb`, `csv_monitor`, `flops_profiler`,
`comms_logger`; the `activation_checkpointing` memory knobs) are accepted and named in one
warning, as is a feature section switched off (`{"enabled": false}`); any other
(model/pipeline/sequence parallelism, compression, curriculum learning, ...) is an error naming
the key, since ignoring it would train something else than the file asks for. The full list
is at the end of this file. Where `zerocore.initialize` treats a DeepSpeed config differently
from DeepSpeed on purpose (a setting refused where DeepSpeed silently ignores it, such as
`offload_param` below stage 3, `ignore_unused_parameters: false`), `docs/deepspeed_unit_tests.md` says why,
beside DeepSpeed's own unit tests run against zerocore.

`zerocore.deepspeed.initialize` (the DeepSpeed face) follows DeepSpeed instead, and marks its
engines so (`engine.deepspeed_semantics`; None on engines of `zerocore.initialize`):
`offload_param` (or `cpu_offload_param`) below stage 3 is ignored with a warning naming the key;
`ignore_unused_parameters: false` is accepted and, at stages 1-2 with optimizer offload, a
trainable parameter without a gradient in an accumulation window fails that window's `step()`
with an AssertionError (DeepSpeed's); `zero_force_ds_cpu_optimizer` (default true) with optimizer
offload refuses a client optimizer other than `DeepSpeedCPUAdam` (`ZeRORuntimeException`); a
parameter trainable at initialize whose `requires_grad` becomes False gets a zero gradient, with
one warning naming it (`zerocore.initialize` refuses at the next `step()`); and a checkpoint's
optimizer state saved at another data-parallel world size is refused (`ZeRORuntimeException`)
unless `checkpoint.load_universal` is true (`zerocore.initialize` reshards it always); and
`data_types.buffer_dtype` null keeps each buffer's dtype (`"keep"`; `zerocore.initialize` keeps a
Transformers model's buffers and casts other floating buffers to the training dtype then); under
`"keep"` a normalization layer's running statistics follow its 16-bit weights, as its kernels need.

`activation_checkpointing` is accepted as memory-only: its keys (`partition_activations`,
`cpu_checkpointing`, `contiguous_memory_optimization`, `number_checkpoints`,
`synchronize_checkpoint_boundary`, `profile`) say where DeepSpeed keeps the activations saved at
checkpoint boundaries, which trades memory for time and changes no value. A model that calls
`deepspeed.checkpointing.checkpoint(fn, *args)` gets `zerocore.deepspeed.checkpointing.checkpoint`,
which recomputes through `torch.utils.checkpoint` (RNG state restored, so dropout matches):
the same values, activations kept where torch keeps them.

An unknown key inside a known section is an error naming it (with the nearest
known spelling); DeepSpeed keys that zerocore has no field for are accepted only with the value
that asks for what zerocore does anyway (e.g. `ignore_unused_parameters: true`,
`zero_quantized_weights: false`). A wrong type or value raises `ConfigError` naming the
key and what is allowed; so does a combination of keys that cannot work together (e.g.
`offload_optimizer.device` other than none at stage 0, `offload_param.device` other than none
below stage 3, `ratio` below 1 with `device` nvme). Whether an `nvme_path` exists, is writable
and supports direct I/O is checked at `zerocore.initialize`, on the machine that trains.

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
    from .compat import other_spellings
    from .deepspeed_defaults import DEEPSPEED_DEFAULTS, DIFFERS, ONLY_ZEROCORE

    spellings = other_spellings()

    rows = ["| key | default | DeepSpeed 0.19 | allowed | meaning | status |", "|---|---|---|---|---|---|"]
    for key, _, spec, default in walk(ZeroConfig):
        ds = DEEPSPEED_DEFAULTS[key]
        ds_text = "(zerocore only)" if ds is ONLY_ZEROCORE else f"`{_fmt(ds)}`" + (" (see below)" if key in DIFFERS
                                                                                   else "")
        names = [f"{name} ({whose})" for name, whose in spellings.get(key, [])]
        meaning = spec.doc + (f" Also accepted as: {', '.join(names)}." if names else "")
        if spec.pending:
            status = f"validated; values that need {spec.pending} raise NotImplementedError (not implemented yet)"
        elif spec.no_effect:
            status = f"accepted; {spec.no_effect}"
        elif spec.applies:
            status = f"only with {spec.applies}"
        else:
            status = "works"
        rows.append(f"| `{key}` | `{_fmt(default)}` | {ds_text} | {allowed_text(spec)} | {meaning} | {status} |")
    sections = []
    for key in _sections(ZeroConfig, ""):
        if key in spellings:
            names = ", ".join(f"`{name}` ({whose})" for name, whose in spellings[key])
            sections.append(f"- `{key}` is also accepted as {names}.")
    text = HEADER + "\n".join(rows) + "\n"
    text += "\nWhere zerocore's default is not DeepSpeed's:\n\n" + "\n".join(
        f"- `{k}`: {why}" for k, why in DIFFERS.items()) + "\n"
    if sections:
        text += "\nSection aliases:\n" + "\n".join(sections) + "\n"
    return text + _foreign_table()


def _foreign_table() -> str:
    from .compat import ANY, accepted_keys, top_level_keys

    rows = ["", "Other libraries' keys accepted inside these sections (any other value is an error):", "",
            "| key | accepted | why |", "|---|---|---|"]
    for path, keys in accepted_keys().items():
        for key, (allowed, why) in keys.items():
            rows.append(f"| `{path}.{key}` | {_accepted(allowed, ANY)} | {why} |")
    rows += ["", "DeepSpeed top-level keys accepted (any other top-level key is an error unless its section has "
             "`\"enabled\": false`):", "", "| key | accepted | why |", "|---|---|---|"]
    for key, (allowed, why) in top_level_keys().items():
        rows.append(f"| `{key}` | {_accepted(allowed, ANY)} | {why} |")
    return "\n".join(rows) + "\n"


def _accepted(allowed, any_value) -> str:
    return "any value" if allowed is any_value else " or ".join(f"`{_fmt(a)}`" for a in allowed)


def _sections(cls, prefix):
    """The dotted key of every nested section of ``cls``, depth first."""
    import dataclasses

    from .options import is_section

    for f in dataclasses.fields(cls):
        if is_section(f):
            key = f"{prefix}.{f.name}" if prefix else f.name
            yield key
            yield from _sections(f.default_factory, key)
