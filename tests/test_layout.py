"""titan-parallel as a library: the layout rules and the arguments their errors name, the public
API's docstrings and import cost, and no Titan config key anywhere in its sources. Fast, no processes
(the rules' launches are in test_tensor_parallel.py, test_context_parallel.py and test_pipeline.py)."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lone_install import titan_key_pattern

import titan_parallel
from titan_parallel import (
    ParallelConfigError,
    ParallelDims,
    check_ac,
    check_async_tp,
    check_cp,
    check_data_parallel,
    check_rotate_method,
    resolve_device,
)

SOURCES = Path(titan_parallel.__file__).parent

def test_sources_name_no_titan_config_key():
    found = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted(SOURCES.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if titan_key_pattern().search(line)
    ]
    assert not found, "\n".join(found)


def test_the_key_pattern_catches_keys_and_spares_python_paths():
    key = titan_key_pattern()
    assert key.search("set parallelism.tensor_parallel_degree = 1")
    assert key.search("(`training.seq_len`)") and key.search("model.converters = ['mx']")
    assert not key.search("import torchao.float8.float8_linear; torch.utils.checkpoint.checkpoint")


def raised(call) -> ParallelConfigError:
    with pytest.raises(ParallelConfigError) as info:
        call()
    error = info.value
    message = str(error)
    assert "\n" not in message
    for argument in error.arguments:  # each a whole word, so a caller can rewrite it into its own terms
        assert re.search(rf"(?<![\w.]){argument}(?!\w)", message), (argument, message)
    return error


@pytest.mark.parametrize(
    "call, arguments, text",
    [
        (lambda: ParallelDims(tp=0), ("tp",), "tp=0 must be >= 1"),
        (lambda: ParallelDims(dp_shard=0), ("dp_shard",), "dp_shard=0 must be >= 1, or -1"),
        (lambda: ParallelDims(cp=2, tp=4, world_size=6), ("cp", "tp"), "the world size 6 is not divisible by cp=2 x tp=4 = 8"),
        (lambda: ParallelDims(dp_shard=2, tp=2, world_size=2), ("dp_shard", "tp"),
         "dp_shard=2 x tp=2 = 4 but the world size is 2; set dp_shard=-1 (the rest) or launch 4 processes"),
        (lambda: ParallelDims(dp_replicate=2, dp_shard=1, pp=2, world_size=8), ("dp_shard", "dp_replicate", "pp"), "= 4 but the world size is 8"),
        (lambda: check_data_parallel(ParallelDims(dp_shard=2, tp=2, world_size=4), "ddp"), ("dp_mode", "dp_shard", "tp", "dp_replicate"),
         "dp_mode='ddp' replicates whole models and does not combine with dp_shard=2, tp=2"),
        (lambda: check_data_parallel(ParallelDims(), "zero3"), ("dp_mode",), "dp_mode='zero3' is unknown"),
        (lambda: ParallelDims(tp=2, ep=2, etp=4, world_size=2), ("etp", "tp"), "etp=4 must be tp=2 (TP splits each expert) or 1"),
        (lambda: ParallelDims(cp=2, tp=2, ep=2, etp=1, world_size=8), ("ep", "cp", "tp", "dp_shard", "etp"),
         "ep=2 must be cp=2 x tp=2 times a divisor of dp_shard=2"),
        (lambda: check_cp(36, 4), ("seq_len", "cp"), "seq_len=36 is not divisible by 2 x cp=4 = 8"),
        (lambda: check_cp(30, 1, tp=4), ("seq_len", "tp"), "seq_len=30 is not divisible by tp=4:"),
        (lambda: check_cp(0, 1), ("seq_len",), "seq_len=0 must be >= 1"),
        (lambda: check_rotate_method("ring"), ("cp_rotate_method",), "cp_rotate_method='ring' is unknown"),
        (lambda: check_rotate_method("rotate", 192, 128), ("cp_rotate_method",), "key head dim is 192 and its value head dim 128"),
        (lambda: check_ac("some", "2"), ("ac_mode",), "ac_mode='some' is unknown"),
        (lambda: check_ac("selective", "0"), ("ac_selective_option",), "ac_selective_option='0' is neither 'op' nor a positive int"),
        (lambda: check_async_tp(2, "cpu", compile=False), ("async_tp", "compile", "device_type"),
         "async_tp needs compile=True and a CUDA device (device_type is 'cpu')"),
        (lambda: resolve_device("tpu"), ("device",), "device='tpu' is unknown"),
    ],
)
def test_rules_name_their_arguments(call, arguments, text):
    error = raised(call)
    assert error.arguments == arguments
    assert text in str(error), str(error)


def test_valid_layouts_pass():
    assert ParallelDims(dp_replicate=2, cp=2, tp=2, world_size=16).dp_shard == 2
    assert ParallelDims(world_size=8).dp == 8
    # Expert parallel carved from dp_shard x cp (etp = tp, the default), or from dp_shard x cp x tp (etp = 1).
    split = ParallelDims(tp=2, ep=2, world_size=8)
    assert (split.etp, split.ep_spans_tp, split.dp_shard_in_ep, split.dp_shard_mod_ep) == (2, False, 2, 2)
    joined = ParallelDims(tp=2, ep=2, etp=1, world_size=8)
    assert (joined.ep_spans_tp, joined.dp_shard_in_ep, joined.dp_shard_mod_ep) == (True, 1, 4)
    wide = ParallelDims(cp=2, tp=2, ep=8, etp=1, world_size=16)
    assert (wide.dp_shard, wide.dp_shard_in_ep, wide.dp_shard_mod_ep) == (4, 2, 2)
    assert not ParallelDims(ep=2, etp=1, world_size=2).ep_spans_tp  # tp = 1: etp = 1 is the default
    # Without expert parallel etp is not read (torchtitan's configs set etp = 1 beside ep = 1 and tp = 8).
    assert not ParallelDims(tp=2, etp=1, world_size=2).ep_spans_tp
    check_data_parallel(ParallelDims(dp_replicate=2, dp_shard=1, world_size=2), "ddp")
    check_data_parallel(ParallelDims(dp_shard=2, tp=2, world_size=4), "fsdp")
    check_cp(32, 2, tp=2)
    check_cp(15, 1)  # neither context nor sequence parallel: any length
    check_rotate_method("rotate")
    check_rotate_method("rotate", 128, 128)
    check_rotate_method("allgather", 192, 128)
    for mode, option in (("none", "2"), ("full", "2"), ("selective", "op"), ("selective", "3"), ("selective", 3)):
        check_ac(mode, option)
    check_async_tp(4, "cuda", compile=True)
    assert resolve_device("cpu").type == "cpu"


@pytest.mark.skipif(sys.modules.get("torch") is not None and __import__("torch").cuda.is_available(), reason="has a GPU")
def test_cuda_without_a_gpu_is_refused():
    error = raised(lambda: resolve_device("cuda"))
    assert error.arguments == ("device",) and str(error) == "device='cuda' but no CUDA GPU is visible; use 'auto' or 'cpu'"
    assert resolve_device("auto").type == "cpu"


def test_errors_keep_their_arguments_through_pickle():
    import pickle

    error = pickle.loads(pickle.dumps(ParallelConfigError("tp=3 does not divide n_heads=16", arguments=("tp",))))
    assert str(error) == "tp=3 does not divide n_heads=16" and error.arguments == ("tp",)


def public_callables():
    """(qualified name, object) of every public function and class defined in titan-parallel's modules."""
    import enum
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(titan_parallel.__path__):
        module = importlib.import_module(f"titan_parallel.{info.name}")
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj) and not issubclass(obj, (Exception, enum.Enum)):
                yield f"{info.name}.{name}", obj


def test_every_public_function_documents_its_arguments():
    undocumented = []
    for name, obj in public_callables():
        params = [p for p in inspect.signature(obj).parameters if p not in ("self", "args", "kwargs")]
        if params and "Args:" not in (inspect.getdoc(obj) or ""):
            undocumented.append(name)
    assert not undocumented, undocumented


def test_no_public_name_is_shadowed_by_a_submodule():
    # Importing `titan_parallel.x` sets the package's attribute `x` to that module: a public
    # name equal to a module's name would turn into the module once anything imported it.
    list(public_callables())  # imports every submodule
    shadowed = [name for name in titan_parallel.__all__ if inspect.ismodule(getattr(titan_parallel, name))]
    assert not shadowed, shadowed


def imports_after(statement: str) -> set[str]:
    """The modules a fresh interpreter has loaded after `statement`."""
    code = f"import sys; {statement}; print(' '.join(sys.modules))"
    return set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())


def test_layout_rules_import_no_torch():
    loaded = imports_after("import titan_parallel.layout, titan_parallel.pipeline_layout; from titan_parallel import ParallelDims, check_cp")
    assert "torch" not in loaded


def test_pipeline_config_imports_no_pipelining_or_torchao():
    loaded = imports_after("from titan_parallel import PipelineConfig, check_pipeline, parallelize, check_float8")
    assert "torch.distributed.pipelining" not in loaded and "torchao" not in loaded


def test_reference_snippets_are_the_examples_code():
    """docs/reference/titan-parallel.md's snippets call the API as examples/parallelize_any_model.py does."""
    repo = Path(__file__).resolve().parents[1]
    example = {line.strip() for line in (repo / "examples" / "parallelize_any_model.py").read_text().splitlines()}
    blocks = re.findall(r"```python\n(.*?)```", (repo / "docs" / "reference" / "titan-parallel.md").read_text(), re.S)
    borrowed = ("import", "from ", "example", "TinyGPT, PLAN", "print(")  # the runnable snippet's own set-up
    snippets = [blocks[0], blocks[1], blocks[2]]  # the plan, FSDP x TP, the pipeline
    missing = [
        line.strip() for block in snippets for line in block.splitlines()
        if line.strip() and not line.strip().startswith(borrowed) and line.strip() not in example
    ]
    assert not missing, missing
