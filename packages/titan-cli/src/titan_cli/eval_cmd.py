"""`titan eval CHECKPOINT --tasks T1,T2`: EleutherAI's lm-evaluation-harness tasks on a Titan checkpoint.

Imports only typer at start-up; torch, the model and lm-eval load when the command runs, so
`titan --help` stays fast. The model class is `titan_core.lm_eval_model.TitanLM`; lm-eval is the
optional extra `titan-core[eval]`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

MISSING_EXTRA = "titan eval needs EleutherAI's lm-evaluation-harness: pip install 'titan-core[eval]'"


def evaluate(
    checkpoint: str = typer.Argument(
        ..., help="A titan train run folder (newest step), a checkpoint/step-N folder, or a Hugging Face folder."
    ),
    tasks: str = typer.Option(..., "--tasks", "-t", help="Comma-separated lm-eval task (or group) names."),
    include_path: Path | None = typer.Option(
        None, "--include-path", help="A folder of your own task YAML files (searched before lm-eval's own)."
    ),
    limit: float | None = typer.Option(
        None, "--limit", help="Examples per task: a count, or a fraction of the task when below 1."
    ),
    num_fewshot: int | None = typer.Option(None, "--num-fewshot", help="Few-shot examples per prompt."),
    batch_size: int = typer.Option(8, "--batch-size", "-b", help="Sequences per forward and per decoding batch."),
    device: str | None = typer.Option(None, "--device", help="cpu, cuda or cuda:N (default: cuda when available)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bfloat16 on a CUDA GPU with bf16), float32, bfloat16."),
    model_name: str | None = typer.Option(None, "--model-name", help="Model family (default: from the checkpoint)."),
    flavor: str | None = typer.Option(None, "--flavor", help="A DCP checkpoint's flavor without a run config.toml."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the results as JSON to this file."),
    seed: int = typer.Option(1234, "--seed", help="Seed of lm-eval's sampling of few-shot examples."),
) -> None:
    """Score a checkpoint on lm-evaluation-harness tasks and print the table. See docs/evaluation.md."""
    from titan_core.launch import USER_ERRORS

    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table
    except ImportError:
        typer.echo(f"titan eval: error: {MISSING_EXTRA}", err=True)
        raise typer.Exit(2) from None
    if include_path is not None and not include_path.is_dir():
        typer.echo(
            f"titan eval: error: --include-path {include_path} is not a folder; pass the folder of your task files",
            err=True,
        )
        raise typer.Exit(2)
    for flag, value, ok, fix in (
        ("--batch-size", batch_size, batch_size >= 1, "give 1 or more sequences"),
        ("--num-fewshot", num_fewshot, num_fewshot is None or num_fewshot >= 0, "give 0 or more examples"),
        ("--limit", limit, limit is None or limit > 0, "give a count of examples, or a fraction of each task below 1"),
    ):
        if not ok:
            typer.echo(f"titan eval: error: {flag} {value:g}: {fix}", err=True)
            raise typer.Exit(2)
    names = [name.strip() for name in tasks.split(",") if name.strip()]
    try:
        from titan_core.config.errors import ConfigError
        from titan_core.lm_eval_model import TitanLM

        manager = _task_manager(TaskManager, names, include_path)
        unknown = [name for name in names if name not in manager.all_tasks]
        if unknown:
            raise ConfigError(
                f"--tasks {','.join(unknown)}: no such lm-eval task{'s' if len(unknown) > 1 else ''}"
                f"{' in --include-path ' + str(include_path) + ' or' if include_path else ''} in lm-eval's own; "
                "check the names (`lm_eval ls tasks`)"
            )
        model = TitanLM(
            checkpoint, model_name=model_name, flavor=flavor, device=device, dtype=dtype, batch_size=batch_size
        )
        results = lm_eval.simple_evaluate(
            model=model,
            tasks=names,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            log_samples=False,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    except (*USER_ERRORS, OSError) as err:  # a wrong input or an unreadable file; a bug keeps its traceback
        typer.echo(f"titan eval: error: {err}", err=True)
        raise typer.Exit(2) from None
    if results is None:  # a non-zero rank of a distributed lm-eval run
        return
    typer.echo(make_table(results))
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        record = {"checkpoint": checkpoint, "results": results["results"], "versions": results.get("versions", {})}
        output.write_text(json.dumps(record, indent=2, default=str) + "\n")
        typer.echo(f"results: {output}", err=True)


def _task_manager(task_manager: type, names: list[str], include_path: Path | None) -> Any:
    """lm-eval's task index: the --include-path folder alone when it holds every task named (indexing
    lm-eval's own ~15,000 task files takes seconds), else that folder and lm-eval's own tasks."""
    if include_path is not None:
        local = task_manager(include_path=str(include_path), include_defaults=False)
        if all(name in local.all_tasks for name in names):
            return local
    return task_manager(include_path=str(include_path) if include_path else None)
