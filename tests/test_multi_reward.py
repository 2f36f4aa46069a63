"""The multi_reward option of the group-based objectives (objectives/advantages.py): GDPO's advantages against
hand-computed values (with groups whose reward is constant), per_reward_advantages as an alias of per_reward, and the
option on every group-based objective."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flowrl.errors import FlowRLError
from flowrl.objectives import OBJECTIVES
from flowrl.objectives.advantages import GroupAdvantages, batch_normalised
from flowrl.objectives.functional import group_advantages
from flowrl.objectives.grpo import GRPOConfig
from flowrl.sections import BuildContext

WEIGHTS = {"ink": 1.0, "hard": 2.0}
CONTEXT = BuildContext(reward_weights=WEIGHTS, sampler=None, pipeline=None)


def batch(ink, hard, groups):
    ink, hard = torch.tensor(ink), torch.tensor(hard)
    return SimpleNamespace(
        rewards=ink + 2 * hard, reward_components={"ink": ink, "hard": hard}, group_ids=torch.tensor(groups), advantages=None
    )


# Three groups of three. Group 0: ink varies, hard is constant. Group 1: both vary. Group 2: both constant.
THREE_GROUPS = batch(
    ink=[0.2, 0.4, 0.6, 0.3, 0.3, 0.6, 0.5, 0.5, 0.5],
    hard=[0.5, 0.5, 0.5, 0.0, 0.1, 0.2, 0.3, 0.3, 0.3],
    groups=[0, 0, 0, 1, 1, 1, 2, 2, 2],
)


def test_gdpo_hand_values_with_constant_reward_groups():
    # Per reward, (r - group mean) / (unbiased group std + eps), eps = 1e-8 (negligible here):
    #   ink  g0: mean 0.4, std sqrt((0.04 + 0 + 0.04) / 2) = 0.2                      -> (-1, 0, 1)
    #   hard g0: constant                                                              -> (0, 0, 0)
    #   ink  g1: mean 0.4, deviations (-0.1, -0.1, 0.2), std sqrt(0.06 / 2) = 0.1732  -> (-a, -a, 2a), a = 1/sqrt(3)
    #   hard g1: mean 0.1, deviations (-0.1, 0, 0.1), std 0.1                          -> (-1, 0, 1)
    #   g2: both constant                                                              -> 0
    # Weighted sum S = A_ink + 2 A_hard: (-1, 0, 1 | -a - 2, -a, 2a + 2 | 0, 0, 0).
    # Batch step: mean 0 (each group sums to 0); unbiased std over the 9 rows:
    #   sum of squares = 2 + (2 + a)^2 + a^2 + (2 + 2a)^2 = 12 + 12a = 12 + 4 sqrt(3);  std = sqrt((12 + 4 sqrt(3)) / 8) = 1.538189
    # GDPO A = S / (1.538189 + 1e-4).
    a = 1 / math.sqrt(3)
    sd = math.sqrt((12 + 4 * math.sqrt(3)) / 8)
    assert sd == pytest.approx(1.538189, abs=1e-6)
    s = [-1, 0, 1, -a - 2, -a, 2 * a + 2, 0, 0, 0]
    gdpo = GroupAdvantages("unbiased", 1e-8, WEIGHTS, batch_normalise=True)(THREE_GROUPS)
    assert gdpo.tolist() == pytest.approx([v / (sd + 1e-4) for v in s], abs=1e-5)
    assert gdpo.tolist() == pytest.approx([-0.650073, 0.0, 0.650073, -1.675466, -0.37532, 2.050785, 0.0, 0.0, 0.0], abs=1e-5)
    # per_reward is the sum before the batch step; weighted_sum normalises ink + 2 hard itself (g0: 0.2 spread of ink alone)
    per_reward = GroupAdvantages("unbiased", 1e-8, WEIGHTS)(THREE_GROUPS)
    assert per_reward.tolist() == pytest.approx(s, abs=1e-5)
    weighted = GroupAdvantages("unbiased", 1e-8)(THREE_GROUPS)
    assert weighted.tolist() == pytest.approx(group_advantages(THREE_GROUPS.rewards, THREE_GROUPS.group_ids, "unbiased", 1e-8).tolist())
    assert weighted[:3].tolist() == pytest.approx([-1, 0, 1], abs=1e-5) and weighted[6:].tolist() == [0, 0, 0]


def test_gdpo_leaves_nonfinite_rows_out():
    b = batch(ink=[0.2, 0.4, 0.6, 0.0], hard=[0.0, 0.1, 0.2, 0.0], groups=[0, 0, 0, 0])
    b.rewards[3] = float("nan")  # a reward that failed: no advantage, and no say in any statistic
    out = GroupAdvantages("unbiased", 1e-8, WEIGHTS, batch_normalise=True)(b)
    # without row 3: A_ink = (-1, 0, 1), A_hard = (-1, 0, 1), S = (-3, 0, 3), batch std 3 -> (-3, 0, 3) / (3 + 1e-4)
    assert out.tolist() == pytest.approx([-3 / 3.0001, 0.0, 3 / 3.0001, 0.0], abs=1e-6)


def flow_factory_gdpo(components: dict, weights: dict, groups: list) -> np.ndarray:
    """Flow-Factory's ``AdvantageProcessor.compute_gdpo`` (src/flow_factory/advantage/advantage_processor.py at
    cbee8a2, single process): per reward ``(r - group mean) / max(np.std(group), 1e-6)`` (NumPy: N in the
    denominator), times its weight, summed, then ``(x - mean) / max(np.std(x), 1e-6)`` over the batch."""
    groups = np.asarray(groups)
    combined = np.zeros(len(groups))
    for name, values in components.items():
        values = np.asarray(values, dtype=np.float64)
        adv = np.zeros_like(values)
        for g in np.unique(groups):
            mask = groups == g
            adv[mask] = (values[mask] - values[mask].mean()) / max(np.std(values[mask]), 1e-6)
        combined += weights[name] * adv
    return (combined - combined.mean()) / max(np.std(combined), 1e-6)


def test_gdpo_batch_step_follows_std_and_matches_flow_factory_with_biased():
    # std: biased, every std with N in the denominator (N = 3 in a group, 9 in the batch), eps 1e-8 in the groups:
    #   ink  g0: std sqrt(0.08 / 3) = 0.163299 -> (-b, 0, b), b = sqrt(3/2) = 1.224745
    #   ink  g1: deviations (-0.1, -0.1, 0.2), std sqrt(0.06 / 3) = 0.141421 -> (-c, -c, 2c), c = 1/sqrt(2)
    #   hard g1: deviations (-0.1, 0, 0.1), std sqrt(0.02 / 3) = 0.0816497 -> (-b, 0, b); g0 and g2: constant -> 0
    # S = A_ink + 2 A_hard = sqrt(3/2) x the unbiased S above: (-b, 0, b | -c - 2b, -c, 2c + 2b | 0, 0, 0).
    # Batch step: mean 0; sum of squares 3/2 (12 + 4 sqrt(3)) = 18 + 6 sqrt(3); biased std sqrt((18 + 6 sqrt(3)) / 9)
    # = 1.776148 (the unbiased one, / 8, is 1.883890: sqrt(9/8) = 1.0607 times larger).
    b, c = math.sqrt(1.5), 1 / math.sqrt(2)
    s = [-b, 0, b, -c - 2 * b, -c, 2 * c + 2 * b, 0, 0, 0]
    sd = math.sqrt((18 + 6 * math.sqrt(3)) / 9)
    assert sd == pytest.approx(1.776148, abs=1e-6)
    biased = GroupAdvantages("biased", 1e-8, WEIGHTS, batch_normalise=True)(THREE_GROUPS)
    assert biased.tolist() == pytest.approx([v / (sd + 1e-4) for v in s], abs=1e-6)
    assert biased.tolist() == pytest.approx([-0.689512, 0.0, 0.689512, -1.777115, -0.39809, 2.175205, 0.0, 0.0, 0.0], abs=1e-5)
    # Flow-Factory's formula on the same rewards: equal up to the epsilon's form (flowrl std + 1e-4, Flow-Factory
    # max(std, 1e-6)), a relative 1e-4 / 1.776 = 6e-5 here
    components = {k: v.tolist() for k, v in THREE_GROUPS.reward_components.items()}
    reference = flow_factory_gdpo(components, WEIGHTS, THREE_GROUPS.group_ids.tolist())
    assert biased.tolist() == pytest.approx(reference.tolist(), rel=1e-4, abs=1e-6)
    assert reference.tolist() == pytest.approx([v / sd for v in s], abs=1e-6)
    # global divides its batch step by N too; unbiased and none by N - 1 (the authors' TRL code): before #41 every
    # convention used N - 1, so std: biased was sqrt(N / (N - 1)) away from Flow-Factory (6.1% at N = 9, 0.79% at 64)
    unbiased_step = batch_normalised(torch.tensor(s), torch.ones(9, dtype=torch.bool), "unbiased")
    assert unbiased_step.tolist() == pytest.approx([v / (sd * math.sqrt(9 / 8) + 1e-4) for v in s], abs=1e-6)
    for convention, denominator in (("global", 9), ("biased", 9), ("unbiased", 8), ("none", 8)):
        out = batch_normalised(torch.tensor(s), torch.ones(9, dtype=torch.bool), convention)
        assert out.tolist() == pytest.approx([v / (math.sqrt((18 + 6 * math.sqrt(3)) / denominator) + 1e-4) for v in s], abs=1e-6)


def test_per_reward_advantages_is_an_alias_of_multi_reward_per_reward():
    alias = GRPOConfig(per_reward_advantages=True).build(CONTEXT).advantage_estimator
    spelled = GRPOConfig(multi_reward="per_reward").build(CONTEXT).advantage_estimator
    assert alias == spelled == GroupAdvantages("unbiased", 1e-8, WEIGHTS, batch_normalise=False)
    assert torch.equal(alias(THREE_GROUPS), spelled(THREE_GROUPS))
    assert GRPOConfig().build(CONTEXT).advantage_estimator == GroupAdvantages("unbiased", 1e-8)  # weighted_sum: as before
    with pytest.raises(ValueError, match="older spelling"):
        GRPOConfig(per_reward_advantages=True, multi_reward="gdpo")
    with pytest.raises(FlowRLError, match="reward components"):
        GRPOConfig(multi_reward="gdpo").build(None)


@pytest.mark.parametrize("name", ["grpo", "diffusion_nft", "awm", "flow_dppo", "dgpo"])
def test_every_group_objective_takes_gdpo_advantages(name):
    section = OBJECTIVES.section(name)(multi_reward="gdpo", std="unbiased", std_eps=1e-8)
    objective = section.build(CONTEXT)
    expected = GroupAdvantages("unbiased", 1e-8, WEIGHTS, batch_normalise=True)(THREE_GROUPS)
    assert torch.equal(objective.advantage_estimator(THREE_GROUPS), expected)


@pytest.mark.parametrize("name", ["diffu_grpo", "unigrpo", "dcolt", "bgpo"])
def test_the_diffusion_lm_objectives_take_gdpo_advantages(name):
    context = BuildContext(reward_weights=WEIGHTS, sampler=SimpleNamespace(block_length=4), pipeline=SimpleNamespace(mask_token_id=0))
    objective = OBJECTIVES.section(name)(multi_reward="gdpo", std="unbiased").build(context)
    expected = GroupAdvantages("unbiased", objective.std_eps, WEIGHTS, batch_normalise=True)(THREE_GROUPS)
    assert torch.equal(objective.advantages(THREE_GROUPS), expected)
    plain = OBJECTIVES.section(name)(std="unbiased").build(context)  # weighted_sum: the combined reward, as before
    assert torch.equal(
        plain.advantages(THREE_GROUPS), group_advantages(THREE_GROUPS.rewards, THREE_GROUPS.group_ids, "unbiased", plain.std_eps)
    )
