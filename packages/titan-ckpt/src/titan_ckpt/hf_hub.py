"""Resolve a checkpoint source: a local folder, or a Hugging Face Hub repo id downloaded
(or found in the local cache when offline) with `huggingface_hub.snapshot_download`.

The token comes from huggingface_hub's usual places (`HF_TOKEN`, `hf auth login`) and
is never printed: it is masked out of any error message.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from titan_ckpt.errors import CheckpointNotFoundError

HF_DOWNLOAD_PATTERNS = ["*.safetensors", "*.json", "tokenizer.model"]
"""Files fetched from a Hub repo: weights, index, config and tokenizer (no .bin/.pth duplicates)."""

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def looks_like_repo_id(source: str) -> bool:
    """True for `org/name` strings that do not exist as a local path.

    Args:
        source: a path or a Hub repo id.
    """
    return _REPO_ID.fullmatch(source) is not None and not Path(source).exists()


def resolve_hf_source(source: str | os.PathLike, revision: str | None = None) -> Path:
    """A local path for `source`: the path itself, or the Hub snapshot of a repo id.

    Tries the Hub first, then the local cache (`local_files_only=True`) when the Hub
    cannot be reached.

    Args:
        source: a local file/folder, or a Hub repo id like `meta-llama/Llama-3.2-1B`.
        revision: branch, tag or commit of the repo; None for the default branch.

    Raises:
        FileNotFoundError: neither a local path nor a reachable or cached repo.
    """
    source = os.fspath(source)
    if Path(source).exists() or not looks_like_repo_id(source):
        return Path(source)
    from huggingface_hub import get_token, snapshot_download

    try:
        return Path(snapshot_download(source, revision=revision, allow_patterns=HF_DOWNLOAD_PATTERNS))
    except Exception as online_err:  # offline, gated, unknown repo: try the cache before giving up
        try:
            return Path(
                snapshot_download(source, revision=revision, allow_patterns=HF_DOWNLOAD_PATTERNS, local_files_only=True)
            )
        except Exception:
            reason = _mask(
                f"{type(online_err).__name__}: {str(online_err).splitlines()[0] if str(online_err) else ''}",
                get_token(),
            )
            raise CheckpointNotFoundError(
                f"{source} is neither a local path nor a Hub repo that can be downloaded "
                f"or found in the cache ({reason}); "
                "check the path or repo id, and for gated repos log in with `hf auth login` or set HF_TOKEN"
            ) from None


def _mask(text: str, token: str | None) -> str:
    """`text` with the token replaced by `***`."""
    return text.replace(token, "***") if token else text
