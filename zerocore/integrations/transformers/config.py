"""A zerocore/DeepSpeed config with ``"auto"`` values filled from ``TrainingArguments``, the way
Transformers fills DeepSpeed's (``HfTrainerDeepSpeedConfig.trainer_config_process`` and
``trainer_config_finalize``): the same keys from the same arguments, and a value given that
differs from its argument is an error naming both.

Two differences, both so that the Trainer's arguments mean what they mean without ZeRO:
``gradient_clipping`` left out of the config is the Trainer's ``max_grad_norm`` (DeepSpeed would
use its own default), and ``train_batch_size`` left out is not needed (the engine derives it).
"""
from __future__ import annotations

from .._wrapping import read_config

# (config key, TrainingArguments value getter, the argument's name, must match when not "auto")
_FROM_ARGS = (
    ("train_micro_batch_size_per_gpu", lambda a: a.per_device_train_batch_size, "per_device_train_batch_size", True),
    ("gradient_accumulation_steps", lambda a: a.gradient_accumulation_steps, "gradient_accumulation_steps", True),
    ("train_batch_size", lambda a: a.world_size * a.per_device_train_batch_size * a.gradient_accumulation_steps,
     "train_batch_size (calculated)", True),
    ("gradient_clipping", lambda a: a.max_grad_norm, "max_grad_norm", True),
    ("optimizer.params.lr", lambda a: a.learning_rate, "learning_rate", True),
    ("optimizer.params.betas", lambda a: [a.adam_beta1, a.adam_beta2], "adam_beta1+adam_beta2", True),
    ("optimizer.params.eps", lambda a: a.adam_epsilon, "adam_epsilon", True),
    ("optimizer.params.weight_decay", lambda a: a.weight_decay, "weight_decay", True),
    ("scheduler.params.warmup_min_lr", lambda a: 0, "(not a Trainer argument)", False),
    ("scheduler.params.warmup_max_lr", lambda a: a.learning_rate, "learning_rate", True),
    ("fp16.enabled", lambda a: bool(a.fp16 or a.fp16_full_eval), "fp16|fp16_full_eval", True),
    ("bf16.enabled", lambda a: bool(a.bf16 or a.bf16_full_eval), "bf16|bf16_full_eval", True),
)


def _node(cfg: dict, key: str):
    """(the dict holding the last part of ``key``, that part); (None, part) when a parent is absent."""
    *parents, last = key.split(".")
    node = cfg
    for p in parents:
        node = node.get(p)
        if not isinstance(node, dict):
            return None, last
    return node, last


class _Filler:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.mismatches: list[str] = []

    def fill(self, key: str, value, arg: str, must_match: bool = True) -> None:
        node, last = _node(self.cfg, key)
        if node is None:
            return
        current = node.get(last)
        if current == "auto":
            node[last] = value
        elif must_match and current is not None and current != value:
            self.mismatches.append(f"- zerocore config {key}={current!r} vs TrainingArguments {arg}={value!r}")


def hidden_size(model) -> int | None:
    c = getattr(model, "config", None)
    for cc in (c, getattr(c, "text_config", None)):
        if cc is None:
            continue
        if getattr(cc, "hidden_size", None):
            return cc.hidden_size
        if getattr(cc, "hidden_sizes", None):
            return max(cc.hidden_sizes)
    return None


def fill_auto(config, args, model=None, num_training_steps: int | None = None) -> dict:
    """The config with every ``"auto"`` filled; ValueError listing each mismatch with its argument,
    or naming an ``"auto"`` that nothing fills."""
    cfg = read_config(config)
    f = _Filler(cfg)
    for key, get, arg, must in _FROM_ARGS:
        f.fill(key, get(args), arg, must)
    z = cfg.get("zero_optimization")
    sized = [k for k in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
             if isinstance(z, dict) and z.get(k) == "auto"]
    if sized:
        h = hidden_size(model) if model is not None else None
        if h is None:
            raise ValueError(f"zerocore config: zero_optimization.{sized[0]}='auto' needs the model's hidden size "
                             "(config.hidden_size / hidden_sizes), which this model lacks; give a number")
        f.fill("zero_optimization.reduce_bucket_size", h * h, "hidden_size^2", False)
        if z.get("stage") == 3:
            f.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * h * h), "0.9*hidden_size^2", False)
            f.fill("zero_optimization.stage3_param_persistence_threshold", 10 * h, "10*hidden_size", False)
    if isinstance(z, dict) and z.get("stage") == 3 and hasattr(args, "ds3_gather_for_generation"):
        # TRL's argument (its default true gathers DeepSpeed's ZeRO-3 model for each generation); the config wins
        z.setdefault("stage3_gather_for_generation", bool(args.ds3_gather_for_generation))
    if num_training_steps is not None:
        f.fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
        f.fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)),
               "warmup_steps")
    if f.mismatches:
        raise ValueError("zerocore config values contradict the TrainingArguments:\n" + "\n".join(f.mismatches)
                         + "\nSet these config values to 'auto' (or equal to the arguments).")
    cfg.setdefault("gradient_clipping", args.max_grad_norm)
    left = _autos(cfg)
    if left and num_training_steps is not None:
        raise ValueError(f"zerocore config: {left[0]}='auto' has no TrainingArguments value to take; give a value")
    return cfg


def _autos(node, prefix="") -> list[str]:
    out = []
    for k, v in node.items():
        if isinstance(v, dict):
            out += _autos(v, f"{prefix}{k}.")
        elif v == "auto":
            out.append(prefix + k)
    return out


def zero_stage(config) -> int:
    z = read_config(config).get("zero_optimization") or {}
    return int(z.get("stage", 0))
