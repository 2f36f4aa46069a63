"""Diffusion-DPO (Wallace et al., arXiv:2311.12908): DPO on the denoising loss, from offline preference pairs.

Each pair (prompt, winner x0, loser x0) is noised with one shared time and one shared noise; the model's
and the frozen reference's regression errors on winner and loser give

    loss = -log sigmoid(-0.5 * beta * ((err_w - err_l) - (err_w_ref - err_l_ref)))

(``functional.diffusion_dpo_loss``). The regression target is the one the model was trained with:
the velocity noise - x0 for rectified flows, the noise for epsilon models, sqrt(a) noise - sqrt(1 - a) x0
for v-prediction. Times are uniform over the model's training times (continuous sigma in (0, 1] for
flows, the integer DDPM steps otherwise), one per pair.

The pairs come from ``flowrl.preferences.pairs`` (a safetensors file of winners and losers plus their
prompts): no sampler, no log-probs; the trainer's rollout reads the iteration's pairs instead of
sampling (``trains_on = "offline_pairs"``).

Differences from the reference implementation: flow-matching models are supported (target = velocity);
the errors are per-dimension means, as in the reference, so beta keeps its meaning across resolutions
only as far as it does there (beta ~ 5000 for SD1.5/SDXL latents).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field

from ..samplers.forward_process import denoising_errors, noised_and_target, training_sigmas
from ..sections import BuildContext, ObjectiveSection
from ..types import LossOutput, Pipeline, ReferenceModel, Role, Sampler, TrainingData, Trajectory
from .functional import diffusion_dpo_loss
from .stateless import Stateless


@dataclass
class DiffusionDPOObjective(Stateless):
    beta: float
    preference: Literal["stored", "human"]  # which order of the pairs is trained; the modality reads it
    name: str = field(default="diffusion_dpo", init=False)
    trains_on: TrainingData = field(default="offline_pairs", init=False)
    needs_log_probs: bool = field(default=False, init=False)
    reference: ReferenceModel = field(default="initial", init=False)
    minibatch_unit: int = field(default=2, init=False)  # rows (2i, 2i + 1) are (winner, loser)
    roles: tuple[Role, ...] = field(default=(), init=False)  # the policy alone

    def prepare(self, batch: Trajectory) -> Trajectory:
        return batch  # the pairs arrive winner first

    def losses(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        x0 = batch.latents[:, -1].float()  # (2P, *S): winner, loser, winner, loser, ...
        pairs = x0.shape[0] // 2
        sigma = training_sigmas(pipeline, pairs, generator).to(x0.device).repeat_interleave(2)
        noise = torch.randn(x0[0::2].shape, generator=generator).to(x0.device).repeat_interleave(2, dim=0)
        x_t, target = noised_and_target(pipeline, x0, noise, sigma)
        err = denoising_errors(pipeline, x_t, sigma, batch.cond, target, batch.guidance_scale)
        with torch.no_grad(), pipeline.reference():
            ref_err = denoising_errors(pipeline, x_t, sigma, batch.cond, target, batch.guidance_scale)
        loss_per_pair = diffusion_dpo_loss(err[0::2], err[1::2], ref_err[0::2], ref_err[1::2], self.beta)
        loss = loss_per_pair.mean()
        with torch.no_grad():
            margin = (err[0::2] - err[1::2]) - (ref_err[0::2] - ref_err[1::2])
            metrics = {
                "loss/policy": loss.detach(),
                "dpo/pair_accuracy": (margin < 0).float().mean(),
                "dpo/implicit_margin": (-0.5 * self.beta * margin).mean(),
                "dpo/err_winner": err[0::2].mean(),
                "dpo/err_loser": err[1::2].mean(),
            }
        yield LossOutput(loss=loss, metrics=metrics)


class DiffusionDPOConfig(ObjectiveSection):
    """Diffusion-DPO: DPO on the denoising loss, from offline preference pairs (prompts.pairs)."""

    name: str = "diffusion_dpo"
    beta: float = Field(
        5000.0, gt=0, description="DPO temperature on the denoising-loss difference (the reference's value for SD1.5 / SDXL)."
    )
    preference: Literal["stored", "human"] = Field(
        "stored", description="Which sample of a pair wins: stored (the pairs' own order) or human (their labels.jsonl, flowrl label)."
    )

    def build(self, context: BuildContext | None = None) -> DiffusionDPOObjective:
        return DiffusionDPOObjective(beta=self.beta, preference=self.preference)
