"""DCoLT's exact per-step action log-probability (LLaDOU, Huang et al. 2025, "Reinforcing the Diffusion
Chain of Lateral Thought with Diffusion Language Models"; docs/math.md section 6).

At each denoising step an Unmasking Policy Module (UPM) scores the masked positions; the ordered set of
positions unmasked at that step is drawn WITHOUT replacement with Plackett-Luce probabilities (equivalently
Gumbel-top-k on the scores), then a token is drawn at each chosen position from the LM's softmax. The step's
action log-prob is therefore exact:

    log pi(a_s | state_s) = sum_k [ s_{c_k} - logsumexp_{j in E_s minus {c_1..c_{k-1}}} s_j ]
                            + sum_k log softmax(logits_{c_k})[x_{c_k}]

with E_s the eligible positions (masked and in the current block) and c_1..c_K the chosen positions in the
order they were drawn (``traj.unmask_rank``).

At a step that completes its block (it takes every position of E_s: K = |E_s|, the sampler's last step of the
block) the SET is forced and only the order inside the step would be scored, an order the step does not act on
(all K tokens are written at once). LLaDOU (``networks/lladou_v0.py::logprob_loss``) puts no position term at
those steps, only the tokens'; ``DCoLTStepLogProb(block_end_order_term=False)`` does the same (the DCoLT
objective's default, ``objective.block_end_order_term``), ``True`` keeps the Plackett-Luce log-prob of the whole
recorded ordered draw (``ORDERED_DRAW``, what ``dcolt_log_probs`` computes unless told otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ...types import MaskedLM, TokenTrajectory
from .estimators import replay_logits, token_log_probs


def plackett_luce_log_prob(scores: Tensor, chosen: Tensor, eligible: Tensor) -> Tensor:
    """Plackett-Luce log-prob of an ordered draw without replacement.

    scores (B, G) real; chosen (B, K) positions in draw order, ``-1`` = nothing drawn at that slot (rows
    drawing fewer than K positions); eligible (B, G) bool, the pool before the first draw.
    Returns (B,) ``sum_k [s_{c_k} - logsumexp(s over eligible minus already chosen)]`` (float32 at least).
    Raises ValueError if a chosen position is not eligible or is chosen twice.
    """
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    available = eligible.bool()
    total = scores.new_zeros(scores.shape[0])
    for k in range(chosen.shape[1]):
        valid = chosen[:, k] >= 0
        idx = chosen[:, k].clamp(min=0).unsqueeze(1)
        was_available = available.gather(1, idx).squeeze(1)
        if not bool(was_available[valid].all()):
            raise ValueError("plackett_luce_log_prob: a chosen position is not eligible or was already chosen")
        # A row with nothing drawn at slot k still gets a finite logsumexp (over every position): a
        # logsumexp over all -inf would be harmless forward but would put NaN into the gradient.
        pool = available | ~valid.unsqueeze(1)
        lse = torch.logsumexp(scores.masked_fill(~pool, float("-inf")), dim=1)
        total = total + torch.where(valid, scores.gather(1, idx).squeeze(1) - lse, 0.0)
        available = available.scatter(1, idx, (was_available & ~valid).unsqueeze(1))
    return total


def ordered_chosen(unmask_step: Tensor, unmask_rank: Tensor, step: int) -> Tensor:
    """(B, K) positions unmasked at ``step`` in ``unmask_rank`` order, ``-1``-padded; K = the most any row drew."""
    active = unmask_step == step
    counts = active.sum(1, keepdim=True)
    k = int(counts.max()) if active.numel() else 0
    key = torch.where(active, unmask_rank, torch.iinfo(unmask_rank.dtype).max)
    order = key.argsort(dim=1)[:, :k]
    slots = torch.arange(k, device=unmask_step.device)[None]
    return torch.where(slots < counts, order, -1)


def current_block_eligible(still_masked: Tensor, block_length: int | None) -> Tensor:
    """(B, G) bool: masked positions in the current semi-autoregressive block.

    The current block is the one holding the first still-masked position: LLaDA-style samplers finish a
    block before starting the next and never unmask beyond it. ``block_length=None``: one block.
    """
    if block_length is None:
        return still_masked
    G = still_masked.shape[1]
    first = still_masked.long().argmax(1)  # 0 for a fully unmasked row, which then has nothing eligible anyway
    block_of = torch.arange(G, device=still_masked.device) // block_length
    return still_masked & (block_of[None] == (first // block_length)[:, None])


class UnmaskingScorer(Protocol):
    """DCoLT's Unmasking Policy Module: ``scorer(state (B, G), logits (B, G, V), step) -> scores (B, G)``.

    ``state`` holds the completion before the step (mask_token_id where masked), ``logits`` the LM's
    completion logits at that state. A scorer that needs the LM's hidden states (LLaDOU's UPM reads the
    last layer) can capture them with a forward hook on ``lm.model``.
    """

    def __call__(self, state: Tensor, logits: Tensor, step: int) -> Tensor: ...


@dataclass(frozen=True)
class DCoLTStepLogProb:
    """Per-step action log-prob: Plackett-Luce log-prob of the ordered chosen positions plus the chosen tokens'
    log-probs under the LM's softmax (temperature 1).

    ``block_end_order_term``: whether a row whose step takes every eligible position (it completes the block)
    keeps its position term. False (LLaDOU): that term is exactly 0 there, the step's log-prob is its tokens'.
    True: the Plackett-Luce log-prob of the recorded order of those positions, which is log(1 / K!) for equal
    scores (K = 8: -10.6 nats) though the order changes nothing the step does.

    logits (B, G, V), scores (B, G), targets (B, G) completion tokens, chosen (B, K) ordered positions
    (``-1`` padded), eligible (B, G) bool -> (B,).
    """

    block_end_order_term: bool

    def __call__(self, logits: Tensor, scores: Tensor, targets: Tensor, chosen: Tensor, eligible: Tensor) -> Tensor:
        positions = plackett_luce_log_prob(scores, chosen, eligible)
        if not self.block_end_order_term:
            completes_block = (chosen >= 0).sum(1) == eligible.sum(1)
            positions = torch.where(completes_block, torch.zeros_like(positions), positions)
        tokens = token_log_probs(logits, targets).gather(1, chosen.clamp(min=0))
        return positions + torch.where(chosen >= 0, tokens, 0.0).sum(1)


ORDERED_DRAW = DCoLTStepLogProb(block_end_order_term=True)  # the exact log-prob of the recorded ordered draw


def dcolt_log_probs(
    lm: MaskedLM,
    scorer: UnmaskingScorer,
    traj: TokenTrajectory,
    block_length: int | None = None,
    step_log_prob: DCoLTStepLogProb = ORDERED_DRAW,
) -> Tensor:
    """(B, num_steps) float32 action log-probs of a recorded trajectory, replayed step by step (by default
    the exact log-probs of the recorded ordered draws; the DCoLT objective passes its ``block_end_order_term``).

    At step s: state = ``traj.state_at(s)``; chosen = positions with ``unmask_step == s`` in
    ``unmask_rank`` order; eligible = positions still masked (``unmask_step >= s``) in the current block
    of ``block_length`` (None = whole completion). Steps at which a row drew nothing contribute 0.
    One forward of the LM and one of the scorer per step that unmasked anything.
    """
    B = traj.completion_ids.shape[0]
    columns = [torch.zeros(B, device=traj.completion_ids.device)] * traj.num_steps
    for s, state, logits in replay_logits(lm, traj):
        scores = scorer(state, logits, s)
        chosen = ordered_chosen(traj.unmask_step, traj.unmask_rank, s)
        eligible = current_block_eligible(traj.unmask_step >= s, block_length)
        columns[s] = step_log_prob(logits, scores, traj.completion_ids, chosen, eligible).float()
    return torch.stack(columns, dim=1)


__all__ = [
    "ORDERED_DRAW",
    "DCoLTStepLogProb",
    "UnmaskingScorer",
    "current_block_eligible",
    "dcolt_log_probs",
    "ordered_chosen",
    "plackett_luce_log_prob",
]
