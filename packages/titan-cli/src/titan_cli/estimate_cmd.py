"""`titan estimate-memory`: per-rank peak memory of a layout, and whether it fits, before launching it.

Imports only typer at start-up; torch and the estimator load when the command runs.
"""

from __future__ import annotations

import json

import typer

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def estimate_memory(
    ctx: typer.Context,
    config: str | None = typer.Option(
        None, "--config", "-c", help="TOML config file, or a shipped config's name (e.g. llama3_8b)."
    ),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", min=1, help="Processes (GPUs) per node."),
    nnodes: int = typer.Option(1, "--nnodes", min=1, help="Number of nodes."),
    gpu_memory: str | None = typer.Option(
        None,
        "--gpu-memory",
        help="Device memory per rank: a size (80GiB, 80GB) or a GPU name (H100, H200, A100, B200, ...).",
    ),
    traced: bool = typer.Option(
        False,
        "--traced",
        help="Trace the real train step under FakeTensorMode (seconds; falls back to analytic where torch cannot).",
    ),
    measure: bool = typer.Option(
        False,
        "--measure",
        help="Run the job on this host's devices with 2 and 3 blocks per stage, two steps each, and extrapolate "
        "the measured peak to the full depth (GPU: max_memory_allocated; CPU: live tensor bytes).",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object (bytes per component, per stage) for scripts."
    ),
) -> None:
    """Estimate each rank's peak device memory for a config and layout, and say whether it fits.

    Takes the same `--config` and `--section.key value` overrides as `titan train`.
    Prints parameters, gradients, optimizer states, activations, communication and
    temporary buffers per pipeline stage, the total, and with `--gpu-memory` a
    verdict and the cheapest change that would make it fit. `--measure` runs it on
    this host instead, all ranks here, cut to a few blocks. Formulas and measured
    accuracy: docs/memory.md.
    """
    from titan_core.config import load_config
    from titan_core.launch import USER_ERRORS, error_line
    from titan_core.memory.measured import MeasureError

    if measure and nnodes > 1:
        typer.echo(
            "titan: error: --measure runs every rank on this host; measure with --nnodes 1 (and the ranks this host "
            "has in --nproc-per-node), or estimate without --measure",
            err=True,
        )
        raise typer.Exit(2)
    try:
        cfg = load_config(config, list(ctx.args))
        from titan_core.memory import estimate_memory as estimate
        from titan_core.memory import render_text

        result = estimate(cfg, nproc_per_node * nnodes, gpu_memory=gpu_memory, traced=traced, measure=measure)
    except USER_ERRORS as e:  # bad input; a bug keeps its traceback
        typer.echo(error_line(e), err=True)
        raise typer.Exit(2) from None
    except MeasureError as e:  # the job does not fit this host's devices even cut short
        typer.echo(error_line(e), err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=1))
    else:
        title = f"{cfg.model.name} {cfg.model.flavor}, {nnodes} node(s) x {nproc_per_node} process(es)"
        typer.echo(render_text(result, title))
    if result.fits is False:
        raise typer.Exit(1)
