"""`titan lighthouse`: torchft's lighthouse, which forms the quorum of replica groups each step.

A thin wrapper around `torchft._torchft.LighthouseServer` (what torchft's own
`torchft_lighthouse` command runs) that prints the address to give every group as
`fault_tolerance.lighthouse`. torchft loads when the command runs, so `titan --help` stays fast.
"""

from __future__ import annotations

import signal
import time

import typer


def lighthouse(
    min_replicas: int = typer.Option(
        1, "--min-replicas", min=1, help="Fewest replica groups in a quorum (as fault_tolerance.min_replica_size)."
    ),
    bind: str = typer.Option("[::]:29510", "--bind", help="Address to listen on; port 0 picks a free one."),
    join_timeout_ms: int = typer.Option(
        60000,
        "--join-timeout-ms",
        min=0,
        help="How long a new quorum waits for heartbeating groups that have not asked yet.",
    ),
    heartbeat_timeout_ms: int = typer.Option(
        5000,
        "--heartbeat-timeout-ms",
        min=1,
        help="A group silent this long is dead: the next quorum goes on without it.",
    ),
    quorum_tick_ms: int = typer.Option(100, "--quorum-tick-ms", min=1, help="How often a waiting quorum is checked."),
) -> None:
    """Run torchft's lighthouse until SIGTERM or Ctrl-C; prints its address for fault_tolerance.lighthouse."""
    try:
        from torchft._torchft import LighthouseServer
    except ImportError:
        typer.echo("titan: error: titan lighthouse needs torchft: pip install 'titan-core[ft]'", err=True)
        raise typer.Exit(2) from None
    try:
        server = LighthouseServer(
            bind=bind,
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
    except RuntimeError as error:  # torchft's: "invalid socket address", "Address already in use", ...
        typer.echo(f"titan: error: --bind {bind}: {error}; give HOST:PORT that is free here, e.g. [::]:29510", err=True)
        raise typer.Exit(2) from None
    stopped: list[int] = []  # a plain flag: a handler calling `threading.Event.set` deadlocked on the lock the
    # interrupted `Event.wait` held (`timeout CMD` signals the process and `uv run` forwards it: two chances a stop)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, _: stopped.append(signum))
    typer.echo(f"lighthouse at {server.address()}: pass --fault_tolerance.lighthouse {server.address()}")
    while not stopped:
        time.sleep(0.2)  # the handler runs between sleeps
    server.shutdown()
    typer.echo("lighthouse stopped")
