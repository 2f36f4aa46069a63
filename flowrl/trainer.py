"""THE loop, for every model and objective:

    for iteration:
        batch   = collect(iteration)        # what the objective trains on: rollouts or offline pairs
        batch   = score(batch)              # rewards (and reward gradients); NaN kept, counted, masked
        batch   = advantages(batch)         # objective.prepare(): advantages / pairs, no grad
        metrics = update(batch, iteration)  # inner epochs x minibatches: objective.losses() -> backward -> step
        log, evaluate, checkpoint

Runs through accelerate: one process by default, ``accelerate launch --num_processes N`` for data
parallelism. Each process rolls out whole prompt groups (so group advantages need no communication);
gradients are averaged by DDP; rewards and evaluation results are gathered for logging. What differs
between images and text lives in ``flowrl/modalities``; what differs between objectives is what they
declare in the ``Objective`` protocol (``flowrl/types.py``).
"""

from __future__ import annotations

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
from .config import Config, to_yaml
from .errors import FlowRLError
from .modalities import build_modality
from .reward_models import build_reward_from_config
from .reward_models.gradients import require_differentiable
from .run_logger import RunLogger, nanmean
from .visualize import save_reward_curve


class Trainer:
    """One loop for every model: a :class:`~flowrl.modalities.Modality` supplies the model-side parts
    (images and video, or masked-diffusion text) and the objective declares what it trains on."""

    def __init__(self, config: Config):
        self.config = config
        self.accelerator = Accelerator(mixed_precision=config.train.mixed_precision, cpu=config.pipeline.device == "cpu")
        self.is_main = self.accelerator.is_main_process
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        self._check_divisibility()
        self.run_dir = Path(config.output_dir)
        self.reward = build_reward_from_config(config.reward)
        seeding.seed_initialisation(config.seed)  # before anything is initialised at random (LoRA, DCoLT's head)
        self.modality = build_modality(config, self.accelerator.device)
        self.pipeline, self.sampler, self.objective = self.modality.pipeline, self.modality.sampler, self.modality.objective
        self.modality.check()
        if self.objective.trains_on == "reward_gradient_rollouts":  # refused before anything runs or is written
            require_differentiable(self.reward, self.objective.name)
        if self.objective.reference == "initial":
            self.pipeline.enable_reference()
        optimizer = torch.optim.AdamW(self._parameter_groups(), lr=config.train.learning_rate, betas=(config.train.adam_beta1, config.train.adam_beta2),
                                      weight_decay=config.train.weight_decay)
        prepared, self.optimizer = self.accelerator.prepare(self.module, optimizer)
        setattr(self.pipeline, self.modality.module_attr, prepared)
        self.iteration = 0
        self.logger = RunLogger(self.run_dir, enabled=self.is_main)
        self._stop_requested = False

    @property
    def module(self) -> torch.nn.Module:
        """The trained module (the denoiser, or the language model), as accelerate prepared it."""
        return getattr(self.pipeline, self.modality.module_attr)

    def _objective_parameters(self) -> list[torch.nn.Parameter]:
        """An objective's own trainable module (DCoLT's unmasking-policy head); none for most."""
        extra = self.objective.extra_module
        return [] if extra is None else list(extra.parameters())

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return self.pipeline.trainable_parameters() + self._objective_parameters()

    def _parameter_groups(self) -> list[dict]:
        """The model's parameters at train.learning_rate; an objective's own module at learning_rate * its
        ``extra_lr_scale`` (a freshly initialised head can be given a different step from the pretrained
        model it steers)."""
        groups = [{"params": self.pipeline.trainable_parameters()}]
        extra = self._objective_parameters()
        if extra:
            groups.append({"params": extra, "lr": self.config.train.learning_rate * self.objective.extra_lr_scale})
        return groups

    def _check_divisibility(self) -> None:
        if self.config.train.prompts_per_iteration % self.world:
            raise FlowRLError(f"train.prompts_per_iteration ({self.config.train.prompts_per_iteration}) must be divisible by the number of processes ({self.world}).")

    # -- one training iteration, phase by phase ---------------------------------------------------
    def train_iteration(self, iteration: int) -> dict[str, float]:
        """collect -> score -> advantages -> update; logging, evaluation and checkpoints follow in fit()."""
        t0 = time.perf_counter()
        batch = self.collect(iteration)
        t1 = time.perf_counter()
        batch = self.score(batch)
        reward_metrics = self._reward_metrics(batch)  # of everything collected, before prepare() reorders or subsets
        t2 = time.perf_counter()
        batch = self.advantages(batch)
        metrics = self.update(batch, iteration)
        t3 = time.perf_counter()
        return {**metrics, **reward_metrics, "perf/rollout_s": t1 - t0, "perf/score_s": t2 - t1, "perf/update_s": t3 - t2}

    def collect(self, iteration: int):
        """This process's batch for ``iteration``: what the objective trains on (rollouts or offline pairs)."""
        return self.modality.collect(iteration, self.rank, self.world)

    def score(self, batch):
        """Attach rewards (and, for objectives that train on reward gradients, their gradients); non-finite
        rewards stay NaN and are left out of the update (and counted). A reward that fails for good (a
        server that stayed down) stops the run with the last completed iteration on disk."""
        try:
            with_gradient = self.objective.trains_on == "reward_gradient_rollouts"
            out, grads = self.modality.score(batch, self.reward, with_gradient)
        except FlowRLError as e:
            raise FlowRLError(f"{str(e).rstrip('.')}; {self._save_after_failure()}.") from None
        scores = out.scores.float()  # on the reward's device: the samples' for images, the CPU for text
        bad = ~torch.isfinite(scores)
        if bad.any():
            warnings.warn(f"{int(bad.sum())} of {len(scores)} rewards were NaN or infinite; those samples are left out of the update.", stacklevel=2)
        batch.rewards = torch.where(bad, torch.full_like(scores, float("nan")), scores)
        batch.reward_components = {k: v.float().to(scores.device) for k, v in out.extras.items()}
        if grads is not None:
            batch.reward_grads = grads
        return batch

    @torch.no_grad()
    def advantages(self, batch):
        """The objective's prepare(): advantages, pairs or labels; no gradient."""
        return self.objective.prepare(self.modality.for_update(batch))

    def update(self, batch, iteration: int) -> dict[str, float]:
        """The objective's inner epochs over minibatches; one optimizer step per minibatch. Rows are
        shuffled in whole units of ``objective.minibatch_unit`` (D3PO's and Diffusion-DPO's pairs stay together)."""
        tc, unit = self.config.train, self.objective.minibatch_unit
        gen = seeding.torch_generator(self.config.seed, iteration, self.rank, "update")
        totals: dict[str, list] = {}
        self.module.train()
        for epoch in range(tc.inner_epochs):
            order = (torch.randperm(len(batch) // unit, generator=gen)[:, None] * unit + torch.arange(unit)).flatten()
            for start in range(0, len(batch), tc.batch_size):
                minibatch = batch[order[start : start + tc.batch_size]]
                minibatch.inner_epoch = epoch
                for k, v in self._optimizer_step(minibatch, gen).items():
                    totals.setdefault(k, []).append(v)
        return {k: float(torch.stack(v).float().mean()) for k, v in totals.items()}

    def _optimizer_step(self, batch, gen: torch.Generator) -> dict[str, torch.Tensor]:
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

    def evaluate(self) -> tuple[dict[str, float], object]:
        """Held-out metrics of the current weights (identical for any number of processes) and the samples shown."""
        return self.modality.evaluate(self.reward, self.rank, self.world)

    # -- persistence ----------------------------------------------------------------------------
    def save(self) -> Path | None:
        states = gather_object([self.objective.state_dict()])
        self.accelerator.wait_for_everyone()
        path = None
        if self.is_main:
            weights = self._weights_to_save()
            state = {"iteration": self.iteration, "objective": states}
            path = save_checkpoint(self.run_dir / "checkpoints" / f"step_{self.iteration:06d}", weights, self.optimizer.optimizer,
                                   state, to_yaml(self.config),
                                   extra=self.pipeline.save_lora if self.pipeline.has_lora else None)  # + the LoRA in its library's format
        self.accelerator.wait_for_everyone()
        return path

    def _weights_to_save(self) -> dict[str, torch.Tensor]:
        weights = self.pipeline.trainable_state_dict()  # LoRA runs of image models store the adapter only
        extra = self.objective.extra_module
        if extra is not None:  # e.g. DCoLT's unmasking-policy head
            weights.update({f"objective.{k}": v for k, v in extra.state_dict().items()})
        return weights

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a checkpoint's weights: the model's trained part and the objective's own module."""
        extra = self.objective.extra_module
        if extra is not None:
            extra.load_state_dict({k[len("objective."):]: v for k, v in weights.items() if k.startswith("objective.")})
        self.pipeline.load_trainable_state_dict({k: v for k, v in weights.items() if not k.startswith("objective.")})

    def load(self, spec: str) -> None:
        directory = resolve_checkpoint(spec, self.run_dir)
        weights, optim, state = read_checkpoint(directory)
        try:
            self.load_weights(weights)
            load_optimizer(self.optimizer.optimizer, optim, state["optimizer"])
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
                metrics = self.train_iteration(iteration)  # collect -> score -> advantages -> update
                self.iteration = iteration + 1
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
                self._after_iteration(metrics)  # log -> evaluate -> checkpoint
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

    def _reward_metrics(self, batch) -> dict[str, float]:
        rewards = torch.cat(gather_object([batch.rewards.cpu()]))
        finite = torch.isfinite(rewards)
        metrics = {"reward/mean": float(rewards[finite].mean()) if finite.any() else float("nan"),
                   "reward/std": float(rewards[finite].std(unbiased=False)) if finite.any() else float("nan"),
                   "reward/nonfinite_count": int((~finite).sum())}
        for name, values in batch.reward_components.items():
            metrics[f"reward/{name}"] = nanmean(torch.cat(gather_object([values.cpu()])).tolist())
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
        metrics, shown = self.evaluate()
        metrics["perf/eval_s"] = time.perf_counter() - t0
        if self.is_main:
            self.modality.save_eval_samples(shown, self.run_dir, step, tag)
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
            "samples_per_iteration": self.config.train.prompts_per_iteration * (2 if self.objective.trains_on == "offline_pairs" else self.config.train.num_generations),
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

