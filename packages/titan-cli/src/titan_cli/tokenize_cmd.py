"""`titan tokenize INPUT... --output DIR`: tokenize a corpus once into memmap-able token shards.

The command-line face of `titan_core.data.write_token_shards`; the format is in
`titan_core.data.token_shards` and docs/data.md. Imports only typer at start-up;
titan_core (and torch) load when the command runs, so `titan --help` stays fast.
"""

from __future__ import annotations

import typer

_DEFAULT_SHARD_TOKENS = 100_000_000  # titan_core.data.token_shards.DEFAULT_SHARD_TOKENS, not imported at start-up
FIELD_OPTION = "--dataset-text-field"


def tokenize(
    inputs: list[str] = typer.Argument(
        ...,
        help=(
            "Text/.jsonl/.parquet files (.json when named), folders, globs, 'stdlib', or a Hugging Face dataset name"
            " (NAME:CONFIG for one of its configs, as allenai/c4:en); read in the order given."
        ),
    ),
    output: str = typer.Option(
        ..., "--output", "-o", help="Folder to create (train with --training.dataset_path DIR)."
    ),
    hf_assets_path: str | None = typer.Option(
        None,
        "--hf-assets-path",
        help="The tokenizer, as model.hf_assets_path (a folder or file); unset = the byte tokenizer.",
    ),
    dataset_text_field: str = typer.Option(
        "text", FIELD_OPTION, help="JSON field / parquet column / record field of the text."
    ),
    shard_tokens: int = typer.Option(
        _DEFAULT_SHARD_TOKENS, "--shard-tokens", help="A shard closes once it holds this many tokens."
    ),
    workers: int = typer.Option(1, "--workers", help="Processes that tokenize documents (the order is kept)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing token-shard folder at --output."),
) -> None:
    """Tokenize documents once into token shards that `titan train` reads with O(1) work per rank.

    Each document becomes BOS + ids + EOS, in the order read: the same token stream
    as tokenizing on the fly with the same tokenizer. The output appears only once complete.
    """
    from titan_core.data import build_tokenizer, write_token_shards
    from titan_core.data.token_shards import check_output
    from titan_core.launch import USER_ERRORS

    def log(message: str) -> None:
        typer.echo(message, err=True)

    try:
        check_output(output, force)  # before a hub dataset is opened
        tokenizer = build_tokenizer(hf_assets_path)
        sources = [open_source(name, dataset_text_field) for name in inputs]
        described = {"inputs": list(inputs), "text_field": dataset_text_field, "sources": [repr(s) for s in sources]}
        manifest = write_token_shards(
            (text for source in sources for text in source),
            tokenizer,
            output,
            shard_tokens=shard_tokens,
            workers=workers,
            source=described,
            force=force,
            log=log,
        )
    except (*USER_ERRORS, OSError) as err:  # a wrong input or an unreadable file; a bug keeps its traceback
        typer.echo(f"titan tokenize: error: {err}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        typer.echo(f"titan tokenize: interrupted; nothing written to {output}", err=True)
        raise typer.Exit(130) from None
    typer.echo(
        f"tokenized {manifest.total_documents:,} documents into {manifest.total_tokens:,} {manifest.dtype} tokens "
        f"({len(manifest.shards)} shards, {tokenizer!r}) at {manifest.folder}; "
        f"train on it with --training.dataset_path {manifest.folder}"
    )


def open_source(name: str, text_field: str):
    """The documents that one INPUT names: local files, 'stdlib', or a hub dataset (as `training.dataset` names them,
    torchtitan's names included: `titan_core.data.corpus.build_source`).

    Args:
        name: a file, folder or glob; "stdlib"; or a Hugging Face dataset name.
        text_field: the JSON field / parquet column / record field of the text.
    """
    from titan_core.data.corpus import build_source

    return build_source(name, None, text_field, dataset_key="titan tokenize INPUT", field_key=FIELD_OPTION)
