"""`titan plan`: the fastest layouts of a job on N GPUs that fit in memory, and the winner as a config.

Imports only typer at start-up; torch and the search load when the command runs.
"""

from __future__ import annotations

import json
import sys

import typer

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def plan(
    ctx: typer.Context,
    config: str | None = typer.Option(
        None, "--config", "-c", help="TOML config file, or a shipped config's name (e.g. llama3_70b)."
    ),
    gpus: int | None = typer.Option(None, "--gpus", help="GPUs in the job (whole nodes when more than one node)."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs per node, i.e. per NVLink domain."),
    gpu: str = typer.Option(
        "H100", "--gpu", help="GPU model, for its peak FLOP/s (and memory): H100, H200, A100, B200, ..."
    ),
    gpu_memory: str | None = typer.Option(
        None, "--gpu-memory", help="Device memory per GPU: a size (80GiB, 80GB) or a GPU name; default: --gpu's."
    ),
    seq_len: int | None = typer.Option(
        None, "--seq-len", help="Tokens per sequence; default: the config's training.seq_len."
    ),
    global_batch_size: int | None = typer.Option(
        None, "--global-batch-size", help="Sequences per optimizer step; default: the config's global_batch_size."
    ),
    host_memory: str | None = typer.Option(
        None, "--host-memory", help="Host memory per node that CPU offload may fill, e.g. 1TiB; default: 2TiB."
    ),
    top: int = typer.Option(5, "--top", help="How many layouts to rank."),
    expert_parallel: bool = typer.Option(
        True,
        "--expert-parallel/--no-expert-parallel",
        help="Search expert-parallel degrees for a Mixture-of-Experts model (--no-expert-parallel: ep = 1).",
    ),
    emit_config: str | None = typer.Option(
        None, "--emit-config", help="Write the best layout's config to this TOML file."
    ),
    force: bool = typer.Option(False, "--force", help="Let --emit-config overwrite an existing file."),
    workers: int | None = typer.Option(
        None,
        "--workers",
        min=1,
        help="Processes measuring what the blocks keep at each layout; default: this machine's CPUs (1 under 4).",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object (layouts, step-time terms, counts) for scripts."
    ),
) -> None:
    """Rank the layouts of a job that fit in memory by estimated step time.

    Searches FSDP / HSDP, context, tensor and pipeline parallel degrees,
    expert parallel for Mixture-of-Experts models, schedules, micro-batches,
    batch splits, activation checkpointing and CPU offload; keeps the layouts whose memory estimate fits; ranks them
    by a cost model of compute and exposed communication (docs/memory.md,
    "titan plan"). Takes `titan train`'s `--config` and `--section.key
    value` overrides; the search sets the keys it searches. Exit 1 when
    no layout fits, 2 on bad input.
    """
    from titan_core.config import ConfigError
    from titan_core.launch import USER_ERRORS, error_line

    try:
        if gpus is None:
            raise ConfigError("--gpus is needed: the number of GPUs in the job, e.g. --gpus 64")
        from titan_core.memory.plan import PlanRequest, prepare_plan, search
        from titan_core.memory.plan_report import check_emit_path

        if emit_config is not None:
            check_emit_path(emit_config, force)  # refused before the search: a file it may not write is bad input
        request = PlanRequest(
            config,
            tuple(ctx.args),
            gpus=gpus,
            gpus_per_node=gpus_per_node,
            gpu=gpu,
            gpu_memory=gpu_memory,
            seq_len=seq_len,
            global_batch=global_batch_size,
            top=top,
            host_memory=host_memory,
            expert_parallel=expert_parallel,
            workers=workers,
            progress=(lambda line: typer.echo(f"titan plan: {line} ...", err=True)) if sys.stderr.isatty() else None,
        )
        result = search(prepare_plan(request))
        command = None
        if result.fits and emit_config is not None:
            from titan_core.memory.plan_report import emit_config as write_config

            command = write_config(result, result.fits[0], emit_config, force)
    except USER_ERRORS as e:  # bad input; a bug keeps its traceback
        typer.echo(error_line(e), err=True)
        raise typer.Exit(2) from None
    from titan_core.memory.plan_report import fix_hint, plan_json, render_plan

    if as_json:
        data = plan_json(result)
        data["emitted"] = None if command is None else {"path": emit_config, "command": command}
        typer.echo(json.dumps(data, indent=1))
    elif result.fits:
        typer.echo(render_plan(result))
        if command is not None:
            typer.echo(f"wrote the best layout to {emit_config}; run it with:\n  {command}")
        else:
            typer.echo("write the best layout as a config for `titan train`: add --emit-config FILE")
    if not result.fits:
        typer.echo(f"titan: {fix_hint(result)}", err=True)
        raise typer.Exit(1)
