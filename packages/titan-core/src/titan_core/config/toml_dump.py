"""Write a `JobConfig` as TOML that `load_config` reads back to an equal config.

Python's standard library reads TOML (tomllib) but does not write it, and the
config only needs tables of scalars and lists, so the emitter is written here
rather than adding a dependency. An unset (None) key becomes a comment, or
`key = "none"` where its default is set (`load_config` reads "none" as unset).
"""

import json
import math
import re
from typing import Any

from pydantic import BaseModel

from titan_core.config.schema import JobConfig

HEADER = "# Titan job config. Run it with: titan train --config THIS_FILE\n"


def dump_toml(cfg: JobConfig, with_docs: bool = False) -> str:
    """The config as TOML text, one table per section, keys in schema order.

    Args:
        cfg: the config to write.
        with_docs: put each key's doc line above it as a comment.
    """
    lines = [HEADER]
    for section_name in JobConfig.model_fields:
        section = getattr(cfg, section_name)
        if with_docs:
            lines.append(f"# {JobConfig.model_fields[section_name].description}")
        lines.append(f"[{section_name}]")
        for key, field in type(section).model_fields.items():
            if with_docs and field.description:
                lines.append(f"# {field.description}")
            value = getattr(section, key)
            if value is None and field.default is None:
                lines.append(f"# {key} is unset")
            elif value is None:  # unset where the default is set: say so explicitly
                lines.append(f'{key} = "none"')
            else:
                lines.append(f"{key} = {format_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def format_toml_value(value: Any) -> str:
    """One value as a TOML literal: bool, int, float, str, a (nested) list of them, or an inline table.

    Args:
        value: the value to write.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value)  # shortest round-tripping form; 'inf', '1e-08' are valid TOML
    if isinstance(value, str):
        # JSON's string escapes are a subset of TOML's basic-string escapes;
        # TOML also forbids a raw DEL character.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_toml_value(item) for item in value) + "]"
    if isinstance(value, BaseModel):  # a table inside a list (`training.dataset_mix`): inline, unset keys left out
        items = [f"{key} = {format_toml_value(v)}" for key, v in value if v is not None]
        return "{" + ", ".join(items) + "}"
    if isinstance(value, dict):  # `training.dataset_mix_phases`' weights: an inline table, keys quoted when needed
        items = [
            f"{k if re.fullmatch(r'[A-Za-z0-9_-]+', k) else format_toml_value(k)} = {format_toml_value(v)}"
            for k, v in value.items()
        ]
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot write {type(value).__name__} value {value!r} as TOML")
