"""The reward names a config can use, and building a reward by name.

``REWARDS`` is the one table of reward names a config can use in ``reward.components`` (and ensembles, binaries,
``eval.judge``). Modules are imported only when their reward is built, so asking for the JPEG reward never
imports the classifier and vice versa. A reward class's constructor is its config section: ``reward.kwargs.<name>``
is checked against its parameters when the config loads. Users add their own by import path
(``"my_pkg.scores:sharpness"``), by an installed package's ``flowrl.rewards`` entry point, or with
``flowrl.register_reward`` (flowrl/registry.py); a function or a class that is not flowrl's is wrapped in
:class:`~flowrl.reward_models.callable_reward.CallableReward`, which checks what it returns.
"""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import ConfigDict, create_model

from flowrl.errors import FlowRLError
from flowrl.registry import Registry
from flowrl.sections import Section, signature_section
from flowrl.types import Reward

_BUILTIN = {
    "digit_classifier": "flowrl.reward_models.digit_classifier:DigitClassifierReward",
    "jpeg_compressibility": "flowrl.reward_models.jpeg:JpegCompressibilityReward",
    "jpeg_incompressibility": "flowrl.reward_models.jpeg:JpegIncompressibilityReward",
    "ink": "flowrl.reward_models.image_stats:InkReward",
    "digit_realism": "flowrl.reward_models.digit_realism:DigitRealismReward",
    "linear2d": "flowrl.reward_models.toy2d:LinearReward2D",
    "quadratic2d": "flowrl.reward_models.toy2d:QuadraticReward2D",
    "aesthetic": "flowrl.reward_models.aesthetic:AestheticReward",
    "clip_score": "flowrl.reward_models.clip_score:ClipScoreReward",
    "source_preservation": "flowrl.reward_models.edit:SourcePreservationReward",  # edit models: keep the source
    "clip_directional": "flowrl.reward_models.edit:ClipDirectionalReward",  # edit models: move along the instruction
    "pickscore": "flowrl.reward_models.pickscore:PickScoreReward",
    "hpsv2": "flowrl.reward_models.hpsv2:HPSv2Reward",
    "image_reward": "flowrl.reward_models.image_reward:ImageRewardReward",
    "motion_quality": "flowrl.reward_models.video_motion:MotionQualityReward",
    "ocr": "flowrl.reward_models.ocr:OCRReward",
    "text_similarity": "flowrl.reward_models.text_similarity:TextSimilarityReward",
    "videoalign": "flowrl.reward_models.videoalign:VideoAlignReward",
    "remote": "flowrl.reward_models.remote:RemoteReward",
    "openai_judge": "flowrl.reward_models.openai_judge:OpenAIJudgeReward",  # a VLM judge behind an OpenAI-compatible server
    # Text rewards (diffusion language models): samples are lists of completion strings.
    "math_answer": "flowrl.reward_models.math_answer:MathAnswerReward",
    "format": "flowrl.reward_models.math_answer:FormatReward",
    "countdown": "flowrl.reward_models.puzzles:CountdownReward",
    "sudoku": "flowrl.reward_models.puzzles:SudokuReward",
    "sudoku_constraints": "flowrl.reward_models.puzzles:SudokuConstraintReward",  # solution-free: best-of-N's verifier
}


def reward_section(target: Any, name: str) -> type[Section]:
    """The section of ``reward.kwargs.<name>``: a class's constructor parameters; a function or an object is the
    reward itself and takes none."""
    if inspect.isclass(target):
        return signature_section(target, name.split(":")[-1].title().replace("_", ""))
    return create_model(f"{name.split(':')[-1]}_kwargs", __config__=ConfigDict(extra="forbid"))


REWARDS = Registry("reward", "reward.components", _BUILTIN, derive=reward_section)
REWARD_NAMES: list[str] = REWARDS.builtin_names()  # flowrl's own


def build_reward(name: str, **kwargs: Any) -> Reward:
    """Build the reward registered (or imported) as ``name``, passing ``kwargs`` to its constructor (checked
    against the constructor first, one sentence when they do not fit)."""
    if name not in REWARDS:
        raise FlowRLError(REWARDS.unknown(name) + ".")
    target = REWARDS.load(name)
    from pydantic import ValidationError

    try:
        given = REWARDS.section(name).model_validate(kwargs)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise FlowRLError(f"reward '{name}': argument '{where}' is invalid ({err['msg'][0].lower()}{err['msg'][1:]}).") from None
    if inspect.isclass(target):
        explicit = {k: getattr(given, k) for k in given.model_fields_set} | dict(given.model_extra or {})
        try:
            reward = target(**explicit)
        except FlowRLError:
            raise
        except Exception as e:
            if name in REWARD_NAMES:
                raise
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            raise FlowRLError(f"reward '{name}' could not be constructed ({type(e).__name__}{': ' + first if first else ''}).") from None
    else:
        reward = target
    return as_reward(reward, name, wrap=name not in REWARD_NAMES)


def as_reward(obj: Any, name: str, wrap: bool = True, probe: bool = True) -> Reward:
    """``obj`` as a flowrl Reward named ``name``: flowrl's own rewards as they are; anything else wrapped in a
    :class:`CallableReward` that checks its signature now and its answers at every call (and, with ``probe``, on a
    probe batch before the model loads)."""
    if not wrap:
        return obj
    from .callable_reward import CallableReward

    return CallableReward(obj, name, probe=probe)


__all__ = ["REWARDS", "REWARD_NAMES", "as_reward", "build_reward", "reward_section"]
