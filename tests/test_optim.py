"""Optimizer builder and warmup-stable-decay LR schedule.

Expected schedule factors are worked out by hand from the definition
(torchtitan's linear_warmup_stable_decay): warmup (s+1)/(W+1); decay progress
p = (s+1-W-S)/(D+1); linear 1-p, sqrt 1-sqrt(p), cosine (1+cos(pi p))/2, mapped
onto [m, 1] as m + (1-m) * shape.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from titan_ckpt import CheckpointOptions
from titan_core.checkpointing import build_checkpointer
from titan_core.config import load_config
from titan_core.config.errors import ConfigError
from titan_core.job import resolve
from titan_core.lr_schedule import build_lr_scheduler
from titan_core.muon import MuonOptions
from titan_core.optim import OptimizerOptions, build_optimizer
from titan_models import get_model_args, get_model_spec
from titan_run import TINY, losses, read_metrics, run_titan


def _lrs(steps: int, n: int | None = None, **schedule) -> list[float]:
    """LR (peak 1.0) used by each of the first `n` optimizer steps."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = build_lr_scheduler(opt, steps=steps, **schedule)
    lrs = []
    for _ in range(steps if n is None else n):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


# steps=10, W=2, decay_ratio=0.4 -> D=4, S=4. Decay steps s=6..9 have
# p = 1/5, 2/5, 3/5, 4/5.
def test_wsd_linear_with_min_lr_factor():
    lrs = _lrs(10, warmup_steps=2, decay_ratio=0.4, decay_type="linear", min_lr_factor=0.1)
    # warmup 1/3, 2/3; stable 1 x4; linear 0.8, 0.6, 0.4, 0.2 -> 0.1 + 0.9 * shape
    expected = [1 / 3, 2 / 3, 1, 1, 1, 1, 0.82, 0.64, 0.46, 0.28]
    assert lrs == pytest.approx(expected, abs=1e-12)


def test_wsd_sqrt_and_cosine():
    sqrt = _lrs(10, warmup_steps=2, decay_ratio=0.4, decay_type="sqrt", min_lr_factor=0.0)
    # 1 - sqrt(0.2) = 1 - 0.4472136; 1 - sqrt(0.8) = 1 - 0.8944272
    assert sqrt[:6] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1])
    assert sqrt[6] == pytest.approx(0.5527864, abs=1e-7)
    assert sqrt[9] == pytest.approx(0.1055728, abs=1e-7)
    cosine = _lrs(10, warmup_steps=2, decay_ratio=0.4, decay_type="cosine", min_lr_factor=0.0)
    # cos(36 deg) = 0.8090170, cos(72 deg) = 0.3090170, cos(108 deg) = -0.3090170
    assert cosine[6] == pytest.approx(0.9045085, abs=1e-7)
    assert cosine[7] == pytest.approx(0.6545085, abs=1e-7)
    assert cosine[8] == pytest.approx(0.3454915, abs=1e-7)
    cosine_min = _lrs(10, warmup_steps=2, decay_ratio=0.4, decay_type="cosine", min_lr_factor=0.5)
    assert cosine_min[8] == pytest.approx(0.5 + 0.5 * 0.3454915, abs=1e-7)


def test_decay_ratio_none_decays_after_warmup():
    # steps=6, W=1 -> D=5, S=0: warmup 1/2, then p = 1/6 .. 5/6
    lrs = _lrs(6, warmup_steps=1, decay_ratio=None, decay_type="linear", min_lr_factor=0.0)
    assert lrs == pytest.approx([1 / 2, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6], abs=1e-12)
    # no warmup: D=4, p = 1/5 .. 4/5; a step past the end keeps the last factor (p = 1 -> m)
    lrs = _lrs(4, n=6, warmup_steps=0, decay_ratio=None, decay_type="linear", min_lr_factor=0.25)
    assert lrs == pytest.approx([0.85, 0.7, 0.55, 0.4, 0.25, 0.25], abs=1e-12)


def test_warmup_plus_decay_longer_than_training_shrinks_decay():
    # steps=10, W=5, ratio 0.8 -> D=8 would overflow; D becomes 5, p = 1/6 .. 5/6
    lrs = _lrs(10, warmup_steps=5, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0)
    assert lrs[4] == pytest.approx(5 / 6)
    assert lrs[5:] == pytest.approx([5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6], abs=1e-12)


def test_warmup_longer_than_training_is_an_error():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ConfigError, match=r"lr_scheduler\.warmup_steps"):
        build_lr_scheduler(opt, steps=5, warmup_steps=6)
    with pytest.raises(ConfigError, match=r"lr_scheduler\.decay_type"):
        build_lr_scheduler(opt, steps=5, warmup_steps=1, decay_type="exp")


def test_scheduler_state_round_trip():
    def build():
        p = torch.nn.Parameter(torch.ones(3))
        opt = build_optimizer([p], lr=1e-2, implementation="for-loop", device_type="cpu")
        sched = build_lr_scheduler(opt, steps=12, warmup_steps=3, decay_ratio=0.5, decay_type="cosine")
        return p, opt, sched

    def train(p, opt, sched, n):
        lrs = []
        for _ in range(n):
            p.grad = torch.full_like(p, 0.5)
            opt.step()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        return lrs

    p_ref, opt_ref, sched_ref = build()
    reference = train(p_ref, opt_ref, sched_ref, 9)

    p, opt, sched = build()
    first = train(p, opt, sched, 4)
    buffer = io.BytesIO()
    torch.save({"sched": sched.state_dict(), "opt": opt.state_dict(), "p": p.detach()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # the state is plain data

    p2, opt2, sched2 = build()
    with torch.no_grad():
        p2.copy_(saved["p"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert sched2.last_epoch == 4
    rest = train(p2, opt2, sched2, 5)
    assert first + rest == pytest.approx(reference, abs=0)
    torch.testing.assert_close(p2.detach(), p_ref.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("implementation", ["for-loop", "foreach", "fused"])
def test_optimizer_kinds_take_a_step(implementation):
    # One Adam step moves by lr * g / (|g| + eps) = lr * sign(g) (bias-corrected m/sqrt(v)).
    # AdamW: p * (1 - lr * wd) - lr = 1 * 0.99 - 0.1 = 0.89.
    # Adam (L2): gradient g + wd * p = 0.6 > 0, so p - lr = 0.9.
    for name, expected in [("AdamW", 0.89), ("Adam", 0.9)]:
        p = torch.nn.Parameter(torch.ones(4))
        opt = build_optimizer(
            [p], name=name, lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
            implementation=implementation, device_type="cpu",
        )
        assert isinstance(opt, torch.optim.AdamW if name == "AdamW" else torch.optim.Adam)
        group = opt.param_groups[0]
        assert group["fused"] == (implementation == "fused")
        assert group["foreach"] == (implementation == "foreach")
        p.grad = torch.full_like(p, 0.5)
        opt.step()
        torch.testing.assert_close(p.detach(), torch.full((4,), expected), rtol=0, atol=1e-6)


def test_unsupported_choices_raise_naming_the_key():
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ConfigError, match=r"optimizer\.implementation.*'fused'.*'meta'"):
        build_optimizer([p], lr=0.1, implementation="fused", device_type="meta")
    complex_param = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(ConfigError, match=r"optimizer\.implementation.*complex64"):
        build_optimizer([complex_param], lr=0.1, implementation="fused", device_type="cpu")
    with pytest.raises(ConfigError, match=r"optimizer\.implementation"):
        build_optimizer([p], lr=0.1, implementation="apex", device_type="cpu")
    with pytest.raises(ConfigError, match=r"optimizer\.name"):
        build_optimizer([p], name="SGD", lr=0.1, device_type="cpu")


def test_options_are_the_keywords_as_one_value():
    import dataclasses
    import inspect

    options = OptimizerOptions(lr=0.1, name="Adam", betas=(0.8, 0.9), eps=1e-6, weight_decay=0.0, implementation="for-loop")
    by_options = build_optimizer([torch.nn.Parameter(torch.ones(2))], options, device_type="cpu")
    by_keywords = build_optimizer(
        [torch.nn.Parameter(torch.ones(2))], name="Adam", lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.0,
        implementation="for-loop", device_type="cpu",
    )
    assert type(by_options) is type(by_keywords) is torch.optim.Adam
    strip = lambda group: {k: v for k, v in group.items() if k != "params"}  # noqa: E731
    assert strip(by_options.param_groups[0]) == strip(by_keywords.param_groups[0])
    defaults = inspect.signature(build_optimizer).parameters
    for field in dataclasses.fields(OptimizerOptions):
        if field.name != "lr":
            assert defaults[field.name].default == field.default, field.name
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match="not both"):
        build_optimizer([p], options, lr=0.2, device_type="cpu")
    with pytest.raises(TypeError, match="needs lr"):
        build_optimizer([p], device_type="cpu")
    with pytest.raises(ConfigError, match=r"optimizer\.name"):
        build_optimizer([p], OptimizerOptions(lr=0.1, name="SGD"), device_type="cpu")


def test_foreach_and_for_loop_agree_after_three_steps():
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    data = [(torch.randn(5, 8), torch.randn(5, 4)) for _ in range(3)]
    results = {}
    for implementation in ("for-loop", "foreach", "fused"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        model.load_state_dict(base.state_dict())
        opt = build_optimizer(
            model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
            implementation=implementation, device_type="cpu",
        )
        for x, y in data:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        results[implementation] = [t.detach().clone() for t in model.parameters()]
    for a, b, start in zip(results["for-loop"], results["foreach"], base.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert not torch.equal(a, start.detach())  # the parameters did move
    for a, b in zip(results["for-loop"], results["fused"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_norm", [0.05, 1e3])  # clipping every step / never
def test_fused_adamw_clipping_as_it_reads_equals_clipping_the_gradients_first(max_norm):
    """The step runner's path with fused AdamW (`grad_norm` + `clip_divisor` as the kernel's `grad_scale`)
    against torch's `clip_grad_norm_` followed by the same optimizer, over three steps."""
    from titan_parallel.grad_clip import clip_divisor, grad_norm

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    data = [(torch.randn(5, 8), torch.randn(5, 4)) for _ in range(3)]
    results, norms = {}, {}
    for path in ("in place", "in the kernel"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        model.load_state_dict(base.state_dict())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        norms[path] = []
        for x, y in data:
            torch.nn.functional.mse_loss(model(x), y).backward()
            if path == "in place":
                norms[path].append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            else:
                norm = grad_norm(model.parameters())
                norms[path].append(norm)
                opt.grad_scale = clip_divisor(norm, max_norm)
            opt.step()
            opt.__dict__.pop("grad_scale", None)
            opt.zero_grad()
        results[path] = [p.detach().clone() for p in model.parameters()]
    assert torch.equal(torch.stack(norms["in place"]), torch.stack(norms["in the kernel"]))
    if max_norm < 1:
        assert all(n > max_norm for n in norms["in place"])  # the clip did act
    for a, b, start in zip(results["in place"], results["in the kernel"], base.parameters()):
        if max_norm < 1:  # x * c against x / (1 / c): a rounding apart
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:  # a divisor of exactly 1
            assert torch.equal(a, b)
        assert not torch.equal(a, start.detach())


def test_clip_divisor_refuses_a_norm_that_clips_nothing():
    from titan_parallel.grad_clip import clip_divisor

    with pytest.raises(ValueError, match="max_norm > 0"):
        clip_divisor(torch.tensor(1.0), 0.0)


class _Count:
    """A JSON state (data position, train state) for the checkpoint manager."""

    def __init__(self):
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class _Run:
    """A one-block Llama, its optimizer and LR schedule, and their checkpoints, as the trainer builds them."""

    def __init__(self, folder, *, steps: int, name: str = "AdamW", **settings):
        torch.manual_seed(0)
        spec = get_model_spec("llama3")
        self.model = spec.build(dataclasses.replace(get_model_args("llama3", "debugmodel"), n_layers=1))
        self.opt = build_optimizer(self.model.named_parameters(), name=name, implementation="fused",
                                   device_type="cpu", plan=spec.plan, **{"lr": 1e-2, **settings})  # fmt: skip
        self.sched = build_lr_scheduler(self.opt, steps=steps, warmup_steps=2)
        self.count = _Count()
        self.ckpt = build_checkpointer(CheckpointOptions(folder=folder, interval=3), model_parts=[self.model],
                                       optimizers=[self.opt], lr_schedulers=[self.sched], dataloader=_Count(),
                                       train_state=self.count, device=torch.device("cpu"))  # fmt: skip

    def resume(self) -> list[str]:
        """Load step 3; what the config changed against the checkpoint (`RunCheckpointer`)."""
        assert self.ckpt.load() == 3
        return self.ckpt.settings_changed

    def train(self, n: int) -> list[float]:
        """`n` steps; the LR each step's update used."""
        used = []
        for _ in range(n):
            tokens = torch.randint(2048, (2, 17), generator=torch.Generator().manual_seed(self.count.value))
            loss = torch.nn.functional.cross_entropy(self.model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            self.opt.zero_grad()
            loss.backward()
            used.append(self.opt.param_groups[0]["lr"])
            self.opt.step()
            self.sched.step()
            self.count.value += 1
            self.ckpt.save(self.count.value)
        self.ckpt.wait()
        return used


def test_a_resume_with_the_same_config_changes_nothing(tmp_path, world_of_one, caplog):
    reference = _Run(tmp_path / "ref", steps=6)
    lrs = reference.train(6)
    run = _Run(tmp_path / "run", steps=6)
    run.train(3)
    resumed = _Run(tmp_path / "run", steps=6)
    with caplog.at_level("INFO", logger="titan"):
        assert resumed.resume() == []  # betas come back from the checkpoint as a list: not a change
    assert not [r for r in caplog.records if "resume:" in r.getMessage()]  # neither a setting nor the LR moved
    assert resumed.train(3) == lrs[3:]  # the same floats
    for a, b in zip(resumed.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_resume_takes_the_configs_lr_weight_decay_and_steps(tmp_path, world_of_one, caplog):
    _Run(tmp_path, steps=3, lr=1e-2, weight_decay=0.1).train(3)  # a finished run: its schedule decayed to 0
    extended = _Run(tmp_path, steps=6, lr=5e-3, weight_decay=0.0, betas=(0.8, 0.9))
    with caplog.at_level("INFO", logger="titan"):
        changed = extended.resume()
    said = [r.getMessage() for r in caplog.records if "optimizer settings apply" in r.getMessage()]
    assert said == ["resume: the config's optimizer settings apply, not the checkpoint's: " + "; ".join(changed)]
    # The 3-step schedule had decayed to 0 for step 4; the 6-step one gives it 5e-3 x 0.6 (below).
    said = [r.getMessage() for r in caplog.records if "next step's LR" in r.getMessage()]
    assert said == ["resume: the next step's LR follows the config's schedule, not the checkpoint's: 0 -> 0.003 (group 0)"]
    assert changed == ["betas (0.9, 0.95) -> (0.8, 0.9) (group 0)", "weight_decay 0.1 -> 0.0 (group 0)",
                       "lr 0.01 -> 0.005 (group 0)"]  # fmt: skip
    # A rollback to that checkpoint (training.on_nonfinite / on_loss_spike = "rollback") keeps the config's too.
    caplog.clear()
    with caplog.at_level("INFO", logger="titan"):
        assert extended.ckpt.restore_latest() == 3 and extended.ckpt.settings_changed == changed
    assert any(r.getMessage().startswith("rollback: the config's optimizer settings apply") for r in caplog.records)
    group = extended.opt.param_groups[0]
    assert (group["weight_decay"], tuple(group["betas"]), group["initial_lr"]) == (0.0, (0.8, 0.9), 5e-3)
    # Steps 4-6 of a 6-step schedule (W = 2, linear decay over D = 4) at the new peak: factor 1 - (s - 2) / 5
    # for s = 4, 5, 6 (titan_core.lr_schedule), not the old schedule's last LR (0) for step 4.
    assert extended.train(3) == pytest.approx([5e-3 * 0.6, 5e-3 * 0.4, 5e-3 * 0.2], rel=1e-12)
    assert extended.sched.get_last_lr() == pytest.approx([0.0], abs=1e-18)


def test_a_resume_under_muon_names_the_group_whose_setting_changed(tmp_path, world_of_one):
    _Run(tmp_path, steps=6, name="Muon").train(3)
    resumed = _Run(tmp_path, steps=6, name="Muon", muon=MuonOptions(adamw_lr=2e-3))
    assert resumed.resume() == ["lr 0.01 -> 0.002 (group 1)"]  # the AdamW group; Muon's (group 0) kept its lr
    muon_group, adamw_group = resumed.opt.param_groups
    # Step 4 of 6 (factor 1 - (4 - 2) / 5, as above) at each group's own peak.
    assert (muon_group["lr"], adamw_group["lr"]) == pytest.approx((1e-2 * 0.6, 2e-3 * 0.6), rel=1e-12)


# optimizer.weight_decay_exclude (titan_core.weight_decay): a one-block Llama's norms and its query projection
# (a Muon matrix under Muon) train without weight decay.
EXCLUDE = ("*norm*", "*.wq.*")
EXCLUDED = {"layers.0.attention_norm.weight", "layers.0.ffn_norm.weight", "norm.weight", "layers.0.attention.wq.weight"}


def _one_block():
    torch.manual_seed(0)
    spec = get_model_spec("llama3")
    return spec, spec.build(dataclasses.replace(get_model_args("llama3", "debugmodel"), n_layers=1))


@pytest.mark.parametrize(("name", "implementation"),
                         [("AdamW", "for-loop"), ("AdamW", "foreach"), ("AdamW", "fused"), ("Adam", "fused"), ("Muon", "fused"),
                          ("AdamW", "master"), ("Adam", "master")])  # fmt: skip
def test_excluded_parameters_take_no_weight_decay(name, implementation):
    # Zero gradients: AdamW's and Muon's updates are 0, so a step only decays, p * (1 - lr * wd) = 0.95 p;
    # Adam's L2 decay is its gradient wd * p, which moves p by lr * g / (|g| + eps). An excluded one stays put.
    # "master": the master-weight step (titan_parallel.MasterAdamW / MasterAdam) on the fp32 masters.
    from titan_parallel import ComputeCopies

    spec, model = _one_block()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    copies = ComputeCopies([model], torch.bfloat16) if implementation == "master" else None
    opt = build_optimizer(model.named_parameters(), name=name, lr=0.1, weight_decay=0.5, device_type="cpu",
                          implementation="fused" if copies else implementation, plan=spec.plan, copies=copies,
                          weight_decay_exclude=EXCLUDE)  # fmt: skip
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0] * (2 if name == "Muon" else 1)
    assert f"no weight decay for {len(EXCLUDED)} tensors" in opt.description
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        if n in EXCLUDED:
            torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0, msg=n)
        elif name == "Adam":
            g = 0.5 * before[n]
            torch.testing.assert_close(p.detach(), before[n] - 0.1 * g / (g.abs() + 1e-8), rtol=0, atol=1e-6, msg=n)
        else:
            torch.testing.assert_close(p.detach(), before[n] * 0.95, rtol=1e-6, atol=0, msg=n)


def test_weight_decay_exclude_needs_parameter_names():
    _, model = _one_block()
    with pytest.raises(ConfigError, match=r"optimizer\.weight_decay_exclude.*named_parameters"):
        build_optimizer(model.parameters(), lr=0.1, device_type="cpu", weight_decay_exclude=("*norm*",))


def test_a_resume_takes_the_configs_exclusions_and_keeps_every_parameters_state(tmp_path, world_of_one):
    """The groups hold what the config excludes now; each parameter's moments come back whichever group it is in."""
    reference = _Run(tmp_path / "ref", steps=6, weight_decay_exclude=EXCLUDE)
    reference.train(3)
    resumed = _Run(tmp_path / "ref", steps=6, weight_decay_exclude=("*norm*",))
    assert resumed.resume() == []  # each group's settings are the config's, as saved
    names = {p: n for n, p in resumed.model.named_parameters()}
    assert {names[p] for p in resumed.opt.param_groups[1]["params"]} == EXCLUDED - {"layers.0.attention.wq.weight"}
    saved = dict(zip([n for n, _ in reference.model.named_parameters()], reference.model.parameters(), strict=True))
    for p, n in names.items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(resumed.opt.state[p][key], reference.opt.state[saved[n]][key], rtol=0, atol=0)


def test_two_ranks_exclude_what_one_process_does_and_a_resume_keeps_the_number_of_groups(tmp_path):
    """`titan train`: FSDP over 2 ranks with activation checkpointing (wrapped parameter names) excludes the same
    parameters as one process and trains the same losses; its checkpoint resumes under other patterns, and a
    resume without any (one param group, not two) is one line naming the keys."""
    args = [*TINY, "--training.steps", "4", "--optimizer.weight_decay", "1.0",
            "--optimizer.weight_decay_exclude", "*norm*,tok_embeddings.*"]  # fmt: skip
    one = run_titan(tmp_path / "one", *args)
    two = run_titan(tmp_path / "two", *args, "--activation_checkpoint.mode", "full", "--checkpoint.enable", "true",
                    "--checkpoint.interval", "2", "--training.local_batch_size", "4", nproc=2)  # the same 8 sequences
    shape = get_model_args("llama3", "debugmodel")  # two norms per block, the final norm, the embeddings
    tensors, elements = 2 * shape.n_layers + 2, (2 * shape.n_layers + 1) * shape.dim + shape.vocab_size * shape.dim
    said = f"no weight decay for {tensors} tensors ({elements:,} elements) matching '*norm*', 'tok_embeddings.*'"
    assert said in one.stdout + one.stderr and said in two.stdout + two.stderr
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=2e-5)

    plain = run_titan(tmp_path / "two", *args[:-2], "--checkpoint.enable", "true", "--training.steps", "6", check=False)
    assert plain.returncode != 0
    line = plain.stderr.strip().splitlines()[-1]
    assert "optimizer.weight_decay_exclude = ['*norm*', 'tok_embeddings.*']" in line, plain.stderr[-3000:]
    assert "checkpoint.exclude_from_loading" in line and "Traceback" not in plain.stderr

    norms = run_titan(tmp_path / "two", *args[:-1], "*norm*", "--checkpoint.enable", "true", "--training.steps", "6")
    assert f"no weight decay for {tensors - 1} tensors" in norms.stdout + norms.stderr
    assert len(losses(tmp_path / "two")) == 6  # steps 1-4, then 5-6 resumed from step 4


def test_gradient_norms_of_large_cpu_tensors_are_exact_to_fp32():
    """torch's CPU L2 norm accumulates a whole tensor in one fp32 vector (pytorch/pytorch#169237): a 20M-element
    gradient's norm came out 1e-3 off on torch 2.11 and 2.15. Titan's norms (clipping, `optim/grad_norm`, the
    per-block norms) take it over chunks: within 1e-6 of the fp64 norm, in fp32 and from bf16 gradients."""
    from titan_parallel.grad_clip import clip_grad_norm_, grad_norm, grouped_norms

    torch.manual_seed(0)
    big = torch.randn(20_000_000) * 1e-3  # alone, so that no smaller tensor's norm hides its error
    for grad in (big, big.bfloat16()):
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad.clone()
        exact = grad.double().norm().item()
        assert grad_norm([param]).item() == pytest.approx(exact, rel=1e-6)
        assert grouped_norms([[grad]])[0].item() == pytest.approx(exact, rel=1e-6)
        assert clip_grad_norm_([param], max_norm=1.0).item() == pytest.approx(exact, rel=1e-6)
        assert param.grad.double().norm().item() == pytest.approx(1.0, rel=1e-2)  # clipped to 1 (bf16: 3 digits)


def test_total_steps_makes_a_short_run_follow_the_start_of_a_long_schedule(tmp_path):
    # lr_scheduler.total_steps 10, W = 2, decay_ratio 0.4 (D = 4, S = 4): the 6 steps of this run take the first 6
    # factors of test_wsd_linear_with_min_lr_factor's schedule, and never decay.
    run_titan(tmp_path, *TINY, "--training.steps", "6", "--optimizer.lr", "1e-3", "--lr_scheduler.total_steps", "10",
              "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0.4")  # fmt: skip
    lrs = [r["optim/lr"] for r in read_metrics(tmp_path) if "optim/lr" in r]
    assert lrs == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3, 1e-3, 1e-3], rel=1e-6)
    with pytest.raises(ConfigError) as caught:
        resolve(load_config(None, ["--lr_scheduler.total_steps", "5", "--lr_scheduler.warmup_steps", "6"]), 1)
    assert str(caught.value) == ("lr_scheduler.warmup_steps: 6 must be between 0 and lr_scheduler.total_steps (5); "
                                 "lower it, unset it, or raise lr_scheduler.total_steps")  # fmt: skip
