"""A run's model args from its flavor and its config: `model.shape` changes and `[mup]`.

The job check (`titan_core.job`) applies both to the flavor's args; `titan convert` and `titan generate`
apply them again from a run's saved config.toml, so a checkpoint is always read with the shape it was
trained with.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from titan_core.config.errors import ConfigError

__all__ = ["apply_shape", "apply_mup", "run_args", "for_seq_len"]

_SCALARS = (bool, int, float, str)


def _single_type(annotation: Any) -> Any:
    """`T` of an annotation `T` or `T | None`; None for a union of several types."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    if not options:
        return annotation
    kinds = [t for t in options if t is not type(None)]
    return kinds[0] if len(kinds) == 1 else None


def _field_type(annotation: Any) -> type | None:
    """The scalar type of a field annotated `T` or `T | None`; None for anything else (a nested dataclass)."""
    annotation = _single_type(annotation)
    return annotation if annotation in _SCALARS else None


def _parse(text: str, kind: type, optional: bool) -> Any:
    """`text` as a value of `kind` ("none" for an optional field's None); ValueError when it is not one."""
    if optional and text.lower() in ("none", "null"):
        return None
    if kind is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError("is not true or false")
        return text.lower() == "true"
    if kind is int:
        return int(text)
    if kind is float:
        return float(text)
    return text


def apply_shape(args: Any, entries: Sequence[str], key: str = "model.shape") -> Any:
    """`args` with each `field=value` of `entries` replaced (the family's own checks run again); a field of a
    nested dataclass (the MoE layer's `MoEArgs`, Llama 3.1's `RopeScaling`) is named with a dot:
    `moe.num_experts=16`, `rope_scaling.factor=16` (an unset optional one starts from its defaults; `rope_scaling=none`
    unsets it).

    Args:
        args: a model family's args dataclass (a flavor's).
        entries: `["dim=512", "n_heads=8", "moe.top_k=2"]`.
        key: the config key the entries come from, for messages.

    Raises:
        ConfigError: an entry that is not `field=value`, a field the args do not have or that is not a
            number, flag or string, a value of the wrong type, or a shape the family refuses.
    """
    if not entries:
        return args
    from titan_models import ModelConfigError

    try:
        return _replaced(args, entries, key, type(args).__module__.split(".")[1], "")
    except ModelConfigError as e:
        raise ConfigError(f"{key} {list(entries)}: {e}") from None


def _replaced(args: Any, entries: Sequence[str], key: str, owner: str, prefix: str) -> Any:
    """`apply_shape`'s work on one dataclass: `owner` names it in messages, `prefix` its fields ("moe.")."""
    changes: dict[str, Any] = {}
    nested: dict[str, list[str]] = {}
    for entry in entries:
        field, sep, text = entry.partition("=")
        field, text = field.strip(), text.strip()
        if not sep or not field:
            raise ConfigError(f"{key}: {prefix + entry!r} is not 'field=value', e.g. 'dim=512'")
        head, dot, rest = field.partition(".")
        if dot:
            if _nested_type(args, head) is None:
                raise ConfigError(f"{key}: {owner} has no nested settings {prefix + head!r} (in {prefix + entry!r})")
            nested.setdefault(head, []).append(f"{rest}={text}")
            continue
        if text.lower() in ("none", "null") and _nested_type(args, field) is not None and _optional(args, field):
            changes[field] = None  # e.g. `rope_scaling=none`: no long-context scaling
            continue
        changes[field] = _value(args, field, text, key, owner, prefix)
    for head, inner in nested.items():
        current = changes.get(head, getattr(args, head))
        if current is None:  # an unset optional table (`rope_scaling`): its defaults, then the entries
            kind = _nested_type(args, head)
            try:
                current = kind()  # type: ignore[misc]
            except TypeError:
                raise ConfigError(f"{key}: {prefix}{head} has fields without defaults; set each of them") from None
        changes[head] = _replaced(current, inner, key, type(current).__name__, f"{prefix}{head}.")
    return dataclasses.replace(args, **changes)


def _nested_type(args: Any, field: str) -> type | None:
    """The dataclass a field of `args` holds (annotated `D` or `D | None`), else None."""
    hints = typing.get_type_hints(type(args))
    if field not in hints:
        return None
    kind = _single_type(hints[field])
    return kind if isinstance(kind, type) and dataclasses.is_dataclass(kind) else None


def _optional(args: Any, field: str) -> bool:
    """`field` of `args` may be None."""
    return type(None) in typing.get_args(typing.get_type_hints(type(args))[field])


def _value(args: Any, field: str, text: str, key: str, owner: str, prefix: str) -> Any:
    """`text` parsed as the type of `args`' scalar field `field`; ConfigError naming `key` otherwise."""
    hints = typing.get_type_hints(type(args))
    scalar = {f.name: _field_type(hints[f.name]) for f in dataclasses.fields(args)}
    kind = scalar.get(field)
    if kind is None:
        settable = sorted(name for name, k in scalar.items() if k is not None)
        choices = ", ".join(prefix + name for name in settable)
        raise ConfigError(f"{key}: {owner} has no settable field {prefix + field!r}; choose from {choices}")
    try:
        return _parse(text, kind, type(None) in typing.get_args(hints[field]))
    except ValueError:
        article = "an" if kind is int else "a"
        raise ConfigError(f"{key}: {prefix}{field}={text!r} is not {article} {kind.__name__}") from None


def apply_mup(args: Any, section: Mapping[str, Any], key: str = "mup.enable") -> Any:
    """`args` with muP's base shape and multipliers from a `[mup]` table (unchanged when it is off).

    Args:
        args: a model family's args (after `apply_shape`).
        section: the `[mup]` settings (`enable`, `base_dim`, `base_head_dim`, `embedding_multiplier`,
            `output_multiplier`), missing ones at their defaults.
        key: the config key named in messages.

    Raises:
        ConfigError: a family without muP (DeepSeek-V3), or a model it does not cover (tied embeddings, MoE).
    """
    if not section.get("enable", False):
        return args
    from titan_models import ModelConfigError
    from titan_models.mup import MuP

    if not any(f.name == "mup" for f in dataclasses.fields(args)):
        raise ConfigError(
            f"{key}: {type(args).__module__.split('.')[1]} models have no muP here; use llama3 or qwen3, or "
            "set mup.enable = false"
        )
    if getattr(args, "tie_word_embeddings", False):
        raise ConfigError(
            f"{key}: muP needs untied embeddings (the embedding and the output scale differently with width); "
            "add 'tie_word_embeddings=false' to model.shape (or set mup.enable = false)"
        )
    mup = MuP(
        base_dim=int(section.get("base_dim", 256)),
        base_head_dim=int(section.get("base_head_dim", 0)) or args.attention_head_dim,
        embedding_multiplier=float(section.get("embedding_multiplier", 1.0)),
        output_multiplier=float(section.get("output_multiplier", 1.0)),
    )
    try:
        return dataclasses.replace(args, mup=mup)
    except ModelConfigError as e:
        raise ConfigError(f"{key}: {e}; or set mup.enable = false") from None


def run_args(args: Any, run_config: Mapping[str, Any]) -> Any:
    """A flavor's args as a run's saved config.toml changed them: `model.shape`, then `[mup]`.

    Args:
        args: the flavor's args.
        run_config: the parsed config.toml.
    """
    args = apply_shape(args, run_config.get("model", {}).get("shape", []))
    return apply_mup(args, run_config.get("mup", {}))


def for_seq_len(args: Any, seq_len: int) -> Any:
    """`args` whose RoPE table holds `seq_len` positions where that is more than its `max_seq_len` (a run of longer
    sequences than the flavor's default builds it so).

    Args:
        args: a model family's args.
        seq_len: the longest sequence the run feeds the model (`training.seq_len`, or a longer `validation.seq_len`).
    """
    return dataclasses.replace(args, max_seq_len=max(args.max_seq_len, seq_len))
