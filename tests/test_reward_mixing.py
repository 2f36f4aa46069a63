"""Reward ensembles (WCO / UWO) and per-reward advantage aggregation against hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.config import RewardConfig
from flowrl.errors import FlowRLError
from flowrl.objectives.functional import group_advantages
from flowrl.objectives.grpo import GroupAdvantages
from flowrl.reward_models import build_reward_from_config
from flowrl.reward_models.combine import RewardEnsemble
from flowrl.types import RewardOutput, Trajectory


class Fixed:
    """A reward whose scores are given (a test input, not the thing under test)."""

    differentiable = False

    def __init__(self, scores, name="fixed"):
        self.scores, self.name = torch.tensor(scores), name

    def __call__(self, samples, prompts, metadata):
        return RewardOutput(self.scores.clone())


MEMBERS = [Fixed([1.0, 4.0]), Fixed([3.0, 4.0]), Fixed([2.0, float("nan")])]


def test_ensemble_modes_hand_values():
    x = torch.zeros(2, 1, 8, 8)
    # Sample 0: members 1, 3, 2 -> mean 2, population variance ((1+1+0)/3) = 2/3, min 1.
    wco = RewardEnsemble(MEMBERS, "wco", 1.0, "variance")(x, ["", ""], [{}, {}])
    assert wco.scores[0].item() == 1.0 and math.isnan(wco.scores[1].item())  # a NaN member -> NaN
    uwo = RewardEnsemble(MEMBERS, "uwo", coefficient=0.5, uncertainty="variance")(x, ["", ""], [{}, {}])
    assert uwo.scores[0].item() == pytest.approx(2.0 - 0.5 * 2 / 3)
    uwo_std = RewardEnsemble(MEMBERS, "uwo", coefficient=0.5, uncertainty="std")(x, ["", ""], [{}, {}])
    assert uwo_std.scores[0].item() == pytest.approx(2.0 - 0.5 * math.sqrt(2 / 3))
    mean = RewardEnsemble(MEMBERS[:2], "mean", 1.0, "variance")(x, ["", ""], [{}, {}])
    assert mean.scores.tolist() == [2.0, 4.0] and mean.extras["std"].tolist() == [1.0, 0.0]
    with pytest.raises(FlowRLError, match="at least two"):
        RewardEnsemble(MEMBERS[:1], "mean", 1.0, "variance")


def test_ensemble_from_config_uses_real_rewards():
    # Two real rewards as members: ink (mean intensity) and a second ink -> identical, so UWO == mean == ink.
    config = RewardConfig(
        components={"ink_ens": 1.0}, ensembles={"ink_ens": {"members": [{"name": "ink"}, {"name": "ink"}], "mode": "uwo"}}
    )
    reward = build_reward_from_config(config)
    x = torch.rand(3, 1, 8, 8)
    assert torch.allclose(reward(x, [""] * 3, [{}] * 3).scores, x.mean(dim=(1, 2, 3)))
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        RewardConfig(components={"e": 1.0}, ensembles={"e": {"members": [{"name": "ink"}, {"name": "nope"}]}})


def test_per_reward_advantages_normalise_each_component():
    # Two groups of two; component a has a huge scale, b a small one.
    a = torch.tensor([100.0, 300.0, 0.0, 0.0])
    b = torch.tensor([1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    batch = Trajectory(
        latents=torch.zeros(4, 2, 1),
        sigmas=torch.tensor([1.0, 0.0]),
        log_probs=torch.zeros(4, 1),
        stochastic=torch.ones(1, dtype=torch.bool),
        cond={},
        prompts=[""] * 4,
        metadata=[{}] * 4,
        group_ids=groups,
        rewards=0.01 * a + 1.0 * b,
        reward_components={"a": a, "b": b},
    )
    est = GroupAdvantages("unbiased", 1e-8, {"a": 0.01, "b": 1.0})
    # Each group of 2 normalises to -+1/sqrt(2) (unbiased std of two values d apart is d/sqrt(2)).
    s = 1 / math.sqrt(2)
    expected = 0.01 * torch.tensor([-s, s, 0.0, 0.0]) + torch.tensor([s, -s, -s, s])
    assert torch.allclose(est(batch), expected, atol=1e-6)
    # Summing first would let a's scale dominate group 0 (sign of sample 0's advantage flips).
    assert group_advantages(batch.rewards, groups)[0] < 0 < est(batch)[0]
