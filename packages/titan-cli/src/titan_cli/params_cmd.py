"""`titan params`: every parameter of a job's model, with its optimizer, weight decay and float8 choice.

Imports only typer at start-up; torch and the model load when the command runs.
"""

from __future__ import annotations

import json

import typer

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def params(
    ctx: typer.Context,
    config: str | None = typer.Option(
        None, "--config", "-c", help="TOML config file, or a shipped config's name (e.g. llama3_8b)."
    ),
    match: list[str] = typer.Option(
        [],
        "--match",
        "-m",
        help="Only parameters whose names match this shell-style pattern (repeat for more), as "
        "optimizer.weight_decay_exclude matches them.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per parameter, one per line."),
) -> None:
    """List every parameter of a job's model: shape, elements, optimizer, weight decay and, with float8, whether
    its linear computes in float8 (and why not).

    Takes the same `--config` and `--section.key value` overrides as `titan train`, and builds the model on the
    meta device (no memory, any size). Use it to write `optimizer.weight_decay_exclude`, `float8.filter_fqns` or
    `checkpoint.exclude_from_loading` patterns: `--match` shows what a pattern matches. See docs/optimizers.md.
    """
    from titan_core.config import load_config
    from titan_core.launch import USER_ERRORS, error_line

    try:
        cfg = load_config(config, list(ctx.args))
        import torch

        from titan_core.memory.target_job import check_target_job
        from titan_core.param_table import parameter_rows, render_rows

        # Checked for the device the config names (a GPU config lists its model on a laptop too), else this host's;
        # a tokenizer folder that is not here gives way to the flavor's vocab, as for `titan estimate-memory`.
        host = "cuda" if torch.cuda.is_available() else "cpu"
        job, notes = check_target_job(cfg, None, host if cfg.training.device == "auto" else cfg.training.device)
        rows = parameter_rows(job, match)
    except USER_ERRORS as e:  # bad input; a bug keeps its traceback
        typer.echo(error_line(e), err=True)
        raise typer.Exit(2) from None
    for note in notes:
        typer.echo(f"note: {note}", err=True)
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row.to_json()))
    else:
        matched = f", matching {' or '.join(repr(p) for p in match)}" if match else ""
        typer.echo(render_rows(rows, f"{cfg.model.name} {cfg.model.flavor}, optimizer {cfg.optimizer.name}{matched}"))
    if match and not rows:
        raise typer.Exit(1)
