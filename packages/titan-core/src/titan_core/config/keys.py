"""Look up a dotted config key (`training.steps`) in the schema, with suggestions.

Used for both command-line overrides and TOML files, so an unknown key reads
the same wherever it came from.
"""

import difflib
import types
import typing
from typing import Any

from pydantic.fields import FieldInfo

from titan_core.config.errors import ConfigError
from titan_core.config.schema import JobConfig, Section
from titan_core.config.torchtitan_keys import torchtitan_only

HELP_HINT = "run `titan train --help-config` to list every key"


def list_sections() -> list[str]:
    """Names of the config sections, in schema order."""
    return list(JobConfig.model_fields)


def list_keys() -> list[str]:
    """Every dotted config key (`section.field`), in schema order."""
    return [f"{section}.{key}" for section in list_sections() for key in section_fields(section)]


def section_fields(section: str) -> dict[str, FieldInfo]:
    """The fields of one section, by name.

    Args:
        section: a section name from `list_sections()`.
    """
    return section_model(section).model_fields


def section_model(section: str) -> type[Section]:
    """The model class of one section (every field of `JobConfig` is a `Section`).

    Args:
        section: a section name from `list_sections()`.
    """
    model = JobConfig.model_fields[section].annotation
    assert isinstance(model, type) and issubclass(model, Section), f"[{section}] is not a Section"
    return model


def suggest_key(dotted: str) -> str | None:
    """The valid key closest to an unknown one, or None when nothing is close.

    Args:
        dotted: the unknown key, e.g. 'training.step', 'trainin.steps', 'steps'
            or a lone section name such as 'trainin'.
    """
    section, _, key = dotted.rpartition(".")
    if section in JobConfig.model_fields:
        same_section = difflib.get_close_matches(key, list(section_fields(section)), n=1)
        if same_section:
            return f"{section}.{same_section[0]}"
    exact_name = [full for full in list_keys() if full.rpartition(".")[2] == key]
    if exact_name:
        return exact_name[0]
    if section in JobConfig.model_fields:
        return None
    if not section:
        close_section = difflib.get_close_matches(key, list_sections(), n=1)
        if close_section:
            return close_section[0]
    close = difflib.get_close_matches(dotted, list_keys(), n=1, cutoff=0.6)
    return close[0] if close else None


LAUNCHER_WORDS = frozenset(("gpus", "gpus_per_node", "ngpus", "num_gpus", "nodes", "num_nodes", "world_size", "nproc"))
"""Names users give the job's size (`titan plan --gpus`, other launchers' flags): in `titan train` and `titan
estimate-memory` that is not a config key but the launcher's `--nproc-per-node` and `--nnodes`."""


def describe_unknown_key(dotted: str, origin: str, what: str = "key") -> str:
    """The one-line message for an unknown key.

    Args:
        dotted: the unknown key.
        origin: where it came from, e.g. '(from --training.step)' or 'in job.toml'.
        what: 'key', or 'section' for a TOML table name.
    """
    if dotted.lower() in LAUNCHER_WORDS:
        fix = "the job's size is set by --nproc-per-node N (processes per node) and --nnodes M"
        return f"unknown config {what} '{dotted}' {origin}; {fix}"
    if (instead := torchtitan_only(dotted)) is not None:
        return f"config {what} '{dotted}' {origin} is torchtitan's, with no Titan equivalent: {instead}"
    suggestion = suggest_key(dotted)
    fix = f"did you mean '{suggestion}'?" if suggestion else HELP_HINT
    return f"unknown config {what} '{dotted}' {origin}; {fix}"


def find_field(dotted: str, origin: str) -> FieldInfo:
    """The schema field of a dotted key; a ConfigError when there is none.

    Args:
        dotted: 'section.field'.
        origin: where the key came from, for the error message.
    """
    section, _, key = dotted.partition(".")
    if section in JobConfig.model_fields and key in section_fields(section):
        return section_fields(section)[key]
    raise ConfigError(describe_unknown_key(dotted, origin))


def strip_annotated(annotation: Any) -> Any:
    """The type under `Annotated[...]` (the annotation itself when not annotated).

    Args:
        annotation: a type annotation.
    """
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def split_optional(annotation: Any) -> tuple[Any, bool]:
    """Split `X | None` into (X, True); any other annotation into (it, False).

    Args:
        annotation: a type annotation.
    """
    annotation = strip_annotated(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return strip_annotated(members[0]), True
    return annotation, False


def literal_choices(annotation: Any) -> tuple[Any, ...]:
    """The allowed values of the first `Literal[...]` inside an annotation, or ().

    Args:
        annotation: a type annotation, e.g. `list[Literal["model", "loss"]]`.
    """
    annotation = strip_annotated(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    for inner in typing.get_args(annotation):
        choices = literal_choices(inner)
        if choices:
            return choices
    return ()
