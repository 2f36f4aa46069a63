"""Train the digit classifier behind the ``digit_classifier`` reward and write its weights.

    python -m flowrl.reward_models.train_digit_classifier [--out DIR] [--seed 0]

Trains on 80% of scikit-learn's 8x8 digits (a split fixed by the seed), reports accuracy on the
other 20%, and writes ``model.safetensors`` and ``training_info.json`` into ``DIR`` (default: the
shipped ``flowrl/assets/digit_classifier/``). Augmentation (1-pixel shifts, contrast jitter, pixel
noise) keeps the classifier robust to the slightly off-centre, noisy images a generator makes.
Deterministic for a given seed and thread count; takes a few seconds on one CPU thread.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from flowrl.atomic_files import atomic_directory
from flowrl.data.digits import load_digit_images
from flowrl.reward_models.digit_classifier import DEFAULT_DIR, WEIGHTS_FILE, DigitClassifier

TRAIN_FRACTION = 0.8


def split_indices(n: int, seed: int) -> tuple[Tensor, Tensor]:
    """Return (train, held_out) index tensors: a seeded permutation cut at 80%."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    cut = int(round(TRAIN_FRACTION * n))
    return perm[:cut], perm[cut:]


def unit_images() -> tuple[Tensor, Tensor]:
    """The digits mapped from the generators' [-1, 1] to the rewards' [0, 1], with labels."""
    images, labels = load_digit_images()
    return (images + 1.0) / 2.0, labels


def augment(x: Tensor, gen: torch.Generator) -> Tensor:
    """Shift each image by up to one pixel (zero fill), jitter its contrast, and add pixel noise."""
    b, _, h, w = x.shape
    padded = F.pad(x, (1, 1, 1, 1))
    dy = torch.randint(0, 3, (b,), generator=gen)
    dx = torch.randint(0, 3, (b,), generator=gen)
    rows = (dy[:, None] + torch.arange(h))[:, :, None]
    cols = (dx[:, None] + torch.arange(w))[:, None, :]
    shifted = padded[torch.arange(b)[:, None, None], 0, rows, cols].unsqueeze(1)
    contrast = 0.8 + 0.4 * torch.rand(b, 1, 1, 1, generator=gen)
    noise = 0.05 * torch.randn(x.shape, generator=gen)
    return (shifted * contrast + noise).clamp(0.0, 1.0)


@torch.no_grad()
def accuracy(model: DigitClassifier, images: Tensor, labels: Tensor) -> float:
    model.eval()
    return (model(images).argmax(dim=-1) == labels).float().mean().item()


def fit(images: Tensor, labels: Tensor, epochs: int, batch_size: int, lr: float, seed: int) -> DigitClassifier:
    """Train a fresh classifier with AdamW and a cosine learning-rate decay."""
    torch.manual_seed(seed)  # initial weights and dropout
    gen = torch.Generator().manual_seed(seed)
    model = DigitClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps_per_epoch = -(-images.shape[0] // batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * steps_per_epoch)
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(images.shape[0], generator=gen).split(batch_size):
            loss = F.cross_entropy(model(augment(images[idx], gen)), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    return model


def save(model: DigitClassifier, out: Path, info: dict) -> None:
    """Write weights and info into a temporary sibling, then swap it in: a crash never leaves half a model."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    with atomic_directory(out) as tmp:
        save_file(state, str(tmp / WEIGHTS_FILE))
        (tmp / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")


def train(out: Path, seed: int, epochs: int, batch_size: int, lr: float) -> dict:
    """Train, evaluate on the held-out 20%, save, and return the training info."""
    start = time.time()
    images, labels = unit_images()
    train_idx, held_idx = split_indices(images.shape[0], seed)
    model = fit(images[train_idx], labels[train_idx], epochs, batch_size, lr, seed)
    held_acc = accuracy(model, images[held_idx], labels[held_idx])
    info = {
        "command": f"python -m flowrl.reward_models.train_digit_classifier --seed {seed} --epochs {epochs}",
        "seed": seed,
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
        "train_size": len(train_idx),
        "held_out_size": len(held_idx),
        "held_out_accuracy": round(held_acc, 4),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(time.time() - start, 1),
    }
    save(model, out, info)
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_DIR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    info = train(a.out, a.seed, a.epochs, a.batch_size, a.lr)
    print(f"held-out accuracy {info['held_out_accuracy']:.4f} ({info['held_out_size']} images); wrote {a.out}")
    print(json.dumps(info))


if __name__ == "__main__":
    main()
