"""What the embedded models' training scripts (``train_*.py``) share: the learning-rate schedule, one optimiser
step, the loss's running average, the command line's common flags and the atomic write of the finished model.

The scripts re-create the weights shipped in ``flowrl/assets/`` byte for byte for a seed and thread count, so each
helper does exactly what the scripts did inline, in the same order (one definition, not five that must agree).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ...atomic_files import atomic_directory

ASSETS = Path(__file__).resolve().parents[2] / "assets"  # where the shipped models live


def warmup_cosine(opt: torch.optim.Optimizer, steps: int, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup`` steps, then a cosine decay to zero at ``steps``."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps))
    )


def optimizer_step(
    loss: torch.Tensor,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    clip: Iterable[torch.nn.Parameter] | None = None,
) -> None:
    """Back-propagate ``loss`` and take one step of ``opt`` and ``sched``; ``clip``: the parameters whose gradient
    norm is clipped to 1 first (None: no clipping)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(clip, 1.0)
    opt.step()
    sched.step()


def loss_ema(ema: float | None, loss: torch.Tensor) -> float:
    """The loss's exponential moving average (weight 0.02 on the new value), shown on the progress bar and recorded
    as ``final_loss_ema``; the first loss starts it."""
    return loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()


def training_parser(doc: str, *, out: Path | None, steps: int, batch_size: int, lr: float, threads: int = 1) -> argparse.ArgumentParser:
    """The flags every training script takes (``--out``, ``--steps``, ``--batch-size``, ``--lr``, ``--seed``,
    ``--threads``) with the script's defaults; the script adds its own."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=threads)
    return p


def parse_training_arguments(p: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the command line and set torch's thread count (the weights depend on it)."""
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    return a


def save_model(out: Path, parts: Sequence[tuple[str, Any]], info: dict[str, Any]) -> None:
    """Write each ``(subdirectory, object)`` of ``parts`` with its ``save_pretrained`` ("" for the directory itself)
    and ``training_info.json`` into ``out``, atomically: a crash never leaves a half-written model."""
    with atomic_directory(out) as tmp:
        for sub, part in parts:
            part.save_pretrained(tmp / sub)
        (tmp / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
