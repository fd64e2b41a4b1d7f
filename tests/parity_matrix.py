"""Every parallel layout against one process: the parity matrix.

Each layout trains the debug model for 4 steps in fp32 (bf16 rows: below), validating at steps 2
and 4 (except compiled rows), from
the same seeded init (on CPU every rank builds the full model from the seed and
keeps its shards, so all layouts start from bit-identical weights) on the same
global batch of 8 sequences, and its per-step global loss is compared with one process.

    uv run python tests/parity_matrix.py            # prints the table (all layouts)
    uv run python tests/parity_matrix.py tp2 cp2_rotate

Tolerance: 2e-5 absolute on losses of ~4-8. Layouts differ from one process only
in the order of floating-point sums (gradient reduce-scatter/all-reduce over
ranks, sharded matmuls, ring-attention partial softmax merges), which perturbs
fp32 results at ~1e-7 relative per step; AdamW's normalised updates carry such
perturbations forward without damping, and over 10 steps we measured up to a few
times 1e-6. A real bug (a wrong shard, a missed gradient, a mis-scaled loss, a
wrong RoPE position) moves the loss by 1e-3 or more within two steps. The matrix ran 10 steps
until 2026-11-27 (the drift figures here and below are over those 10), 6 until 2026-11-30, and 4
since: a bug shows within two (step 1 is the forward of the same weights, step 2 the first update's
result, and the validation at step 2 the eval forward after it), and every step a row leaves out is
one a 4-process row pays four times on the suite's 2 cores.

bf16 rows (`dtype="bfloat16"`): FSDP 2, TP 2, PP 2 (1F1B) and Qwen3-MoE with EP 2, each
against a one-process bf16 run of the same model. FSDP's `MixedPrecisionPolicy` casts for one
rank as for N (`titan_parallel.uses_fsdp`), so the reference and the layouts take one dtype
path; tests/test_precision.py checks that path dtype by dtype. Skipped, with the reason, on a
CPU without native bf16 (`titan_parallel.precision.native_bf16`): there bf16 matmuls run
~150x slower than fp32.

bf16 tolerance. bf16 keeps 8 significant bits: unit roundoff u = 2^-8 ~ 3.9e-3, against
fp32's 2^-24. A different summation order flips which way some bf16 products and
gradients round, and AdamW carries that forward as it does in fp32, 2^16 times larger
at the source. Measured 2026-11-26 on a 2-core Intel Xeon with AMX and AVX512-BF16
(torch 2.15, gloo, OMP_NUM_THREADS=1) at 9aac953 (foreach AdamW), max |loss diff| over
10 steps, seeds 7, 8 and 9 (the rows re-run at 01982c9, fused AdamW: 0.8e-3 .. 1.6e-3):

    summation order only, same bf16 path (FSDP 2, TP 2, PP 2;       Llama 3   0.9e-3 .. 2.8e-3
      one micro-batch of 8 vs two of 4; EP 2 for the MoE)           Qwen3-MoE 1.2e-3 .. 1.0e-2
    bf16 vs its fp32 twin (one process)                              Llama 3   2.0e-3 .. 2.4e-3
                                                                     Qwen3-MoE 5.3e-3 .. 1.7e-2
    injected bugs, bf16 (Llama 3 FSDP 2 unless said):
      half of one linear's gradient lost on one rank                 5.4e-3 (4.6e-3 at step 2 in fp32)
      half of one block's gradients lost on one rank                 8.7e-2; Qwen3-MoE EP 2: 2.4e-2
      one rank's loss scaled x2 before backward                      2.6e-1

At step 1 (same weights, forward only) layouts differ by <= 1e-5, except TP (up to 1.3e-3:
each rank's partial sum of a row-parallel matmul is rounded to bf16 before the sum). u
itself sits between drift and bugs: `BF16_TOLERANCE` = u ~ 3.9e-3 for dense rows (1.4x
above the largest drift measured, 1.4x below the smallest bug injected) and
`BF16_MOE_TOLERANCE` = 4u ~ 1.6e-2 for the MoE row, where a token whose top-k experts flip
on a rounding difference takes another path, so drift grows faster (1.5x above its largest
drift, 1.5x below the bug). DeepSeek-V3 is not used: its expert-bias update steps by the
sign of each expert's load, so one flipped token can move a bias, and its bf16 drift at
seed 7 (5.7e-3 EP 2, 7.8e-3 FSDP 2, 7.6e-3 two micro-batches) hides what the rows look for.

What bf16 rows cannot see: bugs below those bounds (a bug that moves the fp32 loss by 1e-3
within two steps is the fp32 rows' to catch; every layout has one), and the dtype path
itself. The old path (autocast on one data-parallel rank, FSDP's casts on N) moved bf16
losses by 1.6e-3 .. 3.8e-3 (Llama 3 FSDP 2; 3.2e-3 at 01982c9) and 2.7e-3 .. 1.1e-2
(Qwen3-MoE EP 2) over the same seeds: no wider than summation order's drift, so no loss
bound separates the two, and these rows pass under the old path; test_precision.py's
dtype-by-dtype check fails there.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from titan_core.job.rules import NO_EVAL_SCHEDULES  # noqa: E402
from titan_run import TINY, losses, run_titan, validation_losses  # noqa: E402

GLOBAL_BATCH = 8
STEPS = 4  # training steps of every layout and reference (validation at STEPS // 2 and STEPS)
TOLERANCE = 2e-5
BF16_TOLERANCE = 2.0**-8  # bf16's unit roundoff; see the module docstring
BF16_MOE_TOLERANCE = 4 * 2.0**-8

P = "--parallelism."


@dataclass(frozen=True)
class Layout:
    name: str
    nproc: int
    dp: int  # data-parallel degree: local batch = GLOBAL_BATCH / dp
    args: tuple[str, ...]
    slow: bool = False
    # TORCH_DISTRIBUTED_DEBUG=DETAIL when the layout runs alone (this script; a row the test runs again alone);
    # off for DDP, whose reducer crashes (SIGSEGV) under the DETAIL wrapper process group in torch 2.15 on gloo.
    debug_detail: bool = True
    model: tuple[str, ...] = ()  # --model.* arguments; () = the default Llama 3 debug model
    dtype: str = "float32"  # training.mixed_precision_param of the layout and its one-process reference
    tolerance: float = TOLERANCE  # max |loss diff| from the reference over the `STEPS` steps


# Mixture-of-Experts rows: the DeepSeek-V3 debug model (MLA, a dense first block then MoE blocks,
# expert-bias balancing on), and Qwen3-MoE (QK-norm attention, every block MoE).
DEEPSEEK = ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel")
QWEN3_MOE = ("--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe")
EP = f"{P}expert_parallel_degree"
ETP1 = (f"{P}expert_tensor_parallel_degree", "1")
CP2_ULYSSES = (f"{P}context_parallel_degree", "2", f"{P}context_parallel_method", "ulysses")


def short_documents() -> str:
    """A JSONL file of 400 texts of 8 to 60 bytes, written once into the temp folder. With the byte tokenizer and
    seq_len 32 nearly every sequence crosses a document boundary, so block-causal attention masks something."""
    path = Path(tempfile.gettempdir()) / "titan-parity-short-documents.jsonl"
    if not path.exists():
        rng = random.Random(0)
        words = "the a of to in shard rank step loss grad token layer mask block head".split()
        lines = [json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(2, 12)))[:60]}) for _ in range(400)]
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text("\n".join(lines) + "\n")
        partial.replace(path)  # whole or absent, whichever process writes it
    return str(path)


BLOCK_CAUSAL = ("--model.attn_mask_type", "block_causal", "--training.dataset_path", short_documents())


def _pp(schedule: str, *extra: str, microbatch: int = 2) -> tuple[str, ...]:
    """PP 2 under `schedule`, in micro-batches of `microbatch` sequences: 4 per step where the global batch of 8 is
    one rank's (rather than 8 of one sequence, which cost twice the schedule's actions, each a Python round of
    sends and receives, and under TP its collectives: pp2_tp2 took 2.2 s a step against 1.3 s, 2-core AVX2-only AMD
    EPYC, torch 2.15); every schedule still runs its warm-up, steady and cool-down phases."""
    return (f"{P}pipeline_parallel_degree", "2", f"{P}pipeline_parallel_schedule", schedule,
            f"{P}pipeline_parallel_microbatch_size", str(microbatch), *extra)


BUDGET = ("--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget")
LAYOUTS = [
    Layout("fsdp2", 2, 2, ()),
    Layout("fsdp4", 4, 4, ()),
    Layout("hsdp2x2", 4, 4, (f"{P}data_parallel_replicate_degree", "2")),
    # Options of one parallelism share a run (each changes different code: reshard policy and AC; offload and AC).
    Layout("fsdp2_reshard_never_ac_full", 2, 2, (f"{P}fsdp_reshard_after_forward", "never", "--activation_checkpoint.mode", "full")),
    Layout("fsdp2_cpu_offload_ac_selective_op", 2, 2, ("--training.enable_cpu_offload", "true", "--activation_checkpoint.mode",
                                                       "selective", "--activation_checkpoint.selective_ac_option", "op")),
    # TP 2 with sequence and loss parallel (the defaults), and every 2nd block checkpointed.
    Layout("tp2_ac_selective_2", 2, 1, (f"{P}tensor_parallel_degree", "2", "--activation_checkpoint.mode", "selective")),
    # Regional compile (each block, inductor's C++ backend on CPU); loss compiled too.
    Layout("compile_fsdp2", 2, 2, ("--compile.enable", "true"), slow=True),
    # Two of them under an activation memory budget (the partitioner recomputes the rest in backward): aot_eager's
    # (TP on CPU, whose graphs take the process group as a script object: torch 2.15's budgeted partitioner refused
    # to size it until `budget_backend` counted it as 0 bytes) and Inductor's, both at 0.5.
    Layout("compile_tp2_budget_0.5", 2, 1, ("--compile.enable", "true", f"{P}tensor_parallel_degree", "2", *BUDGET,
                                            "0.5"), slow=True),
    Layout("compile_pp2_budget_0.5", 2, 1, ("--compile.enable", "true", *_pp("1F1B"), *BUDGET, "0.5"), slow=True),
    # TP 2 under selective op AC: each checkpointed block compiles whole inside its wrapper (the sequence-parallel
    # norms with it), where TP alone compiles child by child around them.
    Layout("compile_tp2_ac_selective_op", 2, 1, ("--compile.enable", "true", f"{P}tensor_parallel_degree", "2",
                                                 "--activation_checkpoint.mode", "selective",
                                                 "--activation_checkpoint.selective_ac_option", "op"), slow=True),
    # Ring attention stays eager inside the compiled block (a graph break around it).
    Layout("compile_cp2", 2, 1, ("--compile.enable", "true", f"{P}context_parallel_degree", "2"), slow=True),
    Layout("ddp2", 2, 2, (f"{P}dp_mode", "ddp", f"{P}data_parallel_replicate_degree", "2",
                           f"{P}data_parallel_shard_degree", "1"), debug_detail=False),
    Layout("tp2_no_loss_parallel", 2, 1, (f"{P}tensor_parallel_degree", "2", f"{P}disable_loss_parallel", "true")),
    Layout("fsdp2_tp2", 4, 2, (f"{P}tensor_parallel_degree", "2")),
    Layout("pp2_GPipe", 2, 1, _pp("GPipe")),
    Layout("pp2_Interleaved1F1B", 2, 1, _pp("Interleaved1F1B")),
    Layout("pp2_InterleavedZeroBubble", 2, 1, _pp("InterleavedZeroBubble")),
    Layout("pp2_ZBVZeroBubble", 2, 1, _pp("ZBVZeroBubble")),
    Layout("pp2_DualPipeV", 2, 1, _pp("DualPipeV")),
    Layout("pp2_fsdp2", 4, 2, _pp("1F1B", microbatch=1)),  # 1F1B, with FSDP 2 per stage: 4 micro-batches of 1
    Layout("pp2_tp2", 4, 1, _pp("Interleaved1F1B", f"{P}tensor_parallel_degree", "2")),
    Layout("cp2_rotate", 2, 1, (f"{P}context_parallel_degree", "2", f"{P}context_parallel_rotate_method", "rotate")),
    Layout("fsdp2_cp2", 4, 2, (f"{P}context_parallel_degree", "2")),  # CP's K/V exchange by all-gather (the default)
    # 4-D in 8 processes: FSDP shards over the cp ranks (its mesh is dp_shard x cp); covers TP x PP x FSDP.
    Layout("fsdp_tp2_pp2_cp2", 8, 1, _pp("1F1B", f"{P}tensor_parallel_degree", "2", f"{P}context_parallel_degree", "2"),
           slow=True),
    # Ulysses CP (q/k/v all-to-all'd to head shards of whole sequences around plain causal SDPA), in two launches:
    # compiled (Ulysses stays in the block's one graph) under PP 2 with FSDP over the cp ranks; and DeepSeek-V3
    # (MLA: keys and values of different head dims; MoE) with EP 2 x TP 2 (heads split tp x cp = 4 ways).
    Layout("compile_pp2_cp2_ulysses", 4, 1, ("--compile.enable", "true", *_pp("1F1B", *CP2_ULYSSES)), slow=True),
    Layout("moe_ep2_tp2_cp2_ulysses", 4, 1, (EP, "2", f"{P}tensor_parallel_degree", "2", *CP2_ULYSSES), model=DEEPSEEK),
    # Expert parallel: the experts split over ep ranks carved from the FSDP ranks, tokens by all-to-all.
    # With selective "op" AC around the experts' own FSDP unit (torch 2.15's replay of FSDP's annotations failed there).
    Layout("moe_ep2", 2, 2, (EP, "2", "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
                             "op"), model=DEEPSEEK),
    Layout("moe_ep4", 4, 4, (EP, "4"), model=DEEPSEEK),
    Layout("moe_ep2_fsdp4", 4, 4, (EP, "2"), model=DEEPSEEK),  # each expert FSDP-sharded over 2 ranks
    Layout("moe_ep2_hsdp2x2", 4, 4, (EP, "2", f"{P}data_parallel_replicate_degree", "2"), model=DEEPSEEK),
    # Compiled (the experts and their dispatch eager, the rest of each MoE block compiled piece by piece), under full AC.
    Layout("compile_moe_ep2_ac_full", 2, 2, ("--compile.enable", "true", EP, "2", "--activation_checkpoint.mode", "full"),
           model=DEEPSEEK, slow=True),
    # Qwen3-MoE's auxiliary balance loss is divided over the pipeline microbatches as the loss is, and counts each
    # sequence's slots over the cp ranks holding its chunks (FSDP per stage over those ranks; EP 2 over them too).
    Layout("moe_ep2_pp2_cp2", 4, 1, _pp("1F1B", EP, "2", f"{P}context_parallel_degree", "2"), model=QWEN3_MOE),
    Layout("moe_ep2_tp2", 4, 2, (EP, "2", f"{P}tensor_parallel_degree", "2"), model=DEEPSEEK),
    # The TP ranks join expert parallel (ETP=1): each routes its own sequence shard to whole experts. DeepSeek-V3's
    # shared experts split over the flattened tokens, its load counted over dp x tp; Qwen3-MoE's aux loss over the
    # cp x tp ranks holding each sequence's parts.
    Layout("moe_ep2_tp2_etp1", 2, 1, (EP, "2", f"{P}tensor_parallel_degree", "2", *ETP1), model=DEEPSEEK),
    Layout("qwen3_moe_ep4_tp2_cp2_etp1", 4, 1, (EP, "4", f"{P}tensor_parallel_degree", "2", *ETP1,
                                                 f"{P}context_parallel_degree", "2"), model=QWEN3_MOE),
    # Qwen3-MoE under TP: QK-norm on head-sharded activations, the MoE replicated over the TP ranks.
    Layout("qwen3_moe_tp2", 2, 1, (f"{P}tensor_parallel_degree", "2"), model=QWEN3_MOE),
    # Attention within each document (model.attn_mask_type), on short documents, the mask with TP's head shards.
    Layout("block_causal_fsdp2_tp2", 4, 2, (f"{P}tensor_parallel_degree", "2"), model=BLOCK_CAUSAL),
    # Each pipeline stage builds the mask from its micro-batch's slice of the document ids (a keyword input).
    Layout("block_causal_pp2_Interleaved1F1B", 2, 1, _pp("Interleaved1F1B"), model=BLOCK_CAUSAL),
    Layout("block_causal_pp2_ZBVZeroBubble", 2, 1, _pp("ZBVZeroBubble"), model=BLOCK_CAUSAL),
    # Under Ulysses CP the core attends over whole sequences: the mask of the whole sequence (document ids taken
    # before the sequence is sharded), with FSDP over the cp ranks.
    Layout("block_causal_fsdp2_cp2_ulysses", 4, 2, CP2_ULYSSES, model=BLOCK_CAUSAL),
    # Ring attention reads that mask at each ring step's positions (K/V rotated rank to rank), on TP's head shards.
    Layout("block_causal_tp2_cp2_rotate", 4, 1, (f"{P}tensor_parallel_degree", "2", f"{P}context_parallel_degree", "2",
                                                 f"{P}context_parallel_rotate_method", "rotate"), model=BLOCK_CAUSAL),
    # bf16, against a one-process bf16 reference: FSDP casts for 1 rank as for N (the tolerance: module docstring).
    Layout("bf16_fsdp2", 2, 2, (), dtype="bfloat16", tolerance=BF16_TOLERANCE),
    Layout("bf16_tp2", 2, 1, (f"{P}tensor_parallel_degree", "2"), dtype="bfloat16", tolerance=BF16_TOLERANCE),
    Layout("bf16_pp2_1F1B", 2, 1, _pp("1F1B"), dtype="bfloat16", tolerance=BF16_TOLERANCE),
    Layout("bf16_qwen3_moe_ep2", 2, 2, (EP, "2"), model=QWEN3_MOE, dtype="bfloat16", tolerance=BF16_MOE_TOLERANCE),
]


# Validation at steps 2 and 4 through the step runner's forward (pipeline schedules' eval included): its loss is
# compared like the training losses. Compiled rows leave it out (an eval-mode forward recompiles every block), and
# so do the V schedules, whose forward-only pass fails in torch, and the bf16 rows (their tolerance is derived for
# training losses; bf16 TP's validation loss measured 4.65e-3 off one process's, above it).
VALIDATION = ("--validation.enable", "true", "--validation.freq", str(STEPS // 2), "--validation.steps", "1")


def validates(layout: Layout) -> bool:
    """fp32 rows validate, except compiled ones and the V schedules (whose eval() fails in torch)."""
    fp32 = layout.dtype == "float32"  # the bf16 tolerance is derived for training losses only
    return fp32 and "--compile.enable" not in layout.args and not any(s in layout.args for s in NO_EVAL_SCHEDULES)


def layout_args(layout: Layout) -> list[str]:
    """The layout's `titan train` arguments (no dump folder)."""
    return [*TINY, "--training.steps", str(STEPS), *layout.model, "--training.mixed_precision_param", layout.dtype,
            "--training.local_batch_size", str(GLOBAL_BATCH // layout.dp), *layout.args,
            *(VALIDATION if validates(layout) else ())]


def reference_args(model: tuple[str, ...] = (), dtype: str = "float32") -> list[str]:
    """One process's `titan train` arguments for the reference of (model, dtype) (no dump folder)."""
    return [*TINY, "--training.steps", str(STEPS), *model, "--training.mixed_precision_param", dtype,
            "--training.local_batch_size", str(GLOBAL_BATCH), *VALIDATION]


def run_losses(folder: Path) -> list[float]:
    """A finished run's training losses, then its validation losses."""
    return losses(folder) + validation_losses(folder)


def run_layout(layout: Layout, folder: Path) -> list[float]:
    """The layout's `STEPS` training losses, then its 2 validation losses (when it validates)."""
    run_titan(folder, *layout_args(layout), nproc=layout.nproc, debug_detail=layout.debug_detail)
    return run_losses(folder)


def reference_losses(folder: Path, model: tuple[str, ...] = (), dtype: str = "float32") -> list[float]:
    """One process's `STEPS` training losses and 2 validation losses."""
    run_titan(folder, *reference_args(model, dtype))
    return run_losses(folder)


def bf16_skip_reason() -> str | None:
    """Why bf16 rows cannot run on this CPU, or None when it computes bf16 natively."""
    import torch

    from titan_parallel.precision import native_bf16

    native, why = native_bf16(torch.device("cpu"))
    return None if native else f"bf16 rows need native bf16, but {why}: bf16 matmuls would run ~150x slower than fp32"


def max_diff(reference: list[float], layout: list[float]) -> float:
    """Max |difference| of the `STEPS` training losses, and of the 2 validation losses when the layout has them."""
    assert len(reference) == STEPS + 2 and len(layout) in (STEPS, STEPS + 2), (len(reference), len(layout))
    return max(abs(x - y) for x, y in zip(reference, layout, strict=False))


def main(names: list[str]) -> int:
    chosen = [lay for lay in LAYOUTS if not names or lay.name in names]
    if (skip := bf16_skip_reason()) and any(lay.dtype == "bfloat16" for lay in chosen):
        print(f"skipping the bf16 rows: {skip}")
        chosen = [lay for lay in chosen if lay.dtype != "bfloat16"]
    with tempfile.TemporaryDirectory() as tmp:
        refs: dict[tuple[tuple[str, ...], str], list[float]] = {}
        for key in dict.fromkeys((lay.model, lay.dtype) for lay in chosen):
            refs[key] = reference_losses(Path(tmp) / f"ref{len(refs)}", *key)
            name = " ".join(key[0][1::2]) or "llama3 debugmodel"
            print(f"reference {name} {key[1]} (1 process): losses {refs[key][0]:.6f} -> {refs[key][-1]:.6f}")
        print(f"{'layout':<28}{'procs':>6}{'max |loss diff|':>18}{'tolerance':>11}{'seconds':>9}  ok")
        failed = 0
        for layout in chosen:
            start = time.perf_counter()
            try:
                diff = max_diff(refs[layout.model, layout.dtype], run_layout(layout, Path(tmp) / layout.name))
            except AssertionError as e:  # the run itself failed: show why, go on
                print(str(e)[-1500:])
                diff = float("nan")
            ok = diff <= layout.tolerance
            failed += not ok
            print(f"{layout.name:<28}{layout.nproc:>6}{diff:>18.2e}{layout.tolerance:>11.2g}"
                  f"{time.perf_counter() - start:>9.1f}  {'yes' if ok else 'NO'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
