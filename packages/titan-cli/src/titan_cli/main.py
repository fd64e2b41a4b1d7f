"""The `titan` command.

Only typer is imported at start-up; torch and the trainer load inside the
command that needs them, so `titan --help` answers at once.
"""

from __future__ import annotations

import inspect

import typer

from titan_cli.convert_cmd import convert
from titan_cli.estimate_cmd import _PASS_THROUGH as _EST
from titan_cli.estimate_cmd import estimate_memory
from titan_cli.eval_cmd import evaluate
from titan_cli.generate_cmd import generate
from titan_cli.lighthouse_cmd import lighthouse
from titan_cli.params_cmd import _PASS_THROUGH as _PARAMS
from titan_cli.params_cmd import params
from titan_cli.plan_cmd import _PASS_THROUGH as _PLAN
from titan_cli.plan_cmd import plan
from titan_cli.tokenize_cmd import tokenize

app = typer.Typer(
    name="titan",
    help="Pretrain large language models with PyTorch, from one CPU to thousands of GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"titan {version('titan-cli')}")
        raise typer.Exit(0)


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Pretrain large language models with PyTorch, from one CPU to thousands of GPUs."""
    from titan_core.log_filters import drop_torch_noise  # logging only: torch is not imported here

    drop_torch_noise()


_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def _help(command) -> str:
    """`command`'s docstring with each paragraph on one line: Typer's rich help keeps a docstring's line breaks,
    so a paragraph wrapped at the source's width would print ragged at any other terminal width."""
    doc = inspect.getdoc(command) or ""
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in doc.split("\n\n"))


def train(
    ctx: typer.Context,
    config: str | None = typer.Option(
        None, "--config", "-c", help="TOML config file, or the name of a shipped one (e.g. llama3_8b)."
    ),
    nproc_per_node: int = typer.Option(
        1, "--nproc-per-node", help="Processes to start on this node (torchrun underneath)."
    ),
    nnodes: str = typer.Option("1", "--nnodes", help="Nodes in the job, or a MIN:MAX range (elastic)."),
    rdzv_endpoint: str | None = typer.Option(
        None, "--rdzv-endpoint", help="host:port of the rendezvous, for multi-node jobs (same on every node)."
    ),
    max_restarts: int = typer.Option(
        0,
        "--max-restarts",
        help="Restart all processes up to N times after one fails; they resume from the newest checkpoint.",
    ),
    print_config: bool = typer.Option(False, "--print-config", help="Print the resolved config as TOML and exit."),
    help_config: bool = typer.Option(
        False, "--help-config", help="List every config key with its type, default and meaning."
    ),
) -> None:
    """Train a model. Any config key can be overridden: `--training.steps 20 --model.flavor 10M`.

    Precedence: command line > --config file > built-in defaults (the default run:
    a small Llama 3 on the Python stdlib corpus, on CPU, in about a minute).
    """
    if help_config:
        from titan_core.config import config_help

        typer.echo(config_help())
        raise typer.Exit(0)
    forwarded = list(ctx.args)
    if config is not None:
        forwarded = ["--config", config, *forwarded]
    if print_config:
        forwarded.append("--print-config")
    from titan_core.launch import launch  # torch loads only once a job is checked or started

    raise typer.Exit(
        launch(
            forwarded,
            nproc_per_node=nproc_per_node,
            nnodes=nnodes,
            rdzv_endpoint=rdzv_endpoint,
            max_restarts=max_restarts,
        )
    )


# The subcommands live in their own modules, which import only typer at start-up;
# registered here in the order `titan --help` lists them.
app.command(context_settings=_PASS_THROUGH, help=_help(train))(train)
app.command(help=_help(convert))(convert)
app.command("estimate-memory", context_settings=_EST, help=_help(estimate_memory))(estimate_memory)
app.command("plan", context_settings=_PLAN, help=_help(plan))(plan)
app.command("params", context_settings=_PARAMS, help=_help(params))(params)
app.command(help=_help(tokenize))(tokenize)
app.command(help=_help(generate))(generate)
app.command("eval", help=_help(evaluate))(evaluate)
app.command(help=_help(lighthouse))(lighthouse)

if __name__ == "__main__":
    app()
