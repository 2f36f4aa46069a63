"""TraceRL (Wang et al. 2025, "Revolutionizing Reinforcement Learning Framework for Diffusion Large Language Models",
arXiv:2509.06949; code github.com/Gen-Verse/dLLM-RL, ``train/rl_llada.py`` with ``method: TraceRL``): GRPO on the
log-probs of the tokens along the trajectory the sampler actually took.

``objective.name: tracerl``. Rollouts use the run's own sampler (LLaDA's low-confidence order, blocks, a cache), the
same one evaluation uses. Each committed token is scored given the state it was committed in: the completion with the
tokens of earlier steps written and every later one masked (``TrajectoryReplayEstimator``), so the policy's
log-likelihood is ``sum_s log p(tokens committed at s | state_s)``: exact for the sampled tokens given the order,
which a deterministic unmasking rule makes piecewise constant in the weights. ``steps_per_forward`` (TraceRL's
``shrink``) scores k consecutive steps from the state before the first of them, one forward per k steps.

The loss is TraceRL's: advantages z-scored in the group (biased std, 0 where all rewards are equal), groups whose
mean reward lies outside ``group_band`` left out (TraceRL keeps a prompt only when 0.2 <= accuracy <= 0.8), the
per-token PPO clip (0.2), each (completion, step) row's mean over the tokens it committed, the mean over those rows
(``loss_aggregation: step_mean``; ``token_mean``: one mean over all tokens). Where flowrl differs from the release:
the optional KL (``beta``) is k3 against the reference weights (flowrl's convention for every objective), TraceRL's
is against the rollout weights; the EOS filler counts through the first EOS (d1's convention), TraceRL drops every
padding token after the first ``post_num`` (0 by default); TraceRL's value model (its "with_value" configs) is not
implemented.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from ...sections import BuildContext
from ...types import TokenTrajectory
from ..advantages import std_option
from ..functional import StdConvention, group_means
from .estimators import TrajectoryReplayEstimator
from .policy import TokenPolicyConfig, TokenPolicyObjective

# step_mean:  each (completion, step group) row's mean over the tokens it committed, then the mean over rows (TraceRL)
# token_mean: one mean over every counted token of the minibatch (d1's)
TraceRLLossAggregation = Literal["step_mean", "token_mean"]


def groups_in_band(rewards: Tensor, group_ids: Tensor, band: tuple[float, float] | None) -> Tensor:
    """(B,) bool: rows whose group's mean reward (over its finite rewards) lies in ``band`` (all True for None)."""
    if band is None:
        return torch.ones_like(rewards, dtype=torch.bool)
    mean = group_means(rewards, torch.isfinite(rewards), torch.unique(group_ids, return_inverse=True)[1])
    return (mean >= band[0]) & (mean <= band[1])  # a group with no finite reward (NaN mean) is out


@dataclass
class TraceRLObjective(TokenPolicyObjective):
    """Per-token PPO on the trajectory replay's log-probs; rows of groups outside ``group_band`` left out."""

    group_band: tuple[float, float] | None = field(kw_only=True)

    def _valid(self, batch: TokenTrajectory) -> Tensor:
        kept = groups_in_band(batch.rewards.cpu(), batch.group_ids.cpu(), self.group_band)
        return (super()._valid(batch).bool() & kept.to(batch.completion_ids.device)).float()

    def row_weights(self, weights: Tensor, valid: Tensor) -> Tensor:
        """step_mean: a row counts as many times as it has step groups (its weights are 1 / tokens of the group, so they
        sum to that number), making the loss the mean over (completion, step) rows; token_mean: d1's."""
        if self.loss_aggregation == "step_mean":
            return valid * weights.sum(-1)
        return super().row_weights(weights, valid)


class TraceRLConfig(TokenPolicyConfig):
    """TraceRL: rollouts with the run's own sampler, GRPO on each token's log-prob given the state it was committed in."""

    name: str = "tracerl"
    clip_range: float = Field(0.2, gt=0, description="PPO's clip epsilon of the per-token ratio (TraceRL: eps 0.2).")
    std: StdConvention = std_option("biased", "TraceRL: z-score, 0 for a group of equal rewards")
    steps_per_forward: int = Field(
        1, ge=1, description="Consecutive denoising steps scored from one state, one forward for k steps (TraceRL's shrink; 1: exact)."
    )
    group_band: tuple[float, float] | None = Field(
        (0.2, 0.8),
        description="Train only on groups whose mean reward lies in [low, high] (TraceRL: 0.2-0.8 accuracy); null: every group.",
    )
    loss_aggregation: TraceRLLossAggregation = Field(
        "step_mean",
        description="step_mean: each (completion, step) row's token mean, then over rows (TraceRL); token_mean: over all tokens.",
    )

    def estimator(self) -> TrajectoryReplayEstimator:
        return TrajectoryReplayEstimator(self.steps_per_forward, step_weights=self.loss_aggregation == "step_mean")

    def check_run(self, config: Any) -> None:
        if config.sampler.name != "masked":
            raise ValueError(f"objective tracerl replays the masked sampler's trajectories, not sampler '{config.sampler.name}'")
        if config.sampler.remasking == "policy":
            raise ValueError(
                "objective tracerl scores tokens, not a learned unmasking order (sampler.remasking=policy); use objective.name=dcolt"
            )
        if self.group_band is not None and self.group_band[0] > self.group_band[1]:
            raise ValueError(f"objective.group_band {list(self.group_band)} must be [low, high] with low <= high")

    def build(self, context: BuildContext | None = None) -> TraceRLObjective:
        return TraceRLObjective(
            **self._common(context),
            std_eps=1e-8,
            estimator=self.estimator(),
            loss_aggregation=self.loss_aggregation,
            group_band=self.group_band,
        )
