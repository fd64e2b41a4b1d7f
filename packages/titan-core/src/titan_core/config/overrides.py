"""Parse command-line overrides (`--section.key value`) into typed values.

Syntax:
    --training.steps 100        --training.steps=100
    --checkpoint.enable         (a bare boolean flag, followed by --... or nothing, means true)
    --checkpoint.enable false   (true/false, yes/no, on/off, 1/0)
    --compile.components model,loss            (a list, comma-separated)
    --parallelism.module_fqns_per_model_part '[["a"], ["b"]]'   (a list, JSON)
    --model.hf_assets_path none                (unset an optional key)
Dashes in key names are read as underscores (`--training.seq-len`).

Values are converted with the schema's field types here, so a bad value is
reported with the key that carried it; ranges and choices are checked later by
the schema itself.
"""

import json
import typing
from typing import Any

from titan_core.config.errors import ConfigError
from titan_core.config.keys import find_field, split_optional, strip_annotated

TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")
NONE_WORDS = ("none", "null")


def parse_overrides(args: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Read `--section.key value` overrides into nested, typed values.

    Args:
        args: the command-line tokens, e.g. ["--training.steps", "5", "--checkpoint.enable"].

    Returns:
        (values, origins): values[section][key] = typed value; origins["section.key"]
        = "(from --section.key)", for error messages.
    """
    values: dict[str, dict[str, Any]] = {}
    origins: dict[str, str] = {}
    i = 0
    while i < len(args):
        token = args[i]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument {token!r}; overrides look like --section.key value")
        flag, has_equals, text = token[2:].partition("=")
        dotted = flag.replace("-", "_")
        origin = f"(from --{flag})"
        field = find_field(dotted, origin)
        annotation, _ = split_optional(field.annotation)
        if not has_equals:
            following = args[i + 1] if i + 1 < len(args) else None
            if following is None or following.startswith("--"):
                if annotation is not bool:
                    raise ConfigError(f"--{flag} needs a value, e.g. --{flag} VALUE")
                text = "true"  # a bare boolean flag
            else:
                text = following
                i += 1
        section, _, key = dotted.partition(".")
        values.setdefault(section, {})[key] = convert_text(text, field.annotation, dotted, origin)
        origins[dotted] = origin
        i += 1
    return values, origins


def convert_text(text: str, annotation: Any, dotted: str, origin: str) -> Any:
    """Turn one command-line string into a value of the field's type.

    Args:
        text: the string from the command line.
        annotation: the field's type annotation.
        dotted: the key, for error messages.
        origin: where the value came from, for error messages.
    """
    inner, optional = split_optional(annotation)
    if optional and text.strip().lower() in NONE_WORDS:
        return None
    try:
        return _convert(text, inner)
    except ValueError as error:
        raise ConfigError(f"{dotted}: {text!r} {error} {origin}") from None


def _convert(text: str, annotation: Any) -> Any:
    """Convert `text` to `annotation`; a ValueError says what it is not."""
    annotation = strip_annotated(annotation)
    if annotation is bool:
        word = text.strip().lower()
        if word in TRUE_WORDS + FALSE_WORDS:
            return word in TRUE_WORDS
        raise ValueError("is not a boolean (use true or false)")
    if annotation is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError("is not an integer") from None
    if annotation is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError("is not a number") from None
    if typing.get_origin(annotation) is list:
        return _convert_list(text, typing.get_args(annotation)[0])
    return text  # str and Literal[...] of strings: the schema checks the choices


def _convert_list(text: str, item_annotation: Any) -> list[Any]:
    """A JSON list (`["a", "b"]`) or a comma-separated one (`a,b`; "" = empty)."""
    if text.strip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"is not a valid JSON list ({error.msg})") from None
        if not isinstance(value, list):
            raise ValueError("is not a list")
        return value
    if typing.get_origin(strip_annotated(item_annotation)) is list:
        raise ValueError('needs JSON for a list of lists, e.g. \'[["a", "b"], ["c"]]\'')
    items = [item.strip() for item in text.split(",") if item.strip()]
    return [_convert(item, item_annotation) for item in items]
