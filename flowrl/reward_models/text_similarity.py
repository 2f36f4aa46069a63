"""Prompt agreement of a text attached to each sample (e.g. a captioner's caption of the image or video).

score = cos(e(caption), e(prompt)), where e is the sentence embedding of a sentence-transformers checkpoint,
by default all-MiniLM-L6-v2 (Reimers & Gurevych 2019; model card
huggingface.co/sentence-transformers/all-MiniLM-L6-v2), computed as its model card prescribes with plain
transformers: the encoder's token embeddings, mean pooling over the attention mask, L2 normalisation;
inputs truncated at ``max_length`` word pieces (256: the model's ``max_seq_length``). Scores lie in
[-1, 1]; NaN where a sample has no ``metadata[caption_key]``.

``pretrained`` is a hub id (downloaded into the Hugging Face cache on first use) or a local directory
written by ``save_pretrained`` (the model and its tokenizer). Any checkpoint whose sentence embedding is
the normalised mean of its token embeddings fits (all-MiniLM-L6-v2, all-MiniLM-L12-v2, all-mpnet-base-v2);
one pooling another way (CLS token) would be scored with the wrong embedding. The model is loaded on the
first call, onto ``device`` (None: the samples' device) in ``dtype``. Not differentiable (text in, text out).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.reward_models.clip_common import LazyLoadedModel, from_pretrained, outside_inference_mode, parse_dtype
from flowrl.types import RewardOutput

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
MAX_SEQ_LENGTH = 256  # all-MiniLM-L6-v2's max_seq_length (its sentence_bert_config.json)


def mean_pool(token_embeddings: Tensor, attention_mask: Tensor) -> Tensor:
    """Average the token embeddings over the positions the mask keeps (the model card's mean_pooling)."""
    mask = attention_mask.unsqueeze(-1).to(token_embeddings.dtype)
    return (token_embeddings * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


class TextSimilarityReward(LazyLoadedModel):
    """score = cosine similarity of the sentence embeddings of ``metadata[caption_key]`` and the prompt.

    Args:
        pretrained: the sentence-embedding model (hub id or directory; default all-MiniLM-L6-v2).
        caption_key: the metadata key holding each sample's caption (e.g. from a captioner).
        max_length: tokens per text at most (the model's max_seq_length).
        batch_size: texts per forward pass of the embedding model.
    """

    name = "text_similarity"
    differentiable = False

    def __init__(
        self,
        pretrained: str = DEFAULT_MODEL,
        caption_key: str = "caption",
        device: str | None = None,
        dtype: str = "float32",
        max_length: int = MAX_SEQ_LENGTH,
        batch_size: int = 64,
    ) -> None:
        if not (isinstance(max_length, int) and max_length >= 1 and isinstance(batch_size, int) and batch_size >= 1):
            raise FlowRLError(
                f"text_similarity max_length and batch_size must be positive integers, got {max_length!r} and {batch_size!r}."
            )
        self.pretrained = str(pretrained)
        self.caption_key = caption_key
        self.device = device
        self.dtype = parse_dtype(dtype)
        self.max_length = max_length
        self.batch_size = batch_size
        self._model: Any = None
        self._tokenizer: Any = None

    def _load(self) -> None:
        from transformers import AutoModel, AutoTokenizer

        model = from_pretrained(AutoModel.from_pretrained, self.pretrained, "sentence-embedding model")
        tokenizer = from_pretrained(AutoTokenizer.from_pretrained, self.pretrained, "sentence-embedding tokenizer")
        # transformers builds a tokenizer from a bare model config when the directory has no tokenizer files: one that
        # knows only its special tokens and reads every word as [UNK], so every text would embed alike.
        words, specials = len(tokenizer), len(set(tokenizer.all_special_tokens))
        if words <= specials:
            raise FlowRLError(
                f"the sentence-embedding tokenizer of {self.pretrained} knows only its {specials} special tokens; save the "
                "model's own tokenizer beside it (tokenizer.save_pretrained)."
            )
        embeddings = getattr(model.config, "vocab_size", None)
        if embeddings is not None and words > embeddings:
            raise FlowRLError(
                f"the sentence-embedding tokenizer of {self.pretrained} has {words} tokens but the model only {embeddings} "
                "embeddings; the two do not belong together."
            )
        model = model.to(self.dtype).eval()
        model.requires_grad_(False)
        self._tokenizer, self._model = tokenizer, model

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            outside_inference_mode(self._load)
        return self._tokenizer

    @torch.no_grad()
    def embed(self, texts: Sequence[str], device: torch.device | str = "cpu") -> Tensor:
        """(N,) strings -> (N, D) float32 unit vectors on the CPU (the model runs on ``self.device`` or ``device``)."""
        model = self.model_on(torch.device(device))
        on = next(model.parameters()).device
        chunks = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                list(texts[start : start + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(on)
            tokens = model(**batch).last_hidden_state.float()
            chunks.append(torch.nn.functional.normalize(mean_pool(tokens, batch["attention_mask"]), p=2, dim=1).cpu())
        return torch.cat(chunks) if chunks else torch.zeros(0, 0)

    def __call__(self, samples: Any, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        device = samples.device if isinstance(samples, Tensor) else torch.device("cpu")
        captions = [m.get(self.caption_key) for m in metadata]
        have = [i for i, c in enumerate(captions) if c is not None]
        scores = torch.full((len(captions),), math.nan, dtype=torch.float32)
        if have:
            emb = self.embed([str(captions[i]) for i in have] + [str(prompts[i]) for i in have], device)
            cap, pro = emb[: len(have)], emb[len(have) :]
            scores[have] = (cap * pro).sum(dim=1)
        return RewardOutput(scores=scores.to(device))
