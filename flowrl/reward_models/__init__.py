"""Rewards: callables that score decoded images against their prompts (see ``flowrl.types.Reward``).

``build_reward(name, **kwargs)`` builds one by name; modules are imported only when their reward is
built, so asking for the JPEG reward never imports the classifier and vice versa.
"""

from __future__ import annotations

import importlib
from typing import Any

from flowrl.errors import FlowRLError
from flowrl.types import Reward

# name -> "module:Class"
_REGISTRY: dict[str, str] = {
    "digit_classifier": "flowrl.reward_models.digit_classifier:DigitClassifierReward",
    "jpeg_compressibility": "flowrl.reward_models.jpeg:JpegCompressibilityReward",
    "jpeg_incompressibility": "flowrl.reward_models.jpeg:JpegIncompressibilityReward",
    "ink": "flowrl.reward_models.image_stats:InkReward",
    "digit_realism": "flowrl.reward_models.digit_realism:DigitRealismReward",
    "linear2d": "flowrl.reward_models.toy2d:LinearReward2D",
    "quadratic2d": "flowrl.reward_models.toy2d:QuadraticReward2D",
    "aesthetic": "flowrl.reward_models.aesthetic:AestheticReward",
    "clip_score": "flowrl.reward_models.clip_score:ClipScoreReward",
    "pickscore": "flowrl.reward_models.pickscore:PickScoreReward",
    "hpsv2": "flowrl.reward_models.hpsv2:HPSv2Reward",
    "image_reward": "flowrl.reward_models.image_reward:ImageRewardReward",
    "motion_quality": "flowrl.reward_models.video_motion:MotionQualityReward",
    "ocr": "flowrl.reward_models.ocr:OCRReward",
    "text_similarity": "flowrl.reward_models.text_similarity:TextSimilarityReward",
    "videoalign": "flowrl.reward_models.videoalign:VideoAlignReward",
    "remote": "flowrl.reward_models.remote:RemoteReward",
    # Text rewards (diffusion language models): samples are lists of completion strings.
    "math_answer": "flowrl.reward_models.math_answer:MathAnswerReward",
    "format": "flowrl.reward_models.math_answer:FormatReward",
    "countdown": "flowrl.reward_models.puzzles:CountdownReward",
    "sudoku": "flowrl.reward_models.puzzles:SudokuReward",
}

REWARD_NAMES: list[str] = list(_REGISTRY)


def build_reward(name: str, **kwargs: Any) -> Reward:
    """Build the reward registered as ``name``, passing ``kwargs`` to its constructor."""
    if name not in _REGISTRY:
        raise FlowRLError(f"unknown reward '{name}'; choose one of: {', '.join(REWARD_NAMES)}.")
    module_name, class_name = _REGISTRY[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**kwargs)


def build_reward_from_config(config) -> Reward:
    """Build the weighted sum of ``config.components`` (name -> weight), each with ``config.kwargs[name]``.

    Always a WeightedSum, even for one component, so every run logs ``reward/<name>`` the same way.
    A component named in ``config.ensembles`` is a RewardEnsemble of its members, one named in
    ``config.binary`` an AllOfReward (1 when every member's score passes its threshold).
    """
    from .combine import RewardEnsemble, WeightedSum

    def one(name: str) -> Reward:
        ensemble = config.ensembles.get(name) if hasattr(config, "ensembles") else None
        binary = getattr(config, "binary", {}).get(name)
        if binary is not None:  # a sparse reward: 1 when every member passes its threshold (reward_models/binary.py)
            from .binary import AllOfReward

            inners = {m: build_reward(m, **config.kwargs.get(m, {})) for m in binary.all_of}
            reward = AllOfReward(inners, binary.all_of, name=name)
        elif ensemble is None:
            reward = build_reward(name, **config.kwargs.get(name, {}))
        else:
            members = [build_reward(m.name, **m.kwargs) for m in ensemble.members]
            reward = RewardEnsemble(members, ensemble.mode, ensemble.coefficient, ensemble.uncertainty, name=name)
        frames = getattr(config, "video_frames", {}).get(name)
        if frames is not None:  # an image reward applied to videos: all frames, every n-th, or the first only
            from .per_frame import PerFrameReward

            reward = PerFrameReward(reward, every_n=frames.every_n, first_frame_only=frames.first_frame_only)
        return reward

    return WeightedSum({name: one(name) for name in config.components}, dict(config.components))


__all__ = ["REWARD_NAMES", "build_reward", "build_reward_from_config"]
