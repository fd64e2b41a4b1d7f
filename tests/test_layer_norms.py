"""Each block's gradient and parameter norms (`metrics.per_layer_norms`): `titan_parallel.grouped_norms` against
norms taken by hand, the groups a model's names fall into, and `titan train` on FSDP 2, TP 2, PP 2 and EP 2 against
one process: the same norm for every group at every logged step, whose root sum of squares is the run's own
`optim/grad_norm`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from titan_core.metrics.layer_norms import norm_group
from titan_parallel import grouped_norms

from titan_run import TINY, read_metrics, run_titan_all


def test_grouped_norms_are_each_groups_l2_norm():
    torch.manual_seed(0)
    groups = [[torch.randn(3, 4), torch.randn(5)], [], [torch.randn(2, 2, dtype=torch.bfloat16)]]
    by_hand = [torch.cat([t.float().flatten() for t in group]).norm() if group else torch.zeros(()) for group in groups]
    torch.testing.assert_close(grouped_norms(groups), torch.stack(by_hand), rtol=1e-6, atol=0)
    assert grouped_norms([]).shape == (0,)


def test_groups_are_blocks_and_top_level_modules_whatever_wraps_them():
    assert norm_group("layers.3._checkpoint_wrapped_module.attention.wq.weight", "layers") == "layers.3"
    assert norm_group("layers.12._orig_mod.moe.experts.w1", "layers") == "layers.12"
    assert norm_group("tok_embeddings.weight", "layers") == "tok_embeddings"
    assert norm_group("output.weight", "layers") == "output"


LLAMA = [*TINY, "--training.steps", "4", "--metrics.log_freq", "2", "--metrics.per_layer_norms", "true",
         "--metrics.per_layer_updates", "true", "--training.global_batch_size", "4"]  # fmt: skip
KINDS = ("grad_norm/", "param_norm/", "update_norm/", "update_ratio/")
DEEPSEEK = [*LLAMA, "--model.name", "deepseek_v3"]
ROWS = {  # row -> (reference, arguments on 2 ranks)
    "fsdp": ("llama", [*LLAMA, "--training.local_batch_size", "2"]),
    "tp": ("llama", [*LLAMA, "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"]),
    "pp": ("llama", [*LLAMA, "--training.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "2"]),
    "ep": ("deepseek", [*DEEPSEEK, "--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("layer_norms")
    run_titan_all({root / "llama": [*LLAMA, "--training.local_batch_size", "4", "--checkpoint.enable",
                                    "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0"],
                   root / "deepseek": [*DEEPSEEK, "--training.local_batch_size", "4"]})  # fmt: skip
    run_titan_all({root / row: args for row, (_, args) in ROWS.items()}, nproc=2)
    return root


def test_every_layout_reports_one_processs_norms(runs):
    for row, (reference, _) in ROWS.items():
        ours, theirs = read_metrics(runs / row), read_metrics(runs / reference)
        assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [2, 4]
        for mine, ref in zip(ours, theirs, strict=True):
            groups = sorted(k for k in ref if k.startswith(KINDS))
            assert sorted(k for k in mine if k.startswith(KINDS)) == groups, row
            # fp32 layouts agreed within 1.5e-6 (2026-12-06; 1.3e-4 before the CPU norms were taken in chunks, the
            # embedding's and the output's: torch's CPU norm of a whole 524k-element tensor, titan_parallel.grad_clip)
            for key in groups:
                assert mine[key] == pytest.approx(ref[key], rel=1e-5), (row, key, mine[key], ref[key])
            # The groups' gradient norms make up the clipped norm the run reports.
            total = math.sqrt(sum(mine[k] ** 2 for k in groups if k.startswith("grad_norm/")))
            assert total == pytest.approx(mine["optim/grad_norm"], rel=1e-5), row
    names = [k for k in read_metrics(runs / "deepseek")[0] if k.startswith("grad_norm/")]
    assert names == ["grad_norm/tok_embeddings", *(f"grad_norm/layers.{i}" for i in range(4)),
                     "grad_norm/norm", "grad_norm/output"]  # fmt: skip


def test_each_update_norm_is_the_change_between_two_checkpoints(runs):
    from titan_ckpt.dcp_files import read_dcp_state_dict, read_dcp_tensor_shapes

    folder = runs / "llama" / "checkpoint"
    names = [n for n in read_dcp_tensor_shapes(folder / "step-1") if n.startswith(("layers.", "tok_", "norm.", "output."))]
    for record in read_metrics(runs / "llama"):
        step = record["step"]
        before, after = read_dcp_state_dict(folder / f"step-{step - 1}", names), read_dcp_state_dict(folder / f"step-{step}", names)
        by_group: dict[str, float] = {}
        for name in names:
            group = norm_group(name, "layers")
            by_group[group] = by_group.get(group, 0.0) + float((after[name] - before[name]).double().norm() ** 2)
        assert sorted(f"update_norm/{g}" for g in by_group) == sorted(k for k in record if k.startswith("update_norm/"))
        for group, squared in by_group.items():
            # fp32 norms: the embedding's update is mostly weight decay on the ~2000 rows no byte reaches (each
            # ~1e-6), which torch's fp32 sum of squares partly drops: 1.6e-4 and 2.4e-4 low; the others within 3e-6
            rel = 5e-4 if group == "tok_embeddings" else 1e-5
            assert record[f"update_norm/{group}"] == pytest.approx(math.sqrt(squared), rel=rel), (step, group)
            ratio = record[f"update_norm/{group}"] / record[f"param_norm/{group}"]
            assert record[f"update_ratio/{group}"] == pytest.approx(ratio, rel=1e-9) and 0 < ratio < 1, (step, group)
