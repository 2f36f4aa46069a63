"""A model-free motion-quality reward for videos, from dense optical flow (OpenCV Farneback).

Raw optical-flow magnitude is a bad reward on its own: independent noise frames have large
"flow" everywhere, so a policy maximising it learns to flicker. This reward therefore gates motion by
how well the flow *explains* the next frame (photometric warping error), and gives a perfectly
consistent static clip a small floor, so that

    noise  <  static  <  coherent motion.

Formula, per video with frames ``I_0 .. I_{T-1}`` (grayscale uint8, see below), for each pair
``(I_t, I_{t+1})``:

    F_t        = Farneback flow from I_t to I_{t+1}       (I_t(y, x) ~ I_{t+1}(y + F_y, x + F_x))
    W_t        = I_{t+1} warped back to t with F_t (cv2.remap, bilinear)
    err_t      = mean |W_t - I_t| over pixels whose flow target lies inside the frame,
                 divided by the pair's intensity range  max(I_t, I_{t+1}) - min(I_t, I_{t+1})
                 (at least 1 grey level)
    mag_t      = mean |F_t| in pixels of the ORIGINAL resolution

    magnitude   = mean_t mag_t                           (logged, pixels per frame)
    warp_error  = mean_t err_t                           (logged, fraction of the intensity range)
    consistency = exp(-warp_error / warp_scale)          (logged, in (0, 1])
    smoothness  = exp(-mean_t mean|F_{t+1} - F_t| / (smoothness_scale * min(H, W)))  (logged; 1 if T < 3)
    motion      = magnitude / (magnitude + motion_scale * min(H, W))                 (saturating, in [0, 1))

    score = consistency * smoothness ** smoothness_weight * (static_score + (1 - static_score) * motion)

so the score lies in [0, 1]. A perfectly consistent static clip scores ``static_score`` (0.2 by
default), coherent motion up to 1, and noise close to 0 because its warping error is large. The
smoothness term (frame-to-frame change of the flow field) is always logged but only enters the score
when ``smoothness_weight > 0`` (off by default: real footage with cuts or jerky frame rates would be
penalised by it).

Frames are converted to grayscale with the ITU-R 601 luma weights (0.299, 0.587, 0.114) and to uint8.
Farneback needs some spatial support (its default window is 15 px and it builds a 3-level pyramid), so
frames whose shorter side is below ``min_size`` (64) are upsampled bilinearly by the integer factor
``ceil(min_size / min(H, W))`` before the flow is computed; flow magnitudes are divided by that factor,
so ``magnitude`` is always in pixels of the input resolution.

Input: videos float32 (B, C, T, H, W) in [0, 1], C in {1, 3} (the diffusers video-VAE layout). A video
with fewer than 2 frames scores NaN ("not applicable"). Not differentiable. Needs OpenCV
(``pip install opencv-python-headless``), imported on first call.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.types import RewardOutput

LUMA_WEIGHTS = (0.299, 0.587, 0.114)
# Farneback parameters (OpenCV's documented example values): pyramid scale, levels, window size,
# iterations, polynomial neighbourhood, polynomial sigma, flags.
FARNEBACK_PARAMS = (0.5, 3, 15, 3, 5, 1.2, 0)


def import_cv2():
    """Import OpenCV or raise a FlowRLError naming the package to install."""
    try:
        import cv2
    except ImportError:
        raise FlowRLError("the motion_quality reward needs OpenCV, which is not installed; pip install 'flowrl[video]'.") from None
    return cv2


def check_videos(samples: Tensor, who: str) -> None:
    if samples.ndim != 5 or samples.shape[1] not in (1, 3):
        raise FlowRLError(f"{who} reads videos of shape (B, 1 or 3, T, H, W) in [0, 1], got shape {tuple(samples.shape)}.")


def grayscale_uint8(video: np.ndarray) -> np.ndarray:
    """(C, T, H, W) float in [0, 1] -> (T, H, W) uint8 luma."""
    if video.shape[0] == 3:
        gray = LUMA_WEIGHTS[0] * video[0] + LUMA_WEIGHTS[1] * video[1] + LUMA_WEIGHTS[2] * video[2]
    else:
        gray = video[0]
    return np.clip(np.round(gray * 255.0), 0, 255).astype(np.uint8)


def upsample_factor(height: int, width: int, min_size: int) -> int:
    """The integer factor that brings the shorter side to at least ``min_size`` (1 if it already is)."""
    short = min(height, width)
    return 1 if short >= min_size else math.ceil(min_size / short)


def flow_terms(video: np.ndarray, min_size: int = 64) -> dict[str, float]:
    """Return magnitude, warp_error and flow_change (see the module docstring) of one (C, T, H, W) video."""
    cv2 = import_cv2()
    frames = grayscale_uint8(video)
    num_frames, height, width = frames.shape
    factor = upsample_factor(height, width, min_size)
    if factor > 1:
        frames = np.stack([cv2.resize(f, (width * factor, height * factor), interpolation=cv2.INTER_LINEAR) for f in frames])
    h, w = frames.shape[1:]
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)
    magnitudes, errors, flows = [], [], []
    for t in range(num_frames - 1):
        prev, nxt = frames[t], frames[t + 1]
        flow = cv2.calcOpticalFlowFarneback(prev, nxt, None, *FARNEBACK_PARAMS)
        map_x, map_y = xs + flow[..., 0], ys + flow[..., 1]
        warped = cv2.remap(nxt.astype(np.float32), map_x, map_y, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
        inside = (map_x >= 0) & (map_x <= w - 1) & (map_y >= 0) & (map_y <= h - 1)
        intensity_range = max(float(max(prev.max(), nxt.max())) - float(min(prev.min(), nxt.min())), 1.0)
        if inside.any():
            err = float(np.abs(warped - prev.astype(np.float32))[inside].mean()) / intensity_range
        else:  # the flow sends every pixel out of the frame: nothing is explained
            err = 1.0
        flow = flow / factor  # back to pixels of the input resolution
        magnitudes.append(float(np.linalg.norm(flow, axis=-1).mean()))
        errors.append(err)
        flows.append(flow)
    changes = [float(np.linalg.norm(flows[i + 1] - flows[i], axis=-1).mean()) for i in range(len(flows) - 1)]
    return {
        "magnitude": float(np.mean(magnitudes)),
        "warp_error": float(np.mean(errors)),
        "flow_change": float(np.mean(changes)) if changes else 0.0,
    }


class MotionQualityReward:
    """score = consistency * smoothness**w * (static_score + (1 - static_score) * motion); see the module docstring."""

    name = "motion_quality"
    differentiable = False

    def __init__(
        self,
        motion_scale: float = 0.01,
        warp_scale: float = 0.05,
        static_score: float = 0.2,
        smoothness_weight: float = 0.0,
        smoothness_scale: float = 0.01,
        min_size: int = 64,
    ) -> None:
        """
        Args:
            motion_scale: half-saturation of the motion term, as a fraction of the shorter frame side
                per frame (0.01: motion of 1% of the side per frame gives motion = 0.5).
            warp_scale: warping error (fraction of the intensity range) at which consistency = 1/e.
            static_score: the score of a perfectly consistent static clip, in [0, 1).
            smoothness_weight: exponent of the smoothness factor; 0 (default) logs it without using it.
            smoothness_scale: mean flow change between consecutive pairs, as a fraction of the shorter side,
                at which smoothness = 1/e.
            min_size: frames whose shorter side is smaller are upsampled by ceil(min_size / side).
        """
        if motion_scale <= 0 or warp_scale <= 0 or smoothness_scale <= 0:
            raise FlowRLError("motion_quality scales (motion_scale, warp_scale, smoothness_scale) must be positive.")
        if not 0.0 <= static_score < 1.0:
            raise FlowRLError(f"motion_quality static_score must be in [0, 1), got {static_score}.")
        if smoothness_weight < 0:
            raise FlowRLError(f"motion_quality smoothness_weight must be >= 0, got {smoothness_weight}.")
        if min_size < 1:
            raise FlowRLError(f"motion_quality min_size must be a positive integer, got {min_size}.")
        import_cv2()  # refused when the run is built, before its directory is written
        self.motion_scale = motion_scale
        self.warp_scale = warp_scale
        self.static_score = static_score
        self.smoothness_weight = smoothness_weight
        self.smoothness_scale = smoothness_scale
        self.min_size = min_size

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        check_videos(samples, "the motion_quality reward")
        videos = samples.detach().float().clamp(0, 1).cpu().numpy()
        batch, _, num_frames, height, width = videos.shape
        names = ("magnitude", "warp_error", "consistency", "smoothness", "motion")
        terms = {k: np.full(batch, np.nan) for k in names}
        scores = np.full(batch, np.nan)
        if num_frames >= 2:
            short = min(height, width)
            for i, video in enumerate(videos):
                raw = flow_terms(video, self.min_size)
                consistency = math.exp(-raw["warp_error"] / self.warp_scale)
                smoothness = math.exp(-raw["flow_change"] / (self.smoothness_scale * short))
                motion = raw["magnitude"] / (raw["magnitude"] + self.motion_scale * short)
                terms["magnitude"][i] = raw["magnitude"]
                terms["warp_error"][i] = raw["warp_error"]
                terms["consistency"][i] = consistency
                terms["smoothness"][i] = smoothness
                terms["motion"][i] = motion
                scores[i] = consistency * smoothness**self.smoothness_weight * (self.static_score + (1.0 - self.static_score) * motion)

        def to_tensor(a: np.ndarray) -> Tensor:
            return torch.tensor(a.astype(np.float32), device=samples.device)

        return RewardOutput(scores=to_tensor(scores), extras={k: to_tensor(v) for k, v in terms.items()})
