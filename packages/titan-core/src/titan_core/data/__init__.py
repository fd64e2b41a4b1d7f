"""Data for training: tokenizers, corpus sources, and the packed loader.

    tokenizer = build_tokenizer(hf_assets_path)        # None -> ByteTokenizer
    source = build_source("stdlib")                     # or a path / hub name
    loader = PackedLoader(source, tokenizer, seq_len, local_batch_size, dp_rank, dp_world)
    inputs, labels = next(loader)                       # (local_batch_size, seq_len) int64

Pre-tokenized data (`titan tokenize`, docs/data.md) is read by `TokenShardLoader` (file
order) or `MixtureLoader` (shuffled, or several weighted sources); `build_loader` picks
the loader from the settings, `PackedLoader` for text read on the fly.
"""

from titan_core.data.build import build_loader, loader_factory
from titan_core.data.corpus import DocumentSource, StdlibSource, build_source
from titan_core.data.hf_dataset import HFDatasetSource
from titan_core.data.hf_tokenizer import HFTokenizer
from titan_core.data.loader import PackedLoader
from titan_core.data.local_files import LocalFileSource
from titan_core.data.mix_schedule import MixSchedule, shares_of
from titan_core.data.mixture import MixtureLoader
from titan_core.data.tiktoken_tokenizer import GPT2_PATTERN, LLAMA3_PATTERN, TiktokenTokenizer
from titan_core.data.token_loader import TokenShardLoader
from titan_core.data.token_shards import is_token_shard_folder, read_manifest, write_token_shards
from titan_core.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer, tokenizer_fingerprint

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "LLAMA3_PATTERN",
    "GPT2_PATTERN",
    "build_tokenizer",
    "tokenizer_fingerprint",
    "DocumentSource",
    "StdlibSource",
    "LocalFileSource",
    "HFDatasetSource",
    "build_source",
    "PackedLoader",
    "TokenShardLoader",
    "MixtureLoader",
    "MixSchedule",
    "shares_of",
    "build_loader",
    "loader_factory",
    "write_token_shards",
    "read_manifest",
    "is_token_shard_folder",
]
