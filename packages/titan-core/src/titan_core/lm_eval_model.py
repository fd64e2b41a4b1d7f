"""`titan eval`: EleutherAI's lm-evaluation-harness on a Titan checkpoint.

`TitanLM` is an `lm_eval` model (registered as "titan") over any checkpoint `titan generate`
reads: a run folder (its newest complete step), a `step-N` DCP folder, a Hugging Face folder.
Any harness task runs on it, the tasks that score log-likelihoods (multiple choice, perplexity)
and the ones that generate:

- `loglikelihood`: lm-eval's own `TemplateLM` splits each (context, continuation) pair into tokens
  (the whole text encoded, then split at the context's length, as its Hugging Face model does);
  each sequence starts with BOS where Titan's documents did (`PromptCodec.add_bos`). Requests run
  longest first in batches padded to a power of two (few distinct shapes); a sequence longer than
  the model's `max_seq_len + 1` loses tokens from the left. The output projection sees only the
  continuation's positions (a pre-hook gathers them), so no `(batch, seqlen, vocab)` logits exist.
- `loglikelihood_rolling`: the text in disjoint windows of `max_seq_len` tokens, each conditioned on
  the tokens before it (lm-eval's `get_rolling_token_windows`), summed.
- `generate_until`: Titan's static-cache decoding (`titan_core.generation.generate`), greedy, up to
  `max_gen_toks`, `batch_size` prompts at a time (left-padded); the text is cut at the first stop string.

lm-eval is an optional extra (`pip install 'titan-core[eval]'`); this module imports it, so import it
only where the extra is wanted (`titan_cli.eval_cmd` does, and turns a missing extra into one line).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn

from titan_core.generation import GREEDY, LoadedModel, generate, load_model, load_prompt_codec
from titan_core.generation.text import PromptCodec
from titan_parallel.modules import get_submodule_or_none

__all__ = ["TitanLM"]

Scored = tuple[tuple[str, str], list[int], list[int]]  # (request text, context ids, continuation ids)


@register_model("titan")
class TitanLM(TemplateLM):
    """A Titan checkpoint as an lm-eval model.

    Args:
        checkpoint: what `titan generate` reads (run folder, DCP step, Hugging Face folder or repo id).
        model_name: the family; None infers it from the checkpoint.
        flavor: a DCP checkpoint's flavor when no run config.toml is beside it.
        device: "cpu", "cuda" or "cuda:N"; None: CUDA when available.
        dtype: "auto" (bfloat16 on a CUDA GPU with bf16, else float32), "float32" or "bfloat16".
        batch_size: sequences per forward.
        loaded: an already loaded model (`checkpoint` is then only its name); for tests and notebooks.
    """

    def __init__(
        self,
        checkpoint: str,
        model_name: str | None = None,
        flavor: str | None = None,
        device: str | None = None,
        dtype: str = "auto",
        batch_size: int | str = 8,
        loaded: LoadedModel | None = None,
    ):
        super().__init__()
        self.loaded = loaded or load_model(checkpoint, model_name=model_name, flavor=flavor, device=device, dtype=dtype)
        self.codec: PromptCodec = load_prompt_codec(self.loaded.checkpoint, self.loaded.args.vocab_size)
        self.batch_size = int(batch_size)
        self.max_length = int(self.loaded.args.max_seq_len)
        self.head = get_submodule_or_none(self.loaded.model, self.loaded.spec.plan.pp_last[-1])

    @property
    def eot_token_id(self) -> int:
        return self.codec.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is conditioned on: BOS where Titan's documents start with it."""
        return self.codec.tokenizer.bos_id if self.codec.add_bos else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.codec.tokenizer.encode(string)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.codec.tokenizer.decode(list(tokens))

    def _loglikelihood_tokens(
        self, requests: list[Scored], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """`(log-likelihood of the continuation, whether greedy decoding gives it)` per request, in order."""
        sequences = [self._sequence(context, continuation) for _, context, continuation in requests]
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i][0]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(sequences)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            for i, scored in zip(batch, self._score([sequences[i] for i in batch]), strict=True):
                results[i] = scored
        return results

    def _sequence(self, context: list[int], continuation: list[int]) -> tuple[list[int], int]:
        """The tokens to feed the model (BOS first where Titan's documents had it, cut from the left to fit)
        and how many of the last ones are the continuation."""
        bos = self.codec.tokenizer.bos_id
        if self.codec.add_bos and context[:1] != [bos]:
            context = [bos, *context]
        tokens = (context + continuation)[-(self.max_length + 1) :]
        return tokens, min(len(continuation), len(tokens) - 1)

    @torch.no_grad()
    def _score(self, batch: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """One forward over `batch` (right-padded to a power of two): each continuation's summed log-prob and
        whether it is every position's argmax."""
        device = self.loaded.device
        longest = max(len(tokens) - 1 for tokens, _ in batch)
        width = min(1 << (longest - 1).bit_length(), self.max_length)  # few distinct shapes
        inputs = torch.zeros(len(batch), width, dtype=torch.long)
        scored = max(n for _, n in batch)
        positions = torch.zeros(len(batch), scored, dtype=torch.long)  # input positions whose next token is scored
        targets = torch.zeros(len(batch), scored, dtype=torch.long)
        mask = torch.zeros(len(batch), scored, dtype=torch.bool)
        for row, (tokens, n) in enumerate(batch):
            inputs[row, : len(tokens) - 1] = torch.tensor(tokens[:-1])
            first = len(tokens) - 1 - n
            positions[row, :n] = torch.arange(first, first + n)
            targets[row, :n] = torch.tensor(tokens[-n:]) if n else targets[row, :n]
            mask[row, :n] = True
        positions, targets, mask = positions.to(device), targets.to(device), mask.to(device)
        with self._only_positions(positions):
            logits = self.loaded.model(inputs.to(device))  # (batch, scored, vocab)
        logprobs = F.log_softmax(logits.float(), dim=-1)
        picked = logprobs.gather(-1, targets[..., None])[..., 0]  # (batch, scored)
        totals = torch.where(mask, picked, 0.0).sum(-1)
        greedy = ((logprobs.argmax(-1) == targets) | ~mask).all(-1)
        return [(float(t), bool(g)) for t, g in zip(totals.tolist(), greedy.tolist(), strict=True)]

    @contextlib.contextmanager
    def _only_positions(self, positions: torch.Tensor) -> Iterator[None]:
        """Inside, the output projection sees the hidden states at `positions` `(batch, k)` only."""
        if not isinstance(self.head, nn.Module):  # no head module: the model's logits are sliced instead
            raise RuntimeError(f"{self.loaded.spec.name}'s plan names no output projection in pp_last")

        def gather(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            hidden = args[0]  # (batch, seqlen, dim)
            index = positions[..., None].expand(-1, -1, hidden.size(-1))
            return (hidden.gather(1, index), *args[1:])  # (batch, k, dim)

        handle = self.head.register_forward_pre_hook(gather)
        try:
            yield
        finally:
            handle.remove()

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood, in disjoint windows of `max_length` tokens (lm-eval's rolling windows)."""
        results = []
        for request in requests:
            (text,) = request.args
            windows = [
                make_disjoint_window(window)
                for window in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            scored = self._loglikelihood_tokens(
                [(("", ""), context, continuation) for context, continuation in windows]
            )
            results.append(sum(logprob for logprob, _ in scored))
        return results

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first of each request's `until` strings. Requests of one `max_gen_toks`
        decode together, `batch_size` at a time, longest prompt first (Titan's generation left-pads a batch)."""
        prompts, max_new, until = [], [], []
        for request in requests:
            context, options = request.args
            stops = options.get("until") or []
            until.append([stops] if isinstance(stops, str) else list(stops))
            max_new.append(int(options.get("max_gen_toks", 256)))
            prompts.append(self.codec.encode(context)[-max(1, self.max_length - max_new[-1]) :])
        order = sorted(range(len(requests)), key=lambda i: (max_new[i], -len(prompts[i])))
        outputs = [""] * len(requests)
        start = 0
        while start < len(order):
            batch = [i for i in order[start : start + self.batch_size] if max_new[i] == max_new[order[start]]]
            result = generate(
                self.loaded.model,
                self.loaded.spec.plan,
                [prompts[i] for i in batch],
                max_new[batch[0]],
                GREEDY,
                eos_ids=self.codec.eos_ids,
                max_seq_len=self.max_length,
            )
            for i, tokens in zip(batch, result.tokens, strict=True):
                text = self.codec.decode(tokens)
                outputs[i] = text[: min((text.find(stop) for stop in until[i] if stop and stop in text), default=None)]
            start += len(batch)
        return outputs
