"""Pure loss, advantage and preference math (docs/math.md sections 3-4). Every objective calls these; none re-derives them."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from ..samplers.log_prob import Reduction

StdConvention = Literal["unbiased", "biased", "global", "none"]


def group_advantages(rewards: Tensor, group_ids: Tensor, std: StdConvention = "unbiased", eps: float = 1e-8) -> Tensor:
    """GRPO advantages ``(r - mean_group) / (std + eps)``.

    std: "unbiased" (DanceGRPO: N-1 denominator, eps 1e-8), "biased" (Flow-GRPO: N denominator, eps 1e-4),
    "global" (Flow-GRPO's global-std option: group mean, std over the whole batch), "none" (d1: r - mean).
    Non-finite rewards are left out of every statistic and get advantage 0; a group with fewer than two
    finite rewards gets advantage 0 (nothing to compare against). Returns (B,) float32.
    """
    rewards = rewards.float()
    finite = torch.isfinite(rewards)
    adv = torch.zeros_like(rewards)
    global_std = rewards[finite].std(unbiased=False) if std == "global" else None
    for g in torch.unique(group_ids):
        members = (group_ids == g) & finite
        r = rewards[members]
        if r.numel() < 2:
            continue
        centred = r - r.mean()
        if std == "unbiased":
            centred = centred / (r.std(unbiased=True) + eps)
        elif std == "biased":
            centred = centred / (r.std(unbiased=False) + eps)
        elif std == "global":
            centred = centred / (global_std + eps)
        adv[members] = centred
    return adv


def group_means(values: Tensor, valid: Tensor, ids: Tensor) -> Tensor:
    """(B,) each row's mean of ``values`` over the valid rows sharing its id (ids in 0..n-1); NaN where none is valid."""
    v = torch.where(valid, values.float(), torch.zeros_like(values, dtype=torch.float32))
    sums = torch.zeros(int(ids.max()) + 1).index_add_(0, ids, v)
    counts = torch.zeros(int(ids.max()) + 1).index_add_(0, ids, valid.float())
    return (sums / counts)[ids]


def best_worst_subset(rewards: Tensor, group_ids: Tensor, k: int) -> Tensor:
    """Indices of the top k/2 and bottom k/2 rewards of every group (DanceGRPO's best-of-N subset)."""
    keep = []
    for g in torch.unique(group_ids):
        idx = torch.nonzero((group_ids == g) & torch.isfinite(rewards)).flatten()
        order = idx[torch.argsort(rewards[idx], descending=True)]
        half = max(1, k // 2)
        chosen = order if order.numel() <= 2 * half else torch.cat([order[:half], order[-half:]])
        keep.append(chosen)
    return torch.sort(torch.cat(keep)).values


def masked_mean(values: Tensor, mask: Tensor | None) -> Tensor:
    """Mean over the samples where ``mask`` is True (all when None); 0 when none are. A numeric mask weighs each
    sample: ``sum_b m_b v_b / sum_b m_b`` (the dLLM objectives' token_mean counts each row's tokens this way)."""
    if mask is None:
        return values.mean()
    return (values * mask).sum() / mask.sum().clamp(min=1)


def clipped_surrogate_terms(ratio: Tensor, advantages: Tensor, clip_range: float) -> Tensor:
    """Elementwise PPO term max(-A r, -A clip(r, 1 - eps, 1 + eps)) (any shape; A broadcasts)."""
    return torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range))


def k3_kl(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per element: exp(ref - lp) - (ref - lp) - 1 (>= 0, unbiased)."""
    d = ref_log_prob - log_prob
    return torch.exp(d) - d - 1


def clipped_surrogate(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, clip_range: float, mask: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate for one denoising step.

    loss = mean_B max(-A r, -A clip(r, 1 - eps, 1 + eps)),  r = exp(log_prob - old_log_prob),
    the mean taken over samples where ``mask`` (B,) is True (samples whose reward was dropped are
    masked out rather than removed, so every process keeps the same batch shapes).
    Returns the scalar loss and detached statistics (ratio mean, clip fraction, approx KL as DDPO logs it:
    0.5 mean (log r)^2).
    """
    mask = None if mask is None else mask.float()
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    loss = masked_mean(clipped_surrogate_terms(ratio, advantages, clip_range), mask)
    with torch.no_grad():
        stats = {
            "ratio_mean": masked_mean(ratio, mask),
            "clipfrac": masked_mean(((ratio - 1.0).abs() > clip_range).float(), mask),
            "approx_kl": masked_mean(0.5 * log_ratio**2, mask),
        }
    return loss, stats


def noise_level_step_weights(stds: Tensor) -> Tensor:
    """TempFlow-GRPO's noise-aware step weights (He et al. 2025, arXiv:2508.04324) for the trained steps S:

        w_k = s_k / ((1 / |S|) sum_{j in S} s_j),   k in S,

    with s_k the transition std of step k (Flow-GRPO: s_k = g(sigma_k) sqrt(sigma_k - sigma_{k+1})). A step whose
    sampling noise is larger can move the outcome more, so its policy-gradient term counts more; the weights
    average to 1 over S, so the loss scale (and the learning rate that suits it) is that of uniform weights.
    stds: (|S|,) positive. Returns (|S|,) float32.
    """
    stds = stds.float()
    return stds / stds.mean()


def inverse_dt_step_weights(sigmas: Tensor, sigmas_next: Tensor) -> Tensor:
    """GRPO-Guard's gradient re-weighting (Wang et al. 2025, arXiv:2510.22319) for the trained steps S:

        w_k = (1 / |dt_k|) / ((1 / |S|) sum_{j in S} 1 / |dt_j|),   dt_k = sigma_{k+1} - sigma_k,   k in S.

    A Flow-SDE step's mean moves by dt times the velocity, so the policy gradient of step k scales with |dt_k|;
    1/|dt_k| equalises the steps of a non-uniform grid (the paper's delta = beta / dt with beta constant for
    Flow-GRPO's SDE). The paper multiplies each step's loss by 1/dt itself; flowrl normalises the weights to
    mean 1 over S (as noise_level_step_weights), so the loss scale, and the learning rate that suits it, stay
    those of uniform weights: on a uniform grid every weight is exactly 1. sigmas, sigmas_next: (|S|,).
    Returns (|S|,) float32."""
    inv = 1.0 / (sigmas.double() - sigmas_next.double()).abs()
    return (inv / inv.mean()).float()


def gaussian_kl(mean: Tensor, ref_mean: Tensor, std: Tensor, reduction: Reduction = "mean") -> Tensor:
    """KL( N(mean, std^2 I) || N(ref_mean, std^2 I) ) = (mean - ref_mean)^2 / (2 std^2), reduced like the
    log-prob (per-dimension mean by default). Returns (B,)."""
    elem = (mean.float() - ref_mean.float()) ** 2 / (2 * std.float() ** 2)
    dims = tuple(range(1, elem.ndim))
    return elem.mean(dims) if reduction == "mean" else elem.sum(dims)


def pair_preferences(
    rewards: Tensor, components: dict[str, Tensor] | None, first: Tensor, second: Tensor, mode: Literal["reward", "pareto"] = "reward"
) -> Tensor:
    """Preference h in {+1, -1, 0} of sample ``first[i]`` over ``second[i]`` (D3PO's labels from rewards).

    "reward": the sign of the combined-reward difference. "pareto" (D3PO's multi-reward comparison): +1 if
    ``first`` is at least as good in every component and better in one, -1 for the reverse, 0 otherwise.
    A pair with a non-finite reward, or a tie, gets 0. Returns (P,) float32.
    """
    rewards = rewards.float()
    finite = torch.isfinite(rewards[first]) & torch.isfinite(rewards[second])
    if mode == "reward":
        h = torch.sign(rewards[first] - rewards[second])
    else:
        diffs = torch.stack([c.float()[first] - c.float()[second] for c in (components or {}).values()])
        h = (diffs >= 0).all(0).float() * (diffs > 0).any(0).float() - (diffs <= 0).all(0).float() * (diffs < 0).any(0).float()
    return torch.where(finite, h, torch.zeros_like(h))


def d3po_pair_loss(log_ratio_winner: Tensor, log_ratio_loser: Tensor, beta: float, clip_range: float) -> Tensor:
    """D3PO's per-pair loss ``-log sigmoid(beta * (log r_w - log r_l))`` (docs/math.md section 4).

    ``log_ratio`` = log p_theta(x_{t-1} | x_t) - log p_ref(x_{t-1} | x_t) of one stored transition; the ratio
    is clamped to [1 - clip_range, 1 + clip_range] (D3PO's eps = 0.1), so a transition already moved that far
    from the reference gives no gradient. Returns (P,).
    """
    lo, hi = math.log(1.0 - clip_range), math.log(1.0 + clip_range)
    z = beta * (log_ratio_winner.clamp(lo, hi) - log_ratio_loser.clamp(lo, hi))
    return -torch.nn.functional.logsigmoid(z)


def diffusion_dpo_loss(err_winner: Tensor, err_loser: Tensor, ref_err_winner: Tensor, ref_err_loser: Tensor, beta: float) -> Tensor:
    """Diffusion-DPO's per-pair loss (docs/math.md section 4).

    ``err`` = per-sample mean squared error of the denoiser's prediction against its regression target at
    the pair's shared noise and time. With d = err_w - err_l for the model and for the reference,
    loss = -log sigmoid(-0.5 * beta * (d_model - d_ref)): below log 2 exactly when the model fits the
    winner better (relative to the loser) than the reference does. Returns (P,).
    """
    d_model, d_ref = err_winner - err_loser, ref_err_winner - ref_err_loser
    return -torch.nn.functional.logsigmoid(-0.5 * beta * (d_model - d_ref))
