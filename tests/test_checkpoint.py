"""`titan_ckpt.CheckpointManager` in one process (a world of one over gloo): what a checkpoint
holds and restores, atomic folders, keep_latest_k, model-only bf16 saves, damaged and
tampered files, pipeline-style model parts, and the hooks for other weight formats.

Multi-process runs of the trainer are in tests/test_resume.py.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemReader
from torch.optim.lr_scheduler import LambdaLR

from titan_ckpt import CheckpointError, CheckpointManager, CheckpointOptions

_CHECKPOINT_ERROR_INIT = CheckpointError.__init__


@pytest.fixture(autouse=True)
def errors_name_their_arguments(monkeypatch):
    """Every CheckpointError raised here names each of its `arguments` as a whole word (the contract
    callers rely on to rewrite them, e.g. into config keys)."""

    def checked_init(self, message, *, arguments=()):
        for argument in arguments:
            assert re.search(rf"(?<![\w.]){re.escape(argument)}(?!\w)", message), (argument, message)
        _CHECKPOINT_ERROR_INIT(self, message, arguments=arguments)

    monkeypatch.setattr(CheckpointError, "__init__", checked_init)


pytestmark = pytest.mark.usefixtures("world_of_one")  # the manager's collectives (tests/conftest.py)


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 16)


class Tiny(nn.Module):
    """Embedding + linear head; `Embed` and `Head` are its two "pipeline stages" (same names)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


class Counter:
    """A JSON state."""

    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class Run:
    """A model, AdamW, a warmup LR schedule and a counter, as a trainer holds them."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.model = Tiny()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1, betas=(0.8, 0.9), weight_decay=0.1)
        self.scheduler = LambdaLR(self.optimizer, lambda step: (step + 1) / 10)
        self.counter = Counter()

    def manager(self, folder: Path, **kwargs) -> CheckpointManager:
        states = {"lr_scheduler": self.scheduler, "counter": self.counter}
        return CheckpointManager(folder, model_parts=[self.model], optimizers=[self.optimizer], states=states, **kwargs)

    def step(self, n: int = 1, data_seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(data_seed)
        for _ in range(n):
            x = torch.randint(0, 16, (4, 5), generator=gen)
            loss = F.cross_entropy(self.model(x).flatten(0, 1), x.flatten())
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.counter.value += 1


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def stored_tensors(folder: Path) -> dict[str, torch.dtype]:
    meta = FileSystemReader(str(folder)).read_metadata()
    return {k: m.properties.dtype for k, m in meta.state_dict_metadata.items()}


def test_save_then_load_restores_model_optimizer_lr_json_states_and_rng(tmp_path):
    a = Run(seed=1)
    a.step(3)
    saver = a.manager(tmp_path, interval=3)
    assert not saver.save(2) and saver.save(3)
    expected_draw = torch.rand(4)  # drawn from the RNG state saved with step 3
    folder = tmp_path / "step-3"
    manifest = json.loads((folder / "manifest.json").read_text())
    on_disk = {p.name for p in folder.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk and {".metadata", "__0_0.distcp", "counter.json", "rng.json"} <= on_disk
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert entry == {"bytes": len(data), "crc32": zlib.crc32(data)}

    b = Run(seed=2)  # other weights, empty optimizer, schedule at 0
    assert b.manager(tmp_path).load() == 3
    assert all(torch.equal(v, params(a.model)[k]) for k, v in params(b.model).items())
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.optimizer.state[pa][key], b.optimizer.state[pb][key])
    assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 4 / 10)
    assert b.optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    assert b.scheduler.last_epoch == 3 and b.counter.value == 3
    assert torch.equal(torch.rand(4), expected_draw)
    # Training on from the checkpoint is the same as never having stopped.
    a.step(2, data_seed=5)
    b.step(2, data_seed=5)
    assert all(torch.equal(v, params(a.model)[k]) for k, v in params(b.model).items())


def test_async_save_holds_the_state_of_its_step(tmp_path, caplog):
    """Two background saves in a row, each holding its own step's state. The second stages again: torch 2.11's
    stager closed itself after the first ("KeyError: <class 'type'>"), torch 2.15's reuses its buffers."""
    a = Run(seed=1)
    a.step(2)
    at_save = {2: params(a.model)}
    with caplog.at_level(logging.WARNING, logger="titan"):
        saver = a.manager(tmp_path, interval=2, async_mode="async_with_pinned_mem")
    assert "this CPU-only run saves as 'async'" in caplog.text  # no CUDA here: plain async, said once
    assert saver.save(2)
    a.step(1, data_seed=9)  # training goes on while the files are written
    saver.save(3)  # not a save step: completes step-2 once its write is done
    a.step(1, data_seed=10)
    at_save[4] = params(a.model)
    assert saver.save(4)
    a.step(1, data_seed=11)
    saver.close()
    for step in (2, 4):
        assert (tmp_path / f"step-{step}" / "manifest.json").is_file()
        b = Run(seed=2)
        assert b.manager(tmp_path, load_step=step).load() == step
        assert all(torch.equal(v, at_save[step][k]) for k, v in params(b.model).items())
        assert b.counter.value == step


def test_keep_latest_k_and_unfinished_folders(tmp_path):
    a = Run(seed=1)
    saver = a.manager(tmp_path, interval=1, keep_latest_k=2)
    for step in range(1, 5):
        a.step()
        saver.save(step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-4"]
    (tmp_path / "step-9.tmp").mkdir()  # a save killed half-way
    (tmp_path / "step-9.tmp" / "__0_0.distcp").write_bytes(b"half")
    shutil.copytree(tmp_path / "step-4", tmp_path / "step-8")
    (tmp_path / "step-8" / "manifest.json").unlink()  # no manifest: never complete
    b = Run(seed=2)
    assert b.manager(tmp_path).load() == 4
    assert not (tmp_path / "step-9.tmp").exists()
    assert b.counter.value == 4


def test_keep_interval_spares_milestones_from_keep_latest_k(tmp_path):
    a = Run(seed=1)
    saver = a.manager(tmp_path, interval=1, keep_latest_k=2, keep_interval=3)
    for step in range(1, 8):
        a.step()
        saver.save(step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-6", "step-7"]  # the newest 2, and 3 and 6
    assert Run(seed=2).manager(tmp_path).load() == 7
    with pytest.raises(CheckpointError, match=re.escape("keep_interval=3; keep the checkpoints of every N-th step with N a multiple of interval=2")) as err:
        CheckpointManager(tmp_path, model_parts=[a.model], interval=2, keep_interval=3)
    assert err.value.arguments == ("keep_interval", "interval")


def test_first_step_save_and_a_load_only_manager(tmp_path):
    a = Run(seed=1)
    saver = a.manager(tmp_path, interval=4, save_first_step=True)
    saved = []
    for step in range(1, 6):
        a.step()
        saved += [step] if saver.save(step, last_step=step == 5) else []
    assert saved == [1, 4, 5] and sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-4", "step-5"]
    (tmp_path / "step-6.tmp").mkdir()  # another run's save in progress: a load-only manager leaves it
    b = Run(seed=2)
    reader = b.manager(tmp_path, interval=1, load_only=True)
    assert reader.load() == 5 and b.counter.value == 5
    assert all(torch.equal(v, params(a.model)[k]) for k, v in params(b.model).items())
    b.step()
    assert not reader.due(6, last_step=True) and not reader.save(6, last_step=True) and not reader.save(6, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-4", "step-5", "step-6.tmp"]
    with pytest.raises(CheckpointError, match="a seed checkpoint needs a manager that saves, not load_only") as err:
        Run(seed=3).manager(tmp_path / "seed", load_only=True).save_seed()
    assert err.value.arguments == ("load_only",)


def test_model_only_last_save_in_export_dtype(tmp_path):
    a = Run(seed=1)
    a.step(5)
    saver = a.manager(tmp_path, interval=100, last_save_model_only=True, export_dtype=torch.bfloat16)
    assert saver.save(5, last_step=True)
    stored = stored_tensors(tmp_path / "step-5")
    assert set(stored) == {"embed.weight", "head.weight", "head.bias"}
    assert set(stored.values()) == {torch.bfloat16}
    b = Run(seed=2)
    assert b.manager(tmp_path).load() == 5
    expected = {k: v.to(torch.bfloat16).float() for k, v in params(a.model).items()}
    assert all(torch.equal(v, expected[k]) for k, v in params(b.model).items())
    assert not b.optimizer.state and b.counter.value == 5  # no optimizer state saved; the small states are


@pytest.mark.parametrize("damage", ["truncate", "delete", "flip"])
def test_damaged_file_is_named_with_an_older_step_to_use(tmp_path, damage):
    a = Run(seed=1)
    saver = a.manager(tmp_path, interval=1, keep_latest_k=0)
    for step in (1, 2):
        a.step()
        saver.save(step)
    shard = tmp_path / "step-2" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "delete":
        shard.unlink()
    else:
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(data)
    with pytest.raises(CheckpointError) as err:
        Run(seed=2).manager(tmp_path).load()
    problem = {"truncate": "truncated", "delete": "missing", "flip": "corrupt"}[damage]
    assert str(shard) in str(err.value) and problem in str(err.value)
    assert "load_step=1" in str(err.value) and err.value.arguments == ("load_step",)
    assert Run(seed=3).manager(tmp_path, load_step=1).load() == 1  # the suggested fix works


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_tampered_metadata_is_never_unpickled(tmp_path):
    a = Run(seed=1)
    a.step()
    a.manager(tmp_path, interval=1).save(1)
    folder = tmp_path / "step-1"
    evil = _Evil()
    evil.marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(evil))
    manifest = json.loads((folder / "manifest.json").read_text())  # made to match, as an attacker would
    data = (folder / ".metadata").read_bytes()
    manifest["files"][".metadata"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="refusing to load global"):
        Run(seed=2).manager(tmp_path).load()
    assert not evil.marker.exists()


def test_load_step_not_found_lists_the_complete_steps(tmp_path):
    a = Run(seed=1)
    a.manager(tmp_path, interval=1).save(2)
    with pytest.raises(CheckpointError, match=r"no complete step-7; complete checkpoints: \[2\]") as err:
        Run(seed=2).manager(tmp_path, load_step=7).load()
    assert err.value.arguments == ("load_step",)


@pytest.mark.parametrize(
    "kwargs, argument, says",
    [
        ({"exclude_from_loading": ["data"]}, "exclude_from_loading", "unknown state 'data'"),
        ({"async_mode": "background"}, "async_mode", "unknown 'background'"),
        ({"interval": 0}, "interval", "interval=0"),
        ({"keep_latest_k": -1}, "keep_latest_k", "keep_latest_k=-1"),
        ({"load_step": -2}, "load_step", "load_step=-2"),
        ({"optimizers": []}, None, None),  # no optimizer at all is allowed (a model-only manager)
    ],
)
def test_arguments_are_checked_naming_the_argument(tmp_path, kwargs, argument, says):
    a = Run(seed=1)
    kwargs = {"optimizers": [a.optimizer], **kwargs}
    if argument is None:
        CheckpointManager(tmp_path, model_parts=[a.model], **kwargs)
        return
    with pytest.raises(CheckpointError, match=re.escape(says)) as err:
        CheckpointManager(tmp_path, model_parts=[a.model], **kwargs)
    assert err.value.arguments == (argument,)


def test_options_are_the_keywords_as_one_value(tmp_path):
    import dataclasses
    import inspect

    a = Run(seed=1)
    options = CheckpointOptions(folder=tmp_path, interval=1, keep_latest_k=2, export_dtype=torch.bfloat16)
    by_options = CheckpointManager(model_parts=[a.model], optimizers=[a.optimizer], options=options)
    by_keywords = a.manager(tmp_path, interval=1, keep_latest_k=2, export_dtype=torch.bfloat16)
    assert by_options.options == dataclasses.replace(by_keywords.options, exclude_from_loading=()) == options
    assert (by_options.folder, by_options.interval, by_options.export_dtype) == (tmp_path, 1, torch.bfloat16)
    by_options.save(1)
    assert Run(seed=2).manager(tmp_path).load() == 1
    # The keyword defaults are the options' defaults: a manager given neither is the same either way.
    defaults = inspect.signature(CheckpointManager).parameters
    for field in dataclasses.fields(CheckpointOptions):
        if field.name != "folder":
            assert defaults[field.name].default == field.default, field.name
    with pytest.raises(TypeError, match="not both"):
        CheckpointManager(model_parts=[a.model], options=options, interval=3)
    with pytest.raises(TypeError, match="not both"):
        CheckpointManager(tmp_path, model_parts=[a.model], options=options)
    with pytest.raises(TypeError, match="needs a folder"):
        CheckpointManager(model_parts=[a.model])
    with pytest.raises(CheckpointError, match="interval=0") as err:  # the options are checked as the keywords are
        CheckpointManager(model_parts=[a.model], options=CheckpointOptions(folder=tmp_path, interval=0))
    assert err.value.arguments == ("interval",)


def test_the_trainer_builds_its_manager_from_the_resolved_options(tmp_path):
    from titan_core.checkpointing import build_checkpointer
    from titan_core.config import load_config
    from titan_core.job.options import checkpoint_options

    cfg = load_config(None, ["--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.export_dtype", "bfloat16",
                             "--checkpoint.enable_first_step_checkpoint", "--job.dump_folder", str(tmp_path)])
    a = Run(seed=1)
    parts = dict(model_parts=[a.model], optimizers=[a.optimizer], lr_schedulers=[a.scheduler], dataloader=Counter(),
                 train_state=Counter(), device=torch.device("cpu"), load_model_fn=lambda path: {})
    resolved = build_checkpointer(checkpoint_options(cfg.checkpoint, tmp_path), **parts)
    former = build_checkpointer(cfg.checkpoint, run_folder=tmp_path, **parts)  # the config section still works
    assert resolved.options == former.options and resolved.folder == tmp_path / "checkpoint"
    assert (resolved.interval, resolved.export_dtype) == (3, torch.bfloat16)
    assert resolved.save_first_step and not resolved.load_only
    assert resolved.load_model_fn is not None and former.load_model_fn is None  # not initial_load_in_hf
    with pytest.raises(TypeError, match="run_folder"):
        build_checkpointer(cfg.checkpoint, **parts)


def test_arguments_and_states_are_checked(tmp_path):
    a = Run(seed=1)
    with pytest.raises(CheckpointError, match="'rng' is reserved") as err:
        CheckpointManager(tmp_path, model_parts=[a.model], optimizers=[a.optimizer], states={"rng": Counter()})
    assert err.value.arguments == ("states",)
    with pytest.raises(CheckpointError, match="optimizers has 2 entries for 1 model parts") as err:
        CheckpointManager(tmp_path, model_parts=[a.model], optimizers=[a.optimizer, a.optimizer])
    assert err.value.arguments == ("optimizers",)
    a.counter.value = torch.tensor(1)  # not JSON
    with pytest.raises(CheckpointError, match="the 'counter' state is not plain JSON data"):
        a.manager(tmp_path, interval=1).save(1)


class Tensors:
    """A tensor state: a copy of the model's weights (as a moving average keeps one)."""

    def __init__(self, model: nn.Module):
        self.tensors = {k: v.detach().clone() for k, v in model.named_parameters()}
        self.loaded = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        assert all(state[k] is self.tensors[k] for k in state)  # filled in place
        self.loaded += 1


def test_tensor_states_save_in_every_save_and_load_in_place(tmp_path):
    a = Run(seed=1)
    kept = Tensors(a.model)
    a.step(2)
    a.manager(tmp_path, tensor_states={"copy": kept}, interval=2).save(2)
    a.manager(tmp_path, tensor_states={"copy": kept}, interval=2, last_save_model_only=True,
              export_dtype=torch.bfloat16).save(4, last_step=True)  # fmt: skip
    assert {"copy.embed.weight", "copy.head.bias"} <= set(stored_tensors(tmp_path / "step-2"))
    assert stored_tensors(tmp_path / "step-4")["copy.head.weight"] == torch.bfloat16  # model-only: export dtype
    assert "copy" in json.loads((tmp_path / "step-2" / "manifest.json").read_text())["contents"]
    b = Run(seed=2)
    other = Tensors(b.model)
    assert b.manager(tmp_path, tensor_states={"copy": other}, load_step=2).load() == 2
    assert other.loaded == 1 and all(torch.equal(other.tensors[k], v) for k, v in kept.tensors.items())
    plain = tmp_path / "plain"  # a checkpoint saved without it leaves it as it was
    a.manager(plain, interval=2).save(2)
    c = Run(seed=3)
    untouched = Tensors(c.model)
    before = {k: v.clone() for k, v in untouched.tensors.items()}
    assert c.manager(plain, tensor_states={"copy": untouched}).load() == 2
    assert untouched.loaded == 0 and all(torch.equal(untouched.tensors[k], v) for k, v in before.items())
    with pytest.raises(CheckpointError, match="tensor state name 'counter' is reserved or a JSON state's") as err:
        a.manager(tmp_path, tensor_states={"counter": kept})
    assert err.value.arguments == ("tensor_states",)


def test_excluded_states_are_not_loaded(tmp_path):
    a = Run(seed=1)
    a.step(2)
    a.manager(tmp_path, interval=2).save(2)
    b = Run(seed=2)
    fresh = params(b.model)
    assert b.manager(tmp_path, exclude_from_loading=["model", "counter"]).load() == 2
    assert all(torch.equal(v, fresh[k]) for k, v in params(b.model).items())
    assert b.counter.value == 0 and b.scheduler.last_epoch == 2 and b.optimizer.state


def test_pipeline_parts_merge_into_one_model_and_split_back(tmp_path):
    torch.manual_seed(0)
    parts = [Embed(), Head()]
    optimizers = [torch.optim.AdamW(p.parameters(), lr=0.1) for p in parts]
    x = torch.randint(0, 16, (4, 5))
    F.cross_entropy(parts[1].head(parts[0].embed(x)).flatten(0, 1), x.flatten()).backward()
    for opt in optimizers:
        opt.step()
    CheckpointManager(tmp_path / "a", model_parts=parts, optimizers=optimizers, interval=1).save(1)

    whole = Run(seed=5)  # one model, one optimizer: the same names
    assert whole.manager(tmp_path / "a").load() == 1
    assert torch.equal(whole.model.embed.weight, parts[0].embed.weight)
    assert torch.equal(whole.model.head.bias, parts[1].head.bias)
    assert torch.equal(whole.optimizer.state[whole.model.head.weight]["exp_avg"], optimizers[1].state[parts[1].head.weight]["exp_avg"])

    whole.manager(tmp_path / "b", interval=1).save(1)
    torch.manual_seed(9)
    split = [Embed(), Head()]
    split_opts = [torch.optim.AdamW(p.parameters(), lr=0.1) for p in split]
    assert CheckpointManager(tmp_path / "b", model_parts=split, optimizers=split_opts).load() == 1
    assert torch.equal(split[1].head.weight, whole.model.head.weight)
    assert torch.equal(split_opts[0].state[split[0].embed.weight]["exp_avg_sq"], whole.optimizer.state[whole.model.embed.weight]["exp_avg_sq"])


def test_other_format_hooks_and_initial_load_path(tmp_path):
    from safetensors.torch import load_file, save_file

    def save_model(folder: Path, state: dict) -> None:
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))

    def load_model(folder: Path) -> dict:
        return load_file(str(folder / "model.safetensors"))

    a = Run(seed=1)
    a.step(2)
    a.manager(tmp_path / "run-a", interval=10, last_save_model_only=True, save_model_fn=save_model, export_dtype=torch.bfloat16).save(2, last_step=True)
    exported = tmp_path / "run-a" / "step-2"
    manifest = json.loads((exported / "manifest.json").read_text())
    assert manifest["model_format"] == "external" and "model.safetensors" in manifest["files"]
    assert load_file(str(exported / "model.safetensors"))["head.weight"].dtype == torch.bfloat16

    b = Run(seed=2)  # a new run folder with no checkpoint starts from the exported weights
    assert b.manager(tmp_path / "run-b", initial_load_path=exported, load_model_fn=load_model).load() == 0
    assert torch.equal(b.model.head.weight, a.model.head.weight.to(torch.bfloat16).float())
    assert b.counter.value == 0 and not b.optimizer.state

    a.manager(tmp_path / "run-c", interval=1).save(2)  # a full DCP checkpoint as the initial load
    c = Run(seed=3)
    assert c.manager(tmp_path / "run-d", initial_load_path=tmp_path / "run-c" / "step-2").load() == 0
    assert torch.equal(c.model.embed.weight, a.model.embed.weight) and c.counter.value == 0 and not c.optimizer.state
    d = Run(seed=4)
    d.manager(tmp_path / "run-e", initial_load_path=tmp_path / "run-c" / "step-2", initial_load_model_only=False).load()
    assert d.counter.value == 2 and d.optimizer.state


def test_library_errors_name_the_argument_to_change(tmp_path):
    a = Run(seed=1)
    a.step()
    a.manager(tmp_path / "run", interval=1).save(1)
    cases = [  # (what goes wrong, the arguments its error names)
        (lambda: a.manager(tmp_path / "new", initial_load_path=tmp_path).load(), ("initial_load_path", "load_model_fn")),
        (lambda: a.manager(tmp_path / "run", enable=False).save_seed(), ("enable",)),
        (lambda: a.manager(tmp_path / "run").save_seed(), ("folder",)),
    ]
    unverified = tmp_path / "unverified"
    shutil.copytree(tmp_path / "run" / "step-1", unverified)
    (unverified / "manifest.json").unlink()
    cases.append((lambda: a.manager(tmp_path / "new", initial_load_path=unverified, initial_load_model_only=False).load(),
                  ("initial_load_path", "initial_load_model_only")))
    wider = Run(seed=2)
    wider.model.head = nn.Linear(8, 17)  # another shape than the one saved
    wider.optimizer = torch.optim.AdamW(wider.model.parameters())
    cases.append((lambda: wider.manager(tmp_path / "run").load(), ("model_parts",)))
    for fail, arguments in cases:
        with pytest.raises(CheckpointError) as err:
            fail()
        assert err.value.arguments == arguments, str(err.value)
