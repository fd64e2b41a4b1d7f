"""torchtitan's quantization spellings (and its MoE flavors' family), read as Titan's own when a config is loaded.

torchtitan (v0.2.x, its last TOML-configured release) names float8 training
`model.converters = ["quantize.linear.float8"]` with a `[quantize.linear.float8]` table,
and MXFP8 `quantize.linear.mx` with `[quantize.linear.mx]`; Titan calls them `float8` /
`[float8]` and `mx` / `[mx]`. `load_config` rewrites those spellings here, before any key
is checked, so everything after sees Titan's names only. The keys are the same in both
except where `_rewrite_values` says. Each section and converter is given in one spelling
per file (and per command line); a torchtitan key with no Titan equivalent fails in one
line naming it. torchtitan's deprecated `model.tokenizer_path` is `model.hf_assets_path` (`KEY_ALIASES`).
torchtitan's Qwen3 MoE flavors (`name = "qwen3"`, `flavor = "30B-A3B"`) are Titan's `qwen3_moe`
family (`MOE_FAMILIES`).
"""

import difflib
import typing
from typing import Any

from titan_core.config.errors import ConfigError
from titan_core.config.keys import HELP_HINT, section_fields, split_optional

SECTION_ALIASES: dict[str, str] = {"quantize.linear.float8": "float8", "quantize.linear.mx": "mx"}
"""torchtitan section (and converter name) -> Titan's."""

INERT_SECTIONS: dict[str, tuple[str, ...]] = {
    "quantize.grouped_mm.float8": ("fqns",),
    "quantize.grouped_mm.mx": ("recipe_name", "fqns"),
}
"""torchtitan sections (-> their keys) that configure a converter Titan lacks. They act only when
`model.converters` names that converter (which fails, see `NO_EQUIVALENT`), so a file's copy is
read and dropped, as torchtitan itself leaves it unused."""

NO_EQUIVALENT: dict[str, str] = {
    "quantize.grouped_mm.float8": "Titan has no float8 grouped-GEMM (MoE experts) converter, the experts train in "
    "the run's dtype; remove it",
    "quantize.grouped_mm.mx": "Titan has no MXFP8 grouped-GEMM (MoE experts) converter, the experts train in the "
    "run's dtype; remove it",
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": "Titan's torchao MXFP8 recipes choose their own cast kernel; "
    "remove the key",
}
"""torchtitan converters and keys that Titan cannot honour -> why, and the fix."""

KEY_ALIASES: dict[str, str] = {"model.tokenizer_path": "model.hf_assets_path"}
"""torchtitan key -> Titan's, where only the name differs (torchtitan's deprecated `tokenizer_path`)."""

MOE_FAMILIES: dict[tuple[str, str], str] = {
    ("qwen3", flavor): "qwen3_moe" for flavor in ("debugmodel_moe", "30B-A3B", "235B-A22B")
}
"""torchtitan's (model.name, model.flavor) -> Titan's model.name, where torchtitan keeps a Mixture-of-Experts model's
flavors in its dense family (its `qwen3_moe_debug.toml`: `name = "qwen3"`, `flavor = "debugmodel_moe"`) and Titan has
a family of its own for them (the flavor names are the same)."""


def unalias_family(values: dict[str, dict[str, Any]]) -> None:
    """Rewrite, in place, a torchtitan `model.name` whose flavor is one of Titan's MoE family (`MOE_FAMILIES`).

    Args:
        values: values[section][key] = value, the file's and the command line's merged.
    """
    model = values.get("model", {})
    name, flavor = model.get("name"), model.get("flavor")
    family = MOE_FAMILIES.get((name, flavor)) if isinstance(name, str) and isinstance(flavor, str) else None
    if family is not None:
        model["name"] = family


AUTO_FILTER_ENTRY = "auto_filter_small_kn"
"""torchtitan turns on its small-GEMM filter by listing this in `filter_fqns`; Titan has a key for it."""

MX_RECIPES: dict[str, str | None] = {"mxfp8_cublas_rceil": "mxfp8_rceil", "mxfp8_cublas": None}
"""torchtitan MXFP8 recipe -> Titan's `mx.recipe_name`; None = none (torchao's recipes round scales up only)."""


def unalias_file(data: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A TOML file's tables with torchtitan's quantization spellings rewritten to Titan's.

    Args:
        data: the parsed file, table name -> table.
        where: 'in FILE', for messages.

    Returns:
        (data, spelled): the rewritten tables (a new top-level dict); spelled["float8.recipe_name"] =
        "quantize.linear.float8.recipe_name" for each key written in torchtitan's spelling.

    Raises:
        ConfigError: both spellings of one section or converter; a torchtitan section or key without
            a Titan equivalent.
    """
    data = _rename_keys(data, where)
    if "quantize" not in data:
        return _rewrite_converters(data, where), {}
    data = dict(data)
    spelled: dict[str, str] = {}
    for alias, table in _quantize_tables(data.pop("quantize"), where):
        if alias in INERT_SECTIONS:
            for key in table:
                if key not in INERT_SECTIONS[alias]:
                    raise ConfigError(_unknown_key(alias, key, list(INERT_SECTIONS[alias]), where))
            continue
        target = SECTION_ALIASES[alias]
        if target in data:
            raise ConfigError(
                f"[{target}] and [{alias}] {where} are one section in two spellings (Titan's and torchtitan's); "
                "keep one"
            )
        data[target] = {}
        for key, value in table.items():
            _check_key(alias, key, where)
            data[target][key] = value
            spelled[f"{target}.{key}"] = f"{alias}.{key}"
    _rewrite_values(data, spelled, where)
    return _rewrite_converters(data, where), spelled


def unalias_args(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """Command-line tokens with `--quantize.linear.float8.KEY` / `--quantize.linear.mx.KEY` as `--float8.KEY` /
    `--mx.KEY`; values are left for `parse_overrides`, then `unalias_values`.

    Args:
        args: the command-line tokens, e.g. ["--quantize.linear.float8.recipe_name", "rowwise"].

    Returns:
        (args, spelled): the rewritten tokens; spelled["float8.recipe_name"] =
        "quantize.linear.float8.recipe_name" for each flag given in torchtitan's spelling.
    """
    rewritten: list[str] = []
    spelled: dict[str, str] = {}
    sections_given: set[str] = set()
    keys_given: set[str] = set()
    for i, token in enumerate(args):
        flag, has_equals, text = token[2:].partition("=")
        dotted = flag.replace("-", "_")
        if token.startswith("--") and dotted in KEY_ALIASES:
            keys_given.add(dotted)
            dotted = KEY_ALIASES[dotted]
            token = f"--{dotted}" + (f"={text}" if has_equals else "")
        elif token.startswith("--"):
            keys_given.add(dotted)
        section = dotted.partition(".")[0]
        if not token.startswith("--") or section != "quantize":
            if token.startswith("--"):
                sections_given.add(section)
            rewritten.append(token)
            continue
        alias, _, key = dotted.rpartition(".")
        origin = f"(from --{flag})"
        if alias not in SECTION_ALIASES:
            raise ConfigError(_describe_unread_key(dotted, origin))
        _check_key(alias, key, origin)
        target = SECTION_ALIASES[alias]
        if not has_equals and (i + 1 == len(args) or args[i + 1].startswith("--")):  # a bare flag
            annotation = split_optional(section_fields(target)[key].annotation)[0]
            if annotation is not bool and bool not in typing.get_args(annotation):
                raise ConfigError(f"--{flag} needs a value, e.g. --{flag} VALUE")
            text, has_equals = "true", "="  # torchtitan's booleans (`emulate` too) are flags
        sections_given.add(alias)
        spelled[f"{target}.{key}"] = f"{alias}.{key}"
        rewritten.append(f"--{target}.{key}" + (f"={text}" if has_equals else ""))
    for alias, target in KEY_ALIASES.items():
        if {alias, target} <= keys_given:
            raise ConfigError(f"--{target} and --{alias} on the command line are one key in two spellings (Titan's "
                              "and torchtitan's former one); keep one")  # fmt: skip
    for alias, target in SECTION_ALIASES.items():
        if {alias, target} <= sections_given:
            raise ConfigError(
                f"--{target}.* and --{alias}.* on the command line are one section in two spellings (Titan's and "
                "torchtitan's); keep one"
            )
    return rewritten, spelled


def unalias_values(values: dict[str, dict[str, Any]], spelled: dict[str, str], where: str) -> None:
    """Rewrite, in place, the values that torchtitan spells differently: its converter names in
    `model.converters`, and the values of the keys in `spelled` (from `unalias_args`).

    Args:
        values: values[section][key] = typed value (from `parse_overrides`).
        spelled: Titan key -> the torchtitan key it was given as.
        where: 'on the command line', for messages.
    """
    _rewrite_values(values, spelled, where)
    rewritten = _rewrite_converters(values, where)
    if rewritten is not values:
        values["model"] = rewritten["model"]


def _rename_keys(data: dict[str, Any], where: str) -> dict[str, Any]:
    """`data` with each key of `KEY_ALIASES` under Titan's name (a new dict where one is renamed)."""
    for alias, target in KEY_ALIASES.items():
        section, _, key = alias.partition(".")
        table = data.get(section)
        if not isinstance(table, dict) or key not in table:
            continue
        target_key = target.partition(".")[2]
        if target_key in table:
            raise ConfigError(
                f"{target} and {alias} {where} are one key in two spellings (Titan's and torchtitan's former one); "
                "keep one"
            )
        data = {**data, section: {(target_key if k == key else k): v for k, v in table.items()}}
    return data


def _quantize_tables(quantize: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    """The `[quantize.GROUP.KIND]` tables of a file, as ('quantize.GROUP.KIND', table) pairs."""
    known = ", ".join(f"[{name}]" for name in SECTION_ALIASES)
    tables: list[tuple[str, dict[str, Any]]] = []
    groups = quantize.items() if isinstance(quantize, dict) else [("", quantize)]
    for group, kinds in groups:
        for kind, table in kinds.items() if isinstance(kinds, dict) else [("", kinds)]:
            name = ".".join(part for part in ("quantize", group, kind) if part)
            if name not in SECTION_ALIASES and name not in INERT_SECTIONS:
                raise ConfigError(
                    f"unknown config section '{name}' {where}; of torchtitan's quantize sections Titan reads {known} "
                    "(its [float8] and [mx])"
                )
            if not isinstance(table, dict):
                raise ConfigError(f"'{name}' {where} must be a table: write [{name}] then its keys")
            tables.append((name, table))
    return tables


def _check_key(alias: str, key: str, where: str) -> None:
    """Raise `ConfigError` unless `alias.key` names a key of the Titan section `alias` stands for."""
    dotted = f"{alias}.{key}"
    if dotted in NO_EQUIVALENT:
        raise ConfigError(f"{dotted} {where} has no Titan equivalent: {NO_EQUIVALENT[dotted]}")
    fields = list(section_fields(SECTION_ALIASES[alias]))
    if key not in fields:
        raise ConfigError(_unknown_key(alias, key, fields, where))


def _describe_unread_key(dotted: str, origin: str) -> str:
    """The one-line message for a `quantize.*` key outside the sections Titan reads."""
    for name, reason in NO_EQUIVALENT.items():
        if dotted == name or dotted.startswith(f"{name}."):
            return f"{dotted} {origin} has no Titan equivalent: {reason}"
    known = ", ".join(f"{name}.KEY" for name in SECTION_ALIASES)
    return f"unknown config key '{dotted}' {origin}; of torchtitan's quantize keys Titan reads {known}"


def _unknown_key(alias: str, key: str, fields: list[str], where: str) -> str:
    """The one-line message for an unknown key of a torchtitan section, with the closest known one."""
    close = difflib.get_close_matches(key, fields, n=1)
    fix = f"did you mean '{alias}.{close[0]}'?" if close else HELP_HINT
    return f"unknown config key '{alias}.{key}' {where}; {fix}"


def _rewrite_values(values: dict[str, Any], spelled: dict[str, str], where: str) -> None:
    """Rewrite, in place, the values of keys given in torchtitan's spelling that Titan spells differently."""
    if "float8.filter_fqns" in spelled and isinstance(fqns := values["float8"]["filter_fqns"], list):
        if AUTO_FILTER_ENTRY in fqns:
            if values["float8"].get("auto_filter_small_kn") is False:
                auto_key = spelled.get("float8.auto_filter_small_kn", "float8.auto_filter_small_kn")
                raise ConfigError(
                    f"{spelled['float8.filter_fqns']} {where} lists '{AUTO_FILTER_ENTRY}' (torchtitan's way to turn "
                    f"the filter on) but {auto_key} = false; keep one"
                )
            values["float8"]["filter_fqns"] = [fqn for fqn in fqns if fqn != AUTO_FILTER_ENTRY]
            values["float8"]["auto_filter_small_kn"] = True
    recipe = values["mx"]["recipe_name"] if "mx.recipe_name" in spelled else None
    if isinstance(recipe, str) and recipe in MX_RECIPES:
        titan_recipe = MX_RECIPES[recipe]
        if titan_recipe is None:
            raise ConfigError(
                f"{spelled['mx.recipe_name']} = {recipe!r} {where} has no Titan equivalent (torchao's MXFP8 training "
                "recipes round scales up, RCEIL); write 'mxfp8_cublas_rceil' (Titan's 'mxfp8_rceil')"
            )
        values["mx"]["recipe_name"] = titan_recipe


def _rewrite_converters(data: dict[str, Any], where: str) -> dict[str, Any]:
    """`data` with torchtitan's converter names in `model.converters` replaced by Titan's (a new dict
    when any is; `data` itself otherwise)."""
    model = data.get("model")
    converters = model.get("converters") if isinstance(model, dict) else None
    if not isinstance(model, dict) or not isinstance(converters, list):
        return data
    if not any(isinstance(name, str) and name.startswith("quantize.") for name in converters):
        return data
    titan_names: list[Any] = []
    written: dict[str, str] = {}  # Titan name -> the spelling it was given in
    for name in converters:
        if not isinstance(name, str):  # not a converter name: the schema says so
            titan_names.append(name)
            continue
        if name in NO_EQUIVALENT:
            raise ConfigError(f"model.converters {name!r} {where} has no Titan equivalent: {NO_EQUIVALENT[name]}")
        titan = SECTION_ALIASES.get(name, name)
        if written.setdefault(titan, name) != name:
            raise ConfigError(
                f"model.converters {where} lists both {written[titan]!r} and {name!r}, one converter in two "
                "spellings (torchtitan's and Titan's); keep one"
            )
        titan_names.append(titan)
    return {**data, "model": {**model, "converters": titan_names}}
