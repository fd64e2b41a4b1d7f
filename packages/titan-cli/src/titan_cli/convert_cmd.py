"""`titan convert SRC DST [--to hf|dcp|torch]`: the command-line face of `titan_core.convert`.

Imports only typer at start-up; torch, the models and transformers load when the
command runs, so `titan --help` stays fast.
"""

from __future__ import annotations

import os

import typer


def convert(
    src: str = typer.Argument(
        ...,
        help="Source: Hugging Face folder or Hub repo id, DCP folder (e.g. a trainer's step-N; a run folder: its "
        "newest complete step), or .pt/.bin file.",
    ),
    dst: str = typer.Argument(
        ..., help="Output path (must not exist). For --to torch, a .pt path writes one file; else a folder."
    ),
    to: str | None = typer.Option(
        None, "--to", help="Output format: hf, dcp or torch; default: torch where DST ends in .pt / .pth / .bin."
    ),
    dtype: str | None = typer.Option(
        None, "--dtype", help="Cast weights to float32, bfloat16 or float16 (default: keep)."
    ),
    no_parity_check: bool = typer.Option(False, "--no-parity-check", help="Skip the transformers logits comparison."),
    model_name: str | None = typer.Option(
        None,
        "--model-name",
        help="Model family (model.name); default: the family of the Hugging Face architecture in the source's "
        "config.json (e.g. Qwen3ForCausalLM -> qwen3), a trainer run's model.name, else llama3.",
    ),
    flavor: str | None = typer.Option(
        None, "--flavor", help="Named shape of a DCP/torch source that has no config.json beside it (model.flavor)."
    ),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest Hugging Face shard, e.g. 5GB, 500MB."),
    average_with: list[str] = typer.Option(
        [],
        "--average-with",
        help="Another checkpoint of the same model (any format, or a run folder; repeat for more): DST holds the "
        "average of SRC and these (checkpoint averaging).",
    ),
    weights: str | None = typer.Option(
        None,
        "--weights",
        help="With --average-with: one weight per checkpoint, SRC's first, e.g. 1,1,2 (default: equal).",
    ),
    ema: bool = typer.Option(
        False,
        "--ema",
        help="Write the moving average of the weights a trainer checkpoint holds (ema.enable = true) instead of "
        "its weights.",
    ),
    anchors: bool = typer.Option(
        False,
        "--anchors",
        help="Write the DiLoCo anchors a replica group's checkpoint holds (the weights the groups last synced; "
        "fault_tolerance.semi_sync_method) instead of its own weights.",
    ),
) -> None:
    """Convert model weights between Hugging Face safetensors, DCP and torch files, or average several checkpoints.

    The source format is detected. Conversions to or from Hugging Face end with a
    parity check: transformers' logits on the HF files against Titan's on the
    converted weights. With --average-with, DST holds the weighted mean of the
    checkpoints' weights (in fp32), checked for parity when written as Hugging Face
    files. Nothing is left on disk unless the conversion succeeds.
    """
    from titan_ckpt.torch_files import TORCH_SUFFIXES
    from titan_core.convert import convert_checkpoint
    from titan_core.hf_parity import ParityError
    from titan_core.launch import USER_ERRORS

    def log(message: str) -> None:
        typer.echo(message, err=True)

    if ema and anchors:
        typer.echo("titan convert: error: --ema and --anchors each choose the weights to write; give one", err=True)
        raise typer.Exit(2)
    if to is None:
        if os.path.splitext(dst)[1] not in TORCH_SUFFIXES:
            typer.echo(
                f"titan convert: error: --to is needed: DST {dst!r} is a folder, which holds hf, dcp or torch "
                "weights alike; add --to hf, --to dcp or --to torch",
                err=True,
            )
            raise typer.Exit(2)
        to = "torch"
    try:
        weight_list = [float(w) for w in weights.split(",")] if weights is not None else None
    except ValueError:
        typer.echo(
            f"titan convert: error: --weights {weights!r}: give numbers separated by commas, e.g. 1,1,2", err=True
        )
        raise typer.Exit(2) from None
    try:
        result = convert_checkpoint(
            src,
            dst,
            to,
            dtype=dtype,
            parity_check=not no_parity_check,
            model_name=model_name,
            flavor=flavor,
            max_shard_size=max_shard_size,
            log=log,
            average_with=average_with,
            weights=weight_list,
            weight_set="ema" if ema else "anchors" if anchors else "model",
        )
    except ParityError as err:
        typer.echo(f"titan convert: error: {err}", err=True)
        raise typer.Exit(1) from None
    except (*USER_ERRORS, OSError) as err:  # a wrong input or an unreadable file; a bug keeps its traceback
        typer.echo(f"titan convert: error: {err}", err=True)
        raise typer.Exit(2) from None
    verb = f"averaged {1 + len(average_with)} checkpoints," if average_with else "converted"
    typer.echo(
        f"{verb} {result.src_format} -> {result.dst_format}: {result.dst} "
        f"({result.n_params / 1e6:.2f}M parameters, {result.dtype})"
    )
    if result.parity is not None:
        typer.echo(result.parity.describe())
