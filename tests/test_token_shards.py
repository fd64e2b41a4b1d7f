"""Pre-tokenized data: `titan tokenize`, the shard format, and `TokenShardLoader` against `PackedLoader`.

Expected batches come from `PackedLoader` (tokenizing on the fly), never from the code under
test; the end-to-end proof is a 2-process `titan train` on shards whose losses equal the same
run on the raw text files.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from titan_run import REPO, TINY, ListSource, losses, run_titan, run_titan_shared, titan_env
import warm_python
from typer.testing import CliRunner

from titan_cli.main import app
from titan_core.data import (
    ByteTokenizer,
    LocalFileSource,
    PackedLoader,
    TokenShardLoader,
    build_loader,
    read_manifest,
    write_token_shards,
)
from titan_core.data.local_files import expand_pattern
from titan_core.data.token_shards import token_dtype

SHARED = REPO.parent / "shared" / "data"
GPT2_RANKS = SHARED / "tokenizers" / "gpt2.tiktoken"
HAMLET = SHARED / "shakespeare" / "hamlet_gut.txt"
BOS, EOS = 256, 257

# Documents of assorted lengths (shorter than a sample, empty, longer than a shard), incl. non-ASCII.
DOCS = ["a", "hello world", "ünïcödé ✓", "", "x" * 37, "the quick brown fox jumps over the lazy dog", "z" * 5]


class BigVocabTokenizer:
    """A tokenizer whose vocabulary does not fit uint16: ids are code points + 60000."""

    bos_id, eos_id, vocab_size = 69_998, 69_999, 70_000

    def encode(self, text):
        return [60_000 + ord(ch) % 9_000 for ch in text]

    def decode(self, ids):
        return ""

    def fingerprint(self):
        return "big-vocab-test-v1"


def shards(tmp_path, docs=DOCS, shard_tokens=20, tokenizer=None, name="shards"):
    write_token_shards(ListSource(docs), tokenizer or ByteTokenizer(), tmp_path / name, shard_tokens=shard_tokens)
    return tmp_path / name


def samples_of(batch):
    inputs, labels = batch
    assert inputs.dtype == labels.dtype == torch.int64 and inputs.shape == labels.shape
    return torch.cat([inputs, labels[:, -1:]], dim=1).tolist()  # (B, seq_len + 1)


def write_corpus(folder: Path) -> Path:
    """A folder of .txt/.jsonl files (one nested), some documents longer than a sample."""
    (folder / "sub").mkdir(parents=True)
    text = HAMLET.read_text()[:3000] if HAMLET.exists() else "To be, or not to be. " * 150
    (folder / "a.txt").write_text(text[:1200])
    (folder / "sub" / "c.txt").write_text("ünïcödé ✓\n" + text[1200:2000])
    (folder / "b.jsonl").write_text("\n".join(json.dumps({"text": text[i : i + 300]}) for i in range(2000, 3000, 300)))
    return folder


# ---------------------------------------------------------------- titan tokenize


def test_titan_tokenize_writes_a_manifest_and_memmap_shards(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    proc = warm_python.run(
        [sys.executable, "-m", "titan_cli", "tokenize", str(corpus / "**" / "*.*"), "--output", str(out), "--shard-tokens", "500"],
        env=titan_env(), cwd=REPO, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--training.dataset_path" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["format"], manifest["version"], manifest["dtype"]) == ("titan-token-shards", 1, "uint16")
    assert (manifest["vocab_size"], manifest["bos_id"], manifest["eos_id"], manifest["tokenizer"]) == (258, BOS, EOS, "byte-v1")
    # The expected stream, by hand from the spec: every document of the sorted files, [BOS] + utf8 + [EOS].
    texts = list(LocalFileSource(expand_pattern(str(corpus), "test")))
    assert len(texts) == manifest["total_documents"] == 6
    expected = [t for text in texts for t in [BOS, *text.encode("utf-8"), EOS]]
    stream, bounds = [], [0]
    assert len(manifest["shards"]) > 1
    for shard in manifest["shards"]:
        tokens = np.fromfile(out / shard["tokens"], dtype=np.uint16)
        index = np.fromfile(out / shard["index"], dtype=np.int64)
        assert len(tokens) == shard["n_tokens"] and len(index) == shard["n_documents"] + 1
        assert index[0] == 0 and index[-1] == len(tokens) and (tokens[index[:-1]] == BOS).all()
        bounds += [bounds[-1] + int(i) for i in index[1:]]
        stream += tokens.tolist()
    assert stream == expected and manifest["total_tokens"] == len(expected)
    assert bounds[1:] == list(np.cumsum([len(t.encode("utf-8")) + 2 for t in texts]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out"]  # no temporary folder left

    # A folder input names the same files, so the same stream: --force replaces the output.
    result = CliRunner().invoke(app, ["tokenize", str(corpus), "--output", str(out), "--force", "--workers", "2"])
    assert result.exit_code == 0, result.output
    again = read_manifest(out)
    assert len(again.shards) == 1 and again.total_tokens == len(expected)  # the default shard size
    assert np.fromfile(out / again.shards[0].tokens, np.uint16).tolist() == expected


def test_existing_output_without_force_is_one_line_exit_2_and_untouched(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    out = shards(tmp_path, name="out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = CliRunner().invoke(app, ["tokenize", str(corpus), "--output", str(out)])
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "already exists" in result.output and "--force" in result.output
    assert str(out) in result.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # --force never deletes a folder that is not token shards.
    result = CliRunner().invoke(app, ["tokenize", str(corpus), "--output", str(corpus), "--force"])
    assert result.exit_code == 2 and "not a token-shard folder" in result.output
    assert (corpus / "a.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out"]


def test_an_error_midway_leaves_nothing_behind(tmp_path):
    class Failing(ByteTokenizer):
        def encode(self, text):
            if text == "x" * 37:
                raise KeyboardInterrupt  # as Ctrl-C would
            return super().encode(text)

    with pytest.raises(KeyboardInterrupt):
        write_token_shards(ListSource(DOCS), Failing(), tmp_path / "out", shard_tokens=5)
    assert list(tmp_path.iterdir()) == []


def test_records_without_the_text_field_name_the_option_and_leave_nothing(tmp_path):
    corpus = tmp_path / "notes.jsonl"
    corpus.write_text('{"text": "one"}\n{"body": "two"}\n')
    result = CliRunner().invoke(app, ["tokenize", str(corpus), "--output", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"titan tokenize: error: {corpus}:2 has no field 'text' (has ['body']); "
        "set --dataset-text-field to the field of the text"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.jsonl"]


def test_dtype_is_uint16_up_to_65536_tokens_else_uint32(tmp_path):
    assert token_dtype(258) == token_dtype(65_536) == np.uint16
    assert token_dtype(65_537) == np.uint32
    folder = shards(tmp_path, tokenizer=BigVocabTokenizer(), shard_tokens=1000)
    manifest = read_manifest(folder)
    assert manifest.dtype == "uint32"
    tokens = np.fromfile(folder / manifest.shards[0].tokens, dtype=np.uint32).tolist()
    tok = BigVocabTokenizer()
    assert tokens == [t for doc in DOCS for t in [tok.bos_id, *tok.encode(doc), tok.eos_id]]
    expected = PackedLoader(ListSource(DOCS), tok, 9, 3)
    loader = TokenShardLoader(folder, 9, 3, prefetch=0, tokenizer=tok)
    for _ in range(5):
        assert samples_of(next(loader)) == samples_of(next(expected))


def test_fingerprints_follow_the_tokenizer_files_not_their_paths(tmp_path):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers

    from titan_core.data import HFTokenizer, TiktokenTokenizer, tokenizer_fingerprint

    assert tokenizer_fingerprint(ByteTokenizer()) == "byte-v1"
    assert tokenizer_fingerprint(BigVocabTokenizer()) == "big-vocab-test-v1"
    with pytest.raises(TypeError, match="fingerprint"):
        tokenizer_fingerprint(object())
    # An HF tokenizer.json: the same bytes elsewhere give the same fingerprint; another BOS/EOS config does not.
    rust = RustTokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "a": 2, "b": 3}, unk_token="a"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        rust.save(str(tmp_path / name / "tokenizer.json"))
    one, two = HFTokenizer(tmp_path / "one" / "tokenizer.json"), HFTokenizer(tmp_path / "two" / "tokenizer.json")
    assert tokenizer_fingerprint(one) == tokenizer_fingerprint(two) and tokenizer_fingerprint(one).startswith("hf-sha256:")
    (tmp_path / "two" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "</s>"}))
    assert tokenizer_fingerprint(HFTokenizer(tmp_path / "two" / "tokenizer.json")) != tokenizer_fingerprint(one)
    if GPT2_RANKS.exists():  # tiktoken: the ranks file and the split pattern
        (tmp_path / "copy.tiktoken").write_bytes(GPT2_RANKS.read_bytes())
        from titan_core.data import GPT2_PATTERN

        gpt2 = tokenizer_fingerprint(TiktokenTokenizer(GPT2_RANKS))
        assert gpt2 == tokenizer_fingerprint(TiktokenTokenizer(tmp_path / "copy.tiktoken")) and gpt2.startswith("tiktoken-sha256:")
        assert gpt2 != tokenizer_fingerprint(TiktokenTokenizer(GPT2_RANKS, pattern=GPT2_PATTERN))


# ---------------------------------------------------------------- the loader against PackedLoader


@pytest.mark.parametrize("dp_world, seq_len, batch", [(1, 7, 2), (2, 7, 2), (3, 5, 1), (4, 16, 3)])
def test_shard_batches_equal_packed_loader_batches(tmp_path, dp_world, seq_len, batch):
    folder = shards(tmp_path)  # several shards, samples crossing shard ends and the corpus' end
    expected = [PackedLoader(ListSource(DOCS), ByteTokenizer(), seq_len, batch, r, dp_world) for r in range(dp_world)]
    loaders = [TokenShardLoader(folder, seq_len, batch, r, dp_world, prefetch=r % 2 * 2) for r in range(dp_world)]
    for _ in range(12):  # several epochs of the 102-token corpus
        for mine, reference in zip(loaders, expected):
            assert samples_of(next(mine)) == samples_of(next(reference))
    assert {json.dumps(loader.state_dict()) for loader in loaders} == {json.dumps(loaders[0].state_dict())}
    assert loaders[0].state_dict()["samples_consumed"] == expected[0].samples_consumed
    for loader in loaders:
        loader.close()


def test_state_from_two_ranks_resumes_on_one_identically(tmp_path):
    folder = shards(tmp_path)
    ranks = [TokenShardLoader(folder, 6, 2, r, 2) for r in range(2)]
    for _ in range(3):
        for loader in ranks:
            next(loader)
    state = json.loads(json.dumps(ranks[0].state_dict()))  # what a checkpoint stores
    assert state == ranks[1].state_dict()
    one = TokenShardLoader(folder, 6, 4, 0, 1)
    one.load_state_dict(state)
    reference = PackedLoader(ListSource(DOCS), ByteTokenizer(), 6, 4, 0, 1)
    for _ in range(3):
        next(reference)  # the same 12 global samples consumed
    for _ in range(4):
        two = samples_of(next(ranks[0])) + samples_of(next(ranks[1]))
        assert samples_of(next(one)) == two == samples_of(next(reference))
    for loader in (*ranks, one):
        loader.close()


def test_prefetch_on_and_off_give_the_same_batches_and_state(tmp_path):
    folder = shards(tmp_path)
    off = TokenShardLoader(folder, 8, 3, 1, 2, prefetch=0)
    on = TokenShardLoader(folder, 8, 3, 1, 2, prefetch=3)
    for step in range(10):
        assert samples_of(next(on)) == samples_of(next(off))
        time.sleep(0.01 * (step == 2))  # let the thread run ahead: the state counts consumed batches only
        assert on.state_dict() == off.state_dict()
    # Resuming mid-prefetch discards what was read ahead.
    state = off.state_dict()
    for _ in range(2):
        next(on)
    on.load_state_dict(state)
    assert samples_of(next(on)) == samples_of(next(off))
    thread = on._prefetcher.thread
    on.close()
    assert not thread.is_alive()
    # A loader dropped without close() (e.g. a validation pass's) stops its thread.
    dropped = TokenShardLoader(folder, 8, 3, prefetch=2)
    next(dropped)
    thread = dropped._prefetcher.thread
    del dropped
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive() and thread not in threading.enumerate()


def test_foreign_states_are_refused_in_one_line(tmp_path):
    folder = shards(tmp_path)
    loader = TokenShardLoader(folder, 8, 2, prefetch=0)
    packed = PackedLoader(ListSource(DOCS), ByteTokenizer(), 8, 2)
    next(packed)
    with pytest.raises(ValueError) as info:
        loader.load_state_dict(packed.state_dict())
    assert "\n" not in str(info.value) and "training.dataset_path" in str(info.value)
    assert "exclude_from_loading" in str(info.value)
    other = TokenShardLoader(folder, 4, 2, prefetch=0).state_dict()
    with pytest.raises(ValueError, match=r"training\.seq_len=4.*resume with the same training\.seq_len") as info:
        loader.load_state_dict(other)
    assert "\n" not in str(info.value)
    assert loader.state_dict()["samples_consumed"] == 0


def test_build_loader_picks_the_loader_by_the_dataset(tmp_path):
    folder = shards(tmp_path)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("hello")
    args = dict(seq_len=4, local_batch_size=1, prefetch=0)
    assert isinstance(build_loader("stdlib", str(folder), "text", ByteTokenizer(), **args), TokenShardLoader)
    assert isinstance(build_loader(str(folder), None, "text", ByteTokenizer(), **args), TokenShardLoader)
    assert isinstance(build_loader("stdlib", str(tmp_path / "text"), "text", ByteTokenizer(), **args), PackedLoader)


@pytest.mark.skipif(not GPT2_RANKS.exists(), reason="shared test data not present")
def test_a_tokenizer_mismatch_is_one_line_exit_2_and_writes_nothing(tmp_path):
    folder = shards(tmp_path)
    run = tmp_path / "run"
    proc = run_titan(run, *TINY, "--training.dataset_path", str(folder), "--model.hf_assets_path", str(GPT2_RANKS),
                     check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("titan: error: training.dataset_path=") and "model.hf_assets_path" in line, line
    assert "titan tokenize" in line and "byte-v1" in line
    assert not run.exists()


# ---------------------------------------------------------------- parity: a real run


def test_training_on_shards_matches_training_on_the_text_files(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    result = CliRunner().invoke(app, ["tokenize", str(corpus), "--output", str(tmp_path / "shards")])
    assert result.exit_code == 0, result.output
    # File order: shuffling (training.shuffle, on by default) applies to token shards only, text stays in order.
    run = [*TINY, "--training.steps", "4", "--training.local_batch_size", "2", "--training.shuffle", "false"]
    runs = {tmp_path / "text": [*run, "--training.dataset_path", str(corpus)],
            tmp_path / "tokens": [*run, "--training.dataset_path", str(tmp_path / "shards")]}  # fmt: skip
    done = run_titan_shared(runs, nproc=2)  # both in one launch
    for folder in runs.keys() - done:  # failed there: alone, to report the error
        run_titan(folder, *runs[folder], nproc=2)
    assert len(losses(tmp_path / "text")) == 4
    assert losses(tmp_path / "tokens") == losses(tmp_path / "text")
