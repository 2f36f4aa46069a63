"""VideoAlign / VideoReward: a Qwen2-VL-2B reward model for text-to-video (Liu et al. 2025, "Improving
Video Generation with Human Feedback", arXiv:2501.13918; code github.com/KwaiVGI/VideoAlign, weights
huggingface.co/KwaiVGI/VideoReward). It outputs three scores per (video, prompt):
VQ (visual quality), MQ (motion quality) and TA (text alignment). DanceGRPO trains HunyuanVideo on its
MQ (and VQ), calling ``inferencer.reward([path], [prompt], use_norm=True)[0]["MQ"]``.

Normalisation convention (read from VideoAlign's ``inference.py``, ``VideoVLMRewardInference``):
the checkpoint directory holds ``model_config.json`` whose optional ``inference_config`` section has
``VQ_mean, VQ_std, MQ_mean, MQ_std, TA_mean, TA_std``. With ``use_norm=True`` (the default there and
in DanceGRPO) each raw head output is STANDARDISED,

    score_d = (raw_d - d_mean) / d_std          (d in VQ, MQ, TA; ``_norm``)

and ``Overall = VQ + MQ + TA`` is the sum of the three (standardised) scores. If the config has no
``inference_config``, VideoAlign returns the raw outputs. :func:`standardize` is that map,
:func:`denormalize` its inverse (``raw = score * std + mean``, to recover raw head outputs from
published normalised scores), :func:`read_inference_config` reads the statistics and
:func:`combine` forms the reward from the chosen dimensions (``use=["MQ"]``, ``["VQ", "MQ"]``,
``["Overall"]`` ...). The mean/std values themselves are NOT shipped or hard-coded here: they are read
from the checkpoint you download (a third-party port, DongyunZou/VideoVLMReward, hard-codes
VQ 3.6757 / 2.2476, MQ 1.1646 / 1.3811, TA 2.8105 / 2.5121 as mean / std; not checked against the
checkpoint here).

What is verified in this repository (tests/test_video_and_rule_rewards.py): the standardisation and
its inverse on numbers, reading the statistics from a ``model_config.json`` laid out as VideoAlign's
loader expects, the combination of dimensions, that videos reach the backend as mp4 files holding every
frame, and the error raised when the model code or checkpoint is missing. What is NOT verified here
(it needs the real checkpoint, the VideoAlign code and in practice a CUDA GPU): the loading and the
scores of the real model. Requirements for real scoring:

* a clone of github.com/KwaiVGI/VideoAlign (its reward head ``train_reward.py``, ``utils.py``,
  ``data.py``, ``vision_process.py``, ``prompt_template.py`` and ``inference.py`` are not on PyPI):
  pass ``code_dir`` (or set ``FLOWRL_VIDEOALIGN_CODE``), or ``inference_module`` naming an importable
  module that defines ``VideoVLMRewardInference`` (DanceGRPO vendors it as
  ``fastvideo.models.videoalign.inference``);
* the checkpoint directory (``git clone https://huggingface.co/KwaiVGI/VideoReward``) as ``checkpoint``;
* transformers with Qwen2-VL, plus that code's own imports (peft, a video reader such as decord or
  torchvision); its ``inference.py`` builds the model with ``disable_flash_attn2=False``, i.e.
  flash-attention 2, which needs the ``flash-attn`` package and a CUDA GPU;
* OpenCV (``opencv-python-headless``) to write the videos as mp4 files, the input VideoAlign reads.

Input: videos float32 (B, C, T, H, W) in [0, 1]. Not differentiable. Nothing is imported or loaded
until the first call.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.types import RewardOutput

DIMENSIONS = ("VQ", "MQ", "TA")
OVERALL = "Overall"
CONFIG_FILE = "model_config.json"
CODE_ENV = "FLOWRL_VIDEOALIGN_CODE"

Stats = dict[str, tuple[float, float]]


def standardize(raw: Tensor | float, mean: float, std: float) -> Tensor | float:
    """VideoAlign's ``use_norm``: ``(raw - mean) / std`` (per dimension, statistics from the checkpoint)."""
    if not std > 0:
        raise FlowRLError(f"a VideoAlign normalisation std must be positive, got {std}.")
    return (raw - mean) / std


def denormalize(normalized: Tensor | float, mean: float, std: float) -> Tensor | float:
    """The inverse of :func:`standardize`: ``normalized * std + mean`` gives the raw head output back."""
    if not std > 0:
        raise FlowRLError(f"a VideoAlign normalisation std must be positive, got {std}.")
    return normalized * std + mean


def read_inference_config(checkpoint: str | Path) -> Stats | None:
    """{"VQ": (mean, std), "MQ": ..., "TA": ...} from ``checkpoint/model_config.json``; None if it has none."""
    path = Path(checkpoint)
    path = path if path.is_file() else path / CONFIG_FILE
    if not path.is_file():
        raise FlowRLError(f"no VideoAlign {CONFIG_FILE} at {path}; pass the VideoReward checkpoint directory.")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise FlowRLError(f"VideoAlign config {path} is not readable JSON ({e}).") from e
    section = config.get("inference_config")
    if section is None:
        return None
    try:
        return {d: (float(section[f"{d}_mean"]), float(section[f"{d}_std"])) for d in DIMENSIONS}
    except KeyError as e:
        raise FlowRLError(f"VideoAlign config {path} has an inference_config without {e.args[0]}.") from e


def expand_use(use: Sequence[str] | str) -> list[str]:
    """Validate the dimensions to combine; "Overall" means VQ + MQ + TA, as in VideoAlign."""
    names = [use] if isinstance(use, str) else list(use)
    if not names:
        raise FlowRLError("VideoAlign `use` needs at least one of VQ, MQ, TA, Overall.")
    out: list[str] = []
    for n in names:
        if n == OVERALL:
            out.extend(DIMENSIONS)
        elif n in DIMENSIONS:
            out.append(n)
        else:
            raise FlowRLError(f"unknown VideoAlign dimension '{n}'; choose from VQ, MQ, TA, Overall.")
    return out


def combine(scores: Mapping[str, Tensor], use: Sequence[str] | str, weights: Mapping[str, float] | None = None) -> Tensor:
    """sum over the dimensions in ``use`` (with repetition, so ["Overall"] = VQ + MQ + TA) of weight_d * score_d."""
    weights = weights or {}
    dims = expand_use(use)
    total = torch.zeros_like(scores[dims[0]], dtype=torch.float32)
    for d in dims:
        total = total + float(weights.get(d, 1.0)) * scores[d].float()
    return total


def write_mp4(video: np.ndarray, path: str | Path, fps: float) -> None:
    """Write one (C, T, H, W) float [0, 1] video as an mp4 (MPEG-4 part 2) file with OpenCV."""
    try:
        import cv2
    except ImportError as e:
        raise FlowRLError("the videoalign reward writes videos with OpenCV; install it with `pip install opencv-python-headless`.") from e
    frames = np.clip(np.round(video * 255.0), 0, 255).astype(np.uint8).transpose(1, 2, 3, 0)  # T, H, W, C
    if frames.shape[-1] == 1:
        frames = np.repeat(frames, 3, axis=-1)
    height, width = frames.shape[1:3]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), float(fps), (width, height))
    if not writer.isOpened():
        raise FlowRLError(f"OpenCV could not open an mp4 writer for {path}.")
    try:
        for frame in frames:
            writer.write(np.ascontiguousarray(frame[..., ::-1]))  # RGB -> BGR
    finally:
        writer.release()


def load_videoalign_inferencer(
    checkpoint: str | Path,
    code_dir: str | Path | None = None,
    inference_module: str | None = None,
    device: str | None = None,
    dtype: str = "bfloat16",
):
    """Build VideoAlign's own ``VideoVLMRewardInference`` for ``checkpoint`` (raises FlowRLError if unavailable)."""
    ckpt = Path(checkpoint)
    if not (ckpt / CONFIG_FILE).is_file():
        raise FlowRLError(
            f"no VideoAlign checkpoint at {ckpt} ({CONFIG_FILE} missing); download KwaiVGI/VideoReward and pass its directory."
        )
    try:
        from transformers import Qwen2VLForConditionalGeneration  # noqa: F401
    except ImportError as e:
        raise FlowRLError("the videoalign reward needs a transformers release with Qwen2-VL (`pip install -U transformers`).") from e
    try:
        if inference_module is not None:
            module = importlib.import_module(inference_module)
        else:
            code = code_dir or os.environ.get(CODE_ENV)
            if code is None or not (Path(code) / "inference.py").is_file():
                raise FlowRLError(
                    "the videoalign reward needs the VideoAlign code (not on PyPI): clone github.com/KwaiVGI/VideoAlign "
                    f"and pass code_dir (or set {CODE_ENV}), or pass inference_module."
                )
            # inference.py imports its siblings (data, utils, train_reward, ...) as top-level modules.
            if str(Path(code).resolve()) not in sys.path:
                sys.path.insert(0, str(Path(code).resolve()))
            spec = importlib.util.spec_from_file_location("flowrl_videoalign_inference", Path(code) / "inference.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
    except ImportError as e:
        raise FlowRLError(
            f"the VideoAlign code could not be imported: {e}; install its requirements (peft, a video reader, flash-attn)."
        ) from e
    cls = getattr(module, "VideoVLMRewardInference", None)
    if cls is None:
        raise FlowRLError("the VideoAlign inference module defines no VideoVLMRewardInference.")
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(dtype)
    if torch_dtype is None:
        raise FlowRLError(f"videoalign dtype must be bfloat16, float16 or float32, got {dtype!r}.")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return cls(str(ckpt), device=device, dtype=torch_dtype)


class VideoAlignReward:
    """score = sum_{d in use} weight_d * standardize(raw_d); see the module docstring.

    ``backend`` may be any object with VideoAlign's ``reward(video_paths, prompts, fps=None,
    num_frames=None, use_norm=...) -> list[{"VQ", "MQ", "TA"} dict]``; by default the real one is
    built on the first call. flowrl always asks it for raw outputs (``use_norm=False``) and applies the
    checkpoint's statistics itself, so the tested :func:`standardize` is the one that runs.
    Extras: ``VQ``, ``MQ``, ``TA`` (standardised when ``use_norm``) and ``Overall`` (their sum).
    """

    name = "videoalign"
    differentiable = False

    def __init__(
        self,
        checkpoint: str | Path | None = None,
        code_dir: str | Path | None = None,
        inference_module: str | None = None,
        use: Sequence[str] | str = ("MQ",),
        weights: Mapping[str, float] | None = None,
        use_norm: bool = True,
        stats: Mapping[str, Sequence[float]] | None = None,
        video_fps: float = 8.0,
        sample_fps: float | None = None,
        num_frames: int | None = None,
        device: str | None = None,
        dtype: str = "bfloat16",
        backend: Any = None,
    ) -> None:
        """
        Args:
            checkpoint: the VideoReward checkpoint directory (holds model_config.json).
            code_dir: a checkout of VideoAlign's code (its inference.py; or set FLOWRL_VIDEOALIGN_CODE).
            inference_module: an importable module with VideoAlign's inference code, instead of code_dir.
            use: dimensions to add up, e.g. ["MQ"] (DanceGRPO), ["VQ", "MQ"], ["Overall"].
            weights: {dimension: weight} of the sum (default 1 each).
            use_norm: standardise raw outputs with the checkpoint's statistics (VideoAlign's default).
            stats: {"MQ": (mean, std), ...} to use instead of the checkpoint's inference_config.
            video_fps: frame rate the mp4 files are written at.
            sample_fps: frames per second VideoAlign samples the videos at (None: the checkpoint's data_config).
            num_frames: frames VideoAlign samples per video, instead of sample_fps.
            backend: an object with VideoAlign's reward(...) method to use instead of building the real one (tests).
            device: where the model runs; None: CUDA when present, else the CPU.
            dtype: precision of the model's weights.
        """
        self.use = expand_use(use)
        self.weights = dict(weights or {})
        unknown = set(self.weights) - set(DIMENSIONS)
        if unknown:
            raise FlowRLError(f"VideoAlign weights name unknown dimensions {sorted(unknown)}; use VQ, MQ, TA.")
        if sample_fps is not None and num_frames is not None:
            raise FlowRLError("videoalign takes sample_fps or num_frames, not both.")
        self.checkpoint = checkpoint
        self.code_dir = code_dir
        self.inference_module = inference_module
        self.use_norm = use_norm
        self.stats: Stats | None = {d: (float(stats[d][0]), float(stats[d][1])) for d in DIMENSIONS} if stats is not None else None
        self.video_fps = video_fps
        self.sample_fps = sample_fps
        self.num_frames = num_frames
        self.device = device
        self.dtype = dtype
        self._backend = backend

    @property
    def backend(self):
        if self._backend is None:
            if self.checkpoint is None:
                raise FlowRLError("the videoalign reward needs checkpoint= (a download of KwaiVGI/VideoReward) and the VideoAlign code.")
            self._backend = load_videoalign_inferencer(self.checkpoint, self.code_dir, self.inference_module, self.device, self.dtype)
        return self._backend

    def normalization(self) -> Stats | None:
        if not self.use_norm:
            return None
        if self.stats is None:
            if self.checkpoint is None:
                raise FlowRLError("videoalign use_norm needs the checkpoint's statistics: pass checkpoint= or stats=.")
            self.stats = read_inference_config(self.checkpoint)
            if self.stats is None:
                raise FlowRLError(f"the VideoAlign config in {self.checkpoint} has no inference_config; pass stats= or use_norm=False.")
        return self.stats

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        if samples.ndim != 5 or samples.shape[1] not in (1, 3):
            raise FlowRLError(f"the videoalign reward reads videos (B, 1 or 3, T, H, W) in [0, 1], got shape {tuple(samples.shape)}.")
        stats = self.normalization()
        backend = self.backend
        videos = samples.detach().float().clamp(0, 1).cpu().numpy()
        with tempfile.TemporaryDirectory(prefix="flowrl_videoalign_") as tmp:
            paths = []
            for i, video in enumerate(videos):
                path = os.path.join(tmp, f"video_{i}.mp4")
                write_mp4(video, path, self.video_fps)
                paths.append(path)
            kwargs: dict[str, Any] = {"use_norm": False}
            if self.sample_fps is not None:
                kwargs["fps"] = self.sample_fps
            if self.num_frames is not None:
                kwargs["num_frames"] = self.num_frames
            with torch.no_grad():
                raw = backend.reward(paths, list(prompts), **kwargs)
        if len(raw) != len(paths):
            raise FlowRLError(f"VideoAlign returned {len(raw)} scores for {len(paths)} videos.")
        dims: dict[str, Tensor] = {}
        for d in DIMENSIONS:
            values = torch.tensor([float(r[d]) for r in raw], dtype=torch.float64)
            if stats is not None:
                values = standardize(values, *stats[d])
            dims[d] = values.float().to(samples.device)
        scores = combine(dims, self.use, self.weights)
        extras = dict(dims)
        extras[OVERALL] = dims["VQ"] + dims["MQ"] + dims["TA"]
        return RewardOutput(scores=scores, extras=extras)
