"""The muP coordinate check for your own config: how far a few Adam steps move each block's output and the logits,
at several widths, under the usual parametrization and under muP.

    uv run python benchmarks/mup_coord_check.py                                    # the debug Llama
    uv run python benchmarks/mup_coord_check.py --config my_run.toml --widths 128,256,512,1024 --lr 3e-3
    uv run python benchmarks/mup_coord_check.py --model.name qwen3 --steps 10      # any train override after the flags

The check the muP papers and "The Practitioner's Guide to the Maximal Update Parameterization" (2024) ask for
before trusting a muP setup: widen the model (heads of the config's head width more or fewer, Qwen3's feed-forward
3x the width), take `--steps` AdamW steps at `--lr` on one fixed random batch (fp32, one process, the job's own
model, init and optimizer groups: `titan_core.job.resolve` and `build_optimizer`, as `titan train` builds them),
and print the std of the change of each block's output and of the logits. Under the usual parametrization the
changes grow with the width; under muP (`mup.base_dim` = the first width) they stay flat, and a row that grows
points at a layer whose multiplier or learning rate is wrong. tests/test_mup.py asserts this for Llama 3 and
Qwen3. Experiments, not part of the package; no guarantees.
"""

from __future__ import annotations

import argparse


def measure(overrides: list[str], config: str | None, width: int, mup: bool, a: argparse.Namespace) -> list[float]:
    """The std of the change of each block's output, then of the logits, after `a.steps` steps at `width`."""
    import torch
    from titan_core.config import load_config
    from titan_core.job import resolve
    from titan_core.optim import build_optimizer

    base = resolve(load_config(config, overrides), 1)
    head = base.model_args.attention_head_dim
    shape = [f"dim={width}", f"n_heads={max(1, width // head)}", f"n_kv_heads={max(1, width // head // 2)}"]
    if hasattr(base.model_args, "hidden_dim"):  # Qwen3: its feed-forward width is its own field
        shape.append(f"hidden_dim={3 * width}")
    args = [*overrides, "--model.shape", ",".join([*base.cfg.model.shape, *shape]), "--optimizer.lr", str(a.lr),
            "--training.mixed_precision_param", "float32", "--mup.enable", str(mup).lower(),
            "--mup.base_dim", str(a.widths[0])]  # fmt: skip
    job = resolve(load_config(config, args), 1)
    torch.manual_seed(0)
    model = job.spec.build(job.model_args)
    model.init_weights()
    optimizer = build_optimizer(model.named_parameters(), job.optimizer, device_type="cpu", plan=job.spec.plan)
    vocab = job.model_args.vocab_size
    tokens = torch.randint(0, vocab, (a.batch, a.seq_len + 1), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    outputs: dict[str, torch.Tensor] = {}
    for name, block in model.layers.items():
        block.register_forward_hook(lambda module, inputs, out, name=name: outputs.__setitem__(name, out.detach()))
    with torch.no_grad():
        logits0 = model(x)
    start = dict(outputs)
    for _ in range(a.steps):
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        logits = model(x)
    return [(outputs[n] - start[n]).std().item() for n in start] + [(logits - logits0).std().item()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="a titan train config (TOML or a shipped name); its model and shape")
    parser.add_argument("--widths", default="64,128,256,512", help="model widths (dim); the first is muP's base")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    a, overrides = parser.parse_known_args()
    a.widths = [int(w) for w in a.widths.split(",")]
    for kind, mup in (("usual", False), ("muP", True)):
        rows = {w: measure(overrides, a.config, w, mup, a) for w in a.widths}
        names = [f"block {i}" for i in range(len(rows[a.widths[0]]) - 1)] + ["logits"]
        print(f"\n{kind}: std of the change after {a.steps} AdamW steps at lr {a.lr:g} (x: over the base width's)")
        print(f"{'':<10}" + "".join(f"{w:>16}" for w in a.widths))
        for i, name in enumerate(names):
            base = rows[a.widths[0]][i]
            cells = "".join(f"{rows[w][i]:>9.4f} {rows[w][i] / base:>5.2f}x" for w in a.widths)
            print(f"{name:<10}{cells}")


if __name__ == "__main__":
    main()
