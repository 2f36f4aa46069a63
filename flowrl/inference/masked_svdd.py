"""SVDD for masked-diffusion LMs (Li et al. 2024, soft value-based decoding, on discrete diffusion):
per-unmasking-step best-of-M with a one-shot look-ahead.

At every unmasking step each item draws M candidate next states from the sampler's own transition (the
step of ``samplers/masked.py::generate``: tokens at the temperature for every masked position, the
positions to commit by the remasking rule). Each candidate is valued by a verifier-free score
(``text_candidates``: the model's likelihood, or a reward that never sees the gold answer) of its
one-shot completion: one forward pass on the candidate state and every still-masked position filled
with its most likely token (the masked-diffusion analogue of the image SVDD's x0 prediction). The
best candidate is kept. The forward pass that valued the kept candidate is exactly the next step's
forward on the same state, so it is reused: a step costs M forwards per item, not M + 1.

The final step (the one that leaves no mask) is, by default, taken as the authors' discrete-diffusion release takes
it (``last_step: best_of_m``; github.com/masa-ue/SVDD, diffusion_gosai.py, ``_ddpm_update_finetune_controlled_twedie``
selects the best of its ``repeats`` candidates at every step, the last included): the M finished completions are
scored and the best is kept. ``last_step: plain`` takes it as the image release does (svdd.py cites that code): the
first of each item's M candidates is kept, with no choice, and then scored once to report its value (P verifier rows).

Denoiser work, in rows through ``lm.logits`` per item: 1 (the first step's forward) + M x (steps that
leave masks behind). With a fixed schedule of K steps that is 1 + M (K - 1); the plain sampler does K,
best-of-M does M K. Verifier rows: M (K - 1) + 1 (plain) or M K (best_of_m).

With M = 1 nothing is selected and the result is exactly ``generate`` with the same generator (tested):
the candidates draw their randomness in the same order and shapes as the plain sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import FlowRLError
from ..seeding import RowGenerators
from .batching import STEPS, TOTAL, joined
from .masked_search import UnmaskingBatch, keep_rows, text_in_batches
from .search import TextSearchModel
from .text_candidates import MAJORITY, TextScorer, check_candidates_differ


@dataclass
class MaskedSVDDResult:
    completions: list[str]  # (P,) the decoded final completions
    completion_ids: Tensor  # (P, G)
    scores: Tensor  # (P,) the verifier-free score of the final completions
    step_scores: list[Tensor] = joined(STEPS)  # per executed step, (P, M): every candidate's look-ahead score
    forwards: int = joined(TOTAL)  # rows run through lm.logits (one row = one sequence through the model once)


def check_svdd(scorer: TextScorer, m: int, temperature: float, remasking: str) -> None:
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    if getattr(scorer, "name", None) == MAJORITY:
        raise FlowRLError("SVDD values each candidate on its own; majority voting needs a set of finished answers, use --best-of.")
    check_candidates_differ("--svdd", m, temperature, remasking)


@torch.no_grad()
def masked_svdd(
    model: TextSearchModel,
    scorer: TextScorer,
    prompts: Sequence[str],
    m: int,
    generator: torch.Generator | RowGenerators,
    last_step: str = "best_of_m",
) -> MaskedSVDDResult:
    """One completion per prompt by SVDD with ``m`` candidates per unmasking step (batch = prompts x m rows);
    with per-prompt streams, prompt i's m candidates draw in turn from prompt i's stream. ``last_step``:
    ``best_of_m`` (the discrete release: the best finished candidate) or ``plain`` (the first candidate)."""
    check_svdd(scorer, m, model.temperature, model.sampler.remasking)
    if last_step not in ("plain", "best_of_m"):
        raise ValueError(f"last_step must be plain or best_of_m, got {last_step!r}")
    batch = UnmaskingBatch(model, prompts, m, generator)
    batch.start()
    first = torch.arange(batch.items, device=batch.device) * m
    logits, step_scores = None, []  # logits: the kept states' (P, G, V), carried over from the look-ahead that valued them
    final = torch.full((batch.items,), float("nan"))
    for step, s, eligible in batch.steps():
        if logits is None:  # only the first step: later states were valued (and forwarded) as candidates
            logits = batch.logits(batch.rec.completion, first)
        cand = keep_rows(batch.rec, batch.rows)  # the sampler's own transition, M times per item
        batch.transition(logits[batch.rows], cand, eligible[batch.rows], s, step)
        look = batch.logits(cand.completion) if (cand.unmask_step < 0).any() else None  # the look-ahead forward
        if look is None and last_step == "plain":  # the image release's last step: no choice, the first candidate
            batch.rec = keep_rows(cand, first)
            final = batch.value(scorer, batch.rec, None, width=1).squeeze(1)  # the kept completion's value, reported
            break
        value = batch.value(scorer, cand, look)
        step_scores.append(value)
        # the first best candidate; a NaN value is never kept while a finite one exists
        best = torch.where(torch.isfinite(value), value, float("-inf")).argmax(1)
        chosen = first + best.to(batch.device)
        batch.rec = keep_rows(cand, chosen)
        logits = None if look is None else look[chosen]
        final = value.gather(1, best[:, None]).squeeze(1)
    return MaskedSVDDResult(
        completions=batch.decode(batch.rec),
        completion_ids=batch.rec.completion,
        scores=final,
        step_scores=step_scores,
        forwards=batch.forwards,
    )


def masked_svdd_in_batches(
    model: TextSearchModel, scorer: TextScorer, prompts: Sequence[str], m: int, progress=None, last_step: str = "best_of_m"
) -> MaskedSVDDResult:
    """:func:`masked_svdd` over many prompts, ``model.batch_size // m`` prompts (x ``m`` candidates) at a time, each
    prompt with its own stream keyed by its text as the plain evaluation draws (M = 1 reproduces it exactly)."""
    return text_in_batches(model, prompts, m, lambda batch, streams: masked_svdd(model, scorer, batch, m, streams, last_step), progress)


__all__: Sequence[str] = ["MaskedSVDDResult", "check_svdd", "masked_svdd", "masked_svdd_in_batches"]
