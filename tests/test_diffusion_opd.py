"""DiffusionOPD (flowrl/objectives/diffusion_opd.py): the per-step loss against torch.distributions' Gaussian KL, a
Monte-Carlo estimate and hand-derived values; each teacher equal to its checkpoint bit for bit; the routing of rows to
teachers; zero loss and zero gradient when the student is its teacher; the refusals; and the digits preset training."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CONFIGS, fast_overrides

from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.objectives.diffusion_opd import DiffusionOPDConfig, route, step_kl, teacher_model
from flowrl.pipelines.digits import DigitsConfig
from flowrl.training.checkpoint import load_checkpoint_weights, save_checkpoint

PRESET = CONFIGS / "digits" / "diffusion_opd.yaml"
EVEN, ODD = "[0, 2, 4, 6, 8]", "[1, 3, 5, 7, 9]"


def test_step_kl_is_the_gaussian_kl_of_the_two_steps():
    from torch.distributions import Normal, kl_divergence

    gen = torch.Generator().manual_seed(0)
    mu_s, mu_t = torch.randn(3, 1, 4, 4, generator=gen), torch.randn(3, 1, 4, 4, generator=gen)
    std = torch.tensor([0.3, 0.7, 1.2]).view(3, 1, 1, 1)  # one transition std per row, as a per-row time grid gives
    kl = step_kl(mu_s, mu_t, std)
    want = kl_divergence(Normal(mu_s, std.expand_as(mu_s)), Normal(mu_t, std.expand_as(mu_t))).flatten(1).mean(1)
    torch.testing.assert_close(kl, want, rtol=1e-6, atol=0)
    # Monte Carlo: E_{x ~ student}[log p_S(x) - log p_T(x)], 200k draws per element
    x = mu_s + std * torch.randn(200_000, *mu_s.shape, generator=gen)
    estimate = (Normal(mu_s, std).log_prob(x) - Normal(mu_t, std).log_prob(x)).mean(0).flatten(1).mean(1)
    torch.testing.assert_close(estimate, kl, rtol=0.02, atol=0.01)


def test_step_kl_hand_values_and_gradient():
    # one row, two elements: mu_S = (1, 0), mu_T = (0, 2), std 0.5: delta^2 / (2 std^2) = (1 / 0.5, 4 / 0.5) = (2, 8) -> 5;
    # d/d mu_S = delta / std^2 / 2 elements = (1 / 0.25 / 2, -2 / 0.25 / 2) = (2, -4); the ODE form (std 1): 0.5 (1 + 4) / 2
    mu_s = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2).requires_grad_(True)
    mu_t = torch.tensor([0.0, 2.0]).view(1, 1, 1, 2).requires_grad_(True)
    kl = step_kl(mu_s, mu_t, torch.tensor(0.5))
    assert kl.tolist() == [5.0]
    kl.sum().backward()
    assert mu_s.grad.flatten().tolist() == [2.0, -4.0] and mu_t.grad is None  # the teacher's mean is a constant
    assert step_kl(mu_s.detach(), mu_t.detach(), torch.tensor(1.0)).tolist() == [1.25]


def test_route_maps_each_row_to_its_teacher_and_refuses_an_unrouted_prompt():
    routes = {"0": "ink", "2": "ink", "1": "one"}
    assert route([{"digit": 2}, {"digit": 1}, {"digit": 0}], "digit", routes) == ["ink", "one", "ink"]
    with pytest.raises(FlowRLError, match=r"^diffusion_opd routes each prompt by its metadata 'digit', and no teacher takes the value 7;"):
        route([{"digit": 7}], "digit", routes)
    with pytest.raises(ValueError, match="route one value to two teachers"):
        DiffusionOPDConfig(teachers=[{"name": "a", "checkpoint": "x", "route": [1]}, {"name": "b", "checkpoint": "y", "route": ["1"]}])
    with pytest.raises(ValueError, match="names must be unique"):
        DiffusionOPDConfig(teachers=[{"name": "a", "checkpoint": "x", "route": [1]}, {"name": "a", "checkpoint": "y", "route": [2]}])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, one_thread):
    """Two teacher checkpoints of the digits model in flowrl's format: the base model itself, and the base moved."""
    root = tmp_path_factory.mktemp("opd_teachers")
    base = DigitsConfig(pretrained="digits_flow").build("cpu")
    weights = base.trainable_state_dict()
    gen = torch.Generator().manual_seed(5)
    moved = {k: v + 0.02 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v for k, v in weights.items()}
    state = {"step": 0, "roles": {"policy": ""}}
    return {
        "same": save_checkpoint(root / "same" / "step_000000", weights, {"state": {}, "param_groups": []}, state, ""),
        "moved": save_checkpoint(root / "moved" / "step_000000", moved, {"state": {}, "param_groups": []}, state, ""),
    }


def _trainer(tmp_path, teachers: str, **extra):
    from accelerate.state import AcceleratorState

    from flowrl.trainer import Trainer

    AcceleratorState._reset_state(True)
    overrides = fast_overrides(
        tmp_path / "run", **{"log.trackers": "[]", "train.prompts_per_iteration": 4, "train.num_generations": 2, **extra}
    )
    return Trainer(load_config(PRESET, [*overrides, f"objective.teachers={teachers}"]))


def _two(checkpoints) -> str:
    return f"[{{name: ink, checkpoint: {checkpoints['moved']}, route: {EVEN}}}, {{name: one, checkpoint: {checkpoints['same']}, route: {ODD}}}]"


@pytest.mark.slow
def test_a_teacher_is_its_checkpoint_bit_for_bit_and_the_policy_comes_back(tmp_path, checkpoints):
    trainer = _trainer(tmp_path, _two(checkpoints))
    assert [r.name for r in trainer.roles.frozen] == ["teacher_ink", "teacher_one"]
    reference = DigitsConfig(pretrained="digits_flow").build("cpu")
    load_checkpoint_weights(reference, checkpoints["moved"])
    pipeline = trainer.pipeline
    x = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(6))
    cond = pipeline.encode(["a 3", "the digit seven", "an 8"])
    with torch.no_grad():
        want = reference.predict(x, torch.tensor(0.6), cond)
        with teacher_model(pipeline, trainer.objective.teacher_ink):
            got = pipeline.predict(x, torch.tensor(0.6), cond)
        student = pipeline.predict(x, torch.tensor(0.6), cond)
    assert torch.equal(got, want)
    assert pipeline.denoiser is trainer.roles.policy.module and not torch.allclose(student, want, atol=1e-3)
    assert not any(p.requires_grad for p in trainer.objective.teacher_ink.parameters())


@pytest.mark.slow
def test_rows_go_to_their_teachers_and_the_student_as_its_teacher_costs_nothing(tmp_path, checkpoints):
    trainer = _trainer(tmp_path, _two(checkpoints))
    batch = trainer.score(trainer.collect(0))
    digits = torch.tensor([int(m["digit"]) for m in batch.metadata])
    even, odd = digits % 2 == 0, digits % 2 == 1
    assert even.any() and odd.any()
    objective, pipeline, sampler = trainer.objective, trainer.pipeline, trainer.sampler
    rows = {"ink": torch.nonzero(even).flatten(), "one": torch.nonzero(odd).flatten()}
    k = 1
    means = objective.teacher_means(pipeline, sampler, batch, k, rows)
    x, x_next, s, s_next = batch.latents[:, k], batch.latents[:, k + 1], batch.sigmas[k], batch.sigmas[k + 1]
    with torch.no_grad():  # each row alone through its own teacher
        for i in range(len(batch)):
            module = objective.teacher_ink if even[i] else objective.teacher_one
            with teacher_model(pipeline, module):
                v = pipeline.predict(x[i : i + 1], s, {c: t[i : i + 1] for c, t in batch.cond.items()})
            want = sampler.step(v, x[i : i + 1], s, s_next, x_next=x_next[i : i + 1]).mean
            torch.testing.assert_close(means[i : i + 1], want, rtol=0, atol=1e-5)  # batch-size rounding of the convolutions only
    losses = list(objective.losses(pipeline, sampler, batch, torch.Generator().manual_seed(0)))
    assert len(losses) == batch.num_steps
    for out in losses:
        assert out.metrics["opd/kl_ink"] > 1e-4 and out.metrics["opd/kl_one"] < 1e-8  # the odd rows' teacher is the student


@pytest.mark.slow
def test_zero_loss_and_zero_gradient_when_the_student_is_its_teacher(tmp_path, checkpoints):
    teachers = f"[{{name: base, checkpoint: {checkpoints['same']}, route: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}}]"
    trainer = _trainer(tmp_path, teachers)
    batch = trainer.score(trainer.collect(0))
    params = trainer.roles.policy.parameters
    for out in trainer.objective.losses(trainer.pipeline, trainer.sampler, batch, torch.Generator().manual_seed(0)):
        assert out.loss.item() == 0.0
        out.loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in params)


@pytest.mark.slow
def test_the_preset_distils_and_the_kl_falls_on_a_fixed_batch(tmp_path, checkpoints):
    trainer = _trainer(tmp_path, _two(checkpoints), **{"train.learning_rate": 1e-4, "train.batch_size": 8})
    teacher = {n: p.detach().clone() for n, p in trainer.objective.teacher_ink.named_parameters()}
    batch = trainer.score(trainer.collect(0))

    def kl() -> float:
        with torch.no_grad():
            return sum(o.loss.item() for o in trainer.objective.losses(trainer.pipeline, trainer.sampler, batch, torch.Generator()))

    before = kl()
    metrics = trainer.update(trainer.advantages(batch), 0)
    assert kl() < 0.9 * before and metrics["loss/opd_kl"] == pytest.approx(before, rel=1e-5)
    assert all(torch.equal(p, teacher[n]) for n, p in trainer.objective.teacher_ink.named_parameters())  # frozen
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss/opd_kl" in r]
    assert len(rows) == 2 and all({"opd/kl_ink", "opd/kl_one", "opd/kl_step_0"} <= set(r) for r in rows)


def test_refusals(tmp_path):
    with pytest.raises(FlowRLError, match=r"teacher checkpoint '.*nowhere' does not exist \(train the teachers first\)\.$"):
        _trainer(tmp_path, f"[{{name: a, checkpoint: {tmp_path / 'nowhere'}, route: [1]}}]")
    with pytest.raises(FlowRLError, match=r"objective.teachers is empty: diffusion_opd distils task teachers, so name one at least"):
        load_config(PRESET, ["objective.teachers=[]"])


@pytest.mark.slow
def test_the_ode_form_is_half_the_squared_difference_of_the_euler_steps(tmp_path, checkpoints):
    teachers = f"[{{name: moved, checkpoint: {checkpoints['moved']}, route: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}}]"
    trainer = _trainer(tmp_path, teachers, sampler="{name: ode}")
    batch = trainer.score(trainer.collect(0))
    assert not batch.stochastic.any()
    pipeline, steps = trainer.pipeline, batch.num_steps
    losses = list(trainer.objective.losses(pipeline, trainer.sampler, batch, torch.Generator()))
    for k, out in enumerate(losses):
        x, s, dt = batch.latents[:, k], batch.sigmas[k], batch.sigmas[k + 1] - batch.sigmas[k]
        with torch.no_grad():
            v_student = pipeline.predict(x, s, batch.cond)
            with teacher_model(pipeline, trainer.objective.teacher_moved):
                v_teacher = pipeline.predict(x, s, batch.cond)
        want = (0.5 * (dt * (v_student - v_teacher)) ** 2).flatten(1).mean(1).mean() / steps  # Euler means x + dt v
        assert out.loss.item() == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.slow
def test_a_lora_teacher_is_its_lora_checkpoint(tmp_path):
    """A LoRA student's teachers are LoRA checkpoints of the same settings: the copy holds the teacher's adapter."""
    from flowrl.pipelines.common import LoraConfig

    lora = LoraConfig(r=4, alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    teacher = DigitsConfig(pretrained="digits_flow", lora=lora).build("cpu")
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in teacher.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    state = {"step": 0, "roles": {"policy": ""}}
    ckpt = save_checkpoint(tmp_path / "t" / "step_000000", teacher.trainable_state_dict(), {"state": {}, "param_groups": []}, state, "")
    teachers = f"[{{name: t, checkpoint: {ckpt}, route: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]}}]"
    trainer = _trainer(tmp_path, teachers, **{"pipeline.lora": "{r: 4, alpha: 8, target_modules: [to_q, to_k, to_v, to_out.0]}"})
    x = torch.randn(2, 1, 8, 8, generator=gen)
    cond = trainer.pipeline.encode(["a 3", "an 8"])
    with torch.no_grad():
        want = teacher.predict(x, torch.tensor(0.4), cond)
        with teacher_model(trainer.pipeline, trainer.objective.teacher_t):
            got = trainer.pipeline.predict(x, torch.tensor(0.4), cond)
        student = trainer.pipeline.predict(x, torch.tensor(0.4), cond)
    assert torch.equal(got, want) and not torch.allclose(student, want, atol=1e-4)
