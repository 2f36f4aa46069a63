"""The clipped policy-gradient update over denoising steps, shared by GRPO and DDPO.

An objective here is (an advantage estimator) + (this per-step PPO loss). GRPO and DDPO differ only in
how advantages are computed, so they are two advantage estimators plugged into one class rather than
two copies of the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Protocol

import torch
from torch import Tensor

from ..types import LossOutput, Pipeline, ReferenceModel, Sampler, TrainingData, Trajectory
from .functional import best_worst_subset, clipped_surrogate, gaussian_kl, masked_mean

class AdvantageEstimator(Protocol):
    """Advantages (B,) of a scored batch; stateful estimators (DDPO's per-prompt buffers) save their state."""

    def __call__(self, batch: Trajectory) -> Tensor: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def choose_train_steps(stochastic: Tensor, fraction: float, order: Literal["random", "first"], generator: torch.Generator) -> list[int]:
    """Pick ``max(1, int(fraction * n))`` of the n stochastic steps: a random subset (DanceGRPO) or the
    first ones in sampling order (Flow-GRPO)."""
    steps = torch.nonzero(stochastic).flatten()
    n = max(1, int(fraction * steps.numel()))
    if order == "random":
        steps = steps[torch.randperm(steps.numel(), generator=generator)]
    return sorted(steps[:n].tolist())


@dataclass
class PolicyGradientObjective:
    """Clipped surrogate on each trained denoising step, optional KL to the frozen reference.

    KL (``beta > 0``): ``kl_form="gaussian"`` adds ``beta * KL(N(mean_theta, std^2) || N(mean_ref, std^2))``
    per step, reduced like the log-prob (per-dimension mean). ``kl_form="flow_grpo"`` reproduces
    Flow-GRPO's term, which divides by the diffusion coefficient g^2 instead of the transition variance
    g^2 |dt|, i.e. equals the Gaussian KL times |dt|; use it to carry Flow-GRPO's beta values over.
    """

    name: str
    advantage_estimator: AdvantageEstimator
    clip_range: float = 1e-4
    adv_clip_max: float | None = None
    beta: float = 0.0
    kl_form: Literal["gaussian", "flow_grpo"] = "gaussian"
    timestep_fraction: float = 1.0
    timestep_order: Literal["random", "first"] = "random"
    best_worst_k: int | None = None
    trains_on: TrainingData = field(default="rollouts", init=False)
    needs_log_probs: bool = field(default=True, init=False)
    minibatch_unit: int = field(default=1, init=False)
    extra_module: None = field(default=None, init=False)
    extra_lr_scale: float = field(default=1.0, init=False)

    @property
    def reference(self) -> ReferenceModel:
        return "initial" if self.beta > 0 else "none"  # the KL term compares with the initial model

    def prepare(self, batch: Trajectory) -> Trajectory:
        batch.advantages = self.advantage_estimator(batch)
        if self.adv_clip_max is not None:
            batch.advantages = batch.advantages.clamp(-self.adv_clip_max, self.adv_clip_max)
        if self.best_worst_k is not None:
            batch = batch[best_worst_subset(batch.rewards, batch.group_ids, self.best_worst_k)]
        return batch

    def losses(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        steps = choose_train_steps(batch.stochastic, self.timestep_fraction, self.timestep_order, generator)
        advantages = batch.advantages.to(batch.latents.device)
        valid = torch.isfinite(batch.rewards) if batch.rewards is not None else None
        for k in steps:
            x, x_next = batch.latents[:, k], batch.latents[:, k + 1]
            sigma, sigma_next = batch.sigmas[k], batch.sigmas[k + 1]
            model_output = pipeline.predict(x, sigma, batch.cond, batch.guidance_scale)
            out = sampler.step(model_output, x, sigma, sigma_next, x_next=x_next)
            policy_loss, stats = clipped_surrogate(out.log_prob, batch.log_probs[:, k], advantages, self.clip_range, valid)
            loss = policy_loss
            metrics = {"loss/policy": policy_loss.detach(), **{f"policy/{n}": v for n, v in stats.items()}}
            if self.beta > 0:
                kl = self._kl(pipeline, sampler, batch, k, out.mean, out.std, valid)
                loss = loss + self.beta * kl
                metrics["loss/kl"] = kl.detach()
            yield LossOutput(loss=loss / len(steps), metrics=metrics)

    def _kl(self, pipeline, sampler, batch: Trajectory, k: int, mean: Tensor, std: Tensor, valid: Tensor | None) -> Tensor:
        x, sigma, sigma_next = batch.latents[:, k], batch.sigmas[k], batch.sigmas[k + 1]
        with torch.no_grad(), pipeline.reference():
            ref_output = pipeline.predict(x, sigma, batch.cond, batch.guidance_scale)
        ref_mean = sampler.step(ref_output, x, sigma, sigma_next, x_next=batch.latents[:, k + 1]).mean
        kl = gaussian_kl(mean, ref_mean, std, sampler.reduction)  # stochastic samplers declare their reduction
        if self.kl_form == "flow_grpo":
            kl = kl * (sigma - sigma_next).abs()
        return masked_mean(kl, None if valid is None else valid.float())

    def state_dict(self) -> dict[str, Any]:
        return {"advantage_estimator": self.advantage_estimator.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.advantage_estimator.load_state_dict(state.get("advantage_estimator", {}))
