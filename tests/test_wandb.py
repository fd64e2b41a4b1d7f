"""Weights & Biases beside TensorBoard: a real `titan train` run in W&B's offline mode records the
resolved config and the same losses as metrics.jsonl; TensorBoard records the config as text; and
`metrics.enable_wandb` without the package is one line before training starts."""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util
from wandb.proto import wandb_internal_pb2

from titan_core.config import ConfigError
from titan_core.metrics import MetricsLogger
from titan_core.metrics.wandb_sink import MISSING_WANDB, WandbOptions
from titan_run import REPO, TINY, losses, run_titan, titan_env
import warm_python

STEPS = ["--training.steps", "4"]


def wandb_records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    """The records of an offline run's `run-<id>.wandb` file.

    wandb >= 0.18 no longer ships a Python reader (its Go service writes the file), so this reads the
    format itself: a 7-byte header (`:W&B`, magic, version), then LevelDB log blocks of 32 KiB, each
    chunk a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes.
    """
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    block, pos, pending = 32 * 1024, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left for a chunk header: the block is padded
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding at the end of the file
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_and_tensorboard_record_config_and_losses(tmp_path):
    dump, wandb_dir = tmp_path / "run", tmp_path / "wandb-dir"
    run_titan(
        dump, *TINY, *STEPS, "--metrics.enable_tensorboard", "true", "--metrics.enable_wandb", "true",
        "--metrics.wandb_run_name", "tiny-offline",
        env={"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"},
    )
    expected = losses(dump)
    assert len(expected) == 4

    # W&B: one offline run under WANDB_DIR (not the run folder), holding the config and every logged loss.
    [run_file] = (wandb_dir / "wandb").glob("offline-run-*/run-*.wandb")
    assert not (dump / "wandb").exists()
    records = list(wandb_records(run_file))
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("titan", "tiny-offline")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["training"]["steps"] == 4
    assert config["training"]["seq_len"] == 32
    assert config["metrics"]["enable_wandb"] is True
    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in r.history.item}
            history.append(row)
    assert [row["_step"] for row in history] == [1, 2, 3, 4]
    assert [row["loss/global_avg"] for row in history] == expected  # the same floats, bit for bit
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finished, not cut off

    # TensorBoard: the resolved config as TOML text, once.
    events = EventAccumulator(str(dump / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    [text] = events.Tensors("config/text_summary")
    toml = tensor_util.make_ndarray(text.tensor_proto).item().decode()
    assert toml.startswith("```toml\n")
    assert "[training]" in toml and "steps = 4" in toml


def test_missing_wandb_is_one_line_before_training(tmp_path):
    # `import wandb` fails in this process as if the package were not installed.
    script = "import sys; sys.modules['wandb'] = None; from titan_cli.main import app; app()"
    cmd = [sys.executable, "-c", script, "train", "--job.dump_folder", str(tmp_path), *TINY, "--metrics.enable_wandb", "true"]
    proc = warm_python.run(cmd, env=titan_env(), timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"titan: error: {MISSING_WANDB}"], proc.stderr
    assert "pip install 'titan-core[wandb]'" in MISSING_WANDB and "metrics.enable_wandb" in MISSING_WANDB
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing trained


def test_wandb_without_a_login_names_the_key_and_the_fix(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_CONFIG_DIR", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no saved login
    monkeypatch.setenv("WANDB_MODE", "online")
    options = WandbOptions("titan", "no-login", {"training": {"steps": 1}}, tmp_path)
    with pytest.raises(ConfigError, match=r"metrics.enable_wandb: wandb.init failed .*wandb login.*WANDB_MODE=offline"):
        MetricsLogger(None, enable_tensorboard=False, rank=0, total_steps=1, color=False, wandb=options)
