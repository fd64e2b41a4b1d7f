"""The maximal update parametrization (`[mup]`) and `model.shape`: the coordinate check of the muP papers (under
the usual parametrization a fixed Adam learning rate moves a wider model's activations further each step;
under muP by the same amount at every width), muP at its base width equal to the usual model, the Hugging Face
export with the multipliers folded in against transformers, layouts against one process, and the job check."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from titan_cli.main import app
from titan_core.config import ConfigError, load_config
from titan_core.job import resolve
from titan_core.optim import build_optimizer
from titan_models import get_model_spec
from titan_models.mup import MuP
from typer.testing import CliRunner

from titan_run import TINY, losses, read_metrics, run_titan_all

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
WIDTHS = (64, 128, 256, 512)


def shape(name: str, width: int) -> str:
    """Widen by heads of 16, 2 blocks, a 256-token vocab; Qwen3's feed-forward width follows."""
    extra = f",head_dim=16,hidden_dim={3 * width}" if name == "qwen3" else ""
    return f"dim={width},n_heads={width // 16},n_kv_heads={width // 32},n_layers=2,vocab_size=256{extra}"


def moves(name: str, width: int, mup: bool, steps: int = 5) -> tuple[float, float]:
    """How far `steps` Adam steps at lr 1e-2 move the logits and the first block's output (std of the change), for
    the job's own model, init and optimizer groups."""
    args = ["--model.name", name, "--model.shape", shape(name, width), "--optimizer.lr", "1e-2",
            "--optimizer.weight_decay", "0", "--training.mixed_precision_param", "float32"]  # fmt: skip
    if mup:
        args += ["--mup.enable", "true", "--mup.base_dim", str(WIDTHS[0])]
    job = resolve(load_config(None, args), 1)
    torch.manual_seed(0)
    model = job.spec.build(job.model_args)
    model.init_weights()
    optimizer = build_optimizer(model.named_parameters(), job.optimizer, device_type="cpu", plan=job.spec.plan)
    tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    seen = {}
    model.layers["0"].register_forward_hook(lambda module, inputs, out: seen.__setitem__("block", out.detach()))
    with torch.no_grad():
        logits0, block0 = model(x), seen["block"]
    for _ in range(steps):
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        logits = model(x)
    return (logits - logits0).std().item(), (seen["block"] - block0).std().item()


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_coordinate_check_updates_move_activations_alike_at_every_width(name):
    usual = [moves(name, w, mup=False) for w in WIDTHS]
    mup = [moves(name, w, mup=True) for w in WIDTHS]
    assert usual[0] == pytest.approx(mup[0], rel=1e-6)  # at the base width muP is the usual model
    # 8x the width: the usual parametrization's updates move the block 50x+ and the logits 1.8x+ further
    # (measured: 510x and 2.0x); muP's stay within a factor 2 of the base width's (0.78x and 0.59x: the logits'
    # init part, which muP shrinks as 1/sqrt(width), fades and the update part stays).
    assert usual[-1][1] / usual[0][1] > 50 and usual[-1][0] / usual[0][0] > 1.8, usual
    assert 0.5 < mup[-1][1] / mup[0][1] < 2 and 0.4 < mup[-1][0] / mup[0][0] < 1.25, mup
    for (logits, block), (logits_next, block_next) in zip(mup, mup[1:]):
        assert block_next < 1.2 * block and logits_next < 1.2 * logits, mup  # no growth from one width to the next


def test_optimizer_groups_init_and_multipliers_follow_the_width():
    base = ["--model.shape", "dim=512,n_heads=32", "--mup.enable", "true", "--mup.base_dim", "128",
            "--optimizer.lr", "1e-3", "--optimizer.weight_decay_exclude", '["*norm*"]']  # fmt: skip
    job = resolve(load_config(None, base), 1)
    assert job.model_args.mup == MuP(base_dim=128, base_head_dim=16)
    assert job.optimizer.hidden_lr_scale == 0.25
    torch.manual_seed(0)
    model = job.spec.build(job.model_args)
    model.init_weights()
    optimizer = build_optimizer(model.named_parameters(), job.optimizer, device_type="cpu", plan=job.spec.plan)
    lr_of = {id(p): (g["lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        matrix = name.startswith("layers.") and p.ndim == 2
        expected = (2.5e-4 if matrix else 1e-3, 0.0 if "norm" in name else 0.1)
        assert lr_of[id(p)] == expected, name
    # init: the blocks' stds scaled by 1/sqrt(4), the output's that of the base width, the embedding's unchanged
    assert model.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.01, rel=0.05)
    assert model.output.weight.std().item() == pytest.approx(128**-0.5, rel=0.05)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert "muP: 42 block matrices" in optimizer.description and "no weight decay for" in optimizer.description


def mup_model(name: str, seed: int = 0):
    """A small muP model at 2x its base width, its heads half the base's width, non-unit multipliers."""
    spec = get_model_spec(name)
    flavor = spec.flavors["debugmodel"]
    mup = MuP(base_dim=64, base_head_dim=2 * flavor.attention_head_dim, embedding_multiplier=3.0, output_multiplier=0.5)
    args = dataclasses.replace(flavor, n_layers=2, vocab_size=128, dim=128, mup=mup, max_seq_len=64)
    torch.manual_seed(seed)
    model = spec.build(args)
    model.init_weights()
    with torch.no_grad():  # norms away from 1, so a query scale folded into the wrong tensor shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return spec, args, model.eval()


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_hugging_face_export_folds_the_multipliers_and_reads_back(name):
    transformers = pytest.importorskip("transformers")
    spec, args, model = mup_model(name)
    adapter = spec.hf_adapter
    state = {k: v.detach() for k, v in model.state_dict().items()}
    hf_state = adapter.to_hf(state, args)
    config = adapter.hf_config_from_args(args, "float32")
    hf_class = getattr(transformers, adapter.hf_architecture)
    hf_model = hf_class(getattr(transformers, adapter.hf_architecture.replace("ForCausalLM", "Config"))(**config))
    hf_model.load_state_dict(hf_state, strict=True)
    hf_model.eval()
    x = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(x), hf_model(x).logits
    assert ours.abs().max() > 0.1
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-4)
    plain = dataclasses.replace(args, mup=None)
    without = spec.build(plain)
    without.load_state_dict(adapter.from_hf(hf_state, plain))  # the export is a usual model ...
    with torch.no_grad():
        torch.testing.assert_close(without.eval()(x), ours, atol=2e-5, rtol=1e-4)
    back = adapter.from_hf(hf_state, args)  # ... and reads back into the muP model
    for key, value in state.items():
        torch.testing.assert_close(back[key], value, atol=1e-7, rtol=1e-6)
    assert not torch.equal(hf_state["model.embed_tokens.weight"], state["tok_embeddings.weight"])


def test_the_job_check_refuses_what_mup_does_not_cover():
    def refused(args: list[str], match: str) -> None:
        with pytest.raises(ConfigError, match=match):
            resolve(load_config(None, args), 1)

    refused(["--mup.enable", "true", "--optimizer.name", "Muon"], "mup.enable = true with optimizer.name = 'Muon'")
    refused(["--mup.enable", "true", "--model.name", "deepseek_v3"], "mup.enable: deepseek_v3 models have no muP")
    refused(["--mup.enable", "true", "--model.flavor", "1B"], "mup.enable: muP needs untied embeddings.*'tie_word_embeddings=false' to model.shape")
    refused(["--mup.enable", "true", "--model.name", "qwen3_moe", "--model.flavor", "debugmodel_moe"], "mup.enable: muP here covers dense models")
    refused(["--model.shape", "dims=512"], "model.shape: llama3 has no settable field 'dims'; choose from .*dim")
    refused(["--model.shape", "dim=wide"], "model.shape: dim='wide' is not an int")
    refused(["--model.shape", "dim"], "model.shape: 'dim' is not 'field=value'")
    refused(["--model.shape", "rope_scaling=1"], "no settable field 'rope_scaling'")
    refused(["--model.shape", "dim=500"], r"model.shape \['dim=500'\]: ModelArgs.dim=500 is not divisible by n_heads=16")
    refused(["--model.shape", "moe.top_k=2"], "model.shape: llama3 has no nested settings 'moe'")
    deepseek = ["--model.name", "deepseek_v3", "--model.shape"]
    refused([*deepseek, "moe.topk=2"], "MoEArgs has no settable field 'moe.topk'; choose from .*moe.top_k")
    refused([*deepseek, "moe.top_k=20"], r"model.shape \['moe.top_k=20'\]: MoEArgs.top_k=20 must be in 1..num_experts=8")
    moe = resolve(load_config(None, [*deepseek, "moe.num_experts=16,moe.top_k=2,n_layers=3"]), 1).model_args
    assert (moe.moe.num_experts, moe.moe.top_k, moe.n_layers) == (16, 2, 3)
    # Long-context extension: Llama 3.1's RoPE scaling on a flavor without it (from its defaults), or off on 1B
    longer = ["rope_scaling.factor=16,rope_scaling.original_max_position_embeddings=256,max_seq_len=4096"]
    extended = resolve(load_config(None, ["--model.shape", *longer]), 1).model_args
    assert (extended.rope_scaling.factor, extended.rope_scaling.low_freq_factor, extended.max_seq_len) == (16, 1, 4096)
    assert extended.rope_scaling.original_max_position_embeddings == 256
    one_b = ["--model.flavor", "1B", "--model.shape"]
    assert resolve(load_config(None, [*one_b, "rope_scaling=none"]), 1).model_args.rope_scaling is None
    assert resolve(load_config(None, [*one_b, "rope_scaling.factor=4"]), 1).model_args.rope_scaling.factor == 4
    assert resolve(load_config(None, one_b[:2]), 1).model_args.rope_scaling.factor == 32  # 1B's own (Llama 3.2)
    refused(["--model.shape", "rope_scaling.factr=2"], "RopeScaling has no settable field 'rope_scaling.factr'")
    job = resolve(load_config(None, ["--model.shape", "n_layers=3,norm_eps=1e-6,n_kv_heads=none"]), 1)
    assert (job.model_args.n_layers, job.model_args.norm_eps, job.model_args.kv_heads) == (3, 1e-6, 16)
    untied = resolve(load_config(None, ["--mup.enable", "true", "--model.flavor", "1B", "--model.shape",
                                        "tie_word_embeddings=false", "--mup.base_dim", "512"]), 1)  # fmt: skip
    assert untied.model_args.mup.width_multiplier(untied.model_args.dim) == 4.0
    example = resolve(load_config(str(Path(__file__).parents[1] / "examples" / "mup.toml")), 1)  # as README runs it
    assert (example.model_args.dim, example.optimizer.hidden_lr_scale, example.model_args.n_layers) == (1024, 0.25, 4)


RUN = [*TINY, "--training.steps", "4", "--training.global_batch_size", "4", "--model.shape", "dim=512,n_heads=32,n_layers=2",
       "--mup.enable", "true", "--mup.base_head_dim", "32", "--mup.embedding_multiplier", "4",
       "--mup.output_multiplier", "0.5", "--optimizer.lr", "3e-3"]  # fmt: skip
ONE_PROCESS = {
    "reference": ["--checkpoint.enable", "--checkpoint.interval", "4"],
    "plain_loss": ["--training.fused_loss", "false"],
    "base_usual": ["--model.shape", "n_layers=2", "--mup.enable", "false"],
    "base_mup": ["--model.shape", "n_layers=2", "--mup.base_head_dim", "0", "--mup.embedding_multiplier", "1",
                 "--mup.output_multiplier", "1"],
}  # fmt: skip
TWO_PROCESSES = {
    "fsdp": ["--training.local_batch_size", "2"],
    "tp": ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mup")
    run_titan_all({root / name: [*RUN, "--training.local_batch_size", "4", *a] for name, a in ONE_PROCESS.items()})
    run_titan_all({root / name: [*RUN, *a] for name, a in TWO_PROCESSES.items()}, nproc=2)
    return root


def test_layouts_train_a_mup_model_as_one_process_and_the_base_width_is_the_usual_model(runs):
    reference = read_metrics(runs / "reference")
    assert [r["step"] for r in reference] == [1, 2, 3, 4]
    for row in ["plain_loss", *TWO_PROCESSES]:
        gap = max(abs(a - b) for a, b in zip(losses(runs / row), losses(runs / "reference"), strict=True))
        assert gap < 2e-5, (row, gap)
    assert losses(runs / "base_mup") == losses(runs / "base_usual")  # bit for bit
    log = (runs / "reference" / "train.log").read_text()
    assert "llama3/debugmodel with dim=512, n_heads=32, n_layers=2" in log and "muP at 2x the width 256" in log
    assert "muP: 14 block matrices" in log


def test_a_mup_run_converts_with_parity_and_generates(runs, tmp_path):
    step = runs / "reference" / "checkpoint" / "step-4"
    cli = CliRunner()
    result = cli.invoke(app, ["convert", str(step), str(tmp_path / "hf"), "--to", "hf"])
    assert result.exit_code == 0, result.output
    assert "parity:" in result.output and "(ok;" in result.output  # transformers' logits equal the muP model's
    result = cli.invoke(app, ["generate", str(runs / "reference"), "--prompt", "def ", "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
