"""Pictures for the run directory: sample grids, the reward curve and the reward-hacking instruments."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .atomic_files import atomic_path
from .errors import FlowRLError

# The image formats a grid can be written in, by file extension (lower case), as PIL names them.
IMAGE_FORMATS = {
    ".png": "PNG",
    ".jpg": "JPEG",
    ".jpeg": "JPEG",
    ".webp": "WEBP",
    ".gif": "GIF",
    ".bmp": "BMP",
    ".tif": "TIFF",
    ".tiff": "TIFF",
}
# How each format is saved (the grid is always 8-bit RGB, which every one of them stores): PNG, WebP
# (lossless), BMP and TIFF keep every pixel; JPEG is lossy (quality 95, no chroma subsampling, so thin
# digit strokes keep their colour); GIF keeps every pixel of a grid with at most 256 colours (grayscale
# grids always) and reduces others to a 256-colour palette.
_SAVE_OPTIONS: dict[str, dict[str, Any]] = {"JPEG": {"quality": 95, "subsampling": 0}, "WEBP": {"lossless": True}}


def image_format(path: Path | str, also: Sequence[str] = ()) -> str:
    """The PIL format named by ``path``'s extension (case-insensitive), or one sentence refusing it.
    ``also``: other extensions the caller handles itself (e.g. ``.npy``), named in the refusal."""
    fmt = IMAGE_FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        known = [*IMAGE_FORMATS, *also]
        raise FlowRLError(f"cannot tell an image format from the extension of '{path}'; use {', '.join(known[:-1])} or {known[-1]}.")
    return fmt


def save_image(array: np.ndarray, path: Path) -> None:
    """Write a uint8 (H, W, 3) array atomically, in the format ``path``'s extension names (``image_format``)."""
    fmt = image_format(path)
    with atomic_path(path) as tmp:
        Image.fromarray(array).save(tmp, format=fmt, **_SAVE_OPTIONS.get(fmt, {}))


def save_grid(samples: torch.Tensor, path: Path, ncol: int, scale: int = 6, pad: int = 2) -> None:
    """Save images (N, C, H, W) in [0, 1] as one grid, rows of ``ncol``, upscaled ``scale`` x, in the format
    ``path``'s extension names (.png, .jpg / .jpeg, .webp, .gif, .bmp, .tif / .tiff; see ``image_format``).

    Videos (N, C, T, H, W) become a filmstrip: one row per video, its T frames left to right."""
    image_format(path)  # refuse an unknown extension before any work
    if samples.ndim == 5:
        n, c, t, h, w = samples.shape
        samples, ncol = samples.permute(0, 2, 1, 3, 4).reshape(n * t, c, h, w), t
    save_image(grid_array(samples, ncol, scale, pad), Path(path))


def save_points(points: torch.Tensor, path: Path, title: str = "") -> None:
    """Save 2-D samples (N, 2) as a scatter plot PNG (the toy models' "sample grid")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xy = points.detach().float().cpu().numpy()
    fig, ax = plt.subplots(figsize=(5, 4), dpi=100)
    ax.scatter(xy[:, 0], xy[:, 1], s=3, alpha=0.4)
    ax.set_xlim(-4.5, 4.5)
    ax.set_ylim(-3, 3)
    ax.set_aspect("equal")
    ax.set_xlabel("x1")
    ax.set_ylabel("x2")
    ax.set_title(title or f"{len(xy)} samples")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def grid_array(samples: torch.Tensor, ncol: int, scale: int = 1, pad: int = 2) -> np.ndarray:
    """Images (N, C, H, W) in [0, 1] -> one uint8 (H', W', 3) grid, rows of ``ncol``."""
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
    return canvas


def save_videos(videos: torch.Tensor, stem: Path, ncol: int, fps: int = 8, scale: int | None = None) -> list[Path]:
    """Write videos (N, C, T, H, W) in [0, 1] as one animated grid: ``stem.mp4`` (H.264 through imageio's
    ffmpeg plugin) and ``stem.gif``. Returns the paths written."""
    import imageio.v2 as imageio

    n, c, t, h, w = videos.shape
    if scale is None:  # tiny embedded videos are upscaled to be visible; real ones are kept as they are
        scale = max(1, 128 // max(h, w))
    frames = [grid_array(videos[:, :, i], ncol, scale) for i in range(t)]
    # H.264 in yuv420p needs even sides
    frames = [np.pad(f, ((0, f.shape[0] % 2), (0, f.shape[1] % 2), (0, 0))) for f in frames]
    written = []
    with atomic_path(stem.with_suffix(".gif")) as tmp:
        imageio.mimsave(tmp, frames, format="GIF", duration=1000 / fps, loop=0)
    written.append(stem.with_suffix(".gif"))
    mp4 = stem.with_suffix(".mp4")
    tmp = mp4.with_name(f".{mp4.stem}.partial.mp4")  # ffmpeg picks the container from the suffix
    try:
        imageio.mimsave(tmp, frames, fps=fps, codec="libx264", pixelformat="yuv420p", macro_block_size=1)
        tmp.replace(mp4)
        written.append(mp4)
    except (ImportError, ValueError, RuntimeError, OSError) as e:  # no ffmpeg backend: the GIF still shows the run
        tmp.unlink(missing_ok=True)
        import warnings

        warnings.warn(f"MP4 not written ({str(e).splitlines()[0][:120]}); install imageio-ffmpeg (flowrl[video]).", stacklevel=2)
    return written


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


def save_instruments(records: Sequence[dict[str, Any]], path: Path, title: str = "") -> None:
    """The reward-hacking instruments in one picture (docs/instruments.md): the rewards (training rollouts,
    held-out evaluation, the held-out judge), the seed diversity per prompt, and the importance ratio's spread
    per update. Over-optimisation shows as the training reward rising while the judge or the diversity falls."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key: str) -> tuple[np.ndarray, np.ndarray]:
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        return tuple(map(np.array, zip(*pts))) if pts else (np.array([]), np.array([]))

    stand_in = any(r.get("eval/judge/is_eval_reward") for r in records)
    panels = [
        ("reward", [("reward/mean", "train reward (rollouts)", "-"), ("eval/reward/mean", "held-out eval reward", "o-")]),
        (
            "judge (never trained on)" if not stand_in else "judge = held-out eval reward (no eval.judge set)",
            [("eval/judge/mean", "held-out judge", "o-")],
        ),
        ("seed diversity per prompt", [("eval/diversity", "mean pairwise L2 (held-out)", "o-")]),
        (
            "importance ratio per update",
            [
                ("policy/ratio_std", "ratio std (mean over steps)", "-"),
                ("policy/ratio_shift", "1 - ratio mean (GRPO-Guard's left shift)", "-"),
            ],
        ),
    ]
    records = [
        {**r, "policy/ratio_shift": 1 - r["policy/ratio_mean"]} if isinstance(r.get("policy/ratio_mean"), (int, float)) else r
        for r in records
    ]
    fig, axes = plt.subplots(2, 2, figsize=(9, 6), dpi=100, sharex=True)
    for ax, (name, lines) in zip(axes.flat, panels):
        drawn = False
        for key, label, style in lines:
            s, v = series(key)
            if len(s):
                ax.plot(s, v, style, label=label, markersize=3)
                drawn = True
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("iteration")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
