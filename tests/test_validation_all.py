"""`validation.steps = -1`: each pass reads all of the held-out data, to the last batch that does not wrap past
its end. The logged loss equals the plain cross-entropy of the saved weights averaged over every full batch of the
file (worked out here from the tokenizer, not the loader), for text read on the fly and for the same text as token
shards, on one process and on 2 FSDP ranks; data that fills no batch is refused in one line naming its key."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from titan_core.config import ConfigError, load_config
from titan_core.job import resolve
from titan_run import TINY, read_metrics, run_titan

SEQ, GLOBAL_BATCH = 32, 4  # TINY's training.seq_len; 4 sequences a step on one process and on 2 ranks
RUN = [*TINY, "--training.steps", "2", "--validation.enable", "--validation.freq", "2", "--validation.steps", "-1"]
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex the jovial bankers".split()


def documents() -> list[str]:
    rng = np.random.default_rng(3)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(20, 60)))) for _ in range(14)]


def validation_losses(folder) -> dict[str, float]:
    (record,) = [r for r in read_metrics(folder) if "validation/loss" in r]
    return {k: v for k, v in record.items() if k.startswith("validation/")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from titan_core.data import build_tokenizer
    from titan_core.data.token_shards import write_token_shards

    root = tmp_path_factory.mktemp("validation_all")
    text = root / "held_out.jsonl"
    text.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents()))
    shards = root / "held_out_shards"
    write_token_shards(documents(), build_tokenizer(None), shards, shard_tokens=300)  # several shards
    sets = json.dumps([{"path": str(text), "name": "text"}, {"path": str(shards), "name": "shards"}])
    one, fsdp2 = root / "one", root / "fsdp2"
    run_titan(one, *RUN, "--training.local_batch_size", str(GLOBAL_BATCH), "--validation.sets", sets,
              "--checkpoint.enable", "--checkpoint.interval", "2")  # fmt: skip
    run_titan(fsdp2, *RUN, "--training.local_batch_size", str(GLOBAL_BATCH // 2), "--validation.sets", sets, nproc=2)
    return one, fsdp2


def full_batches() -> list[torch.Tensor]:
    """Every full global batch of the documents' stream `[bos] + ids + [eos]`, each (GLOBAL_BATCH, SEQ + 1)."""
    from titan_core.data import build_tokenizer

    tokenizer = build_tokenizer(None)
    stream = [t for d in documents() for t in (tokenizer.bos_id, *tokenizer.encode(d), tokenizer.eos_id)]
    per_batch = GLOBAL_BATCH * (SEQ + 1)
    n = len(stream) // per_batch
    assert n >= 3 and len(stream) % per_batch, "the data must hold several batches and a partial one"
    return [torch.tensor(stream[i * per_batch : (i + 1) * per_batch]).view(GLOBAL_BATCH, SEQ + 1) for i in range(n)]


def test_the_loss_is_the_saved_weights_cross_entropy_over_every_full_batch(runs):
    from titan_core.model_source import expected_shapes, read_dcp_model

    one, _ = runs
    job = resolve(load_config(None, RUN), 1)
    model = job.spec.build(job.model_args)
    model.load_state_dict(read_dcp_model(one / "checkpoint" / "step-2", job.model_args,
                                         expected_shapes(job.spec.build, job.model_args)))  # fmt: skip
    model.eval()
    with torch.no_grad():
        per_batch = [F.cross_entropy(model(b[:, :-1]).flatten(0, 1).float(), b[:, 1:].flatten()).item()
                     for b in full_batches()]  # fmt: skip
    expected = sum(per_batch) / len(per_batch)
    logged = validation_losses(one)
    assert logged["validation/text/loss"] == pytest.approx(expected, rel=1e-5)
    assert logged["validation/shards/loss"] == pytest.approx(expected, rel=1e-5)  # the same tokens, as shards
    # the mean over all batches is not the first batch's nor the first (n - 1)'s: the whole pass was read
    assert min(abs(expected - per_batch[0]), abs(expected - sum(per_batch[:-1]) / (len(per_batch) - 1))) > 1e-6


def test_two_fsdp_ranks_read_the_same_batches_as_one_process(runs):
    one, fsdp2 = runs
    logged_one, logged_two = validation_losses(one), validation_losses(fsdp2)
    assert sorted(logged_two) == sorted(logged_one)
    assert all(logged_two[k] == pytest.approx(logged_one[k], rel=2e-5) for k in logged_one), (logged_one, logged_two)


def test_data_that_fills_no_batch_is_one_line_naming_its_key(tmp_path):
    from titan_core.data import build_tokenizer
    from titan_core.data.build import loader_factory
    from titan_core.validation import check_first_batch

    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": "too short"}) + "\n")
    make = loader_factory(str(small), None, "text", build_tokenizer(None), seq_len=SEQ, local_batch_size=2,
                          dp_rank=1, dp_world=2, section="validation", dataset_key="validation.sets[1].path")
    with pytest.raises(ConfigError) as caught:
        check_first_batch(make, whole_pass=True)
    message = str(caught.value)
    expected = "validation.sets[1].path: the data holds fewer tokens than one validation batch (132 over all ranks)"
    assert "\n" not in message and message.startswith(expected), message
    check_first_batch(make, whole_pass=False)  # a fixed number of batches repeats what there is
    check_first_batch(loader_factory("stdlib", None, "text", build_tokenizer(None), seq_len=SEQ, local_batch_size=2,
                                     section="validation"), whole_pass=True)  # the held-out corpus fills one


def test_the_example_reads_its_whole_set():
    from titan_core.data import build_tokenizer
    from titan_core.data.build import loader_factory
    from titan_core.validation import check_first_batch
    from titan_run import REPO

    cfg = load_config(str(REPO / "examples" / "validation_all.toml"))
    v = cfg.validation
    assert v.enable and v.steps == -1 and resolve(cfg, 1).model_args.max_seq_len >= v.seq_len
    tokenizer = build_tokenizer(None)
    make = loader_factory(v.dataset, str(REPO / v.dataset_path), "text", tokenizer, seq_len=v.seq_len,
                          local_batch_size=v.local_batch_size, section="validation")  # fmt: skip
    check_first_batch(make, whole_pass=True)
    loader, batches = make(), 0
    for _ in loader:
        if loader.wrapped():
            break
        batches += 1
    # worked out from the file: each document is [bos] + its tokens + [eos], cut into batches of whole samples
    lines = (REPO / v.dataset_path).read_text().splitlines()
    tokens = sum(len(tokenizer.encode(json.loads(line)["text"])) + 2 for line in lines)
    assert batches == tokens // (v.local_batch_size * (v.seq_len + 1)) == 5  # 5: as the example's comment says


@pytest.mark.parametrize("section, key", [("validation", "validation.dataset_path"),
                                          ("training", "training.dataset_path")])  # fmt: skip
def test_an_empty_file_is_named_by_its_sections_key(tmp_path, section, key):
    from titan_core.data import build_tokenizer
    from titan_core.data.build import loader_factory

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    make = loader_factory("stdlib", str(empty), "text", build_tokenizer(None), seq_len=SEQ, local_batch_size=2,
                          section=section)  # fmt: skip
    with pytest.raises(ConfigError, match=f"has no documents; check {key}$"):
        next(make())


def test_an_empty_validation_file_stops_the_run_before_its_first_step(tmp_path):
    """With a fixed number of validation batches (they repeat what there is), an empty file is still refused when
    the run starts, not at the first validation after `validation.freq` steps of training."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = run_titan(tmp_path / "run", *TINY, "--validation.enable", "--validation.freq", "5",
                     "--validation.steps", "2", "--validation.dataset_path", str(empty), check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"the dataset {str(empty)!r} has no documents; check validation.dataset_path" in proc.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == "" and "step  1/" not in proc.stdout  # no step ran


@pytest.mark.parametrize("value", ["0", "-2"])
def test_steps_is_minus_one_or_positive(value):
    with pytest.raises(ConfigError, match="validation.steps"):
        load_config(None, ["--validation.steps", value])
    assert load_config(None, ["--validation.steps", "-1"]).validation.steps == -1
