"""Images and video: diffusers-family pipelines (and the embedded models), the collector of the objective's training
data (on-policy rollouts, with the reward's gradient, offline pairs, SePPO's reference rollouts: one table, below), and a
held-out evaluation on the deterministic sampler."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object

from ..config import Config, eval_steps_and_guidance
from ..errors import FlowRLError
from ..evaluation.aggregate import nanmean
from ..evaluation.diversity import seed_diversity
from ..evaluation.held_out import HeldOut, held_out_images
from ..objectives import BuildContext, build_objective
from ..pipelines import build_pipeline
from ..pipelines.guidance import training_guidance_scale
from ..prompts import prompts_for
from ..samplers import ODEConfig, build_sampler
from ..samplers.rollout import padded_samples, sample, start_noise
from ..training.distributed import check_peers
from ..types import Pipeline, Reward, Sampler, Trajectory
from ..visualize import save_grid, save_points, save_videos
from .collector import collector_for
from .image_rollouts import ImageRollouts
from .offline_pairs import OfflinePairs
from .reference_rollouts import ReferenceRollouts


@dataclass
class ImageComponents:
    """A config's model side: the pipeline (guidance mode set), the rollout sampler and the deterministic
    evaluation sampler (ODE / DDIM eta = 0)."""

    pipeline: Pipeline
    sampler: Sampler
    eval_sampler: Sampler


def build_image_components(config: Config, device: torch.device | str, loaded: Any = None) -> ImageComponents:
    """``loaded``: a diffusers pipeline already in memory, whose components the model uses (flowrl.Trainer(pipeline=...))."""
    pipeline = build_pipeline(config.pipeline, device, loaded)
    pipeline.guidance_mode = config.rollout.guidance_mode
    sampler = build_sampler(config.sampler, pipeline)
    # a masked-token model (amused) starts from the all-masked state, so its randomness is all in the steps: it is
    # evaluated with its own sampler on the per-item keyed streams (greedy decoding would give every seed one image)
    eval_sampler = sampler if pipeline.prediction_type == "masked_tokens" else build_sampler(ODEConfig(), pipeline)
    return ImageComponents(pipeline, sampler, eval_sampler)


class ImageModality:
    module_attr = "denoiser"

    def __init__(self, config: Config, device: torch.device, loaded: Any = None, objective: Any = None):
        self.config, self.device = config, device
        parts = build_image_components(config, device, loaded)
        self.pipeline, self.sampler, self.eval_sampler = parts.pipeline, parts.sampler, parts.eval_sampler
        context = BuildContext(
            dict(config.reward.components),
            config.sampler,
            self.pipeline,
            run_dir=config.output_dir,
            group_size=config.train.num_generations,
        )
        self.objective = objective if objective is not None else build_objective(config.objective, context)
        self.train_pool = prompts_for(config.prompts, "train")
        self.held_out: HeldOut = held_out_images(config, self.pipeline, device)
        self.collector = collector_for(
            {
                "rollouts": lambda: ImageRollouts(self),
                "reward_gradient_rollouts": lambda: ImageRollouts(self, with_gradient=True),
                "offline_pairs": lambda: OfflinePairs(self),
                "reference_rollouts": lambda: ReferenceRollouts(self),
            },
            self.objective,
            "image and video",
        )

    def check(self) -> None:
        objective, tc = self.objective, self.config.train
        if objective.needs_log_probs and not self.sampler.stochastic:
            raise FlowRLError(
                f"objective '{objective.name}' needs log-probs but sampler '{self.sampler.name}' is deterministic; use a stochastic sampler."
            )
        unit = objective.minibatch_unit
        if self.collector.rows_per_prompt % unit or tc.batch_size % unit:
            raise FlowRLError(
                f"objective '{objective.name}' trains pairs of samples: train.num_generations ({tc.num_generations}) "
                f"and train.batch_size ({tc.batch_size}) must be multiples of {unit}."
            )

    def for_update(self, batch: Trajectory) -> Trajectory:
        """The batch as training re-scores it: with the rollout's guidance scale, except 1 in ``cfg_rollout_only``."""
        batch.guidance_scale = training_guidance_scale(self.config.rollout.guidance_mode, batch.guidance_scale)
        return batch

    # -- sample (flowrl.Trainer.sample) --------------------------------------------------------------
    def sample(
        self,
        prompts: list[str],
        num_samples: int,
        seed: int,
        sampler: str = "ode",
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        metadata: list[dict] | None = None,
    ) -> torch.Tensor:
        if sampler not in ("ode", "rollout"):
            raise FlowRLError(f"sampler must be 'ode' (deterministic) or 'rollout' (the run's training sampler), got {sampler!r}.")
        steps, guidance = eval_steps_and_guidance(self.config)  # by default the model as it is evaluated
        self.pipeline.denoiser.eval()
        traj = sample(
            self.pipeline,
            self.eval_sampler if sampler == "ode" else self.sampler,
            prompts,
            num_samples,
            num_inference_steps or steps,
            guidance if guidance_scale is None else guidance_scale,
            seed=seed,
            metadata=metadata,
        )
        return traj.samples

    # -- evaluate -----------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, reward: Reward, rank: int, world: int, judge: Reward | None = None) -> tuple[dict[str, float], torch.Tensor]:
        """Held-out prompts, fixed seeds, deterministic sampler, sharded over processes and gathered; ``judge``
        (eval.judge) scores the same samples, and ``eval/diversity`` is their seed diversity per prompt.
        Returns (metrics, the first ``log.grid_prompts`` prompts' samples for the grid)."""
        held = self.held_out
        gen = held.generator()  # per-item streams keyed by the prompt's content (evaluation/held_out.py)
        noise = start_noise(self.pipeline, len(held), gen)
        mine = list(range(rank, len(held), world))
        self.pipeline.denoiser.eval()
        # eval.batch_size rows per denoiser call, the last call padded: every sample is computed in a batch of the
        # same shape, so its bits do not depend on which other items are evaluated beside it
        size = self.config.eval.batch_size
        samples = torch.cat(
            [
                padded_samples(
                    self.pipeline,
                    self.eval_sampler,
                    held.prompts,
                    held.metadata,
                    mine[start : start + size],
                    size,
                    held.sigmas,
                    gen,
                    held.guidance_scale,
                    noise,
                )
                for start in range(0, len(mine), size)
            ]
        )
        prompts, metadata = [held.prompts[i] for i in mine], [held.metadata[i] for i in mine]
        out = reward(samples, prompts, metadata)
        judged = judge(samples, prompts, metadata) if judge is not None else None
        local = [
            (
                i,
                float(out.scores[j]),
                {k: float(v[j]) for k, v in out.extras.items()},
                samples[j].cpu(),
                {"mean": float(judged.scores[j]), **{k: float(v[j]) for k, v in judged.extras.items()}} if judged is not None else {},
            )
            for j, i in enumerate(mine)
        ]
        check_peers(world)  # a reward that failed on another process ends this evaluation too, not a wait
        rows = sorted(gather_object(local), key=lambda r: r[0])
        metrics = {"eval/reward/mean": nanmean([r[1] for r in rows])}
        for key in rows[0][2]:
            metrics[f"eval/reward/{key}"] = nanmean([r[2][key] for r in rows])
        for key in rows[0][4]:
            metrics[f"eval/judge/{key}"] = nanmean([r[4][key] for r in rows])
        samples = torch.stack([r[3] for r in rows])
        metrics["eval/diversity"] = seed_diversity(samples, self.config.eval.samples_per_prompt)
        grid = samples[: self.config.log.grid_prompts * self.config.eval.samples_per_prompt]
        return metrics, grid

    def evaluated_items(self, shown: torch.Tensor) -> dict[str, Any]:
        """What an evaluation spec records of the held-out evaluation: its prompts, metadata, sampler, sample shape."""
        held = self.held_out
        return {
            "prompts": list(held.prompts),
            "metadata": list(held.metadata),
            "sampler": {"name": self.eval_sampler.name},
            "sample_shape": tuple(shown.shape[1:]),
        }

    def save_eval_samples(self, grid: torch.Tensor, run_dir: Path, step: int, tag: str | None) -> None:
        if grid.ndim == 2:  # points (the 2-D toy): a scatter plot
            for path in [run_dir / "samples" / f"step_{step:06d}.png"] + ([run_dir / f"samples_{tag}.png"] if tag else []):
                save_points(grid, path, title=f"step {step}: {len(grid)} held-out samples")
            return
        ncol = self.config.eval.samples_per_prompt
        save_grid(grid, run_dir / "samples" / f"step_{step:06d}.png", ncol=ncol)
        if tag:
            save_grid(grid, run_dir / f"samples_{tag}.png", ncol=ncol)
        if grid.ndim == 5:  # videos: also an animated grid as MP4 and GIF
            save_videos(grid, run_dir / "samples" / f"step_{step:06d}", ncol=ncol)
            if tag:
                save_videos(grid, run_dir / f"samples_{tag}", ncol=ncol)
