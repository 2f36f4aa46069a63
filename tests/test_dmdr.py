"""DMDR (flowrl/objectives/dmdr.py): the ReFL loss against hand-derived values; with the reward's weight at zero the
student's and the fake score's losses are DMD2's bit for bit (same draws), with it the student's gradient is DMD2's plus
the reward weight times ReFL's; with the DM weight at zero the student's loss is the ReFL loss alone; the separate
teacher runs as the teacher model's own pipeline; the warm-up schedule, the refusals, and two iterations of the preset."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CONFIGS, fast_overrides

from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.objectives.dmd2 import FAKE_SCORE, DMD2Config, flow_x0
from flowrl.objectives.dmdr import DMDRConfig, load_teacher, refl_loss
from flowrl.pipelines.common import LoraConfig
from flowrl.pipelines.digits import DigitsConfig
from flowrl.types import Trajectory

PRESET = CONFIGS / "digits" / "dmdr.yaml"
SETTINGS = {"fake_steps_per_student_step": 1, "fake_lr_scale": 1.0}  # the student steps on every minibatch


def test_refl_loss_hand_values():
    # two rows of two elements: x0 = [(1, 2), (0, -1)], g = [(0.5, -1), (2, 1)]
    # <g, x0> = (0.5 - 2, 0 - 1) = (-1.5, -1); loss = -mean = 1.25; d loss / d x0_i = -g_i / 2
    x0 = torch.tensor([[1.0, 2.0], [0.0, -1.0]]).view(2, 1, 1, 2).requires_grad_(True)
    g = torch.tensor([[0.5, -1.0], [2.0, 1.0]]).view(2, 1, 1, 2)
    loss = refl_loss(x0, g)
    assert loss.item() == pytest.approx(1.25)
    loss.backward()
    torch.testing.assert_close(x0.grad, -g / 2)


def test_refl_gradient_is_the_mean_rewards_gradient_at_the_sample():
    # with g the gradient of a differentiable reward r at x0, d refl / d x0 = -d mean(r) / d x0 (ReFL's loss)
    x0 = torch.randn(3, 1, 2, 2, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def reward(x):
        return (x.flatten(1) ** 2).sum(1) * torch.tensor([1.0, -2.0, 0.5])

    (g,) = torch.autograd.grad(reward(x0).sum(), x0)
    (want,) = torch.autograd.grad(-reward(x0).mean(), x0)
    refl_loss(x0, g).backward()
    torch.testing.assert_close(x0.grad, want)


def test_warmup_skips_the_students_first_turns_and_refusals():
    objective = DMDRConfig(fake_steps_per_student_step=2, fake_warmup_steps=2).build()
    turns = []
    for _ in range(8):
        objective.minibatches += 1
        turns.append(objective.student_turn())
    assert turns == [False, False, False, False, False, True, False, True]  # turns at 2 and 4 skipped
    with pytest.raises(FlowRLError, match=r"reward_weight and objective.dm_weight are both 0"):
        load_config(PRESET, ["objective.reward_weight=0", "objective.dm_weight=0"])
    with pytest.raises(FlowRLError, match=r"sampler.name must be 'ode'"):
        load_config(PRESET, ["sampler.name=flow_sde"])
    with pytest.raises(FlowRLError, match=r"needs the reward gradient"):
        objective.prepare(_trajectory(torch.zeros(1, 3, 1, 8, 8), {"prompt_embeds": torch.zeros(1, 1, 1)}, None))


def _trajectory(latents, cond, grads) -> Trajectory:
    n = len(latents)
    return Trajectory(
        latents=latents,
        sigmas=torch.tensor([1.0, 0.5, 0.0]),
        log_probs=torch.full((n, 2), float("nan")),
        stochastic=torch.zeros(2, dtype=torch.bool),
        cond=cond,
        prompts=["a 3"] * n,
        metadata=[{"digit": 3}] * n,
        group_ids=torch.arange(n),
        reward_grads=grads,
    )


@pytest.fixture(scope="module")
def adapted(one_thread):
    """The digits model with the student's LoRA and a fake-score adapter, both moved away from zero."""
    lora = LoraConfig(r=4, alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"])
    pipeline = DigitsConfig(pretrained="digits_flow", lora=lora).build("cpu")
    pipeline.add_role_adapter(FAKE_SCORE, lora)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in pipeline.trainable_parameters() + pipeline.adapter_parameters(FAKE_SCORE):
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return pipeline


@pytest.fixture(scope="module")
def batch(adapted):
    """The student's own 2-step ODE trajectories of 4 rows, and a reward gradient per final sample."""
    gen = torch.Generator().manual_seed(3)
    cond = adapted.encode(["a 3", "the digit seven", "an 8", "a 1"])
    xs, sigmas = [torch.randn(4, 1, 8, 8, generator=gen)], [1.0, 0.5, 0.0]
    with torch.no_grad():
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            xs.append(xs[-1] + (s_next - s) * adapted.predict(xs[-1], torch.full((4,), s), cond))
    return _trajectory(torch.stack(xs, 1), cond, torch.randn(4, 1, 8, 8, generator=gen))


def _run(objective, pipeline, batch, seed: int = 5) -> tuple[list, dict[str, torch.Tensor]]:
    """Every loss of one minibatch, backpropagated; the gradients of the student's and the fake score's adapters."""
    params = pipeline.trainable_parameters() + pipeline.adapter_parameters(FAKE_SCORE)
    for p in params:
        p.grad = None
    outputs = []
    for out in objective.losses(pipeline, None, objective.prepare(batch), torch.Generator().manual_seed(seed)):
        out.loss.backward()
        outputs.append(out)
    return outputs, {str(i): p.grad.clone() for i, p in enumerate(params) if p.grad is not None}


@pytest.mark.slow  # the module's digits pipeline loads in its setup
def test_zero_reward_weight_is_dmd2_bit_for_bit_and_the_reward_adds_reflx_gradient(adapted, batch):
    dmd2_outs, dmd2_grads = _run(DMD2Config(**SETTINGS).build(), adapted, batch)
    zero_outs, zero_grads = _run(DMDRConfig(**SETTINGS, reward_weight=0.0).build(), adapted, batch)
    assert [o.role for o in zero_outs] == [o.role for o in dmd2_outs] == ["policy", FAKE_SCORE]
    assert all(torch.equal(a.loss, b.loss) for a, b in zip(zero_outs, dmd2_outs))
    assert dmd2_grads.keys() == zero_grads.keys() and all(torch.equal(dmd2_grads[k], zero_grads[k]) for k in dmd2_grads)
    # with the reward: the DM loss's gradient is DMD2's unchanged (same draws), the rest is w * d refl / d theta
    w = 0.3
    outs, grads = _run(DMDRConfig(**SETTINGS, reward_weight=w).build(), adapted, batch)
    refl_outs, refl_grads = _run(DMDRConfig(**SETTINGS, reward_weight=w, dm_weight=0.0).build(), adapted, batch)
    assert outs[0].metrics["loss/dm"] == dmd2_outs[0].metrics["loss/dm"]
    torch.testing.assert_close(outs[0].loss, dmd2_outs[0].loss + w * outs[0].metrics["loss/refl"])
    student = [str(i) for i in range(len(adapted.trainable_parameters()))]
    for k in student:
        torch.testing.assert_close(grads[k], dmd2_grads[k] + refl_grads[k], rtol=1e-4, atol=1e-6)  # float sums
    assert any(refl_grads[k].abs().sum() > 0 for k in student)


@pytest.mark.slow
def test_zero_dm_weight_is_the_refl_loss_alone(adapted, batch):
    w = 0.7
    outs, _ = _run(DMDRConfig(**SETTINGS, reward_weight=w, dm_weight=0.0).build(), adapted, batch)
    # by hand: the same step draw as the objective (the generator's first draw), the student's x0 there, ReFL's loss
    k = torch.randint(0, 2, (4,), generator=torch.Generator().manual_seed(5))
    x_k, s_k = batch.latents[torch.arange(4), k], batch.sigmas[k]
    with torch.no_grad():
        x0 = flow_x0(x_k, s_k, adapted.predict(x_k, s_k, batch.cond))
    assert "loss/dm" not in outs[0].metrics  # no teacher or fake-score call
    torch.testing.assert_close(outs[0].loss, w * refl_loss(x0, batch.reward_grads), rtol=1e-6, atol=0)
    last = k == 1
    torch.testing.assert_close(x0[last], batch.latents[last, -1], rtol=0, atol=1e-5)  # last-step rows: x0 is the sample


@pytest.mark.slow
def test_a_separate_teacher_runs_as_its_own_pipeline(one_thread):
    student = DigitsConfig(pretrained="digits_flow_2step").build("cpu")  # the shipped student as the base
    base = DigitsConfig(pretrained="digits_flow").build("cpu")
    teacher = load_teacher(student, "digits_flow")
    assert not any(p.requires_grad for p in teacher.parameters())
    x, sigma = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(6)), torch.tensor([0.8, 0.3])
    cond = student.encode(["a 3", "an 8"])
    with torch.no_grad():
        want = base.predict(x, sigma, cond)
        with student.use_denoiser(teacher):
            got = student.predict(x, sigma, cond)
        own = student.predict(x, sigma, cond)
    assert torch.equal(got, want)  # bit for bit the teacher's own pipeline
    assert not torch.allclose(own, got, atol=1e-3)  # back to the student after the block
    with pytest.raises(FlowRLError, match=r"^objective.teacher 'digits_ddpm' predicts 'epsilon', but the student predicts 'flow'"):
        load_teacher(student, "digits_ddpm")


@pytest.mark.slow
def test_the_preset_trains_two_iterations_with_the_teacher_frozen(tmp_path, one_thread):
    from accelerate.state import AcceleratorState

    from flowrl.trainer import Trainer

    AcceleratorState._reset_state(True)
    extra = {"train.prompts_per_iteration": 2, "train.num_generations": 4, "train.batch_size": 2, "rollout.num_inference_steps": 2}
    overrides = fast_overrides(tmp_path / "run", **extra, **{"objective.fake_warmup_steps": 0, "log.trackers": "[]"})
    trainer = Trainer(load_config(PRESET, overrides))
    assert trainer.roles.names() == ["policy", FAKE_SCORE] and [f.name for f in trainer.roles.frozen] == ["teacher"]
    teacher = {n: p.detach().clone() for n, p in trainer.objective.teacher_model.named_parameters()}
    student = [p.detach().clone() for p in trainer.roles.policy.parameters]
    trainer.fit()
    assert all(torch.equal(v, p) for (n, v), p in zip(teacher.items(), trainer.objective.teacher_model.parameters()))
    assert any(not torch.equal(a, b.detach()) for a, b in zip(student, trainer.roles.policy.parameters))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "loss/refl" in row]
    assert [row["step"] for row in rows] == [1, 2]
    assert all({"loss/dm", "loss/refl", "loss/fake_score", "dmdr/last_step_rows"} <= set(row) for row in rows)


@pytest.mark.slow
def test_a_reward_without_a_gradient_is_refused_before_training(tmp_path, one_thread):
    from accelerate.state import AcceleratorState

    from flowrl.trainer import Trainer

    AcceleratorState._reset_state(True)
    overrides = fast_overrides(tmp_path / "run", **{"reward.components": "{digit_realism: 1.0}", "log.trackers": "[]"})
    with pytest.raises(FlowRLError, match=r"^reward 'digit_realism' is not differentiable; dmdr needs a reward gradient"):
        Trainer(load_config(PRESET, overrides)).fit()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained, nothing logged
