"""A bad value given to one of the face's config-section objects (``DeepSpeedFP16Config(...)``,
``DeepSpeedZeroConfig(...)``, the offload sections) raises what DeepSpeed's pydantic models raise, a
``pydantic.ValidationError``, that is also zerocore's ``ConfigError`` (and so DeepSpeed's
``DeepSpeedConfigError``), carrying zerocore's message, which names the key and what is allowed: code written
against DeepSpeed catches ``ValidationError``, code written against zerocore ``ConfigError``. Without pydantic
installed (zerocore does not need it) the ``ConfigError`` itself is raised."""
from __future__ import annotations

import contextlib
import functools

from ...config.options import ConfigError


@functools.cache
def _error_class():
    try:
        from pydantic import ValidationError
    except ImportError:
        return None

    class SectionValidationError(ValidationError, ConfigError):
        """pydantic's error for DeepSpeed's code, zerocore's for zerocore's."""

    SectionValidationError.__qualname__ = SectionValidationError.__name__

    return SectionValidationError


def _validation_error(title: str, err: ConfigError, section: dict):
    cls = _error_class()
    if cls is None:
        return None
    from pydantic_core import InitErrorDetails, PydanticCustomError

    message = str(err)
    field = message.split(":", 1)[0].rsplit(".", 1)[-1]  # "fp16.loss_scale: got ..." -> loss_scale
    # (the message goes in as the template's context value: a literal "{" in it would be read as a placeholder)
    detail = InitErrorDetails(type=PydanticCustomError("value_error", "{message}", {"message": message}),
                              loc=(field,), input=section.get(field))
    return cls.from_exception_data(title, [detail])


@contextlib.contextmanager
def validation_errors(title: str, section: dict):
    """Inside: a ``ConfigError`` leaves as ``pydantic.ValidationError`` of model ``title`` (see above)."""
    try:
        yield
    except ConfigError as err:
        converted = _validation_error(title, err, section)
        if converted is None:
            raise
        raise converted from err
