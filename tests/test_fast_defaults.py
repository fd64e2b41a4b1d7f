"""The defaults chosen for speed: each is the fast choice where it applies and changes nothing else.

- `optimizer.implementation = "auto"`: fused where torch has fused kernels for the device type.
- `training.attention_backend = "auto"`: cuDNN first on Hopper+, flash first before, torch's order
  on CPU; a name pins one backend (checked through torch's own `sdpa_kernel` here on CPU: a pinned
  backend that cannot run fails rather than silently running another).
- Selective "op" activation checkpointing saves float8 matmuls (`aten._scaled_mm`) as it saves
  bf16 ones, instead of recomputing every one of them.
- FSDP over a one-rank shard group keeps its gathered copy and skips the all-gather, which on one
  rank only copies a buffer onto itself: the same losses, bit for bit.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from titan_core.optim import build_optimizer, resolve_implementation
from titan_parallel.activation_checkpoint import _op_policy
from titan_parallel.attention_backend import choose_sdpa_backends, sdpa_context


def test_auto_optimizer_kernel_is_fused_where_torch_has_it():
    assert resolve_implementation("auto", "cpu")[0] == "fused"
    assert resolve_implementation("auto", "cuda")[0] == "fused"
    assert resolve_implementation("auto", "meta") == ("foreach", "auto: torch has no fused Adam/AdamW kernels for meta")
    assert resolve_implementation("foreach", "cuda") == ("foreach", "as configured")  # explicit settings win
    opt = build_optimizer([torch.nn.Parameter(torch.ones(3))], lr=1e-3, implementation="auto", device_type="cpu")
    assert opt.param_groups[0]["fused"] is True


def test_attention_order_by_device(monkeypatch):
    assert choose_sdpa_backends("auto", torch.device("cpu"))[0] is None  # torch's own order on CPU
    assert choose_sdpa_backends("flash", torch.device("cpu"))[0] == ("flash",)  # pinned, whatever the device
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert choose_sdpa_backends("auto", torch.device("cuda"))[0] == ("cudnn", "flash", "efficient", "math")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert choose_sdpa_backends("auto", torch.device("cuda"))[0][0] == "flash"
    with pytest.raises(ValueError, match="cudnn, flash"):
        choose_sdpa_backends("fast", torch.device("cpu"))


def test_a_pinned_backend_is_the_only_one_sdpa_may_use():
    q = k = v = torch.randn(1, 2, 8, 4)
    with sdpa_context(("math",)):
        reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with (
        pytest.raises(RuntimeError, match="No viable backend|No available kernel"),
        sdpa_context(("cudnn",)),
    ):  # no CPU cuDNN
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_context(None):  # torch's default: the CPU flash kernel, equal to math
        assert torch.allclose(F.scaled_dot_product_attention(q, k, v, is_causal=True), reference, atol=1e-6)


class _CountScaledMM(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_selective_op_ac_saves_every_other_float8_matmul():
    """Two float8 matmuls in a checkpointed region: the policy saves one of the two (as it does for bf16
    matmuls), so backward recomputes one; before, both were recomputed."""
    one = torch.tensor(1.0)
    a = torch.randn(16, 32).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    p = torch.randn(16, 16, requires_grad=True)

    def region(p):
        x = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
        y = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
        return ((x * p).sin() + (y * p).cos()).sum()

    loss = checkpoint(region, p, use_reentrant=False, context_fn=_op_policy())
    with _CountScaledMM() as counter:
        loss.backward()
    assert counter.calls == 1


def test_one_rank_fsdp_skips_the_all_gather_and_trains_identically(tmp_path, monkeypatch):
    """In-process: a 1-rank FSDP bf16 model, 3 optimizer steps, with the no-op all-gather and with torch's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import titan_parallel.fsdp as fsdp
    from titan_models import get_model_args, get_model_spec

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29591")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        spec, args = get_model_spec("llama3"), get_model_args("llama3", "debugmodel")
        calls = []
        original_call = fsdp._OneRankAllGather.__call__

        def counted(self, *a, **k):
            calls.append(1)
            return original_call(self, *a, **k)

        monkeypatch.setattr(fsdp._OneRankAllGather, "__call__", counted)

        def train(skip: bool) -> list[float]:
            if not skip:
                monkeypatch.setattr(fsdp, "_skip_one_rank_all_gathers", lambda *a: None)
            torch.manual_seed(0)
            model = spec.build(args)
            model.init_weights()
            fsdp.apply_fsdp(model, spec.plan, mesh, param_dtype=torch.bfloat16)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
            out = []
            for _ in range(3):
                loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.item())
            return out

        fast = train(skip=True)
        # torch 2.15 skips a one-rank all-gather itself (ours is then never called); torch 2.11 does not
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        torch_skips_it = "world_size == 1" in inspect.getsource(FSDPParamGroup.unshard)
        assert calls or torch_skips_it, "the one-rank all-gather was not used"
        assert fast == train(skip=False)
    finally:
        dist.destroy_process_group()
