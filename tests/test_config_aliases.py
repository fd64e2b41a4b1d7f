"""torchtitan's quantization spellings (`model.converters = ["quantize.linear.float8"]`, `[quantize.linear.float8]`,
`quantize.linear.mx`) load as Titan's `float8` / `[float8]` / `mx`: the same job as the Titan spelling, one
spelling per file, and a one-line error naming any torchtitan key Titan has no equivalent for.

The torchtitan files are written here as torchtitan v0.2.2 documents them (torchtitan/config/job_config.py,
docs/float8.md, docs/mxfp8.md); the expected values are typed in, not read back from the code.
"""

from pathlib import Path

import pytest

from titan_core.config import ConfigError, JobConfig, dump_toml, load_config


def write(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def config_error(config_file: str | None, overrides: list[str]) -> str:
    """The ConfigError message of a load that must fail; it must be one line."""
    with pytest.raises(ConfigError) as info:
        load_config(config_file, overrides)
    message = str(info.value)
    assert "\n" not in message, message
    return message


TORCHTITAN_FLOAT8 = """
[model]
converters = ["quantize.linear.float8"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = true
precompute_float8_dynamic_scale_for_fsdp = true
recipe_name = "tensorwise"
filter_fqns = ["output", "attention.wk", "auto_filter_small_kn"]
emulate = true
"""

TITAN_FLOAT8 = """
[model]
converters = ["float8"]

[float8]
enable_fsdp_float8_all_gather = true
precompute_float8_dynamic_scale_for_fsdp = true
recipe_name = "tensorwise"
filter_fqns = ["output", "attention.wk"]
auto_filter_small_kn = true
emulate = true
"""


def test_a_torchtitan_float8_file_is_the_titan_spelled_job(tmp_path):
    torchtitan = load_config(write(tmp_path, TORCHTITAN_FLOAT8, "torchtitan.toml"), [])
    titan = load_config(write(tmp_path, TITAN_FLOAT8, "titan.toml"), [])
    assert torchtitan == titan
    assert torchtitan.model.converters == ["float8"]
    f = torchtitan.float8
    assert (f.enable_fsdp_float8_all_gather, f.precompute_float8_dynamic_scale_for_fsdp, f.emulate) == (
        True,
        True,
        True,
    )
    # torchtitan switches its small-GEMM filter on by listing "auto_filter_small_kn" in filter_fqns.
    assert f.filter_fqns == ["output", "attention.wk"] and f.auto_filter_small_kn is True
    # Everything after the load sees Titan's names only: the run folder's config.toml is Titan-spelled.
    dumped = dump_toml(torchtitan)
    assert "[float8]" in dumped and "quantize" not in dumped


def test_a_torchtitan_mx_file_is_the_titan_spelled_job(tmp_path):
    torchtitan = write(
        tmp_path,
        """
[model]
converters = ["quantize.linear.mx"]

[quantize.linear.mx]
recipe_name = "mxfp8_cublas_rceil"
filter_fqns = ["output", "router.gate"]
""",
        "torchtitan.toml",
    )
    titan = write(
        tmp_path,
        """
[model]
converters = ["mx"]

[mx]
recipe_name = "mxfp8_rceil"
filter_fqns = ["output", "router.gate"]
""",
        "titan.toml",
    )
    cfg = load_config(torchtitan, [])
    assert cfg == load_config(titan, [])
    assert (cfg.model.converters, cfg.mx.recipe_name) == (["mx"], "mxfp8_rceil")


def test_torchtitan_shipped_sections_load_as_written(tmp_path):
    # torchtitan's llama3 8B and DeepSeek-V3 configs: the float8 section is there with the converter off, and the
    # MoE grouped-GEMM section configures a converter nobody asked for (inert in torchtitan too).
    cfg = load_config(
        write(
            tmp_path,
            """
[model]
converters = []

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output", "router.gate"]

[quantize.grouped_mm.float8]
fqns = ["experts"]
""",
        ),
        [],
    )
    expected = JobConfig()
    expected.float8.filter_fqns = ["output", "router.gate"]
    assert cfg == expected


def test_torchtitan_command_line_flags_work(tmp_path):
    # torchtitan's booleans are bare flags, `emulate` included (Titan's also takes "auto", so it needs a value).
    torchtitan = load_config(
        None,
        (
            "--model.converters quantize.linear.float8 --quantize.linear.float8.enable_fsdp_float8_all_gather "
            "--quantize.linear.float8.precompute-float8-dynamic-scale-for-fsdp "
            "--quantize.linear.float8.filter_fqns output,auto_filter_small_kn "
            "--quantize.linear.float8.recipe_name rowwise --quantize.linear.float8.emulate"
        ).split(),
    )
    titan = load_config(
        None,
        (
            "--model.converters float8 --float8.enable_fsdp_float8_all_gather "
            "--float8.precompute_float8_dynamic_scale_for_fsdp --float8.filter_fqns output "
            "--float8.auto_filter_small_kn true --float8.recipe_name rowwise --float8.emulate true"
        ).split(),
    )
    assert torchtitan == titan
    assert (torchtitan.float8.recipe_name, torchtitan.float8.emulate) == ("rowwise", True)
    message = config_error(None, ["--quantize.linear.float8.recipe_name"])
    assert (
        message == "--quantize.linear.float8.recipe_name needs a value, e.g. --quantize.linear.float8.recipe_name VALUE"
    )
    assert load_config(None, ["--quantize.linear.mx.recipe_name=mxfp8_cublas_rceil"]).mx.recipe_name == "mxfp8_rceil"
    # The command line may use the other spelling than the file it overrides.
    path = write(tmp_path, TITAN_FLOAT8)
    assert load_config(path, ["--quantize.linear.float8.emulate", "false"]).float8.emulate is False


def test_both_spellings_in_one_file_fail_in_one_line_naming_both(tmp_path):
    path = write(tmp_path, '[float8]\nrecipe_name = "rowwise"\n\n[quantize.linear.float8]\nemulate = true\n')
    message = config_error(path, [])
    assert "[float8]" in message and "[quantize.linear.float8]" in message and path in message and "keep one" in message
    path = write(tmp_path, '[model]\nconverters = ["float8", "quantize.linear.float8"]\n', "converters.toml")
    message = config_error(path, [])
    assert "model.converters" in message and "'float8'" in message and "'quantize.linear.float8'" in message
    assert path in message and "keep one" in message
    message = config_error(None, ["--float8.emulate", "true", "--quantize.linear.float8.recipe_name", "rowwise"])
    assert "--float8.*" in message and "--quantize.linear.float8.*" in message and "keep one" in message


@pytest.mark.parametrize(
    "text, overrides, named",
    [
        (
            '[quantize.linear.mx]\nmxfp8_dim1_cast_kernel_choice = "cuda"\n',
            [],
            "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice",
        ),
        (
            None,
            ["--quantize.linear.mx.mxfp8_dim1_cast_kernel_choice", "cuda"],
            "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice",
        ),
        ('[model]\nconverters = ["quantize.grouped_mm.float8"]\n', [], "'quantize.grouped_mm.float8'"),
        (None, ["--model.converters", "quantize.linear.float8,quantize.grouped_mm.mx"], "'quantize.grouped_mm.mx'"),
        (None, ["--quantize.grouped_mm.mx.fqns", "experts"], "quantize.grouped_mm.mx.fqns"),
        ('[quantize.linear.mx]\nrecipe_name = "mxfp8_cublas"\n', [], "quantize.linear.mx.recipe_name = 'mxfp8_cublas'"),
    ],
)
def test_a_torchtitan_key_without_a_titan_equivalent_is_named(tmp_path, text, overrides, named):
    message = config_error(write(tmp_path, text) if text else None, overrides)
    assert named in message and "has no Titan equivalent" in message


def test_unknown_torchtitan_spellings_are_named_with_a_suggestion(tmp_path):
    path = write(tmp_path, '[quantize.linear.float8]\nrecipe = "rowwise"\n')
    message = config_error(path, [])
    assert "'quantize.linear.float8.recipe'" in message and path in message
    assert "did you mean 'quantize.linear.float8.recipe_name'?" in message
    message = config_error(write(tmp_path, '[quantize.linear.nvfp4]\nrecipe_name = "x"\n', "nvfp4.toml"), [])
    assert "'quantize.linear.nvfp4'" in message and "[quantize.linear.float8]" in message
    message = config_error(None, ["--quantize.linear.float8.recipe", "rowwise"])
    assert "did you mean 'quantize.linear.float8.recipe_name'?" in message
    # A bad value under the torchtitan spelling names both the Titan key and the one written.
    message = config_error(write(tmp_path, '[quantize.linear.float8]\nrecipe_name = "rowwize"\n', "bad.toml"), [])
    assert message.startswith("float8.recipe_name: 'rowwize' is not one of 'tensorwise', 'rowwise'")
    assert "as quantize.linear.float8.recipe_name" in message


def test_torchtitans_former_tokenizer_path_is_hf_assets_path(tmp_path):
    folder = str(tmp_path / "Llama-3.1-8B")
    from_file = load_config(write(tmp_path, f'[model]\nname = "llama3"\ntokenizer_path = "{folder}"\n'), [])
    assert from_file.model.hf_assets_path == folder
    assert load_config(None, ["--model.tokenizer_path", folder]) == from_file
    assert load_config(None, [f"--model.tokenizer-path={folder}"]).model.hf_assets_path == folder
    message = config_error(write(tmp_path, f'[model]\ntokenizer_path = "{folder}"\nhf_assets_path = "x"\n', "both.toml"), [])
    assert "model.hf_assets_path and model.tokenizer_path" in message and "keep one" in message
    message = config_error(None, ["--model.hf_assets_path", "x", "--model.tokenizer_path", folder])
    assert "--model.hf_assets_path and --model.tokenizer_path" in message and "keep one" in message
