"""A user's objective with two trained roles and a frozen one, from outside flowrl (named by import path:
``objective.name=two_role_objective:CriticGRPOConfig``, with tests/ on the Python path).

The policy trains with flowrl's GRPO; beside it a critic learns to predict each sample's reward from its final state
(a learned reward model, the shape of an actor-critic's value head or DMD2's fake-score model): the role ``"critic"``,
either a small module of the objective's own (``critic: module``) or a second LoRA adapter on the policy's denoiser
(``critic: adapter``, which regresses the rollout's samples like a fake-score model). A frozen role, ``"anchor"``
(the module critic's initial copy), is declared and read, never trained: the critic's loss adds a small pull toward it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from flowrl.objectives.grpo import GRPOConfig
from flowrl.samplers.forward_process import denoising_errors, noised_and_target, training_sigmas
from flowrl.sections import BuildContext
from flowrl.types import FrozenRole, LossOutput, Role, TrainedRole


class Critic(nn.Module):
    """Reward from the final state: one hidden layer over the flattened sample."""

    def __init__(self, size: int, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(size, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.float()).squeeze(-1)


@dataclass
class CriticGRPO:
    grpo: Any
    kind: Literal["module", "adapter"]
    critic: Critic | None
    anchor: Critic | None
    critic_lr_scale: float
    name: str = field(default="critic_grpo", init=False)

    def __getattr__(self, key: str) -> Any:  # trains_on, needs_log_probs, reference, minibatch_unit: GRPO's
        if key in ("grpo", "__setstate__"):
            raise AttributeError(key)
        return getattr(self.grpo, key)

    @property
    def roles(self) -> tuple[Role, ...]:
        if self.kind == "adapter":
            return (TrainedRole("critic", adapter="critic", lr_scale=self.critic_lr_scale),)
        return (TrainedRole("critic", attribute="critic", lr_scale=self.critic_lr_scale), FrozenRole("anchor", "attribute", "anchor"))

    def prepare(self, batch):
        return self.grpo.prepare(batch)

    def losses(self, pipeline, sampler, batch, generator: torch.Generator) -> Iterator[LossOutput]:
        yield from self.grpo.losses(pipeline, sampler, batch, generator)
        yield self._critic_loss(pipeline, batch, generator)

    def _critic_loss(self, pipeline, batch, generator: torch.Generator) -> LossOutput:
        x0 = batch.latents[:, -1].float()
        if self.kind == "adapter":  # a fake-score model: the denoising loss on the policy's own samples, with its adapter
            sigma = training_sigmas(pipeline, len(x0), generator).to(x0.device)
            x_t, target = noised_and_target(pipeline, x0, torch.randn(x0.shape, generator=generator).to(x0.device), sigma)
            with pipeline.use_adapter("critic"):
                loss = denoising_errors(pipeline, x_t, sigma, batch.cond, target, 1.0).mean()
        else:
            rewards = batch.rewards.to(x0.device)
            valid = torch.isfinite(rewards)
            predicted = self.critic(x0)  # one forward per backward: the critic may be wrapped by DDP
            with torch.no_grad():
                pull = self.anchor(x0)
            loss = (predicted - rewards.nan_to_num()).pow(2)[valid].mean() + 1e-3 * (predicted - pull).pow(2).mean()
        return LossOutput(loss, {"loss/critic": loss.detach()}, role="critic")

    def state_dict(self) -> dict[str, Any]:
        return self.grpo.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.grpo.load_state_dict(state)


class CriticGRPOConfig(GRPOConfig):
    """GRPO for the policy, and a critic trained beside it with an optimizer of its own."""

    name: str = "two_role_objective:CriticGRPOConfig"
    critic: Literal["module", "adapter"] = Field("module", description="The critic's form: a module of its own, or a LoRA adapter.")
    critic_lr_scale: float = Field(10.0, gt=0, description="The critic's learning rate relative to train.learning_rate.")

    def build(self, context: BuildContext | None = None) -> CriticGRPO:
        grpo = super().build(context)
        if self.critic == "adapter":
            return CriticGRPO(grpo, "adapter", None, None, self.critic_lr_scale)
        size = int(torch.Size(context.pipeline.latent_shape()).numel())
        critic = Critic(size)
        return CriticGRPO(grpo, "module", critic, copy.deepcopy(critic), self.critic_lr_scale)
