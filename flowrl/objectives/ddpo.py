"""DDPO (Black et al. 2023, arXiv:2305.13301): PPO on the DDIM/DDPM denoising steps.

Advantages are normalised per prompt with a running buffer of that prompt's recent rewards; while a
prompt has fewer than ``min_count`` rewards in its buffer, the current batch's statistics stand in.
Advantages are clipped to +-adv_clip_max (5) and all denoising steps are trained by default.

Differences from ddpo-pytorch:
- The stat tracker is part of the objective's state and is saved in checkpoints, so a resumed run
  normalises exactly as an uninterrupted one would.
- It runs on flow samplers too (any stochastic sampler with log-probs), not only DDIM.
- Non-finite rewards are dropped before they reach the buffers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from ..sections import BuildContext
from ..types import Trajectory
from .policy_gradient import PolicyGradientConfig, PolicyGradientObjective


@dataclass
class PerPromptStatTracker:
    buffer_size: int
    min_count: int
    eps: float = 1e-6
    buffers: dict[str, deque] = field(default_factory=dict)

    def __call__(self, batch: Trajectory) -> Tensor:
        rewards = batch.rewards.float().cpu()
        finite = torch.isfinite(rewards)
        prompts = batch.prompts
        advantages = torch.zeros_like(rewards)  # non-finite rewards: advantage 0 and masked out of the loss
        for prompt in dict.fromkeys(prompts):
            idx = torch.tensor([i for i, p in enumerate(prompts) if p == prompt and finite[i]], dtype=torch.long)
            if idx.numel() == 0:
                continue
            buf = self.buffers.setdefault(prompt, deque(maxlen=self.buffer_size))
            buf.extend(rewards[idx].tolist())
            if len(buf) < self.min_count:
                mean, std = rewards[finite].mean(), rewards[finite].std(unbiased=False)
            else:
                history = torch.tensor(list(buf))
                mean, std = history.mean(), history.std(unbiased=False)
            advantages[idx] = (rewards[idx] - mean) / (std + self.eps)
        return advantages.to(batch.rewards.device)

    def state_dict(self) -> dict[str, Any]:
        return {"buffers": {p: list(b) for p, b in self.buffers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffers = {p: deque(v, maxlen=self.buffer_size) for p, v in state.get("buffers", {}).items()}


class DDPOConfig(PolicyGradientConfig):
    """``objective.name: ddpo``: advantages from a per-prompt running buffer of rewards (ddpo-pytorch's stat tracker)."""

    name: str = "ddpo"
    per_prompt_stat_tracking: bool = Field(
        True, description="Normalise each reward by a running buffer of its prompt's rewards; false: by the batch statistics."
    )
    buffer_size: int = Field(32, ge=1, description="Rewards kept per prompt in the stat tracker.")
    min_count: int = Field(16, ge=1, description="Rewards a prompt needs before its own statistics are used (else the batch's).")
    adv_clip_max: float = Field(5.0, gt=0, description="Clip advantages to +-value.")

    def build(self, context: BuildContext | None = None) -> PolicyGradientObjective:
        if self.per_prompt_stat_tracking:
            estimator = PerPromptStatTracker(self.buffer_size, self.min_count)
        else:
            estimator = PerPromptStatTracker(buffer_size=1, min_count=10**9)  # batch statistics only
        return self.policy_gradient(estimator, self.adv_clip_max)
