"""LAION aesthetic predictor v2 ("improved-aesthetic-predictor", Schuhmann 2022), the reward of DDPO,
DRaFT, AlignProp and Flow-GRPO's aesthetic runs.

Score = MLP head applied to the L2-normalised CLIP ViT-L/14 image embedding. The head predicts an AVA
style mean rating on a 1-10 scale (real photographs land around 4-7). The released head is
``sac+logos+ava1-l14-linearMSE.pth`` from github.com/christophschuhmann/improved-aesthetic-predictor:
download it and pass its path as ``head_path`` (a ``.safetensors`` file with the same keys works too).
The CLIP model defaults to ``openai/clip-vit-large-patch14``, the transformers port of the OpenAI
ViT-L/14 that the reference (``simple_inference.py``) loads through the ``clip`` package.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.errors import FlowRLError
from flowrl.reward_models.clip_common import ClipBackedReward, outside_inference_mode, read_state_dict
from flowrl.types import RewardOutput

DEFAULT_MODEL = "openai/clip-vit-large-patch14"
HEAD_FILE_NAME = "sac+logos+ava1-l14-linearMSE.pth"


class AestheticHead(nn.Module):
    """The reference ``MLP`` of improved-aesthetic-predictor, layer for layer (state-dict keys
    ``layers.0``, ``layers.2``, ``layers.4``, ``layers.6``, ``layers.7``).

    There are no activations between the Linear layers: the reference has them commented out
    (``#nn.ReLU()``), and the released weights were trained that way, so the head is an affine map of
    the embedding. The dropouts are inert in eval mode and kept only so the keys line up.
    """

    def __init__(self, input_dim: int = 768) -> None:
        super().__init__()
        self.input_dim = input_dim
        self.layers = nn.Sequential(
            nn.Linear(input_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings: Tensor) -> Tensor:
        """(B, input_dim) normalised embeddings -> (B,) predicted ratings."""
        return self.layers(embeddings).squeeze(-1)


def load_head_state(path: str | Path) -> dict[str, Tensor]:
    """Read a head state dict from ``.safetensors`` or the original ``.pth`` (tensors only)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FlowRLError(
            f"aesthetic head weights not found at {file}; download {HEAD_FILE_NAME} from "
            "github.com/christophschuhmann/improved-aesthetic-predictor and pass its path as head_path."
        )
    return read_state_dict(file, "aesthetic head weights")


def load_aesthetic_head(path: str | Path | None, input_dim: int = 768) -> AestheticHead:
    """Load a frozen head in eval mode; FlowRLError if the file is missing, corrupt or does not fit."""
    if path is None:
        raise FlowRLError(
            f"the aesthetic reward needs its MLP head: download {HEAD_FILE_NAME} from "
            "github.com/christophschuhmann/improved-aesthetic-predictor and pass head_path=<file>."
        )
    state = load_head_state(path)
    head = AestheticHead(input_dim)
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        w = state.get("layers.0.weight")
        found = f" (its first layer reads {w.shape[1]}-d embeddings)" if isinstance(w, Tensor) and w.ndim == 2 else ""
        raise FlowRLError(
            f"aesthetic head weights at {path} do not fit the reference MLP with a {input_dim}-d input{found}; "
            "set head_input_dim to the CLIP projection size the head was trained on."
        ) from e
    head.eval()
    head.requires_grad_(False)
    return head


class AestheticReward(ClipBackedReward):
    """Predicted aesthetic rating (about 1-10) of each image; prompts are ignored.

    Args:
        pretrained: hub id or directory of the CLIP model (with its processor).
        head_path: the improved-aesthetic-predictor head's weights file (.pth or .safetensors); required.
        head_input_dim: the head's input size, which must equal the CLIP projection size (768 for ViT-L/14).
    """

    name = "aesthetic"

    def __init__(
        self,
        pretrained: str = DEFAULT_MODEL,
        head_path: str | None = None,
        device: str | None = None,
        dtype: str = "float32",
        processor: str | None = None,
        differentiable: bool = True,
        head_input_dim: int = 768,
    ) -> None:
        super().__init__(pretrained, processor=processor, device=device, dtype=dtype, differentiable=differentiable)
        self.head_path = head_path
        self.head_input_dim = int(head_input_dim)
        self._head: AestheticHead | None = None

    def _load(self) -> None:
        # Check the head first: it is the part a user most often forgets, and it is cheap.
        head = load_aesthetic_head(self.head_path, self.head_input_dim)
        super()._load()
        proj = int(getattr(self._model.config, "projection_dim", self.head_input_dim))
        if proj != self.head_input_dim:
            raise FlowRLError(
                f"the CLIP model at {self.pretrained} embeds into {proj} dimensions but the aesthetic head "
                f"reads {self.head_input_dim}; use the CLIP model the head was trained on (ViT-L/14: 768)."
            )
        self._head = head

    def head_on(self, device: torch.device) -> AestheticHead:
        if self._head is None:
            outside_inference_mode(self._load)
        assert self._head is not None
        self._head = outside_inference_mode(lambda: self._head.to(device))
        return self._head

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        emb = self.embed_images(samples)
        head = self.head_on(emb.device)
        with torch.set_grad_enabled(self.differentiable and torch.is_grad_enabled()):
            scores = head(emb.float())
        return RewardOutput(scores=scores.float().to(samples.device))
