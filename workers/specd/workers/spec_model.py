"""The base of every `SpecDecodeDeployment` model (camelCase aliases, unknown fields
refused, frozen) and the errors that name a spec field."""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ConfigError(ValueError):
    """A spec that cannot be served; the message names the field and the fix."""


class SubfieldError(ValueError):
    """Raised by a model validator to name a field below the model it validates
    (``adaptive.candidateSteps[2]``); ``format_validation_error`` joins the paths."""

    def __init__(self, subpath: str, message: str):
        super().__init__(message)
        self.subpath = subpath


class SpecModel(BaseModel):
    model_config = ConfigDict(
        extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True
    )


class DType(str, Enum):
    """A model's (or draft's) activation dtype; auto: the checkpoint's (the target's, for a
    draft)."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
