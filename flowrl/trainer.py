"""THE loop: rollout -> score -> prepare -> update -> log/evaluate/save.

Runs through accelerate: one process by default, ``accelerate launch --num_processes N`` for data
parallelism. Each process rolls out whole prompt groups (so group advantages need no communication);
gradients are averaged by DDP; rewards and evaluation results are gathered for logging.
"""

from __future__ import annotations

import math
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from tqdm import tqdm

from . import seeding
from .checkpoint import load_optimizer, read_checkpoint, resolve_checkpoint, save_checkpoint
from .config import Config, ODEConfig, eval_steps_and_guidance, to_yaml
from .errors import FlowRLError
from .inference.best_of_n import BestOfN, best_of_n
from .inference.noise_search import NoiseSearchResult, zero_order_search
from .inference.svdd import SVDDResult, svdd_sample
from .objectives import build_objective
from .pipelines import build_pipeline
from .pipelines.guidance import training_guidance_scale
from .preference_pairs import PreferencePairs, read_pairs
from .prompts import prompt_pool, sample_prompts
from .reward_models import build_reward_from_config
from .run_logger import RunLogger
from .samplers import build_sampler
from .samplers.rollout import group_noise, rollout, sde_window
from .types import Trajectory
from .visualize import save_grid, save_reward_curve, save_videos


class Trainer:
    def __init__(self, config: Config):
        self.config = config
        self.accelerator = Accelerator(mixed_precision=config.train.mixed_precision, cpu=config.pipeline.device == "cpu")
        self.is_main = self.accelerator.is_main_process
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        self._check_divisibility()
        self.run_dir = Path(config.output_dir)
        self.reward = build_reward_from_config(config.reward)
        seeding.seed_initialisation(config.seed)
        self._build_components()
        self._check_capabilities()
        if getattr(self.objective, "needs_reference", False):
            self.pipeline.enable_reference()
        optimizer = torch.optim.AdamW(self._parameter_groups(), lr=config.train.learning_rate, betas=(config.train.adam_beta1, config.train.adam_beta2),
                                      weight_decay=config.train.weight_decay)
        prepared, self.optimizer = self.accelerator.prepare(self.module, optimizer)
        setattr(self.pipeline, self.module_attr, prepared)
        pc = config.prompts
        self.train_pool = prompt_pool(pc.dataset, pc.train_split, file=pc.train_file)
        self.eval_pool = prompt_pool(pc.dataset, pc.eval_split, pc.eval_size, file=pc.eval_file)
        self.pairs = self._read_pairs() if getattr(self.objective, "offline", False) else None
        self.iteration = 0
        self.logger = RunLogger(self.run_dir, enabled=self.is_main)
        self._stop_requested = False

    module_attr = "denoiser"  # the pipeline attribute holding the trained module

    def _build_components(self) -> None:
        """Build the modality's pipeline, samplers and objective (images here; text in TextTrainer)."""
        cfg = self.config
        self.pipeline = build_pipeline(cfg.pipeline, self.accelerator.device)
        self.pipeline.guidance_mode = cfg.rollout.guidance_mode
        self.sampler = build_sampler(cfg.sampler, self.pipeline)
        self.eval_sampler = build_sampler(ODEConfig(), self.pipeline)
        self.objective = build_objective(cfg.objective, reward_weights=dict(cfg.reward.components))

    @property
    def module(self) -> torch.nn.Module:
        return getattr(self.pipeline, self.module_attr)

    def _objective_parameters(self) -> list[torch.nn.Parameter]:
        """An objective's own trainable module (DCoLT's unmasking-policy head); none for most."""
        return list(getattr(self.objective, "extra_parameters", lambda: [])())

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return self.pipeline.trainable_parameters() + self._objective_parameters()

    def _parameter_groups(self) -> list[dict]:
        """The model's parameters at train.learning_rate; an objective's own module at learning_rate * its
        ``extra_lr_scale`` (a freshly initialised head can be given a different step from the pretrained
        model it steers)."""
        groups = [{"params": self.pipeline.trainable_parameters()}]
        extra = self._objective_parameters()
        if extra:
            groups.append({"params": extra, "lr": self.config.train.learning_rate * getattr(self.objective, "extra_lr_scale", 1.0)})
        return groups

    # -- start-up checks ------------------------------------------------------------------------
    def _check_divisibility(self) -> None:
        if self.config.train.prompts_per_iteration % self.world:
            raise FlowRLError(f"train.prompts_per_iteration ({self.config.train.prompts_per_iteration}) must be divisible by the number of processes ({self.world}).")

    def _check_capabilities(self) -> None:
        if self.objective.needs_log_probs and not self.sampler.stochastic:
            raise FlowRLError(f"objective '{self.objective.name}' needs log-probs but sampler '{self.sampler.name}' is deterministic; use a stochastic sampler.")
        unit, tc = getattr(self.objective, "minibatch_unit", 1), self.config.train
        generations = 2 if getattr(self.objective, "offline", False) else tc.num_generations  # offline: rows are (winner, loser)
        if generations % unit or tc.batch_size % unit:
            raise FlowRLError(f"objective '{self.objective.name}' trains pairs of samples: train.num_generations ({tc.num_generations}) "
                              f"and train.batch_size ({tc.batch_size}) must be multiples of {unit}.")

    # -- the coarse verbs ---------------------------------------------------------------------------
    def sigmas(self, num_steps: int) -> torch.Tensor:
        return self.pipeline.schedule.sigmas(num_steps).to(self.accelerator.device)

    def rollout(self, iteration: int) -> Trajectory:
        """Sample this process's prompt groups for ``iteration`` and record their trajectories (an offline
        objective reads its preference pairs instead)."""
        if self.pairs is not None:
            return self._pair_batch(iteration)
        cfg, tc = self.config.rollout, self.config.train
        groups = tc.prompts_per_iteration // self.world
        chosen = sample_prompts(self.train_pool, groups, seeding.python_rng(self.config.seed, iteration, self.rank, "prompts"))
        prompts = [p for p, _ in chosen for _ in range(tc.num_generations)]
        metadata = [m for _, m in chosen for _ in range(tc.num_generations)]
        group_ids = torch.arange(groups).repeat_interleave(tc.num_generations) + self.rank * groups
        gen = seeding.torch_generator(self.config.seed, iteration, self.rank, "rollout")
        noise = group_noise(self.pipeline, group_ids, gen, cfg.same_noise_in_group)
        window = sde_window(cfg.num_inference_steps, cfg.sde_window_size, cfg.sde_window_start, cfg.sde_window_slide_every, iteration)
        sigmas = self.sigmas(cfg.num_inference_steps)
        chunks = []
        for start in range(0, len(prompts), cfg.batch_size):
            sl = slice(start, start + cfg.batch_size)
            chunks.append(rollout(self.pipeline, self.sampler, prompts[sl], metadata[sl], group_ids[sl], sigmas, gen,
                                  cfg.guidance_scale, window, initial_noise=noise[sl]))
        return Trajectory.cat(chunks)

    def _read_pairs(self) -> PreferencePairs:
        """The offline objective's pairs, checked against the model's sample shape."""
        if self.config.prompts.pairs is None:
            raise FlowRLError(f"objective '{self.objective.name}' trains on offline preference pairs: set prompts.pairs to a pairs "
                              "directory (python -m flowrl.preference_pairs).")
        pairs = read_pairs(self.config.prompts.pairs)
        shape = tuple(self.pipeline.initial_noise(1, torch.Generator()).shape[1:])
        if tuple(pairs.winners.shape[1:]) != shape:
            raise FlowRLError(f"the pairs in '{self.config.prompts.pairs}' have shape {tuple(pairs.winners.shape[1:])}, the model's samples {shape}.")
        return pairs

    @torch.no_grad()
    def _pair_batch(self, iteration: int) -> Trajectory:
        """This process's pairs for ``iteration`` (drawn with replacement, keyed by the seed) as a trajectory
        of clean samples, rows (2i, 2i + 1) = (winner, loser) of pair i."""
        per_process = self.config.train.prompts_per_iteration // self.world
        rng = seeding.python_rng(self.config.seed, iteration, self.rank, "pairs")
        idx = [rng.randrange(len(self.pairs)) for _ in range(per_process)]
        x0 = torch.stack([t for i in idx for t in (self.pairs.winners[i], self.pairs.losers[i])]).to(self.accelerator.device)
        prompts = [self.pairs.prompts[i] for i in idx for _ in range(2)]
        metadata = [dict(self.pairs.metadata[i]) for i in idx for _ in range(2)]
        return Trajectory(latents=x0[:, None], sigmas=torch.zeros(1), log_probs=x0.new_zeros(len(prompts), 0),
                          stochastic=torch.zeros(0, dtype=torch.bool), cond=self.pipeline.encode(prompts), prompts=prompts, metadata=metadata,
                          group_ids=torch.arange(per_process).repeat_interleave(2) + self.rank * per_process,
                          samples=self.pipeline.decode(x0), guidance_scale=1.0)

    @torch.no_grad()
    def score(self, traj: Trajectory) -> Trajectory:
        """Attach rewards; non-finite rewards stay NaN and are left out of the update (and counted)."""
        out = self.reward(self.reward_inputs(traj), traj.prompts, traj.metadata)
        scores = out.scores.float()  # on the reward's device: the samples' for images, the CPU for text
        bad = ~torch.isfinite(scores)
        if bad.any():
            warnings.warn(f"{int(bad.sum())} of {len(scores)} rewards were NaN or infinite; those samples are left out of the update.", stacklevel=2)
        traj.rewards = torch.where(bad, torch.full_like(scores, float("nan")), scores)
        traj.reward_components = {k: v.float().to(scores.device) for k, v in out.extras.items()}
        return traj

    def reward_inputs(self, traj):
        """What the reward scores: decoded images here, decoded completions for text."""
        return traj.samples

    def update(self, traj: Trajectory, iteration: int) -> dict[str, float]:
        """Run the objective's inner epochs over minibatches; one optimizer step per minibatch."""
        tc = self.config.train
        with torch.no_grad():
            traj = self.objective.prepare(traj)
        if hasattr(traj, "guidance_scale"):  # cfg_rollout_only re-scores the conditional branch alone
            traj.guidance_scale = training_guidance_scale(self.config.rollout.guidance_mode, traj.guidance_scale)
        gen = seeding.torch_generator(self.config.seed, iteration, self.rank, "update")
        totals: dict[str, list] = {}
        self.module.train()
        unit = getattr(self.objective, "minibatch_unit", 1)  # D3PO: pairs stay together
        for epoch in range(tc.inner_epochs):
            order = (torch.randperm(len(traj) // unit, generator=gen)[:, None] * unit + torch.arange(unit)).flatten()
            for start in range(0, len(traj), tc.batch_size):
                batch = traj[order[start : start + tc.batch_size]]
                batch.inner_epoch = epoch
                for k, v in self._optimizer_step(batch, gen).items():
                    totals.setdefault(k, []).append(v)
        return {k: float(torch.stack(v).float().mean()) for k, v in totals.items()}

    def _optimizer_step(self, batch: Trajectory, gen: torch.Generator) -> dict[str, torch.Tensor]:
        self.optimizer.zero_grad(set_to_none=True)
        per_step: dict[str, list[torch.Tensor]] = {}
        for loss_out in self.objective.losses(self.pipeline, self.sampler, batch, gen):
            self.accelerator.backward(loss_out.loss)
            for k, v in loss_out.metrics.items():
                per_step.setdefault(k, []).append(v)
        metrics = {k: torch.stack(v).mean() for k, v in per_step.items()}
        if self.config.train.max_grad_norm is not None:
            norm = self.accelerator.clip_grad_norm_(self.trainable_parameters(), self.config.train.max_grad_norm)
            metrics["train/grad_norm"] = torch.as_tensor(norm).detach()
        self.optimizer.step()
        return metrics

    def _eval_setup(self) -> tuple[list, torch.Tensor, float, torch.Generator]:
        """The held-out items (prompt, metadata) x samples_per_prompt, the time grid, the guidance scale and
        the generator (seeded identically on every process and at every evaluation)."""
        ec = self.config.eval
        items = [item for item in self.eval_pool for _ in range(ec.samples_per_prompt)]
        steps, guidance = eval_steps_and_guidance(self.config)
        return items, self.sigmas(steps), guidance, torch.Generator().manual_seed(ec.seed)

    @torch.no_grad()
    def evaluate(self) -> tuple[dict[str, float], torch.Tensor]:
        """Held-out prompts, fixed seeds, deterministic sampler. Returns (metrics, grid samples)."""
        ec = self.config.eval
        items, sigmas, guidance, gen = self._eval_setup()
        noise = self.pipeline.initial_noise(len(items), gen)
        mine = list(range(self.rank, len(items), self.world))
        self.module.eval()
        traj = rollout(self.pipeline, self.eval_sampler, [items[i][0] for i in mine], [items[i][1] for i in mine],
                       torch.tensor(mine), sigmas, gen, guidance, initial_noise=noise[mine])
        out = self.reward(traj.samples, traj.prompts, traj.metadata)
        local = [(i, float(out.scores[j]), {k: float(v[j]) for k, v in out.extras.items()}, traj.samples[j].cpu()) for j, i in enumerate(mine)]
        rows = sorted(gather_object(local), key=lambda r: r[0])
        metrics = {"eval/reward/mean": _nanmean([r[1] for r in rows])}
        for key in rows[0][2]:
            metrics[f"eval/reward/{key}"] = _nanmean([r[2][key] for r in rows])
        grid = torch.stack([r[3] for r in rows])[: self.config.log.grid_prompts * ec.samples_per_prompt]
        return metrics, grid

    def evaluate_best_of_n(self, n: int) -> BestOfN:
        """The held-out evaluation with Best-of-N selection by the run's reward (one process): each item's
        best of ``n`` candidates, candidate 0 being the sample :meth:`evaluate` draws."""
        items, sigmas, guidance, gen = self._eval_setup()
        self.module.eval()
        return best_of_n(self.pipeline, self.eval_sampler, self.reward, [p for p, _ in items], [m for _, m in items], n, sigmas, gen,
                         guidance, self.config.rollout.batch_size)

    def evaluate_noise_search(self, rounds: int, neighbors: int, step: float) -> NoiseSearchResult:
        """The held-out evaluation with zero-order search over each item's start noise (ODE sampler, the run's
        reward), starting from the noise :meth:`evaluate` draws; one process."""
        items, sigmas, guidance, gen = self._eval_setup()
        noise = self.pipeline.initial_noise(len(items), gen)
        self.module.eval()
        return zero_order_search(self.pipeline, self.eval_sampler, self.reward, [p for p, _ in items], [m for _, m in items], rounds, neighbors,
                                 step, sigmas, gen, guidance, self.config.rollout.batch_size, initial_noise=noise)

    def evaluate_svdd(self, m: int) -> SVDDResult:
        """The held-out items sampled with SVDD-PM (``m`` candidates per step from the rollout sampler,
        scored by the run's reward), starting from the evaluation's initial noise; one process."""
        items, sigmas, guidance, gen = self._eval_setup()
        noise = self.pipeline.initial_noise(len(items), gen)
        chunk = max(1, self.config.rollout.batch_size // m)  # prompts per batch of chunk x m candidates
        self.module.eval()
        parts = [svdd_sample(self.pipeline, self.sampler, self.reward, [p for p, _ in items[i : i + chunk]], [d for _, d in items[i : i + chunk]],
                             m, sigmas, gen, guidance, initial_noise=noise[i : i + chunk]) for i in range(0, len(items), chunk)]
        return SVDDResult(samples=torch.cat([r.samples for r in parts]), scores=torch.cat([r.scores for r in parts]),
                          step_scores=torch.cat([r.step_scores for r in parts], 1),
                          components={k: torch.cat([r.components[k] for r in parts]) for k in parts[0].components})

    # -- persistence ----------------------------------------------------------------------------
    def save(self) -> Path | None:
        states = gather_object([self.objective.state_dict()])
        self.accelerator.wait_for_everyone()
        path = None
        if self.is_main:
            weights = self._weights_to_save()
            state = {"iteration": self.iteration, "objective": states}
            lora = getattr(self.pipeline, "has_lora", False)  # + the diffusers LoRA file, for load_lora_weights(checkpoint)
            path = save_checkpoint(self.run_dir / "checkpoints" / f"step_{self.iteration:06d}", weights, self.optimizer.optimizer
                                   if hasattr(self.optimizer, "optimizer") else self.optimizer, state, to_yaml(self.config),
                                   extra=self.pipeline.save_lora if lora else None)
        self.accelerator.wait_for_everyone()
        return path

    def _weights_to_save(self) -> dict[str, torch.Tensor]:
        own = getattr(self.pipeline, "trainable_state_dict", None)  # LoRA runs store the adapter only
        weights = own() if own else dict(self.accelerator.unwrap_model(self.module).state_dict())
        extra = getattr(self.objective, "extra_module", None)
        if extra is not None:  # e.g. DCoLT's unmasking-policy head
            weights.update({f"objective.{k}": v for k, v in extra.state_dict().items()})
        return weights

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        extra = getattr(self.objective, "extra_module", None)
        if extra is not None:
            extra.load_state_dict({k[len("objective."):]: v for k, v in weights.items() if k.startswith("objective.")})
        weights = {k: v for k, v in weights.items() if not k.startswith("objective.")}
        own = getattr(self.pipeline, "load_trainable_state_dict", None)
        own(weights) if own else self.accelerator.unwrap_model(self.module).load_state_dict(weights)

    def load(self, spec: str) -> None:
        directory = resolve_checkpoint(spec, self.run_dir)
        weights, optim, state = read_checkpoint(directory)
        try:
            self._load_weights(weights)
            load_optimizer(getattr(self.optimizer, "optimizer", self.optimizer), optim, state["optimizer"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise FlowRLError(f"checkpoint '{directory}' does not match this model ({str(e).splitlines()[0][:160]}).") from None
        objective_states = state.get("objective", [])
        if len(objective_states) != self.world:
            raise FlowRLError(f"checkpoint '{directory}' was written by {len(objective_states)} process(es) but this run has {self.world}.")
        self.objective.load_state_dict(objective_states[self.rank])
        self.iteration = int(state["iteration"])

    # -- the loop ---------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        cfg = self.config
        if cfg.resume_from:  # before anything is written: a bad checkpoint must leave no files behind
            self.load(cfg.resume_from)
            self.logger.truncate_after(self.iteration)
        else:
            self._claim_output_dir()
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        if self.iteration == 0:
            self._evaluate_and_log(0, tag="before")
        previous = signal.signal(signal.SIGINT, self._request_stop)
        started, first = time.time(), self.iteration
        bar = tqdm(range(self.iteration, cfg.train.iterations), initial=self.iteration, total=cfg.train.iterations,
                   desc="flowrl train", disable=not (self.is_main and cfg.log.progress), dynamic_ncols=True)
        try:
            for iteration in bar:
                metrics = self.train_iteration(iteration)
                self.iteration = iteration + 1
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
                self._after_iteration(metrics)
                if self._stop_requested or (cfg.train.stop_after and self.iteration - first >= cfg.train.stop_after):
                    break
        finally:
            signal.signal(signal.SIGINT, previous)
            bar.close()
        return self._finish(time.time() - started)

    def _claim_output_dir(self) -> None:
        """A fresh run never mixes its metrics or checkpoints with an earlier run's."""
        previous = [p for p in ("metrics.jsonl", "checkpoints") if (self.run_dir / p).exists()]
        if not previous:
            return
        if not self.config.overwrite:
            raise FlowRLError(f"output_dir '{self.run_dir}' already holds a run; continue it with resume_from=latest, "
                              "choose another output_dir, or set overwrite=true to replace it.")
        self.accelerator.wait_for_everyone()
        if self.is_main:
            import shutil

            for name in ("metrics.jsonl", "summary.json", "reward_curve.png"):
                (self.run_dir / name).unlink(missing_ok=True)
            for name in ("checkpoints", "samples", "tensorboard"):
                shutil.rmtree(self.run_dir / name, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def train_iteration(self, iteration: int) -> dict[str, float]:
        t0 = time.perf_counter()
        traj = self.rollout(iteration)
        t1 = time.perf_counter()
        try:
            traj = self.score(traj)
        except FlowRLError as e:  # e.g. a reward server that stayed down through its retries
            raise FlowRLError(f"{str(e).rstrip('.')}; {self._save_after_failure()}.") from None
        t2 = time.perf_counter()
        metrics = self.update(traj, iteration)
        t3 = time.perf_counter()
        metrics.update(self._reward_metrics(traj))
        metrics.update({"perf/rollout_s": t1 - t0, "perf/score_s": t2 - t1, "perf/update_s": t3 - t2})
        return metrics

    def _reward_metrics(self, traj: Trajectory) -> dict[str, float]:
        rewards = torch.cat(gather_object([traj.rewards.cpu()]))
        finite = torch.isfinite(rewards)
        metrics = {"reward/mean": float(rewards[finite].mean()) if finite.any() else float("nan"),
                   "reward/std": float(rewards[finite].std(unbiased=False)) if finite.any() else float("nan"),
                   "reward/nonfinite_count": int((~finite).sum())}
        for name, values in traj.reward_components.items():
            metrics[f"reward/{name}"] = _nanmean(torch.cat(gather_object([values.cpu()])).tolist())
        return metrics

    def _after_iteration(self, metrics: dict[str, float]) -> None:
        cfg, it = self.config, self.iteration
        last = it == cfg.train.iterations
        if (cfg.eval.every and it % cfg.eval.every == 0) or last:
            metrics.update(self._evaluate_and_log(it, tag="after" if last else None, log=False))
        self.logger.log(it, metrics)
        if (cfg.log.checkpoint_every and it % cfg.log.checkpoint_every == 0) or last or self._stop_requested:
            self.save()
        if self.is_main and ((cfg.eval.every and it % cfg.eval.every == 0) or last):
            save_reward_curve(self.logger.records(), self.run_dir / "reward_curve.png", title=f"{cfg.objective.name} on {cfg.pipeline.pretrained}")

    def _evaluate_and_log(self, step: int, tag: str | None, log: bool = True) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics, grid = self.evaluate()
        metrics["perf/eval_s"] = time.perf_counter() - t0
        if self.is_main:
            ncol = self.config.eval.samples_per_prompt
            save_grid(grid, self.run_dir / "samples" / f"step_{step:06d}.png", ncol=ncol)
            if tag:
                save_grid(grid, self.run_dir / f"samples_{tag}.png", ncol=ncol)
            if grid.ndim == 5:  # videos: also an animated grid as MP4 and GIF
                save_videos(grid, self.run_dir / "samples" / f"step_{step:06d}", ncol=ncol)
                if tag:
                    save_videos(grid, self.run_dir / f"samples_{tag}", ncol=ncol)
        if log:
            self.logger.log(step, metrics)
        return metrics

    def _finish(self, seconds: float) -> dict[str, Any]:
        records = self.logger.records() if self.is_main else []
        evals = [r for r in records if r.get("eval/reward/mean") is not None]
        summary = {
            "iterations_completed": self.iteration,
            "iterations_planned": self.config.train.iterations,
            "eval_reward_initial": evals[0]["eval/reward/mean"] if evals else None,
            "eval_reward_final": evals[-1]["eval/reward/mean"] if evals else None,
            "samples_per_iteration": self.config.train.prompts_per_iteration * (2 if self.pairs is not None else self.config.train.num_generations),
            "wall_seconds_this_process": round(seconds, 1),
            "stopped_early": self.iteration < self.config.train.iterations,
        }
        if self.is_main:
            import json

            from .checkpoint import atomic_path

            with atomic_path(self.run_dir / "summary.json") as tmp:
                tmp.write_text(json.dumps(summary, indent=2) + "\n")
            save_reward_curve(records, self.run_dir / "reward_curve.png", title=f"{self.config.objective.name} on {self.config.pipeline.pretrained}")
        self.logger.close()
        self.accelerator.wait_for_everyone()
        return summary

    def _save_after_failure(self) -> str:
        """Make sure the last completed iteration is on disk (the weights are untouched: scoring
        precedes the update) and say where. Every process must fail alike: saving is collective."""
        if self.iteration == 0:
            return "no iteration had completed, so there is nothing to resume"
        directory = self.run_dir / "checkpoints" / f"step_{self.iteration:06d}"
        if not directory.is_dir():
            self.save()
        return f"the run stopped with iteration {self.iteration} saved in {directory} (resume with resume_from=latest)"

    def _request_stop(self, signum, frame) -> None:
        if self._stop_requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self._stop_requested = True
        tqdm.write("flowrl: stopping after this iteration and saving a checkpoint (Ctrl-C again to abort now).")


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")
