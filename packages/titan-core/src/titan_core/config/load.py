"""Build a `JobConfig` from defaults, a TOML file and command-line overrides.

Precedence: command line > TOML file > schema defaults. Every problem raises
`ConfigError` with one line that names the key (or file) and the fix. torchtitan's
quantization spellings (`[quantize.linear.float8]`, ...) are read as Titan's here
(`titan_core.config.aliases`).
"""

import re
import tomllib
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from titan_core.config.aliases import unalias_args, unalias_family, unalias_file, unalias_values
from titan_core.config.errors import ConfigError
from titan_core.config.keys import (
    describe_unknown_key,
    find_field,
    list_sections,
    literal_choices,
    split_optional,
)
from titan_core.config.overrides import NONE_WORDS, parse_overrides
from titan_core.config.schema import JobConfig

_TOML_LOCATION = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")


def load_config(config_file: str | None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """The job config: defaults, then the TOML file, then the overrides on top.

    Args:
        config_file: a TOML file path, or the name of a shipped config
            (`llama3_8b` or `llama3_8b.toml`); None = defaults only.
        overrides: command-line tokens, e.g. ["--training.steps", "5", "--checkpoint.enable"].

    Raises:
        ConfigError: one line naming the key, value or file at fault and the fix.
    """
    values: dict[str, dict[str, Any]] = {}
    origins: dict[str, str] = {}
    if config_file is not None:
        source = resolve_config_file(config_file)
        values, spelled = read_config_file(source)
        origins = {f"{section}.{key}": f"(in {source})" for section, table in values.items() for key in table}
        origins.update({key: f"(in {source}, as {alias})" for key, alias in spelled.items()})
    cli_args, cli_spelled = unalias_args(list(overrides))
    cli_values, cli_origins = parse_overrides(cli_args)
    unalias_values(cli_values, cli_spelled, "on the command line")
    cli_origins.update({key: f"(from --{alias})" for key, alias in cli_spelled.items()})
    for section, table in cli_values.items():
        values.setdefault(section, {}).update(table)
    origins.update(cli_origins)
    unalias_family(values)
    return validate_config(values, origins)


def validate_config(values: dict[str, dict[str, Any]], origins: dict[str, str]) -> JobConfig:
    """Check nested values against the schema and build the `JobConfig`.

    Args:
        values: values[section][key] = value; missing keys take their defaults.
        origins: origins["section.key"] = where the value came from, for messages.
    """
    try:
        return JobConfig.model_validate(values)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, origins)) from None


def list_shipped_configs() -> list[str]:
    """Names of the configs shipped in `titan_core/configs/`, sorted."""
    folder = resources.files("titan_core") / "configs"
    return sorted(entry.name.removesuffix(".toml") for entry in folder.iterdir() if entry.name.endswith(".toml"))


def resolve_config_file(config_file: str) -> Traversable:
    """Find a config: an existing file path first, else a shipped config by name.

    Args:
        config_file: a path, or a shipped name such as 'llama3_8b' (with or without .toml).
    """
    path = Path(config_file).expanduser()
    if path.is_file():
        return path
    shipped = resources.files("titan_core") / "configs" / f"{config_file.removesuffix('.toml')}.toml"
    if shipped.is_file():
        return shipped
    names = ", ".join(list_shipped_configs())
    raise ConfigError(f"config file '{config_file}' not found: give a TOML file path or a shipped config ({names})")


def read_config_file(source: Traversable) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Read a TOML config, torchtitan's quantization spellings as Titan's, and check that every section
    and key exists.

    An optional key may be written `key = "none"` to unset it.

    Args:
        source: the file (a path, or a shipped resource).

    Returns:
        (values, spelled): values[section][key]; spelled["float8.recipe_name"] =
        "quantize.linear.float8.recipe_name" for each key written in torchtitan's spelling.
    """
    try:
        data = tomllib.loads(source.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(_describe_toml_error(str(error), source)) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file {source}: {error}") from None
    origin = f"in {source}"
    data, spelled = unalias_file(data, origin)
    for name, table in data.items():
        if name not in list_sections():
            raise ConfigError(describe_unknown_key(name, origin, what="section"))
        if not isinstance(table, dict):
            raise ConfigError(f"'{name}' {origin} must be a table: write [{name}] then its keys")
        for key, value in table.items():
            field = find_field(f"{name}.{key}", origin)
            if split_optional(field.annotation)[1] and _is_none_word(value):
                table[key] = None
    return data, spelled


def _is_none_word(value: Any) -> bool:
    """True for the strings that mean "unset" in an optional key: 'none', 'null'."""
    return isinstance(value, str) and value.strip().lower() in NONE_WORDS


def _describe_toml_error(message: str, source: Traversable) -> str:
    """'TOML syntax error in FILE at line N, column C: WHAT' from tomllib's message."""
    match = _TOML_LOCATION.search(message)
    if match is None:
        return f"TOML syntax error in {source}: {message}"
    what = message[: match.start()]
    return f"TOML syntax error in {source} at line {match[1]}, column {match[2]}: {what}"


def describe_validation_error(error: ValidationError, origins: dict[str, str]) -> str:
    """One line for the first problem pydantic found: key, value, what is allowed, origin.

    Args:
        error: pydantic's error for the whole config.
        origins: origins["section.key"] = where the value came from.
    """
    first = error.errors()[0]
    location = [str(part) for part in first["loc"][:2]]
    dotted = ".".join(location)
    value = first.get("input")
    kind = first["type"]
    context = first.get("ctx", {})
    if kind == "literal_error":
        field = find_field(dotted, "")
        allowed = ", ".join(repr(choice) for choice in literal_choices(field.annotation))
        problem = f"{value!r} is not one of {allowed}"
    elif kind in _BOUNDS:
        problem = f"{value!r} must be {_BOUNDS[kind]} {next(iter(context.values()))}"
    elif kind in _TYPE_NAMES:
        problem = f"{value!r} is not {_TYPE_NAMES[kind]}"
    elif kind == "value_error":
        problem = str(context.get("error", first["msg"]))
    else:
        problem = f"{value!r}: {first['msg']}"
    origin = origins.get(dotted)
    others = list(dict.fromkeys(".".join(str(part) for part in e["loc"][:2]) for e in error.errors()[1:]))
    others = [key for key in others if key != dotted] or others  # the same key twice: still say there is more
    tail = f" (also wrong: {', '.join(others[:4])}{', ...' if len(others) > 4 else ''})" if others else ""
    where = "" if problem.startswith(dotted) else f"{dotted}: "  # a validator's message may name the key itself
    return f"{where}{problem}{' ' + origin if origin else ''}{tail}"


_BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}
_TYPE_NAMES = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean (true or false)",
    "bool_parsing": "a boolean (true or false)",
    "string_type": "a string",
    "list_type": "a list",
    "model_type": "a table",
    "dict_type": "a table",
}
