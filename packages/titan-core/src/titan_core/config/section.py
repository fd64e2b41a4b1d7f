"""The base of every config section and the constrained number types the sections use."""

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def _minus_one_or_at_least(low: int) -> AfterValidator:
    def check(value: int) -> int:
        if value != -1 and value < low:
            raise ValueError(f"{value!r} must be -1 or >= {low}")
        return value

    return AfterValidator(check)


PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
Degree = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
UnitFraction = Annotated[float, Field(ge=0, le=1)]
MinusOneOrPositive = Annotated[int, _minus_one_or_at_least(1)]
"""-1 (derive it, or all of it: the field's docstring says which) or any int >= 1."""
MinusOneOrNonNegative = Annotated[int, _minus_one_or_at_least(0)]
"""-1 (the field's docstring says what it means) or any int >= 0."""


class Section(BaseModel):
    """Base of every config section: unknown keys and bad assignments fail."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
