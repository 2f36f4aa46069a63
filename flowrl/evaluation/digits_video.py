"""Sample quality of the embedded text-to-video model (``digits_video``), or of a run checkpoint of it:

    python -m flowrl.evaluation.digits_video digits_video [--checkpoint runs/x/checkpoints/step_000030]

prints the fraction of held-out clips moving in the prompted direction, the digit classifier's accuracy
on the first and last frames, and the mean ``motion_quality`` reward (docs/digits_video.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..data.digits_video import digit_crops, direction_accuracy, prompt_set
from ..pipelines.diffusers_base import PipelineConfig
from ..pipelines.digits_video import DigitsVideoPipeline
from ..reward_models import build_reward
from ..samplers import ODEConfig, build_sampler
from ..samplers.rollout import rollout


@torch.no_grad()
def measure(
    model: str, checkpoint: Path | None = None, seeds: int = 4, steps: int = 10, guidance_scale: float = 1.0, seed: int = 1234
) -> dict:
    """Sample quality of a model directory (optionally with a run checkpoint's weights) on the held-out
    prompts: ``seeds`` ODE samples per prompt. Returns the fraction of clips moving in the prompted
    direction (centre of mass, first to last frame), the digit classifier's accuracy on the digit cut
    out of the first and of the last frame, and the mean ``motion_quality`` reward."""
    pipeline = DigitsVideoPipeline(PipelineConfig(name="digits_video", pretrained=model), "cpu")
    if checkpoint is not None:
        from ..training.checkpoint import read_weights

        pipeline.denoiser.load_state_dict({k: v for k, v in read_weights(checkpoint).items() if not k.startswith("objective.")})
    pipeline.denoiser.eval()
    items = [item for item in prompt_set("eval") for _ in range(seeds)]
    prompts, metadata = [p for p, _ in items], [m for _, m in items]
    gen = torch.Generator().manual_seed(seed)
    traj = rollout(
        pipeline,
        build_sampler(ODEConfig(), pipeline),
        prompts,
        metadata,
        torch.arange(len(items)),
        pipeline.schedule.sigmas(steps),
        gen,
        guidance_scale,
        same_noise_in_group=False,
    )
    videos = traj.samples
    classifier, motion = build_reward("digit_classifier"), build_reward("motion_quality")
    digit_first = classifier(digit_crops(videos, 0), prompts, metadata).extras["accuracy"]
    digit_last = classifier(digit_crops(videos, -1), prompts, metadata).extras["accuracy"]
    return {
        "samples": len(items),
        "direction_accuracy": round(direction_accuracy(videos, [m["direction"] for m in metadata]), 4),
        "digit_accuracy_first_frame": round(float(digit_first.mean()), 4),
        "digit_accuracy_last_frame": round(float(digit_last.mean()), 4),
        "motion_quality": round(float(motion(videos, prompts, metadata).scores.mean()), 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model directory or embedded name (digits_video)")
    p.add_argument("--checkpoint", type=Path, default=None, help="a run checkpoint whose weights to use")
    p.add_argument("--guidance-scale", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(json.dumps(measure(a.model, a.checkpoint, guidance_scale=a.guidance_scale)))


if __name__ == "__main__":
    main()
