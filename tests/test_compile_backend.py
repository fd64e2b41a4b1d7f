"""`compile.backend` (torchtitan's key; `ParallelOptions.compile_backend` in titan-parallel): the blocks and the
loss compile with the backend named, e.g. to tell a problem of Inductor's from one of Dynamo's or AOTAutograd's.
`aot_eager` and `eager` runs train exactly as an uncompiled run and never reach Inductor (no code in its cache);
names that cannot work are refused in one line naming the argument."""

from __future__ import annotations

import pytest
from titan_run import TINY, losses, run_titan, run_titan_all

from titan_parallel import ParallelConfigError, check_compile_backend

RUN = [*TINY, "--training.steps", "3"]


def test_aot_eager_and_eager_train_as_the_uncompiled_run_without_inductor(tmp_path):
    plain, dynamo = tmp_path / "plain", tmp_path / "eager"
    run_titan_all({plain: RUN, dynamo: [*RUN, "--compile.enable", "true", "--compile.backend", "eager"]})
    inductor_cache = tmp_path / "inductor"
    aot = run_titan(tmp_path / "aot_eager", *RUN, "--compile.enable", "true", "--compile.backend", "aot_eager",
                    env={"TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)})  # fmt: skip
    assert "compiled (model, loss; aot_eager)" in aot.stdout + aot.stderr  # the banner names it
    assert losses(tmp_path / "aot_eager") == losses(plain) == losses(dynamo)  # bit for bit: no kernel of Inductor's
    assert not [p for p in inductor_cache.rglob("*") if p.is_file()]  # the blocks and the fused loss alike


@pytest.mark.parametrize("kwargs, arguments, says", [
    (dict(compile_backend="inductr", device_type="cpu"), ("compile_backend",),
     "compile_backend='inductr' is not a registered torch.compile backend"),
    (dict(compile_backend="inductor", device_type="cpu", tp=2), ("compile_backend", "tp", "device_type"),
     "compile_backend='inductor' with tp=2 on CPU"),
    (dict(compile_backend="eager", device_type="cuda", ac_mode="memory_budget"), ("ac_mode", "compile_backend"),
     "ac_mode='memory_budget' needs a backend whose partitioner the budget steers"),
])  # fmt: skip
def test_a_backend_that_cannot_work_names_its_arguments(kwargs, arguments, says):
    with pytest.raises(ParallelConfigError, match=says) as caught:
        check_compile_backend(**kwargs)
    assert caught.value.arguments == arguments and "compile.backend" not in str(caught.value)


def test_the_backends_that_can_work_pass():
    check_compile_backend(None, "cpu", tp=2, ac_mode="memory_budget")  # unset: Titan's default choice
    check_compile_backend("inductor", "cuda", tp=2, ac_mode="memory_budget")
    check_compile_backend("aot_eager", "cpu", tp=2, ac_mode="memory_budget")
    check_compile_backend("eager", "cpu", tp=4)
