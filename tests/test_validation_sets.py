"""`validation.sets`: several held-out sets, each logged as `validation/<name>/loss`, each equal to a run that
validates on that set alone, on one process and on 2 FSDP ranks; their mean is `validation/loss`."""

from __future__ import annotations

import json
import re

import pytest
from titan_core.config import ConfigError, load_config
from titan_core.job import resolve
from titan_run import SHARED_DATA, TINY, read_metrics, run_titan, run_titan_all

HAMLET = str(SHARED_DATA / "shakespeare" / "hamlet_gut.txt")
SETS = json.dumps([{"path": "stdlib"}, {"path": HAMLET, "name": "hamlet"}])  # on the command line: JSON
RUN = [*TINY, "--training.steps", "4", "--validation.enable", "--validation.freq", "2", "--validation.steps", "2"]


def validations(folder, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(folder) if key in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation_sets")
    folders = {name: root / name for name in ("sets", "stdlib", "hamlet", "sets_fsdp2")}
    run_titan_all({
        folders["sets"]: [*RUN, "--training.local_batch_size", "4", "--validation.sets", SETS],
        folders["stdlib"]: [*RUN, "--training.local_batch_size", "4"],
        folders["hamlet"]: [*RUN, "--training.local_batch_size", "4", "--validation.dataset_path", HAMLET],
    })  # fmt: skip
    proc = run_titan(folders["sets_fsdp2"], *RUN, "--training.local_batch_size", "2", "--validation.sets", SETS, nproc=2)
    return folders, proc.stdout + proc.stderr


def test_each_set_is_the_loss_of_a_run_validating_on_it_alone(runs):
    folders, _ = runs
    stdlib = validations(folders["sets"], "validation/stdlib/loss")
    hamlet = validations(folders["sets"], "validation/hamlet/loss")
    assert sorted(stdlib) == sorted(hamlet) == [2, 4]
    assert stdlib == validations(folders["stdlib"], "validation/loss")
    assert hamlet == validations(folders["hamlet"], "validation/loss")
    assert stdlib != hamlet  # two different sets
    mean = validations(folders["sets"], "validation/loss")
    assert all(mean[s] == pytest.approx((stdlib[s] + hamlet[s]) / 2, rel=1e-7) for s in mean)


def test_two_fsdp_ranks_validate_each_set_as_one_process(runs):
    folders, log = runs
    for key in ("validation/stdlib/loss", "validation/hamlet/loss", "validation/loss"):
        one, two = validations(folders["sets"], key), validations(folders["sets_fsdp2"], key)
        assert sorted(two) == [2, 4] and max(abs(one[s] - two[s]) for s in one) < 2e-5, (key, one, two)
    # the console line: the mean with its perplexity, then each set's loss
    shown = re.findall(r"validation loss (\S+) \(ppl \S+; stdlib (\S+), hamlet (\S+)\)", log)
    records = [validations(folders["sets_fsdp2"], k) for k in ("validation/loss", "validation/stdlib/loss",
                                                               "validation/hamlet/loss")]  # fmt: skip
    assert [tuple(map(float, s)) for s in shown] == [tuple(round(r[s], 4) for r in records) for s in (2, 4)]
    assert "validation sets stdlib, hamlet" in log  # the banner


@pytest.mark.parametrize("args, expected", [
    (["--validation.sets", SETS, "--validation.dataset_path", HAMLET],
     f"validation.sets and validation.dataset_path={HAMLET} are both set"),
    (["--validation.sets", '[{"path": "stdlib"}, {"path": "a/stdlib"}]'], "validation.sets: the name 'stdlib' labels two sets"),
])  # fmt: skip
def test_a_broken_set_list_is_one_line(args, expected):
    with pytest.raises(ConfigError) as caught:
        resolve(load_config(None, ["--validation.enable", *args]), 1)
    assert "\n" not in str(caught.value) and expected in str(caught.value), str(caught.value)


def test_the_example_config_resolves():
    from titan_core.job.run_rules import validation_set_names
    from titan_run import REPO

    cfg = load_config(str(REPO / "examples" / "validation_sets.toml"))
    resolve(cfg, 1)
    assert validation_set_names(cfg.validation.sets) == ["stdlib", "commonsense"]
    assert (REPO / cfg.validation.sets[1].path).is_file() and cfg.validation.sets[1].text_field == "context"


def test_a_sets_missing_text_field_names_that_sets_key(tmp_path):
    from titan_run import REPO

    jsonl = str(REPO / "examples" / "eval_tasks" / "toy_commonsense.jsonl")  # its text is under "context"
    sets = json.dumps([{"path": "stdlib"}, {"path": jsonl, "name": "mc", "text_field": "ctx"}])
    proc = run_titan(tmp_path / "run", *RUN, "--validation.sets", sets, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "has no field 'ctx'" in proc.stderr and "set validation.sets[1].text_field to the field" in proc.stderr
