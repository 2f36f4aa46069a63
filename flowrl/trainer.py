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

import functools
import math
import os
import shutil
import signal
import sys
import time
import warnings
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, broadcast_object_list, gather_object
from tqdm import tqdm

from . import seeding
from .atomic_files import TEMP_PREFIX, atomic_path, writing
from .config import Config, load_config, resolve_device, set_num_threads, to_yaml
from .errors import FlowRLError, Preempted
from .modalities import build_modality
from .modalities.reward_overlap import RolloutScoring
from .prompts import prompts_for
from .reward_models import build_reward_from_config
from .reward_models.gradients import require_differentiable
from .reward_models.mix import probe_user_rewards, required_metadata, rewards_from_python, user_parts
from .training import deepspeed_zero, fault_injection
from .training.checkpoint import (
    STATE_FILE,
    checkpoint_step,
    find_latest,
    load_optimizer,
    read_checkpoint,
    remove_leftover_temporaries,
    save_checkpoint,
)
from .training.determinism import enable_deterministic_mode
from .training.distributed import choose_blocks_to_wrap, enable_fsdp_on_cpu, full_optimizer_state, full_tensors, is_fsdp, shard_state_dict
from .training.resume_check import check_resume_config
from .training.run_lock import RunLock
from .training.run_logger import RunLogger, json_line, nanmean
from .training.trackers import Trackers
from .types import PAIRED_ROWS
from .visualize import save_instruments, save_reward_curve


def lr_factor(schedule: str, iteration: int, iterations: int, min_fraction: float = 0.0) -> float:
    """The learning rate of 0-based ``iteration`` of ``iterations`` as a fraction of train.learning_rate:
    1 throughout for "constant"; for "linear" and "cosine" 1 at the first iteration and ``min_fraction`` at the last."""
    if schedule == "constant" or iterations <= 1:
        return 1.0
    progress = min(max(iteration / (iterations - 1), 0.0), 1.0)
    shape = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_fraction + (1 - min_fraction) * shape


class Trainer:
    """One loop for every model: a :class:`~flowrl.modalities.Modality` supplies the model-side parts
    (images and video, or masked-diffusion text) and the objective declares what it trains on.

    ``config``: a :class:`Config`, or a preset name (``"digits/grpo"``) or YAML path, with ``overrides``
    (``["train.iterations=5"]``). From Python, parts can be given as objects instead of names:

    - ``reward``: the training reward: a function ``fn(samples, prompts, metadata) -> scores``, a reward object, or a
      mapping ``{name: reward}`` weighted by ``reward_weights`` (default 1 each); it replaces ``config.reward``,
      whose ``components`` then record the names. ``judge``: the same for ``eval.judge``.
    - ``pipeline``: a model already in memory, used instead of loading ``pipeline.pretrained``: a diffusers pipeline
      for image and video families (its components are used, not copied), a transformers model or a
      ``(model, tokenizer)`` pair for diffusion LMs.

    A user's reward is tried on a small batch shaped like the model's samples before any model loads, so one that
    cannot score them is one sentence, not a failure minutes into the run.
    """

    def __init__(
        self,
        config: Config | str | os.PathLike,
        overrides: Sequence[str] = (),
        *,
        reward: Any = None,
        reward_weights: dict[str, float] | None = None,
        judge: Any = None,
        pipeline: Any = None,
    ):
        if not isinstance(config, Config):
            config = load_config(config, overrides)
        elif overrides:
            config = load_config(None, overrides, base=config)
        user_reward = user_judge = None
        if reward is not None:
            user_reward, recorded = rewards_from_python(reward, reward_weights)
            config = config.model_copy(update={"reward": recorded})
        elif reward_weights:
            raise FlowRLError("reward_weights weighs the rewards given as reward={name: fn}; pass them with it.")
        if judge is not None:
            user_judge, recorded = rewards_from_python(judge)
            config = config.model_copy(update={"eval": config.eval.model_copy(update={"judge": recorded})})
        self.config = config
        set_num_threads(config)  # one thread for the embedded models: more only add contention (train.num_threads)
        if config.train.deterministic:  # before any model or CUDA context exists
            enable_deterministic_mode()
        self.trackers = Trackers(config, Path(config.output_dir))  # a tracker's missing package is refused before anything is written
        self.accelerator = _accelerator(config, self.trackers.log_with())
        enable_fsdp_on_cpu(self.accelerator)  # an FSDP launch of CPU processes shards as it would on GPUs
        self.deepspeed = deepspeed_zero.is_deepspeed(self.accelerator)
        if self.deepspeed:
            deepspeed_zero.load_models_whole()  # before any model is loaded: only the trained module is partitioned, at prepare
        self.is_main = self.accelerator.is_main_process
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        self._check_divisibility()
        self.run_dir = Path(config.output_dir)
        self.reward = user_reward if user_reward is not None else build_reward_from_config(config.reward)
        self.judge = (
            user_judge
            if user_judge is not None
            else (build_reward_from_config(config.eval.judge) if config.eval.judge is not None else None)
        )  # never trained on
        self._probe_user_rewards()  # before any model loads
        seeding.seed_initialisation(config.seed)  # before anything is initialised at random (LoRA, DCoLT's head)
        self.modality = build_modality(config, self.accelerator.device, loaded=pipeline)
        self.pipeline, self.sampler, self.objective = self.modality.pipeline, self.modality.sampler, self.modality.objective
        self.modality.check()
        self._check_reward_can_score()
        if self.objective.trains_on == "reward_gradient_rollouts":  # refused before anything runs or is written
            require_differentiable(self.reward, self.objective.name)
        if self.objective.reference == "initial":
            self.pipeline.enable_reference()
        groups = self._parameter_groups()
        self._base_lrs = [g.get("lr", config.train.learning_rate) for g in groups]  # from the config, so a resume with a new rate takes it
        optimizer = torch.optim.AdamW(
            groups,
            lr=config.train.learning_rate,
            betas=(config.train.adam_beta1, config.train.adam_beta2),
            weight_decay=config.train.weight_decay,
        )
        if is_fsdp(self.accelerator):  # the family's blocks become FSDP units (flowrl/training/distributed.py)
            choose_blocks_to_wrap(self.accelerator, self.module)
        if getattr(self.module, "may_leave_parameters_unused", False) and self.accelerator.ddp_handler is None:
            # a module that routes each call to part of its weights (Wan2.2's two experts): DDP must find the
            # parameters that got no gradient rather than wait for them (their gradient then stays None)
            self.accelerator.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=True)
        if self.deepspeed:  # micro batch, accumulation boundary and clipping are flowrl's (flowrl/training/deepspeed_zero.py)
            deepspeed_zero.configure(self.accelerator, config.train.batch_size, config.train.max_grad_norm)
        prepared, self.optimizer = self.accelerator.prepare(self.module, optimizer)
        setattr(self.pipeline, self.modality.module_attr, prepared)
        self.iteration = 0
        self.logger = RunLogger(self.run_dir, enabled=self.is_main, trackers=self.trackers)
        self._stop_requested: str | bool = False  # "SIGINT" or "SIGTERM" once asked to stop
        self._run_lock = RunLock(self.run_dir)
        self._updating = False  # True while the optimizer may have changed the weights of an unfinished iteration
        self._saving = False  # True while a checkpoint is being written
        self._logged = 0  # the last iteration whose metrics line (with its evaluation) is written; a later one is not saved
        # (iteration, non-finite, all) of the last train.nonfinite_window iterations' rewards; saved in each checkpoint
        self._nonfinite: deque[tuple[int, int, int]] = deque(maxlen=config.train.nonfinite_window)
        self._last_eval_spec: tuple[int, dict[str, Any]] | None = None  # (step, spec) of the last evaluation, main process

    def _probe_user_rewards(self) -> None:
        """A user's reward (an import path, an entry point, an object passed in) scores two samples shaped like the
        model's, with the first training prompts, before the model loads (reward_models/mix.py)."""
        rewards = [self.reward] + ([self.judge] if self.judge is not None else [])
        if not any(user_parts(r) for r in rewards):
            return
        pool = (prompts_for(self.config.prompts, "train")[:2] * 2)[:2]
        probe_user_rewards(rewards, self.config.pipeline.probe_samples(len(pool)), [p for p, _ in pool], [m for _, m in pool])

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

    def _check_reward_can_score(self) -> None:
        """Refuse, before anything runs, a reward that cannot score the configured prompts: a reward declares the
        metadata it needs (``required_metadata``, e.g. the digit classifier's "digit"), and a prompt without it
        would score NaN in every iteration. Components weighted 0 are only watched, so they are not checked."""
        needs = sorted(required_metadata(self.reward))
        if not needs:
            return
        from .evaluation.held_out import eval_pool

        pc = self.config.prompts
        pools = [("held-out prompt", eval_pool(self.config), pc.eval_file if pc.dataset in ("file", "hf") else None)]
        if self.objective.trains_on not in PAIRED_ROWS:  # offline pairs carry their own prompts and labels
            pools.insert(0, ("training prompt", self.modality.train_pool, pc.train_file if pc.dataset in ("file", "hf") else None))
        winners = getattr(self.modality, "winners", None)
        if winners is not None:  # SePPO's winners: their prompts are scored (and logged) like the reference samples'
            source = self.config.objective.winners
            pools.insert(0, ("winner", list(zip(winners.prompts, winners.metadata)), None if source == "embedded" else source))
        pairs = getattr(self.modality, "pairs", None)
        if pairs is not None:  # offline preference pairs: their samples are scored with their own prompts' metadata
            pools.insert(0, ("pair", list(zip(pairs.prompts, pairs.metadata)), pc.pairs))
        for what, pool, file in pools:
            for i, (prompt, metadata) in enumerate(pool):
                for reward_name, key in needs:
                    if metadata.get(key) is None:
                        where = f" of '{file}'" if file else ""
                        raise FlowRLError(
                            f"reward '{reward_name}' needs '{key}' in every prompt's metadata, but {what} {i + 1}{where} "
                            f"({prompt[:60]!r}) has none, so it would score NaN and never train; give the prompts a "
                            f"'{key}' (a .jsonl prompt file) or choose another reward."
                        )

    def _check_divisibility(self) -> None:
        if self.config.train.prompts_per_iteration % self.world:
            raise FlowRLError(
                f"train.prompts_per_iteration ({self.config.train.prompts_per_iteration}) must be divisible by the number of processes ({self.world})."
            )

    # -- one training iteration, phase by phase ---------------------------------------------------
    def train_iteration(self, iteration: int) -> dict[str, float]:
        """collect -> score -> advantages -> update; logging, evaluation and checkpoints follow in fit()."""
        lr = self.config.train.learning_rate * self._set_learning_rate(iteration)
        # each finished rollout chunk is handed over here: decoded, and with rollout.overlap_reward also scored on a
        # worker thread while the next chunk is generated (modalities/reward_overlap.py)
        scoring = RolloutScoring(self.reward, self.config.rollout.overlap_reward)
        try:
            t0 = time.perf_counter()
            fault_injection.reached("collect", iteration + 1)
            batch = self.collect(iteration, scoring)
            t1 = time.perf_counter()
            fault_injection.reached("score", iteration + 1)
            batch = self.score(batch, scoring)
        finally:
            scoring.close()  # after a failure or a stop mid-rollout: the chunks not started are dropped
        reward_metrics = self._reward_metrics(batch, iteration)  # of everything collected, before prepare() reorders or subsets
        self._check_learnable(iteration)  # before the update: a batch with nothing to learn from never reaches the optimizer
        t2 = time.perf_counter()
        fault_injection.reached("advantages", iteration + 1)
        batch = self.advantages(batch)
        self._updating = True
        fault_injection.reached("update", iteration + 1)
        metrics = self.update(batch, iteration)
        self._updating = False
        t3 = time.perf_counter()
        return {
            **metrics,
            **reward_metrics,
            "train/learning_rate": lr,
            "perf/rollout_s": t1 - t0,
            "perf/score_s": t2 - t1,
            "perf/update_s": t3 - t2,
            "perf/reward_wait_s": t2 - t1,  # the loop blocked on the reward: all of it when serial
            "perf/reward_hidden_s": 0.0,
            **scoring.perf(),  # decode_s; when overlapped the reward's own score_s and the part of it hidden
        }

    def _set_learning_rate(self, iteration: int) -> float:
        """Every parameter group at its base rate times ``lr_factor`` of this iteration; returns the factor."""
        tc = self.config.train
        factor = lr_factor(tc.lr_schedule, iteration, tc.iterations, tc.lr_min_fraction)
        for group, base in zip(self.optimizer.param_groups, self._base_lrs):
            group["lr"] = base * factor
        return factor

    def collect(self, iteration: int, scoring: RolloutScoring | None = None):
        """This process's batch for ``iteration``: what the objective trains on (rollouts or offline pairs).
        ``scoring``: where the rollout chunks are decoded (and, overlapped, scored); ``score`` then takes the same one."""
        return self.modality.collect(iteration, self.rank, self.world, scoring)

    def score(self, batch, scoring: RolloutScoring | None = None):
        """Attach rewards (and, for objectives that train on reward gradients, their gradients); non-finite
        rewards stay NaN and are left out of the update (and counted). A reward that fails for good (a
        server that stayed down) raises; fit() then stops the run with the last completed iteration on disk.
        With an overlapped ``scoring`` the rewards were computed during collect and are joined here."""
        with_gradient = self.objective.trains_on == "reward_gradient_rollouts"
        out, grads = self.modality.score(batch, self.reward, with_gradient, scoring)
        scores = out.scores.float()  # on the reward's device: the samples' for images, the CPU for text
        bad = ~torch.isfinite(scores)
        if bad.any():
            warnings.warn(
                f"{int(bad.sum())} of {len(scores)} rewards were NaN or infinite; those samples are left out of the update.", stacklevel=2
            )
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
        means = {k: float(torch.stack(v).float().mean()) for k, v in totals.items()}
        if self.world > 1:  # the run's metrics, not the main process's share: each key averaged over the processes that have it
            shares = gather_object([means])
            means = {
                k: sum(m[k] for m in shares if k in m) / sum(k in m for m in shares) for k in dict.fromkeys(k for m in shares for k in m)
            }
        return means

    def _optimizer_step(self, batch, gen: torch.Generator) -> dict[str, torch.Tensor]:
        if self.deepspeed:
            return self._deepspeed_step(batch, gen)
        self.optimizer.zero_grad(set_to_none=True)
        per_step: dict[str, list[torch.Tensor]] = {}
        for loss_out in self.objective.losses(self.pipeline, self.sampler, batch, gen):
            if loss_out.loss.requires_grad:  # else no trained weight shaped it (a frozen Wan2.2 expert's step): nothing to do
                self.accelerator.backward(loss_out.loss)
            for k, v in loss_out.metrics.items():
                per_step.setdefault(k, []).append(v)
        metrics = {k: torch.stack(v).mean() for k, v in per_step.items()}
        self._average_objective_gradients()
        if self.config.train.max_grad_norm is not None:
            norm = self.accelerator.clip_grad_norm_(self.trainable_parameters(), self.config.train.max_grad_norm)
            metrics["train/grad_norm"] = torch.as_tensor(norm).detach()
        self.optimizer.step()
        return metrics

    def _average_objective_gradients(self) -> None:
        """An objective's own module (DCoLT's unmasking-policy head) lives outside the module accelerate wrapped, so
        DDP does not average its gradients: average them here, or every process's copy of it would drift apart."""
        params = [p for p in self._objective_parameters() if p.requires_grad]
        if self.world == 1 or not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]  # a process may not have reached it
        flat = self.accelerator.reduce(torch.cat([g.flatten() for g in grads]), reduction="mean")
        for p, g in zip(params, torch.split(flat, [g.numel() for g in grads])):
            p.grad = g.view_as(p).clone()

    def _deepspeed_step(self, batch, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """The same minibatch step driven through DeepSpeed's engine: every loss back-propagated, the accumulation
        boundary on the last, one engine step (which clips to train.max_grad_norm and zeroes the gradients)."""
        per_step: dict[str, list[torch.Tensor]] = {}

        def record(loss_out) -> None:
            for k, v in loss_out.metrics.items():
                per_step.setdefault(k, []).append(v)

        deepspeed_zero.backward_minibatch(self.module, self.objective.losses(self.pipeline, self.sampler, batch, gen), record)
        metrics = {k: torch.stack(v).mean() for k, v in per_step.items()}
        norm = deepspeed_zero.grad_norm(self.module)
        if self.config.train.max_grad_norm is not None and norm is not None:
            metrics["train/grad_norm"] = norm
        return metrics

    def evaluate(self, return_samples: bool = False) -> dict[str, float] | tuple[dict[str, float], Any]:
        """Held-out metrics of the current weights (identical for any number of processes); with ``return_samples``
        also the samples shown in the run directory's grids (images / videos, or text rows)."""
        metrics, shown = self.modality.evaluate(self.reward, self.rank, self.world, judge=self.judge)
        if self.judge is None:  # no judge configured: the held-out reward stands in for it, and says so
            metrics["eval/judge/mean"], metrics["eval/judge/is_eval_reward"] = metrics["eval/reward/mean"], 1.0
        return (metrics, shown) if return_samples else metrics

    def eval_spec(self, metrics: dict[str, float], shown: Any, checkpoint: Path | None) -> dict[str, Any]:
        """The evaluation spec (flowrl/evaluation/spec.py) of ``evaluate``'s ``metrics`` for the current weights
        (``checkpoint``: where they are saved, if they are). Under FSDP or DeepSpeed the weights are sharded across
        processes and their hash is left out (None)."""
        from .evaluation.spec import build_spec, weights_sha256

        text = self.config.pipeline.modality == "text"
        extra = self.objective.extra_module
        modules = [("", self.accelerator.unwrap_model(self.module)), *([("objective.", extra)] if extra is not None else [])]
        sharded = is_fsdp(self.accelerator) or self.deepspeed
        if text:
            items = self.modality.eval_pool
            prompts, metadata = [p for p, _ in items], [m for _, m in items]
            sampler = {"name": "masked", **self.config.sampler.model_dump(mode="json")}
        else:
            prompts, metadata = self.modality.held_out.prompts, self.modality.held_out.metadata
            sampler = {"name": self.modality.eval_sampler.name}
        return build_spec(
            self.config,
            method={"name": "plain"},
            checkpoint=checkpoint,
            weights=None if sharded else weights_sha256(modules),
            sampler=sampler,
            prompts=list(prompts),
            metadata=list(metadata),
            reward=self.reward,
            judge=self.judge,
            result={k: v for k, v in metrics.items() if not k.startswith("perf/")},
            sample_shape=None if text else tuple(shown.shape[1:]),
        )

    def sample(self, prompts: str | Sequence[str], num_samples: int = 1, seed: int = 0, **options: Any) -> Any:
        """Samples of the current weights: ``num_samples`` per prompt, prompt-major. Images and videos come back as a
        float tensor in [0, 1] (deterministic sampler unless ``sampler="rollout"``; ``num_inference_steps``,
        ``guidance_scale`` and ``metadata`` as options); a diffusion LM's as completion strings (``temperature``,
        default the evaluation's)."""
        return self.modality.sample([prompts] if isinstance(prompts, str) else list(prompts), num_samples, seed, **options)

    def train(self) -> dict[str, Any]:
        """Run the training loop (``fit``): what ``flowrl train`` does; returns the summary written to summary.json."""
        return self.fit()

    # -- persistence ----------------------------------------------------------------------------
    def save(self) -> Path | None:
        fault_injection.reached("checkpoint", self.iteration)
        states = gather_object([self.objective.state_dict()])
        self.accelerator.wait_for_everyone()
        path = None
        self._saving = True
        target = self.run_dir / "checkpoints" / f"step_{self.iteration:06d}"
        sharded = is_fsdp(self.accelerator)  # every process gathers its shards; the main one writes full tensors
        gathered = (
            (full_tensors(self._weights_to_save(), self.is_main), full_optimizer_state(self.optimizer.optimizer, self.is_main))
            if sharded
            else None
        )
        if self.deepspeed:  # every process writes its partition of the engine's state; the main one the full weights
            staging = target.parent / f"{TEMP_PREFIX}{target.name}.deepspeed"
            if self.is_main and staging.exists():
                shutil.rmtree(staging)  # left by a run killed while saving
            self.accelerator.wait_for_everyone()
            deepspeed_zero.save_engine_state(self.module, staging)
            gathered = (deepspeed_zero.full_weights(self.module, self._weights_to_save, self.is_main), self._deepspeed_optimizer_groups())
            self.accelerator.wait_for_everyone()
        if self.is_main:
            weights, optimizer = gathered or (self._weights_to_save(), self.optimizer.optimizer)
            lora = functools.partial(self.pipeline.save_lora, state_dict=weights) if gathered else self.pipeline.save_lora
            state = {
                "iteration": self.iteration,
                "objective": states,
                # the non-finite-reward window of the iterations this checkpoint holds (not of one that failed after them),
                # so a resumed run stops where the uninterrupted one would
                "nonfinite_window": [list(entry) for entry in self._nonfinite if entry[0] < self.iteration],
                **({"deepspeed_zero_stage": deepspeed_zero.zero_stage(self.module)} if self.deepspeed else {}),
            }

            def extra(tmp: Path) -> None:
                if self.pipeline.has_lora:  # + the LoRA in its library's format
                    lora(tmp)
                if self.deepspeed:
                    deepspeed_zero.move_into(staging, tmp)

            path = save_checkpoint(target, weights, optimizer, state, to_yaml(self.config), extra=extra)
        self._saving = False
        self.accelerator.wait_for_everyone()
        return path

    def _deepspeed_optimizer_groups(self) -> dict:
        """A DeepSpeed checkpoint's optimizer.safetensors holds no moments (they are in its deepspeed/ partitions):
        only AdamW's hyperparameters per group, for a person reading the state file."""
        return {"state": {}, "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]}

    def _weights_to_save(self) -> dict[str, torch.Tensor]:
        weights = self.pipeline.trainable_state_dict()  # LoRA runs of image models store the adapter only
        extra = self.objective.extra_module
        if extra is not None:  # e.g. DCoLT's unmasking-policy head
            weights.update({f"objective.{k}": v for k, v in extra.state_dict().items()})
        return weights

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a checkpoint's weights: the model's trained part and the objective's own module."""
        self._load_objective_module(weights)
        if is_fsdp(self.accelerator):  # the checkpoint's full tensors, split into this process's shards
            weights = shard_state_dict(self.module.state_dict(), weights)
        self.pipeline.load_trainable_state_dict({k: v for k, v in weights.items() if not k.startswith("objective.")})

    def _load_objective_module(self, weights: dict[str, torch.Tensor]) -> None:
        extra = self.objective.extra_module
        if extra is not None:
            extra.load_state_dict({k[len("objective.") :]: v for k, v in weights.items() if k.startswith("objective.")})

    def load(self, spec: str) -> None:
        if spec == "latest":  # the newest checkpoint that verifies, said out loud
            directory, notice = find_latest(self.run_dir)
            if self.is_main:
                print(f"flowrl: {notice}", file=sys.stderr, flush=True)
            weights, optim, state = read_checkpoint(directory, verify=False)  # find_latest verified every file
        else:
            directory = Path(spec)
            weights, optim, state = read_checkpoint(directory)
        written_by_deepspeed = "deepspeed_zero_stage" in state
        if written_by_deepspeed and not self.deepspeed:
            raise FlowRLError(
                f"checkpoint '{directory}' was written by a DeepSpeed run, whose AdamW state lies in its partitioned deepspeed/ "
                "files; resume it under the same DeepSpeed launch (flowrl export reads its weights under any launch)."
            )
        check_resume_config(self.config, directory, spec)  # after the launch check: no resume_allow mends that one
        try:
            if self.deepspeed:  # weights, fp32 master copies and AdamW moments from the engine's own checkpoint
                self._load_objective_module(weights)
                deepspeed_zero.load_engine_state(self.module, directory)
            else:
                self.load_weights(weights)
                load_optimizer(self.optimizer.optimizer, optim, state["optimizer"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise FlowRLError(f"checkpoint '{directory}' does not match this model ({str(e).splitlines()[0][:160]}).") from None
        objective_states = state.get("objective", [])
        if len(objective_states) != self.world:
            raise FlowRLError(f"checkpoint '{directory}' was written by {len(objective_states)} process(es) but this run has {self.world}.")
        self.objective.load_state_dict(objective_states[self.rank])
        self.iteration = self._logged = int(state["iteration"])
        self._nonfinite.clear()  # a checkpoint written before the window was saved: it starts afresh
        self._nonfinite.extend(tuple(int(x) for x in entry) for entry in state.get("nonfinite_window", []))

    # -- the loop ---------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train ``train.iterations`` iterations (or what is left of them after ``resume_from``): the output directory
        is locked for the whole run (flowrl/training/run_lock.py), and a run ends with summary.json whatever ends it."""
        self._take_output_dir()
        try:
            return self._fit()
        finally:
            if self.is_main:
                self._run_lock.release()

    def _take_output_dir(self) -> None:
        """The output directory's lock, taken by the main process and agreed by all: a refusal is every process's."""
        problem = None
        if self.is_main:
            try:
                self._run_lock.acquire()
                self._remove_leftover_temporaries()
            except FlowRLError as e:
                self._run_lock.release()
                problem = str(e)
        if self.world > 1:
            problem = broadcast_object_list([problem])[0]
        if problem:
            raise FlowRLError(problem)

    def _remove_leftover_temporaries(self) -> None:
        """A run killed mid-write (kill -9, the OOM killer) leaves its temporary names behind (a hidden half-written
        checkpoint can be gigabytes): the next run removes them, and says so, once it holds the lock, which no live
        run then holds. Where the file system cannot lock, another run may be writing them: they are left."""
        if not self._run_lock.held:
            return
        removed = remove_leftover_temporaries(self.run_dir)
        if removed:
            shown = ", ".join(p.as_posix() for p in removed[:3]) + (f" and {len(removed) - 3} more" if len(removed) > 3 else "")
            print(
                f"flowrl: removed {len(removed)} temporary file(s) left in '{self.run_dir}' by a write that a killed run "
                f"did not finish: {shown}.",
                file=sys.stderr,
                flush=True,
            )

    def _fit(self) -> dict[str, Any]:
        cfg = self.config
        resume = cfg.resume_from
        if resume == "latest" and not self._has_checkpoint():
            if self.is_main:  # e.g. killed while writing its first checkpoint: there is nothing to resume
                print(f"flowrl: output_dir '{self.run_dir}' holds no complete checkpoint, so the run starts afresh there.", file=sys.stderr)
            resume = None
        if resume:  # before anything is written: a bad checkpoint must leave no files behind
            self.load(resume)
            self.logger.truncate_after(self.iteration)
        else:
            self._claim_output_dir()
        if self.is_main:
            self._write_config()
        self.trackers.start(self.accelerator, self.config.model_dump(mode="json"))  # the resolved config, as config.yaml holds it
        if self.iteration == 0:
            self._evaluate_and_log(0, tag="before")
        previous = self._catch_stop_signals()
        started, first = time.time(), self.iteration
        bar = tqdm(
            range(self.iteration, cfg.train.iterations),
            initial=self.iteration,
            total=cfg.train.iterations,
            desc="flowrl train",
            disable=not (self.is_main and cfg.log.progress),
            dynamic_ncols=True,
        )
        status, reason = "completed", None
        try:
            for iteration in bar:
                metrics = self.train_iteration(iteration)  # collect -> score -> advantages -> update
                self.iteration = iteration + 1
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
                if self._after_iteration(metrics):  # log -> evaluate -> checkpoint; True: stop here
                    if self._stop_requested == "SIGTERM":
                        status = "preempted"
                        reason = f"stopped by SIGTERM (preemption) after iteration {self.iteration}; resume with resume_from=latest."
                    else:
                        status, reason = "interrupted", f"stopped by Ctrl-C after iteration {self.iteration}."
                    break
                if cfg.train.stop_after and self.iteration - first >= cfg.train.stop_after:
                    status, reason = "stopped", f"train.stop_after={cfg.train.stop_after} iterations were done."
                    break
        except FlowRLError as e:
            # Any failure of an iteration (a reward that cannot learn or stayed down, a full disk): keep what was
            # trained, say so in summary.json, and end with one sentence.
            message = f"{str(e).rstrip('.')}; {self._save_after_failure()}."
            self._finish(time.time() - started, "failed", message, quiet=True)
            raise FlowRLError(message) from None
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            bar.close()
        if self.iteration >= cfg.train.iterations:  # a stop requested during the last iteration stopped nothing
            status, reason = "completed", None
        return self._finish(time.time() - started, status, reason)

    def _write_config(self) -> None:
        """The resolved config, first thing in the run directory; a directory this created is removed again
        when the write fails, so an unwritable or full disk leaves nothing behind. A resumed run that changed the
        config keeps the earlier one as config_history/step_<N>.yaml (the config the run had up to step N)."""
        created = [d for d in [self.run_dir, *self.run_dir.parents] if not d.exists()]  # innermost first
        path, text = self.run_dir / "config.yaml", to_yaml(self.config)
        try:
            if self.config.resume_from and path.is_file() and path.read_text() != text:
                with atomic_path(self.run_dir / "config_history" / f"step_{self.iteration:06d}.yaml") as tmp:
                    tmp.write_text(path.read_text())
            with atomic_path(path) as tmp:
                tmp.write_text(text)
        except FlowRLError:
            for d in created:
                try:
                    d.rmdir()
                except OSError:
                    break
            raise

    def _has_checkpoint(self) -> bool:
        """Whether the output directory holds a checkpoint (valid or not: a corrupt one is named by find_latest)."""
        return any(checkpoint_step(p) is not None for p in (self.run_dir / "checkpoints").glob("step_*"))

    def _claim_output_dir(self) -> None:
        """A fresh run never mixes its metrics or checkpoints with an earlier run's. An earlier run that saved no
        checkpoint (killed before or while writing its first) has nothing to resume: it is replaced, and said so."""
        previous = [p for p in ("metrics.jsonl", "checkpoints") if (self.run_dir / p).exists()]
        if not previous:
            return
        if not self._has_checkpoint() and not self.config.overwrite:
            if self.is_main:
                print(f"flowrl: output_dir '{self.run_dir}' holds a run that saved no checkpoint; it is replaced.", file=sys.stderr)
        elif not self.config.overwrite:
            raise FlowRLError(
                f"output_dir '{self.run_dir}' already holds a run; continue it with resume_from=latest, "
                "choose another output_dir, or set overwrite=true to replace it."
            )
        self.accelerator.wait_for_everyone()
        if self.is_main:
            import shutil

            with writing(self.run_dir):
                for name in ("metrics.jsonl", "summary.json", "reward_curve.png", "instruments.png"):
                    (self.run_dir / name).unlink(missing_ok=True)
                for name in ("checkpoints", "samples", "tensorboard"):
                    if (self.run_dir / name).exists():
                        shutil.rmtree(self.run_dir / name)
        self.accelerator.wait_for_everyone()

    def _reward_metrics(self, batch, iteration: int) -> dict[str, float]:
        rewards = torch.cat(gather_object([batch.rewards.cpu()]))
        finite = torch.isfinite(rewards)
        self._nonfinite.append((iteration, int((~finite).sum()), len(rewards)))  # every process sees the same gathered counts
        metrics = {
            "reward/mean": float(rewards[finite].mean()) if finite.any() else float("nan"),
            "reward/std": float(rewards[finite].std(unbiased=False)) if finite.any() else float("nan"),
            "reward/nonfinite_count": int((~finite).sum()),
        }
        for name, values in batch.reward_components.items():
            metrics[f"reward/{name}"] = nanmean(torch.cat(gather_object([values.cpu()])).tolist())
        return metrics

    def _check_learnable(self, iteration: int) -> None:
        """Stop a run that cannot learn instead of training on nothing: every reward of this iteration non-finite,
        or more than train.max_nonfinite_fraction of the last train.nonfinite_window iterations' rewards. Offline
        pairs are labelled already (their rewards are only logged), so they are exempt."""
        if (
            self.objective.trains_on in PAIRED_ROWS or not self._nonfinite
        ):  # pairs are labelled already, or (SePPO) the reward is only logged
            return
        tc = self.config.train
        _, bad, total = self._nonfinite[-1]
        if total and bad == total:
            raise FlowRLError(
                f"all {total} rewards of iteration {iteration + 1} were NaN or infinite (reward components: "
                f"{', '.join(self.config.reward.components)}), so the run cannot learn"
            )
        if len(self._nonfinite) == tc.nonfinite_window:
            _, bad, total = (sum(x) for x in zip(*self._nonfinite))
            if total and bad / total > tc.max_nonfinite_fraction:
                raise FlowRLError(
                    f"{bad} of {total} rewards of the last {tc.nonfinite_window} iterations were NaN or infinite, more than "
                    f"train.max_nonfinite_fraction={tc.max_nonfinite_fraction:g}, so the run is not learning"
                )

    def _after_iteration(self, metrics: dict[str, float]) -> bool:
        """Returns whether the run stops after this iteration (Ctrl-C). The flag is read once: a Ctrl-C that
        arrives while this iteration is being logged or saved stops the run after the next one, so the
        stopped weights are always evaluated and saved together."""
        cfg, it = self.config, self.iteration
        stopping = self._agreed_stop()
        last = it == cfg.train.iterations
        # After Ctrl-C the stopped weights are evaluated too, so summary.json's final reward is theirs; after SIGTERM
        # (a preemption, with a deadline) they are only saved.
        evaluate = ((cfg.eval.every and it % cfg.eval.every == 0) or last or stopping) and stopping != "SIGTERM"
        if evaluate:
            metrics.update(self._evaluate_and_log(it, tag="after" if last or stopping else None, log=False))
        fault_injection.reached("log", it)
        self.logger.log(it, metrics)
        self._logged = it
        if (cfg.log.checkpoint_every and it % cfg.log.checkpoint_every == 0) or last or stopping:
            self.save()
        if self.is_main and evaluate:
            fault_injection.reached("plots", it)
            records = self.logger.records()
            save_reward_curve(records, self.run_dir / "reward_curve.png", title=f"{cfg.objective.name} on {cfg.pipeline.pretrained}")
            fault_injection.reached("plots:instruments.png", it)
            save_instruments(records, self.run_dir / "instruments.png", title=f"{cfg.objective.name} on {cfg.pipeline.pretrained}")
        return bool(stopping)

    def _agreed_stop(self) -> str | bool:
        """This iteration's stop request, the same on every process (each got its own signal, maybe not at once)."""
        if self.world == 1:
            return self._stop_requested
        requests = [r for r in gather_object([self._stop_requested]) if r]
        return "SIGTERM" if "SIGTERM" in requests else (requests[0] if requests else False)

    def _evaluate_and_log(self, step: int, tag: str | None, log: bool = True) -> dict[str, float]:
        fault_injection.reached("evaluate", step)
        t0 = time.perf_counter()
        metrics, shown = self.evaluate(return_samples=True)
        if self.is_main:  # summary.json records the last one, with the checkpoint that holds its weights (_finish)
            self._last_eval_spec = (step, self.eval_spec(metrics, shown, None))
        metrics["perf/eval_s"] = time.perf_counter() - t0
        if self.is_main:
            self.modality.save_eval_samples(shown, self.run_dir, step, tag)
            self.trackers.log_samples(step)
        if log:
            self.logger.log(step, metrics)
        return metrics

    def _finish(self, seconds: float, status: str = "completed", reason: str | None = None, quiet: bool = False) -> dict[str, Any]:
        """Write summary.json: what was done and, when the run did not complete, why (``status``: completed,
        interrupted, stopped or failed; ``reason``: the sentence). ``quiet``: on the failure path, where a
        second error (a full disk) must not hide the first."""
        records = self.logger.records() if self.is_main else []
        evals = [r for r in records if r.get("eval/reward/mean") is not None]
        summary = {
            "status": status,
            "reason": reason,
            "iterations_completed": self.iteration,
            "iterations_planned": self.config.train.iterations,
            "eval_reward_initial": evals[0]["eval/reward/mean"] if evals else None,
            "eval_reward_final": evals[-1]["eval/reward/mean"] if evals else None,
            "eval_reward_final_step": evals[-1]["step"] if evals else None,  # the weights the final reward measured
            "samples_per_iteration": self.config.train.prompts_per_iteration
            * (2 if self.objective.trains_on in PAIRED_ROWS else self.config.train.num_generations),
            "wall_seconds_this_process": round(seconds, 1),
            "stopped_early": self.iteration < self.config.train.iterations,
            "eval_spec": self._final_eval_spec(),
        }
        fault_injection.reached("finish")
        try:  # summary.json is the run's last write: a summary that says completed had every other write done
            self.logger.close()  # the trackers' last flush
            if self.is_main and (self.run_dir / "config.yaml").is_file():
                save_reward_curve(
                    records, self.run_dir / "reward_curve.png", title=f"{self.config.objective.name} on {self.config.pipeline.pretrained}"
                )
        except FlowRLError:
            if not quiet:
                raise
        fault_injection.reached("finish:summary.json")
        try:
            if self.is_main and (self.run_dir / "config.yaml").is_file():
                with atomic_path(self.run_dir / "summary.json") as tmp:
                    tmp.write_text(json_line(summary, indent=2) + "\n")
        except FlowRLError:
            if not quiet:  # on the failure path the first error is the one to say
                raise
        if not quiet:
            self.accelerator.wait_for_everyone()
        return summary

    def _final_eval_spec(self) -> dict[str, Any] | None:
        """The spec of the last evaluation this process ran, naming the checkpoint of its step (``flowrl eval --spec
        summary.json`` re-runs it); the starting model's (step 0) needs none."""
        if self._last_eval_spec is None:
            return None
        step, spec = self._last_eval_spec
        spec = {**spec, "model": dict(spec["model"])}
        if step > 0:
            ckpt = self.run_dir / "checkpoints" / f"step_{step:06d}"
            saved = (ckpt / STATE_FILE).is_file()
            spec["model"]["checkpoint"] = str(ckpt.resolve()) if saved else None
            if not saved:
                spec["model"]["trained_weights_unsaved"] = True
        return spec

    def _save_after_failure(self) -> str:
        """Make sure the last completed iteration is on disk and say where. Weights changed by an unfinished
        update are not saved (they belong to no iteration). Every process must fail alike: saving is collective."""
        if self.iteration == 0:
            return "no iteration had completed, so there is nothing to resume"
        directory = self.run_dir / "checkpoints" / f"step_{self.iteration:06d}"
        if not directory.is_dir():
            # the checkpoint write itself failed, the weights are half-updated, or the iteration's evaluation or metrics
            # line is missing (a resume from it would never write them: it is trained again instead)
            if self._saving or self._updating or self._logged < self.iteration:
                earlier = sorted(p.name for p in (self.run_dir / "checkpoints").glob("step_*") if p.is_dir())
                resume = f"resume_from=latest continues from {earlier[-1]}" if earlier else "there is no checkpoint to resume from"
                what = (
                    "could not be saved"
                    if self._saving
                    else "was not saved (the failure came during the next update)"
                    if self._updating
                    else "was not saved (the failure came before its metrics were logged)"
                )
                return f"iteration {self.iteration} {what}, so {resume}"
            try:
                self.save()
            except FlowRLError as e:
                return f"iteration {self.iteration} could not be saved either ({str(e).rstrip('.')})"
        return f"the run stopped with iteration {self.iteration} saved in {directory} (resume with resume_from=latest)"

    def _catch_stop_signals(self) -> dict[int, Any]:
        """Ctrl-C and SIGTERM (what SLURM and Kubernetes send before they kill) finish the iteration and save; the
        handlers they replace, to put back. Off the main thread (a notebook's worker) Python allows no handler."""
        previous = {}
        for signum, handler in ((signal.SIGINT, self._request_stop), (signal.SIGTERM, self._request_preemption)):
            try:
                previous[signum] = signal.signal(signum, handler)
            except ValueError:
                pass
        return previous

    def _request_preemption(self, signum, frame) -> None:
        if self._stop_requested == "SIGTERM":  # a second SIGTERM: the deadline is closer than an iteration
            raise Preempted
        self._stop_requested = "SIGTERM"
        tqdm.write("flowrl: SIGTERM: stopping after this iteration and saving a checkpoint (a second SIGTERM stops at once).")

    def _request_stop(self, signum, frame) -> None:
        if self._stop_requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self._stop_requested = "SIGINT"
        tqdm.write("flowrl: stopping after this iteration, evaluating and saving a checkpoint (Ctrl-C again to abort now).")


def _settle_single_process_state(mixed_precision: str, device: torch.device | None) -> None:
    """accelerate keeps one state per process and refuses an Accelerator with other settings than the first one's. In
    a single process (a notebook or a script building several Trainers, the test suite) an earlier Trainer's precision
    or device must not bind a later one: when they differ, the state starts afresh (one process: no group to keep)."""
    from accelerate.state import AcceleratorState, PartialState

    if not PartialState._shared_state:
        return
    current = PartialState().device
    wanted = device if device is not None else (torch.device("cuda") if torch.cuda.is_available() else current)  # auto: accelerate's pick
    if wanted.type == "cuda" and wanted.index is None:
        wanted = torch.device("cuda", torch.cuda.current_device())
    precision = AcceleratorState._shared_state.get("_mixed_precision", mixed_precision)
    if (current.type, current.index or 0) != (wanted.type, wanted.index or 0) or precision != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=True)


def _accelerator(config: Config, log_with: list | None = None) -> Accelerator:
    """accelerate puts a single process on its default device (a GPU when there is one, whatever was asked);
    pipeline.device is honoured exactly, or refused in one sentence when this machine lacks that device."""
    spec = config.pipeline.device
    device = resolve_device(spec)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device is not None and device.type == "cuda" and device.index is not None and world > 1:
        raise FlowRLError(
            f"pipeline.device is '{spec}', one GPU, but {world} processes run; use pipeline.device=cuda "
            "(each process takes its own GPU) or auto."
        )
    if world == 1:
        _settle_single_process_state(config.train.mixed_precision, device)
    if world == 1 and device is not None and device.type != "cpu":
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        before = os.environ.get("ACCELERATE_TORCH_DEVICE")
        os.environ["ACCELERATE_TORCH_DEVICE"] = str(device)  # read by accelerate when it first sets up its state
        try:
            accelerator = Accelerator(mixed_precision=config.train.mixed_precision, log_with=log_with)
        finally:
            if before is None:
                os.environ.pop("ACCELERATE_TORCH_DEVICE", None)
            else:
                os.environ["ACCELERATE_TORCH_DEVICE"] = before
    else:
        # a DeepSpeed launch on a machine without a GPU: cpu=False (still the CPU) lets accelerate turn DeepSpeed on,
        # and gloo is named because accelerate finds no device backend there (flowrl/training/deepspeed_zero.py)
        deepspeed_on_cpu = deepspeed_zero.prepare_cpu_processes()
        accelerator = Accelerator(
            mixed_precision=config.train.mixed_precision,
            cpu=device is not None and device.type == "cpu" and not deepspeed_on_cpu,
            log_with=log_with,
            kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if deepspeed_on_cpu else None,
        )
    if device is not None and (accelerator.device.type, accelerator.device.index or 0) != (device.type, device.index or 0) and world == 1:
        raise FlowRLError(f"pipeline.device is '{spec}' but accelerate placed the run on '{accelerator.device}'.")
    return accelerator
