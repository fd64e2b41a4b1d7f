"""titan-ckpt on a model it has never seen: save, verify, resume, and import Hugging Face weights.

Needs only `pip install titan-ckpt` (torch, numpy, safetensors, huggingface-hub, tqdm).
The model below is a small PyTorch language model written here. Run:

    python examples/checkpoint_any_model.py [WORK_DIR]
    torchrun --nproc-per-node 2 examples/checkpoint_any_model.py [WORK_DIR]   # FSDP2-sharded

It trains 6 steps uninterrupted, then again with checkpoints every 2 steps (written in
the background) stopped after step 4 and resumed by a fresh manager, and checks:
- atomic: a save is `step-N.tmp` until complete, then renamed to `step-N`;
- verified: every file's CRC-32 is in `manifest.json`, and a damaged file is refused
  with a `CheckpointError` that names the argument to change (`load_step`);
- resume: the resumed losses equal the uninterrupted run's exactly;
- Hugging Face: safetensors + config.json with Hugging Face-style names, converted
  to DCP with a renaming function, load back tensor-equal.
Each check prints one `check ...` line; the exit status is nonzero if any fails.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from titan_ckpt import CheckpointError, CheckpointManager, convert_hf_to_dcp, read_dcp_state_dict

VOCAB, DIM, CONTEXT, LAYERS, BATCH, SEQ, STEPS = 64, 32, 4, 2, 8, 16, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ConvLM(nn.Module):
    """Each position sees the last CONTEXT tokens through a causal depthwise convolution."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Conv1d(DIM, DIM, kernel_size=CONTEXT, groups=DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):  # (bs, seq) -> (bs, seq, vocab)
        h = self.embed(tokens).transpose(1, 2)  # (bs, dim, seq)
        h = self.mix(F.pad(h, (CONTEXT - 1, 0))).transpose(1, 2)  # causal: left padding only
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class TrainState:
    """The step and tokens seen: a JSON state the manager saves beside the tensors."""

    def __init__(self):
        self.step, self.tokens = 0, 0

    def state_dict(self):
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state):
        self.step, self.tokens = state["step"], state["tokens"]


class Run:
    """Model, AdamW, warmup LR schedule and train state, as a training script holds them."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.model = ConvLM()
        if dist.get_world_size() > 1:  # FSDP2: each block, then the root
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / 3))
        self.state = TrainState()

    def manager(self, folder: Path, **kwargs) -> CheckpointManager:
        states = {"lr_scheduler": self.scheduler, "train_state": self.state}
        return CheckpointManager(folder, model_parts=[self.model], optimizers=[self.optimizer], states=states, **kwargs)

    def train_step(self) -> float:
        self.state.step += 1
        gen = torch.Generator().manual_seed(1000 * self.state.step + dist.get_rank())  # this step's data
        batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        loss = F.cross_entropy(self.model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.state.tokens += batch.numel()
        return loss.item()

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model, unsharded (a collective under FSDP)."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))


# Hugging Face-style module names, as a transformers port of ConvLM would call them.
HF_TOP = {"embed": "model.embed_tokens", "mix": "model.token_mixer", "norm": "model.norm", "head": "lm_head"}
HF_LAYER = {"norm": "input_layernorm", "up": "mlp.up_proj", "down": "mlp.down_proj"}
OURS_TOP, OURS_LAYER = ({v: k for k, v in table.items()} for table in (HF_TOP, HF_LAYER))


def to_hf_name(name: str) -> str:
    """"blocks.1.up.weight" -> "model.layers.1.mlp.up_proj.weight", "head.bias" -> "lm_head.bias"."""
    module, param = name.rsplit(".", 1)
    if module.startswith("blocks."):
        _, layer, leaf = module.split(".")
        return f"model.layers.{layer}.{HF_LAYER[leaf]}.{param}"
    return f"{HF_TOP[module]}.{param}"


def from_hf_name(name: str) -> str:
    """The inverse of `to_hf_name`: the renaming function the conversion is given."""
    module, param = name.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, layer, leaf = module.split(".", 3)
        return f"blocks.{layer}.{OURS_LAYER[leaf]}.{param}"
    return f"{OURS_TOP[module]}.{param}"


FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    """Print one check line (rank 0) and remember a failure."""
    if not ok:
        FAILED.append(name)
    if dist.get_rank() == 0:
        print(f"check {name}: {'ok' if ok else 'FAILED'}{f' ({detail})' if detail else ''}", flush=True)


def main(work: Path) -> None:
    rank = dist.get_rank()
    root = work / "run"

    # 1. The uninterrupted run.
    reference = Run(seed=0)
    ref_losses = [reference.train_step() for _ in range(STEPS)]

    # 2. The same run, checkpointed every 2 steps in the background, stopped after step 4.
    first = Run(seed=0)
    manager = first.manager(root, interval=2, async_mode="async")
    losses, pending = [], False
    for _ in range(4):
        losses.append(first.train_step())
        manager.save(first.state.step)
        if first.state.step == 2 and rank == 0:
            pending = (root / "step-2.tmp").is_dir() and not (root / "step-2").exists()
    manager.close()  # waits for the background write; a crash instead leaves step-2 as the newest
    dist.barrier()  # rank 0 completes the folders: the other ranks read them after it
    done = sorted(p.name for p in root.iterdir())
    check("atomic", rank != 0 or (pending and done == ["step-2", "step-4"]), f"step-2.tmp while writing, then {done}")

    # Every file is in the manifest with its size and CRC-32.
    manifest = json.loads((root / "step-4" / "manifest.json").read_text())
    crcs_match = all(
        zlib.crc32((root / "step-4" / name).read_bytes()) == entry["crc32"] for name, entry in manifest["files"].items()
    )
    check("verified", crcs_match, f"{len(manifest['files'])} files with CRC-32 in manifest.json")

    # 3. A fresh manager (as a new process would build it) resumes from step 4.
    second = Run(seed=123)  # other weights, an empty optimizer
    resumed = second.manager(root)
    step = resumed.load()
    losses += [second.train_step() for _ in range(STEPS - step)]
    resumed.close()
    check("resume", step == 4 and losses == ref_losses, f"losses {['%.6f' % x for x in losses]}")

    # 4. A damaged file is refused; the error names the argument that picks another step.
    damaged = work / "damaged"
    if rank == 0:
        shutil.copytree(root, damaged)
        shard = damaged / "step-4" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(data)
    dist.barrier()
    try:
        Run(seed=5).manager(damaged).load()
        check("damaged", False, "loaded a corrupt checkpoint")
    except CheckpointError as err:
        check("damaged", err.arguments == ("load_step",) and "load_step=2" in str(err), f"arguments={err.arguments}: {err}")

    # 5. Hugging Face-format weights of the trained model, converted to DCP, loaded back.
    full = second.full_state()
    hf_folder, dcp_folder = work / "hf", work / "hf-as-dcp"
    if rank == 0:
        hf_folder.mkdir()
        save_file({to_hf_name(k): v.contiguous() for k, v in full.items()}, str(hf_folder / "model.safetensors"))
        config = {"architectures": ["ConvLMForCausalLM"], "vocab_size": VOCAB, "hidden_size": DIM, "num_hidden_layers": LAYERS}
        (hf_folder / "config.json").write_text(json.dumps(config))
        convert_hf_to_dcp(hf_folder, dcp_folder, lambda sd: {from_hf_name(k): v for k, v in sd.items()})
    dist.barrier()
    stored = read_dcp_state_dict(dcp_folder, list(full))
    check("hf-to-dcp", all(torch.equal(stored[k], full[k]) for k in full), f"{len(stored)} tensors with the model's own names")
    fresh = Run(seed=7)
    fresh.manager(work / "from-hf", initial_load_path=dcp_folder).load()  # model weights only, into any layout
    again = fresh.full_state()
    check("hf-load", all(torch.equal(again[k], full[k]) for k in full), "a new run started from the converted folder")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo")
    else:  # one process: a world of one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    chosen = [sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="titan-ckpt-example-")]
    dist.broadcast_object_list(chosen, src=0)  # every rank works in rank 0's folder
    work = Path(chosen[0])
    if dist.get_rank() == 0:
        work.mkdir(parents=True, exist_ok=True)
        print(f"working in {work}", flush=True)
    dist.barrier()
    try:
        main(work)
    finally:
        dist.destroy_process_group()
    sys.exit(1 if FAILED else 0)
