"""Trainers that drive zerocore through their own extension points.

- ``zerocore.integrations.transformers``: a mixin / class factory for Hugging Face ``Trainer`` and
  its subclasses (TRL's ``SFTTrainer``), the ``"auto"`` config filling, stage-3 ``from_pretrained``.
- ``zerocore.integrations.lightning``: a Lightning ``Strategy`` registered as ``"zerocore_stage_N"``.

Each module imports only the public API of its library (and a few documented overridable
methods), never patches the library's modules. See docs/integrations.md.
"""
