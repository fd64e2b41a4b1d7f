"""`titan convert` and titan-ckpt's HF / DCP / torch storage, single process on CPU.

The command runs in-process through typer's CliRunner (the same code the `titan`
entry point runs; transformers is imported once for the whole file); one subprocess
checks that `titan --help` does not import torch.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from typer.testing import CliRunner

from titan_ckpt.dcp_files import read_dcp_state_dict, read_dcp_tensor_shapes
from titan_ckpt.formats import detect_format
from titan_ckpt.hf_safetensors import INDEX_FILE, parse_size, plan_shards, read_hf_state_dict
from titan_ckpt import atomic_output
from titan_cli.main import app
from titan_core import hf_parity
from titan_core.convert import convert_checkpoint
from titan_core.hf_parity import check_hf_parity
from titan_models.llama3 import Transformer, args_from_hf_config, llama3_flavors
from titan_models.llama3.hf_adapter import permute_to_hf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # the tests' own dcp.save

REPO_ID = "titan-test/tiny-llama"
FAKE_TOKEN = "hf_fakeSecretToken1234567890"
PARITY = re.compile(r"parity: max_abs_diff=(\S+) kl=(\S+) tokens=(\d+) \(ok;")
TOKENIZER_FILES = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": '{"bos_token": "<s>"}'}


def tiny_hf_config(**overrides):
    base = dict(
        hidden_size=64,
        intermediate_size=120,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        initializer_range=0.1,
        bos_token_id=7,
        eos_token_id=8,
    )
    return transformers.LlamaConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory) -> Path:
    """A small random Llama saved by transformers in 5 shards, with tokenizer files."""
    folder = tmp_path_factory.mktemp("source") / "hf"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_hf_config())
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="40KB")
    for name, text in TOKENIZER_FILES.items():
        (folder / name).write_text(text)
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    return folder


def run_cli(*args: str):
    return CliRunner().invoke(app, ["convert", *map(str, args)])


def parse_parity(output: str) -> tuple[float, float, int]:
    match = PARITY.search(output)
    assert match, output
    return float(match.group(1)), float(match.group(2)), int(match.group(3))


def load_hf_files(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files, read with safetensors itself."""
    out = {}
    for path in folder.glob("*.safetensors"):
        out.update(load_file(path))
    return out


def fake_hub_cache(cache: Path, repo_id: str, snapshot_of: Path) -> None:
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(snapshot_of, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


def no_partial_left(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if ".partial-" in p.name]


def test_cli_chain_hf_dcp_hf_torch_dcp(hf_source, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    # hf -> dcp from a Hub repo id, offline, out of the local cache; the token never shows.
    fake_hub_cache(tmp_path / "cache", REPO_ID, hf_source)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    result = run_cli(REPO_ID, tmp_path / "dcp", "--to", "dcp")
    assert result.exit_code == 0, result.output
    diff, kl, n = parse_parity(result.output)
    assert diff < 1e-5 and kl < 1e-9 and n == 256
    assert "Loading weights" not in result.output  # transformers' progress bar, off for the parity check

    missing = run_cli("titan-test/not-cached", tmp_path / "never", "--to", "dcp")
    assert missing.exit_code == 2
    assert "titan-test/not-cached" in missing.stderr and FAKE_TOKEN not in missing.output
    assert len(missing.stderr.strip().splitlines()) == 1 and not (tmp_path / "never").exists()

    # dcp -> hf: shape from the config.json the first step left beside the DCP files.
    result = run_cli(tmp_path / "dcp", tmp_path / "hf2", "--to", "hf", "--max-shard-size", "40KB")
    assert result.exit_code == 0, result.output
    diff, kl, _ = parse_parity(result.output)
    assert diff < 1e-5 and kl < 1e-9

    # hf -> torch folder (model.pt + config.json), then torch -> dcp (no HF side: no parity line).
    result = run_cli(tmp_path / "hf2", tmp_path / "torch", "--to", "torch")
    assert result.exit_code == 0, result.output
    diff, kl, _ = parse_parity(result.output)
    assert diff < 1e-5 and kl < 1e-9
    result = run_cli(tmp_path / "torch", tmp_path / "dcp2", "--to", "dcp")
    assert result.exit_code == 0, result.output
    assert "parity" not in result.stdout

    # The round trip is lossless: HF files bit-identical to transformers' own.
    source, back = load_hf_files(hf_source), load_hf_files(tmp_path / "hf2")
    assert set(back) == set(source) and all(torch.equal(back[k], source[k]) for k in source)
    index = json.loads((tmp_path / "hf2" / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(source)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in source.values())
    assert all(len(load_file(tmp_path / "hf2" / f)) > 0 for f in set(index["weight_map"].values()))
    config = transformers.LlamaConfig.from_pretrained(tmp_path / "hf2")
    assert (config.intermediate_size, config.num_key_value_heads, config.bos_token_id) == (120, 2, 7)
    for folder in ("dcp", "hf2", "torch", "dcp2"):
        for name, text in TOKENIZER_FILES.items():
            assert (tmp_path / folder / name).read_text() == text

    # The Titan-side files hold Titan names in Meta's RoPE layout, identical across formats.
    titan = torch.load(tmp_path / "torch" / "model.pt", weights_only=True)
    names = list(read_dcp_tensor_shapes(tmp_path / "dcp2"))
    dcp2 = read_dcp_state_dict(tmp_path / "dcp2", names)
    assert set(titan) == set(dcp2) == set(Transformer(args_from_hf_config(config.to_dict())).state_dict())
    assert all(torch.equal(titan[k], dcp2[k]) for k in titan)
    hf_q = source["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(permute_to_hf(titan["layers.1.attention.wq.weight"], 4), hf_q)
    assert not torch.equal(titan["layers.1.attention.wq.weight"], hf_q)
    assert [detect_format(tmp_path / f) for f in ("hf2", "dcp", "torch")] == ["hf", "dcp", "torch"]
    assert no_partial_left(tmp_path)


def test_dtype_option_and_single_torch_file(hf_source, tmp_path):
    result = run_cli(hf_source, tmp_path / "dcp16", "--to", "dcp", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    diff, kl, _ = parse_parity(result.output)  # both sides compared on the bf16-rounded weights
    assert diff < 1e-5 and kl < 1e-9
    assert {dtype for _, dtype in read_dcp_tensor_shapes(tmp_path / "dcp16").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "dcp16" / "config.json").read_text())["torch_dtype"] == "bfloat16"

    result = run_cli(tmp_path / "dcp16", tmp_path / "weights.pt", "--dtype", "float32")  # .pt: --to torch
    assert result.exit_code == 0, result.output
    state = torch.load(tmp_path / "weights.pt", weights_only=True)
    source = read_hf_state_dict(hf_source)
    assert state["tok_embeddings.weight"].dtype == torch.float32
    assert torch.equal(state["tok_embeddings.weight"], source["model.embed_tokens.weight"].bfloat16().float())


def test_trainer_checkpoint_step_folder_to_hf(tmp_path):
    """A trainer's step-N (CheckpointManager layout: model keys as they are, optimizer tensors as
    `optimizer.state.<param>.<name>`, JSON states beside) finds its flavor in the run's config.toml."""
    args = llama3_flavors["debugmodel"]
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if name.endswith("norm.weight") else 0.05 * torch.randn_like(param))
    state = model.state_dict()
    run = tmp_path / "run"
    step = run / "checkpoint" / "step-3"
    optimizer = {f"optimizer.state.{k}.exp_avg": torch.zeros_like(v) for k, v in state.items()}
    dcp.save({**state, **optimizer}, checkpoint_id=str(step), no_dist=True)
    (step / "train_state.json").write_text('{"step": 3}')
    gone = tmp_path / "assets-on-another-machine"
    (run / "config.toml").write_text(
        f'[job]\ndump_folder = "run"\n\n[model]\nname = "llama3"\nflavor = "debugmodel"\nhf_assets_path = "{gone}"\n'
    )

    lines: list[str] = []
    result = convert_checkpoint(str(step), tmp_path / "hf", "hf", log=lines.append)
    # the run's tokenizer is not on this machine: said in a line, the conversion goes on without it
    assert f"the run's tokenizer (model.hf_assets_path {gone} in {run / 'config.toml'}) is not here" in "\n".join(lines)
    assert result.parity.passed and result.parity.max_abs_diff < 1e-5 and result.parity.n_tokens == 256
    hf = load_hf_files(tmp_path / "hf")
    assert torch.equal(hf["lm_head.weight"], state["output.weight"])
    assert torch.equal(hf["model.layers.5.self_attn.k_proj.weight"], permute_to_hf(state["layers.5.attention.wk.weight"], 8))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["intermediate_size"] == 768  # 256 * 8/3 -> 682, up to 3 * 256

    # A checkpoint that nests the model under "model" (keys `model.<param>`) reads the same.
    nested = tmp_path / "nested" / "step-1"
    dcp.save({"model": state, "optimizer": {"step": torch.tensor(1)}}, checkpoint_id=str(nested), no_dist=True)
    convert_checkpoint(str(nested), tmp_path / "nested.pt", "torch", parity_check=False, flavor="debugmodel")
    back = torch.load(tmp_path / "nested.pt", weights_only=True)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_bad_inputs_fail_in_one_line_and_write_nothing(hf_source, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(hf_source, broken)
    shard = sorted(broken.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "notes.txt").write_text("not a checkpoint")
    bare_dcp = tmp_path / "bare_dcp"
    dcp.save({"tok_embeddings.weight": torch.zeros(2, 2)}, checkpoint_id=str(bare_dcp), no_dist=True)
    cases = [
        ((broken, tmp_path / "out1", "--to", "dcp"), shard.name),
        ((unknown, tmp_path / "out2", "--to", "dcp"), "unknown checkpoint format"),
        ((tmp_path / "nowhere", tmp_path / "out3", "--to", "dcp"), "does not exist"),
        ((hf_source, unknown, "--to", "dcp"), "already exists"),
        ((hf_source, tmp_path / "out4", "--to", "gguf"), "--to 'gguf'"),
        ((hf_source, tmp_path / "out5", "--to", "dcp", "--dtype", "float8"), "unknown dtype 'float8'"),
        ((bare_dcp, tmp_path / "out6", "--to", "hf"), "--flavor"),
        ((bare_dcp, tmp_path / "out7", "--to", "hf", "--flavor", "debugmodel"), "'tok_embeddings.weight' has shape (2, 2), the model expects (2048, 256)"),
        ((bare_dcp, tmp_path / "out8", "--to", "hf", "--flavor", "nope"), "unknown model.flavor 'nope'"),
        ((hf_source, tmp_path / "out9"), "--to is needed: DST"),  # a folder does not say its format
    ]
    for args, expected in cases:
        result = run_cli(*args)
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith("titan convert: error: ") and expected in lines[-1], (args, result.stderr)
    assert not any((tmp_path / f"out{i}").exists() for i in range(1, 10))
    assert no_partial_left(tmp_path)


def test_failed_parity_check_leaves_nothing(hf_source, tmp_path, monkeypatch):
    monkeypatch.setattr(hf_parity, "PARITY_MAX_KL", -1.0)  # any result now fails
    result = run_cli(hf_source, tmp_path / "dcp", "--to", "dcp")
    assert result.exit_code == 1
    assert "parity" in result.stderr and "FAILED" in result.stderr and "was not written" in result.stderr
    assert not (tmp_path / "dcp").exists() and no_partial_left(tmp_path)


def test_parity_without_transformers_is_skipped(hf_source, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    args = args_from_hf_config(json.loads((hf_source / "config.json").read_text()))
    report = check_hf_parity(hf_source, {}, args, Transformer, "LlamaForCausalLM")
    assert report.skipped and report.passed and "transformers is not installed" in report.describe()
    result = run_cli(hf_source, tmp_path / "dcp", "--to", "dcp")
    assert result.exit_code == 0 and "parity: skipped (transformers is not installed" in result.stdout


def test_help_is_fast_and_lists_convert():
    """`titan --help` imports no torch; a command leaves torch's warnings about torchao's import out of its output."""
    code = (
        "import sys; from typer.testing import CliRunner; from titan_cli.main import app\n"
        "top = CliRunner().invoke(app, ['--help']).output; sub = CliRunner().invoke(app, ['convert', '--help']).output\n"
        "assert 'convert' in top and '--to' in sub and '--no-parity-check' in sub, (top, sub)\n"
        "assert 'torch' not in sys.modules, 'titan --help imported torch'\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('torchao'): import torchao  # as transformers' quantizers do in the parity check\n"
    )
    run = subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True)
    # torch 2.15 logs "<enum 'KernelPreference'> is an Enum subclass ..." when torchao registers its enums
    assert "register_constant" not in run.stderr, run.stderr


def test_storage_helpers(tmp_path):
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size(123) == 123
    with pytest.raises(ValueError, match="5GB"):
        parse_size("five gigs")
    # greedy in order; a tensor larger than the limit gets its own shard
    assert plan_shards({"a": 4, "b": 4, "c": 10, "d": 1}, 8) == [["a", "b"], ["c"], ["d"]]
    with pytest.raises(RuntimeError):
        with atomic_output(tmp_path / "out") as tmp:
            tmp.mkdir()
            (tmp / "half").write_text("x")
            raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []


def test_hf_weights_reader_and_writer_for_the_trainer(tmp_path):
    """`write_hf_weights` fills an existing step folder (the manager's tmp folder); `read_hf_weights` reads it back."""
    from titan_core.convert import read_hf_weights, write_hf_weights
    from titan_models.llama3 import ModelArgs

    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=19, multiple_of=16, tie_word_embeddings=True)
    state = Transformer(args).state_dict()
    (tmp_path / "train_state.json").write_text("{}")
    write_hf_weights(tmp_path, state, "llama3", args, dtype=torch.bfloat16, max_shard_size="4KB")
    assert (tmp_path / INDEX_FILE).is_file() and (tmp_path / "train_state.json").is_file()
    assert "lm_head.weight" not in load_hf_files(tmp_path)  # tied, as transformers saves it
    back = read_hf_weights(tmp_path, "llama3", args)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k].bfloat16()) for k in state)


def test_exports_of_a_run_carry_its_tokenizer(tmp_path):
    """A run trained with `model.hf_assets_path` exports with its tokenizer: the last save in Hugging Face format and
    `titan convert` of a DCP step both carry the tokenizer files, so `transformers` tokenizes as training did and
    `titan generate` on the export, away from the run folder, continues as it does from the run's checkpoint."""
    from test_tokenizers import train_tiny_bpe
    from titan_run import TINY, run_titan

    from titan_core.data import build_tokenizer

    assets = tmp_path / "assets"
    assets.mkdir()
    train_tiny_bpe(assets, ["<s>", "</s>"])
    (assets / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    run = tmp_path / "run"
    run_titan(run, *TINY, "--training.steps", "2", "--model.hf_assets_path", str(assets), "--checkpoint.enable",
              "--checkpoint.interval", "1", "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only")  # fmt: skip
    last = run / "checkpoint" / "step-2"
    assert detect_format(last) == "hf"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (last / name).read_bytes() == (assets / name).read_bytes(), name

    export = tmp_path / "elsewhere" / "export"
    result = CliRunner().invoke(app, ["convert", str(run / "checkpoint" / "step-1"), str(export), "--to", "hf"])
    assert result.exit_code == 0, result.output
    assert f"tokenizer: tokenizer.json, tokenizer_config.json from {assets}" in result.output
    text = "To be, or not to be, that is the question"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == build_tokenizer(str(assets)).encode(text)

    def generate(source: Path) -> list[str]:
        out = CliRunner().invoke(app, ["generate", str(source), "-p", "To be", "-n", "12", "--temperature", "0"])
        assert out.exit_code == 0, out.output
        return out.output.splitlines()

    from_run, from_export = generate(run / "checkpoint" / "step-1"), generate(export)
    assert from_run[0] == from_export[0] and from_run[0].startswith("To be")  # the prompt and its continuation
    described = [next(line for line in lines if line.startswith("model ")) for lines in (from_run, from_export)]
    assert described[0].endswith(f"tokenizer of {assets}") and described[1].endswith(f"tokenizer in {export}")


def _trainer_run(root: Path, flavor: str, steps: dict[int, int]) -> Path:
    """A run folder `root` with step-N checkpoints of random `flavor` weights (seed per step) and its config.toml."""
    args = llama3_flavors[flavor]
    for step, seed in steps.items():
        torch.manual_seed(seed)
        state = {k: 0.05 * torch.randn_like(v) for k, v in Transformer(args).state_dict().items()}
        dcp.save(state, checkpoint_id=str(root / "checkpoint" / f"step-{step}"), no_dist=True)
    (root / "config.toml").write_text(f'[model]\nname = "llama3"\nflavor = "{flavor}"\n')
    return root / "checkpoint"


def test_average_of_trainer_checkpoints(tmp_path):
    """`--average-with`: the output is the weighted mean of the checkpoints, tensor by tensor (computed here in
    float64 from the files), in DCP, torch and Hugging Face (with its parity check); bad weights or a checkpoint of
    another shape fail in one line and write nothing."""
    ckpt = _trainer_run(tmp_path / "run", "debugmodel", {1: 1, 2: 2, 3: 3})
    def read(folder: Path) -> dict[str, torch.Tensor]:
        return read_dcp_state_dict(folder, list(read_dcp_tensor_shapes(folder)))

    states = [read(ckpt / f"step-{s}") for s in (3, 1, 2)]  # the source first, then --average-with
    more = ["--average-with", ckpt / "step-1", "--average-with", ckpt / "step-2"]
    for out, extra, weights in ((tmp_path / "avg", ["--to", "dcp"], (1, 1, 1)),
                                (tmp_path / "avg.pt", ["--to", "torch", "--weights", "1,1,2"], (1, 1, 2))):  # fmt: skip
        result = run_cli(ckpt / "step-3", out, *extra, *more)
        assert result.exit_code == 0 and "averaged 3 checkpoints" in result.stdout, result.output
        got = read(out) if out.is_dir() else torch.load(out, weights_only=True)
        assert set(got) == set(states[0])
        for key in states[0]:
            mean = sum(w * s[key].double() for w, s in zip(weights, states)) / sum(weights)
            torch.testing.assert_close(got[key].double(), mean, rtol=1e-6, atol=1e-7, msg=key)
            assert got[key].dtype == torch.float32
    result = run_cli(ckpt / "step-3", tmp_path / "avg_hf", "--to", "hf", *more)
    assert result.exit_code == 0, result.output
    assert parse_parity(result.stdout)[0] < 1e-5
    other = _trainer_run(tmp_path / "other", "10M", {1: 1})  # another shape
    cases = [
        (["--weights", "1,2", *more], "--weights: 2 weight(s) for 3 checkpoints"),
        (["--weights", "1,x", *more], "--weights '1,x': give numbers separated by commas"),
        (["--weights", "1"], "--weights weigh the checkpoints of an average; add them with --average-with"),
        (["--average-with", other / "step-1"], f"--average-with {other / 'step-1'}: another model shape than"),
    ]
    for i, (extra, expected) in enumerate(cases):
        result = run_cli(ckpt / "step-3", tmp_path / f"bad{i}", "--to", "dcp", *extra)
        assert result.exit_code == 2 and expected in result.stderr.strip().splitlines()[-1], (extra, result.stderr)
        assert not (tmp_path / f"bad{i}").exists()
    assert no_partial_left(tmp_path)
