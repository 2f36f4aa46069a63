"""Group advantages from one reward or several: the one estimator every group-based objective uses.

A run with several reward components (``reward.components: {ink: 1, digit_classifier: 1}``) can turn them into
one advantage per sample three ways, chosen by the objective's ``multi_reward`` option:

- ``weighted_sum`` (the default): the combined reward ``R = sum_k w_k r_k`` normalised in its prompt group,
  ``A = (R - mean_g R) / (std_g R + eps)`` (GRPO's form). A component with a large spread decides the sign of A,
  so a reward that varies little inside a group (a hard one, mostly failing) barely moves it.
- ``per_reward``: each component normalised in its group first, then weighted and summed,
  ``A = sum_k w_k (r_k - mean_g r_k) / (std_g r_k + eps)`` (Flow-GRPO's multi-reward setting; GRPO's older
  ``per_reward_advantages: true`` is this form, kept as an alias).
- ``gdpo``: GDPO (Liu et al. 2026, "Group reward-Decoupled normalization Policy Optimization",
  arXiv:2601.05242; not the diffusion-LM "Group Diffusion Policy Optimization" of arXiv:2510.08554): ``per_reward``,
  then the sum normalised over the whole batch, ``A = (S - mean_batch S) / (std_batch S + 1e-4)``. The batch std
  follows the objective's ``std`` convention, as the group step's does: the N denominator for ``biased`` and
  ``global`` (Flow-Factory's ``compute_gdpo``, NumPy's std), N - 1 for ``unbiased`` and ``none`` (the authors' TRL
  code, NVlabs/GDPO ``trl-GDPO/.../grpo_trainer.py``, torch's default). The batch step keeps the advantage's scale
  the same whatever the number of rewards (a plain sum of K unit-variance advantages has a spread of up to K).

The group statistics use the objective's ``std`` convention and ``std_eps`` for every component
(``functional.group_advantages``). Samples with a non-finite combined reward are left out of every statistic and
get A = 0 (the authors' code replaces a missing reward by 0 instead); a group whose component is constant
contributes 0 for that component. docs/objectives/gdpo.md has the two-reward measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from ..errors import FlowRLError
from ..sections import BuildContext, Section
from ..types import Trajectory
from .functional import StdConvention, group_advantages
from .stateless import Stateless

MultiReward = Literal["weighted_sum", "per_reward", "gdpo"]
GDPO_BATCH_EPS = 1e-4  # the authors' epsilon of the batch-wise normalisation (TRL and verl ports alike)
BIASED_CONVENTIONS = ("biased", "global")  # the std conventions whose group step divides by N (functional.group_advantages)
STD_CONVENTIONS = "Advantage normaliser: unbiased / biased divide by the group std (N - 1 / N), global by the batch std, none: r - mean"
ESTIMATOR_FIELDS = ("std", "std_eps", "multi_reward")  # a section's fields that make its advantage estimator


def per_reward_advantages(
    components: dict[str, Tensor], weights: dict[str, float], rewards: Tensor, group_ids: Tensor, std: StdConvention, eps: float
) -> Tensor:
    """``sum_k w_k A_k`` with ``A_k`` the group-normalised advantage of component k; rows whose combined reward
    ``rewards`` is non-finite are left out of every component's statistics (A = 0). Returns (B,) float32."""
    total = torch.zeros_like(rewards, dtype=torch.float32)
    for name, weight in weights.items():
        if weight != 0:
            component = torch.where(torch.isfinite(rewards), components[name], float("nan"))
            total = total + weight * group_advantages(component, group_ids, std, eps)
    return total


def batch_normalised(values: Tensor, valid: Tensor, std: StdConvention = "unbiased", eps: float = GDPO_BATCH_EPS) -> Tensor:
    """GDPO's batch step: ``(v - mean) / (std + eps)`` over the rows where ``valid``. The std is the objective's
    convention's: N in the denominator for ``biased`` and ``global`` (Flow-Factory), N - 1 for ``unbiased`` and
    ``none`` (the authors' TRL code; ``none`` has no group std to follow). The other rows get 0, and fewer than two
    valid rows leave every row 0."""
    out = torch.zeros_like(values, dtype=torch.float32)
    kept = values[valid].float()
    if kept.numel() < 2:
        return out
    out[valid] = (kept - kept.mean()) / (kept.std(unbiased=std not in BIASED_CONVENTIONS) + eps)
    return out


def clip_advantages(advantages: Tensor, clip_max: float | None) -> Tensor:
    """``advantages`` clamped to +-``clip_max`` (an objective's ``adv_clip_max``); None: as they are."""
    return advantages if clip_max is None else advantages.clamp(-clip_max, clip_max)


@dataclass
class GroupAdvantages(Stateless):  # each batch's groups are normalised on their own
    """Group-normalised advantages of the combined reward, or, with ``component_weights``, the weighted sum of each
    component's own group-normalised advantage (``per_reward``), batch-normalised when ``batch_normalise`` (GDPO)."""

    std: StdConvention
    eps: float
    component_weights: dict[str, float] | None = None
    batch_normalise: bool = False

    def __call__(self, batch: Trajectory) -> Tensor:
        if not self.component_weights:
            return group_advantages(batch.rewards, batch.group_ids, self.std, self.eps)
        total = per_reward_advantages(batch.reward_components, self.component_weights, batch.rewards, batch.group_ids, self.std, self.eps)
        if self.batch_normalise:
            total = batch_normalised(total, torch.isfinite(batch.rewards), self.std)
        return total


def std_option(default: StdConvention, whose: str) -> Any:
    """The ``std`` field of a group-advantage objective's section: the conventions are described here once, the
    objectives differ in the default and in whose choice it is (``whose``: "the authors: global")."""
    return Field(default, description=f"{STD_CONVENTIONS} ({whose}).")


def std_eps_option(default: float) -> Any:
    """The ``std_eps`` field of a group-advantage objective's section (the objectives differ in the default)."""
    return Field(default, gt=0, description="Added to the std before the advantage is divided by it.")


class MultiRewardOption(Section):
    """The ``multi_reward`` option, shared by every group-based objective's section (GRPO, DiffusionNFT, AWM,
    Flow-DPPO, DGPO, the diffusion-LM objectives); the section's own ``std`` and ``std_eps`` give the group statistics."""

    multi_reward: MultiReward = Field(
        "weighted_sum",
        description="How reward components become one advantage: weighted_sum (normalise the sum), per_reward (normalise each, "
        "then sum), gdpo (GDPO's multi-reward normalisation, arXiv:2601.05242: per_reward, then normalise over the batch; "
        "not the diffusion-LM GDPO of arXiv:2510.08554).",
    )

    def multi_reward_kwargs(self, context: BuildContext | None, multi_reward: MultiReward | None = None) -> dict[str, Any]:
        """``component_weights`` and ``batch_normalise`` of the estimator (``multi_reward`` overrides the field: GRPO's
        alias); {} for the weighted sum."""
        mode = multi_reward or self.multi_reward
        if mode == "weighted_sum":
            return {}
        if context is None or not context.reward_weights:
            raise FlowRLError(f"objective.multi_reward={mode} needs the run's reward components (reward.components).")
        return {"component_weights": dict(context.reward_weights), "batch_normalise": mode == "gdpo"}

    def group_advantages(self, context: BuildContext | None, multi_reward: MultiReward | None = None) -> GroupAdvantages:
        """The estimator for this section, with its ``std`` and ``std_eps``."""
        return GroupAdvantages(self.std, self.std_eps, **self.multi_reward_kwargs(context, multi_reward))

    def with_group_advantages(self, objective: type, context: BuildContext | None, **extra: Any) -> Any:
        """``objective`` built from this section's fields (an ObjectiveSection's ``target_kwargs``) and ``extra``, the
        fields that make the estimator (``ESTIMATOR_FIELDS``) passed as its ``advantage_estimator`` instead."""
        kwargs = {k: v for k, v in self.target_kwargs().items() if k not in ESTIMATOR_FIELDS}
        return objective(advantage_estimator=self.group_advantages(context), **kwargs, **extra)
