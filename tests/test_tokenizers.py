"""Tokenizers: byte, tiktoken (GPT-2 ranks file), Hugging Face tokenizer.json, build_tokenizer."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from titan_core.data import (
    GPT2_PATTERN,
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    build_tokenizer,
)
from titan_core.data.tiktoken_tokenizer import llama3_special_tokens, split_long_runs
from titan_core.data.token_shards import token_dtype, wrap_document

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
GPT2_RANKS = SHARED / "tokenizers" / "gpt2.tiktoken"
HAMLET = SHARED / "shakespeare" / "hamlet_gut.txt"
needs_shared = pytest.mark.skipif(not GPT2_RANKS.exists(), reason="shared test data not present")

UNICODE_TEXT = "héllo wörld ✓ 😀 中文 ñ\n\ttabs  and  spaces\r\n"


# ---------------------------------------------------------------- byte


def test_byte_tokenizer_round_trips_unicode_and_uses_utf8_bytes():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258)
    ids = tok.encode(UNICODE_TEXT)
    assert tok.decode(ids) == UNICODE_TEXT
    assert all(0 <= i < 256 for i in ids)
    # UTF-8 by hand: é = C3 A9, ✓ = E2 9C 93, 😀 = F0 9F 98 80.
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.encode("✓") == [0xE2, 0x9C, 0x93]
    assert tok.encode("😀") == [0xF0, 0x9F, 0x98, 0x80]
    assert tok.encode("Hi") == [72, 105]
    assert tok.decode([256, 72, 105, 257]) == "Hi"  # specials are dropped
    assert build_tokenizer(None).encode("Hi") == [72, 105]


# ---------------------------------------------------------------- tiktoken


@pytest.fixture(scope="module")
def gpt2():
    return TiktokenTokenizer(GPT2_RANKS, pattern=GPT2_PATTERN)


@needs_shared
def test_tiktoken_gpt2_ranks_layout_and_known_ids(gpt2):
    with open(GPT2_RANKS) as f:
        n_ranks = sum(1 for line in f if line.strip())
    assert n_ranks == 50256  # per the shared data README: GPT-2's 50,256 ranks
    assert isinstance(gpt2, Tokenizer)
    assert gpt2.decode([0]) == "!"  # rank 0 is the byte "!"
    assert gpt2.bos_id == n_ranks and gpt2.eos_id == n_ranks + 1  # specials right after the ranks
    assert gpt2.vocab_size == n_ranks + 256
    assert gpt2.decode([gpt2.bos_id]) == "<|begin_of_text|>"
    assert gpt2.decode([n_ranks + 9]) == "<|eot_id|>"
    # GPT-2's well-known ids: "Hello" = 15496, " world" = 995.
    assert gpt2.encode("Hello world") == [15496, 995]
    # Special-token names inside a document are plain text, never special ids.
    ids = gpt2.encode("a <|begin_of_text|> b <|end_of_text|>")
    assert gpt2.bos_id not in ids and gpt2.eos_id not in ids
    assert gpt2.decode(ids) == "a <|begin_of_text|> b <|end_of_text|>"


@needs_shared
def test_tiktoken_round_trips_shakespeare_and_unicode(gpt2):
    text = HAMLET.read_text()
    ids = gpt2.encode(text)
    assert gpt2.decode(ids) == text
    assert len(ids) < len(text) / 2.5  # real BPE merges, not bytes
    assert max(ids) < gpt2.vocab_size
    assert gpt2.decode(gpt2.encode(UNICODE_TEXT)) == UNICODE_TEXT


@needs_shared
def test_tiktoken_array_path_equals_the_list_path(gpt2):
    """`titan tokenize` encodes through `encode_array` (tiktoken's buffer, no Python int per token): the same ids
    as `encode` for prose, special-token names, a run long enough to be cut, no text, a lone surrogate."""
    texts = [HAMLET.read_text()[:20000], "a <|begin_of_text|> b <|end_of_text|>", "x" * 50000 + " y", "",
             UNICODE_TEXT, "bad \ud800 surrogate"]
    dtype = token_dtype(gpt2.vocab_size)
    for text in texts:
        array = gpt2.encode_array(text)
        assert array.dtype == np.uint32 and array.tolist() == gpt2.encode(text)
        wrapped = wrap_document(text, gpt2, dtype)
        assert wrapped.tolist() == [gpt2.bos_id, *gpt2.encode(text), gpt2.eos_id]


def test_llama3_special_token_layout():
    names = llama3_special_tokens()
    # Meta's Llama 3: 128000 <|begin_of_text|>, 128001 <|end_of_text|>, 128006/7 headers,
    # 128009 <|eot_id|>, 128255 <|reserved_special_token_250|>.
    assert len(names) == 256 and len(set(names)) == 256
    assert names[0] == "<|begin_of_text|>" and names[1] == "<|end_of_text|>"
    assert names[6:10] == ["<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
    assert names[10] == "<|reserved_special_token_5|>"
    assert names[255] == "<|reserved_special_token_250|>"


def test_split_long_runs_keeps_text_and_bounds_runs():
    text = "ab" + " " * 7 + "cdefghijklmno pq" + "x" * 10
    pieces = list(split_long_runs(text, 3))
    assert "".join(pieces) == text
    for piece in pieces:
        run, longest = 0, 0
        for prev, ch in zip(" " + piece, piece):
            run = run + 1 if prev.isspace() == ch.isspace() else 1
            longest = max(longest, run)
        assert longest <= 3, piece
    assert list(split_long_runs("short text", 3000)) == ["short text"]


@needs_shared
def test_build_tokenizer_finds_tiktoken_files(tmp_path):
    # A folder holding *.tiktoken, and a folder holding tokenizer.model (Llama 3's name).
    by_folder = build_tokenizer(GPT2_RANKS.parent)
    assert isinstance(by_folder, TiktokenTokenizer) and by_folder.bos_id == 50256
    shutil.copy(GPT2_RANKS, tmp_path / "tokenizer.model")
    by_model = build_tokenizer(str(tmp_path))
    assert isinstance(by_model, TiktokenTokenizer) and by_model.vocab_size == 50256 + 256
    assert by_model.decode(by_model.encode(UNICODE_TEXT)) == UNICODE_TEXT


# ---------------------------------------------------------------- Hugging Face


def train_tiny_bpe(folder: Path, specials: list[str]) -> Path:
    """A byte-level BPE tokenizer.json trained on a few lines, saved in `folder`."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    lines = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer"] * 20
    tok.train_from_iterator(lines, trainer=trainer)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_tokenizer_round_trip_and_config_specials(tmp_path):
    path = train_tiny_bpe(tmp_path, ["<s>", "</s>", "<|custom|>"])  # trainer gives specials ids 0, 1, 2
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<|custom|>", "lstrip": False}, "eos_token": "</s>"})
    )
    tok = build_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.bos_id, tok.eos_id) == (2, 1)
    for text in ["To be, or not to be", UNICODE_TEXT]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(i < tok.vocab_size for i in ids)
        assert not {0, 1, 2} & set(ids)  # no specials added
    assert len(tok.encode("to be, or not to be")) < len("to be, or not to be")  # merges learned
    assert tok.vocab_size >= 259  # 3 specials + 256 bytes at least

    # Without a config: the common names (<s>, </s>) are found.
    (tmp_path / "tokenizer_config.json").unlink()
    tok = HFTokenizer(path)
    assert (tok.bos_id, tok.eos_id) == (0, 1)


def test_hf_tokenizer_without_known_specials_names_the_config(tmp_path):
    path = train_tiny_bpe(tmp_path, ["<pad>"])
    with pytest.raises(ValueError, match="tokenizer_config.json") as err:
        HFTokenizer(path)
    assert "bos_token" in str(err.value) and "\n" not in str(err.value)


def test_build_tokenizer_prefers_tokenizer_json(tmp_path):
    train_tiny_bpe(tmp_path, ["<s>", "</s>"])
    (tmp_path / "other.tiktoken").write_text("IQ== 0\n")
    assert isinstance(build_tokenizer(tmp_path), HFTokenizer)
    assert isinstance(build_tokenizer(tmp_path / "tokenizer.json"), HFTokenizer)


# ---------------------------------------------------------------- errors


def test_build_tokenizer_errors_name_the_path_and_key(tmp_path):
    missing = tmp_path / "no" / "such" / "assets"
    with pytest.raises(FileNotFoundError) as err:
        build_tokenizer(str(missing))
    message = str(err.value)
    assert str(missing) in message and "model.hf_assets_path" in message and "\n" not in message

    with pytest.raises(FileNotFoundError) as err:
        build_tokenizer(tmp_path)  # exists, holds nothing
    message = str(err.value)
    assert str(tmp_path) in message and "tokenizer.json" in message and "tokenizer.model" in message
    assert "model.hf_assets_path" in message and "\n" not in message

    junk = tmp_path / "tokenizer.model"
    junk.write_bytes(b"\x0a\x08\x00\xff binary sentencepiece-ish")
    with pytest.raises(ValueError) as err:
        build_tokenizer(tmp_path)
    assert str(junk) in str(err.value) and "model.hf_assets_path" in str(err.value)


def test_split_long_runs_cuts_where_the_regex_scan_cuts():
    """The window pre-check (`_may_have_long_run`) skips the regex scan only where it would find nothing:
    random texts of runs around the limit cut exactly as the scan alone cuts them."""
    import random
    import re

    def scan_only(text: str, max_run: int) -> list[str]:
        start, out = 0, []
        for run in re.finditer(rf"(?<!\s)\s{{{max_run + 1},}}|(?<!\S)\S{{{max_run + 1},}}", text):
            for cut in range(run.start() + max_run, run.end(), max_run):
                out.append(text[start:cut])
                start = cut
        return [*out, text[start:]]

    rng = random.Random(0)
    for _ in range(2000):
        max_run = rng.randint(1, 12)
        alphabet = rng.choice([["a", "b", " ", "\n", "é"], ["a"] * 5 + [" "], [" "] * 5 + ["x"]])
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))
        assert list(split_long_runs(text, max_run)) == scan_only(text, max_run), (text, max_run)


def test_tokenize_tasks_spread_long_documents_and_keep_the_order():
    from titan_core.data.token_shards import _DOCS_PER_TASK, _TASK_CHARS, _tasks

    books = ["x" * (_TASK_CHARS // 2 + 1)] * 4  # two do not fit in one task
    assert [len(t) for t in _tasks(books)] == [1, 1, 1, 1]
    lines = [f"line {i}" for i in range(2 * _DOCS_PER_TASK + 3)]
    tasks = list(_tasks(lines))
    assert [len(t) for t in tasks] == [_DOCS_PER_TASK, _DOCS_PER_TASK, 3]
    assert [doc for task in tasks for doc in task] == lines
