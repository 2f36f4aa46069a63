"""What every CLIP-based reward shares: loading, image preprocessing (differentiable and reference),
and normalised image / text embeddings.

Two preprocessing paths produce the ``pixel_values`` a CLIP vision tower reads:

* ``ClipPreprocess`` (the differentiable path): pure torch on (B, C, H, W) images in [0, 1]. Resize the
  shortest side to the processor's size with antialiased bicubic interpolation (separably, as PIL),
  center-crop, normalise with the processor's mean / std. Gradients flow back to the images, which direct reward
  backpropagation needs.
* ``processor_pixel_values`` (the reference path): the real transformers image processor
  (``CLIPImageProcessor``) applied to the images quantised to uint8, exactly as a user of the model card
  would call it. Not differentiable.

The two agree closely but not bit-for-bit; see ``ClipPreprocess`` for why.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from flowrl.errors import FlowRLError

# The OpenAI CLIP normalisation constants (CLIP's clip/clip.py `_transform`); also what
# transformers' CLIPImageProcessor, open_clip's ViT-H-14 laion2b weights and ImageReward use.
OPENAI_CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(name: str) -> torch.dtype:
    """Map a config dtype string to a torch dtype (FlowRLError for anything else)."""
    if name not in DTYPES:
        raise FlowRLError(f"unknown reward model dtype '{name}'; choose one of: {', '.join(DTYPES)}.")
    return DTYPES[name]


# --------------------------------------------------------------------------------------------------
# Where weights come from
# --------------------------------------------------------------------------------------------------


def looks_local(pretrained: str | Path) -> bool:
    """True if ``pretrained`` names a local path rather than a hub id like ``org/name``.

    Anything that exists on disk is local; so is anything that starts like a path (``/``, ``.``, ``~``)
    or has more than one ``/`` (hub ids have exactly one), so a mistyped directory is reported as a
    missing directory instead of being sent to the hub.
    """
    s = str(pretrained)
    if Path(s).expanduser().exists():
        return True
    return s.startswith(("/", ".", "~", "\\")) or s.count("/") > 1 or (len(s) > 1 and s[1] == ":")


def require_local_dir(path: str | Path, what: str) -> Path:
    """Return ``path`` as a directory or raise FlowRLError naming it."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FlowRLError(f"{what} directory {p} does not exist; pass a hub id or a directory written by save_pretrained.")
    if not p.is_dir():
        raise FlowRLError(f"{what} path {p} is not a directory; pass the directory written by save_pretrained.")
    return p


def from_pretrained(loader: Callable[[str], Any], source: str | Path, what: str) -> Any:
    """Call ``loader(source)`` turning every failure into one FlowRLError sentence that names the source."""
    from huggingface_hub import constants

    from flowrl.hub import check_hub, hub_unreachable, is_connection_failure

    local = looks_local(source)
    src = str(require_local_dir(source, what)) if local else str(source)
    instead = "pass that directory instead of the hub id"
    # a hub id, online: the hub is probed first (bounded by HF_HUB_ETAG_TIMEOUT); unreachable, a cached model is read
    # from the cache and an uncached one is one sentence saying so (offline, huggingface_hub answers from the cache at once)
    online = not local and not constants.HF_HUB_OFFLINE
    local_only = online and check_hub(src, None, what, instead)
    try:
        return loader(src, local_files_only=True) if local_only else loader(src)
    except FlowRLError:
        raise
    except Exception as e:  # transformers raises OSError, ValueError, safetensors errors, HTTP errors...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if local:
            raise FlowRLError(f"{what} at {src} could not be loaded; it is missing files or corrupt ({first}).") from e
        if online and is_connection_failure(e):  # the network went away after the probe
            raise hub_unreachable(src, what, instead) from None
        raise FlowRLError(
            f"{what} '{src}' could not be loaded from the Hugging Face hub or its cache ({first}); "
            "download it while online or pass a local directory."
        ) from e


def load_clip_model(pretrained: str | Path, dtype: torch.dtype = torch.float32):
    """Load a frozen ``transformers.CLIPModel`` (eval mode, no grad) from a hub id or a directory."""
    from transformers import CLIPModel

    model = from_pretrained(CLIPModel.from_pretrained, pretrained, "CLIP model")
    model = model.to(dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def load_clip_processor(pretrained: str | Path):
    """Load the processor (image processor + tokenizer) saved beside a CLIP model."""
    from transformers import AutoProcessor

    processor = from_pretrained(AutoProcessor.from_pretrained, pretrained, "CLIP processor")
    if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        raise FlowRLError(
            f"the processor at {pretrained} has no image processor and tokenizer; "
            "a CLIP reward needs both (save them with CLIPProcessor.save_pretrained)."
        )
    return processor


# --------------------------------------------------------------------------------------------------
# Preprocessing
# --------------------------------------------------------------------------------------------------


def _field(obj: Any, key: str) -> Any:
    # transformers 4.x stores size dicts as dicts, 5.x as SizeDict objects with attributes.
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(key)
    return getattr(obj, key, None)


def as_rgb(samples: Tensor) -> Tensor:
    """(B, 1|3, H, W) -> (B, 3, H, W) float; grayscale is repeated to three channels."""
    if samples.ndim != 4 or samples.shape[1] not in (1, 3):
        raise FlowRLError(f"image rewards read (B, 1 or 3, H, W) images in [0, 1], got shape {tuple(samples.shape)}.")
    if samples.shape[1] == 1:
        samples = samples.expand(-1, 3, -1, -1)
    return samples


def shortest_edge_size(height: int, width: int, size: int) -> tuple[int, int]:
    """Output (h, w) of resizing the shortest side to ``size``; the long side is floored, as transformers'
    ``get_resize_output_image_size`` and torchvision's ``Resize(int)`` both do."""
    if height <= width:
        return size, int(size * width / height)
    return int(size * height / width), size


@dataclass(frozen=True)
class ClipPreprocess:
    """Differentiable CLIP preprocessing in torch, configured like a transformers CLIP image processor.

    It reproduces PIL's resize, which the processor (and OpenAI CLIP's own ``_transform``) uses:

    * PIL resizes separably, horizontal pass first, and clips the intermediate image to 0..255 between
      the passes. Bicubic overshoots at sharp edges, so that intermediate clip matters (a single 2-D
      torch resize with one clamp at the end differs by up to 0.07 after normalisation on skimage's
      astronaut, 0.28 when upsampling a 64 px image). Here: resize the width, clamp to [0, 1], resize the
      height, clamp. The clamps pass gradients everywhere except where an overshoot was cut.
    * Both use the same antialiased bicubic kernel: torch's ``antialias=True`` path is a port of PIL's
      (a = -0.5, support scaled by the downsampling factor, renormalised at the borders).
    * What remains is quantisation: the processor reads uint8 and PIL rounds each pass to uint8; this
      path stays in float (that keeps it differentiable). One uint8 step is 1/255 = 0.0039 before
      normalisation, 0.0039 / 0.26 = 0.015 after; tests/test_model_rewards.py measures a max abs
      difference of about 0.015 (mean about 0.004) on real photographs, downsampled and upsampled.
    * The crop offset is floored, as transformers does (torchvision's CenterCrop, used by OpenAI CLIP's
      ``_transform``, rounds instead: at most one pixel of shift when the margin is odd).
    """

    size: int | tuple[int, int] = 224  # int: shortest edge; (h, w): exact size
    crop: tuple[int, int] | None = (224, 224)
    mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    std: tuple[float, ...] = OPENAI_CLIP_STD

    @classmethod
    def openai(cls, size: int) -> ClipPreprocess:
        """OpenAI CLIP's own preprocessing (``clip.py``'s ``_transform``) at ``size``: shortest side to ``size``, a center
        crop of ``size`` x ``size``, the OpenAI mean / std; what HPSv2 and ImageReward read."""
        return cls(size=size, crop=(size, size), mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD)

    @classmethod
    def from_image_processor(cls, ip: Any) -> ClipPreprocess:
        """Read size, crop, mean and std from a transformers image processor (4.x dicts or 5.x SizeDicts)."""
        size_cfg = getattr(ip, "size", None)
        shortest = _field(size_cfg, "shortest_edge")
        if getattr(ip, "do_resize", True) is False:
            raise FlowRLError("CLIP rewards expect an image processor that resizes (do_resize=True).")
        if shortest:
            size: int | tuple[int, int] = int(shortest)
        elif _field(size_cfg, "height") and _field(size_cfg, "width"):
            size = (int(_field(size_cfg, "height")), int(_field(size_cfg, "width")))
        elif isinstance(size_cfg, int):
            size = int(size_cfg)
        else:
            raise FlowRLError(f"unsupported image processor size {size_cfg!r}; expected shortest_edge or height/width.")
        crop = None
        if getattr(ip, "do_center_crop", False):
            c = getattr(ip, "crop_size", None)
            crop = (int(c), int(c)) if isinstance(c, int) else (int(_field(c, "height")), int(_field(c, "width")))
        mean = tuple(float(v) for v in (getattr(ip, "image_mean", None) or OPENAI_CLIP_MEAN))
        std = tuple(float(v) for v in (getattr(ip, "image_std", None) or OPENAI_CLIP_STD))
        resample = getattr(ip, "resample", None)
        # PIL's BICUBIC is 3; torchvision-backed processors may hold InterpolationMode.BICUBIC instead.
        if resample is not None and str(getattr(resample, "value", resample)).lower() not in ("3", "bicubic"):
            raise FlowRLError(f"CLIP rewards reproduce bicubic resizing only; the image processor asks for resample={resample!r}.")
        return cls(size=size, crop=crop, mean=mean, std=std)

    def __call__(self, samples: Tensor) -> Tensor:
        """(B, 1|3, H, W) images in [0, 1] -> (B, 3, h, w) normalised pixel values, keeping the graph."""
        x = as_rgb(samples).float()
        h, w = x.shape[-2:]
        out_hw = shortest_edge_size(h, w, self.size) if isinstance(self.size, int) else tuple(self.size)
        # Separable like PIL: width first, clip, then height, clip (see the class docstring). A bicubic
        # resize along an axis whose size does not change is the identity, so each call is one pass.
        if out_hw[1] != w:
            x = F.interpolate(x, size=(h, out_hw[1]), mode="bicubic", antialias=True, align_corners=False).clamp(0.0, 1.0)
        if out_hw[0] != h:
            x = F.interpolate(x, size=tuple(out_hw), mode="bicubic", antialias=True, align_corners=False).clamp(0.0, 1.0)
        x = x.clamp(0.0, 1.0)
        if self.crop is not None:
            x = center_crop(x, self.crop)
        mean = torch.tensor(self.mean, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        return (x - mean) / std


def center_crop(x: Tensor, crop: tuple[int, int]) -> Tensor:
    """Center crop (B, C, H, W) to ``crop``, zero-padding first when the image is smaller (as transformers)."""
    ch, cw = crop
    h, w = x.shape[-2:]
    if ch > h or cw > w:
        ph, pw = max(ch - h, 0), max(cw - w, 0)
        # transformers puts the extra pixel of an odd pad on top / left (ceil), then crops.
        x = F.pad(x, (math.ceil(pw / 2), pw // 2, math.ceil(ph / 2), ph // 2))
        h, w = x.shape[-2:]
    top, left = (h - ch) // 2, (w - cw) // 2
    return x[..., top : top + ch, left : left + cw]


def to_uint8_images(samples: Tensor) -> list[np.ndarray]:
    """(B, 1|3, H, W) in [0, 1] -> B uint8 (H, W, 3) arrays, the input an image processor expects."""
    x = as_rgb(samples.detach()).float().clamp(0.0, 1.0)
    arr = (x * 255.0).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [a for a in arr]


def processor_pixel_values(image_processor: Any, samples: Tensor) -> Tensor:
    """Pixel values from the real transformers image processor (PIL resize); not differentiable."""
    out = image_processor(images=to_uint8_images(samples), return_tensors="pt")
    return out["pixel_values"].to(samples.device)


# --------------------------------------------------------------------------------------------------
# Embeddings
# --------------------------------------------------------------------------------------------------


def _features(out: Any) -> Tensor:
    # transformers 4.x returns the projected tensor; 5.x returns a ModelOutput whose pooler_output is it.
    return out if isinstance(out, Tensor) else out.pooler_output


def image_embeddings(model: Any, pixel_values: Tensor) -> Tensor:
    """(B, D) L2-normalised float32 image embeddings of a CLIPModel, keeping the graph to the pixels."""
    dtype = next(model.parameters()).dtype
    feats = _features(model.get_image_features(pixel_values=pixel_values.to(dtype))).float()
    return F.normalize(feats, dim=-1)


def text_embeddings(model: Any, tokenizer: Any, prompts: Sequence[str], device: torch.device | str) -> Tensor:
    """(B, D) L2-normalised float32 text embeddings (no grad; prompts are not optimised).

    Each distinct prompt is encoded once (a GRPO group repeats its prompt), padded to the longest and
    truncated to the text tower's context length (77 for CLIP), as the PickScore README tokenises.
    """
    unique = list(dict.fromkeys(prompts))
    max_len = int(getattr(model.config.text_config, "max_position_embeddings", 77))
    tokens = tokenizer(list(unique), padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    with torch.no_grad():
        feats = _features(
            model.get_text_features(input_ids=tokens["input_ids"].to(device), attention_mask=tokens["attention_mask"].to(device))
        ).float()
    feats = F.normalize(feats, dim=-1)
    index = torch.tensor([unique.index(p) for p in prompts], device=feats.device)
    return feats[index]


def check_batch(samples: Tensor, prompts: Sequence[str]) -> None:
    if len(prompts) != samples.shape[0]:
        raise FlowRLError(f"got {samples.shape[0]} images but {len(prompts)} prompts; give one prompt per image.")


def outside_inference_mode(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with inference mode off: weights created or moved under a caller's
    ``torch.inference_mode()`` would be inference tensors and break every later differentiable call."""
    with torch.inference_mode(False):
        return fn()


class LazyLoadedModel:
    """A reward whose model loads on first use (``_load`` sets ``_model``) and follows the samples'
    device unless ``device`` pins it. Loading happens outside inference mode so later calls can take
    gradients through it.

    Its subclasses' constructors take (described once here, for the config reference):

    Args:
        device: where the model runs, e.g. "cuda:1"; None: the samples' device.
        dtype: precision of the model's weights ("float32", "bfloat16" or "float16").
    """

    _model: Any = None
    device: str | None = None
    _load: Any  # each reward's own loader: sets self._model

    def model_on(self, device: torch.device) -> Any:
        """The loaded model on ``self.device`` or ``device``; loads on first use."""
        if self._model is None:
            outside_inference_mode(self._load)
        target = torch.device(self.device) if self.device is not None else device
        self._model = outside_inference_mode(lambda: self._model.to(target))
        return self._model


@dataclass(eq=False, repr=False)
class PretrainedReward(LazyLoadedModel):
    """A lazily loaded reward model read from ``pretrained``: the constructor parameters every such reward takes,
    declared once. A subclass is a dataclass too; its own parameters follow these three (a default for
    ``pretrained`` among them), so its constructor, and the config section read from it, list pretrained, device and
    dtype first. Construction loads nothing; ``dtype`` becomes the torch dtype it names."""

    pretrained: str
    device: str | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        self.dtype = parse_dtype(self.dtype)
        self._model: Any = None


@dataclass(eq=False, repr=False)
class ClipBackedReward(PretrainedReward):
    """Lazy, frozen CLIPModel + processor shared by the CLIP-family rewards.

    Nothing is loaded in ``__init__``; the first call loads the model onto ``device`` (or the samples'
    device when None) in ``dtype``. ``differentiable=True`` preprocesses in torch (gradients reach the
    samples); ``differentiable=False`` uses the real transformers image processor under no_grad.

    Args:
        pretrained: hub id or directory holding the CLIP model and its processor.
        processor: where the processor comes from instead (a hub id or a directory); None: pretrained.
        differentiable: preprocess in torch so gradients reach the samples; false: the transformers image
            processor (PIL) under no_grad.
    """

    name = "clip"
    processor: str | None = None
    differentiable: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.processor_source = self.processor if self.processor is not None else self.pretrained
        self.differentiable = bool(self.differentiable)
        self._processor: Any = None
        self._preprocess: ClipPreprocess | None = None

    # ---- loading -----------------------------------------------------------------------------
    def _load(self) -> None:
        model = load_clip_model(self.pretrained, self.dtype)
        processor = load_clip_processor(self.processor_source)
        self._preprocess = ClipPreprocess.from_image_processor(processor.image_processor)
        self._processor = processor
        self._model = model

    @property
    def clip_processor(self) -> Any:
        """The loaded processor (image processor + tokenizer); loads on first use."""
        if self._processor is None:
            outside_inference_mode(self._load)
        return self._processor

    @property
    def preprocess(self) -> ClipPreprocess:
        if self._preprocess is None:
            outside_inference_mode(self._load)
        assert self._preprocess is not None
        return self._preprocess

    # ---- embeddings --------------------------------------------------------------------------
    def pixel_values(self, samples: Tensor, device: torch.device) -> Tensor:
        """The model's input: torch preprocessing (differentiable) or the image processor (no graph)."""
        if self.differentiable:
            return self.preprocess(samples.to(device))
        return processor_pixel_values(self.clip_processor.image_processor, samples).to(device)

    def embed_images(self, samples: Tensor) -> Tensor:
        """(B, D) normalised float32 image embeddings on the model's device."""
        model = self.model_on(samples.device)
        device = next(model.parameters()).device
        with torch.set_grad_enabled(self.differentiable and torch.is_grad_enabled()):
            return image_embeddings(model, self.pixel_values(samples, device))

    def embed(self, samples: Tensor, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Normalised (image, text) embeddings, (B, D) float32 each, on the model's device."""
        check_batch(samples, prompts)
        img = self.embed_images(samples)
        txt = text_embeddings(self._model, self.clip_processor.tokenizer, prompts, img.device)
        return img, txt


__all__ = [
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "ClipBackedReward",
    "PretrainedReward",
    "ClipPreprocess",
    "center_crop",
    "image_embeddings",
    "load_clip_model",
    "load_clip_processor",
    "parse_dtype",
    "processor_pixel_values",
    "text_embeddings",
    "to_uint8_images",
]


def read_state_dict(file: Path, what: str) -> dict[str, Tensor]:
    """Read a tensor state dict from ``.safetensors`` or a ``.pth`` (``weights_only``: never unpickle
    code); accept a ``{"state_dict": ...}`` wrapper; every problem is one sentence naming ``what``."""
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(file))
        else:
            state = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FlowRLError(f"{what} at {file} are corrupt or not a state dict ({first}).") from e
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise FlowRLError(f"{what} at {file} are not a state dict of tensors.")
    return dict(state)
