"""D3PO (Yang et al., arXiv:2311.13231): direct preference optimisation on the denoising steps, online.

Consecutive samples of one prompt form a pair (they start from the same noise x_T when
``rollout.same_noise_in_group`` is on, as in D3PO); the preference h comes from their rewards (or a
Pareto comparison of the reward components). Every trained step t of a decisive pair contributes

    -log sigmoid(beta * (log r_w - log r_l)),   r = clamp(p_theta(x_{t-1} | x_t) / p_ref(x_{t-1} | x_t), 1 - eps, 1 + eps)

with the reference the frozen initial model (LoRA: the adapters switched off) and log-probs reduced like
the sampler's (per-dimension mean, as ddpo-pytorch and D3PO do). Before any update the ratio is 1 and
the loss is exactly log 2.

Differences from the reference implementation:
- Labels come from any reward or reward mix, or from a person (``preference: human``: the labels.jsonl that
  ``flowrl label`` writes for a pairs directory built with ``--trajectories``; D3PO's code reads human labels
  of stored trajectories the same way, or a fixed reward script).
- Ties and pairs with a dropped (non-finite) reward have h = 0: their loss is the constant log 2 with no
  gradient, so they are masked out of the mean instead of diluting it, and kept in the batch so that
  every process has the same shapes.
- Pairs stay together when the trainer shuffles minibatches (``minibatch_unit = 2``).
- One LossOutput per trained step, like GRPO: memory does not grow with the number of trained steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field

from ..sections import BuildContext, ObjectiveSection
from ..types import LossOutput, Pipeline, ReferenceModel, Role, Sampler, TrainingData, Trajectory
from .functional import d3po_pair_loss, masked_mean, pair_preferences
from .policy_gradient import TimestepOrder, choose_train_steps, timestep_fraction_option, timestep_order_option
from .stateless import Stateless

Preference = Literal["reward", "pareto", "human"]


@dataclass
class D3POObjective(Stateless):
    beta: float
    clip_range: float  # D3PO's eps: the ratio to the reference is clamped to [1 - eps, 1 + eps]
    preference: Preference
    timestep_fraction: float
    timestep_order: TimestepOrder
    name: str = field(default="d3po", init=False)
    trains_on: TrainingData = field(default="rollouts", init=False)  # pairs: consecutive rows of a group
    needs_log_probs: bool = field(default=True, init=False)
    reference: ReferenceModel = field(default="initial", init=False)  # the ratio is to the initial model
    minibatch_unit: int = field(default=2, init=False)  # the trainer shuffles whole pairs
    roles: tuple[Role, ...] = field(default=(), init=False)  # the policy alone

    def __post_init__(self) -> None:
        if self.preference == "human":  # a person labelled stored pairs: train on their recorded trajectories
            self.trains_on = "offline_pairs"

    def prepare(self, batch: Trajectory) -> Trajectory:
        """Pair consecutive samples of each group, winner first; ``advantages`` = 1 for the two samples of
        a decisive pair, 0 for a tie (the mask of the loss). Human-labelled pairs arrive winner first and
        decisive (ties and skips never reach training)."""
        if self.preference == "human":
            batch.advantages = torch.ones(len(batch), device=batch.latents.device)
            return batch
        first, second = [], []
        for g in torch.unique(batch.group_ids):
            idx = torch.nonzero(batch.group_ids == g).flatten().tolist()
            first += idx[0::2][: len(idx) // 2]
            second += idx[1::2]
        first_t, second_t = torch.tensor(first), torch.tensor(second)
        h = pair_preferences(batch.rewards, batch.reward_components, first_t, second_t, self.preference)
        winner, loser = torch.where(h >= 0, first_t, second_t), torch.where(h >= 0, second_t, first_t)
        order = torch.stack([winner, loser], 1).flatten()
        batch = batch[order]
        batch.advantages = (h != 0).float().repeat_interleave(2)
        return batch

    def losses(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        steps = choose_train_steps(batch.stochastic, self.timestep_fraction, self.timestep_order, generator)
        decisive = batch.advantages[0::2].to(batch.latents.device)
        for k in steps:
            x, x_next, sigma, sigma_next = batch.latents[:, k], batch.latents[:, k + 1], batch.sigmas[k], batch.sigmas[k + 1]
            log_prob = sampler.step(
                pipeline.predict(x, sigma, batch.cond, batch.guidance_scale), x, sigma, sigma_next, x_next=x_next
            ).log_prob
            with torch.no_grad(), pipeline.reference():
                ref_output = pipeline.predict(x, sigma, batch.cond, batch.guidance_scale)
                ref_log_prob = sampler.step(ref_output, x, sigma, sigma_next, x_next=x_next).log_prob
            log_ratio = log_prob - ref_log_prob
            pair_loss = d3po_pair_loss(log_ratio[0::2], log_ratio[1::2], self.beta, self.clip_range)
            loss = masked_mean(pair_loss, decisive)
            with torch.no_grad():
                ratio = torch.exp(log_ratio)
                metrics = {
                    "loss/policy": loss.detach(),
                    "policy/ratio_mean": ratio.mean(),
                    "policy/clipfrac": ((ratio - 1).abs() > self.clip_range).float().mean(),
                    # the implicit reward orders the pair as the labels do
                    "d3po/pair_accuracy": masked_mean((log_ratio[0::2] > log_ratio[1::2]).float(), decisive),
                    "d3po/decisive_fraction": decisive.mean(),
                }
            yield LossOutput(loss=loss / len(steps), metrics=metrics)


class D3POConfig(ObjectiveSection):
    """D3PO: pairs of samples of one prompt, preference from the rewards, DPO loss on every trained step."""

    name: str = "d3po"
    beta: float = Field(0.1, gt=0, description="D3PO's beta: the DPO temperature.")
    clip_range: float = Field(
        0.1, gt=0, lt=1, description="The ratio to the reference is clamped to [1 - c, 1 + c]; beyond it no gradient."
    )
    # human: the labels of the pairs in prompts.pairs (flowrl label, labels.jsonl), trained on the trajectories stored with
    # them (python -m flowrl.preferences.pairs --trajectories)
    preference: Preference = Field(
        "reward",
        description="Which sample of a pair wins: reward (the combined reward), pareto (dominance over the components), human (labels).",
    )
    timestep_fraction: float = timestep_fraction_option()
    timestep_order: TimestepOrder = timestep_order_option()

    def check_run(self, config: Any) -> None:
        if self.preference == "pareto" and len(config.reward.components) < 2:
            raise ValueError("objective.preference=pareto compares reward components: reward.components needs at least two")

    def build(self, context: BuildContext | None = None) -> D3POObjective:
        return D3POObjective(**self.target_kwargs())
