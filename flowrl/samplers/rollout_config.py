"""The ``rollout`` section of a run: how training samples are drawn (samplers/rollout.py draws them,
samplers/branching.py when B2-DiffuRL's branches are on)."""

from __future__ import annotations

from pydantic import Field, model_validator

from ..sections import Section
from ..types import GuidanceMode
from .branching import BranchingConfig


class RolloutConfig(Section):
    """``rollout``: how training samples are drawn (steps, guidance, SDE window, shared noise, B2-DiffuRL branches)."""

    num_inference_steps: int = Field(10, ge=1, description="Denoising steps per rollout sample.")
    guidance_scale: float = Field(1.0, description="Classifier-free guidance scale; 1.0: no guidance.")
    # "cfg": both branches, gradient through both; "cfg_detached_uncond": the unconditional branch without gradient;
    # "cfg_rollout_only": training re-scores the conditional branch alone (off-policy); "embedded": the scale is a
    # model input (FLUX.1-dev guidance embedding), one forward pass.
    guidance_mode: GuidanceMode = Field("cfg", description="How guidance enters rollout and training (docs/guidance.md).")
    same_noise_in_group: bool = Field(True, description="The samples of one prompt group start from the same initial noise.")
    sde_window_size: int | None = Field(
        None, ge=1, description="Steps that are stochastic (and trained), the rest deterministic; None: every step."
    )
    sde_window_start: int = Field(0, ge=0, description="The first step of the stochastic window.")
    sde_window_slide_every: int = Field(
        0, ge=0, description="Iterations between one-step slides of the window (MixGRPO); 0: the window stays fixed."
    )
    batch_size: int = Field(64, ge=1, description="Samples per denoiser call during rollout.")
    # the same batch, so the same bits when the reward scores a row the same in its chunk as in the whole batch
    # (docs/rewards.md "Overlapping the reward with the rollout")
    overlap_reward: bool = Field(
        False, description="Score each finished chunk of batch_size samples on a worker thread while the next is generated."
    )
    branching: BranchingConfig | None = Field(
        None, description="B2-DiffuRL: a shared prefix, branches from it and a backward progressive window; None: off."
    )

    @model_validator(mode="after")
    def _branching_steps(self):
        b = self.branching
        if b is not None:
            end = b.end_steps or self.num_inference_steps
            if not b.start_steps <= end <= self.num_inference_steps:
                raise ValueError(
                    f"rollout.branching needs start_steps ({b.start_steps}) <= end_steps ({end}) <= num_inference_steps "
                    f"({self.num_inference_steps})"
                )
            if self.sde_window_size is not None:
                raise ValueError("rollout.branching sets the trained window itself; leave rollout.sde_window_size unset")
        return self
