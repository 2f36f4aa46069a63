"""Images and video: diffusers-family pipelines (and the embedded models) with SDE / DDIM rollouts,
offline preference pairs, decoded-sample rewards, and a held-out evaluation on the deterministic sampler."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object

from .. import seeding
from ..config import Config
from ..errors import FlowRLError
from ..evaluation.diversity import seed_diversity
from ..evaluation.held_out import HeldOut, held_out_images
from ..objectives import BuildContext, build_objective
from ..objectives.seppo import reference_pair_batch, winners_for
from ..pipelines import build_pipeline
from ..pipelines.guidance import training_guidance_scale
from ..preferences.labels import labelled_pairs
from ..preferences.pairs import PreferencePairs, read_pairs
from ..prompts import prompts_for, sample_prompts
from ..reward_models.gradients import reward_and_gradient
from ..samplers import ODEConfig, build_sampler
from ..samplers.branching import branched_rollout, trained_steps
from ..samplers.rollout import keyed_noise, padded_rows, rollout, sample, sde_window, start_noise
from ..training.run_logger import nanmean
from ..types import PAIRED_ROWS, Pipeline, Reward, RewardOutput, Sampler, Trajectory
from ..visualize import save_grid, save_points, save_videos
from .reward_overlap import RolloutScoring


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
        self.pairs: PreferencePairs | None = self._read_pairs() if self.objective.trains_on == "offline_pairs" else None
        self.winners = winners_for(self.objective, self.pipeline) if self.objective.trains_on == "reference_rollouts" else None  # SePPO

    def check(self) -> None:
        objective, tc = self.objective, self.config.train
        if objective.needs_log_probs and not self.sampler.stochastic:
            raise FlowRLError(
                f"objective '{objective.name}' needs log-probs but sampler '{self.sampler.name}' is deterministic; use a stochastic sampler."
            )
        if (
            objective.trains_on == "rollouts"
            and not self.sampler.stochastic
            and self.config.rollout.same_noise_in_group
            and tc.num_generations > 1
        ):
            raise FlowRLError(
                f"sampler '{self.sampler.name}' is deterministic and rollout.same_noise_in_group is true, so every sample of a "
                "prompt group would be the same and no group has anything to compare; set rollout.same_noise_in_group=false."
            )
        unit = objective.minibatch_unit
        generations = 2 if objective.trains_on in PAIRED_ROWS else tc.num_generations  # rows are (winner, loser)
        if generations % unit or tc.batch_size % unit:
            raise FlowRLError(
                f"objective '{objective.name}' trains pairs of samples: train.num_generations ({tc.num_generations}) "
                f"and train.batch_size ({tc.batch_size}) must be multiples of {unit}."
            )
        if self.config.rollout.overlap_reward:
            self._check_overlap()

    def _check_overlap(self) -> None:
        """rollout.overlap_reward scores plain rollout chunks, without gradient, on a worker thread."""
        objective = self.objective
        why = None
        if objective.trains_on == "reward_gradient_rollouts":
            why = (
                f"objective '{objective.name}' trains on the reward's gradient through the decoder, a graph built on the "
                "loop's own thread after the rollout"
            )
        elif objective.trains_on != "rollouts":
            why = f"objective '{objective.name}' trains on {objective.trains_on.replace('_', ' ')}, which are not rolled out in chunks"
        elif self.config.rollout.branching is not None:
            why = "rollout.branching rolls out a shared prefix and then its branches, not chunk after chunk"
        if why:
            raise FlowRLError(
                f"rollout.overlap_reward scores each rollout chunk on a worker thread while the next one is generated, but {why}; "
                "set rollout.overlap_reward=false."
            )

    # -- collect ------------------------------------------------------------------------------------
    def collect(self, iteration: int, rank: int, world: int, scoring: RolloutScoring | None = None) -> Trajectory:
        """On-policy rollouts of this process's prompt groups, or (offline objectives) the iteration's pairs.
        ``scoring``: where each finished rollout chunk is decoded (and, with rollout.overlap_reward, scored)."""
        if self.winners is not None:  # SePPO: dataset winners beside a previous checkpoint's samples
            rc = self.config.rollout
            return reference_pair_batch(
                self.objective,
                self.pipeline,
                self.sampler,
                self.winners,
                seed=self.config.seed,
                iteration=iteration,
                rank=rank,
                world=world,
                pairs=self.config.train.prompts_per_iteration // world,
                num_inference_steps=rc.num_inference_steps,
                guidance_scale=rc.guidance_scale,
                chunk=rc.batch_size,
            )
        return self._pair_batch(iteration, rank, world) if self.pairs is not None else self._rollouts(iteration, rank, world, scoring)

    def for_update(self, batch: Trajectory) -> Trajectory:
        """The batch as training re-scores it: with the rollout's guidance scale, except 1 in ``cfg_rollout_only``."""
        batch.guidance_scale = training_guidance_scale(self.config.rollout.guidance_mode, batch.guidance_scale)
        return batch

    @torch.no_grad()
    def _rollouts(self, iteration: int, rank: int, world: int, scoring: RolloutScoring | None = None) -> Trajectory:
        cfg, tc, seed = self.config.rollout, self.config.train, self.config.seed
        groups = tc.prompts_per_iteration // world
        # Every draw is made for the whole world and keyed by global indices (seeding.global_draw,
        # RowGenerators): an N-process run samples exactly the prompts and noise of a 1-process run.
        chosen = seeding.global_draw(
            lambda n: sample_prompts(self.train_pool, n, seeding.python_rng(seed, iteration, 0, "prompts")), groups, rank, world
        )
        prompts = [p for p, _ in chosen for _ in range(tc.num_generations)]
        metadata = [m for _, m in chosen for _ in range(tc.num_generations)]
        group_ids = torch.arange(groups).repeat_interleave(tc.num_generations) + rank * groups
        rows = seeding.global_rows(group_ids, tc.num_generations)
        gen = seeding.RowGenerators.keyed(seed, iteration, "rollout", rows)
        noise = keyed_noise(
            self.pipeline, seeding.RowGenerators.keyed(seed, iteration, "initial_noise", group_ids if cfg.same_noise_in_group else rows)
        )
        self.pipeline.denoiser.eval()  # rollouts sample the policy deterministically in its layers (dropout off), as the peers do; update() sets train()
        if cfg.branching is not None:  # B2-DiffuRL: one shared prefix per group, branches over the trained window (samplers/branching.py)
            return self._branched_rollouts(iteration, prompts, metadata, group_ids, gen, noise)
        window = sde_window(cfg.num_inference_steps, cfg.sde_window_size, cfg.sde_window_start, cfg.sde_window_slide_every, iteration)
        sigmas = self.pipeline.schedule.sigmas(cfg.num_inference_steps).to(self.device)
        chunks = []
        for start in range(0, len(prompts), cfg.batch_size):
            sl = slice(start, start + cfg.batch_size)
            chunk = rollout(
                self.pipeline,
                self.sampler,
                prompts[sl],
                metadata[sl],
                group_ids[sl],
                sigmas,
                gen[sl],
                cfg.guidance_scale,
                window,
                initial_noise=noise[sl],
                decode=scoring is None,  # else the hand-over decodes it (timed; on the reward's worker when overlapped)
            )
            if scoring is not None:
                final = chunk.samples  # undecoded: the final states, the very tensor rollout() decodes
                decoded = scoring.chunk(lambda final=final: self.pipeline.decode(final), chunk.prompts, chunk.metadata)
                if decoded is not None:  # else overlapped: the samples come back from the worker at join (score)
                    chunk.samples = decoded
            chunks.append(chunk)
        if scoring is not None:
            scoring.generated()
        return Trajectory.cat(chunks)

    def _branched_rollouts(self, iteration: int, prompts, metadata, group_ids, gen, noise) -> Trajectory:
        cfg, b = self.config.rollout, self.config.rollout.branching
        trained = trained_steps(iteration, self.config.train.iterations, cfg.num_inference_steps, b.start_steps, b.end_steps)
        sigmas = self.pipeline.schedule.sigmas(cfg.num_inference_steps).to(self.device)
        traj = branched_rollout(
            self.pipeline,
            self.sampler,
            prompts,
            metadata,
            group_ids,
            sigmas,
            gen,
            cfg.num_inference_steps - trained,
            noise,
            cfg.guidance_scale,
            cfg.batch_size,
        )
        if not traj.stochastic.any():  # e.g. DDIM's step into clean data has no noise, so a 1-step window has nothing to train
            raise FlowRLError(
                f"the trained window of iteration {iteration + 1} (the last {trained} of {cfg.num_inference_steps} steps) has no stochastic "
                f"step on sampler '{self.sampler.name}'; raise rollout.branching.start_steps."
            )
        return traj

    def _read_pairs(self) -> PreferencePairs:
        """The offline objective's pairs, checked against the model's sample shape."""
        if self.config.prompts.pairs is None:
            raise FlowRLError(
                f"objective '{self.objective.name}' trains on offline preference pairs: set prompts.pairs to a pairs "
                "directory (python -m flowrl.preferences.pairs)."
            )
        directory = self.config.prompts.pairs
        # objective.preference (D3PO, Diffusion-DPO): "human" trains on a person's labels.jsonl of the pairs
        if getattr(self.config.objective, "preference", None) == "human":
            labelled = labelled_pairs(directory)
            pairs, c = labelled.pairs, labelled.counts
            print(
                f"flowrl: training on {c['preferences']} human preferences of the {c['total']} pairs in '{directory}' "
                f"({c['ties']} ties, {c['skips']} skips and {c['total'] - c['labelled']} unlabelled pairs left out).",
                file=sys.stderr,
                flush=True,
            )
        else:
            pairs = read_pairs(directory)
        shape = tuple(self.pipeline.initial_noise(1, torch.Generator()).shape[1:])
        if tuple(pairs.winners.shape[1:]) != shape:
            raise FlowRLError(f"the pairs in '{directory}' have shape {tuple(pairs.winners.shape[1:])}, the model's samples {shape}.")
        if self.objective.needs_log_probs:  # D3PO re-scores every step of the stored trajectories
            self._check_trajectories(pairs, directory)
        return pairs

    def _check_trajectories(self, pairs: PreferencePairs, directory: str) -> None:
        if pairs.trajectories is None:
            raise FlowRLError(
                f"objective '{self.objective.name}' trains on the denoising trajectories of the pairs, and '{directory}' has "
                "none; build the pairs with python -m flowrl.preferences.pairs CONFIG --trajectories."
            )
        rc = self.config.rollout
        grid = self.pipeline.schedule.sigmas(rc.num_inference_steps).cpu().float()
        if pairs.trajectories.sigmas.shape != grid.shape or not torch.allclose(pairs.trajectories.sigmas, grid, atol=1e-6):
            raise FlowRLError(
                f"the trajectories in '{directory}' were sampled on {pairs.trajectories.sigmas.shape[0] - 1} steps of another "
                f"time grid than this config's (rollout.num_inference_steps = {rc.num_inference_steps}); use the config they were built with."
            )

    @torch.no_grad()
    def _pair_batch(self, iteration: int, rank: int, world: int) -> Trajectory:
        """This process's pairs for ``iteration`` (drawn with replacement, keyed by the seed) as a trajectory
        of clean samples, rows (2i, 2i + 1) = (winner, loser) of pair i."""
        per_process = self.config.train.prompts_per_iteration // world
        rng = seeding.python_rng(self.config.seed, iteration, 0, "pairs")  # drawn for the whole world, as rollouts are
        idx = seeding.global_draw(lambda n: [rng.randrange(len(self.pairs)) for _ in range(n)], per_process, rank, world)
        prompts = [self.pairs.prompts[i] for i in idx for _ in range(2)]
        metadata = [dict(self.pairs.metadata[i]) for i in idx for _ in range(2)]
        group_ids = torch.arange(per_process).repeat_interleave(2) + rank * per_process
        traj = self.pairs.trajectories
        if self.objective.needs_log_probs:  # every recorded state (D3PO on human labels), as the rollout recorded it
            states = torch.stack([t for i in idx for t in (traj.winners[i], traj.losers[i])]).to(self.device)
            x0, k = states[:, -1], states.shape[1] - 1
            return Trajectory(
                latents=states,
                sigmas=traj.sigmas.to(self.device),
                log_probs=torch.full((len(prompts), k), float("nan")),
                stochastic=traj.stochastic.clone(),
                cond=self.pipeline.encode(prompts),
                prompts=prompts,
                metadata=metadata,
                group_ids=group_ids,
                samples=self.pipeline.decode(x0),
                guidance_scale=traj.guidance_scale,
            )
        x0 = torch.stack([t for i in idx for t in (self.pairs.winners[i], self.pairs.losers[i])]).to(self.device)
        return Trajectory(
            latents=x0[:, None],
            sigmas=torch.zeros(1),
            log_probs=x0.new_zeros(len(prompts), 0),
            stochastic=torch.zeros(0, dtype=torch.bool),
            cond=self.pipeline.encode(prompts),
            prompts=prompts,
            metadata=metadata,
            group_ids=group_ids,
            samples=self.pipeline.decode(x0),
            guidance_scale=1.0,
        )

    # -- score --------------------------------------------------------------------------------------
    def score(
        self, batch: Trajectory, reward: Reward, with_gradient: bool, scoring: RolloutScoring | None = None
    ) -> tuple[RewardOutput, torch.Tensor | None]:
        """The reward of the decoded samples; with ``with_gradient`` also d reward / d final latents, through
        the decoder (the VAE of latent models), ``rollout.batch_size`` samples per graph. With an overlapped
        ``scoring`` the chunks were decoded and scored on its worker during collect: joined here, in order."""
        if scoring is not None and scoring.scored_on_worker:
            samples, out = scoring.join()
            batch.samples = torch.cat(samples)
            return out, None
        if with_gradient:
            return reward_and_gradient(
                reward, self.pipeline.decode, batch.latents[:, -1], batch.prompts, batch.metadata, chunk_size=self.config.rollout.batch_size
            )
        with torch.no_grad():
            return reward(batch.samples, batch.prompts, batch.metadata), None

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
        rc = self.config.rollout
        self.pipeline.denoiser.eval()
        traj = sample(
            self.pipeline,
            self.eval_sampler if sampler == "ode" else self.sampler,
            prompts,
            num_samples,
            num_inference_steps or rc.num_inference_steps,
            rc.guidance_scale if guidance_scale is None else guidance_scale,
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
        samples = torch.cat([self._eval_rows(held, noise, gen, mine[start : start + size], size) for start in range(0, len(mine), size)])
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

    def _eval_rows(self, held: HeldOut, noise: torch.Tensor, gen: seeding.RowGenerators, rows: list[int], size: int) -> torch.Tensor:
        """The evaluation samples of held-out items ``rows``, sampled in one batch of ``size`` rows (padded)."""
        everything, streams = padded_rows(rows, size, gen)
        traj = rollout(
            self.pipeline,
            self.eval_sampler,
            [held.prompts[i] for i in everything],
            [held.metadata[i] for i in everything],
            torch.tensor(everything),
            held.sigmas,
            streams,
            held.guidance_scale,
            initial_noise=noise[everything],
        )
        return traj.samples[: len(rows)]

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
