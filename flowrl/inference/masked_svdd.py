"""SVDD for masked-diffusion LMs (Li et al. 2024, soft value-based decoding, on discrete diffusion):
per-unmasking-step best-of-M with a one-shot look-ahead.

At every unmasking step each item draws M candidate next states from the sampler's own transition (the
step of ``samplers/masked.py::generate``: tokens at the temperature for every masked position, the
positions to commit by the remasking rule). Each candidate is valued by a verifier-free score
(``text_candidates``: the model's likelihood, or a reward that never sees the gold answer) of its
one-shot completion: one forward pass on the candidate state and every still-masked position filled
with its most likely token (the masked-diffusion analogue of the image SVDD's x0 prediction). The
best candidate is kept. The forward pass that valued the kept candidate is exactly the next step's
forward on the same state, so it is reused: a step costs M forwards per item, not M + 1. At the final
step the candidates are finished completions and are scored as they are (no look-ahead).

Denoiser work, in rows through ``lm.logits`` per item: 1 (the first step's forward) + M x (steps that
leave masks behind). With a fixed schedule of K steps that is 1 + M (K - 1); the plain sampler does K,
best-of-M does M K.

With M = 1 nothing is selected and the result is exactly ``generate`` with the same generator (tested):
the candidates draw their randomness in the same order and shapes as the plain sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import FlowRLError
from ..samplers.masked import (
    MaskedSamplerConfig,
    _check_args,
    _num_to_unmask,
    _Recorder,
    _scores,
    _token_log_probs,
    decode_completions,
    gumbel_sample,
    shift_logits,
    transfer_schedule,
)
from ..samplers.text_generation import candidate_streams, encode_prompts
from ..seeding import RowGenerators
from ..types import MaskedLM
from .text_candidates import MAJORITY, TextScorer, check_candidates_differ


@dataclass
class MaskedSVDDResult:
    completions: list[str]  # (P,) the decoded final completions
    completion_ids: Tensor  # (P, G)
    scores: Tensor  # (P,) the verifier-free score of the final completions
    step_scores: list[Tensor]  # per executed step, (P, M): every candidate's look-ahead score
    forwards: int  # rows run through lm.logits (one row = one sequence through the model once)


def _keep(rec: _Recorder, rows: Tensor) -> _Recorder:
    return _Recorder(
        completion=rec.completion[rows],
        unmask_step=rec.unmask_step[rows],
        unmask_rank=rec.unmask_rank[rows],
        token_log_probs=rec.token_log_probs[rows],
        committed=rec.committed[rows],
    )


@torch.no_grad()
def masked_svdd(
    lm: MaskedLM,
    sampler: MaskedSamplerConfig,
    prompt_length: int | None,
    scorer: TextScorer,
    prompts: Sequence[str],
    m: int,
    temperature: float,
    generator: torch.Generator | RowGenerators,
    position_scorer=None,
) -> MaskedSVDDResult:
    """One completion per prompt by SVDD with ``m`` candidates per unmasking step (batch = prompts x m rows);
    with per-prompt streams, prompt i's m candidates draw in turn from prompt i's stream."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    if getattr(scorer, "name", None) == MAJORITY:
        raise FlowRLError("SVDD values each candidate on its own; majority voting needs a set of finished answers, use --best-of.")
    check_candidates_differ("--svdd", m, temperature, sampler.remasking)
    sc = sampler
    num_blocks = _check_args(sc.gen_length, sc.steps, sc.block_length, sc.remasking, sc.threshold, position_scorer)
    steps_per_block = sc.steps // num_blocks
    schedule = transfer_schedule(sc.block_length, steps_per_block)
    ids, mask = encode_prompts(lm, prompts, prompt_length)
    p, length = ids.shape
    rows = torch.arange(p, device=ids.device).repeat_interleave(m)  # candidate-major within an item
    cand_gen = generator[rows.tolist()] if isinstance(generator, RowGenerators) else generator
    ids_m, prompts_m = ids[rows], [q for q in prompts for _ in range(m)]
    attention_mask = torch.cat([mask[rows], torch.ones((p * m, sc.gen_length), dtype=mask.dtype, device=mask.device)], dim=1)
    rec = _Recorder.start(ids, sc.gen_length, lm.mask_token_id)
    positions = torch.arange(sc.gen_length, device=ids.device)
    forwards, step_scores = 0, []

    def completion_logits(completion: Tensor, keep_rows: Tensor | None) -> Tensor:
        nonlocal forwards
        x_ids = ids_m if keep_rows is None else ids_m[keep_rows]
        x_mask = attention_mask if keep_rows is None else attention_mask[keep_rows]
        forwards += completion.shape[0]
        logits = lm.logits(torch.cat([x_ids, completion], dim=1), attention_mask=x_mask)
        return (shift_logits(logits) if sc.logit_shift else logits)[:, length:]

    logits = None  # the kept states' logits (P, G, V), carried over from the look-ahead that valued them
    for block in range(num_blocks):
        in_block = (positions >= block * sc.block_length) & (positions < (block + 1) * sc.block_length)
        for s in range(steps_per_block):
            eligible = (rec.unmask_step < 0) & in_block
            if not eligible.any() or (sc.threshold is None and schedule[s] == 0):
                continue  # nothing to commit, as in generate
            if logits is None:  # only the first step: later states were valued (and forwarded) as candidates
                logits = completion_logits(rec.completion, torch.arange(p, device=ids.device) * m)
            cand_logits, cand_eligible = logits[rows], eligible[rows]
            # the sampler's own transition, M times per item, drawing randomness in generate's order and shapes
            x0 = gumbel_sample(cand_logits, temperature, cand_gen, exclude=lm.mask_token_id)
            log_p = _token_log_probs(cand_logits, x0)
            scores = _scores(cand_logits, log_p, rec.completion[rows], sc.remasking, position_scorer, cand_gen, temperature)
            scores = scores.masked_fill(~cand_eligible, float("-inf"))
            k = _num_to_unmask(scores, cand_eligible, schedule[s], sc.threshold, s == steps_per_block - 1)
            cand = _keep(rec, rows)
            cand.commit(x0, log_p, scores, k, block * steps_per_block + s)
            remaining = cand.unmask_step < 0
            if remaining.any():  # look-ahead: fill every masked position with its most likely token in one pass
                look = completion_logits(cand.completion, None)
                fill = gumbel_sample(look, 0.0, exclude=lm.mask_token_id)
                filled = torch.where(remaining, fill.to(cand.completion.dtype), cand.completion)
                log_lik = torch.where(remaining, _token_log_probs(look, fill), cand.token_log_probs.double()).sum(1)
            else:
                look, filled, log_lik = None, cand.completion, cand.token_log_probs.double().sum(1)
            texts = decode_completions(lm.tokenizer, filled, lm.eos_token_id)
            value = scorer(texts, prompts_m, log_lik).double().view(p, m)
            step_scores.append(value)
            # the first best candidate; a NaN value is never kept while a finite one exists
            best = torch.where(torch.isfinite(value), value, float("-inf")).argmax(1).to(ids.device)
            chosen = torch.arange(p, device=ids.device) * m + best
            rec = _keep(cand, chosen)
            logits = None if look is None else look[chosen]
    final = step_scores[-1].gather(1, best[:, None].cpu()).squeeze(1) if step_scores else torch.full((p,), float("nan"))
    return MaskedSVDDResult(
        completions=decode_completions(lm.tokenizer, rec.completion, lm.eos_token_id),
        completion_ids=rec.completion,
        scores=final,
        step_scores=step_scores,
        forwards=forwards,
    )


def masked_svdd_in_batches(
    lm: MaskedLM,
    sampler: MaskedSamplerConfig,
    prompt_length: int | None,
    scorer: TextScorer,
    prompts: Sequence[str],
    m: int,
    temperature: float,
    seed: int,
    batch_size: int,
    position_scorer=None,
    progress=None,
) -> MaskedSVDDResult:
    """:func:`masked_svdd` over many prompts, ``batch_size // m`` prompts (x ``m`` candidates) at a time, each
    prompt with its own stream keyed by its text as the plain evaluation draws (M = 1 reproduces it exactly). ``progress``: called with the number of prompts done after each chunk."""
    chunk = max(1, batch_size // m)
    parts = []
    for i in range(0, len(prompts), chunk):
        parts.append(
            masked_svdd(
                lm,
                sampler,
                prompt_length,
                scorer,
                prompts[i : i + chunk],
                m,
                temperature,
                candidate_streams(seed, prompts[i : i + chunk], 0),
                position_scorer,
            )
        )
        if progress is not None:
            progress(len(prompts[i : i + chunk]))
    return MaskedSVDDResult(
        completions=[c for r in parts for c in r.completions],
        completion_ids=torch.cat([r.completion_ids for r in parts]),
        scores=torch.cat([r.scores for r in parts]),
        step_scores=[torch.cat(s) for s in zip(*(r.step_scores for r in parts))] if len({len(r.step_scores) for r in parts}) == 1 else [],
        forwards=sum(r.forwards for r in parts),
    )


__all__: Sequence[str] = ["MaskedSVDDResult", "masked_svdd", "masked_svdd_in_batches"]
