"""Where an Adjoint Matching toy checkpoint's velocity differs from the tilted flow's, and what that costs the ODE.

The fine-tuned model should be the rectified flow of the tilted target p_base exp(lambda r), whose velocity the 2-D
toy knows in closed form (``GaussianMixture.velocity`` of ``tilted_target``). This prints, for a trained checkpoint:

1. the velocity error (RMS over points, and its mean vector) at a ladder of noise levels, on points of the *tilted*
   target noised to that level (where an exact model's ODE paths run);
2. the closed-form comparison (``flowrl.evaluation.toy2d``) of 200-step ODE samples whose velocity is the exact
   tilted one above a level s0 and the checkpoint's below it, for several s0: the level above which pasting in the
   exact velocity makes the ODE pass says where the checkpoint's error matters.

    python bench/adjoint_matching_velocity_error.py runs/toy_am_quadratic/checkpoints/step_001200 --reward quadratic
"""

from __future__ import annotations

import argparse
import json

import torch
from safetensors.torch import load_file

from flowrl.evaluation.toy2d import compare_to_target
from flowrl.pipelines.toy2d import TWO_MODES, Toy2DPipeline, tilted_target
from flowrl.reward_models.toy2d import LinearReward2D, QuadraticReward2D

REWARDS = {"quadratic": (QuadraticReward2D, 2.0), "linear": (LinearReward2D, 1.0)}  # the two toy presets' lambda


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--reward", choices=sorted(REWARDS), default="quadratic")
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)
    pipe = Toy2DPipeline()
    pipe.load_trainable_state_dict(load_file(f"{args.checkpoint}/denoiser.safetensors"))
    reward, lam = REWARDS[args.reward]
    target = tilted_target(TWO_MODES, reward(), lam)
    gen = torch.Generator().manual_seed(0)
    x0, eps = target.sample(args.samples, gen), torch.randn(args.samples, 2, generator=gen)
    with torch.no_grad():
        for s in (0.999, 0.99, 0.95, 0.9, 0.8, 0.7, 0.6, 0.4, 0.2, 0.05):
            xs = ((1 - s) * x0 + s * eps).float()
            err = pipe.predict(xs, torch.tensor(s), None) - target.velocity(xs, s).float()
            print(json.dumps({"sigma": s, "velocity_rms_error": round(err.pow(2).sum(1).mean().sqrt().item(), 4),
                              "mean_error": [round(e, 4) for e in err.mean(0).tolist()]}))  # fmt: skip
        sigmas = torch.linspace(1, 0, args.steps + 1)
        for s0 in (1.0, 0.9, 0.8, 0.7, 0.6, 0.0):
            x = torch.randn(args.samples, 2, generator=torch.Generator().manual_seed(1))
            for a, b in zip(sigmas[:-1], sigmas[1:]):
                v = target.velocity(x, a) if a > s0 or s0 == 0.0 else pipe.predict(x, a, None)
                x = x + (b - a) * v.float()
            c = compare_to_target(x, target).as_dict()
            label = "exact everywhere" if s0 == 0.0 else ("checkpoint everywhere" if s0 == 1.0 else f"exact above {s0}")
            print(json.dumps({"ode_velocity": label, **{k: c[k] for k in ("weight_error", "mean_error", "std_relative_error", "passed")}}))


if __name__ == "__main__":
    main()
