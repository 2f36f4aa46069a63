"""Inference-time scaling on the embedded model, measured in one run: Best-of-N, zero-order noise search and
SVDD-PM at the same number of candidates, with the denoiser work each spends counted (sample-forwards)
rather than assumed.

For each budget M the held-out evaluation (configs/digits/grpo.yaml's) is sampled four ways: plain (one
ODE sample per item), best-of-M (ODE, M candidates per item), zero-order search (ODE, M samples per
item: the start noise plus (M - 1) / 3 rounds of 3 neighbours at step 0.5) and SVDD-PM with M candidates
per step (the preset's SDE). It prints reward, gain over the plain evaluation, denoiser sample-forwards relative
to the plain evaluation, and wall time. The last line is ``svdd_gain_over_best_of_n=<ratio>`` at the
largest budget: how many times more reward SVDD gains than best-of-N for the same candidate count.

    python bench/inference_scaling.py [--budgets 4 16] [key=value overrides]
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
from flowrl.inference.noise_search import zero_order_search  # noqa: E402
from flowrl.inference.search import ImageSearchModel, Items  # noqa: E402
from flowrl.inference.svdd import svdd_in_batches  # noqa: E402
from flowrl.trainer import Trainer  # noqa: E402


class ForwardCounter:
    """Counts the rows the denoiser is run on (one row = one sample through the model once)."""

    def __init__(self, pipeline):
        self.rows, self._predict = 0, pipeline.predict
        pipeline.predict = self

    def __call__(self, x, *args, **kwargs):
        self.rows += x.shape[0]
        return self._predict(x, *args, **kwargs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 16])
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(
            load_config(REPO / "configs" / "digits" / "grpo.yaml", [f"output_dir={tmp}", "log.progress=false", *args.overrides])
        )
        counter = ForwardCounter(trainer.pipeline)
        pipe, held, reward, batch = trainer.pipeline, trainer.modality.held_out, trainer.reward, trainer.config.rollout.batch_size
        ode = ImageSearchModel(pipe, trainer.modality.eval_sampler, held.sigmas, held.guidance_scale, batch)
        sde = ImageSearchModel(pipe, trainer.sampler, held.sigmas, held.guidance_scale, batch)
        items = Items(held.prompts, held.metadata)

        def best(m):  # every search draws from the plain evaluation's streams: its start noise first
            return best_of_n(ode, reward, items, m, held.generator())

        def zero_order(m):
            return zero_order_search(ode, reward, items, max(1, (m - 1) // 3), 3, 0.5, held.generator())

        def svdd(m):
            return svdd_in_batches(sde, reward, items, m, held.generator())

        def measure(fn):
            counter.rows, start = 0, time.perf_counter()
            value = fn()
            return value, counter.rows, time.perf_counter() - start

        plain, plain_rows, plain_s = measure(lambda: trainer.evaluate()["eval/reward/mean"])
        print(
            f"plain evaluation: reward {plain:.4f}, {plain_rows} sample-forwards, {plain_s:.1f} s "
            f"({len(held)} items, sampler ode, {trainer.config.rollout.num_inference_steps} steps)"
        )
        print(f"{'method':<14}{'M':>4}{'reward':>9}{'gain':>9}{'forwards x':>12}{'wall s':>8}")
        gains = {}
        for m in args.budgets:
            for name, fn in (
                ("best-of-N", lambda m=m: best(m).scaling_curve()[m]),
                ("zero-order", lambda m=m: float(zero_order(m).scores.mean())),
                ("svdd-pm", lambda m=m: float(svdd(m).scores.mean())),
            ):
                value, rows, seconds = measure(fn)  # not ``reward``: the searches above close over the reward
                gains[name, m] = value - plain
                print(f"{name:<14}{m:>4}{value:>9.4f}{value - plain:>+9.4f}{rows / plain_rows:>12.2f}{seconds:>8.1f}")
        top = max(args.budgets)
        print(f"svdd_gain_over_best_of_n={gains['svdd-pm', top] / gains['best-of-N', top]:.2f}")


if __name__ == "__main__":
    main()
