"""Pictures for the run directory: sample grids and the reward curve."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from .checkpoint import atomic_path


def save_grid(samples: torch.Tensor, path: Path, ncol: int, scale: int = 6, pad: int = 2) -> None:
    """Save images (N, C, H, W) in [0, 1] as one PNG grid, rows of ``ncol``, upscaled ``scale`` x."""
    n, c, h, w = samples.shape
    nrow = (n + ncol - 1) // ncol
    H, W = h * scale + pad, w * scale + pad
    canvas = np.full((nrow * H + pad, ncol * W + pad, 3), 40, dtype=np.uint8)
    imgs = (samples.detach().float().clamp(0, 1).cpu().numpy() * 255).round().astype(np.uint8)
    for i, img in enumerate(imgs):
        img = np.repeat(img, 3, axis=0) if c == 1 else img[:3]
        img = img.transpose(1, 2, 0).repeat(scale, 0).repeat(scale, 1)
        r, col = divmod(i, ncol)
        canvas[pad + r * H : pad + r * H + h * scale, pad + col * W : pad + col * W + w * scale] = img
    with atomic_path(path) as tmp:
        Image.fromarray(canvas).save(tmp, format="PNG")


def save_reward_curve(records: Sequence[dict[str, Any]], path: Path, title: str = "") -> None:
    """Plot training reward (mean +- std of each rollout) and held-out evaluation reward against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["reward/mean"], r.get("reward/std") or 0.0) for r in records if r.get("reward/mean") is not None]
    evals = [(r["step"], r["eval/reward/mean"]) for r in records if r.get("eval/reward/mean") is not None]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    if train:
        s, m, sd = map(np.array, zip(*train))
        ax.plot(s, m, label="train reward (rollout mean)", color="tab:blue")
        ax.fill_between(s, m - sd, m + sd, color="tab:blue", alpha=0.15)
    if evals:
        s, m = map(np.array, zip(*evals))
        ax.plot(s, m, "o-", label="held-out eval reward", color="tab:orange")
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
