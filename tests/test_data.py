"""Corpus sources and the packed loader: order, sharding, resume, world-size changes."""

import json
import sysconfig
from itertools import islice
from pathlib import Path

import pytest
import torch

from titan_core.data import (
    ByteTokenizer,
    DocumentSource,
    LocalFileSource,
    PackedLoader,
    StdlibSource,
    build_loader,
    build_source,
)
from titan_core.data.hf_dataset import HFDatasetSource

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
HAMLET = SHARED / "shakespeare" / "hamlet_gut.txt"
BOS, EOS = 256, 257


class ListSource:
    """Documents from a list; records which document indices were read."""

    def __init__(self, docs):
        self.docs = docs
        self.read = []

    def __iter__(self):
        return self.skip(0)

    def skip(self, n_docs):
        for index in range(n_docs, len(self.docs)):
            self.read.append(index)
            yield self.docs[index]


# Documents of assorted lengths (some shorter than a sample, one much longer), incl. non-ASCII.
DOCS = ["a", "hello world", "ünïcödé ✓", "", "x" * 37, "the quick brown fox jumps over the lazy dog", "z" * 5]


def expected_samples(docs, seq_len, n_samples):
    """The global samples, worked out by hand from the spec: [BOS] + utf8 + [EOS], looped, cut."""
    stream = []
    while len(stream) < n_samples * (seq_len + 1):
        for doc in docs:
            stream += [BOS] + list(doc.encode("utf-8")) + [EOS]
    return [stream[i * (seq_len + 1) : (i + 1) * (seq_len + 1)] for i in range(n_samples)]


def global_batch(loaders):
    """One step of every rank's loader, the rank batches in rank order, as lists of samples."""
    samples = []
    for loader in loaders:
        inputs, labels = next(loader)
        assert inputs.dtype == labels.dtype == torch.int64
        assert inputs.shape == labels.shape == (loader.local_batch_size, loader.seq_len)
        assert (inputs[:, 1:] == labels[:, :-1]).all()  # labels are inputs shifted by one
        samples += [row_in + [row_lab[-1]] for row_in, row_lab in zip(inputs.tolist(), labels.tolist())]
    return samples


def make_loaders(source, seq_len, batch, world):
    return [PackedLoader(source, ByteTokenizer(), seq_len, batch, rank, world) for rank in range(world)]


# ---------------------------------------------------------------- sources


def test_stdlib_source_yields_the_standard_library():
    source = build_source("stdlib", None)
    assert isinstance(source, DocumentSource)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = source.files
    assert len(files) > 100
    assert files == sorted(files, key=lambda p: p.relative_to(root).as_posix())
    assert root / "os.py" in files
    skipped = {"test", "tests", "idlelib", "site-packages", "lib2to3"}
    assert not any(part in skipped for f in files for part in f.relative_to(root).parts)
    first_six = list(islice(source, 6))
    assert first_six == list(islice(source, 6))  # re-iterable, same order
    assert next(source.skip(5)) == first_six[5]
    index = files.index(root / "os.py")
    assert next(source.skip(index)) == (root / "os.py").read_text(encoding="utf-8")


def test_stdlib_source_skips_folders_and_falls_back_offline(tmp_path):
    for rel in ["b.py", "a.py", "pkg/c.py", "v8.py", "pkg/notes.txt", "test/t.py", "tests/t.py", "idlelib/i.py",
                "site-packages/s.py", "lib2to3/l.py", "pkg/tests/t.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    # v8.py is validation's: zlib.crc32(b"v8.py") % 20 == 0 (the corpus module's rule); the others are training's
    assert list(StdlibSource(tmp_path)) == ["# a.py\n", "# b.py\n", "# pkg/c.py\n"]
    assert list(StdlibSource(tmp_path).skip(2)) == ["# pkg/c.py\n"]
    assert list(StdlibSource(tmp_path, split="validation")) == ["# v8.py\n"]
    assert list(StdlibSource(tmp_path, split="all")) == ["# a.py\n", "# b.py\n", "# pkg/c.py\n", "# v8.py\n"]

    empty = tmp_path / "stripped"
    empty.mkdir()
    fallback = list(StdlibSource(empty, split="all"))  # no .py files: the interpreter's own docstrings
    assert len(fallback) > 5
    assert fallback[0].startswith("builtins") and "print" in fallback[0]
    assert list(StdlibSource(empty, split="all").skip(3)) == fallback[3:]
    # split by index there: every 20th document, from the first, is validation's
    assert list(StdlibSource(empty, split="validation")) == fallback[::20]
    assert list(StdlibSource(empty)) == [doc for i, doc in enumerate(fallback) if i % 20]


def test_the_stdlib_corpus_holds_out_validation_files_that_training_never_reads():
    every = StdlibSource(split="all").files
    train, held_out = build_source("stdlib").files, build_source("stdlib", split="validation").files
    assert not set(train) & set(held_out) and sorted(train + held_out) == sorted(every)
    assert 0.02 * len(every) < len(held_out) < 0.1 * len(every)
    # the loaders: training and validation read different text from their first batch on
    first = {}
    for section in ("training", "validation"):
        loader = build_loader("stdlib", None, "text", ByteTokenizer(), seq_len=64, local_batch_size=2, section=section)
        first[section] = next(iter(loader))[0]
    assert not torch.equal(first["training"], first["validation"])
    validation_text = bytes(first["validation"][0, 1:].tolist()).decode("utf-8", errors="replace")
    assert validation_text in held_out[0].read_text(encoding="utf-8")  # the first held-out file's start


def test_validation_on_the_training_data_is_named_in_a_warning(tmp_path):
    from titan_core.config import load_config
    from titan_core.validation import training_overlap

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a"}\n')
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "b"}\n')

    def overlap(*overrides: str) -> str | None:
        return training_overlap(load_config(None, ["--validation.enable", *overrides]))

    assert overlap() is None  # stdlib on both sides: split
    assert overlap("--training.dataset_path", str(corpus), "--validation.dataset_path", str(other)) is None
    same = overlap("--training.dataset_path", str(corpus), "--validation.dataset_path", f"{tmp_path}/../{tmp_path.name}/corpus.jsonl")
    assert same == (
        f"validation.dataset_path reads what training trains on (training.dataset_path = {corpus}): the validation "
        "loss measures the fit to text the run has seen, not to held-out text; point validation.dataset_path at "
        "other files"
    )
    mix = json.dumps([{"path": "stdlib", "weight": 1}, {"path": str(corpus), "weight": 1}])
    assert f"(training.dataset_mix[1].path = {corpus})" in overlap(
        "--training.dataset_mix", mix, "--validation.dataset", str(corpus)
    )
    assert overlap("--training.dataset", "allenai/c4", "--validation.dataset", "allenai/c4") is None  # its splits
    assert overlap("--training.dataset", str(corpus), "--validation.dataset", str(corpus)).startswith(
        f"validation.dataset reads what training trains on (training.dataset = {corpus})"
    )


def write_local_corpus(folder):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    (folder / "b.txt").write_text("a whole text file\nis one document ✓\n")
    lines = [json.dumps({"text": f"json doc {i}", "id": i}) for i in range(3)]
    (folder / "a.jsonl").write_text(lines[0] + "\n\n" + lines[1] + "\n" + lines[2] + "\n")
    table = pa.table({"text": [f"parquet row {i}" for i in range(5)], "n": list(range(5))})
    pq.write_table(table, folder / "c.parquet", row_group_size=2)  # row groups of 2, 2, 1
    (folder / "sub").mkdir()
    (folder / "sub" / "d.txt").write_text("nested")
    (folder / "ignored.csv").write_text("x,y\n")
    return ["json doc 0", "json doc 1", "json doc 2", "a whole text file\nis one document ✓\n"] + [
        f"parquet row {i}" for i in range(5)
    ] + ["nested"]


def test_local_sources_txt_jsonl_parquet(tmp_path):
    expected = write_local_corpus(tmp_path / "corpus")
    source = build_source("ignored-when-a-path-is-set", str(tmp_path / "corpus"))
    assert isinstance(source, LocalFileSource)
    assert list(source) == expected
    assert list(source) == expected  # a second epoch, same order
    for n in range(len(expected) + 2):
        assert list(source.skip(n)) == expected[n:], n
    # The dataset key itself may be a path or a glob.
    assert list(build_source(str(tmp_path / "corpus"), None)) == expected
    assert list(build_source(str(tmp_path / "corpus" / "*.jsonl"), None)) == expected[:3]
    assert list(build_source("x", str(tmp_path / "corpus" / "**" / "*.txt"))) == [expected[3], "nested"]
    assert list(build_source("x", str(tmp_path / "corpus" / "c.parquet")).skip(3)) == expected[7:9]


def test_local_sources_other_text_field_and_errors(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"content": "one"}\n{"content": "two"}\n')
    assert list(build_source("x", str(tmp_path / "d.jsonl"), text_field="content")) == ["one", "two"]
    with pytest.raises(ValueError) as err:
        list(build_source("x", str(tmp_path / "d.jsonl")))
    assert str(err.value) == (
        f"{tmp_path / 'd.jsonl'}:1 has no field 'text' (has ['content']); "
        "set training.dataset_text_field to the field of the text"
    )

    pattern = str(tmp_path / "nothing" / "*.txt")
    with pytest.raises(FileNotFoundError) as err:
        build_source("stdlib", pattern)
    assert "training.dataset_path" in str(err.value) and pattern in str(err.value) and "\n" not in str(err.value)
    missing = str(tmp_path / "missing_dir")
    with pytest.raises(FileNotFoundError) as err:
        build_source("stdlib", missing)
    assert "training.dataset_path" in str(err.value) and missing in str(err.value)
    # validation's data is named by validation's keys
    with pytest.raises(FileNotFoundError) as err:
        build_loader("stdlib", missing, "text", ByteTokenizer(), seq_len=8, local_batch_size=1, section="validation")
    assert str(err.value).startswith(f"validation.dataset_path: {missing} does not exist"), str(err.value)
    with pytest.raises(FileNotFoundError) as err:
        build_loader(missing, None, "text", ByteTokenizer(), seq_len=8, local_batch_size=1, section="validation")
    assert str(err.value).startswith(f"validation.dataset: {missing} does not exist"), str(err.value)


def test_hub_dataset_offline_error_names_the_key(monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError) as err:
        build_source("nobody-titan-test/no-such-dataset", None)
    message = str(err.value)
    assert "training.dataset" in message and "stdlib" in message and "unreachable" in message
    assert "\n" not in message


def test_validation_reads_a_hub_datasets_validation_split(monkeypatch):
    """Training streams a hub dataset's `train` split, validation its `validation` split (the hub replaced by
    in-memory datasets of the same kind, `IterableDataset`s, that record which split was asked for)."""
    datasets = pytest.importorskip("datasets")
    splits = {"train": ["seen in training"] * 3, "validation": ["held out"] * 3}
    asked = []

    def load_dataset(path, name=None, *, split, streaming):
        asked.append((path, split, streaming))
        if split not in splits:
            raise ValueError(f'Unknown split "{split}". Should be one of {list(splits)}.')
        return datasets.Dataset.from_list([{"text": t} for t in splits[split]]).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    texts = {}
    for section in ("training", "validation"):
        loader = build_loader("org/corpus", None, "text", ByteTokenizer(), seq_len=8, local_batch_size=1, section=section)
        texts[section] = bytes(next(iter(loader))[0][0, 1:].tolist()).decode()
    assert asked == [("org/corpus", "train", True), ("org/corpus", "validation", True)]
    assert texts == {"training": "seen in", "validation": "held ou"}
    splits.pop("validation")
    with pytest.raises(ValueError) as err:
        build_source("org/corpus", None, split="validation", section="validation")
    assert str(err.value).startswith("validation.dataset: could not load the 'validation' split of 'org/corpus'")
    assert 'Unknown split "validation"' in str(err.value) and "\n" not in str(err.value)


def test_a_hub_dataset_of_several_configs_takes_one_after_a_colon(tmp_path, monkeypatch):
    """`NAME:CONFIG` (as `allenai/c4:en`), on a real `datasets` dataset of two configs: a local folder whose
    README declares them, which `load_dataset` reads as it reads a hub repository's, offline."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "corpus"
    (repo / "en").mkdir(parents=True)
    (repo / "de").mkdir()
    (repo / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: en\n  data_files:\n  - split: train\n    path: en/train.jsonl\n"
        "  - split: validation\n    path: en/validation.jsonl\n"
        "- config_name: de\n  data_files:\n  - split: train\n    path: de/train.jsonl\n---\n"
    )
    (repo / "en" / "train.jsonl").write_text('{"text": "hello"}\n')
    (repo / "en" / "validation.jsonl").write_text('{"text": "held out"}\n')
    (repo / "de" / "train.jsonl").write_text('{"text": "hallo"}\n')
    assert list(HFDatasetSource(f"{repo}:de")) == ["hallo"]
    assert list(HFDatasetSource(f"{repo}:en", split="validation", key="validation.dataset")) == ["held out"]
    with pytest.raises(ValueError) as missing:
        HFDatasetSource(str(repo))
    message = str(missing.value)
    assert message.startswith(f"training.dataset: could not load the 'train' split of '{repo}'"), message
    assert "Config name is missing. Please pick one among the available configs: ['en', 'de']" in message
    assert message.endswith(f"name one after a colon ({repo}:CONFIG)") and "\n" not in message
    with pytest.raises(ValueError) as unknown:
        HFDatasetSource(f"{repo}:fr")
    assert "BuilderConfig 'fr' not found. Available: ['en', 'de']" in str(unknown.value)
    assert str(unknown.value).endswith("point training.dataset at local .txt/.jsonl/.parquet files (a file, folder "
                                       "or glob), or 'stdlib'")


def test_json_files_are_read_when_named_and_left_out_of_a_folder_scan(tmp_path):
    """A `.json` file named or globbed reads as JSON Lines (what `datasets` writes) or as one array of objects, skips
    like the others; a folder's scan leaves `.json` out (a dataset's metadata files live there)."""
    lines, array = tmp_path / "lines.json", tmp_path / "array.json"
    lines.write_text('{"text": "a"}\n\n{"text": "b", "url": "x"}\n{"text": "c"}\n')
    array.write_text('  [{"text": "d"}, {"text": "e"}]')
    assert list(build_source("x", str(lines))) == ["a", "b", "c"]
    assert list(build_source("x", str(array))) == ["d", "e"]
    both = build_source("x", str(tmp_path / "*.json"))  # sorted: array.json first
    assert [list(both.skip(n)) for n in (0, 1, 2, 4)] == [["d", "e", "a", "b", "c"], ["e", "a", "b", "c"],
                                                          ["a", "b", "c"], ["c"]]  # fmt: skip
    (tmp_path / "doc.txt").write_text("from the folder")
    assert list(build_source("x", str(tmp_path))) == ["from the folder"]
    (tmp_path / "bad.json").write_text('[{"content": "f"}]')
    with pytest.raises(ValueError) as err:
        list(build_source("x", str(tmp_path / "bad.json")))
    assert str(err.value) == (f"{tmp_path / 'bad.json'} (record 0) has no field 'text' (has ['content']); "
                              "set training.dataset_text_field to the field of the text")  # fmt: skip


def test_torchtitans_dataset_names_read_what_torchtitan_reads(tmp_path, monkeypatch):
    """`c4_test` is torchtitan's test corpus under the working directory (a checkout's tests/assets/c4_test/data.json,
    JSON Lines); `c4` and `c4_validation` are the hub's allenai/c4 `en` config, train and validation splits (the hub
    replaced by an in-memory dataset that records what was asked); a local path of that name wins."""
    datasets = pytest.importorskip("datasets")
    from titan_core.run_banner import describe_dataset

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        build_source("c4_test", None)
    assert str(err.value).startswith("training.dataset: 'c4_test' is torchtitan's test corpus, which it reads from "
                                     "tests/assets/c4_test/*.json under the working directory")  # fmt: skip
    (tmp_path / "tests" / "assets" / "c4_test").mkdir(parents=True)
    (tmp_path / "tests" / "assets" / "c4_test" / "data.json").write_text(
        '{"text": "Beginners BBQ Class", "timestamp": "2019-04-25T12:57:54Z", "url": "https://example.com"}\n'
        '{"text": "Discussion in Windows 10", "timestamp": "2019-04-21T10:07:13Z", "url": "https://example.org"}\n'
    )
    assert list(build_source("c4_test", None)) == ["Beginners BBQ Class", "Discussion in Windows 10"]
    asked = []

    def load_dataset(path, name=None, *, split, streaming):
        asked.append((path, name, split))
        return datasets.Dataset.from_list([{"text": split}]).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert list(build_source("c4", None)) == ["train"]
    assert list(build_source("c4", None, split="validation", section="validation")) == ["validation"]
    assert list(build_source("c4_validation", None)) == ["validation"]  # torchtitan reads its validation split
    assert asked == [("allenai/c4", "en", "train"), ("allenai/c4", "en", "validation"),
                     ("allenai/c4", "en", "validation")]  # fmt: skip
    assert describe_dataset("c4_validation", None) == "c4_validation (torchtitan's name: allenai/c4:en, validation split)"
    (tmp_path / "c4").mkdir()
    (tmp_path / "c4" / "mine.txt").write_text("my own c4")
    assert list(build_source("c4", None)) == ["my own c4"]


# ---------------------------------------------------------------- loader


def test_loader_packs_documents_with_bos_eos_across_epochs():
    seq_len, batch = 8, 3
    loader = PackedLoader(ListSource(DOCS), ByteTokenizer(), seq_len, batch)
    total = sum(len(d.encode()) + 2 for d in DOCS)  # tokens in one epoch
    n_steps = 3 * total // (seq_len + 1) // batch + 2  # about three epochs
    got = [s for _ in range(n_steps) for s in global_batch([loader])]
    assert got == expected_samples(DOCS, seq_len, n_steps * batch)
    assert loader.epoch >= 2
    # BOS/EOS placement by hand: the stream opens [BOS] 'a' [EOS] [BOS] 'hello ...'.
    assert got[0] == [BOS, ord("a"), EOS, BOS] + list(b"hello")  # 9 = seq_len + 1 tokens
    assert got[1][:7] == list(b" world") + [EOS]  # sample 1 picks up right after "hello"


def test_rank_shares_are_disjoint_and_cover_the_single_process_batch():
    seq_len, batch, world = 6, 2, 4
    ranks = make_loaders(ListSource(DOCS), seq_len, batch, world)
    single = PackedLoader(ListSource(DOCS), ByteTokenizer(), seq_len, batch * world)
    for _ in range(5):
        per_rank = [next(loader) for loader in ranks]
        inputs, labels = next(single)
        assert (inputs == torch.cat([x for x, _ in per_rank])).all()
        assert (labels == torch.cat([y for _, y in per_rank])).all()
    states = [json.dumps(loader.state_dict(), sort_keys=True) for loader in ranks]
    assert len(set(states)) == 1  # identical on every rank
    assert json.loads(states[0]) == single.state_dict()


@pytest.mark.parametrize("steps_before", [1, 4, 9, 13])
def test_resume_mid_stream_gives_identical_batches(steps_before):
    seq_len, batch = 7, 2
    docs_per_epoch = len(DOCS)
    reference = PackedLoader(ListSource(DOCS), ByteTokenizer(), seq_len, batch)
    for _ in range(steps_before):
        next(reference)
    state = json.loads(json.dumps(reference.state_dict()))  # plain JSON data
    assert all(isinstance(v, int) for k, v in state.items() if k != "doc_digest")
    assert state["doc_digest"] is None if state["doc_offset"] == 0 else isinstance(state["doc_digest"], str)

    source = ListSource(DOCS)
    resumed = PackedLoader(source, ByteTokenizer(), seq_len, batch)
    resumed.load_state_dict(state)
    for _ in range(6):  # runs on across at least one epoch boundary
        a, b = next(reference), next(resumed)
        assert (a[0] == b[0]).all() and (a[1] == b[1]).all()
    # No document before the saved position was re-read.
    assert source.read[0] == state["doc_index"] % docs_per_epoch
    assert resumed.state_dict() == reference.state_dict()


def test_resume_across_an_epoch_boundary_state():
    seq_len, batch = 5, 1
    epoch_tokens = sum(len(d.encode()) + 2 for d in DOCS)
    loader = PackedLoader(ListSource(DOCS), ByteTokenizer(), seq_len, batch)
    steps = epoch_tokens // (seq_len + 1) + 1  # the first step that reads into epoch 1
    for _ in range(steps):
        next(loader)
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["samples_consumed"] == steps
    resumed = PackedLoader(ListSource(DOCS), ByteTokenizer(), seq_len, batch)
    resumed.load_state_dict(state)
    expected = expected_samples(DOCS, seq_len, steps + 4)[steps:]
    assert [s for _ in range(4) for s in global_batch([resumed])] == expected


def test_resume_into_other_world_sizes_continues_the_global_order():
    seq_len = 6
    got = []
    two = make_loaders(ListSource(DOCS), seq_len, batch=3, world=2)
    for _ in range(3):
        got += global_batch(two)  # 18 samples
    state = json.loads(json.dumps(two[1].state_dict()))
    assert state["samples_consumed"] == 18

    four = make_loaders(ListSource(DOCS), seq_len, batch=2, world=4)
    for loader in four:
        loader.load_state_dict(state)
    for _ in range(2):
        got += global_batch(four)  # 16 samples
    state = four[2].state_dict()

    one = make_loaders(ListSource(DOCS), seq_len, batch=5, world=1)
    one[0].load_state_dict(state)
    for _ in range(2):
        got += global_batch(one)  # 10 samples
    assert one[0].state_dict()["samples_consumed"] == 44
    assert got == expected_samples(DOCS, seq_len, 44)  # nothing repeated or skipped


def test_loader_errors_are_one_line():
    with pytest.raises(ValueError, match="training.seq_len"):
        PackedLoader(ListSource(DOCS), ByteTokenizer(), 0, 1)
    with pytest.raises(ValueError, match="dp_rank"):
        PackedLoader(ListSource(DOCS), ByteTokenizer(), 4, 1, dp_rank=2, dp_world=2)
    with pytest.raises(ValueError, match="no documents"):
        next(PackedLoader(ListSource([]), ByteTokenizer(), 4, 1))
    # A checkpoint's data position that does not fit this run's data: each refusal names the keys and the way on
    # from the data's start.
    skip = "or skip the data position with checkpoint.exclude_from_loading=['dataloader']"
    first = PackedLoader(ListSource(DOCS), ByteTokenizer(), 4, 1)
    saved = first.state_dict()
    with pytest.raises(ValueError, match="training.seq_len=4") as info:
        PackedLoader(ListSource(DOCS), ByteTokenizer(), 8, 1).load_state_dict(saved)
    assert str(info.value).endswith(skip)
    with pytest.raises(ValueError, match="does not come from PackedLoader") as info:
        first.load_state_dict({"format": "titan-token-shards", "seq_len": 4})
    assert "data keys" in str(info.value) and str(info.value).endswith(skip)
    for _ in range(3):  # past the first document: 3 x 5 tokens of the stream, inside document 1
        next(first)
    assert first.state_dict()["doc_index"] >= 1 and first.state_dict()["doc_offset"] > 0
    shorter = PackedLoader(ListSource(DOCS[:1]), ByteTokenizer(), 4, 1)
    shorter.load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="the dataset changed since the checkpoint") as info:
        next(shorter)
    assert str(info.value).endswith(skip)


def test_a_resume_on_other_text_under_the_same_position_is_refused():
    # The checkpoint was saved inside document 1 ("hello world"); the text there changed, its length did not.
    first = PackedLoader(ListSource(DOCS), ByteTokenizer(), 4, 1)
    for _ in range(3):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # as the checkpoint's JSON holds it
    assert (state["doc_index"], state["doc_offset"] > 0, len(state["doc_digest"])) == (1, True, 16)
    edited = [DOCS[0], "HELLO WORLD", *DOCS[2:]]
    resumed = PackedLoader(ListSource(edited), ByteTokenizer(), 4, 1)
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match="document 1 of .* is not the one the checkpoint was reading") as info:
        next(resumed)
    assert str(info.value).endswith("checkpoint.exclude_from_loading=['dataloader']")
    # The same text resumes, and a save before the document was read again keeps the digest to check.
    same = PackedLoader(ListSource(DOCS), ByteTokenizer(), 4, 1)
    same.load_state_dict(state)
    assert same.state_dict() == state
    assert [t.tolist() for t in next(same)] == [t.tolist() for t in next(first)]
    # A state saved before the digest was recorded still loads.
    old = PackedLoader(ListSource(edited), ByteTokenizer(), 4, 1)
    old.load_state_dict({k: v for k, v in state.items() if k != "doc_digest"})
    next(old)


def test_loader_over_real_sources():
    # The offline default: stdlib with the byte tokenizer, a whole epoch in well under a second.
    loader = PackedLoader(build_source("stdlib"), ByteTokenizer(), 1024, 16)
    first = StdlibSource().files[0].read_bytes()
    inputs, _ = next(loader)
    assert inputs[0, 0].item() == BOS
    assert inputs[0, 1 : 1 + min(len(first), 50)].tolist() == list(first[:50])
    while loader.epoch == 0:
        next(loader)
    assert loader.state_dict()["doc_index"] < 50
    if HAMLET.exists():
        hamlet = PackedLoader(build_source("x", str(HAMLET)), ByteTokenizer(), 64, 2)
        inputs, labels = next(hamlet)
        data = HAMLET.read_bytes()
        assert inputs[0].tolist() == [BOS] + list(data[:63])
        assert labels[1].tolist() == list(data[65:129])  # stream[66:130], stream[k] = data[k-1]
