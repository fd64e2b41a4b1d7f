"""`Muon`: torch's Muon update for the matrices of the blocks and AdamW for the rest, in one optimizer,
on every layout Titan runs (one process, FSDP2/HSDP, TP, PP, EP and their products).

    optimizer.name = "Muon"    # the rule: titan_core.muon_groups.RULE; docs/optimizers.md

Per Muon matrix, as `torch.optim.Muon` steps a whole 2-D tensor:

    B <- lerp(B, g, 1 - momentum);  U <- lerp(g, B, momentum) if nesterov else B     (on each rank's shard)
    O <- NewtonSchulz(U)                       (the whole matrix, on its owner: titan_parallel.matrix_owners)
    W <- W (1 - lr wd) - adjust_lr(lr, shape) O                                        (on each rank's shard)

What is torch's and what is not:
- the Newton-Schulz iteration and the learning-rate adjustment are torch's own functions
  (`torch.optim._muon._zeropower_via_newtonschulz` and `_adjust_lr`, private: the module-level
  check below fails at import if they move), with torch's coefficients and eps;
- the momentum and the update are the two lines of `torch.optim._muon._single_tensor_muon`, repeated
  here because they must run on shards while the orthogonalisation runs on whole matrices;
- torch.optim.Muon refuses 3-D tensors: stacked experts (E, out, in) are E matrices here, each
  orthogonalised and its learning rate adjusted by its own (out, in);
- the AdamW groups are stepped by a `torch.optim.AdamW` holding the same group dicts and state;
- torch's Newton-Schulz always computes in bf16. Where bf16 matmuls are slow (CPUs without
  AVX512-BF16 or AMX: 30-150x slower than fp32, see `newton_schulz`), `ns_dtype=torch.float32` runs
  the same iteration in fp32 here instead (`optimizer.muon_ns_dtype`, "auto" picks it there).

Element for element this is `torch.optim.Muon` on one process (tests/test_muon.py checks it to 1e-6)
with the bf16 Newton-Schulz. Distributed, the Newton-Schulz input is what torch would cast to
`ns_dtype` from the same fp32 momentum, so layouts differ from one process only where their
gradients do (the order of sums).

State: one fp32 `momentum_buffer` per Muon parameter (a `DTensor` like it, so DCP saves, resumes
and reshards it as it does AdamW's `exp_avg`); AdamW's `exp_avg`, `exp_avg_sq` and `step` for the rest.
The step has no `found_inf` kernel: the step runner reads a non-finite verdict on the host (one sync
per step, as for AdamW's foreach kernel).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import _muon as _torch_muon

from titan_parallel.precision import resolve_param_dtype

ADJUST_LR_FNS = ("original", "match_rms_adamw")
"""torch.optim.Muon's `adjust_lr_fn` values offered: an early torch.optim.Muon's two (2.15 adds a third)."""

_NEWTON_SCHULZ: Callable[..., torch.Tensor] = _torch_muon._zeropower_via_newtonschulz
_ADJUST_LR: Callable[[float, str | None, Any], float] = _torch_muon._adjust_lr
# Some torch versions take `use_addmm` (default False in torch.optim.Muon): keep Muon's default.
_NS_EXTRA = {"use_addmm": False} if "use_addmm" in inspect.signature(_NEWTON_SCHULZ).parameters else {}
NS_COEFFICIENTS = (_torch_muon.DEFAULT_A, _torch_muon.DEFAULT_B, _torch_muon.DEFAULT_C)
NS_EPS = _torch_muon.EPS


@dataclass(frozen=True)
class MuonOptions:
    """Muon's own settings (config keys `optimizer.muon_*`, `optimizer.adamw_*`).

    Args:
        momentum: the momentum buffer's decay.
        nesterov: update with Nesterov momentum.
        ns_steps: Newton-Schulz iterations per orthogonalisation.
        adjust_lr_fn: "match_rms_adamw" (0.2 sqrt(max(A, B)): AdamW's learning rate and weight decay
            carry over; Moonlight's) or "original" (sqrt(max(1, A/B)): Keller Jordan's, lr ~0.02).
        adamw_lr: learning rate of the AdamW group; None = the optimizer's `lr`.
        adamw_weight_decay: weight decay of the AdamW group; None = the optimizer's `weight_decay`.
        ns_dtype: what Newton-Schulz computes in: "bfloat16" (torch.optim.Muon's), "float32", or
            "auto" (bf16 where the device has native bf16, else fp32: `resolve_ns_dtype`).
    """

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr_fn: str = "match_rms_adamw"
    adamw_lr: float | None = None
    adamw_weight_decay: float | None = None
    ns_dtype: str = "auto"


NS_DTYPES = ("auto", "bfloat16", "float32")


def resolve_ns_dtype(name: str, device_type: str) -> tuple[torch.dtype, str]:
    """The dtype Newton-Schulz computes in for `name` ("auto", "bfloat16", "float32"), and why.

    The compute dtype's rule (`titan_parallel.resolve_param_dtype`): "auto" is bf16 (torch.optim.Muon's)
    where the device has native bf16, else fp32. On a CPU without AVX512-BF16 or AMX a bf16 matmul runs
    30-150x slower than fp32 (one (1024, 4096) orthogonalisation: 81 s in bf16, 0.54 s in fp32, on a
    2-core AMD EPYC held to AVX2). An explicit "bfloat16" there is kept, and the reason says so.

    Args:
        name: "auto", "bfloat16" or "float32".
        device_type: where the parameters live, e.g. "cuda" or "cpu".
    """
    if name not in NS_DTYPES:
        raise ValueError(f"ns_dtype={name!r}; choose one of {', '.join(NS_DTYPES)}")
    if device_type == "cuda" and not torch.cuda.is_available():  # an estimate for another host
        return (torch.float32 if name == "float32" else torch.bfloat16), f"{name}, assumed for a CUDA device"
    with warnings.catch_warnings():  # its warning is about the model's compute; the reason names it here
        warnings.simplefilter("ignore", UserWarning)
        return resolve_param_dtype(name, torch.device(device_type))


def newton_schulz(matrix: torch.Tensor, group: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of one (m, n) matrix with a Muon group's settings, in `dtype`.

    bf16 is torch's own function. Any other dtype runs the same quintic iteration here (torch's
    casts to bf16 unconditionally): normalise by the Frobenius norm, then `ns_steps` times
    X <- a X + (b A + c A A) X with A = X X^T, on the wide orientation of the matrix.

    Args:
        matrix: the whole matrix (its momentum update).
        group: a Muon param group (`ns_coefficients`, `ns_steps`, `eps`).
        dtype: what the iteration computes in (and returns).
    """
    coefficients, steps, eps = group["ns_coefficients"], group["ns_steps"], group["eps"]
    if dtype == torch.bfloat16:
        return _NEWTON_SCHULZ(matrix, coefficients, steps, eps, **_NS_EXTRA)
    a, b, c = coefficients
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.to(dtype=dtype, copy=True)
    x = x.T if tall else x
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """Muon groups and AdamW groups in one optimizer (one per model part, as the checkpoint keys them).

    Args:
        param_groups: dicts with `params`, `use_muon` and the group's `lr` and `weight_decay`. Muon
            groups may set torch.optim.Muon's `momentum`, `nesterov`, `ns_coefficients`, `eps`,
            `ns_steps`, `adjust_lr_fn` (torch's defaults otherwise); their parameters are 2-D
            matrices or 3-D stacks of them (dim 0 the stack). AdamW groups take torch.optim.AdamW's
            `betas`, `eps`.
        foreach: AdamW's kernel choice for the AdamW groups.
        fused: AdamW's kernel choice for the AdamW groups.
        param_names: name of each Muon parameter, for errors.
        ns_dtype: what Newton-Schulz computes in (and the matrices travel in between ranks): bf16 as
            torch.optim.Muon, or fp32 where bf16 matmuls are slow (`resolve_ns_dtype`).
    """

    description = ""
    """How the rule split the parameters (`muon_param_groups`), for the log."""

    MUON_DEFAULTS: dict[str, Any] = {
        "momentum": 0.95,
        "nesterov": True,
        "ns_coefficients": NS_COEFFICIENTS,
        "eps": NS_EPS,
        "ns_steps": 5,
        "adjust_lr_fn": None,
        "foreach": False,
        "fused": False,
    }

    def __init__(
        self,
        param_groups: Sequence[dict[str, Any]],
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
        param_names: dict[torch.Tensor, str] | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
    ):
        groups = [{**g, "params": list(g["params"])} for g in param_groups]
        for g in groups:
            if "use_muon" not in g or "lr" not in g or "weight_decay" not in g:
                raise ValueError("each param group of Muon needs 'use_muon', 'lr' and 'weight_decay'")
            if g["use_muon"]:
                for key, value in self.MUON_DEFAULTS.items():
                    g.setdefault(key, value)
                if g["adjust_lr_fn"] not in (None, *ADJUST_LR_FNS):
                    raise ValueError(f"adjust_lr_fn={g['adjust_lr_fn']!r}; choose one of {', '.join(ADJUST_LR_FNS)}")
        adamw = [g for g in groups if not g["use_muon"]]
        # torch's AdamW fills its defaults into the same dicts; this optimizer's state is its state too
        self._adamw = torch.optim.AdamW(adamw, foreach=foreach, fused=fused) if adamw else None
        super().__init__(groups, {})
        self._link_adamw()
        matrices = [p for g in self.param_groups if g["use_muon"] for p in g["params"]]
        names = [(param_names or {}).get(p, f"Muon parameter {i}") for i, p in enumerate(matrices)]
        self.ns_dtype = ns_dtype
        from titan_parallel.matrix_owners import MatrixOwners  # here: a job check imports this module, not DTensor

        self.owners = MatrixOwners(matrices, names, dtype=ns_dtype)

    def _link_adamw(self) -> None:
        if self._adamw is not None:
            groups = [g for g in self.param_groups if not g["use_muon"]]
            self._adamw.__setstate__({"state": self.state, "param_groups": groups})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then the AdamW half pointed at the new group dicts and state.

        Args:
            state_dict: what `state_dict()` returned.
        """
        super().load_state_dict(state_dict)
        self._link_adamw()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Muon step of the Muon groups and one AdamW step of the others.

        Args:
            closure: re-evaluates the loss (as torch optimizers take it).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adamw is not None:
            self._adamw.step()
        self._muon_step()
        return loss

    def _muon_step(self) -> None:
        params, groups, updates = [], [], []
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for p in group["params"]:
                params.append(p)
                groups.append(group)
                updates.append(None if p.grad is None else self._momentum(p, group))
        ortho = self.owners.apply(updates, lambda i, matrix: newton_schulz(matrix, groups[i], self.ns_dtype))
        for p, group, update in zip(params, groups, ortho, strict=True):
            if update is None:
                continue
            lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
            adjusted = _ADJUST_LR(lr, group["adjust_lr_fn"], p.shape[-2:])  # per matrix: (out, in)
            weight = _local(p)
            weight.mul_(1 - lr * group["weight_decay"])
            weight.add_(update, alpha=-adjusted)

    def _momentum(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Update `p`'s momentum buffer with its gradient; returns the (Nesterov) update, local shard."""
        state, grad = self.state[p], p.grad
        assert grad is not None, "only parameters with a gradient step"
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        grad, buf = _local(grad), _local(state["momentum_buffer"])
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor  # here: the job check imports this module's options only

    return t.to_local() if isinstance(t, DTensor) else t


def muon_param_groups(
    named: Iterable[tuple[str, torch.Tensor]],
    plan: Any,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    muon: MuonOptions,
    weight_decay_exclude: Sequence[str] = (),
) -> tuple[list[dict[str, Any]], dict[torch.Tensor, str], str]:
    """The two param groups of `titan_core.muon_groups.RULE`: Muon's, then AdamW's (either may be empty,
    e.g. a pipeline stage without blocks: every part has the same two groups, as checkpoints need). With
    `weight_decay_exclude`, each is followed by a group of its matching parameters with weight decay 0 (four
    groups, on every part).

    Args:
        named: the model part's `(name, parameter)` pairs.
        plan: the model's `ModelPlan`.
        lr: Muon's learning rate (and AdamW's unless `muon.adamw_lr`).
        weight_decay: Muon's weight decay (and AdamW's unless `muon.adamw_weight_decay`).
        betas: AdamW's betas.
        eps: AdamW's eps.
        muon: Muon's own settings.
        weight_decay_exclude: shell-style patterns of parameter names without weight decay
            (`titan_core.weight_decay`).

    Returns:
        (param groups, name of each Muon parameter, a one-line description of the split).
    """
    from titan_core.muon_groups import RULE, split_params
    from titan_core.weight_decay import describe_exclusion, split_by_decay

    split = split_params(named, plan)
    adamw_lr = lr if muon.adamw_lr is None else muon.adamw_lr
    adamw_wd = weight_decay if muon.adamw_weight_decay is None else muon.adamw_weight_decay
    groups = [
        {
            "params": [p for _, p in split.muon],
            "use_muon": True,
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": muon.momentum,
            "nesterov": muon.nesterov,
            "ns_steps": muon.ns_steps,
            "adjust_lr_fn": muon.adjust_lr_fn,
        },
        {"params": [p for _, p in split.adamw], "use_muon": False, "lr": adamw_lr, "weight_decay": adamw_wd,
         "betas": betas, "eps": eps},
    ]  # fmt: skip
    nesterov = " nesterov" if muon.nesterov else ""
    line = (
        f"{RULE}: {split.describe()}; Muon lr {lr:g} wd {weight_decay:g} ({muon.adjust_lr_fn}, "
        f"momentum {muon.momentum:g}{nesterov}, {muon.ns_steps} Newton-Schulz steps), "
        f"AdamW lr {adamw_lr:g} wd {adamw_wd:g}"
    )
    if weight_decay_exclude:
        split_groups, without = [], []
        for group, pairs in zip(groups, (split.muon, split.adamw), strict=True):
            decayed, excluded = split_by_decay(pairs, weight_decay_exclude)
            split_groups += [{**group, "params": decayed}, {**group, "params": excluded, "weight_decay": 0.0}]
            without += excluded
        groups = split_groups
        line += f"; {describe_exclusion(without, weight_decay_exclude)}"
    return groups, {p: name for name, p in split.muon}, line
