"""Downstream multiple-choice evaluation during training: HellaSwag / ARC / PIQA-style tasks scored by
log-likelihood every `eval.freq` steps, under every layout.

A task is a local JSONL file, one example a line (a context, K endings, the index of the right one):

    {"context": "She cracked the eggs into the", "endings": [" bowl.", " sky.", " shoe."], "label": 0}

Each (context, ending) pair is one sequence, `[bos] + encode(context) + encode(ending)`, scored as
lm-eval-harness scores multiple-choice tasks: the ending's log-likelihood given the context, the sum of
its tokens' log-probabilities. An example counts for `acc` when its right ending has the highest
log-likelihood, and for `acc_norm` when it has the highest log-likelihood per character of the ending
(lm-eval's `acc_norm`). `gold_logprob` is the mean log-likelihood of the right endings, a continuous
figure that moves before the accuracies do. Results are logged as `eval/<task>/acc`, `.../acc_norm`
and `.../gold_logprob`, to the console, metrics.jsonl, TensorBoard and W&B.

Fixed shapes: every sequence is padded to `training.seq_len` (labels -100 on the context and the
padding), and batches hold `training.local_batch_size` sequences, so a compiled model and the pipeline
schedule see exactly the training shapes: nothing recompiles per length. A sequence longer than
`seq_len + 1` tokens loses tokens from the left, the start of the context first (as lm-eval truncates);
each pass counts them and the first logs how many.

The forward is the step runner's (`StepRunner.eval_sequence_losses`): the same placement, CP sharding,
mixed precision and loss (fused, compiled or vocab-parallel) as training, and under pipeline parallel the
schedule's forward-only pass. Rows are dealt to the data-parallel ranks batch by batch (the last batches
padded with empty rows, so every rank runs as many batches); each rank writes its rows' sums into one
vector of all rows, and an all-reduce over the dp x cp group (and the pipeline group) completes it: CP
ranks add their sequence shards, pipeline ranks without the last stage add zeros.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from titan_core.config.errors import ConfigError, MissingFileError
from titan_core.data import Tokenizer

__all__ = ["DownstreamEvaluator", "MultipleChoiceTask", "load_task", "score_task", "task_rows"]

logger = logging.getLogger("titan")

IGNORE_INDEX = -100  # the loss's ignore_index: labels on the context and the padding


@dataclass(frozen=True)
class MultipleChoiceTask:
    """One task's examples.

    Args:
        name: the task's name in the metrics (`eval/<name>/acc`).
        contexts: one context per example.
        endings: each example's candidate endings (any number per example).
        labels: each example's right ending, an index into its endings.
    """

    name: str
    contexts: list[str]
    endings: list[list[str]]
    labels: list[int]


def task_name_and_file(spec: str) -> tuple[str, Path]:
    """An `eval.tasks` entry's name and file: `name=path`, or `path` named by the file's stem.

    Args:
        spec: one entry of `eval.tasks`.
    """
    name, named, path = spec.partition("=")
    if not named:
        name, path = "", spec
    file = Path(path).expanduser()
    return name or file.stem, file


def load_tasks(specs: Sequence[str], max_examples: int | None = None) -> list[MultipleChoiceTask]:
    """The tasks of `eval.tasks`, each named once (their metrics are `eval/<name>/...`).

    Args:
        specs: `eval.tasks`.
        max_examples: keep each task's first this many examples; None keeps all.
    """
    names = [task_name_and_file(spec)[0] for spec in specs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(
            f"eval.tasks: the name {twice[0]!r} labels two tasks, whose eval/{twice[0]}/... figures would overwrite "
            "each other; drop one, or name each as name=path",
            keys=("eval.tasks",),
        )
    return [load_task(spec, max_examples) for spec in specs]


def load_task(spec: str, max_examples: int | None = None) -> MultipleChoiceTask:
    """A task from `eval.tasks`: `path` (named by the file's stem) or `name=path`, a JSONL file.

    Args:
        spec: one entry of `eval.tasks`.
        max_examples: keep the first this many examples; None keeps all.
    """
    name, file = task_name_and_file(spec)
    if not file.is_file():
        raise MissingFileError(f"eval.tasks: {file} is not a file; point it at a JSONL file of multiple-choice tasks")
    task = MultipleChoiceTask(name, [], [], [])
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            if max_examples is not None and len(task.labels) == max_examples:
                break
            try:
                row = json.loads(line)
                context, endings, label = row["context"], row["endings"], row["label"]
                _check_example(context, endings, label)
            except (ValueError, KeyError, TypeError) as error:
                raise ConfigError(
                    f'eval.tasks: {file}:{number} is not {{"context": str, "endings": [str, str, ...], "label": int}} '
                    f"with 0 <= label < len(endings) ({error})",
                    keys=("eval.tasks",),
                ) from None
            task.contexts.append(context)
            task.endings.append(endings)
            task.labels.append(label)
    if not task.labels:
        raise ConfigError(f"eval.tasks: {file} holds no examples", keys=("eval.tasks",))
    return task


def _check_example(context: object, endings: object, label: object) -> None:
    """Raise `ValueError` saying what is wrong with one example's fields."""
    if not isinstance(context, str):
        raise ValueError("the context is not a string")
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) for e in endings):
        raise ValueError("a choice needs a list of two endings or more, each a string")
    if not all(endings):
        raise ValueError("an empty ending has log-likelihood 0 and wins every time")
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(endings):
        raise ValueError(f"the label {label!r} is not the index of an ending")


def task_rows(task: MultipleChoiceTask, tokenizer: Tokenizer, seq_len: int) -> tuple[list[list[int]], list[int], int]:
    """The task's sequences, one per (example, ending) in order: `(tokens, scored, truncated)`.

    `tokens` is `[bos] + context + ending`, cut from the left to `seq_len + 1` tokens; `scored` how many of
    its last tokens are the ending's (the ones the loss takes); `truncated` how many sequences were cut.

    Args:
        task: the examples.
        tokenizer: the run's tokenizer.
        seq_len: the training sequence length (inputs and labels are `seq_len` long).
    """
    rows, scored, truncated = [], [], 0
    for context, endings in zip(task.contexts, task.endings, strict=True):
        context_ids = [tokenizer.bos_id, *tokenizer.encode(context)]
        for ending in endings:
            ending_ids = tokenizer.encode(ending)
            tokens = context_ids + ending_ids
            if len(tokens) > seq_len + 1:
                tokens, truncated = tokens[-(seq_len + 1) :], truncated + 1
            rows.append(tokens)
            scored.append(min(len(ending_ids), len(tokens) - 1))
    return rows, scored, truncated


def score_task(task: MultipleChoiceTask, logprobs: Sequence[float]) -> dict[str, float]:
    """Accuracy, length-normalised accuracy (lm-eval's `acc_norm`: per character of the ending) and the
    right endings' mean log-likelihood, from each (example, ending)'s log-likelihood in order.

    Args:
        task: the examples.
        logprobs: one log-likelihood per (example, ending), examples in order, each example's endings in order.
    """
    acc = acc_norm = gold = 0.0
    start = 0
    for endings, label in zip(task.endings, task.labels, strict=True):
        scores = logprobs[start : start + len(endings)]
        start += len(endings)
        normed = [score / max(1, len(ending)) for score, ending in zip(scores, endings, strict=True)]
        acc += float(max(range(len(scores)), key=scores.__getitem__) == label)  # ties: the first ending
        acc_norm += float(max(range(len(normed)), key=normed.__getitem__) == label)
        gold += scores[label]
    n = len(task.labels)
    prefix = f"eval/{task.name}"
    return {f"{prefix}/acc": acc / n, f"{prefix}/acc_norm": acc_norm / n, f"{prefix}/gold_logprob": gold / n}


class DownstreamEvaluator:
    """Scores multiple-choice tasks with the training model, on every rank of the run.

    Args:
        tasks: the tasks (`load_task`).
        tokenizer: the run's tokenizer.
        seq_len: every sequence is padded (or cut from the left) to this length: `training.seq_len`.
        local_batch_size: sequences per batch on each rank: `training.local_batch_size` (the pipeline
            schedule's and the compiled model's shape).
        sequence_losses: `(inputs, labels) -> each sequence's summed token loss` on this rank, None on
            pipeline ranks without the last stage (`StepRunner.eval_sequence_losses`).
        parts: this rank's model parts (put in eval mode for the pass).
        dp_rank: this rank's data-parallel index.
        dp_world: the data-parallel degree.
        loss_group: the data- and context-parallel ranks (their sums are added).
        pp_group: the pipeline group under pipeline parallel (the last stage's sums are shared over it).
        device: where the sums live.
        rank: the global rank (rank 0 logs).
    """

    def __init__(
        self,
        tasks: Sequence[MultipleChoiceTask],
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        local_batch_size: int,
        sequence_losses: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None],
        parts: Sequence[nn.Module],
        dp_rank: int,
        dp_world: int,
        loss_group: dist.ProcessGroup,
        pp_group: dist.ProcessGroup | None = None,
        device: torch.device,
        rank: int = 0,
    ):
        self.tasks, self.seq_len, self.batch = list(tasks), seq_len, local_batch_size
        self.sequence_losses, self.parts = sequence_losses, list(parts)
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.loss_group, self.pp_group, self.device, self.rank = loss_group, pp_group, device, rank
        self.pad_id = tokenizer.eos_id
        self.rows: list[list[int]] = []
        self.scored: list[int] = []
        self.truncated = 0
        for task in self.tasks:
            rows, scored, truncated = task_rows(task, tokenizer, seq_len)
            self.rows += rows
            self.scored += scored
            self.truncated += truncated
        self.logged_truncation = False

    def batch_tensors(self, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `first .. first + local_batch_size` as `(inputs, labels)`, each `(local_batch_size, seq_len)`;
        rows past the end are empty (padding, every label ignored)."""
        inputs = torch.full((self.batch, self.seq_len), self.pad_id, dtype=torch.long)
        labels = torch.full((self.batch, self.seq_len), IGNORE_INDEX, dtype=torch.long)
        for slot, row in enumerate(range(first, min(first + self.batch, len(self.rows)))):
            tokens, scored = self.rows[row], self.scored[row]
            length = len(tokens) - 1
            inputs[slot, :length] = torch.tensor(tokens[:-1])
            labels[slot, length - scored : length] = torch.tensor(tokens[length + 1 - scored :])
        return inputs, labels

    @torch.no_grad()
    def evaluate(self) -> dict[str, object]:
        """Every task's `eval/<task>/acc`, `acc_norm` and `gold_logprob` (the same on every rank)."""
        started = time.perf_counter()
        per_step = self.batch * self.dp_world  # rows all data-parallel ranks take per batch
        n_batches = -(-len(self.rows) // per_step)
        sums = torch.zeros(n_batches * per_step, device=self.device)  # every row's -log-likelihood, all ranks
        modes = [part.training for part in self.parts]
        for part in self.parts:
            part.eval()
        try:
            for index in range(n_batches):
                first = index * per_step + self.dp_rank * self.batch
                losses = self.sequence_losses(*self.batch_tensors(first))
                if losses is not None:
                    sums[first : first + self.batch] = losses
        finally:
            for part, mode in zip(self.parts, modes, strict=True):
                part.train(mode)
        dist.all_reduce(sums, group=self.loss_group)
        if self.pp_group is not None:  # only the last stage's ranks hold sums; the others add 0
            dist.all_reduce(sums, group=self.pp_group)
        logprobs = (-sums[: len(self.rows)]).tolist()  # the one host read of the pass
        results: dict[str, object] = {}
        start = 0
        for task in self.tasks:
            count = sum(len(endings) for endings in task.endings)
            results.update(score_task(task, logprobs[start : start + count]))
            start += count
        if self.rank == 0:
            self._log(results, time.perf_counter() - started)
        return results

    def _log(self, results: dict[str, object], seconds: float) -> None:
        if self.truncated and not self.logged_truncation:
            logger.warning(
                "eval: %d of %d sequences are longer than training.seq_len + 1 = %d tokens and lose the start "
                "of their context",
                self.truncated,
                len(self.rows),
                self.seq_len + 1,
            )
            self.logged_truncation = True
        scores = "  ".join(
            f"{task.name} acc {results[f'eval/{task.name}/acc']:.4f} "
            f"acc_norm {results[f'eval/{task.name}/acc_norm']:.4f} ({len(task.labels)} examples)"
            for task in self.tasks
        )
        logger.info("eval: %s  [%.1f s]", scores, seconds)
