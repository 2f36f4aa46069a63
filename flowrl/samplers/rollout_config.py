"""The ``rollout`` section of a run: how training samples are drawn (samplers/rollout.py draws them,
samplers/branching.py when B2-DiffuRL's branches are on)."""

from __future__ import annotations

from pydantic import Field, model_validator

from ..sections import Section
from ..types import GuidanceMode
from .branching import BranchingConfig


class RolloutConfig(Section):
    """``rollout``: how training samples are drawn (steps, guidance, SDE window, shared noise, B2-DiffuRL branches)."""

    num_inference_steps: int = Field(10, ge=1)
    guidance_scale: float = 1.0  # 1.0 = no guidance
    # How guidance enters rollout and training (docs/guidance.md): "cfg" both, gradient through both
    # branches; "cfg_detached_uncond" both, unconditional branch without gradient; "cfg_rollout_only"
    # rollout guided, training re-scores the conditional branch alone; "embedded" the scale is a model
    # input (FLUX.1-dev guidance embedding), one forward pass.
    guidance_mode: GuidanceMode = "cfg"
    same_noise_in_group: bool = True
    sde_window_size: int | None = Field(None, ge=1)  # None: every step stochastic
    sde_window_start: int = Field(0, ge=0)
    sde_window_slide_every: int = Field(0, ge=0)  # iterations between one-step slides (MixGRPO); 0 = fixed
    batch_size: int = Field(64, ge=1)  # samples per denoiser call during rollout
    # decode and score each finished chunk of batch_size samples on a worker thread while the next chunk is generated
    # (docs/rewards.md "Overlapping the reward with the rollout"); the same batch, so the same bits when the reward scores
    # a row the same in its chunk as in the whole batch
    overlap_reward: bool = False
    branching: BranchingConfig | None = None  # B2-DiffuRL: shared prefix, branches, backward progressive window

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
