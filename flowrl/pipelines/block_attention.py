"""Block-causal attention for block-diffusion language models (BD3-LM, SDAR, TraDo style).

The sequence ``[prompt ; completion]`` is cut into blocks of ``block_length`` tokens, aligned to the sequence's
END, so the completion (a whole number of blocks) starts on a block boundary whatever the prompt's length; the
prompt's first block may be shorter. A query attends to every key of its own block and of the blocks before it,
never to a later block. That is what makes a key-value cache exact: the keys and values of the prompt and of the
finished blocks cannot change when a later block changes, so they are computed once and reused.

Masks are additive float tensors (0 = attend, the dtype's minimum = not), shape (B, 1, Q, K): transformers passes a
4-D mask through unchanged, and its eager attention ADDS the mask to the scores (a boolean mask there is silently
wrong; sdpa accepts either). Padding keys are never attended; every query attends to itself, so no row is fully
masked (a padding query's output is never read, and this keeps it finite).

Position ids count real tokens only (left padding does not shift the completion), as the training script does.

Training (``block_diffusion_training_mask``) follows BD3-LM's vectorised form: the input is ``[prompt ; x_t ; x_0]``
(noised and clean completion side by side, both at the completion's positions); a noised block attends to itself and
to the CLEAN earlier blocks, a clean block to itself and the clean blocks before it. So each noised block is predicted
from exactly the context it has at sampling time (clean finished blocks), for every block in one forward.
"""

from __future__ import annotations

import torch
from torch import Tensor


def block_ids(length: int, block_length: int, device: torch.device | None = None) -> Tensor:
    """(length,) int64 block index of each position, blocks aligned to the end: the last ``block_length``
    positions are block -1, the ones before -2, ... (only the order matters)."""
    i = torch.arange(length, device=device)
    return torch.div(i - length, block_length, rounding_mode="floor")


def additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where ``allowed``, the dtype's minimum elsewhere (an additive attention mask)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def position_ids(attention_mask: Tensor) -> Tensor:
    """(B, L) positions counting real tokens only; padding gets position 0 (never attended as a key)."""
    mask = attention_mask.bool()
    return (mask.long().cumsum(-1) - 1).clamp_min(0).masked_fill(~mask, 0)


def _self(q: int, L: int, device: torch.device) -> Tensor:
    """(q, L) True where query r (position L - q + r) meets its own key."""
    return torch.arange(L, device=device)[None, :] == (torch.arange(q, device=device) + L - q)[:, None]


def block_causal_mask(attention_mask: Tensor, block_length: int, dtype: torch.dtype, queries: int | None = None) -> Tensor:
    """(B, 1, Q, L) additive mask for keys ``attention_mask`` (B, L) (1 = real token) and the last ``queries`` positions
    as queries (all L by default; fewer when the earlier ones are in a key-value cache)."""
    B, L = attention_mask.shape
    q = L if queries is None else queries
    blocks = block_ids(L, block_length, attention_mask.device)
    allowed = blocks[None, :] <= blocks[L - q :, None]  # (Q, L): own block and earlier ones
    allowed = allowed[None] & attention_mask.bool()[:, None, :]  # (B, Q, L): never a padding key
    allowed = allowed | _self(q, L, attention_mask.device)[None]
    return additive(allowed, dtype)[:, None]


def full_mask(attention_mask: Tensor, dtype: torch.dtype, queries: int | None = None) -> Tensor:
    """(B, 1, Q, L) additive bidirectional mask: every real key, for the last ``queries`` positions."""
    B, L = attention_mask.shape
    q = L if queries is None else queries
    allowed = attention_mask.bool()[:, None, :].expand(B, q, L) | _self(q, L, attention_mask.device)[None]
    return additive(allowed, dtype)[:, None]


def block_diffusion_training_mask(prompt_mask: Tensor, completion_length: int, block_length: int, dtype: torch.dtype) -> Tensor:
    """(B, 1, P + 2G, P + 2G) additive mask for the training input ``[prompt ; x_t ; x_0]`` (see the module docstring).

    ``prompt_mask``: (B, P), 1 = real prompt token. ``completion_length`` G must be a multiple of ``block_length``.
    """
    B, P = prompt_mask.shape
    G, device = completion_length, prompt_mask.device
    ids = block_ids(P + G, block_length, device)
    block = torch.cat([ids, ids[P:]])  # prompt, x_t, x_0 (x_0 at x_t's blocks)
    noised = (torch.arange(P + 2 * G, device=device) >= P) & (torch.arange(P + 2 * G, device=device) < P + G)
    q_block, k_block = block[:, None], block[None, :]
    q_noised, k_noised = noised[:, None], noised[None, :]
    clean_key = ~k_noised & ((k_block < q_block) | ((k_block == q_block) & ~q_noised))
    own_noised_block = k_noised & q_noised & (k_block == q_block)
    keys = torch.cat([prompt_mask.bool(), torch.ones(B, 2 * G, dtype=torch.bool, device=device)], 1)
    allowed = (clean_key | own_noised_block)[None] & keys[:, None, :]
    allowed = allowed | torch.eye(P + 2 * G, dtype=torch.bool, device=device)[None]
    return additive(allowed, dtype)[:, None]


def block_diffusion_training_positions(prompt_mask: Tensor, completion_length: int) -> Tensor:
    """(B, P + 2G) position ids of ``[prompt ; x_t ; x_0]``: x_0 repeats x_t's positions."""
    full = position_ids(
        torch.cat([prompt_mask.long(), torch.ones(prompt_mask.shape[0], completion_length, dtype=torch.long, device=prompt_mask.device)], 1)
    )
    return torch.cat([full, full[:, prompt_mask.shape[1] :]], 1)


__all__ = [
    "additive",
    "block_causal_mask",
    "block_diffusion_training_mask",
    "block_diffusion_training_positions",
    "block_ids",
    "full_mask",
    "position_ids",
]
