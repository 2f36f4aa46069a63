"""SMC on the exact 2-D toy: do the weighted particles approach the closed-form tilted target as N grows?

The toy's base is the exact rectified flow of 0.5 N((-2, 0), 0.5^2 I) + 0.5 N((2, 0), 0.5^2 I) (no training); the two
toy presets' rewards and lambdas define the targets p_base(x) exp(lambda r(x)) in closed form
(``flowrl.pipelines.toy2d.tilted_target``): linear r = 0.5 x1 + 0.5 x2 with lambda = 1 (mode weights 0.12 / 0.88,
means shifted by 0.125) and quadratic r = -0.5 |x - (0, 1)|^2 with lambda = 2 (weights 0.5 / 0.5, means pulled in to
+-4/3, std 0.408). For each N the same total number of particles is spent (``--budget``: items x N), the particles
move with the flow SDE (Flow-GRPO's, noise level 0.7) for ``--steps`` steps, and every item's weighted particles are
pooled (each item's weights sum to 1 / items). The weighted set's per-mode weight, mean and std are compared with the
target's exactly as ``python -m flowrl.evaluation.toy2d`` compares samples (same assignment, same error measures,
same tolerances: weight 0.03, mean 0.05, std 6%). The row lambda = 0 is the base sampler against the base: the floor
the discretisation leaves.

Prints a markdown table per task and writes them to ``--out``.

    python bench/smc_toy.py [--ns 4 16 64 256] [--budget 131072] [--steps 100] [--tempering linear] [--out runs/smc_toy.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.evaluation.toy2d import MEAN_TOLERANCE, STD_RELATIVE_TOLERANCE, WEIGHT_TOLERANCE  # noqa: E402
from flowrl.inference.search import ImageSearchModel, Items  # noqa: E402
from flowrl.inference.sections import SMCConfig  # noqa: E402
from flowrl.inference.smc import smc_sample, weighted_set, weighted_toy_comparison  # noqa: E402
from flowrl.pipelines.toy2d import TWO_MODES, Toy2DPipeline, tilted_target  # noqa: E402
from flowrl.reward_models import build_reward  # noqa: E402
from flowrl.samplers.flow_sde import FlowSDEConfig  # noqa: E402

TASKS = [("linear2d", 1.0), ("quadratic2d", 2.0)]  # the toy presets' reward and lambda


def _pair(values) -> str:
    return " / ".join(f"{v:.3f}" for v in values)


def _vec(rows) -> str:
    return " / ".join("(" + ", ".join(f"{v:.3f}" for v in r) + ")" for r in rows)


def run(reward_name: str, lam: float, n: int, budget: int, steps: int, tempering: str, seed: int) -> dict:
    pipe, reward = Toy2DPipeline(), build_reward(reward_name)
    items = max(1, budget // n)
    start = time.perf_counter()
    model = ImageSearchModel(pipe, FlowSDEConfig().build(), pipe.schedule.sigmas(steps))
    smc = SMCConfig(n=n, lam=lam, tempering=tempering)
    result = smc_sample(model, reward, Items([""] * items, [{}] * items), smc, torch.Generator().manual_seed(seed))
    seconds = time.perf_counter() - start
    points, weights = weighted_set(result)
    c = weighted_toy_comparison(points, weights, tilted_target(TWO_MODES, reward, lam))
    return {
        "n": n,
        "items": items,
        "comparison": c,
        "resamples": float(result.resample_count.double().mean()),
        "final_ess": float(result.ess[-1].mean()) / n,
        "seconds": seconds,
    }


def table(reward_name: str, lam: float, rows: list[dict]) -> str:
    target = tilted_target(TWO_MODES, build_reward(reward_name), lam)
    lines = [
        f"**{reward_name}, lambda = {lam:g}**: target weights {_pair(target.weights)}, means {_vec(target.means)}, std {_pair(target.stds)}",
        "",
        "| N | items | mode weights | mode means | mode stds (x1, x2 per mode) | weight err | mean err | std err | pass | resamplings / item | final ESS / N |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c, st = r["comparison"], r["comparison"].stats
        label = f"{r['n']}" if r.get("lam", lam) == lam else f"{r['n']} (lambda = 0, base vs base)"
        lines.append(
            f"| {label} | {r['items']} | {_pair(st['weights'])} | {_vec(st['means'])} | {_vec(st['stds'])} | {c.weight_error:.4f} | "
            f"{c.mean_error:.4f} | {100 * c.std_relative_error:.1f}% | {'yes' if c.passed else 'no'} | {r['resamples']:.2f} | {r['final_ess']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ns", type=int, nargs="+", default=[4, 16, 64, 256])
    p.add_argument("--budget", type=int, default=131072, help="particles per run (items x N), the same for every N")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--tempering", default="linear", choices=["linear", "final"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/smc_toy.md"))
    args = p.parse_args()
    torch.set_num_threads(1)
    parts = [
        f"SMC on the 2-D toy: {args.budget} particles per row (items x N), flow SDE (noise level 0.7), {args.steps} steps, "
        f"{args.tempering} tempering, systematic resampling at ESS < N / 2, seed {args.seed}. Tolerances: weight "
        f"{WEIGHT_TOLERANCE}, mean {MEAN_TOLERANCE}, std {100 * STD_RELATIVE_TOLERANCE:.0f}%.",
    ]
    total = time.perf_counter()
    for reward_name, lam in TASKS:
        rows = [{**run(reward_name, 0.0, args.ns[0], args.budget, args.steps, args.tempering, args.seed), "lam": 0.0}]
        for n in args.ns:
            rows.append(run(reward_name, lam, n, args.budget, args.steps, args.tempering, args.seed))
            print(f"  {reward_name} N = {n}: {rows[-1]['comparison'].as_dict()} ({rows[-1]['seconds']:.1f} s)", flush=True)
        parts.append(table(reward_name, lam, rows))
    text = "\n\n".join(parts) + "\n"
    print(text)
    print(f"({time.perf_counter() - total:.0f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
