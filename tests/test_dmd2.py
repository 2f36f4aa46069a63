"""DMD2 (flowrl/objectives/dmd2.py): the distribution-matching gradient against hand-derived values, the fake score's
loss as flow matching on the student's samples through its own adapter, the teacher (adapters off) equal to the base
model bit for bit, the two-time-scale schedule, the refusals, and two iterations of the digits preset."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CONFIGS, fast_overrides
from safetensors.torch import load_file

from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.objectives.dmd2 import FAKE_SCORE, DMD2Config, dm_gradient, dm_loss, fake_score_loss, flow_x0, guided_velocity
from flowrl.pipelines.common import LoraConfig
from flowrl.pipelines.digits import DigitsConfig

PRESET = CONFIGS / "digits" / "dmd2.yaml"


def test_dm_gradient_and_loss_hand_values():
    # one sample of two elements: x0 = (0, 0), real = (1, -1), fake = (2, 1)
    # p_real = x0 - real = (-1, 1), mean|p_real| = 1; p_fake = (-2, -1); grad = (p_real - p_fake) / 1 = (1, 2)
    # loss = 0.5 * mean(grad^2) = 0.5 * (1 + 4) / 2 = 1.25; d loss / d x0 = grad / 2 = (0.5, 1) = (fake - real) / 1 / 2
    x0 = torch.zeros(1, 1, 1, 2, requires_grad=True)
    real, fake = torch.tensor([1.0, -1.0]).view(1, 1, 1, 2), torch.tensor([2.0, 1.0]).view(1, 1, 1, 2)
    grad = dm_gradient(x0, real, fake)
    assert grad.flatten().tolist() == [1.0, 2.0] and not grad.requires_grad
    loss = dm_loss(x0, grad)
    assert loss.item() == pytest.approx(1.25)
    loss.backward()
    assert x0.grad.flatten().tolist() == pytest.approx([0.5, 1.0])


def test_dm_loss_gradient_is_the_normalised_score_difference():
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 1, 4, 4, generator=gen, requires_grad=True)
    real, fake = torch.randn(3, 1, 4, 4, generator=gen), torch.randn(3, 1, 4, 4, generator=gen)
    dm_loss(x0, dm_gradient(x0, real, fake)).backward()
    normaliser = (x0.detach() - real).abs().mean(dim=(1, 2, 3), keepdim=True)  # per sample, as DMD2's mean(dim=[1, 2, 3])
    expected = (fake - real) / normaliser / x0.numel()
    torch.testing.assert_close(x0.grad, expected, rtol=1e-5, atol=1e-8)
    # a zero normaliser (the student's sample on the teacher's prediction): torch.nan_to_num as DMD2 applies it, 0/0 -> 0
    # and x/0 -> the largest float (then clipped by train.max_grad_norm), never NaN
    still = torch.zeros(1, 1, 1, 2)
    assert dm_gradient(still, still, torch.tensor([0.0, 1.0]).view(1, 1, 1, 2)).flatten().tolist() == [0.0, torch.finfo().max]


def test_flow_x0_inverts_the_forward_process():
    gen = torch.Generator().manual_seed(1)
    x0, eps = torch.randn(2, 1, 3, 3, generator=gen), torch.randn(2, 1, 3, 3, generator=gen)
    sigma = torch.tensor([0.3, 0.9])
    x_t = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * eps
    torch.testing.assert_close(flow_x0(x_t, sigma, eps - x0), x0)


@pytest.fixture(scope="module")
def pipelines(one_thread):
    """The digits model twice: plain (the base), and with the student's LoRA and a fake-score adapter, both moved
    away from zero so that neither equals the base."""
    lora = LoraConfig(r=4, alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"])
    base = DigitsConfig(pretrained="digits_flow").build("cpu")
    adapted = DigitsConfig(pretrained="digits_flow", lora=lora).build("cpu")
    adapted.add_role_adapter(FAKE_SCORE, lora)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in adapted.trainable_parameters() + adapted.adapter_parameters(FAKE_SCORE):
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return base, adapted


def _inputs(pipeline, n: int = 3):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, 1, 8, 8, generator=gen)
    return x, torch.tensor([0.9, 0.5, 0.1])[:n], pipeline.encode(["a 3", "the digit seven", "an 8"][:n])


@pytest.mark.slow  # the module's two digits pipelines load in its setup
@pytest.mark.parametrize("guidance", [1.0, 1.75])
def test_teacher_forward_with_adapters_off_equals_the_base_model_exactly(pipelines, guidance):
    base, adapted = pipelines
    x, sigma, cond = _inputs(base)
    with torch.no_grad():
        want = guided_velocity(base, x, sigma, cond, guidance)
        with adapted.reference():
            teacher = guided_velocity(adapted, x, sigma, cond, guidance)  # the DM loss's real score
        student = guided_velocity(adapted, x, sigma, cond, guidance)
    assert torch.equal(teacher, want)  # bit for bit: with the adapters off the LoRA layers return their base layer's output
    assert not torch.allclose(student, want, atol=1e-3)  # the adapters are back on after the block


@pytest.mark.slow
def test_guided_velocity_is_the_familys_cfg_with_a_noise_level_per_row(pipelines):
    base, _ = pipelines
    x, sigma, cond = _inputs(base)
    with torch.no_grad():
        rows = [base.predict(x[i : i + 1], sigma[i], {k: v[i : i + 1] for k, v in cond.items()}, 1.75) for i in range(len(x))]
        per_row = guided_velocity(base, x, sigma, cond, 1.75)
    torch.testing.assert_close(per_row, torch.cat(rows), rtol=0, atol=1e-5)  # batch-size rounding of the convolutions only


@pytest.mark.slow
def test_fake_score_loss_is_flow_matching_on_student_samples_through_its_adapter(pipelines):
    _, adapted = pipelines
    x0, sigma, cond = _inputs(adapted)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(4))
    for p in adapted.trainable_parameters() + adapted.adapter_parameters(FAKE_SCORE):
        p.grad = None
    loss = fake_score_loss(adapted, x0, noise, sigma, cond)
    s = sigma.view(-1, 1, 1, 1)
    x_t, target = (1 - s) * x0 + s * noise, noise - x0
    with torch.no_grad(), adapted.use_adapter(FAKE_SCORE):
        fake_v = adapted.predict(x_t, sigma, cond)
    with torch.no_grad():
        student_v = adapted.predict(x_t, sigma, cond)
    expected = (fake_v - target).pow(2).flatten(1).mean(1).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert loss.item() != pytest.approx((student_v - target).pow(2).mean().item(), rel=1e-3)  # the fake adapter, not the student's
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapted.adapter_parameters(FAKE_SCORE))
    assert all(p.grad is None for p in adapted.trainable_parameters())  # no gradient reaches the student


def test_config_refusals():
    with pytest.raises(
        FlowRLError, match=r"^dmd2 trains a few-step student on its own ODE steps, so sampler.name must be 'ode' \(is 'flow_sde'\)\.$"
    ):
        load_config(PRESET, ["sampler.name=flow_sde"])
    with pytest.raises(FlowRLError, match=r"two LoRA adapters on the teacher's base; set pipeline\.lora\.$"):
        load_config(PRESET, ["pipeline.lora=null"])
    with pytest.raises(FlowRLError, match=r"objective.min_sigma \(0.5\) must be below objective.max_sigma \(0.4\)"):
        load_config(PRESET, ["objective.min_sigma=0.5", "objective.max_sigma=0.4"])
    objective = DMD2Config(fake_steps_per_student_step=3).build()
    turns = []
    for _ in range(7):
        objective.minibatches += 1
        turns.append(objective.student_turn())
    assert turns == [False, False, True, False, False, True, False]  # the student steps on every 3rd minibatch


@pytest.mark.slow
def test_the_preset_trains_student_and_fake_score_two_iterations(tmp_path, one_thread):
    from accelerate.state import AcceleratorState

    from flowrl.trainer import Trainer

    AcceleratorState._reset_state(True)
    overrides = fast_overrides(
        tmp_path / "run",
        **{
            "train.prompts_per_iteration": 5,
            "train.num_generations": 2,
            "train.batch_size": 2,
            "rollout.num_inference_steps": 2,
            "log.checkpoint_every": 2,
            "log.trackers": "[]",
        },
    )
    trainer = Trainer(load_config(PRESET, overrides))
    assert trainer.roles.names() == ["policy", FAKE_SCORE] and [f.name for f in trainer.roles.frozen] == ["teacher"]
    student, fake = trainer.roles.policy, trainer.roles[FAKE_SCORE]
    base = {n: p.detach().clone() for n, p in trainer.pipeline.denoiser.named_parameters() if "lora_" not in n}
    before = {**{f"s{i}": p.detach().clone() for i, p in enumerate(student.parameters)}}
    before.update({f"f{i}": p.detach().clone() for i, p in enumerate(fake.parameters)})
    trainer.fit()
    after = {**{f"s{i}": p for i, p in enumerate(student.parameters)}, **{f"f{i}": p for i, p in enumerate(fake.parameters)}}
    moved = [k for k in before if not torch.equal(before[k], after[k].detach())]
    # the student's up-projections start at zero and get the DM gradient on its 2 steps; every fake-score tensor moves
    assert {k for k in before if k.startswith("f")} <= set(moved) and any(k.startswith("s") for k in moved)
    params = dict(trainer.pipeline.denoiser.named_parameters())
    assert all(torch.equal(v, params[n]) for n, v in base.items())  # the teacher (the base) never changes
    assert trainer.objective.minibatches == 10  # 2 iterations x 5 minibatches; the student stepped on the 5th and 10th
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "loss/fake_score" in row]  # the training rows (an evaluation writes its own)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert {"loss/dm", "loss/fake_score", "dmd2/grad_norm", "train/grad_norm", "train/grad_norm/fake_score"} <= set(row)
        assert all(torch.isfinite(torch.tensor(row[k])) for k in ("loss/dm", "loss/fake_score"))
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    weights = load_file(checkpoint / "denoiser.safetensors")
    assert any(k.startswith(f"{FAKE_SCORE}.") for k in weights) and any(not k.startswith(f"{FAKE_SCORE}.") for k in weights)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["roles"] == {"policy": "", FAKE_SCORE: f"{FAKE_SCORE}."}
