"""The reward-vs-N picture of the image inference-time scaling table (docs/inference_scaling.md), measured:
best-of-N (ODE, N = 1 .. 64) and SVDD-PM (the preset's SDE, M candidates per step) on the base embedded
digits model, and best-of-N on a GRPO-trained checkpoint if one is given.

    python bench/image_scaling_curve.py --out docs/images/inference_scaling_digits.png \\
        [--checkpoint runs/digits_grpo/checkpoints/step_000030] [--n 64] [--svdd 1 4 16] [--n-trained 16]

Prints the numbers it plots.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.config import load_config  # noqa: E402
from flowrl.inference.best_of_n import best_of_n  # noqa: E402
from flowrl.inference.plots import save_scaling_plot  # noqa: E402
from flowrl.inference.search import ImageSearchModel, Items  # noqa: E402
from flowrl.inference.svdd import svdd_in_batches  # noqa: E402
from flowrl.trainer import Trainer  # noqa: E402
from flowrl.training.checkpoint import read_weights  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--checkpoint", default=None, help="a GRPO run checkpoint of configs/digits/grpo.yaml")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--n-trained", type=int, default=16)
    p.add_argument("--trained-label", default="after GRPO (30 it), best-of-N (ODE)")
    p.add_argument("--svdd", type=int, nargs="*", default=[1, 4, 16])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lines = {}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(load_config(REPO / "configs" / "digits" / "grpo.yaml", [f"output_dir={tmp}", "log.progress=false"]))
        pipe, held, reward, batch = trainer.pipeline, trainer.modality.held_out, trainer.reward, trainer.config.rollout.batch_size
        ode = ImageSearchModel(pipe, trainer.modality.eval_sampler, held.sigmas, held.guidance_scale, batch)
        sde = ImageSearchModel(pipe, trainer.sampler, held.sigmas, held.guidance_scale, batch)
        items = Items(held.prompts, held.metadata)

        def best(n):
            start = time.perf_counter()
            curve = best_of_n(ode, reward, items, n, held.generator()).scaling_curve()
            print(
                f"  best-of-{n}: {time.perf_counter() - start:.0f} s; " + ", ".join(f"N={k}: {v:.4f}" for k, v in curve.items()), flush=True
            )
            return curve

        print(f"{len(held)} held-out items (configs/digits/grpo.yaml evaluation)")
        lines["base digits_flow, best-of-N (ODE)"] = best(args.n)
        svdd = {}
        for m in args.svdd:
            result = svdd_in_batches(sde, reward, items, m, held.generator())  # from the plain evaluation's start noise
            svdd[m] = float(result.scores[torch.isfinite(result.scores)].mean())
            print(f"  svdd M={m}: {svdd[m]:.4f}", flush=True)
        lines["base digits_flow, SVDD-PM (SDE, M = N per step)"] = svdd
        if args.checkpoint:
            trainer.load_weights(read_weights(Path(args.checkpoint)))
            lines[args.trained_label] = best(args.n_trained)
    save_scaling_plot({"digits: held-out reward (ink + classifier)": lines}, Path(args.out), "held-out reward, mean over 80 items")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
