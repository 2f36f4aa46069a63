"""The data behind the embedded digits models: scikit-learn's bundled 8x8 handwritten digits, the
text prompts that describe them, and a word-level tokenizer over those prompts.

Prompts come in two disjoint template sets: ``TRAIN_TEMPLATES`` (RL training prompts) and
``EVAL_TEMPLATES`` (held-out phrasings for evaluation). The generators are pre-trained on both, so
the held-out phrasings are understood but never optimised against.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TRAIN_TEMPLATES = ["a handwritten {word}", "the digit {word}", "a picture of a {word}", "digit {n}"]
EVAL_TEMPLATES = ["a drawing of the number {word}", "handwritten digit {n}"]
MAX_PROMPT_TOKENS = 8
IMAGE_SIZE = 8


def prompt_for(digit: int, template: str) -> str:
    return template.format(word=NUMBER_WORDS[digit], n=digit)


def prompt_set(split: str) -> list[tuple[str, dict[str, Any]]]:
    """All (prompt, metadata) pairs of a split ("train" or "eval"); metadata holds the digit."""
    templates = {"train": TRAIN_TEMPLATES, "eval": EVAL_TEMPLATES}[split]
    return [(prompt_for(d, t), {"digit": d}) for t in templates for d in range(10)]


def sample_prompts(split: str, n: int, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
    pool = prompt_set(split)
    return [pool[rng.randrange(len(pool))] for _ in range(n)]


def load_digit_images() -> tuple[torch.Tensor, torch.Tensor]:
    """Return images (N, 1, 8, 8) float32 in [-1, 1] and labels (N,) int64."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.from_numpy(data.images.astype(np.float32) / 8.0 - 1.0).unsqueeze(1)
    return images, torch.from_numpy(data.target.astype(np.int64))


def vocabulary() -> list[str]:
    words = {"[PAD]", "[UNK]", "[BOS]", "[EOS]"}
    for template in TRAIN_TEMPLATES + EVAL_TEMPLATES:
        for d in range(10):
            words.update(prompt_for(d, template).split())
    specials = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
    return specials + sorted(words - set(specials))


def prompt_tokenizer(words: list[str], max_length: int):
    """A word-level ``PreTrainedTokenizerFast`` over ``words`` (ids in list order; [PAD], [UNK], [BOS], [EOS] among
    them) that wraps each prompt in [BOS] ... [EOS]: the embedded digit models' tokenizer, saved with the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", vocab["[BOS]"]), ("[EOS]", vocab["[EOS]"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        model_max_length=max_length,
    )


def build_tokenizer():
    """The tokenizer over the digit prompts' vocabulary (saved with the model)."""
    return prompt_tokenizer(vocabulary(), MAX_PROMPT_TOKENS)
