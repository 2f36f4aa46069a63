"""HPSv2 / HPSv2.1 (Wu et al. 2023, "Human Preference Score v2"): an open_clip ViT-H/14 fine-tuned on
HPD v2 human preferences.

Needs the optional extra ``hps`` (``pip install 'flowrl[hps]'``, i.e. ``open-clip-torch``, which in turn
needs a torchvision build matching the installed torch). Without it, building the reward works and
the first call raises a FlowRLError naming the extra. The checkpoint (``HPS_v2.1_compressed.pt`` or
``HPS_v2_compressed.pt`` from the hub repo ``xswu/HPSv2``) holds the full CLIP state dict under
``"state_dict"``; it replaces every weight, so no base laion2b download is needed.

Score, exactly as ``hpsv2.score`` (``hpsv2/img_score.py``) computes it: the model's forward returns
L2-normalised image and text features, ``logits_per_image = image_features @ text_features.T``, and the
reported score is the diagonal, i.e. the cosine of each image with its own prompt (about 0.2-0.35).
The HPSv2 README / benchmark tables print that number times 100 (``evaluation.py`` multiplies the
mean by 100); ``scale=100`` reproduces those numbers. Note that ``logit_scale`` is *not* applied,
unlike PickScore.

What was verified here: the scoring function ``hps_scores`` on given embeddings, and the error when
open_clip is missing. The loading code follows ``hpsv2/img_score.py`` (ViT-H-14, ``load_state_dict``
of ``checkpoint["state_dict"]``, ``get_tokenizer("ViT-H-14")``) but could not run here, because
open_clip imports torchvision and no matching torchvision is installable in this environment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.hub import download_files
from flowrl.reward_models.clip_common import (
    ClipPreprocess,
    PretrainedReward,
    as_rgb,
    check_batch,
    looks_local,
    to_uint8_images,
)
from flowrl.types import RewardOutput

DEFAULT_REPO = "xswu/HPSv2"
CHECKPOINTS = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}
ARCH = "ViT-H-14"
EXTRA_HINT = "pip install 'flowrl[hps]' (open-clip-torch, with a torchvision matching your torch)"


def hps_scores(image_features: Tensor, text_features: Tensor, scale: float = 1.0) -> Tensor:
    """HPS of image i for prompt i: ``scale * diag(normalize(img) @ normalize(txt).T)`` as (B,) float32.

    Computed row by row (no B x B matrix). The features are normalised here too; open_clip already
    returns normalised features, and normalising twice changes nothing.
    """
    if image_features.shape != text_features.shape or image_features.ndim != 2:
        raise FlowRLError(
            f"HPS needs (B, D) image and text features of one shape, got {tuple(image_features.shape)} and {tuple(text_features.shape)}."
        )
    img = F.normalize(image_features.float(), dim=-1)
    txt = F.normalize(text_features.float(), dim=-1)
    return scale * (img * txt).sum(dim=-1)


def import_open_clip() -> Any:
    """Import open_clip or raise FlowRLError naming the extra (also when torchvision is broken)."""
    try:
        import open_clip  # type: ignore[import-not-found]
    except ImportError as e:
        raise FlowRLError(f"the hpsv2 reward needs the open_clip package, which is not installed: {EXTRA_HINT}.") from e
    except Exception as e:  # open_clip imports torchvision, which fails loudly when built for another torch
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FlowRLError(f"open_clip is installed but failed to import ({first}); {EXTRA_HINT}.") from e
    return open_clip


def resolve_checkpoint(pretrained: str, version: str) -> Path:
    """A local checkpoint file, a directory holding the version's file, or a hub repo to download from."""
    if version not in CHECKPOINTS:
        raise FlowRLError(f"unknown HPS version '{version}'; choose one of: {', '.join(CHECKPOINTS)}.")
    filename = CHECKPOINTS[version]
    if looks_local(pretrained):
        p = Path(pretrained).expanduser()
        file = p / filename if p.is_dir() else p
        if not file.is_file():
            raise FlowRLError(f"HPS checkpoint not found at {file}; download {filename} from the hub repo {DEFAULT_REPO}.")
        return file
    (file,) = download_files(pretrained, [filename], "download it while online and pass its path as pretrained")
    return file


@dataclass(eq=False, repr=False)
class HPSv2Reward(PretrainedReward):
    """HPSv2.1 score of each image for its prompt (cosine; ``scale=100`` for the README's numbers).

    Args:
        pretrained: hub repo (default ``xswu/HPSv2``), a checkpoint file, or a directory holding it.
        version: "v2.1" (default) or "v2.0".
        differentiable: flowrl's torch preprocessing with open_clip's geometry (resize shortest side to 224
            bicubic, center crop 224, OpenAI CLIP mean / std); false: open_clip's own preprocess_val under no_grad.
        scale: factor on the cosine score (100 for the README's numbers).
    """

    name = "hpsv2"

    pretrained: str = DEFAULT_REPO
    version: str = "v2.1"
    differentiable: bool = True
    scale: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.differentiable, self.scale = bool(self.differentiable), float(self.scale)
        self.preprocess = ClipPreprocess.openai(224)
        self._tokenizer: Any = None
        self._preprocess_val: Any = None

    def _load(self) -> None:
        open_clip = import_open_clip()
        file = resolve_checkpoint(self.pretrained, self.version)
        model, _, preprocess_val = open_clip.create_model_and_transforms(ARCH, pretrained=None, precision="fp32", device="cpu")
        try:
            checkpoint = torch.load(str(file), map_location="cpu", weights_only=True)
            state = checkpoint["state_dict"] if isinstance(checkpoint, dict) and "state_dict" in checkpoint else checkpoint
            model.load_state_dict(state)
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise FlowRLError(f"HPS checkpoint at {file} is corrupt or does not fit open_clip {ARCH} ({first}).") from e
        model = model.to(self.dtype)
        model.eval()
        model.requires_grad_(False)
        self._tokenizer = open_clip.get_tokenizer(ARCH)
        self._preprocess_val = preprocess_val
        self._model = model

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        check_batch(samples, prompts)
        as_rgb(samples)  # shape check before any loading
        model = self.model_on(samples.device)
        device = next(model.parameters()).device
        if self.differentiable:
            pixels = self.preprocess(samples.to(device))
        else:
            from PIL import Image

            with torch.no_grad():
                pixels = torch.stack([self._preprocess_val(Image.fromarray(a)) for a in to_uint8_images(samples)]).to(device)
        with torch.set_grad_enabled(self.differentiable and torch.is_grad_enabled()):
            img = model.encode_image(pixels.to(self.dtype), normalize=True)
        with torch.no_grad():
            txt = model.encode_text(self._tokenizer(list(prompts)).to(device), normalize=True)
        scores = hps_scores(img, txt, self.scale)
        return RewardOutput(scores=scores.float().to(samples.device))
