"""Weighted mixtures and the global shuffle, in one process: the permutation, the schedule, the
loader's batches across world sizes and resumes, its metrics, and the one-line errors.

Expected batches come from independent readings (the whole corpus read by hand, an uninterrupted
one-rank loader, `TokenShardLoader`), never from the code under test alone. The multi-process
proof (a real 70/30 run resumed on another world size) is tests/test_data_mix_training.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from titan_run import ListSource

from titan_core.config import ConfigError, load_config
from titan_core.config.schema import DatasetSource
from titan_core.data import ByteTokenizer, MixSchedule, TokenShardLoader, build_loader, shares_of, write_token_shards
from titan_core.data.permutation import mix_key, permute
from titan_core.data.token_shards import read_manifest
from titan_core.data.token_windows import TokenWindows
from titan_core.job import resolve

BYTES = ByteTokenizer()


def folder(tmp_path: Path, name: str, letter: str, n_docs: int) -> Path:
    """A token-shard folder of `n_docs` documents of one letter plus their number (several shards)."""
    docs = [letter * (5 + 7 * (i % 5)) + str(i) for i in range(n_docs)]
    write_token_shards(ListSource(docs), BYTES, tmp_path / name, shard_tokens=120)
    return tmp_path / name


@pytest.fixture
def two(tmp_path):
    return folder(tmp_path, "web", "w", 40), folder(tmp_path, "code", "c", 15)


def mix_loader(paths, weights, *, batch, rank=0, world=1, seq_len=7, shuffle=True, seed=0, prefetch=0, phases=()):
    mix = [DatasetSource(path=str(p), weight=w) for p, w in zip(paths, weights, strict=True)]
    return build_loader(
        "stdlib",
        None,
        "text",
        BYTES,
        seq_len=seq_len,
        local_batch_size=batch,
        dp_rank=rank,
        dp_world=world,
        prefetch=prefetch,
        shuffle=shuffle,
        shuffle_seed=seed,
        mix=mix,
        mix_phases=phases,
    )


def rows(batch) -> list[list[int]]:
    inputs, labels = batch
    assert inputs.dtype == labels.dtype == torch.int64 and inputs.shape == labels.shape
    return torch.cat([inputs, labels[:, -1:]], dim=1).tolist()  # (B, seq_len + 1)


# ---------------------------------------------------------------- the permutation


def test_permutation_is_a_keyed_bijection_computed_per_index():
    for n in (1, 2, 3, 5, 64, 1000, 4097):
        assert sorted(permute(np.arange(n), n, mix_key(1, 0)).tolist()) == list(range(n)), n
    orders = {tuple(permute(np.arange(50), 50, mix_key(seed, 0)).tolist()) for seed in range(4)}
    assert len(orders) == 4 and tuple(range(50)) not in orders
    # Epochs (keys) differ, and an index is O(1): 64 indices of a 10**15-window corpus without any table.
    started = time.perf_counter()
    far = permute(np.arange(10**14, 10**14 + 64), 10**15, mix_key(0, 0, 9))
    assert time.perf_counter() - started < 0.5 and len(set(far.tolist())) == 64 and far.max() < 10**15


# ---------------------------------------------------------------- the schedule


def test_schedule_is_exact_periodic_and_even_in_every_window():
    assert shares_of([0.7, 0.3]) == [7, 3] and shares_of([2, 1]) == [2, 1] and shares_of([0.5, 0.25, 0.25]) == [2, 1, 1]
    schedule = MixSchedule(shares_of([0.7, 0.3]))
    assert schedule.period == 10 and np.bincount(schedule.pattern).tolist() == [7, 3]
    for weights in ([0.7, 0.3], [0.6, 0.25, 0.1, 0.05], [0.123, 0.456, 0.421]):
        schedule = MixSchedule(shares_of(weights))
        assert schedule.max_window_error(300) <= 1.5, weights  # within ~1 sample of the weight, any window
    # locate() and consumed() agree, for any global index, without walking the stream.
    schedule = MixSchedule(shares_of([0.123, 0.456, 0.421]))
    g = np.arange(10**12, 10**12 + 2000)
    source, index = schedule.locate(g)
    before = schedule.consumed(int(g[0]))
    for s in range(3):
        assert index[source == s].tolist() == list(range(before[s], before[s] + int((source == s).sum())))
    assert (schedule.consumed(int(g[-1]) + 1) - before).tolist() == np.bincount(source, minlength=3).tolist()


def test_bad_weights_and_entries_are_one_line_naming_the_key():
    cases = {
        '[{"path": "/x", "weight": 0}]': "training.dataset_mix[0].weight must be a positive number, got 0",
        '[{"path": "/x", "weight": 1}, {"path": "/y"}]': "training.dataset_mix[1].weight is missing",
        '[{"path": "/x", "weight": 1, "wieght": 2}]': "training.dataset_mix[0] has unknown key(s) ['wieght']",
        '[{"weight": 1}]': "training.dataset_mix[0].path is missing",
        '{"path": "/x", "weight": 1}': "training.dataset_mix is one table, not a list of them: put it in [...]",
        '["/x"]': "training.dataset_mix[0] is '/x', not a table",
    }
    for value, expected in cases.items():
        with pytest.raises(ConfigError) as caught:
            load_config(None, ["--training.dataset_mix", value])
        assert str(caught.value).startswith(expected) and "\n" not in str(caught.value), str(caught.value)
    with pytest.raises(ConfigError, match=r"dataset_mix\[1\]\.weight=1e-09 is below 1/10000 .* raise it or drop"):
        shares_of([1.0, 1e-9])
    with pytest.raises(ConfigError, match=r"training.on_loss_spike = 'rollback' .* --checkpoint.enable true"):
        resolve(load_config(None, ["--training.on_loss_spike", "rollback"]), 1)


def test_bad_paths_and_names_are_one_line_naming_the_key(tmp_path, two):
    with pytest.raises(ConfigError) as caught:
        mix_loader([two[0], tmp_path / "nowhere" / "shards"], [1, 1], batch=2)
    assert str(caught.value).startswith("training.dataset_mix[1].path: ") and "does not exist" in str(caught.value)
    with pytest.raises(ConfigError, match=r"dataset_mix\[0\] and \[1\] are both named 'web'; set a distinct name"):
        mix_loader([two[0], two[0]], [1, 1], batch=2)
    # a text source whose records lack the field names the entry's own key for it
    (tmp_path / "notes.jsonl").write_text('{"body": "one"}\n')
    loader = mix_loader([two[0], tmp_path / "notes.jsonl"], [1, 1], batch=4)
    with pytest.raises(ConfigError) as caught:
        for _ in range(3):
            next(iter(loader))
    assert str(caught.value).endswith(
        "has no field 'text' (has ['body']); set training.dataset_mix[1].text_field to the field of the text"
    )


def test_a_toml_mix_reads_and_writes_back(tmp_path):
    from titan_core.config import dump_toml

    toml = tmp_path / "mix.toml"
    toml.write_text(
        '[training]\ndataset_mix = [{path = "/a", weight = 0.7, name = "web"}, {path = "/b", weight = 0.3}]\n'
    )
    cfg = load_config(str(toml))
    assert [(e.path, e.weight, e.name) for e in cfg.training.dataset_mix] == [("/a", 0.7, "web"), ("/b", 0.3, None)]
    (tmp_path / "again.toml").write_text(dump_toml(cfg))
    assert load_config(str(tmp_path / "again.toml")) == cfg


# ---------------------------------------------------------------- shuffled windows


def test_shuffle_reads_every_window_once_per_epoch_in_a_new_order(two):
    manifest = read_manifest(two[0])
    stream = np.concatenate([np.fromfile(manifest.folder / s.tokens, dtype=manifest.dtype) for s in manifest.shards])
    width = 8
    n = len(stream) // width
    expected = sorted(stream[: n * width].reshape(n, width).astype(np.int64).tolist())  # the tail is not read
    windows = TokenWindows(manifest, width - 1, mix_key(0, 0), "training.dataset_path")
    epoch0, epoch1 = windows.read(np.arange(n)).tolist(), windows.read(np.arange(n, 2 * n)).tolist()
    assert sorted(epoch0) == sorted(epoch1) == expected
    assert epoch0 != epoch1 and epoch0 != stream[: n * width].reshape(n, width).tolist()
    assert (windows.epoch(n - 1), windows.epoch(n), windows.epoch(2 * n)) == (0, 1, 2)
    in_order = TokenWindows(manifest, width - 1, None, "training.dataset_path")
    assert in_order.read(np.arange(3)).tolist() == stream[: 3 * width].reshape(3, width).tolist()


def test_unshuffled_one_folder_mix_equals_the_token_shard_loader(two):
    mixed = mix_loader([two[0]], [1], batch=3, rank=1, world=2, shuffle=False)
    plain = TokenShardLoader(two[0], 7, 3, 1, 2, prefetch=0)
    for _ in range(12):  # several epochs, samples crossing shard and corpus ends
        assert rows(next(mixed)) == rows(next(plain))


# ---------------------------------------------------------------- the mixture loader


def test_mixture_honours_the_weights_and_reports_tokens_and_epochs(two):
    loader = mix_loader(two, [0.7, 0.3], batch=10)
    web = [0, 0]
    for _ in range(20):
        for row in rows(next(loader)):
            web[0 if ord("w") in row else 1] += 1  # every 8-token window of "www...12" holds a "w"
    assert web == [140, 60]  # exactly 70/30 over 200 samples
    metrics = loader.metrics()
    assert metrics["data/web/tokens"] == 140 * 7 and metrics["data/code/tokens"] == 60 * 7
    code_windows = read_manifest(two[1]).total_tokens // 8
    assert metrics["data/code/epoch"] == 60 // code_windows >= 1 and metrics["data/web/epoch"] == 140 // (
        read_manifest(two[0]).total_tokens // 8
    )
    assert loader.describe_samples(0, 10) == "web 7, code 3 samples (global samples 0-9)"


@pytest.mark.parametrize("text_source", [False, True])
def test_two_ranks_resume_on_one_and_three_with_the_same_batches(tmp_path, two, text_source):
    """Two ranks (B=3) for 4 steps; their state resumes a one-rank (B=6) and a three-rank (B=2) loader:
    every later step's global batch equals the uninterrupted one-rank loader's, bit for bit, across
    epoch ends (the "tiny" folder holds 5 windows and gives about 16 samples)."""
    paths = [two[0], folder(tmp_path, "tiny", "t", 3)]
    if text_source:  # a source tokenized on the fly, which every rank advances through the whole step
        (tmp_path / "text").mkdir()
        for i in range(3):
            (tmp_path / "text" / f"{i}.txt").write_text(f"plain text file {i} " * (4 + i))
        paths.append(tmp_path / "text")
    weights = [0.5, 0.3, 0.2][: len(paths)]
    reference = mix_loader(paths, weights, batch=6)
    expected = [rows(next(reference)) for _ in range(9)]
    ranks = [mix_loader(paths, weights, batch=3, rank=r, world=2, prefetch=2 * r) for r in range(2)]
    for step in range(4):
        assert rows(next(ranks[0])) + rows(next(ranks[1])) == expected[step]
    state = json.loads(json.dumps(ranks[0].state_dict()))  # what a checkpoint stores
    assert state == ranks[1].state_dict() and state["samples_consumed"] == 24
    one = mix_loader(paths, weights, batch=6)
    one.load_state_dict(state)
    three = [mix_loader(paths, weights, batch=2, rank=r, world=3, prefetch=r) for r in range(3)]
    for loader in three:
        loader.load_state_dict(state)
    for step in range(4, 9):
        assert rows(next(one)) == expected[step]
        assert sum((rows(next(loader)) for loader in three), []) == expected[step]
    assert one.metrics() == three[0].metrics() == reference.metrics() and reference.metrics()["data/tiny/epoch"] >= 2
    for loader in (*ranks, *three):
        loader.close()


def test_a_changed_mix_seed_or_order_is_refused_in_one_line(two):
    loader = mix_loader(two, [0.7, 0.3], batch=2)
    next(loader)
    state = loader.state_dict()
    cases = [
        (mix_loader(two, [0.5, 0.5], batch=2), "the checkpoint read [web: share 7"),
        (
            mix_loader(two, [0.7, 0.3], batch=2, seed=1),
            "training.shuffle_seed = 0, this run has training.shuffle_seed = 1",
        ),
        (mix_loader(two, [0.7, 0.3], batch=2, shuffle=False), "this run has training.shuffle = false"),
        (mix_loader(two, [0.7, 0.3], batch=2, seq_len=5), "training.seq_len=7, this run has 5"),
        (TokenShardLoader(two[0], 7, 2, prefetch=0), "this run reads training.dataset_path in file order"),
    ]
    for other, expected in cases:
        with pytest.raises(ConfigError) as caught:
            other.load_state_dict(state)
        assert expected in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
        assert "exclude_from_loading" in str(caught.value)
    plain = TokenShardLoader(two[0], 7, 2, prefetch=0)
    next(plain)
    one_folder = build_loader("stdlib", str(two[0]), "text", BYTES, seq_len=7, local_batch_size=2, shuffle=True)
    with pytest.raises(
        ConfigError, match=r"read in file order \(training.shuffle = false\).*resume with the checkpoint's"
    ):
        one_folder.load_state_dict(plain.state_dict())


# ---------------------------------------------------------------- phases (training.dataset_mix_phases)


def test_phases_change_the_weights_and_each_source_reads_on_where_it_stopped():
    from titan_core.data.mix_schedule import PhasedMixSchedule, phase_shares

    one = MixSchedule([7, 3])
    alone = PhasedMixSchedule([(0, [7, 3])])
    g = np.arange(500)
    assert all((a == b).all() for a, b in zip(one.locate(g), alone.locate(g), strict=True))
    # 70/30 for 105 samples, 50/50 for 195, then only the second source (the first sits it out)
    assert phase_shares([0.5, 0.5], "k") == [1, 1] and phase_shares([0, 2], "k") == [0, 1]
    phased = PhasedMixSchedule([(0, [7, 3]), (105, [1, 1]), (300, [0, 1])])
    source, index = phased.locate(g)
    for s in (0, 1):  # every source's samples are its next ones, in order, across the phase changes
        assert index[source == s].tolist() == list(range(int((source == s).sum())))
    # 105 samples at 7/3: 10 periods and 5 slots (the first 5 of the 7/3 round-robin take 4 and 1): 74 and 31
    assert phased.consumed(105).tolist() == [74, 31]
    assert (phased.consumed(300) - phased.consumed(105)).tolist() == [98, 97]  # 195 at 1:1, the first goes first
    assert (phased.consumed(500) - phased.consumed(300)).tolist() == [0, 200]
    for n in (0, 1, 104, 105, 106, 299, 300, 377):
        assert phased.consumed(n).tolist() == [int((source[:n] == s).sum()) for s in (0, 1)]
    with pytest.raises(ConfigError, match="k: weights must be numbers >= 0, one of them > 0"):
        phase_shares([0, 0], "k")


def test_a_phase_starts_at_its_sample_and_a_resume_may_change_only_later_phases(two):
    phases = [(40, {"code": 1.0})]  # after 40 samples (4 steps of 10): code alone
    reference = mix_loader(two, [0.7, 0.3], batch=10, phases=phases)
    batches = [rows(next(reference)) for _ in range(7)]
    web_rows = [sum(ord("w") in row for row in batch) for batch in batches]
    assert web_rows == [7, 7, 7, 7, 0, 0, 0]
    assert reference.metrics()["data/web/tokens"] == 28 * 7 and reference.metrics()["data/code/tokens"] == 42 * 7
    for at in (2, 5):  # a checkpoint before the phase and one inside it
        loader = mix_loader(two, [0.7, 0.3], batch=10, phases=phases)
        for _ in range(at):
            next(loader)
        state = json.loads(json.dumps(loader.state_dict()))
        assert state["phases"] == [[40, [0, 1]]]
        resumed = [mix_loader(two, [0.7, 0.3], batch=5, rank=r, world=2, phases=phases) for r in range(2)]
        for loader in resumed:  # two ranks of 5 go on as the one of 10
            loader.load_state_dict(state)
        assert [rows(next(resumed[0])) + rows(next(resumed[1])) for _ in range(7 - at)] == batches[at:]
    # Decided late: a run whose checkpoint (step 3, sample 30) had no phase may add one from step 5 on ...
    plain = mix_loader(two, [0.7, 0.3], batch=10)
    for _ in range(3):
        next(plain)
    later = mix_loader(two, [0.7, 0.3], batch=10, phases=phases)
    later.load_state_dict(plain.state_dict())
    assert [rows(next(later)) for _ in range(4)] == batches[3:]
    # ... but not change one that the checkpoint's data already followed.
    inside = mix_loader(two, [0.7, 0.3], batch=10, phases=phases)
    for _ in range(5):
        next(inside)
    for other in ([(40, {"web": 1.0})], [(30, {"code": 1.0})], []):
        changed = mix_loader(two, [0.7, 0.3], batch=10, phases=other)
        with pytest.raises(ConfigError, match=r"mixture phases from global sample 40 code 100% before its position "
                                              r"\(global sample 50\).*change only"):  # fmt: skip
            changed.load_state_dict(inside.state_dict())


def test_bad_phases_are_one_line_naming_the_key(tmp_path, two):
    mix = json.dumps([{"path": str(two[0]), "weight": 0.7}, {"path": str(two[1]), "weight": 0.3}])
    base = ["--training.steps", "10", "--training.dataset_mix", mix, "--training.dataset_mix_phases"]
    cases = {
        '[{"step": 5, "weights": {"code": 1}}, {"step": 5, "weights": {"web": 1}}]':
            "training.dataset_mix_phases[1].step=5: phases start at increasing steps after step 5",
        '[{"step": 11, "weights": {"code": 1}}]': "at most training.steps=10",
        '[{"step": 5, "weights": {"math": 1}}]':
            "training.dataset_mix_phases[0].weights names 'math', not a source of training.dataset_mix (its names: web, code)",
        '[{"step": 5, "weights": {"code": 0}}]': "training.dataset_mix_phases[0].weights: weights must be numbers >= 0",
    }  # fmt: skip
    for phases, expected in cases.items():
        with pytest.raises(ConfigError) as caught:
            resolve(load_config(None, [*base, phases]), 1)
        assert expected in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
    with pytest.raises(ConfigError, match="training.dataset_mix_phases needs training.dataset_mix"):
        resolve(load_config(None, ["--training.dataset_mix_phases", '[{"step": 5, "weights": {"a": 1}}]']), 1)
    with pytest.raises(ConfigError, match=r"phases\[0\].step=1: phases start at increasing steps after step 1"):
        resolve(load_config(None, [*base, '[{"step": 1, "weights": {"code": 1}}]']), 1)  # step 1: the mix's own
