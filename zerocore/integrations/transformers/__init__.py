"""Hugging Face Transformers (and TRL) training with zerocore; see docs/integrations.md.

``ZeroTrainer(model=..., args=TrainingArguments(...), zerocore_config=cfg, ...)``, or
``make_zero_trainer(SFTTrainer)(..., zerocore_config=cfg)`` for a Trainer subclass;
``from_pretrained(AutoModelForCausalLM, path, cfg)`` builds a stage-3 model partitioned as it loads.
"""
from __future__ import annotations

from .._common import check_version

TRANSFORMERS_VERSION = check_version("transformers", "5.0", "6", "zerocore.integrations.transformers")

import transformers  # noqa: E402

# the Trainer methods the mixin overrides; a Transformers without them is not one this was built for
_OVERRIDDEN = ("create_optimizer", "create_scheduler", "_wrap_model", "training_step", "_clip_grad_norm",
               "_get_grad_norm", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler",
               "_load_from_checkpoint", "_load_best_model", "save_model", "_save")
_missing = [m for m in _OVERRIDDEN if not hasattr(transformers.Trainer, m)]
if _missing:
    raise ImportError(f"zerocore.integrations.transformers supports transformers >=5.0,<6 (tested with 5.24); "
                      f"transformers {TRANSFORMERS_VERSION} lacks Trainer.{', Trainer.'.join(_missing)}")

from .config import fill_auto  # noqa: E402
from .loading import from_pretrained, generate, load_pretrained_weights  # noqa: E402
from .trainer import ZeroTrainerMixin, make_zero_trainer  # noqa: E402

ZeroTrainer = make_zero_trainer(transformers.Trainer)

__all__ = ["ZeroTrainer", "ZeroTrainerMixin", "make_zero_trainer", "fill_auto", "from_pretrained", "generate",
           "load_pretrained_weights", "TRANSFORMERS_VERSION"]
