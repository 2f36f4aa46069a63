"""Check samples of the 2-D toy against the closed-form tilted target p_base(x) exp(lambda r(x)).

    flowrl sample runs/toy_am_linear/checkpoints/step_000600 -n 20000 --sampler rollout --steps 200 --out samples.npy
    python -m flowrl.evaluation.toy2d runs/toy_am_linear/checkpoints/step_000600 samples.npy

The checkpoint (or config file) names the reward and lambda, from which :func:`flowrl.pipelines.toy2d.tilted_target`
gives the target mixture. Samples are assigned to the target's components (:func:`mode_statistics`) and every
component's weight, mean and per-coordinate standard deviation is compared with the target's, against the
tolerances of the Adjoint Matching issue: weight within 0.03, mean within 0.05 per coordinate, std within 6%.
Prints one table and one JSON line; exits 1 when a tolerance is missed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import FlowRLError
from ..pipelines.toy2d import TWO_MODES, GaussianMixture, mode_statistics, tilted_target

WEIGHT_TOLERANCE, MEAN_TOLERANCE, STD_RELATIVE_TOLERANCE = 0.03, 0.05, 0.06


@dataclass
class ToyComparison:
    """Largest deviations from the target over components (and coordinates) and whether each is in tolerance."""

    weight_error: float
    mean_error: float
    std_relative_error: float
    stats: dict

    @property
    def passed(self) -> bool:
        return (
            self.weight_error <= WEIGHT_TOLERANCE
            and self.mean_error <= MEAN_TOLERANCE
            and self.std_relative_error <= STD_RELATIVE_TOLERANCE
        )

    def as_dict(self) -> dict:
        return {
            "weight_error": round(self.weight_error, 4),
            "mean_error": round(self.mean_error, 4),
            "std_relative_error": round(self.std_relative_error, 4),
            "passed": self.passed,
            **self.stats,
        }


def compare_to_target(samples: torch.Tensor, target: GaussianMixture) -> ToyComparison:
    """Per-component weight, mean and std of ``samples`` (N, 2) against ``target``."""
    if samples.ndim != 2 or samples.shape[1] != target.dim:
        raise FlowRLError(f"expected ({'N'}, {target.dim}) points, got an array of shape {tuple(samples.shape)}.")
    if not torch.isfinite(samples).all():
        raise FlowRLError("the samples contain NaN or infinite values.")
    st = mode_statistics(samples, target)
    w = torch.tensor(target.weights, dtype=torch.float64)
    m = torch.tensor(target.means, dtype=torch.float64)
    s = torch.tensor(target.stds, dtype=torch.float64)[:, None]
    stats = {
        "n": int(samples.shape[0]),
        "weights": [round(float(v), 4) for v in st.weights],
        "target_weights": [round(float(v), 4) for v in w],
        "means": [[round(float(v), 4) for v in r] for r in st.means],
        "target_means": [[round(float(v), 4) for v in r] for r in m],
        "stds": [[round(float(v), 4) for v in r] for r in st.stds],
        "target_stds": [round(float(v), 4) for v in s[:, 0]],
    }
    return ToyComparison(
        weight_error=float((st.weights - w).abs().max()),
        mean_error=float((st.means - m).abs().max()),
        std_relative_error=float((st.stds / s - 1).abs().max()),
        stats=stats,
    )


def target_of(source: str | Path) -> tuple[GaussianMixture, float]:
    """The tilted target a run's config (a checkpoint directory or a YAML file) trains towards, and its lambda:
    Adjoint Matching's reward_multiplier, or 1 / beta for a KL-regularised policy gradient."""
    from ..config import load_config
    from ..reward_models import build_reward

    path = Path(source)
    config = load_config(path / "config.yaml" if path.is_dir() else path)
    objective = config.objective
    if objective.name == "adjoint_matching":
        lam = objective.reward_multiplier
    elif getattr(objective, "beta", 0.0) > 0 and objective.name in ("grpo", "ddpo"):
        lam = 1.0 / objective.beta  # E[r] - beta KL(p || p_base) is maximised by p_base exp(r / beta)
    else:
        lam = None
    if config.pipeline.name != "toy2d" or lam is None or len(config.reward.components) != 1:
        raise FlowRLError(
            f"'{source}' is not a run of the 2-D toy with a tilted target (pipeline toy2d, one toy reward component, "
            "objective adjoint_matching, or grpo / ddpo with a KL weight beta > 0)."
        )
    ((name, weight),) = config.reward.components.items()
    lam = lam * weight  # the loop optimises weight * r
    return tilted_target(TWO_MODES, build_reward(name, **config.reward.kwargs.get(name, {})), lam), lam


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowrl.evaluation.toy2d", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="the run's checkpoint directory or its YAML config")
    parser.add_argument("samples", help=".npy file of (N, 2) samples, e.g. from flowrl sample --out FILE.npy")
    args = parser.parse_args(argv)
    try:
        target, lam = target_of(args.source)
        if not Path(args.samples).is_file():
            raise FlowRLError(f"samples file '{args.samples}' does not exist.")
        try:
            samples = torch.from_numpy(np.load(args.samples, allow_pickle=False)).double()
        except ValueError as e:
            raise FlowRLError(f"could not read '{args.samples}' as a .npy array: {e}.") from None
        result = compare_to_target(samples, target)
    except FlowRLError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    st = result.stats
    print(f"lambda {lam}: {st['n']} samples against the closed-form tilted target")
    for j in range(len(target.weights)):
        print(
            f"  mode {j}: weight {st['weights'][j]:.4f} (target {st['target_weights'][j]:.4f})  mean {st['means'][j]} "
            f"(target {st['target_means'][j]})  std {st['stds'][j]} (target {st['target_stds'][j]})"
        )
    print(
        f"  largest errors: weight {result.weight_error:.4f} (<= {WEIGHT_TOLERANCE}), mean {result.mean_error:.4f} (<= {MEAN_TOLERANCE}), "
        f"std {100 * result.std_relative_error:.1f}% (<= {100 * STD_RELATIVE_TOLERANCE:.0f}%): {'PASS' if result.passed else 'FAIL'}"
    )
    print(json.dumps(result.as_dict()))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
