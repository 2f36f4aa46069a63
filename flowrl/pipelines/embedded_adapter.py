"""What the adapters of flowrl's embedded models (digits, digits_video) add to :class:`DiffusersAdapter`.

The embedded models are real diffusers/transformers components (a UNet or a CogVideoX transformer, a
CLIP text encoder, a tokenizer, a scheduler config) in pixel space, so everything else (LoRA, the KL
reference, prompt caching, guidance, checkpoints, the diffusers LoRA export) is the base class's. Only
three things differ from a hub checkpoint:

* ``pipeline.pretrained`` may name a shipped model (``flowrl/assets/<name>``) instead of a directory;
* prompts are short and padded to a fixed ``max_prompt_tokens`` (the length the model was trained with);
* samples are pixels in [-1, 1] and decode to [0, 1] without a VAE.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import Tensor

from ..errors import FlowRLError
from ..types import Condition
from .diffusers_base import DiffusersAdapter, PipelineConfig, prompt_token_ids

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def shipped_generators() -> list[str]:
    """The generators shipped in flowrl/assets (each folder with its training record; the digit classifier, a reward
    model, aside): read from the files, so the list a user is shown is never stale."""
    return sorted(p.name for p in ASSETS.iterdir() if (p / "training_info.json").is_file() and p.name != "digit_classifier")


class EmbeddedPipelineConfig(PipelineConfig):
    """The section of an embedded model's family (digits, digits_video)."""

    def default_num_threads(self) -> int | None:
        return 1  # an embedded model: too small to share among threads


class EmbeddedAdapter(DiffusersAdapter):
    """Base of the adapters over flowrl's shipped tiny models (see the module docstring)."""

    embedded: tuple[str, ...] = ()  # shipped model names, folders of flowrl/assets
    required: tuple[str, ...] = ()  # component folders a model directory must have
    max_prompt_tokens = 8

    def _resolve_source(self, pretrained: str) -> str:
        """Map a shipped model name or a local directory to an absolute directory; fail with one sentence."""
        path = ASSETS / pretrained if pretrained in self.embedded else Path(pretrained).expanduser()
        if not path.is_dir():
            if pretrained in shipped_generators():  # shipped, for another family (arith_mdlm in an image pipeline)
                raise FlowRLError(
                    f"pipeline.pretrained '{pretrained}' is an embedded model of another family; this family's are "
                    f"{', '.join(self.embedded)}."
                )
            raise FlowRLError(
                f"pipeline.pretrained '{pretrained}' is neither an embedded model ({', '.join(shipped_generators())}) nor an "
                "existing directory."
            )
        missing = [c for c in self.required if not (path / c).is_dir()]
        if missing:
            raise FlowRLError(f"model directory '{path}' lacks the component folder(s) {', '.join(missing)}.")
        return str(path.resolve())

    def _load_text_encoder(self) -> None:
        from transformers import AutoTokenizer, CLIPTextModel

        self.tokenizer = self._load(AutoTokenizer, "tokenizer")
        self.text_encoder = self._load(CLIPTextModel, "text_encoder")

    def _scheduler_config(self) -> dict[str, Any]:
        try:
            return json.loads((Path(self.source) / "scheduler" / "scheduler_config.json").read_text())
        except (OSError, ValueError) as e:
            raise FlowRLError(f"could not read the scheduler config of '{self.source}': {str(e).splitlines()[0][:160]}") from None

    def _encode_prompts(self, prompts: list[str]) -> Condition:
        ids = prompt_token_ids(self.tokenizer, prompts, self.max_prompt_tokens)
        with self._frozen_on_device(self.text_encoder):
            hidden = self.text_encoder(ids.to(self.text_encoder.device)).last_hidden_state
        return {"prompt_embeds": hidden.float()}  # (B, L, D)

    def decode(self, x: Tensor) -> Tensor:
        """Pixels in [-1, 1] -> [0, 1], float32. Differentiable (Adjoint Matching backpropagates a reward through
        it); rollouts call it under no_grad, so nothing is kept there."""
        return (x.float().clamp(-1, 1) + 1) / 2
