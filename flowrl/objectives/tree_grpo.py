"""TreeGRPO (Ding & Ye, arXiv:2512.08153, "TreeGRPO: Tree-Advantage GRPO for Online RL Post-Training of Diffusion
Models"). No code released by the authors was found; this is derived from the paper, with the assumptions listed in
docs/objectives/tree_grpo.md.

Each prompt group is one tree (samplers/step_credit.py ``tree_rollout``): from the group's shared initial noise,
every node splits into ``branch_factor`` children by an SDE step at each of the ``branch_steps`` and follows the ODE
between them, so the group's branch_factor^depth leaves share their prefixes and the denoiser sees each node once.
Leaf rewards are normalised in the tree (GRPO's group advantage); an edge (the SDE transition into a child at a
branch step) gets the mean advantage of the leaves under that child, the reward propagated up the tree
(``edge_advantage: subtree_mean``), or that minus its parent's (``minus_parent``: centred among siblings). The loss is
the PPO-clipped ratio of every edge, each edge counted once however many leaves share it, averaged over the edges
of a branch step and then over the branch steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field, field_validator
from torch import Tensor

from ..samplers.step_credit import TreeLayout
from ..sections import BuildContext, ObjectiveSection
from ..types import LossOutput, Pipeline, Sampler, Trajectory
from .advantages import GroupAdvantages, MultiRewardOption, clip_advantages, std_eps_option, std_option
from .functional import StdConvention, group_means
from .step_credit import StepCreditBase, refuse_rollout_settings, step_log_probs, weighted_step_loss

EdgeAdvantage = Literal["subtree_mean", "minus_parent"]


def same_state(group_ids: Tensor, states: Tensor) -> Tensor:
    """(B,) an id shared by exactly the rows of one group whose ``states`` (B, *S) are bit for bit equal: the rows
    under one tree node."""
    keys = torch.cat([group_ids.reshape(-1, 1).to(states), states.flatten(1)], dim=1)
    return torch.unique(keys, dim=0, return_inverse=True)[1]


def tree_advantages(leaf_advantages: Tensor, valid: Tensor, batch: Trajectory, edge_advantage: EdgeAdvantage) -> Tensor:
    """(B, K) step-specific advantages: at branch step k, row b's is the mean leaf advantage under the child its path
    enters at k (rows sharing x_{k+1}), minus the mean under its parent (rows sharing x_k) for ``minus_parent``; NaN
    on the other steps and where no leaf under the child has a finite reward."""
    adv = torch.full(batch.log_probs.shape, float("nan"))
    group_ids, latents, valid, leaf = batch.group_ids.cpu(), batch.latents.cpu(), valid.cpu(), leaf_advantages.cpu()
    for k in torch.nonzero(batch.stochastic.cpu()).flatten().tolist():
        child = group_means(leaf, valid, same_state(group_ids, latents[:, k + 1]))
        if edge_advantage == "minus_parent":
            child = child - group_means(leaf, valid, same_state(group_ids, latents[:, k]))
        adv[:, k] = child
    return adv


@dataclass
class TreeGRPOObjective(StepCreditBase):
    name: str
    advantage_estimator: GroupAdvantages
    clip_range: float
    adv_clip_max: float | None
    branch_steps: tuple[int, ...]
    branch_factor: int
    edge_advantage: EdgeAdvantage
    minibatch_unit: int = field(default=1, init=False)  # the tree's leaves: set from the group size at build, so a tree is never split

    @property
    def rollout_layout(self) -> TreeLayout:
        return TreeLayout(self.branch_steps, self.branch_factor)

    def prepare(self, batch: Trajectory) -> Trajectory:
        valid = torch.isfinite(batch.rewards)
        leaf = clip_advantages(self.advantage_estimator(batch), self.adv_clip_max)
        batch.advantages = tree_advantages(leaf, valid, batch, self.edge_advantage).to(batch.latents.device)
        return batch

    def losses(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        steps = torch.nonzero(batch.stochastic.cpu()).flatten().tolist()
        for k in steps:
            edge = same_state(batch.group_ids.cpu(), batch.latents[:, k + 1].cpu())
            first = torch.full((int(edge.max()) + 1,), len(edge), dtype=torch.long).scatter_reduce(
                0, edge, torch.arange(len(edge)), reduce="amin"
            )
            adv = batch.advantages[first.to(batch.advantages.device), k].cpu()
            counted = torch.isfinite(adv)
            log_prob, old = step_log_probs(pipeline, sampler, batch, k, first)
            out = weighted_step_loss(log_prob, old, torch.nan_to_num(adv), counted.float(), self.clip_range, float(counted.sum()), k)
            out.loss = out.loss / len(steps)
            out.metrics["tree/edges"] = torch.tensor(float(len(first)))
            yield out


class TreeGRPOConfig(ObjectiveSection, MultiRewardOption):
    """``objective.name: tree_grpo``: TreeGRPO (docs/objectives/tree_grpo.md). train.num_generations must be
    branch_factor ** len(branch_steps): a group is the leaves of one tree."""

    name: str = "tree_grpo"
    std: StdConvention = std_option("biased", "Flow-GRPO's, which TreeGRPO builds on")
    std_eps: float = std_eps_option(1e-4)
    clip_range: float = Field(1e-3, gt=0, description="PPO's clip epsilon of each edge's ratio.")
    adv_clip_max: float | None = Field(
        5.0, description="Clip the leaf advantages to +-value before they are propagated; None: no clipping."
    )
    branch_steps: list[int] = Field(
        [0, 3, 6], description="The steps (0 = the noise end) at which every node splits; ODE steps in between. Sorted, distinct."
    )
    branch_factor: int = Field(2, ge=2, description="Children per node at a branch step.")
    edge_advantage: EdgeAdvantage = Field(
        "subtree_mean",
        description="An edge's advantage: subtree_mean, the mean leaf advantage under its child; minus_parent, that minus "
        "the mean under its parent (centred among siblings).",
    )

    @field_validator("branch_steps")
    @classmethod
    def _sorted(cls, v: list[int]) -> list[int]:
        if not v or sorted(set(v)) != v or v[0] < 0:
            raise ValueError(f"must be distinct non-negative steps in increasing order; got {v}")
        return v

    def check_run(self, config: Any) -> None:
        refuse_rollout_settings(config, "tree_grpo")
        k, leaves = config.rollout.num_inference_steps, self.branch_factor ** len(self.branch_steps)
        if self.branch_steps[-1] >= k:
            raise ValueError(f"objective.branch_steps {self.branch_steps} must be below rollout.num_inference_steps ({k})")
        if config.train.num_generations != leaves:
            raise ValueError(
                f"train.num_generations ({config.train.num_generations}) must be the tree's leaves, objective.branch_factor ** "
                f"len(objective.branch_steps) = {leaves}"
            )

    def build(self, context: BuildContext | None = None) -> TreeGRPOObjective:
        objective = TreeGRPOObjective(
            name=self.name,
            advantage_estimator=self.group_advantages(context),
            clip_range=self.clip_range,
            adv_clip_max=self.adv_clip_max,
            branch_steps=tuple(self.branch_steps),
            branch_factor=self.branch_factor,
            edge_advantage=self.edge_advantage,
        )
        objective.minibatch_unit = context.group_size if context is not None else 1
        return objective
