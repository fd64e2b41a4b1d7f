"""Every parallel layout against one process: the parity matrix.

Each layout trains the debug model for 10 steps in fp32 from the same seeded
init (on CPU every rank builds the full model from the seed and keeps its
shards, so all layouts start from bit-identical weights) on the same global
batch of 8 sequences, and its per-step global loss is compared with one process.

    uv run python tests/parity_matrix.py            # prints the table (all layouts)
    uv run python tests/parity_matrix.py tp2 cp2_rotate

Tolerance: 2e-5 absolute on losses of ~4-8. Layouts differ from one process only
in the order of floating-point sums (gradient reduce-scatter/all-reduce over
ranks, sharded matmuls, ring-attention partial softmax merges), which perturbs
fp32 results at ~1e-7 relative per step; AdamW's normalised updates carry such
perturbations forward without damping, and over 10 steps we measured up to a few
times 1e-6. A real bug (a wrong shard, a missed gradient, a mis-scaled loss, a
wrong RoPE position) moves the loss by 1e-3 or more within two steps.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from titan_run import TINY, losses, run_titan  # noqa: E402

GLOBAL_BATCH = 8
TOLERANCE = 2e-5

P = "--parallelism."


@dataclass(frozen=True)
class Layout:
    name: str
    nproc: int
    dp: int  # data-parallel degree: local batch = GLOBAL_BATCH / dp
    args: tuple[str, ...]
    slow: bool = False
    # TORCH_DISTRIBUTED_DEBUG=DETAIL; off for DDP, whose reducer crashes (SIGSEGV) under the
    # DETAIL wrapper process group in torch 2.15 on gloo.
    debug_detail: bool = True
    model: tuple[str, ...] = ()  # --model.* arguments; () = the default Llama 3 debug model


# Mixture-of-Experts rows: the DeepSeek-V3 debug model (MLA, a dense first block then MoE blocks,
# expert-bias balancing on), and Qwen3-MoE (QK-norm attention, every block MoE).
DEEPSEEK = ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel")
QWEN3_MOE = ("--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe")
EP = f"{P}expert_parallel_degree"


def _pp(schedule: str, *extra: str) -> tuple[str, ...]:
    return (f"{P}pipeline_parallel_degree", "2", f"{P}pipeline_parallel_schedule", schedule, *extra)


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
    Layout("compile_tp2", 2, 1, ("--compile.enable", "true", f"{P}tensor_parallel_degree", "2"), slow=True),
    Layout("compile_pp2", 2, 1, ("--compile.enable", "true", *_pp("1F1B")), slow=True),
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
    Layout("pp2_fsdp2", 4, 2, _pp("1F1B")),  # 1F1B, with FSDP 2 per stage
    Layout("pp2_tp2", 4, 1, _pp("Interleaved1F1B", f"{P}tensor_parallel_degree", "2")),
    Layout("cp2_rotate", 2, 1, (f"{P}context_parallel_degree", "2", f"{P}context_parallel_rotate_method", "rotate")),
    Layout("fsdp2_cp2", 4, 2, (f"{P}context_parallel_degree", "2")),  # CP's K/V exchange by all-gather (the default)
    # 4-D in 8 processes: FSDP shards over the cp ranks (its mesh is dp_shard x cp); covers TP x PP x FSDP.
    Layout("fsdp_tp2_pp2_cp2", 8, 1, _pp("1F1B", f"{P}tensor_parallel_degree", "2", f"{P}context_parallel_degree", "2"),
           slow=True),
    # Expert parallel: the experts split over ep ranks carved from the FSDP ranks, tokens by all-to-all.
    Layout("moe_ep2", 2, 2, (EP, "2"), model=DEEPSEEK),
    Layout("moe_ep4", 4, 4, (EP, "4"), model=DEEPSEEK),
    Layout("moe_ep2_fsdp4", 4, 4, (EP, "2"), model=DEEPSEEK),  # each expert FSDP-sharded over 2 ranks
    Layout("moe_ep2_hsdp2x2", 4, 4, (EP, "2", f"{P}data_parallel_replicate_degree", "2"), model=DEEPSEEK),
    # Qwen3-MoE's auxiliary balance loss is divided over the pipeline microbatches as the loss is.
    Layout("moe_ep2_pp2", 4, 2, _pp("1F1B", EP, "2"), model=QWEN3_MOE),
    Layout("moe_ep2_tp2", 4, 2, (EP, "2", f"{P}tensor_parallel_degree", "2"), model=DEEPSEEK),
    # Qwen3-MoE under TP: QK-norm on head-sharded activations, the MoE replicated over the TP ranks.
    Layout("qwen3_moe_tp2", 2, 1, (f"{P}tensor_parallel_degree", "2"), model=QWEN3_MOE),
]


def run_layout(layout: Layout, folder: Path) -> list[float]:
    run_titan(folder, *TINY, *layout.model, "--training.local_batch_size", str(GLOBAL_BATCH // layout.dp), *layout.args,
              nproc=layout.nproc, debug_detail=layout.debug_detail)
    return losses(folder)


def reference_losses(folder: Path, model: tuple[str, ...] = ()) -> list[float]:
    run_titan(folder, *TINY, *model, "--training.local_batch_size", str(GLOBAL_BATCH))
    return losses(folder)


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 10, (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def main(names: list[str]) -> int:
    chosen = [lay for lay in LAYOUTS if not names or lay.name in names]
    with tempfile.TemporaryDirectory() as tmp:
        refs: dict[tuple[str, ...], list[float]] = {}
        for model in dict.fromkeys(lay.model for lay in chosen):
            refs[model] = reference_losses(Path(tmp) / f"ref{len(refs)}", model)
            name = " ".join(model[1::2]) or "llama3 debugmodel"
            print(f"reference {name} (1 process): losses {refs[model][0]:.6f} -> {refs[model][-1]:.6f}; tolerance {TOLERANCE:g}")
        print(f"{'layout':<28}{'procs':>6}{'max |loss diff|':>18}{'seconds':>9}  ok")
        failed = 0
        for layout in chosen:
            start = time.perf_counter()
            try:
                diff = max_diff(refs[layout.model], run_layout(layout, Path(tmp) / layout.name))
            except AssertionError as e:  # the run itself failed: show why, go on
                print(str(e)[-1500:])
                diff = float("nan")
            ok = diff <= TOLERANCE
            failed += not ok
            print(f"{layout.name:<28}{layout.nproc:>6}{diff:>18.2e}{time.perf_counter() - start:>9.1f}  {'yes' if ok else 'NO'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
