"""The base of every input spec: frozen, no extra fields, strict types, finite numbers, and
one error type.

- Strict: an integer field takes an integer, not `"8"`, `True` or `8.0` (a boolean or a
  text read as a number hides a typo; a float would be truncated); a float field takes an
  integer or a float.
- Finite: NaN and infinity are refused in every float field (an infinite memory or bandwidth
  would make every plan fit).
- Any violation raises `SpecValidationError` (a `SpecError`), one line naming each field, the
  rule and the value, never pydantic's multi-line ValidationError.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from planner.errors import SpecValidationError, format_validation_error

# ---- bounds on sizes: far beyond any real run, low enough that products of them stay exact in
# float64 and int64 and that no enumeration over them can run for long ----
#: Transformer layers of a model (the largest published dense models have under 200).
MAX_LAYERS = 10_000
#: Widths: hidden, MLP, head and low-rank sizes (the largest published hidden size is under 2^15).
MAX_WIDTH = 2**22
#: Attention heads, key/value heads, experts.
MAX_HEADS = 2**16
#: Vocabulary entries.
MAX_VOCAB = 2**26
#: Tokens: sequence length, context, attention window.
MAX_TOKENS = 2**30
#: Sequences per optimizer step.
MAX_BATCH = 2**32
#: GPUs in a job, and any parallel degree.
MAX_GPUS = 2**32


@contextmanager
def _as_spec_error(name: str):
    """pydantic's ValidationError (and a nesting too deep to validate) as one SpecValidationError."""
    try:
        yield
    except ValidationError as exc:
        raise SpecValidationError(name, format_validation_error(exc)) from None
    except RecursionError:
        raise SpecValidationError(name, "input nested too deeply") from None


class Spec(BaseModel):
    """A validated input; construction errors are SpecValidationError (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    def __init__(self, /, **data: Any) -> None:
        with _as_spec_error(type(self).__name__):
            super().__init__(**data)

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any):  # type: ignore[override]
        with _as_spec_error(cls.__name__):
            return super().model_validate(obj, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: Any, **kwargs: Any):  # type: ignore[override]
        with _as_spec_error(cls.__name__):
            return super().model_validate_json(json_data, **kwargs)
