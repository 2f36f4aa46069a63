"""GRPO and DDPO math against hand-derived values (derivations in comments)."""

from __future__ import annotations

import math
from collections import deque

import pytest
import torch

from flowrl.objectives.ddpo import DDPOConfig, PerPromptStatTracker
from flowrl.objectives.functional import best_worst_subset, clipped_surrogate, gaussian_kl, group_advantages
from flowrl.objectives.grpo import GRPOConfig
from flowrl.objectives.policy_gradient import choose_train_steps
from flowrl.types import Trajectory


def test_clipped_surrogate_hand_values():
    # docs/math.md section 3 hand check: A = -1, r = 1 -> max(-(-1)*1, -(-1)*clip(1)) = 1.
    loss, stats = clipped_surrogate(torch.zeros(1), torch.zeros(1), torch.tensor([-1.0]), 0.2)
    assert loss.item() == pytest.approx(1.0)
    assert stats["ratio_mean"].item() == 1.0 and stats["clipfrac"].item() == 0.0
    # r = 1.5, eps = 0.2: A = +2 -> max(-3, -2*1.2 = -2.4) = -2.4 (clipped: no credit beyond 1 + eps).
    #                    A = -2 -> max(3, 2.4) = 3 (unclipped: the pessimistic side is kept).
    lp = torch.log(torch.tensor([1.5, 1.5]))
    loss, stats = clipped_surrogate(lp, torch.zeros(2), torch.tensor([2.0, -2.0]), 0.2)
    assert loss.item() == pytest.approx((-2.4 + 3.0) / 2)
    assert stats["clipfrac"].item() == 1.0
    assert stats["approx_kl"].item() == pytest.approx(0.5 * math.log(1.5) ** 2)
    # r = 0.5, A = -1: max(0.5, 0.8) = 0.8 (clipped from below).
    loss, _ = clipped_surrogate(torch.log(torch.tensor([0.5])), torch.zeros(1), torch.tensor([-1.0]), 0.2)
    assert loss.item() == pytest.approx(0.8)


def test_clipped_surrogate_mask_drops_samples():
    # Masked-out samples must not enter the mean: loss over [A=-1 (valid), A=+100 (dropped)] at r=1 is 1.0.
    loss, _ = clipped_surrogate(torch.zeros(2), torch.zeros(2), torch.tensor([-1.0, 100.0]), 0.2, torch.tensor([True, False]))
    assert loss.item() == pytest.approx(1.0)


def test_clipped_surrogate_gradient():
    # Unclipped region (r = 1): d/dlogp of -A * exp(logp - old) = -A * r = -A, averaged over B = 2.
    lp = torch.zeros(2, requires_grad=True)
    loss, _ = clipped_surrogate(lp, torch.zeros(2), torch.tensor([1.0, -3.0]), 0.1)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([-0.5, 1.5]))


def test_group_advantages_conventions():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0, 10.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    # Group 0: mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5.
    # unbiased std = sqrt(5/3), biased std = sqrt(5/4). Group 1 has zero spread -> (r - mean) = 0.
    dev = torch.tensor([-1.5, -0.5, 0.5, 1.5])
    unb = group_advantages(r, g, "unbiased", 1e-8)
    assert torch.allclose(unb[:4], dev / (math.sqrt(5 / 3) + 1e-8))
    assert torch.allclose(unb[4:], torch.zeros(2))
    assert torch.allclose(group_advantages(r, g, "biased", 1e-4)[:4], dev / (math.sqrt(5 / 4) + 1e-4))
    assert torch.allclose(group_advantages(r, g, "none")[:4], dev)
    glob = r.std(unbiased=False)
    assert torch.allclose(group_advantages(r, g, "global", 1e-4)[:4], dev / (glob + 1e-4))


def test_group_advantages_ignore_nonfinite():
    # The NaN sample is left out: group {1, 3} has mean 2, unbiased std sqrt(2); the NaN sample gets 0.
    adv = group_advantages(torch.tensor([1.0, float("nan"), 3.0]), torch.zeros(3, dtype=torch.long), "unbiased", 0.0)
    assert torch.allclose(adv, torch.tensor([-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2)]))


def test_best_worst_subset_keeps_extremes_per_group():
    r = torch.tensor([0.1, 0.9, 0.5, 0.3, 5.0, 1.0, 3.0, 2.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # k = 2: best and worst of each group -> group 0: idx 1 (0.9), 0 (0.1); group 1: idx 4 (5.0), 5 (1.0).
    assert best_worst_subset(r, g, 2).tolist() == [0, 1, 4, 5]


def test_gaussian_kl_closed_form():
    # KL(N(m1, s^2) || N(m2, s^2)) = (m1 - m2)^2 / (2 s^2); per-dim mean of [1, 4] / (2 * 0.25) = 5.
    kl = gaussian_kl(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor(0.5))
    assert kl.item() == pytest.approx(5.0)
    ref = torch.distributions.kl_divergence(
        torch.distributions.Normal(torch.tensor([1.0, 2.0]), 0.5), torch.distributions.Normal(torch.zeros(2), 0.5)
    )
    assert kl.item() == pytest.approx(ref.mean().item())


def test_ddpo_stat_tracker_fallback_then_per_prompt():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=3)
    batch = _batch(torch.tensor([1.0, 3.0, 10.0, 20.0]), ["a", "a", "b", "b"])
    # Below min_count (2 < 3) -> batch statistics: mean 8.5, biased std sqrt(((7.5^2 + 5.5^2 + 1.5^2 + 11.5^2)/4)).
    std = math.sqrt((7.5**2 + 5.5**2 + 1.5**2 + 11.5**2) / 4)
    assert torch.allclose(tracker(batch), (torch.tensor([1.0, 3.0, 10.0, 20.0]) - 8.5) / (std + 1e-6))
    # Second batch: prompt "a" now has 4 >= 3 rewards [1, 3, 2, 2] -> mean 2, biased std sqrt(0.5).
    batch = _batch(torch.tensor([2.0, 2.0, 0.0, 0.0]), ["a", "a", "c", "c"])
    adv = tracker(batch)
    assert torch.allclose(adv[:2], torch.zeros(2), atol=1e-6)
    assert tracker.buffers["a"] == deque([1.0, 3.0, 2.0, 2.0])
    # Round trip of the state (checkpointed for exact resume).
    other = PerPromptStatTracker(buffer_size=4, min_count=3)
    other.load_state_dict(tracker.state_dict())
    assert other.buffers == tracker.buffers


def test_ddpo_clips_advantages():
    obj = DDPOConfig(per_prompt_stat_tracking=False, adv_clip_max=0.5).build()
    batch = obj.prepare(_batch(torch.tensor([0.0, 0.0, 0.0, 100.0]), ["a"] * 4))
    assert batch.advantages.abs().max().item() == pytest.approx(0.5)


def test_grpo_prepare_best_worst():
    obj = GRPOConfig(best_worst_k=2).build()
    batch = obj.prepare(_batch(torch.tensor([0.0, 1.0, 2.0, 3.0]), ["a"] * 4))
    assert len(batch) == 2 and batch.rewards.tolist() == [0.0, 3.0]


def test_choose_train_steps():
    stochastic = torch.tensor([True, True, False, True, True])
    gen = torch.Generator().manual_seed(0)
    assert choose_train_steps(stochastic, 0.5, "first", gen) == [0, 1]
    chosen = choose_train_steps(stochastic, 0.6, "random", gen)
    assert len(chosen) == 2 and set(chosen) <= {0, 1, 3, 4}
    assert choose_train_steps(stochastic, 0.01, "first", gen) == [0]  # at least one step


def _batch(rewards: torch.Tensor, prompts: list[str]) -> Trajectory:
    b = rewards.shape[0]
    return Trajectory(
        latents=torch.zeros(b, 2, 1),
        sigmas=torch.tensor([1.0, 0.0]),
        log_probs=torch.zeros(b, 1),
        stochastic=torch.ones(1, dtype=torch.bool),
        cond={},
        prompts=prompts,
        metadata=[{}] * b,
        group_ids=torch.zeros(b, dtype=torch.long),
        rewards=rewards,
    )
