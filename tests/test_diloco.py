"""DiLoCo across torchft replica groups on gloo, with real processes (docs/fault_tolerance.md, "DiLoCo").

Two replica groups of one process each train through `titan lighthouse` with `semi_sync_method = 'diloco'`,
syncing every 2 steps. Against the paper's outer step computed here from the groups' own weights:

    delta = mean over groups (anchor - weights after the inner steps)  (streaming: after step 1, a fragment's)
    anchor' = anchor - outer_lr * (delta + momentum * delta)           (torch's Nesterov SGD, first step)

and bit-exact resume from a checkpoint between two syncs (anchors and outer momentum are in it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from test_loss_spike import dcp_tensors
from test_torchft import INTERVAL, Group, run_groups, running_lighthouse, start, wait_for
from titan_run import TINY

from titan_core.diloco import model_fragments

pytest.importorskip("torchft")

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def train_groups(tmp: Path, names: tuple[str, str], lighthouse: str, *args: str) -> list[Path]:
    """Both replica groups of one DiLoCo run, side by side (2 groups, both needed for a sync); their folders."""
    return run_groups(tmp, names, lighthouse, *TINY, "--checkpoint.enable", "--checkpoint.keep_latest_k", "0",
                      "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.outer_lr", str(OUTER_LR),
                      "--fault_tolerance.outer_momentum", str(OUTER_MOMENTUM), *args, timeout=240)


def split(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix` ("model." names the weights: the checkpoint's unprefixed keys)."""
    if prefix == "model.":
        return {k: v for k, v in tensors.items() if not k.startswith(("optimizer.", "diloco."))}
    return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def test_diloco_outer_step_matches_the_paper_and_resumes_exactly(tmp_path):
    with running_lighthouse(tmp_path, min_replicas=2) as address:
        synced = train_groups(tmp_path, ("a0", "a1"), address, "--fault_tolerance.sync_steps", "2",
                              "--training.steps", "5", "--checkpoint.interval", "1")
        streamed = train_groups(tmp_path, ("c0", "c1"), address, "--fault_tolerance.sync_steps", "2",
                                "--fault_tolerance.num_fragments", "2", "--training.steps", "2",
                                "--checkpoint.interval", "1")
        logs = (tmp_path / "a0.log").read_text()
        assert "step 2 syncs 2 of 2 replica groups" in logs, logs[-3000:]
        assert "DiLoCo, a sync every 2 steps; outer SGD lr 0.7, Nesterov momentum 0.9" in logs
        assert "training.steps=5 ends 1 steps after the last sync" in logs
        assert "in 2 fragments, one every 1 steps" in (tmp_path / "c0.log").read_text()
        records = [json.loads(line) for line in (synced[0] / "metrics.jsonl").read_text().splitlines()]
        assert [r.get("ft/replica_groups") for r in records] == [None, 2, 2, 2, 2]  # from the first sync on
        assert all(r["ft/dropped_syncs"] == 0 for r in records)
        assert ["ft/outer_grad_norm" in r and r["ft/sync_wait_ms"] >= 0 for r in records] == [False, *[True] * 4]

        saved = {(g, step): dcp_tensors(folder / f"checkpoint/step-{step}")
                 for g, folder in enumerate(synced) for step in (1, 2, 3, 4, 5)}
        for step in (1, 2, 3, 4):  # the groups hold the same weights right after each sync, their own in between
            ours, theirs = split(saved[0, step], "model."), split(saved[1, step], "model.")
            assert ours.keys() == theirs.keys() and ours
            same = all(torch.equal(ours[k], theirs[k]) for k in ours)
            assert same == (step % 2 == 0), step
            state = [split(saved[g, step], "diloco.") for g in (0, 1)]
            assert all(torch.equal(state[0][k], state[1][k]) for k in state[0])  # anchors and momentum

        # The first fragment (the embedding, the first half of the blocks) syncs after step 1, the second (the other
        # blocks, the final norm, the output) after step 2. After step 1 the first fragment's weights are the
        # paper's outer step from each group's weights after one inner step: the unsynced run's step 1.
        start_weights = split(split(saved[0, 1], "diloco."), "anchor.")  # no sync yet: the initial weights
        one_step = [split(saved[g, 1], "model.") for g in (0, 1)]
        first = set(model_fragments(list(start_weights), "layers", 2)[0])
        assert "tok_embeddings.weight" in first and "output.weight" not in first
        worst = 0.0
        for step, synced_now in ((1, first), (2, set(start_weights) - first)):
            groups = [dcp_tensors(folder / f"checkpoint/step-{step}") for folder in streamed]
            for name in start_weights:  # (Adam's first update is +-lr: a vector's signs may agree by chance)
                same = torch.equal(groups[0][name], groups[1][name])
                assert same if name in synced_now else (not same or groups[0][name].dim() == 1), (step, name)
            if step == 1:
                for name in first:
                    assert not torch.equal(one_step[0][name], one_step[1][name])  # each group on its own data
                    delta = ((start_weights[name] - one_step[0][name]) + (start_weights[name] - one_step[1][name])) / 2
                    expected = start_weights[name] - OUTER_LR * (delta + OUTER_MOMENTUM * delta)
                    torch.testing.assert_close(groups[0][f"diloco.momentum.{name}"], delta, rtol=0, atol=1e-7)
                    torch.testing.assert_close(groups[0][name], expected, rtol=0, atol=1e-6)
                    worst = max(worst, (groups[0][name] - expected).abs().max().item())
                assert all(groups[0][f"diloco.momentum.{n}"].eq(0).all() for n in set(start_weights) - first)
        print(f"\nafter the first sync: max |weights - the paper's outer step| = {worst:.2e}")
        # The whole model's sync: the step-2 weights are the anchors, one outer step from the start on the momentum.
        model, state = split(saved[0, 2], "model."), split(saved[0, 2], "diloco.")
        # the first sync's outer gradient is its momentum: ft/outer_grad_norm is its norm (in fp64 here: torch's fp32
        # norm of one 5.8M-element vector on CPU was 1.3e-4 off)
        first_norm = torch.cat([state[f"momentum.{n}"].flatten() for n in start_weights]).double().norm().item()
        assert records[1]["ft/outer_grad_norm"] == pytest.approx(first_norm, rel=1e-5)
        for name, start_weight in start_weights.items():
            momentum = state[f"momentum.{name}"]
            assert not momentum.eq(0).all()
            torch.testing.assert_close(model[name], start_weight - OUTER_LR * (1 + OUTER_MOMENTUM) * momentum,
                                       rtol=0, atol=1e-6)
            assert torch.equal(state[f"anchor.{name}"], model[name])

        # `titan convert --anchors` writes the weights the groups last synced, not this group's own since then.
        from typer.testing import CliRunner

        from titan_cli.main import app

        step3, exported = synced[0] / "checkpoint/step-3", tmp_path / "anchors.pt"
        result = CliRunner().invoke(app, ["convert", str(step3), str(exported), "--to", "torch", "--anchors"])
        assert result.exit_code == 0, result.output
        written, anchors = torch.load(exported, weights_only=True), split(saved[0, 3], "diloco.anchor.")
        assert written.keys() == anchors.keys() and all(torch.equal(written[k], anchors[k]) for k in anchors)
        assert all(torch.equal(anchors[k], split(saved[1, 2], "model.")[k]) for k in anchors)  # step 2's sync
        result = CliRunner().invoke(app, ["convert", str(exported), str(tmp_path / "x.pt"), "--to", "torch",
                                          "--flavor", "debugmodel", "--anchors"])  # fmt: skip
        assert result.exit_code == 2 and "is a torch checkpoint" in result.output

        # Resume both groups from step 3 (between syncs: weights apart from the anchors, momentum set).
        resumed = []
        for g, folder in enumerate(synced):
            copy = tmp_path / f"r{g}"
            shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("step-4", "step-5", "metrics.jsonl"))
            resumed.append(copy.name)
        resumed_folders = train_groups(tmp_path, (resumed[0], resumed[1]), address, "--fault_tolerance.sync_steps",
                                       "2", "--training.steps", "5", "--checkpoint.interval", "1")
        for g, folder in enumerate(resumed_folders):
            for step in (4, 5):  # a sync, and a step after it
                again = dcp_tensors(folder / f"checkpoint/step-{step}")
                assert again.keys() == saved[g, step].keys()
                different = [k for k in again if not torch.equal(again[k], saved[g, step][k])]
                assert not different, (step, different)
            assert re.search(r"loaded \S+step-3 \(.*diloco", (tmp_path / f"r{g}.log").read_text())

        # Overlapped (fragment_sync_delay 1): the all-reduce starts after step 1 from its weights, the outer step is
        # taken after step 2 (here early, in the step-1 checkpoint, which saves inside the window), the weights then
        # half the anchors, half the group's own; both groups resumed from step 1 end as the uninterrupted run.
        # Two ranks per group (FSDP inside it): the anchors and pseudo-gradients are DTensor shards.
        overlap = ["--fault_tolerance.sync_steps", "2", "--fault_tolerance.fragment_sync_delay", "1",
                   "--fault_tolerance.fragment_update_alpha", "0.5", "--training.steps", "4",
                   "--checkpoint.interval", "1", "--nproc-per-node", "2"]  # fmt: skip
        delayed = train_groups(tmp_path, ("d0", "d1"), address, *overlap)
        delayed_log = (tmp_path / "d0.log").read_text()
        assert "each all-reduce behind 1 inner steps" in delayed_log
        assert "step 2 syncs 2 of 2 replica groups" in delayed_log  # its outer step's, not its quorum's (1)
        after = {(g, step): dcp_tensors(folder / f"checkpoint/step-{step}")
                 for g, folder in enumerate(delayed) for step in (1, 2, 3, 4)}
        one_step = [split(after[g, 1], "model.") for g in (0, 1)]
        worst = 0.0
        for name, start_weight in start_weights.items():
            delta = ((start_weight - one_step[0][name]) + (start_weight - one_step[1][name])) / 2
            expected = start_weight - OUTER_LR * (delta + OUTER_MOMENTUM * delta)
            for g in (0, 1):
                torch.testing.assert_close(after[g, 1][f"diloco.momentum.{name}"], delta, rtol=0, atol=1e-7)
                torch.testing.assert_close(after[g, 1][f"diloco.anchor.{name}"], expected, rtol=0, atol=1e-6)
                assert torch.equal(after[g, 2][f"diloco.anchor.{name}"], after[g, 1][f"diloco.anchor.{name}"])
            worst = max(worst, (after[0, 1][f"diloco.anchor.{name}"] - expected).abs().max().item())
        print(f"overlapped: max |anchors - the paper's outer step on the step-1 weights| = {worst:.2e}")
        # ft/outer_grad_norm sums over the group's shards: the fp64 norm of the whole first outer gradient (its momentum)
        momentum = torch.cat([after[0, 1][f"diloco.momentum.{n}"].double().flatten() for n in start_weights])
        delayed_records = [json.loads(line) for line in (delayed[0] / "metrics.jsonl").read_text().splitlines()]
        assert delayed_records[1]["ft/outer_grad_norm"] == pytest.approx(momentum.norm().item(), rel=1e-5)
        weights_at_2 = [split(after[g, 2], "model.") for g in (0, 1)]  # half each group's own: still apart
        assert all(not torch.equal(weights_at_2[0][k], weights_at_2[1][k]) for k in weights_at_2[0] if "norm" not in k)
        for step, sync_end in ((1, 2), (2, 0), (3, 4), (4, 0)):
            saved_window = json.loads((delayed[0] / f"checkpoint/step-{step}/diloco_sync.json").read_text())
            assert saved_window == {"stepped_sync_end": sync_end}, step
        for g, folder in enumerate(delayed):
            shutil.copytree(folder, tmp_path / f"e{g}",
                            ignore=shutil.ignore_patterns("step-2", "step-3", "step-4", "metrics.jsonl"))
        again = train_groups(tmp_path, ("e0", "e1"), address, *overlap)
        for g, folder in enumerate(again):
            for step in (2, 3, 4):
                resumed_step = dcp_tensors(folder / f"checkpoint/step-{step}")
                assert resumed_step.keys() == after[g, step].keys()
                different = [k for k in resumed_step if not torch.equal(resumed_step[k], after[g, step][k])]
                assert not different, (g, step, different)


def test_a_diloco_group_started_late_heals_from_its_peer_at_a_sync(tmp_path):
    """Group 0 trains alone (syncing with itself every INTERVAL steps); group 1, started later in a fresh folder,
    trains its first INTERVAL steps alone, then at its first sync takes group 0's weights, inner optimizer, anchors,
    outer momentum, step and data position live, and from then on both hold the same weights and DiLoCo state after each sync."""
    lighthouse = start([sys.executable, "-m", "titan_cli", "lighthouse", "--bind", "[::]:0", "--min-replicas", "1",
                        "--join-timeout-ms", "1000", "--heartbeat-timeout-ms", "1000"], tmp_path / "lighthouse.log")
    groups: list[Group] = []
    diloco = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", str(INTERVAL)]
    try:
        found = wait_for(lambda: re.search(r"lighthouse at (\S+):", (tmp_path / "lighthouse.log").read_text()),
                         "lighthouse address")
        address = found.group(1)
        first = Group(tmp_path, "g0", 0, address, *diloco)
        groups.append(first)
        wait_for(lambda: len(first.poll()) >= 2 * INTERVAL, f"{2 * INTERVAL} steps of group 0 alone")
        late = Group(tmp_path, "g1", 1, address, *diloco)
        groups.append(late)
        healed = wait_for(lambda: re.search(r"recovered step (\d+) live", late.log.read_text()), "the late group healed")
        joined = int(healed.group(1)) + 1  # the sync it healed at
        # Both save every INTERVAL steps (each a sync step): one both saved after the sync they took together.
        common = wait_for(lambda: sorted(s for s in first.saved() & late.saved() if s > joined), "a common checkpoint")
        for group in groups:
            group.proc.send_signal(signal.SIGTERM)
        for group in groups:
            assert group.proc.wait(timeout=60) == 0, group.log.read_text()[-3000:]
        assert "syncs 2 of 2 replica groups" in first.log.read_text()
        late_steps = [json.loads(line)["step"] for line in (late.folder / "metrics.jsonl").read_text().splitlines()]
        # its first INTERVAL - 1 steps alone; its first sync step is numbered as its peer's
        assert late_steps[:INTERVAL] == [*range(1, INTERVAL), joined] and joined > INTERVAL

        ours = dcp_tensors(first.folder / f"checkpoint/step-{common[0]}")
        theirs = dcp_tensors(late.folder / f"checkpoint/step-{common[0]}")
        compared = [k for k in ours if not k.startswith("optimizer.")]  # the inner optimizers are each group's own
        assert ours.keys() == theirs.keys() and any(k.startswith("diloco.momentum.") for k in compared)
        different = [k for k in compared if not torch.equal(ours[k], theirs[k])]
        assert not different, different
        # and the late group reads on at its peer's data position (its own slice of each global batch)
        saved = [json.loads((g.folder / f"checkpoint/step-{common[0]}/dataloader.json").read_text()) for g in groups]
        assert saved[0] == saved[1], saved
        print(f"\nthe late group healed at step {joined}; compared at step {common[0]}")
    finally:
        for proc in [g.proc for g in groups] + [lighthouse]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_fragments_cut_the_blocks_in_order_with_the_embedding_first_and_the_output_last():
    names = ["tok_embeddings.weight", *(f"layers.{i}.{w}.weight" for i in range(5) for w in ("wq", "wo")),
             "norm.weight", "output.weight"]
    fragments = model_fragments(names, "layers", 3)
    blocks = [sorted({int(n.split(".")[1]) for n in f if n.startswith("layers.")}) for f in fragments]
    assert blocks == [[0, 1], [2, 3], [4]]
    assert fragments[0][0] == "tok_embeddings.weight" and fragments[2][-2:] == ["norm.weight", "output.weight"]
    assert sorted(n for f in fragments for n in f) == sorted(names)
    assert model_fragments(names, "layers", 1) == [names]
    with pytest.raises(ValueError, match="6 DiLoCo fragments for a model of 5 blocks"):
        model_fragments(names, "layers", 6)


def test_bf16_master_weights_train_diloco_groups_not_per_step_ones():
    """DiLoCo averages the groups' fp32 weights, so a group of one bf16 rank keeps its master weights; the per-step
    mode would average the bf16 gradients the optimizer reads, and the job check refuses it."""
    from titan_core.config import ConfigError, load_config
    from titan_core.job import resolve

    ft = ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2",
          "--fault_tolerance.lighthouse", "http://localhost:29510", "--training.mixed_precision_param", "bfloat16",
          "--optimizer.master_weights", "on"]  # fmt: skip
    job = resolve(load_config(None, [*ft, "--fault_tolerance.semi_sync_method", "diloco"]), 1)
    assert job.parallel.master_weights
    with pytest.raises(ConfigError, match="fault_tolerance.enable averages gradients over replica groups"):
        resolve(load_config(None, ft), 1)


class FakeGroups:
    """torchft's replica groups for one in-process DiLoCo: the all-reduce averages this group's pseudo-gradient with
    a peer's that stayed at the anchors (zero), i.e. halves it; the vote says `votes.pop(0)` (True when empty)."""

    def __init__(self, votes: list[bool] | None = None):
        self.votes, self.quorums, self.commits = list(votes or []), [], 0
        self.in_flight: list[torch.Tensor] = []

    def add_state(self, name, tensors):
        pass

    def quorum(self, done_steps):
        self.quorums.append(done_steps)

    def start_average(self, flats):
        self.in_flight = list(flats)
        self.dtypes = [flat.dtype for flat in flats]
        return [object()]

    def wait(self, works):
        for flat in self.in_flight:  # (a second wait finds nothing left to halve)
            flat.div_(2)
        self.in_flight = []

    def errored(self):
        return False

    def commit(self, step=None):
        self.commits += 1
        return self.votes.pop(0) if self.votes else True


def tiny_blocks() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    model.out = torch.nn.Linear(4, 2)
    return model


def inner_step(model: torch.nn.Module, step: int) -> None:
    """A stand-in for the inner optimizer's step: a seeded move of every weight."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


def overlapped(model: torch.nn.Module, groups: FakeGroups, alpha: float = 0.25):
    from titan_core.diloco import DiLoCo

    names = [n for n, _ in model.named_parameters()]
    return DiLoCo([model], groups, sync_steps=4, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                  fragments=model_fragments(names, "layers", 2), delay=1, alpha=alpha, last_step=8)


def test_a_delayed_sync_takes_its_outer_step_later_and_merges_the_groups_own_progress():
    """Streaming DiLoCo's overlap: 2 fragments synced every 4 steps (fragment 0 after steps 2, 6; fragment 1 after
    4, 8), each all-reduce started one step before (after 1, 3, 5, 7) from the weights then, the outer step on the
    average taken a step later, the weights then (1 - alpha) x anchors + alpha x the group's own after that step."""
    model = tiny_blocks()
    groups = FakeGroups()
    outer = overlapped(model, groups)
    params = dict(model.named_parameters())
    fragment_of = {n: f for f, names in enumerate(model_fragments(list(params), "layers", 2)) for n in names}
    anchor = {n: p.detach().clone() for n, p in params.items()}
    momentum = {n: torch.zeros_like(p) for n, p in params.items()}
    delta: dict[str, torch.Tensor] = {}
    for step in range(1, 9):
        inner_step(model, step)
        changed = outer.advance(step)
        assert changed == (step % 2 == 0)
        for name, p in params.items():
            fragment = fragment_of[name]
            if step % 4 == 2 * fragment + 1:  # this fragment's all-reduce starts from the weights after this step
                delta[name] = (anchor[name] - p.detach()) / 2  # (the average with a peer that did not move)
            if step % 4 == (2 * fragment + 2) % 4:  # its outer step, a step later: torch's Nesterov SGD
                momentum[name] = OUTER_MOMENTUM * momentum[name] + delta[name]
                anchor[name] = anchor[name] - OUTER_LR * (delta[name] + OUTER_MOMENTUM * momentum[name])
                # the weights here are merged already: compare the anchors, then the merge below
                torch.testing.assert_close(outer.anchors[name], anchor[name], rtol=0, atol=1e-6)
                torch.testing.assert_close(outer.momentum[name], momentum[name], rtol=0, atol=1e-6)
        if changed:  # the outer gradient's norm: the synced fragment's averaged pseudo-gradient
            synced = [delta[n].flatten() for n in params if step % 4 == (2 * fragment_of[n] + 2) % 4]
            expected_norm = torch.cat(synced).double().norm().item()
            assert outer.metrics()["ft/outer_grad_norm"] == pytest.approx(expected_norm, rel=1e-6)
    assert groups.quorums == [0, 2, 4, 6] and groups.commits == 4  # a quorum at each start, a vote at each end

    # The merge, against a group that took the same steps with alpha 0 (its weights become the anchors).
    merging, plain = tiny_blocks(), tiny_blocks()
    mixed, whole = overlapped(merging, FakeGroups()), overlapped(plain, FakeGroups(), alpha=0.0)
    for step in (1, 2):
        for model, outer in ((merging, mixed), (plain, whole)):
            inner_step(model, step)
            local = {n: p.detach().clone() for n, p in model.named_parameters()}  # before the sync's merge
            outer.advance(step)
    first = set(model_fragments(list(params), "layers", 2)[0])
    for name, weight in merging.named_parameters():
        if name in first:
            assert torch.equal(mixed.anchors[name], whole.anchors[name])
            assert torch.equal(dict(plain.named_parameters())[name], whole.anchors[name])
            torch.testing.assert_close(weight.detach(), 0.75 * whole.anchors[name] + 0.25 * local[name],
                                       rtol=0, atol=1e-7)
        else:  # not synced yet
            assert torch.equal(weight, local[name])


def test_a_checkpoint_inside_the_window_holds_the_outer_step_and_resumes_bit_exactly():
    """A save between a sync's start and its outer step takes the step then (the anchors a resumed run merges
    with); the run that saved ends the window as one that did not save, a run resumed from the save merges without
    a vote (with or without the delay), and a vote that drops the sync takes the early step back."""
    import copy

    from titan_core.diloco import DiLoCo

    saving, plain = tiny_blocks(), tiny_blocks()
    groups = FakeGroups()
    a, b = overlapped(saving, groups), overlapped(plain, FakeGroups())
    for model, outer in ((saving, a), (plain, b)):
        inner_step(model, 1)
        outer.advance(1)  # fragment 0's all-reduce in flight
    saved_weights = copy.deepcopy(saving.state_dict())
    saved = {k: v.clone() for k, v in a.state_dict().items()}  # the checkpoint's tensor state, then its JSON one
    window = a.window.state_dict()
    assert window == {"stepped_sync_end": 2}
    first = model_fragments([n for n, _ in saving.named_parameters()], "layers", 2)[0]
    assert not torch.equal(saved[f"anchor.{first[0]}"], b.anchors[first[0]])  # stepped already, b not yet

    resumed_model = tiny_blocks()
    resumed_model.load_state_dict(saved_weights)
    resumed_groups = FakeGroups()
    resumed = overlapped(resumed_model, resumed_groups)
    resumed.load_state_dict(saved)
    resumed.window.load_state_dict(window)
    for step in range(2, 9):
        for model, outer in ((saving, a), (plain, b), (resumed_model, resumed)):
            inner_step(model, step)
            outer.advance(step)
        for other in (plain, resumed_model):
            for (name, x), y in zip(saving.state_dict().items(), other.state_dict().values(), strict=True):
                assert torch.equal(x, y), (step, name)
        if step == 2:
            merged_at_2 = {k: v.clone() for k, v in saving.state_dict().items()}
        assert all(torch.equal(a.anchors[n], resumed.anchors[n]) for n in a.anchors)
    assert groups.commits == 4 and resumed_groups.commits == 3  # the resumed run's first window: no vote

    # Resumed with no delay: the sync the checkpoint holds is merged at step 2, not started again there.
    undelayed_model, undelayed_groups = tiny_blocks(), FakeGroups()
    undelayed_model.load_state_dict(saved_weights)
    names = [n for n, _ in undelayed_model.named_parameters()]
    undelayed = DiLoCo([undelayed_model], undelayed_groups, sync_steps=4, outer_lr=OUTER_LR,
                       outer_momentum=OUTER_MOMENTUM, fragments=model_fragments(names, "layers", 2), alpha=0.25)
    undelayed.load_state_dict(saved)
    undelayed.window.load_state_dict(window)
    inner_step(undelayed_model, 2)
    undelayed.advance(2)
    assert undelayed_groups.quorums == [] and undelayed_groups.commits == 0
    assert all(torch.equal(x, y) for x, y in zip(merged_at_2.values(), undelayed_model.state_dict().values(),
                                                 strict=True))
    assert a.window.state_dict() == {"stepped_sync_end": 0}  # no sync in flight after step 8

    # Dropped by the vote: the early step is taken back and fragment 0's weights return to the last anchors.
    dropped_model = tiny_blocks()
    start = {n: p.detach().clone() for n, p in dropped_model.named_parameters()}
    dropped = overlapped(dropped_model, FakeGroups(votes=[False]))
    inner_step(dropped_model, 1)
    dropped.advance(1)
    dropped.state_dict()  # a checkpoint inside the window: the early step
    inner_step(dropped_model, 2)
    dropped.advance(2)
    weights = dict(dropped_model.named_parameters())
    for name in weights:
        assert torch.equal(dropped.anchors[name], start[name]) and dropped.momentum[name].eq(0).all()
        assert torch.equal(weights[name], start[name]) == (name in first), name


def test_bfloat16_on_the_wire_halves_the_bytes_and_steps_in_fp32():
    """`sync_dtype = bfloat16`: the pseudo-gradients cross in bf16 (half the bytes), the outer step reads them back
    in fp32: the anchors are the fp32 outer step on the bf16-rounded average."""
    from titan_core.diloco import DiLoCo

    model, groups = tiny_blocks(), FakeGroups()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    outer = DiLoCo([model], groups, sync_steps=2, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                   sync_dtype=torch.bfloat16)
    for step in (1, 2):
        inner_step(model, step)
        local = {n: p.detach().clone() for n, p in model.named_parameters()}
        outer.advance(step)
    assert groups.dtypes == [torch.bfloat16]
    for name, weight in model.named_parameters():
        delta = ((start[name] - local[name]).bfloat16() / 2).float()  # the wire's rounding, then the average
        assert outer.anchors[name].dtype == torch.float32 and torch.equal(outer.momentum[name], delta)
        torch.testing.assert_close(weight.detach(), start[name] - OUTER_LR * (delta + OUTER_MOMENTUM * delta),
                                   rtol=0, atol=1e-7)
        assert not torch.equal(delta, (start[name] - local[name]) / 2)  # (bf16 did round it)
