"""GRPO-Guard's ratio normalisation: flowrl's exact per-sample shift against Flow-Factory's form, the approximation it
replaced (#41 item 1), and what the exact form costs.

The normalised log-ratio of a Gaussian transition with std s is (log r + b) s, with b = mean(dmu^2) / (2 s^2) the
sample's own shift, dmu = mu_theta - mu_old (mu_old: the mean the rollout sampled from). Until #41 flowrl kept no
rollout means and used the minibatch mean of log r (detached) for every sample's b; now the rollout records its step
means (``Trajectory.step_means``) and b is computed exactly. ``guard_case`` builds a drifted policy's step:
rollout means mu_old ~ N(0, 1), x_next = mu_old + s eps, current means mu_old + dmu with dmu = drift u_b z (z ~ N(0, 1)
per dimension, u_b in [0.5, 1.5): each sample moved by its own amount), 32 samples, s = 0.3, random advantages,
clip range 2e-4 (the frontier's GRPO-Guard, docs/objectives/flow_dppo.md). For each form it reports how many of the 32
clip decisions equal the reference's (Flow-Factory's ``GRPOGuardTrainer`` formula, transcribed in float64) and the
gradient's (w.r.t. dmu) max difference relative to the reference gradient's largest entry; then the time of one
step's normalised ratio, clipped loss and backward for each form, and the bytes the step means add to a rollout.

    python bench/grpo_guard_shift.py [--repeats 20] [--json OUT]

Prints a table; the last line is one JSON object. tests/test_grpo_guard.py uses ``guard_case``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.objectives.functional import clipped_surrogate  # noqa: E402
from flowrl.objectives.policy_gradient import normalised_log_ratio  # noqa: E402
from flowrl.samplers.log_prob import gaussian_log_prob  # noqa: E402

SHAPES = {256: (1, 16, 16), 65536: (16, 64, 64)}  # the 256-dim case; SD3's latent of a 512 px image
FORMS = ("exact", "approximation")


def flow_factory_loss(x_next, mean, old_mean, s, advantages, clip_range):
    """Flow-Factory's GRPOGuardTrainer (src/flow_factory/trainers/grpo.py), in the dtype of its inputs: log-probs are
    per-dimension means, ratio = exp((log_prob - old_log_prob) * s + mse / (2 s)), mse = mean((mu_theta - mu_old)^2)
    per sample, and PPO's clipped loss. Returns the loss and the ratio."""

    def log_prob(mu):
        return (-((x_next - mu) ** 2) / (2 * s**2) - math.log(s) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)

    mse = (mean - old_mean).flatten(1).pow(2).mean(1)
    ratio = torch.exp((log_prob(mean) - log_prob(old_mean)) * s + mse / (2 * s))
    loss = torch.mean(torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)))
    return loss, ratio


def normalised(form: str, mean, old_mean, x_next, s: float):
    """flowrl's normalised log-ratio of one step in float32: ``exact`` (the shift from the stored rollout mean) or the
    ``approximation`` flowrl used before #41, (log r - the minibatch mean of log r, detached) * s."""
    std = torch.tensor(s)
    log_p, old_log_p = gaussian_log_prob(x_next, mean, std), gaussian_log_prob(x_next, old_mean, std)
    if form == "exact":
        return normalised_log_ratio(log_p, old_log_p, mean, old_mean, std, "mean")
    log_ratio = log_p - old_log_p
    return (log_ratio - log_ratio.detach().mean()) * s


def drifted_step(state_shape, drift: float, batch: int = 32, s: float = 0.3, seed: int = 0) -> dict[str, torch.Tensor]:
    """The rollout means, next states, drifts dmu and advantages of one step (float32)."""
    g = torch.Generator().manual_seed(seed)
    old_mean = torch.randn(batch, *state_shape, generator=g)
    x_next = old_mean + s * torch.randn(batch, *state_shape, generator=g)
    u = 0.5 + torch.rand(batch, *[1] * len(state_shape), generator=g)
    dmu = drift * u * torch.randn(batch, *state_shape, generator=g)
    return {"old_mean": old_mean, "x_next": x_next, "dmu": dmu, "advantages": torch.randn(batch, generator=g)}


def guard_case(state_shape, drift: float, batch: int = 32, s: float = 0.3, clip_range: float = 2e-4, seed: int = 0):
    """{form: (clip decisions (B,) bool, gradient w.r.t. dmu)} for flowrl's forms and the float64 ``reference``."""
    step, results = drifted_step(state_shape, drift, batch, s, seed), {}
    for form in FORMS:
        theta = step["dmu"].clone().requires_grad_(True)
        value = normalised(form, step["old_mean"] + theta, step["old_mean"], step["x_next"], s)
        loss, _ = clipped_surrogate(value, torch.zeros(batch), step["advantages"], clip_range)
        (grad,) = torch.autograd.grad(loss, theta)
        results[form] = ((value.detach().exp() - 1).abs() > clip_range, grad)
    theta = step["dmu"].double().requires_grad_(True)
    old_mean = step["old_mean"].double()
    loss, ratio = flow_factory_loss(step["x_next"].double(), old_mean + theta, old_mean, s, step["advantages"].double(), clip_range)
    (grad,) = torch.autograd.grad(loss, theta)
    results["reference"] = ((ratio.detach() - 1).abs() > clip_range, grad)
    return results


def agreement(results, form: str) -> tuple[int, float]:
    """How many clip decisions equal the reference's, and the gradient's max difference relative to the reference
    gradient's largest entry."""
    (clipped, grad), (ref_clipped, ref_grad) = results[form], results["reference"]
    return int((clipped == ref_clipped).sum()), float((grad.double() - ref_grad).abs().max() / ref_grad.abs().max())


def step_seconds(form: str, state_shape, repeats: int) -> float:
    """Median seconds of one step's normalised ratio, clipped loss and backward (the denoiser excluded)."""
    step, times = drifted_step(state_shape, 0.1), []
    for _ in range(repeats):
        theta = step["dmu"].clone().requires_grad_(True)
        t0 = time.perf_counter()
        value = normalised(form, step["old_mean"] + theta, step["old_mean"], step["x_next"], 0.3)
        clipped_surrogate(value, torch.zeros(len(value)), step["advantages"], 2e-4)[0].backward()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"{'dims':>6}{'drift':>7}{'form':>15}{'clip same /32':>15}{'grad rel diff':>15}")
    for dims, shape in SHAPES.items():
        for drift in (0.03, 0.1):
            results = guard_case(shape, drift)
            for form in FORMS:
                same, rel = agreement(results, form)
                rows.append({"dims": dims, "drift": drift, "form": form, "clip_same": same, "grad_rel_diff": rel})
                print(f"{dims:>6}{drift:>7}{form:>15}{same:>15}{rel:>15.2e}")
    cost = {}
    for dims, shape in SHAPES.items():
        ms = {form: 1e3 * step_seconds(form, shape, a.repeats) for form in FORMS}
        cost[dims] = {**{f"{form}_ms": round(v, 3) for form, v in ms.items()}, "step_means_bytes_per_sample_step": 4 * dims}
        print(
            f"{dims:>6} dims, 32 samples, 1 thread: exact {ms['exact']:.2f} ms, approximation {ms['approximation']:.2f} ms per step; ",
            end="",
        )
        print(f"step means {4 * dims / 1024:.0f} KiB per sample and stochastic step")
    out = {"rows": rows, "cost": cost}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
