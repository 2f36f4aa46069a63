"""Score videos with an image reward: average it over (a subset of) the frames, or read only the first.

``PerFrameReward`` wraps another reward, so it is built in code rather than by name, e.g.
``PerFrameReward(build_reward("ink"), every_n=4, first_frame_only=False)``; it has no entry in the reward registry
(a config asks for it with ``reward.video_frames``).

Scoring only the first frame (``first_frame_only=True``) is the cheap proxy the video-RL literature
uses with image reward models (one image-reward call per video instead of T).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.sections import Section
from flowrl.types import Reward, RewardOutput


class FrameSelection(Section):
    """``reward.video_frames.<component>``: score videos with an image reward frame by frame (the mean), or only the
    first frame (the cheap proxy)."""

    first_frame_only: bool = Field(False, description="Score only the first frame (a cheap proxy).")
    every_n: int = Field(1, ge=1, description="Score frames 0, every_n, 2 * every_n, ... and average them.")


def frame_indices(num_frames: int, every_n: int = 1, first_frame_only: bool = False) -> list[int]:
    """The frames that are scored: [0] or 0, every_n, 2 * every_n, ... < num_frames."""
    return [0] if first_frame_only else list(range(0, num_frames, every_n))


class PerFrameReward:
    """score(video) = mean over the selected frames t of inner(frame_t), NaN frames left out.

    Every frame is scored with its video's prompt and metadata. Frames the inner reward marks NaN
    ("not applicable") are ignored; a video whose selected frames are all NaN scores NaN. The inner
    reward's extras are averaged per video the same way. Differentiable iff the inner reward is: the
    frames are views of ``samples`` and the average keeps the graph.
    """

    def __init__(self, image_reward: Reward, every_n: int, first_frame_only: bool) -> None:
        if int(every_n) != every_n or every_n < 1:
            raise FlowRLError(f"per-frame every_n must be a positive integer, got {every_n}.")
        self.inner = image_reward
        self.every_n = int(every_n)
        self.first_frame_only = bool(first_frame_only)
        self.name = f"per_frame/{image_reward.name}"
        self.differentiable = bool(image_reward.differentiable)

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        if samples.ndim != 5:
            raise FlowRLError(f"a per-frame reward reads videos of shape (B, C, T, H, W), got shape {tuple(samples.shape)}.")
        batch, channels, num_frames, height, width = samples.shape
        idx = frame_indices(num_frames, self.every_n, self.first_frame_only)
        n = len(idx)
        # (B, C, n, H, W) -> (B, n, C, H, W) -> (B * n, C, H, W): video-major, frame-minor.
        frames = samples[:, :, idx].permute(0, 2, 1, 3, 4).reshape(batch * n, channels, height, width)
        out = self.inner(
            frames,
            [p for p in prompts for _ in range(n)],
            [m for m in metadata for _ in range(n)],
        )

        def per_video(values: Tensor) -> Tensor:
            return torch.nanmean(values.float().reshape(batch, n), dim=1)

        return RewardOutput(
            scores=per_video(out.scores),
            extras={k: per_video(v.detach()) for k, v in out.extras.items()},
        )
