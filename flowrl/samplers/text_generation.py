"""Generating masked-diffusion LM completions: the one code path the training rollout, the held-out evaluation and
every inference-time search of a diffusion LM call (prompts encoded with left padding, the configured sampler run
at a temperature, completions decoded), and the per-item random streams that make a prompt's completion independent
of its batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import seeding
from ..types import CanvasTrajectory, MaskedLM, TokenTrajectory
from . import entropy_bound
from .entropy_bound import EntropyBoundSamplerConfig, resolve_settings
from .masked import MaskedSamplerConfig, decode_completions, generate


def encode_prompts(lm: MaskedLM, prompts: Sequence[str], prompt_length: int | None) -> tuple[Tensor, Tensor]:
    """Left-padded prompt ids (B, P) and their bool mask on the model's device; ``prompt_length`` pads and
    truncates to a fixed length (the embedded model's position table), None pads to the longest."""
    tok = lm.tokenizer
    tok.padding_side = "left"  # the completion must follow the prompt's last real token
    enc = tok(
        list(prompts),
        padding="max_length" if prompt_length else "longest",
        max_length=prompt_length,
        truncation=prompt_length is not None,
        return_tensors="pt",
    )
    return enc.input_ids.to(lm.device), enc.attention_mask.bool().to(lm.device)


def generate_texts(
    lm: MaskedLM,
    prompts: Sequence[str],
    sampler: MaskedSamplerConfig | EntropyBoundSamplerConfig,
    prompt_length: int | None,
    temperature: float,
    generator: torch.Generator,
    position_scorer=None,
) -> TokenTrajectory | CanvasTrajectory:
    """Generate one completion per prompt with the sampler settings at ``temperature``, decoded into
    ``.completions``. The training rollout, the held-out evaluation and best-of-N all call this. DiffusionGemma's
    entropy-bound sampler returns a CanvasTrajectory (``temperature`` scales its schedule)."""
    ids, mask = encode_prompts(lm, prompts, prompt_length)
    if isinstance(sampler, EntropyBoundSamplerConfig):
        settings = resolve_settings(lm, sampler, temperature)
        canvas_traj = entropy_bound.generate(lm, ids, mask, settings, generator)
        canvas_traj.completions = entropy_bound.decode_completions(lm.tokenizer, canvas_traj.completion_ids, settings.eos_token_ids)
        return canvas_traj
    traj = generate(
        lm,
        ids,
        mask,
        sampler.gen_length,
        sampler.steps,
        sampler.block_length,
        temperature=temperature,
        remasking=sampler.remasking,
        threshold=sampler.threshold,
        position_scorer=position_scorer,
        logit_shift=sampler.logit_shift,
        generator=generator,
        kv_cache=sampler.kv_cache,
    )
    traj.completions = decode_completions(lm.tokenizer, traj.completion_ids, lm.eos_token_id)
    return traj


def candidate_streams(seed: int, prompts: Sequence[str], j: int) -> seeding.RowGenerators:
    """Candidate j of each prompt: its own stream keyed by (seed, the prompt's text, j); candidate 0 is the plain
    evaluation's draw. A diffusion LM's item is keyed by its prompt alone: its metadata (the gold answer) never
    conditions the generation."""
    return seeding.RowGenerators.by_content(seed, prompts, [{}] * len(prompts), [j] * len(prompts))
