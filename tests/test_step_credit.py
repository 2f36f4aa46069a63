"""Flash-GRPO, TreeGRPO and stepwise GRPO (#40): their advantages and losses on hand-derived numbers, their rollout
layouts on the embedded digits flow model (one shared SDE step per group; exactly shared tree prefixes; x0
estimates read back without a denoiser call), ratio 1 at the first update, and each preset training."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.config import load_config
from flowrl.objectives.flash_grpo import rectification_scale, rectification_weights, trained_step
from flowrl.objectives.step_credit import weighted_step_loss
from flowrl.objectives.stepwise_grpo import step_credits, stepwise_advantages
from flowrl.samplers.flash_sde import FlashSDESampler
from flowrl.samplers.flow_sde import FlowSDESampler
from flowrl.samplers.step_credit import X0_REWARD, candidate_steps, x0_estimates
from flowrl.trainer import Trainer
from tests.conftest import CONFIGS, fast_overrides

pytestmark = pytest.mark.usefixtures("one_thread")

FLASH, TREE, STEPWISE = (CONFIGS / "digits" / f"{n}.yaml" for n in ("flash_grpo", "tree_grpo", "stepwise_grpo"))
TREE_FAST = {"objective.branch_steps": "[0,2]"}  # 4 steps, 2 x 2 = 4 leaves per tree


def trainer_for(config, tmp_path, **extra) -> Trainer:
    return Trainer(load_config(config, fast_overrides(tmp_path, **extra)))


def scored(trainer: Trainer, rewards: torch.Tensor | None = None):
    batch = trainer.collect(0)
    out = trainer.modality.collector.score(batch, trainer.reward)[0]
    batch.rewards = out.scores.float() if rewards is None else rewards
    batch.reward_components = dict(out.extras)
    return batch


def first_update_ratios(trainer: Trainer, batch) -> list[float]:
    batch = trainer.objective.prepare(batch)
    losses = list(trainer.objective.losses(trainer.pipeline, trainer.sampler, batch, torch.Generator().manual_seed(0)))
    return [float(v) for loss in losses for k, v in loss.metrics.items() if k.startswith("policy/ratio_mean/step_")]


# -- Flash-GRPO -----------------------------------------------------------------------------------------------


def test_flash_noise_and_rectification_scale_by_hand():
    sampler = FlashSDESampler(noise_floor=0.1, noise_ceiling=0.9, reduction="mean")
    assert float(sampler.diffusion_coefficient(torch.tensor(0.5))) == pytest.approx(0.1 + 0.8 * 0.5)
    # floor 0, ceiling 1: g(0.8) = 0.8, dt = -0.1; the released code's coe = 1 / (sqrt|dt| / g + g sqrt|dt| (1 - s) / (2 s))
    flash = FlashSDESampler(noise_floor=0.0, noise_ceiling=1.0, reduction="mean")
    x = torch.randn(1, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    released = 1 / (math.sqrt(0.1) / 0.8 + 0.8 * math.sqrt(0.1) * 0.2 / 1.6)  # 1 / (0.395285 + 0.031623) = 2.342428
    assert float(rectification_scale(flash, x, torch.tensor(0.8), torch.tensor(0.7))) == pytest.approx(released, rel=1e-5)
    assert released == pytest.approx(2.342428, rel=1e-6)
    # Flow-GRPO's g = a sqrt(s / (1 - s)) at a = 0.7, s = 0.5: g = 0.7, dt = -0.25 -> 1 / (0.5 / 0.7 + 0.7 * 0.5 * 0.5 / 1.0)
    flow = FlowSDESampler(noise_level=0.7, diffusion="flow_grpo", reduction="mean")
    expected = 1 / (0.5 / 0.7 + 0.7 * 0.5 * 0.5)
    assert float(rectification_scale(flow, x, torch.tensor(0.5), torch.tensor(0.25))) == pytest.approx(expected, rel=1e-5)


def test_flash_weights_and_loss_by_hand():
    weights = rectification_weights(torch.tensor([2.0, 1.0, 1.0, 9.0]), torch.tensor([True, True, True, False]))
    assert torch.allclose(weights, torch.tensor([1.5, 0.75, 0.75, 0.0]))  # c / mean(2, 1, 1); the dropped row 0
    adv = torch.tensor([1.0, -1.0, 2.0, 5.0])
    same = torch.zeros(4)
    out = weighted_step_loss(same, same, adv, weights, 1e-3, 3.0, 0)  # ratio 1: sum w (-A) / 3
    assert float(out.loss) == pytest.approx((-1.5 + 0.75 - 1.5) / 3)
    assert float(out.metrics["loss/policy"]) == pytest.approx((-1 + 1 - 2) / 3)  # unweighted, counted rows
    # ratio e^0.1 = 1.105 > 1 + eps: A > 0 takes the clipped -A (1 + eps), A < 0 the unclipped -A r
    r = math.exp(0.1)
    out = weighted_step_loss(torch.full((4,), 0.1), same, adv, weights, 1e-3, 3.0, 0)
    assert float(out.loss) == pytest.approx((-1.5 * 1.001 + 0.75 * r - 0.75 * 2 * 1.001) / 3, rel=1e-6)
    assert float(out.metrics["policy/clipfrac"]) == 1.0


def test_flash_candidates_are_the_noise_end():
    assert candidate_steps(torch.ones(20, dtype=torch.bool), 0.5) == list(range(10))  # the released first 10 of 20
    assert candidate_steps(torch.ones(4, dtype=torch.bool), 0.1) == [0]


def test_flash_rollout_one_shared_step_per_group_and_ratio_one(tmp_path):
    trainer = trainer_for(FLASH, tmp_path, **{"train.prompts_per_iteration": 4, "objective.step_fraction": 1.0})
    batch = scored(trainer)
    steps = trained_step(batch)
    assert (torch.isfinite(batch.log_probs).sum(1) == 1).all()  # one SDE step per trajectory
    for g in batch.group_ids.unique():
        assert steps[batch.group_ids == g].unique().numel() == 1  # iso-temporal: the group shares it
    # the ODE before the step: a group's members, which start from their own noise, follow the Euler step exactly
    row, k = 0, int(steps[0])
    x = batch.latents[:1, 0]
    for j in range(k):
        v = trainer.pipeline.predict(x, batch.sigmas[j], {n: c[:1] for n, c in batch.cond.items()})
        x = x + (batch.sigmas[j + 1] - batch.sigmas[j]) * v
    assert torch.allclose(x, batch.latents[row : row + 1, k], atol=1e-5)
    ratios = first_update_ratios(trainer, batch)
    assert ratios and all(abs(r - 1) < 1e-5 for r in ratios)


# -- TreeGRPO -------------------------------------------------------------------------------------------------


def test_tree_rollout_shares_prefixes_and_advantages_propagate_up(tmp_path):
    trainer = trainer_for(TREE, tmp_path, **TREE_FAST)
    batch = scored(trainer, torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 1.0, 1.0]))
    assert batch.stochastic.tolist() == [True, False, True, False]
    lat = batch.latents
    for g0 in (0, 4):  # leaves g0..g0+3: one root, {0, 1} and {2, 3} share steps 1-2, every leaf its own after step 2
        assert torch.equal(lat[g0, 0], lat[g0 + 3, 0])
        assert torch.equal(lat[g0, 1:3], lat[g0 + 1, 1:3]) and torch.equal(lat[g0 + 2, 1:3], lat[g0 + 3, 1:3])
        assert not torch.equal(lat[g0, 1], lat[g0 + 2, 1]) and not torch.equal(lat[g0, 3], lat[g0 + 1, 3])
    adv = trainer.objective.prepare(batch).advantages
    # group 0: mean 3, biased std sqrt(3.5); leaf advantages (-2, -1, 0, 3) / (sqrt(3.5) + 1e-4)
    s = math.sqrt(3.5) + 1e-4
    assert torch.allclose(adv[:4, 0], torch.tensor([-1.5, -1.5, 1.5, 1.5]) / s, atol=1e-6)  # the subtree means at step 0
    assert torch.allclose(adv[:4, 2], torch.tensor([-2.0, -1.0, 0.0, 3.0]) / s, atol=1e-6)  # each leaf's own edge
    assert torch.isnan(adv[:, 1]).all() and torch.isnan(adv[:, 3]).all()  # no credit on ODE steps
    # group 1: rewards (0, 0, 1, 1): mean 0.5, std 0.5; step 0: (-0.5, -0.5, 0.5, 0.5) / 0.5001
    assert torch.allclose(adv[4:, 0], torch.tensor([-0.5, -0.5, 0.5, 0.5]) / 0.5001, atol=1e-6)
    # minus_parent centres each edge among its siblings: step 2 of group 0: leaf - its pair's mean
    trainer.objective.edge_advantage = "minus_parent"
    centred = trainer.objective.prepare(batch).advantages
    assert torch.allclose(centred[:4, 2], torch.tensor([-0.5, 0.5, -1.5, 1.5]) / s, atol=1e-6)
    assert torch.allclose(centred[:4, 0], adv[:4, 0], atol=1e-6)  # the root's mean is 0
    trainer.objective.edge_advantage = "subtree_mean"
    ratios = first_update_ratios(trainer, batch)
    assert len(ratios) == 2 and all(abs(r - 1) < 1e-5 for r in ratios)


def test_tree_refuses_a_group_that_is_not_its_leaves(tmp_path):
    with pytest.raises(Exception, match=r"must be the tree's leaves, objective.branch_factor \*\* len\(objective.branch_steps\) = 8"):
        load_config(TREE, fast_overrides(tmp_path, **{"objective.branch_steps": "[0,1,2]", "train.num_generations": 4}))


# -- stepwise GRPO --------------------------------------------------------------------------------------------


def test_stepwise_credits_and_advantages_by_hand():
    rewards = torch.tensor([[0.0, 0.5, 0.6, 1.0], [0.2, 0.1, 0.4, 0.4]])  # R(x0_hat_0..2), R(x_3)
    assert torch.allclose(step_credits(rewards, "step_gain"), torch.tensor([[0.5, 0.1, 0.4], [-0.1, 0.3, 0.0]]))
    assert torch.allclose(step_credits(rewards, "to_go"), torch.tensor([[1.0, 0.5, 0.4], [0.2, 0.3, 0.0]]))
    credits = torch.tensor([[0.5, 0.1, 0.4], [-0.1, 0.3, 0.0], [0.2, 0.2, 0.2], [9.0, 9.0, 9.0]])
    valid = torch.tensor([True, True, True, False])
    adv = stepwise_advantages(credits, valid, torch.tensor([0, 0, 0, 0]), [0, 2], "biased", 1e-4)
    # step 0: (0.5, -0.1, 0.2): mean 0.2, biased std sqrt(0.06); step 1 not trained; row 3 dropped
    s = math.sqrt(0.06) + 1e-4
    assert torch.allclose(adv[:, 0], torch.tensor([0.3 / s, -0.3 / s, 0.0, 0.0]), atol=1e-5)
    assert torch.equal(adv[:, 1], torch.zeros(4))
    s2 = math.sqrt(((0.4 - 0.2) ** 2 + 0.2**2) / 3) + 1e-4
    assert torch.allclose(adv[:, 2], torch.tensor([0.2 / s2, -0.2 / s2, 0.0, 0.0]), atol=1e-5)


def test_stepwise_x0_estimates_are_the_rollouts_own_and_ratio_one(tmp_path):
    trainer = trainer_for(STEPWISE, tmp_path, **{"rollout.sde_window_size": 3, "rollout.sde_window_start": 1})
    batch = scored(trainer)
    x0 = x0_estimates(trainer.sampler, batch)
    for k in range(4):  # x - sigma v with v the denoiser's, stochastic (1-3) and ODE (0) steps alike
        v = trainer.pipeline.predict(batch.latents[:, k], batch.sigmas[k], batch.cond)
        assert torch.allclose(x0[:, k], batch.latents[:, k] - batch.sigmas[k] * v, atol=2e-4), k
    for k in range(4):  # the score phase rewarded each estimate with the run's reward
        direct = trainer.reward(trainer.pipeline.decode(x0[:, k]), batch.prompts, batch.metadata).scores
        assert torch.allclose(batch.reward_components[X0_REWARD.format(k)], direct.float(), atol=1e-5)
    ratios = first_update_ratios(trainer, batch)
    assert ratios and all(abs(r - 1) < 1e-5 for r in ratios)
    assert torch.equal(batch.advantages[:, 0], torch.zeros(len(batch)))  # the ODE step gets no credit


# -- the presets train --------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, extra", [(FLASH, {}), (TREE, TREE_FAST), (STEPWISE, {})], ids=["flash", "tree", "stepwise"])
def test_preset_trains_two_iterations(tmp_path, config, extra):
    from tests.tiny_components import two_iterations_change_every_parameter

    trainer = two_iterations_change_every_parameter(fast_overrides(tmp_path, **extra), config=config)
    assert trainer.objective.name == config.stem
