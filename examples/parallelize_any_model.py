"""titan-parallel on a model it has never seen: FSDP + TP, and PP + FSDP.

Needs only `pip install titan-parallel` (torch + numpy) and uses only its
top-level API (`from titan_parallel import ...`). The model below is a plain
PyTorch transformer written here; its plan is a small table. Run:

    torchrun --nproc-per-node 4 examples/parallelize_any_model.py

Each rank also trains the same model in one process and the script checks the
parallel layouts give the same losses (fp32, CPU gloo or GPU NCCL).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from titan_parallel import (
    ModelPlan,
    ParallelDims,
    ParallelOptions,
    PipelineConfig,
    TPStyle,
    build_pipeline,
    check_pipeline,
    clip_grad_norm_,
    copy_full_state,
    init_distributed,
    parallelize,
    pipeline_step,
    resolve_device,
    shutdown_distributed,
    split_model,
)

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH, STEPS = 256, 64, 4, 4, 16, 8, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = SelfAttention()
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        bs, seqlen, _ = x.shape
        # -1 heads: under tensor parallel each rank holds HEADS / tp of them.
        q, k, v = (f(x).view(bs, seqlen, -1, DIM // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (bs, heads, seqlen, head_dim)
        return self.o(out.transpose(1, 2).reshape(bs, seqlen, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        # Parts a pipeline stage does not own are None.
        h = self.embed(tokens) if self.embed is not None else tokens
        for block in self.blocks.values():
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


# The whole parallel description of TinyGPT.
PLAN = ModelPlan(
    blocks="blocks",
    tp=(("embed", TPStyle.EMBEDDING), ("norm", TPStyle.NORM), ("head", TPStyle.OUTPUT)),
    block_tp=(
        ("norm1", TPStyle.NORM), ("attn", TPStyle.BLOCK_INPUT),
        ("attn.q", TPStyle.COLWISE), ("attn.k", TPStyle.COLWISE), ("attn.v", TPStyle.COLWISE), ("attn.o", TPStyle.ROWWISE),
        ("norm2", TPStyle.NORM), ("mlp", TPStyle.BLOCK_INPUT),
        ("mlp.up", TPStyle.COLWISE), ("mlp.down", TPStyle.ROWWISE),
    ),
    pp_first=("embed",),
    pp_last=("norm", "head"),
    fsdp_root_units=("embed", "head"),
)


def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def single_process_losses(full_state):
    model = TinyGPT()
    model.load_state_dict(full_state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for b in batches():
        opt.zero_grad()
        loss = loss_fn(model(b[:, :-1]), b[:, 1:])
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        out.append(loss.item())
    return out


def fsdp_tp_losses(full_state, device):
    """FSDP over 2 ranks x TP over 2 ranks; each data-parallel rank takes half the batch."""
    dims = ParallelDims(dp_shard=2, tp=2, world_size=4)
    mesh = dims.build_mesh(device.type)
    with torch.device("meta"):
        model = TinyGPT()
    parallelize(model, PLAN, mesh, ParallelOptions(loss_parallel=False))
    model.to_empty(device=device)
    copy_full_state(model, full_state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp_rank, half = mesh["dp"].get_local_rank(), BATCH // 2
    out = []
    for b in batches():
        b = b[dp_rank * half:(dp_rank + 1) * half].to(device)
        opt.zero_grad()
        loss = loss_fn(model(b[:, :-1]), b[:, 1:])
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dist.all_reduce(total := loss.detach().clone(), group=mesh["dp"].get_group())
        out.append(total.item() / 2)
    return out


def pp_fsdp_losses(full_state, device):
    """2 pipeline stages (1F1B, 4 microbatches of 1) x FSDP over 2 ranks."""
    dims = ParallelDims(pp=2, dp_shard=2, world_size=4)
    mesh = dims.build_mesh(device.type)
    with torch.device("meta"):
        model = TinyGPT()
    half = BATCH // 2  # each data-parallel rank's batch
    config = PipelineConfig(schedule="1F1B", microbatch_size=1)
    names = check_pipeline(config, pp=2, n_layers=LAYERS, local_batch_size=half, plan=PLAN)  # stage 0: embed + 2 blocks
    parts = split_model(model, PLAN, names, mesh["pp"], config.schedule)  # this rank's stage
    for part in parts:
        parallelize(part.module, PLAN, mesh, ParallelOptions(pipeline_parallel=True))
        part.module.to_empty(device=device)
        copy_full_state(part.module, full_state)
    pipe = build_pipeline(parts, config, n_stages=len(names), pp_mesh=mesh["pp"], device=device, local_batch_size=half, loss_fn=loss_fn)
    opts = [torch.optim.AdamW(part.module.parameters(), lr=1e-3) for part in parts]
    dp_rank = mesh["dp"].get_local_rank()
    out = []
    for b in batches():
        b = b[dp_rank * half:(dp_rank + 1) * half].to(device)
        for opt in opts:
            opt.zero_grad()
        loss = pipeline_step(pipe.schedule, pipe.stages, b[:, :-1], b[:, 1:])  # None off the last stage
        total = loss.detach().clone() if loss is not None else torch.zeros((), device=device)
        clip_grad_norm_([p for part in parts for p in part.module.parameters()], 1.0, pp_mesh=mesh["pp"])
        for opt in opts:
            opt.step()
        dist.all_reduce(total)  # only the 2 last-stage ranks hold a loss
        out.append(total.item() / 2)
    return out


def main():
    device = resolve_device("auto")  # cuda:LOCAL_RANK where there is a GPU, else the CPU
    rank, world = init_distributed(device)
    assert world == 4, "run with torchrun --nproc-per-node 4"
    torch.manual_seed(0)
    full_state = TinyGPT().state_dict()  # same seed on every rank: the same full weights
    ref = single_process_losses(full_state)
    for name, fn in (("FSDP2 x TP2", fsdp_tp_losses), ("PP2 x FSDP2", pp_fsdp_losses)):
        got = fn(full_state, device)
        diff = max(abs(a - b) for a, b in zip(ref, got))
        if rank == 0:
            print(f"{name}: losses {['%.5f' % x for x in got]}  max diff vs one process {diff:.2e}", flush=True)
        assert diff < 1e-5, (name, diff)
    shutdown_distributed()


if __name__ == "__main__":
    main()
    os._exit(0)
