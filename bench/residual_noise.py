"""Residual noise in final samples: the Flow-GRPO SDE against coefficient-preserving sampling (CPS) at equal steps.

Both samplers start from the held-out evaluation's start noise (configs/digits/grpo.yaml: 20 held-out prompt
phrasings x 4 seeds) and run the same number of steps (the preset's 10) at the same noise level (0.7); each is
repeated with ``--repeats`` independent SDE noise streams. Two measures, both in pixel units (images in [0, 1],
before the decoder's clamp):

- ``last_step_residual``: RMS over pixels and samples of x_final - x0_hat, x0_hat = x - sigma v the model's own
  clean prediction at the last step. It is the noise the sampler leaves on top of what the model would output.
  The ODE's last Euler step lands on x0_hat exactly (0); CPS's last step has std sigma_next sin(a pi / 2) = 0.
- ``hf_ratio``: high-frequency energy of the final image (mean squared 4-neighbour Laplacian, replicate-padded)
  divided by that of the ODE sample from the same start noise. 1 = as smooth as the deterministic sample.

Also printed: the held-out reward (ink + classifier) and the judge (digit_realism) of the final samples. The
last line is one JSON object with every number.

    OMP_NUM_THREADS=1 python bench/residual_noise.py [--repeats 4] [--checkpoint DIR] [key=value overrides]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.config import load_config  # noqa: E402
from flowrl.samplers import FlowCPSConfig, FlowSDEConfig  # noqa: E402
from flowrl.samplers.rollout import rollout, start_noise  # noqa: E402
from flowrl.trainer import Trainer  # noqa: E402
from flowrl.training.checkpoint import read_weights  # noqa: E402


def hf_energy(pixels: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B,): mean squared 4-neighbour Laplacian."""
    x = F.pad(pixels, (1, 1, 1, 1), mode="replicate")
    lap = x[..., 1:-1, :-2] + x[..., 1:-1, 2:] + x[..., :-2, 1:-1] + x[..., 2:, 1:-1] - 4 * x[..., 1:-1, 1:-1]
    return lap.pow(2).flatten(1).mean(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--noise-level", type=float, default=0.7)
    p.add_argument("--checkpoint", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(REPO / "configs" / "digits" / "grpo.yaml", [f"output_dir={tmp}", "log.progress=false", *args.overrides])
        trainer = Trainer(config)
        if args.checkpoint:
            trainer.load_weights(read_weights(Path(args.checkpoint)))
        pipe, held, reward = trainer.pipeline, trainer.modality.held_out, trainer.reward
        judge = trainer.judge
        pipe.denoiser.eval()
        ids = torch.arange(len(held))
        noise = start_noise(pipe, len(held), held.generator())
        steps = held.sigmas.numel() - 1

        def run(sampler, seed):
            traj = rollout(
                pipe,
                sampler,
                held.prompts,
                held.metadata,
                ids,
                held.sigmas,
                torch.Generator().manual_seed(seed),
                held.guidance_scale,
                initial_noise=noise,
            )
            x_last, sigma = traj.latents[:, -2], held.sigmas[-2]
            with torch.no_grad():
                x0_hat = x_last - sigma * pipe.predict(x_last, sigma, traj.cond, held.guidance_scale).float()
            final = traj.latents[:, -1]
            return (final + 1) / 2, (final - x0_hat) / 2, traj

        ode_pixels, _, ode_traj = run(FlowSDEConfig(noise_level=0.0).build(), 0)
        ode_hf = hf_energy(ode_pixels)
        rows = {}
        samplers = {
            "ode": FlowSDEConfig(noise_level=0.0).build(),
            f"flow_sde (a={args.noise_level})": FlowSDEConfig(noise_level=args.noise_level).build(),
            f"flow_cps (a={args.noise_level})": FlowCPSConfig(noise_level=args.noise_level).build(),
        }
        for name, sampler in samplers.items():
            res, ratio, rew, jud = [], [], [], []
            for r in range(args.repeats if name != "ode" else 1):
                pixels, residual, traj = run(sampler, 1000 + r)
                res.append(residual.pow(2).flatten(1).mean(1))
                ratio.append(hf_energy(pixels) / ode_hf)
                rew.append(reward(traj.samples, traj.prompts, traj.metadata).scores)
                if judge is not None:
                    jud.append(judge(traj.samples, traj.prompts, traj.metadata).scores)
            rows[name] = {
                "last_step_residual": float(torch.cat(res).mean().sqrt()),
                "hf_ratio": float(torch.cat(ratio).mean()),
                "hf_ratio_median": float(torch.cat(ratio).median()),
                "reward": float(torch.cat(rew).mean()),
                "judge": float(torch.cat(jud).mean()) if jud else None,
                "samples": int(torch.cat(res).numel()),
            }
    print(f"{len(held)} held-out start noises, {steps} steps, checkpoint: {args.checkpoint or 'base model'}")
    print(f"{'sampler':<20}{'last-step residual':>20}{'HF / ODE (mean)':>17}{'(median)':>10}{'reward':>9}{'judge':>8}{'n':>6}")
    for name, r in rows.items():
        print(
            f"{name:<20}{r['last_step_residual']:>20.4f}{r['hf_ratio']:>17.3f}{r['hf_ratio_median']:>10.3f}{r['reward']:>9.4f}"
            f"{(r['judge'] if r['judge'] is not None else float('nan')):>8.4f}{r['samples']:>6}"
        )
    print(json.dumps({"steps": steps, "checkpoint": args.checkpoint, "repeats": args.repeats, "rows": rows}))


if __name__ == "__main__":
    main()
