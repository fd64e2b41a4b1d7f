"""List every config key with its type, default and doc line (`titan train --help-config`)."""

import types
import typing
from typing import Any

from pydantic.fields import FieldInfo

from titan_core.config.keys import section_fields, split_optional, strip_annotated
from titan_core.config.schema import JobConfig
from titan_core.config.toml_dump import format_toml_value

_BOUND_SYMBOLS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def config_help() -> str:
    """Every section and key: `--section.key TYPE (default VALUE)` then its doc line."""
    lines = [
        "Config keys (TOML: [section] key = value; command line: --section.key value).",
        "Precedence: command line > TOML file > these defaults. Write none to unset a '| None' key.",
    ]
    for section_name, section_field in JobConfig.model_fields.items():
        lines.append("")
        lines.append(f"[{section_name}]  {section_field.description or ''}".rstrip())
        for key, field in section_fields(section_name).items():
            lines.append(
                f"  --{section_name}.{key} {describe_type(field)}  (default {describe_default(field.default)})"
            )
            lines.append(f"      {field.description or ''}".rstrip())
    return "\n".join(lines) + "\n"


def describe_type(field: FieldInfo) -> str:
    """A short type string, e.g. 'int > 0', "'linear' | 'sqrt' | 'cosine'", 'str | None'.

    Args:
        field: a section field of the schema.
    """
    inner, optional = split_optional(field.annotation)
    text = _name_type(inner)
    bounds = [
        f"{symbol} {getattr(constraint, name)}"
        for constraint in _constraints(field)
        for name, symbol in _BOUND_SYMBOLS
        if hasattr(constraint, name)
    ]
    if bounds:
        text += " " + ", ".join(bounds)
        if optional:
            text = f"({text})"
    return f"{text} | None" if optional else text


def describe_default(value: Any) -> str:
    """The default as TOML would write it; None reads 'unset'.

    Args:
        value: a field's default.
    """
    return "unset" if value is None else format_toml_value(value)


def _name_type(annotation: Any) -> str:
    """'int', 'list[str]', "'a' | 'b'" for an annotation without None."""
    annotation = strip_annotated(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(choice) for choice in typing.get_args(annotation))
    if origin is list:
        return f"list[{_name_type(typing.get_args(annotation)[0])}]"
    return getattr(annotation, "__name__", str(annotation))


def _constraints(field: FieldInfo) -> list[Any]:
    """The annotated-types constraints (Gt, Ge, ...) of a field, also under `X | None`."""
    found = list(field.metadata)
    pending = [field.annotation]
    while pending:
        annotation = pending.pop()
        if typing.get_origin(annotation) is typing.Annotated:
            for extra in typing.get_args(annotation)[1:]:
                found.extend(extra.metadata if isinstance(extra, FieldInfo) else [extra])
        elif typing.get_origin(annotation) in (typing.Union, types.UnionType):
            pending.extend(typing.get_args(annotation))
    return found
