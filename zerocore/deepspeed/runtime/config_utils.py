"""``deepspeed.runtime.config_utils.DeepSpeedConfigModel``: the pydantic base class DeepSpeed's config sections
(and projects built on DeepSpeed) declare their own sections with. Its rules, as DeepSpeed's: unknown keys are
refused, a field may be given by its name or its alias, assignments are validated, the string ``"auto"`` (the
Hugging Face Trainer's placeholder) given for a field leaves its default (``strict=True``: kept, so validated),
and a field marked deprecated in ``json_schema_extra`` (``{"deprecated": True, "new_param": "name",
"new_param_fn": f}``) given by the user sets ``name`` to ``f(value)`` with a warning; giving both is an
AssertionError. Needs pydantic (DeepSpeed's own dependency); zerocore itself does not."""
from __future__ import annotations

try:
    from pydantic import BaseModel, ConfigDict
except ImportError as e:  # the face imports without pydantic; this module is for code that declares sections
    raise ImportError("deepspeed.runtime.config_utils.DeepSpeedConfigModel is a pydantic model: pip install pydantic"
                      ) from e

from ..utils.logging import logger


class DeepSpeedConfigModel(BaseModel):
    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data):
        if not strict:  # "auto": the caller leaves it to us, so the field's default
            data = {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto")}
        super().__init__(**data)
        self._move_deprecated()

    def _move_deprecated(self) -> None:
        given = self.model_fields_set
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            if not extra.get("deprecated") or name not in given:
                continue
            new = extra.get("new_param")
            hint = f"; use {new} instead" if new else ""
            logger.warning(f"Config parameter {name} is deprecated{hint}")
            if not new:
                continue
            assert new not in given, (f"Cannot provide deprecated parameter '{name}' and replacing parameter "
                                      f"'{new}' together")
            convert = extra.get("new_param_fn", lambda v: v)
            setattr(self, new, convert(getattr(self, name)))
