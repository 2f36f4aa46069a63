"""``flowrl.Trainer``: the Python API of a training run, built from a config and the user's own parts.

It assembles the run and hands the work to the training wing (``flowrl/training/``):

    modality = build_modality(config)           # model, samplers, objective, the collector of its training data
    roles    = build_roles(...)                 # the policy and what the objective declares (trained / frozen)
    engine   = build_engine(accelerator)        # one process or DDP, FSDP2, DeepSpeed ZeRO-2/3: wraps and steps the roles
    loop     = TrainingLoop(...)                # one iteration: collect -> score -> prepare -> update
    run      = Run(...)                         # output directory, resume, evaluation / log / checkpoint cadence, summary

and exposes what a user calls: ``train()``, ``evaluate()``, ``sample()``, ``save()``, and the parts themselves.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from . import seeding
from .config import Config, load_config, set_num_threads
from .errors import FlowRLError
from .modalities import build_modality
from .objectives import frozen_roles
from .reward_models import build_reward_from_config
from .reward_models.mix import rewards_from_python
from .training import deepspeed_zero
from .training.determinism import enable_deterministic_mode
from .training.engine import build_engine
from .training.launch import make_accelerator
from .training.loop import TrainingLoop
from .training.preflight import check_divisibility, check_reward_can_score, probe_rewards
from .training.roles import build_roles, lr_factor
from .training.run import Run
from .training.trackers import Trackers

__all__ = ["Trainer", "lr_factor"]


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
        config, user_reward, user_judge = _config_with_user_rewards(config, overrides, reward, reward_weights, judge)
        self.config = config
        set_num_threads(config)  # one thread for the embedded models: more only add contention (train.num_threads)
        if config.train.deterministic:  # before any model or CUDA context exists
            enable_deterministic_mode()
        self.trackers = Trackers(config, Path(config.output_dir))  # a tracker's missing package is refused before anything is written
        self.accelerator = make_accelerator(config, self.trackers.log_with())  # and made ready for its launch (FSDP, DeepSpeed)
        self.is_main = self.accelerator.is_main_process
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        check_divisibility(config, self.world)
        self.run_dir = Path(config.output_dir)
        self.reward = user_reward if user_reward is not None else build_reward_from_config(config.reward)
        self.judge = user_judge if user_judge is not None else _judge_from_config(config)  # never trained on
        probe_rewards(config, [self.reward] + ([self.judge] if self.judge is not None else []))  # before any model loads
        seeding.seed_initialisation(config.seed)  # before anything is initialised at random (LoRA, DCoLT's head)
        self.modality = build_modality(config, self.accelerator.device, loaded=pipeline)
        self.pipeline, self.sampler, self.objective = self.modality.pipeline, self.modality.sampler, self.modality.objective
        self.modality.check()
        # the task's prompts are read now, before a run directory exists, so a missing task file stops the run with
        # nothing written (the text modality reads its pools when first used: sampling given prompts needs neither)
        _ = self.modality.train_pool, getattr(self.modality, "eval_pool", None)
        self.modality.collector.check(self.reward)
        check_reward_can_score(config, self.reward, self.modality.collector)
        self.roles = build_roles(config, self.pipeline, self.modality.module_attr, self.objective, frozen_roles(self.objective))
        self.engine = build_engine(self.accelerator, config)
        self.engine.prepare(self.roles)
        self.loop = TrainingLoop(config, self.modality, self.roles, self.engine, self.reward, self.rank, self.world)
        self.run = Run(config, self.accelerator, self.engine, self.roles, self.loop, self.modality, self.trackers, self)

    # -- the parts -----------------------------------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The trained module (the denoiser, or the language model), as the engine wrapped it."""
        return self.roles.policy.module

    @property
    def optimizer(self) -> Any:
        """The policy's optimizer (each trained role has its own: ``trainer.roles[name].optimizer``)."""
        return self.roles.policy.optimizer

    @property
    def deepspeed(self) -> bool:
        return deepspeed_zero.is_deepspeed(self.accelerator)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Every trained role's parameters, the policy's first."""
        return [p for role in self.roles.trained for p in role.parameters]

    @property
    def logger(self):
        return self.run.logger

    @property
    def iteration(self) -> int:
        return self.run.iteration

    # -- one training iteration, phase by phase (training/loop.py) ----------------------------------------------------
    def train_iteration(self, iteration: int) -> dict[str, float]:
        """collect -> score -> prepare -> update; logging, evaluation and checkpoints follow in fit()."""
        return self.loop.iteration(iteration)

    def collect(self, iteration: int, scoring=None):
        return self.loop.collect(iteration, scoring)

    def score(self, batch, scoring=None):
        return self.loop.score(batch, scoring)

    def advantages(self, batch):
        return self.loop.prepare(batch)

    def update(self, batch, iteration: int) -> dict[str, float]:
        return self.loop.update(batch, iteration)

    # -- evaluation and sampling ---------------------------------------------------------------------------------------
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
        from .objectives import own_modules

        modules = [("", self.accelerator.unwrap_model(self.module)), *own_modules(self.objective)]
        items = self.modality.evaluated_items(shown)
        return build_spec(
            self.config,
            method={"name": "plain"},
            checkpoint=checkpoint,
            weights=None if self.engine.shards_weights else weights_sha256(modules),
            sampler=items["sampler"],
            prompts=items["prompts"],
            metadata=items["metadata"],
            reward=self.reward,
            judge=self.judge,
            result={k: v for k, v in metrics.items() if not k.startswith("perf/")},
            sample_shape=items["sample_shape"],
        )

    def sample(self, prompts: str | Sequence[str], num_samples: int = 1, seed: int = 0, **options: Any) -> Any:
        """Samples of the current weights: ``num_samples`` per prompt, prompt-major. Images and videos come back as a
        float tensor in [0, 1] (deterministic sampler unless ``sampler="rollout"``; ``num_inference_steps`` and
        ``guidance_scale``, by default the evaluation's, and ``metadata`` as options); a diffusion LM's as completion
        strings (``temperature``, default the evaluation's)."""
        return self.modality.sample([prompts] if isinstance(prompts, str) else list(prompts), num_samples, seed, **options)

    # -- the run (training/run.py) ---------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Run the training loop (``fit``): what ``flowrl train`` does; returns the summary written to summary.json."""
        return self.fit()

    def fit(self) -> dict[str, Any]:
        """Train ``train.iterations`` iterations (or what is left after ``resume_from``); the summary of summary.json."""
        return self.run.fit()

    def save(self) -> Path | None:
        """A checkpoint of every trained role at the current iteration (a collective under a launch)."""
        return self.run.save()

    def load(self, spec: str) -> None:
        """Resume from a checkpoint directory, or "latest" in the output directory."""
        self.run.load(spec)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a checkpoint's weights into every trained role (the model's trained part, an objective's own modules)."""
        self.engine.load_weights(self.roles, weights)


def _config_with_user_rewards(config, overrides, reward, reward_weights, judge) -> tuple[Config, Any, Any]:
    """The run's config, and the user's reward and judge objects (``Trainer(reward=..., judge=...)``): they replace
    ``config.reward`` / ``eval.judge``, whose components then record their names."""
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
    return config, user_reward, user_judge


def _judge_from_config(config: Config) -> Any:
    return build_reward_from_config(config.eval.judge) if config.eval.judge is not None else None
