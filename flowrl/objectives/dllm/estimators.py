"""Seeded log-likelihood estimators for masked diffusion language models (docs/math.md section 6).

A masked diffusion LM gives no closed-form ``log pi(completion | prompt)``; each dLLM RL method replaces it
with an estimate built from a few forwards on partially masked inputs. Every estimator here is a pure
callable

    estimator(lm, traj, seed_index) -> EstimatorOutput(token_log_probs (B, G) float32, weights (B, G) float32)

with the sequence-level estimate ``(weights * token_log_probs).sum(-1)``. Tokens with weight 0 do not count
and their ``token_log_probs`` are set to 0, so a per-token objective (d1's per-token ratios) can use
``weights`` as its averaging weights and a sequence-level one can use the weighted sum.

Determinism contract. All randomness comes from ``traj.mask_seeds[:, seed_index]`` through one CPU
``torch.Generator`` per row, drawn on the CPU and moved to the device. So (a) the old policy (scored right
after the rollout) and the new policy (scored at inner iteration ``seed_index``) see the same masks, and
at unchanged weights the ratio ``exp(new - old)`` is exactly 1; (b) a row's masks do not depend on the
batch it is scored in (micro-batching and rollout/train batch sizes may differ) nor on the device.

| estimator                 | paper                        | forwards    | estimates (see each docstring)            |
|---------------------------|------------------------------|-------------|-------------------------------------------|
| OneStepEstimator          | d1 diffu-GRPO                | 1           | fully-masked one-pass per-token log-probs |
| AnswerMaskEstimator       | UniGRPO (paper) / dLLM-RL    | 1           | mean log-prob over a random answer mask   |
| CoupledEstimator          | DiffuCoder coupled-GRPO      | 2           | ELBO, antithetic pair of masks            |
| ELBOEstimator, elbo_terms | LLaDA ELBO (BGPO, SPG, VRPO) | num_samples | ELBO, stratified mask counts              |
| TrajectoryReplayEstimator | TraceRL                      | num_steps/k | log-prob of the sampled tokens            |
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from ...errors import FlowRLError
from ...types import MaskedLM, TokenTrajectory

_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


class EstimatorOutput(NamedTuple):
    """token_log_probs (B, G) float32 (0 where weight is 0) and weights (B, G) float32."""

    token_log_probs: Tensor
    weights: Tensor

    def sequence_log_prob(self) -> Tensor:
        """(B,) the sequence-level estimate ``sum_i weights_i * token_log_probs_i``."""
        return (self.weights * self.token_log_probs).sum(-1)


class LogLikelihoodEstimator(Protocol):
    def __call__(self, lm: MaskedLM, traj: TokenTrajectory, seed_index: int) -> EstimatorOutput: ...


# ---------------------------------------------------------------------------------------------- helpers


def row_generators(traj: TokenTrajectory, seed_index: int) -> list[torch.Generator]:
    """One CPU generator per row, seeded from ``traj.mask_seeds[row, seed_index]``.

    The CPU Mersenne Twister only uses the low 32 bits of a seed, so the high half is xor-folded in:
    seeds that differ only above bit 32 would otherwise give identical masks.
    """
    if traj.mask_seeds is None:
        raise FlowRLError("This dLLM log-likelihood estimator needs trajectory mask_seeds drawn at rollout time.")
    if not 0 <= seed_index < traj.mask_seeds.shape[1]:
        n = traj.mask_seeds.shape[1]
        raise FlowRLError(f"seed_index {seed_index} is out of range: the rollout drew {n} mask seeds.")
    gens = []
    for seed in traj.mask_seeds[:, seed_index].tolist():
        s = int(seed) & _U64
        gens.append(torch.Generator().manual_seed((s ^ (s >> 32)) & _U32))
    return gens


def completion_logits(lm: MaskedLM, traj: TokenTrajectory, completion: Tensor, prompt: Tensor | None = None) -> Tensor:
    """Logits (B, G, V) at the completion positions for the input ``[prompt ; completion]``.

    ``prompt`` defaults to the unmasked ``traj.prompt_ids``; the attention mask is the prompt mask followed
    by ones (completion tokens, EOS filler included, are always attended, as during sampling).

    A block-diffusion model (block-causal attention, ``lm.block_length`` set; pipelines/block_attention.py) predicts
    each block from the clean blocks before it, as it generates: its logits come from ``lm.block_diffusion_logits``
    with the recorded completion as that clean context (BD3-LM's likelihood), whatever the estimator masked before
    the block. On a sampling state (the replay) that is the same forward the sampler ran.
    """
    prompt = traj.prompt_ids if prompt is None else prompt
    if getattr(lm, "block_length", None) is not None:
        return lm.block_diffusion_logits(prompt, traj.prompt_mask, completion.to(prompt.device), traj.completion_ids)
    ids = torch.cat([prompt, completion.to(prompt.device)], dim=1)
    attn = torch.cat([traj.prompt_mask.long(), torch.ones_like(completion, dtype=torch.long)], dim=1)
    return lm.logits(ids, attn)[:, prompt.shape[1] :]


def token_log_probs(logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits)[target] in float32, (B, G, V), (B, G) -> (B, G), without a (B, G, V) log-softmax."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def through_first_eos(completion_ids: Tensor, eos_token_id: int | None) -> Tensor:
    """(B, G) bool: True up to and including the first EOS (all True when there is none or no EOS id)."""
    if eos_token_id is None:
        return torch.ones_like(completion_ids, dtype=torch.bool)
    is_eos = completion_ids == eos_token_id
    first = torch.where(is_eos.any(1), is_eos.long().argmax(1), completion_ids.shape[1])
    return torch.arange(completion_ids.shape[1], device=completion_ids.device)[None] <= first[:, None]


def _masked_completion(lm: MaskedLM, traj: TokenTrajectory, mask: Tensor) -> Tensor:
    return torch.where(mask, lm.mask_token_id, traj.completion_ids)


def _rows_rand(gens: list[torch.Generator], n: int, device: torch.device) -> Tensor:
    """(B, n) uniforms, row b from generator b."""
    return torch.stack([torch.rand(n, generator=g) for g in gens]).to(device)


# ------------------------------------------------------------------------------------------- estimators


@dataclass(frozen=True)
class OneStepEstimator:
    """d1's diffu-GRPO one-step estimator (Zhao et al. 2025, "d1: Scaling Reasoning in Diffusion LLMs via RL").

    ONE forward with the whole completion masked and each real prompt token masked independently with
    probability ``prompt_mask_prob`` (p = 0.15; the random prompt mask is d1's regulariser that makes the
    ``num_iterations`` inner updates see different inputs). ``token_log_probs[b, i] = log p(x_i | masked
    prompt, all-mask completion)``: a mean-field, per-token surrogate, not an estimate of log pi(x).

    Weights are 1 per completion token and d1's objective averages the per-token ratio terms over them.
    With ``pad_after_eos`` (d1's ``completion_mask``) tokens after the first EOS get weight 0 (the EOS
    itself counts); without an ``lm.eos_token_id`` every token counts. Prompt padding is never masked.
    """

    prompt_mask_prob: float  # d1: 0.15 (objective.prompt_mask_prob)
    pad_after_eos: bool = True

    def __call__(self, lm: MaskedLM, traj: TokenTrajectory, seed_index: int) -> EstimatorOutput:
        gens = row_generators(traj, seed_index)
        u = _rows_rand(gens, traj.prompt_ids.shape[1], traj.prompt_ids.device)
        prompt_masked = traj.prompt_mask.bool() & (u < self.prompt_mask_prob)
        prompt = torch.where(prompt_masked, lm.mask_token_id, traj.prompt_ids)
        completion = torch.full_like(traj.completion_ids, lm.mask_token_id)
        lp = token_log_probs(completion_logits(lm, traj, completion, prompt), traj.completion_ids)
        keep = torch.ones_like(lp, dtype=torch.bool)
        if self.pad_after_eos:
            keep = through_first_eos(traj.completion_ids, lm.eos_token_id)
        return EstimatorOutput(torch.where(keep, lp, 0.0), keep.float())


@dataclass(frozen=True)
class AnswerMaskEstimator:
    """UniGRPO's answer-only random masking as MMaDA's paper describes it (Yang et al. 2025; no UniGRPO code was
    released, so this is paper-derived); dLLM-RL's ``random_masking`` is the same estimator, not UniGRPO itself.

    Prompt never masked; per row a ratio ``r ~ U[low, high]``; each completion token masked with
    probability r (at least one: if none was, one uniformly random position is). One forward.
    ``weights = 1 / num_masked`` on masked positions, so the sequence estimate is the MEAN log-prob of the
    masked tokens given the unmasked ones. It estimates a per-token quantity: for a context-free model its
    expectation is ``log pi(x) / G`` exactly (every position is equally likely to be in the mask).
    """

    low: float  # 0.1 and 0.9 as dLLM-RL's lower_p / upper_p (objective.mask_low / mask_high); the paper: 0 and 1
    high: float

    def __call__(self, lm: MaskedLM, traj: TokenTrajectory, seed_index: int) -> EstimatorOutput:
        gens = row_generators(traj, seed_index)
        G = traj.completion_ids.shape[1]
        rows = []
        for g in gens:
            ratio = self.low + (self.high - self.low) * torch.rand((), generator=g)
            m = torch.rand(G, generator=g) < ratio
            if not m.any():  # an empty mask would give an undefined mean and no gradient
                m[torch.randint(G, (), generator=g)] = True
            rows.append(m)
        mask = torch.stack(rows).to(traj.completion_ids.device)
        lp = token_log_probs(completion_logits(lm, traj, _masked_completion(lm, traj, mask)), traj.completion_ids)
        weights = mask.float() / mask.sum(-1, keepdim=True).float()
        return EstimatorOutput(torch.where(mask, lp, 0.0), weights)


@dataclass(frozen=True)
class CoupledEstimator:
    """DiffuCoder's coupled sampling (Gong et al. 2025, "DiffuCoder", coupled-GRPO).

    Per row ``t ~ U[t_low, t_high]``; a random mask M (each completion token in M with probability t) and
    its complement; two forwards, prompt never masked. Each token's log-prob comes from the pass in which
    it was masked, so every token is scored exactly once. Weights ``1/(2t)`` on M and ``1/(2(1-t))`` on
    the complement: the sequence estimate is the AVERAGE of the two coupled LLaDA ELBO estimates
    ``sum_{i in M} lp_i / t`` and ``sum_{i not in M} lp_i / (1 - t)`` (the paper's eq.), an unbiased
    ELBO estimate; for a context-free model its expectation is exactly ``log pi(x)``.

    What we chose versus DiffuCoder's released code, and why:
    - the code puts ``(lp_full + where(M, lp_M / t, lp_Mc / (1 - t))) / 2`` INSIDE the per-token ratio,
      with ``lp_full`` from a third, fully masked pass. Scaling by 1/t inside exp sharpens the ratio by up
      to 1/t (5x at t = 0.2) and changes what the clip range means, so we keep 1/t in ``weights`` and
      leave ``token_log_probs`` unscaled; the 1/2 is the code's averaging. The third pass is d1's
      estimator (``OneStepEstimator``); combine the two at the objective if wanted.
    - t is drawn per row (the code draws one t per batch) so a row's masks do not depend on its batch.
    - default t range [0.2, 0.8] as in the code: under t ~ U(0, 1) (``t_low=0, t_high=1``, the paper's
      form) the 1/t weight gives the estimate infinite variance (Var ~ 1/t near 0).
    """

    t_low: float = 0.2
    t_high: float = 0.8

    def __call__(self, lm: MaskedLM, traj: TokenTrajectory, seed_index: int) -> EstimatorOutput:
        gens = row_generators(traj, seed_index)
        G = traj.completion_ids.shape[1]
        device = traj.completion_ids.device
        t = self.t_low + (self.t_high - self.t_low) * torch.stack([torch.rand((), generator=g) for g in gens])
        t = t.clamp(1e-6, 1 - 1e-6).to(device)[:, None]
        mask = _rows_rand(gens, G, device) < t
        lp_m = token_log_probs(completion_logits(lm, traj, _masked_completion(lm, traj, mask)), traj.completion_ids)
        lp_c = token_log_probs(completion_logits(lm, traj, _masked_completion(lm, traj, ~mask)), traj.completion_ids)
        weights = torch.where(mask, 0.5 / t, 0.5 / (1 - t)).float()
        return EstimatorOutput(torch.where(mask, lp_m, lp_c), weights)


def _mask_counts(gens: list[torch.Generator], G: int, n: int, stratified: bool) -> Tensor:
    """(B, n) mask counts in [1, G]; each one marginally uniform on {1..G}.

    Stratified: one ``u ~ U[0, 1)`` per row and ``l_j = ceil(G (j + u) / n)``, so the n counts cover
    [1, G] evenly (``(j + u) / n`` is U(0, 1) for a uniform j, hence each l_j is uniform on {1..G}).
    """
    if stratified:
        u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in gens])
        j = torch.arange(n, dtype=torch.float64)
        return torch.ceil(G * (j[None] + u[:, None]) / n).long().clamp(1, G)
    return torch.stack([torch.randint(1, G + 1, (n,), generator=g) for g in gens])


def elbo_terms(
    lm: MaskedLM, traj: TokenTrajectory, seed_index: int, num_samples: int = 4, stratified: bool = True
) -> Iterator[EstimatorOutput]:
    """LLaDA's ELBO one Monte-Carlo sample at a time (Nie et al. 2025, "LLaDA", likelihood evaluation).

    ``log pi(x|q) >= E_{l ~ U{1..G}} E_{|M| = l} [ (G / l) sum_{i in M} log p(x_i | q, x with M masked) ]``
    (the lower-variance form with an exact mask count; ``G / l`` is the 1/t weight with t = l / G).

    Sample j masks exactly ``l_j`` uniformly random completion positions (prompt never masked) and
    yields ``token_log_probs`` at the masked positions with ``weights = G / l_j`` there (the 1/t weight
    with t = l / G), so ``sequence_log_prob()`` of each term is
    ``(G / l_j) sum_{i masked} log p(x_i | x_unmasked)``, a lower bound on log pi(x) in expectation.
    Each term alone is unbiased for the ELBO; for a context-free model it equals ``log pi(x)`` in
    expectation (even conditionally on l_j). BGPO backpropagates each term on its own so memory does not
    grow with ``num_samples``; one forward per term, drawn lazily.
    """
    gens = row_generators(traj, seed_index)
    B, G = traj.completion_ids.shape
    device = traj.completion_ids.device
    counts = _mask_counts(gens, G, num_samples, stratified)
    for j in range(num_samples):
        mask = torch.zeros(B, G, dtype=torch.bool)
        for b, g in enumerate(gens):
            mask[b, torch.randperm(G, generator=g)[: int(counts[b, j])]] = True
        mask = mask.to(device)
        lp = token_log_probs(completion_logits(lm, traj, _masked_completion(lm, traj, mask)), traj.completion_ids)
        weights = mask.float() * (G / counts[:, j : j + 1].to(device=device, dtype=torch.float32))
        yield EstimatorOutput(torch.where(mask, lp, 0.0), weights)


@dataclass(frozen=True)
class ELBOEstimator:
    """LLaDA's ELBO averaged over ``num_samples`` stratified Monte-Carlo samples (see ``elbo_terms``).

    The estimate is the mean over j of the terms' sequence estimates. To return one (B, G) pair, the
    terms are merged per position: ``weights_i = mean_j w_ji`` and ``token_log_probs_i`` is the
    ``w``-weighted mean of that position's log-probs over the samples that masked it, so
    ``sum_i weights_i * token_log_probs_i == mean_j sum_i w_ji lp_ji`` (up to rounding). Keeps every
    term's graph alive; use ``terms`` (BGPO) to backpropagate one sample at a time.
    """

    num_samples: int = 4
    stratified: bool = True

    def terms(self, lm: MaskedLM, traj: TokenTrajectory, seed_index: int) -> Iterator[EstimatorOutput]:
        return elbo_terms(lm, traj, seed_index, self.num_samples, self.stratified)

    def __call__(self, lm: MaskedLM, traj: TokenTrajectory, seed_index: int) -> EstimatorOutput:
        sum_w = sum_wlp = None
        for lp, w in self.terms(lm, traj, seed_index):
            sum_w = w if sum_w is None else sum_w + w
            sum_wlp = w * lp if sum_wlp is None else sum_wlp + w * lp
        counted = sum_w > 0
        lp = torch.where(counted, sum_wlp / torch.where(counted, sum_w, 1.0), 0.0)
        return EstimatorOutput(lp, sum_w / self.num_samples)


def replay_logits(lm: MaskedLM, traj: TokenTrajectory) -> Iterator[tuple[int, Tensor, Tensor]]:
    """For each denoising step s at which something was unmasked: (s, state before s (B, G), logits (B, G, V)).

    Steps at which no row unmasked anything are skipped (no forward): their action is empty.
    """
    for s in range(traj.num_steps):
        if not bool((traj.unmask_step == s).any()):
            continue
        state = traj.state_at(s, lm.mask_token_id)
        yield s, state, completion_logits(lm, traj, state)


def step_groups(unmask_step: Tensor, num_steps: int, steps_per_forward: int) -> Tensor:
    """(B, G) int64: each position's group of ``steps_per_forward`` consecutive acting steps of its own row (TraceRL's
    ``collapse_k_unique``: a row's distinct unmasking steps in order, k to a group). Steps at which a row unmasked
    nothing do not count, so with ``steps_per_forward=1`` the group is the rank of the position's step in its row."""
    acted = torch.zeros(unmask_step.shape[0], num_steps, dtype=torch.long, device=unmask_step.device)
    acted.scatter_(1, unmask_step, 1)
    rank_of_step = acted.cumsum(1) - 1  # (B, num_steps): how many acting steps came before, for an acting step
    return rank_of_step.gather(1, unmask_step) // steps_per_forward


@dataclass(frozen=True)
class TrajectoryReplayEstimator:
    """TraceRL-style trajectory replay (Wang et al. 2025, "Revolutionizing RL Framework for dLLMs", TraceRL).

    Each position's log-prob (model softmax, temperature 1) given the state its token was committed in: the
    completion with every position of an earlier group of steps (``step_groups``) written and the rest masked, prompt
    unmasked. With ``steps_per_forward=1`` the sum is ``sum_s log p(tokens chosen at s | state_s)``, the exact log-prob
    of the sampled TOKENS along this trajectory given its unmasking order (the order's own probability is not included;
    see ``plackett_luce.dcolt_log_probs`` for that); with k > 1, TraceRL's ``shrink``, the tokens of k consecutive
    steps are scored together from the state before the first of them (one forward per k steps, an approximation).

    ``step_weights``: weight 1 per token (False), or 1 / (tokens the position's group committed) so that each group
    weighs 1 whatever its size (True; TraceRL's mean over each step's tokens, see ``objectives/dllm/tracerl.py``).
    No randomness: ``seed_index`` is ignored. Cost: one forward per group (num_steps / k), versus 1-4 for the masked
    estimators.
    """

    steps_per_forward: int  # 1: the exact replay (the objective's section holds the default)
    step_weights: bool = False

    def __call__(self, lm: MaskedLM, traj: TokenTrajectory, seed_index: int = 0) -> EstimatorOutput:
        group = step_groups(traj.unmask_step, traj.num_steps, self.steps_per_forward)
        lp = torch.zeros(traj.completion_ids.shape, dtype=torch.float32, device=traj.completion_ids.device)
        mask = torch.full_like(traj.completion_ids, lm.mask_token_id)
        for g in range(int(group.max()) + 1 if group.numel() else 0):
            state = torch.where(group < g, traj.completion_ids, mask)
            lp = torch.where(group == g, token_log_probs(completion_logits(lm, traj, state), traj.completion_ids), lp)
        if not self.step_weights:
            return EstimatorOutput(lp, torch.ones_like(lp))
        tokens_in_group = torch.zeros_like(lp).scatter_add_(1, group, torch.ones_like(lp))  # (B, G): column g = group g's size
        return EstimatorOutput(lp, 1.0 / tokens_in_group.gather(1, group))


ESTIMATORS = {
    "one_step": OneStepEstimator,
    "answer_mask": AnswerMaskEstimator,
    "coupled": CoupledEstimator,
    "elbo": ELBOEstimator,
    "trajectory_replay": TrajectoryReplayEstimator,
}

__all__ = [
    "ESTIMATORS",
    "AnswerMaskEstimator",
    "CoupledEstimator",
    "ELBOEstimator",
    "EstimatorOutput",
    "LogLikelihoodEstimator",
    "OneStepEstimator",
    "TrajectoryReplayEstimator",
    "completion_logits",
    "elbo_terms",
    "replay_logits",
    "row_generators",
    "step_groups",
    "through_first_eos",
    "token_log_probs",
]
