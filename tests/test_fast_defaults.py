"""The defaults chosen for speed: each is the fast choice where it applies and changes nothing else.

- `optimizer.implementation = "auto"`: fused where torch has fused kernels for the device type.
- `training.attention_backend = "auto"`: cuDNN first on Hopper+, flash first before, torch's order
  on CPU; a name pins one backend (checked through torch's own `sdpa_kernel` here on CPU: a pinned
  backend that cannot run fails rather than silently running another).
- Selective "op" activation checkpointing saves float8 matmuls (`aten._scaled_mm`) as it saves
  bf16 ones, instead of recomputing every one of them.
- FSDP over a one-rank shard group keeps its gathered (compute-dtype) copy for backward by default.
"""

from __future__ import annotations

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


def test_one_rank_fsdp_keeps_its_gathered_copy_for_backward(monkeypatch):
    """On a one-rank shard group "default" does not reshard after forward (no memory to win but the
    compute-dtype copy, and a second cast per unit in backward); "always" wins."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import titan_parallel.fsdp as fsdp
    from titan_models import get_model_args, get_model_spec

    asked: list[bool] = []
    real = fsdp.fully_shard
    monkeypatch.setattr(fsdp, "fully_shard", lambda m, reshard_after_forward, **k: asked.append(reshard_after_forward)
                        or real(m, reshard_after_forward=reshard_after_forward, **k))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port: tests run side by side
    try:
        mesh = init_device_mesh("cpu", (1,))
        spec, args = get_model_spec("llama3"), get_model_args("llama3", "debugmodel")
        with torch.device("meta"):
            fsdp.apply_fsdp(spec.build(args), spec.plan, mesh, param_dtype=torch.bfloat16)
        assert asked and not any(asked)
        asked.clear()
        with torch.device("meta"):
            fsdp.apply_fsdp(spec.build(args), spec.plan, mesh, reshard_after_forward="always")
        assert all(asked[:-1]) and not asked[-1]  # the root keeps its parameters for backward
    finally:
        dist.destroy_process_group()
