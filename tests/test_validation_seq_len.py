"""`validation.seq_len`: validation at another sequence length than training's. The logged loss equals the
plain cross-entropy of the saved weights on the held-out batches at that length; 2 context-parallel ranks log
the loss one process does; the RoPE table covers the longer length; the layouts that cannot take it refuse it
in one line naming the key."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from titan_core.config import ConfigError, load_config
from titan_core.job import resolve
from titan_run import TINY, read_metrics, run_titan

RUN = [*TINY, "--training.steps", "2", "--training.local_batch_size", "2", "--validation.enable",
       "--validation.freq", "2", "--validation.steps", "2", "--validation.seq_len", "128"]  # fmt: skip
# training.seq_len is TINY's 32: validation reads sequences 4x as long


def validation_loss(folder) -> float:
    (loss,) = [r["validation/loss"] for r in read_metrics(folder) if "validation/loss" in r]
    return loss


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation_seq_len")
    one, cp2 = root / "one", root / "cp2"
    run_titan(one, *RUN, "--checkpoint.enable", "--checkpoint.interval", "2")
    run_titan(cp2, *RUN, "--parallelism.context_parallel_degree", "2", nproc=2)
    return one, cp2


def test_the_loss_is_the_saved_weights_cross_entropy_at_that_length(runs):
    from titan_core.data import build_tokenizer
    from titan_core.data.build import loader_factory
    from titan_core.model_shape import for_seq_len
    from titan_core.model_source import expected_shapes, read_dcp_model

    one, _ = runs
    cfg = load_config(None, RUN)
    job = resolve(cfg, 1)
    args = for_seq_len(job.model_args, 128)
    model = job.spec.build(args)
    model.load_state_dict(read_dcp_model(one / "checkpoint" / "step-2", args, expected_shapes(job.spec.build, args)))
    model.eval()
    loader = loader_factory("stdlib", None, "text", build_tokenizer(None), seq_len=128, local_batch_size=2,
                            section="validation")()  # fmt: skip
    with torch.no_grad():
        batches = [next(loader) for _ in range(2)]
        assert all(inputs.shape == (2, 128) for inputs, _ in batches)
        expected = sum(F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).item() for x, y in batches) / 2
    assert validation_loss(one) == pytest.approx(expected, rel=1e-5)


def test_two_context_parallel_ranks_validate_as_one_process(runs):
    one, cp2 = runs
    assert validation_loss(cp2) == pytest.approx(validation_loss(one), rel=2e-5)


def test_the_rope_table_covers_the_longer_length():
    assert resolve(load_config(None, RUN), 1).model_args.max_seq_len == 2048  # the debug model's own is longer
    long = resolve(load_config(None, [*RUN, "--validation.seq_len", "4096"]), 1)
    assert long.model_args.max_seq_len == 4096
    off = resolve(load_config(None, [*RUN, "--validation.seq_len", "4096", "--validation.enable", "false"]), 1)
    assert off.model_args.max_seq_len == 2048  # no validation: the model is the training run's


@pytest.mark.parametrize("args, world, expected", [
    (["--validation.seq_len", "126", "--parallelism.context_parallel_degree", "2"], 2,
     "seq_len=126 is not divisible by 2 x cp=2 = 4: context parallel cuts each sequence into 2 chunks per rank; "
     "change seq_len or cp (seq_len set by validation.seq_len, cp set by parallelism.context_parallel_degree)"),
    (["--validation.seq_len", "66", "--parallelism.tensor_parallel_degree", "4"], 4,
     "seq_len=66 is not divisible by tp=4: sequence parallel splits each sequence into one piece per tensor-parallel "
     "rank; change seq_len or tp (seq_len set by validation.seq_len"),
    (["--parallelism.pipeline_parallel_degree", "2"], 2,
     "validation.seq_len=128 differs from training.seq_len=32; under pipeline parallel validation runs the training "
     "schedule: unset it"),
])  # fmt: skip
def test_a_length_the_layout_cannot_take_is_one_line(args, world, expected):
    with pytest.raises(ConfigError) as caught:
        resolve(load_config(None, [*RUN, *args]), world)
    message = str(caught.value)
    assert "\n" not in message and expected in message, message
    assert "validation.seq_len" in message
