"""Tensor- and context-parallel parity worker, launched by tests/test_tensor_parallel.py and
tests/test_context_parallel.py under torchrun (4 processes, gloo, CPU, float32).

    python -m torch.distributed.run --nproc-per-node 4 tests/workers/tp_cp_worker.py {tp|cp} OUT_JSON

Every rank builds the same seeded tiny Llama alone (the reference) and runs one
forward and backward on the whole batch; then, per case, the same weights split
by TP and/or CP run the same batch. Rank 0 writes, per case, the largest absolute
differences (over all ranks) of the logits, the loss and every parameter's
gradient, plus the largest reference magnitudes, to OUT_JSON; the tests assert on them.
The expected head-tail layout is written out here independently of the product code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import datetime
import json
import logging
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel

from rank_exit import leave
from titan_models.llama3 import Transformer, llama3_flavors, llama3_plan
from titan_parallel import (
    ParallelConfigError,
    ParallelDims,
    ParallelOptions,
    apply_cp,
    apply_tp,
    copy_full_state,
    parallelize,
    shard_sequence,
    unshard_sequence,
)
from titan_parallel.grad_clip import grad_norm
import titan_parallel.ring_attention as ring_attention_module
from titan_parallel.ring_attention import RingAttention, ring_attention
from titan_parallel.ulysses_attention import UlyssesAttention, ulysses_attention

ARGS = dataclasses.replace(llama3_flavors["debugmodel"], n_layers=2, vocab_size=512)
BS, SEQ = 2, 32
WORLD = 4


@functools.cache
def build_mesh(cp: int = 1, tp: int = 1):
    """The 5-D mesh for `cp` x `tp` on the 4 ranks (dp_shard takes the rest); built once per layout."""
    return ParallelDims(cp=cp, tp=tp, world_size=WORLD).build_mesh("cpu")


def head_tail_index(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Positions rank `rank` holds: chunks `rank` and `2*cp-1-rank` of `2*cp` equal chunks."""
    chunks = torch.arange(seq).chunk(2 * cp)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class Reference:
    """The single-process model, its logits, loss and gradients on the whole batch."""

    def __init__(self, args=ARGS):
        self.args = args
        torch.manual_seed(0)
        self.model = Transformer(args)
        self.model.init_weights()
        # Parameters and the (non-persistent) RoPE table.
        self.state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.state["rope_cache"] = self.model.rope_cache.clone()
        gen = torch.Generator().manual_seed(1234)
        data = torch.randint(0, ARGS.vocab_size, (BS, SEQ + 1), generator=gen)
        self.tokens, self.labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        self.logits = self.model(self.tokens)
        self.loss = F.cross_entropy(self.logits.flatten(0, 1), self.labels.flatten())
        self.loss.backward()
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
        self.logits = self.logits.detach()


def build_meta(stage: str | None = None, args=ARGS) -> Transformer:
    """The model on the meta device; `stage` "first" keeps embeddings + layer 0, "last" layer 1 + norm + output."""
    with torch.device("meta"):
        model = Transformer(args)
    if stage == "first":
        del model.layers["1"]
        model.norm, model.output = None, None
    elif stage == "last":
        del model.layers["0"]
        model.tok_embeddings = None
    return model


def materialize(model: Transformer, ref: Reference) -> Transformer:
    """Give a meta (possibly split) model the reference's weights and RoPE table."""
    model.to_empty(device="cpu")
    copy_full_state(model, ref.state)
    return model


class Recorder:
    """Collects per-case maxima, reduced with MAX over all ranks."""

    def __init__(self):
        self.cases: dict[str, dict[str, float]] = {}

    def add(self, case: str, **values: float) -> None:
        self.cases.setdefault(case, {}).update(values)

    def reduce(self) -> dict:
        out = {}
        for case, values in self.cases.items():
            keys = sorted(values)
            t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out[case] = dict(zip(keys, t.tolist()))
        return out


def grad_diffs(model: torch.nn.Module, ref: Reference, reduce_group=None, divide: int = 1) -> dict[str, float]:
    """Largest gradient difference (absolute, and relative to each parameter's largest reference
    gradient), the largest reference gradient, and how many parameters were compared."""
    worst, worst_rel, scale, count = 0.0, 0.0, 0.0, 0
    for name, param in model.named_parameters():
        grad = full(param.grad)
        if reduce_group is not None:
            grad = grad.clone()
            dist.all_reduce(grad, group=reduce_group)
            grad /= divide
        expected = ref.grads[name.replace("_checkpoint_wrapped_module.", "")]
        assert grad.shape == expected.shape, (name, grad.shape, expected.shape)
        worst = max(worst, maxdiff(grad, expected))
        worst_rel = max(worst_rel, maxdiff(grad, expected) / expected.abs().max().item())
        scale = max(scale, expected.abs().max().item())
        count += 1
    return {"grads": worst, "grads_rel": worst_rel, "grad_scale": scale, "n_grads": count}


# ---- tensor parallel -----------------------------------------------------------------------


def run_tp(base: Reference, rec: Recorder) -> None:
    """TP=2 and TP=4, with and without loss parallel; and TP=2 on a model with tied embeddings."""
    cases = [(f"tp{tp}_{'loss_parallel' if lp else 'replicated_logits'}", tp, lp, base) for tp in (2, 4) for lp in (True, False)]
    cases.append(("tp2_tied_embeddings", 2, True, Reference(dataclasses.replace(ARGS, tie_word_embeddings=True))))
    for case, tp, lp, ref in cases:
        model = materialize(apply_tp(build_meta(args=ref.args), llama3_plan, build_mesh(tp=tp)["tp"], loss_parallel=lp), ref)
        if ref.args.tie_word_embeddings:
            rec.add(case, still_tied=float(model.output.weight is model.tok_embeddings.weight))
        wq = model.layers["0"].attention.wq.weight
        rec.add(case, wq_local_rows=wq.to_local().shape[0])
        logits = model(ref.tokens)
        rec.add(case, logits_is_dtensor=float(isinstance(logits, DTensor)))
        with loss_parallel() if lp else contextlib.nullcontext():
            loss = F.cross_entropy(logits.flatten(0, 1), ref.labels.flatten())
            loss.backward()
        rec.add(
            case,
            **grad_diffs(model, ref),
            logits=maxdiff(full(logits), ref.logits),
            loss=maxdiff(full(loss), ref.loss),
        )


def run_async_tp_plumbing(rec: Recorder) -> None:
    """`parallelize` with async TP on CPU: which requirement does the refusal name, with compile on and off?"""
    for compile_on in (True, False):
        options = ParallelOptions(async_tp=True, compile=compile_on)
        try:
            parallelize(build_meta(), llama3_plan, build_mesh(tp=2), options)
            arguments: tuple[str, ...] = ()
        except ParallelConfigError as e:
            arguments = e.arguments
        state = "on" if compile_on else "off"
        rec.add("parallelize_async_tp", **{
            f"compile_{state}_error_names_cuda": float("device_type" in arguments),
            f"compile_{state}_error_names_compile": float("compile" in arguments),
        })


# ---- context parallel ----------------------------------------------------------------------


def shard_diffs(out, expected, local, whole, idx) -> dict[str, float]:
    """Max |difference| of a sharded attention's output and q, k, v gradients (`local`, leaves holding this rank's
    positions `idx`) from the whole sequence's (`expected`, and `whole`'s gradients) at those positions."""
    diffs = {"out": maxdiff(out, expected[:, :, idx])}
    for name, part, full_leaf in zip(("dq", "dk", "dv"), local, whole, strict=True):
        diffs[name] = maxdiff(part.grad, full_leaf.grad[:, :, idx])
    return diffs


@contextlib.contextmanager
def ring_kernel(method: str):
    """"rotate_math": ring rotate with its float32 matmul blocks (its path off CPU) instead of CPU's fused kernel."""
    fused = ring_attention_module.FUSED_DEVICES
    if method.endswith("_math"):
        ring_attention_module.FUSED_DEVICES = ()
    try:
        yield
    finally:
        ring_attention_module.FUSED_DEVICES = fused


def run_ring_alone(rec: Recorder) -> None:
    """`ring_attention` and `ulysses_attention` on random q/k/v against causal SDPA on the whole sequence, forward
    and backward."""
    bs, seq, head_dim = 2, 32, 8
    for cp in (2, 4):
        mesh = build_mesh(cp=cp)
        group, rank = mesh["cp"].get_group(), mesh["cp"].get_local_rank()
        idx = head_tail_index(seq, cp, rank)
        for n_heads, n_kv_heads in ((4, 4), (4, 2), (6, 2)):
            gen = torch.Generator().manual_seed(7)
            q = torch.randn(bs, n_heads, seq, head_dim, generator=gen, requires_grad=True)
            k = torch.randn(bs, n_kv_heads, seq, head_dim, generator=gen, requires_grad=True)
            v = torch.randn(bs, n_kv_heads, seq, head_dim, generator=gen, requires_grad=True)
            dout = torch.randn(bs, n_heads, seq, head_dim, generator=gen)
            expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_heads != n_kv_heads)
            (expected * dout).sum().backward()
            for method in ("allgather", "rotate", "rotate_math", "ulysses"):
                ql, kl, vl = (t.detach()[:, :, idx].clone().requires_grad_() for t in (q, k, v))
                if method == "ulysses" and n_heads % cp:  # 6 query heads do not split 4 ways: refused
                    try:
                        ulysses_attention(ql, kl, vl, group, CausalSDPA())
                        arguments: tuple[str, ...] = ()
                    except ParallelConfigError as e:
                        arguments = e.arguments
                    rec.add(f"ring_cp{cp}_{method}_h{n_heads}_kv{n_kv_heads}", refused=float("cp" in arguments))
                    continue
                if method == "ulysses":  # KV heads repeated where cp does not divide them (kv 2 at cp 4)
                    out = ulysses_attention(ql, kl, vl, group, CausalSDPA())
                else:
                    with ring_kernel(method):
                        out = ring_attention(ql, kl, vl, group, method.removesuffix("_math"))
                (out * dout[:, :, idx]).sum().backward()
                rec.add(
                    f"ring_cp{cp}_{method}_h{n_heads}_kv{n_kv_heads}",
                    **shard_diffs(out, expected, (ql, kl, vl), (q, k, v), idx),
                )


class CausalSDPA(torch.nn.Module):
    """A plain attention core, as the models' own: causal SDPA, grouped-query where K/V have fewer heads."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.size(1) != k.size(1))


def run_ulysses_mla_shaped(rec: Recorder) -> None:
    """Ulysses with values of another head dim than the keys (MLA: q and k in one all-to-all, v in another)."""
    bs, seq = 2, 32
    for cp in (2, 4):
        mesh = build_mesh(cp=cp)
        group, rank = mesh["cp"].get_group(), mesh["cp"].get_local_rank()
        idx = head_tail_index(seq, cp, rank)
        gen = torch.Generator().manual_seed(8)
        q, k = (torch.randn(bs, 4, seq, 12, generator=gen, requires_grad=True) for _ in range(2))
        v = torch.randn(bs, 4, seq, 8, generator=gen, requires_grad=True)
        dout = torch.randn(bs, 4, seq, 8, generator=gen)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (expected * dout).sum().backward()
        ql, kl, vl = (t.detach()[:, :, idx].clone().requires_grad_() for t in (q, k, v))
        out = ulysses_attention(ql, kl, vl, group, CausalSDPA())
        (out * dout[:, :, idx]).sum().backward()
        rec.add(
            f"ulysses_cp{cp}_v_head_dim",
            **shard_diffs(out, expected, (ql, kl, vl), (q, k, v), idx),
        )


class MaskedSDPA(torch.nn.Module):
    """An attention core that takes the model's mask, as the models' own: SDPA under it, causal without one."""

    def forward(self, q, k, v, mask=None):
        gqa = q.size(1) != k.size(1)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def run_masked(rec: Recorder) -> None:
    """Ulysses and ring attention under the whole sequence's mask (block-causal over packed documents): against
    SDPA under that mask on the whole sequence, GQA (4 query heads on 2 KV heads) and MLA's head dims (ring:
    all-gather only, as the rotation needs one head dim). Ring attention reads the dense mask and a FlexAttention
    BlockMask of the same documents alike; documents start inside chunks, so some ring steps hold keys that
    some of a rank's queries see none of."""
    from torch.nn.attention.flex_attention import create_block_mask

    bs, seq = 2, 32
    ids = torch.tensor([[0] * 5 + [1] * 14 + [2] * 13, [0] * 9 + [1] * 11 + [2] * 3 + [3] * 9])  # boundaries inside chunks
    mask = (ids[:, :, None] == ids[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    mask = mask[:, None]  # (bs, 1, seq, seq), written here, not by titan_models.document_mask

    def same_document_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (ids[b, q_idx] == ids[b, kv_idx])

    block_mask = create_block_mask(same_document_causal, bs, None, seq, seq, device="cpu")
    cores = {
        "ulysses": lambda group: UlyssesAttention(MaskedSDPA(), group),
        "allgather": lambda group: RingAttention(group, "allgather"),
        "rotate": lambda group: RingAttention(group, "rotate"),
        "rotate_math": lambda group: RingAttention(group, "rotate"),  # under ring_kernel("rotate_math")
    }
    for cp in (2, 4):
        mesh = build_mesh(cp=cp)
        group, rank = mesh["cp"].get_group(), mesh["cp"].get_local_rank()
        idx = head_tail_index(seq, cp, rank)
        # The rotation's blocks after step 0, on every rank: each cut to where some query sees some key, or left out.
        local = seq // cp
        blocks = [
            ring_attention_module._ring_blocks(step, r, cp, ring_attention_module.cp_positions(local, r, cp), mask)
            for r in range(cp)
            for step in range(1, cp)
        ]
        kept = sum(b[0][2].shape[-2] * b[0][2].shape[-1] for b in blocks if b) / (len(blocks) * local * local // 2)
        rec.add(f"masked_cp{cp}_ring_blocks", left_out=float(sum(not b for b in blocks)), kept=kept)
        for name, (n_heads, n_kv_heads, qk_dim, v_dim) in {"gqa": (4, 2, 8, 8), "mla": (4, 4, 12, 8)}.items():
            gen = torch.Generator().manual_seed(9)
            q = torch.randn(bs, n_heads, seq, qk_dim, generator=gen, requires_grad=True)
            k = torch.randn(bs, n_kv_heads, seq, qk_dim, generator=gen, requires_grad=True)
            v = torch.randn(bs, n_kv_heads, seq, v_dim, generator=gen, requires_grad=True)
            dout = torch.randn(bs, n_heads, seq, v_dim, generator=gen)
            expected = MaskedSDPA()(q, k, v, mask)
            (expected * dout).sum().backward()
            for method, core in cores.items():
                if method.startswith("rotate") and qk_dim != v_dim:
                    continue
                forms = {"dense": mask, "block_mask": block_mask} if method != "ulysses" else {"dense": mask}
                for form, given in forms.items():
                    ql, kl, vl = (t.detach()[:, :, idx].clone().requires_grad_() for t in (q, k, v))
                    with ring_kernel(method):
                        out = core(group)(ql, kl, vl, mask=given)
                        (out * dout[:, :, idx]).sum().backward()
                        causal = core(group)(ql.detach(), kl.detach(), vl.detach())
                    rec.add(
                        f"masked_cp{cp}_{name}_{method}_{form}",
                        **shard_diffs(out, expected, (ql, kl, vl), (q, k, v), idx),
                        mask_matters=float(maxdiff(causal, out) > 1e-2),
                    )


def gather_logits(local: torch.Tensor, cp: int, group) -> torch.Tensor:
    """All-gather the cp ranks' logits and put them back in sequence order (written independently)."""
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    out = torch.empty(local.size(0), local.size(1) * cp, local.size(2))
    for r, part in enumerate(parts):
        out[:, head_tail_index(out.size(1), cp, r)] = part
    return out


def run_cp(ref: Reference, rec: Recorder) -> None:
    """CP-only models: logits, loss (averaged over cp) and gradients (averaged over cp) against the reference."""
    for cp in (2, 4):
        mesh = build_mesh(cp=cp)
        cp_mesh = mesh["cp"]
        group, rank = cp_mesh.get_group(), cp_mesh.get_local_rank()
        tokens, labels = shard_sequence(ref.tokens, ref.labels, cp_mesh=cp_mesh)
        idx = head_tail_index(SEQ, cp, rank)
        rec.add(f"shard_sequence_cp{cp}", tokens=maxdiff(tokens, ref.tokens[:, idx]), labels=maxdiff(labels, ref.labels[:, idx]))
        for method in ("allgather", "rotate", "ulysses"):
            case = f"cp{cp}_{method}"
            options = {"cp_method": "ulysses"} if method == "ulysses" else {"cp_rotate_method": method}
            model = materialize(apply_cp(build_meta(), llama3_plan, cp_mesh, **options), ref)
            core = UlyssesAttention if method == "ulysses" else RingAttention
            swapped = all(isinstance(b.attention.sdpa, core) for b in model.layers.values())
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss, group=group)
            rec.add(
                case,
                **grad_diffs(model, ref, reduce_group=group, divide=cp),
                not_swapped=float(not swapped),  # 0 when every block's core is the method's module
                logits=maxdiff(gather_logits(logits.detach(), cp, group), ref.logits),
                unshard=maxdiff(unshard_sequence(logits.detach(), cp_mesh), ref.logits),
                local_loss_differs=float(abs(loss.item() - ref.loss.item()) > 1e-4),  # 1: shards really differ
                loss=maxdiff(mean_loss / cp, ref.loss),
            )


def run_cp_stages(ref: Reference, rec: Recorder) -> None:
    """Two pipeline stages run one after the other: the last one gets only hidden states (positions from the hook)."""
    for tp, cp, method in ((1, 4, "ring"), (2, 2, "ring"), (2, 2, "ulysses")):
        mesh = build_mesh(cp=cp, tp=tp)
        cp_mesh = mesh["cp"]
        tokens, _ = shard_sequence(ref.tokens, ref.labels, cp_mesh=cp_mesh)
        stages = []
        for stage in ("first", "last"):
            model = build_meta(stage)
            if tp > 1:
                apply_tp(model, llama3_plan, mesh["tp"], loss_parallel=False)
            stages.append(materialize(apply_cp(model, llama3_plan, cp_mesh, cp_rotate_method="rotate", cp_method=method), ref))
        with torch.no_grad():
            hidden = stages[0](tokens)  # (bs, seqlen/(cp*tp), dim) locally
            logits = stages[1](hidden)
        rec.add(
            f"stages_tp{tp}_cp{cp}" + ("_ulysses" if method == "ulysses" else ""),
            hidden_seq=hidden.shape[1],
            logits=maxdiff(gather_logits(logits, cp, cp_mesh.get_group()), ref.logits),
        )


def run_tp_cp_parallelize(ref: Reference, rec: Recorder) -> None:
    """TP 2 x CP 2 through `parallelize` (FSDP over dp_shard_cp averages the local-mean gradients)."""
    for method in ("allgather", "rotate", "ulysses"):
        mesh = build_mesh(cp=2, tp=2)
        cp_options = {"cp_method": "ulysses"} if method == "ulysses" else {"cp_rotate_method": method}
        options = ParallelOptions(loss_parallel=True, **cp_options)
        model = materialize(parallelize(build_meta(), llama3_plan, mesh, options), ref)
        tokens, labels = shard_sequence(ref.tokens, ref.labels, cp_mesh=mesh["cp"])
        # the embedding's output as the next module gets it, after FSDP's hooks (registered before this one)
        views: list[bool] = []
        model.tok_embeddings.register_forward_hook(lambda _m, _a, out: views.append(out._base is not None))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logits = model(tokens)  # Shard(-1) over tp
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
        mean_loss = full(loss).detach().clone()
        dist.all_reduce(mean_loss, group=mesh["cp"].get_group())
        # the gradient norm over FSDP x TP shards (a matrix's gradient is sharded on both mesh dims, a norm's weight
        # on one): one process's, in one all-reduce per mesh dim, without DTensor's warning about sequential ones
        warned: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("torch.distributed.tensor._redistribute").addHandler(handler)
        with CommDebugMode() as comms:
            norm = grad_norm(model.parameters())
        logging.getLogger("torch.distributed.tensor._redistribute").removeHandler(handler)
        ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref.grads.values()]))
        rec.add(
            f"parallelize_tp2_cp2_{method}",
            grad_norm_rel=abs(norm.item() - ref_norm.item()) / ref_norm.item(),
            grad_norm_collectives=float(comms.get_total_counts()),
            grad_norm_warnings=float(sum("sequential" in m for m in warned)),
            embedding_output_is_view=float(any(views)),
            view_warnings=float(sum("returned a view" in str(w.message) for w in caught)),
            **grad_diffs(model, ref),
            logits=maxdiff(gather_logits(full(logits).detach(), 2, mesh["cp"].get_group()), ref.logits),
            loss=maxdiff(mean_loss / 2, ref.loss),
        )


def main() -> None:
    suite, out_path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.use_deterministic_algorithms(True)
    ref = Reference()
    rec = Recorder()
    if suite == "tp":
        run_tp(ref, rec)
        run_async_tp_plumbing(rec)
    elif suite == "cp":
        run_ring_alone(rec)
        run_ulysses_mla_shaped(rec)
        run_masked(rec)
        run_cp(ref, rec)
        run_cp_stages(ref, rec)
        run_tp_cp_parallelize(ref, rec)
    else:
        raise SystemExit(f"unknown suite {suite!r}; use tp or cp")
    results = rec.reduce()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        leave(1)
    dist.destroy_process_group()
    leave(0)
