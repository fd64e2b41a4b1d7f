"""bf16 training of any model on one device: fp32 master weights, bf16 copies the optimizer writes.

Needs only `pip install titan-parallel` (torch; on a GPU, the Triton that comes with torch's CUDA
build). The model is a plain PyTorch module written here. Run:

    python examples/master_weights_any_model.py

`ComputeCopies` gives every parameter a bf16 copy, swapped in when a forward starts, so the
model computes in bf16 and autograd leaves bf16 gradients; `MasterAdamW` steps the fp32 masters
from them and writes the copies (one Triton kernel on CUDA, torch's fused kernel elsewhere).
`state_dict()` always returns the fp32 masters. The script also trains the same model the long way
(a bf16 copy cast by hand each step, fp32 gradients, torch's fused AdamW) and checks both give the
same losses.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from titan_parallel import ComputeCopies, MasterAdamW

VOCAB, DIM, SEQ, BATCH, STEPS = 256, 64, 32, 8, 5
HYPER = {"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.norm = nn.RMSNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.out(self.norm(h + self.mlp(h)))


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = TinyLM().to(device)
    reference = copy.deepcopy(model)

    copies = ComputeCopies([model], torch.bfloat16)  # the model computes in bf16 from its next forward on
    optimizer = MasterAdamW(model.parameters(), copies, **HYPER)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), fused=True, **HYPER)

    data = torch.Generator(device=device).manual_seed(1)
    for step in range(1, STEPS + 1):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device=device, generator=data)
        loss = loss_of(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        compute = copy.deepcopy(reference)  # the long way: cast a bf16 copy, hand fp32 gradients to AdamW
        for p in compute.parameters():
            p.data = p.data.to(torch.bfloat16)
        ref_loss = loss_of(compute, tokens)
        ref_loss.backward()
        for p, c in zip(reference.parameters(), compute.parameters(), strict=True):
            p.grad = c.grad.float()
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
        print(f"step {step}  loss {loss.item():.5f}  (by hand {ref_loss.item():.5f})")
        assert torch.allclose(loss, ref_loss, rtol=1e-4), (loss.item(), ref_loss.item())

    state = model.state_dict()
    assert all(v.dtype == torch.float32 for v in state.values())  # checkpoints hold the fp32 masters
    print(f"{device}: {len(state)} fp32 master tensors, losses equal to the hand-written bf16 loop")


if __name__ == "__main__":
    main()
