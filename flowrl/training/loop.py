"""One training iteration, for every model, objective and launch:

    batch   = collect(iteration)        # what the objective trains on (modalities/collector.py)
    batch   = score(batch)              # rewards (and reward gradients); NaN kept, counted, left out of the update
    batch   = prepare(batch)            # objective.prepare(): advantages / pairs / labels, no grad
    metrics = update(batch, iteration)  # inner epochs x minibatches: objective.losses() -> engine.step()

Each phase is a fault point (training/fault_injection.py) and is timed into ``perf/*``, both through one helper
(``Phases``). What differs between images and text is the modality's collector; what differs between objectives is
what they declare (``Objective``, flowrl/types.py); what differs between launches is the engine (engine.py). The run
around the iterations (output directory, evaluation, checkpoints, signals) is run.py.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from accelerate.utils import gather_object

from .. import seeding
from ..errors import FlowRLError
from ..evaluation.aggregate import nanmean
from ..modalities.reward_overlap import RolloutScoring
from ..types import LossOutput
from . import fault_injection
from .distributed import check_peers
from .engine import Engine, gather_means
from .flops import ModelFlops, run_modules
from .roles import POLICY, Roles


class Phases:
    """The phases of one iteration: each is a fault point (``<name>@<step>``) and adds its seconds to a ``perf/*`` key."""

    def __init__(self, step: int):
        self.step = step
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str, perf: str) -> Iterator[None]:
        fault_injection.reached(name, self.step)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[perf] = self.seconds.get(perf, 0.0) + time.perf_counter() - start


@torch.no_grad()
def collect_batch(collector, iteration: int, rank: int, world: int, scoring: RolloutScoring) -> Any:
    """The collector's chunks as they are finished, each handed to the scorer (decoded there, and with
    rollout.overlap_reward scored on its worker while the next chunk is generated), assembled into the batch."""
    batches = []
    for chunk in collector.collect(iteration, rank, world):
        if chunk.decode is not None:
            samples = scoring.chunk(chunk.decode, chunk.batch.prompts, chunk.batch.metadata)
            if samples is not None and chunk.attach is not None:  # else overlapped: the samples come back at join (score)
                chunk.attach(samples)
        batches.append(chunk.batch)
    scoring.generated()
    return collector.assemble(batches)


class TrainingLoop:
    """collect -> score -> prepare -> update for this process (``rank`` of ``world``)."""

    def __init__(self, config, modality, roles: Roles, engine: Engine, reward, rank: int, world: int):
        self.config, self.modality, self.roles, self.engine, self.reward = config, modality, roles, engine, reward
        self.collector, self.objective = modality.collector, modality.objective
        self.rank, self.world = rank, world
        self.updating = False  # True once an optimizer may have changed the weights of an unfinished iteration
        self._objective_before: dict[str, Any] | None = None  # the objective's state when an unfinished iteration began
        # (iteration, non-finite, all) of the last train.nonfinite_window iterations' rewards; saved in each checkpoint
        self.nonfinite: deque[tuple[int, int, int]] = deque(maxlen=config.train.nonfinite_window)
        self.flat_streak = 0  # iterations in a row in which every group's rewards were equal (check_learnable)
        # the model FLOPs of each iteration, counted per call of the run's models (training/flops.py)
        device = getattr(modality.pipeline, "device", "cpu")
        self.flops = ModelFlops(lambda: run_modules(roles, modality.pipeline, self.objective), device, config.log.peak_flops)

    def iteration(self, iteration: int) -> dict[str, float]:
        """One iteration. It may fail anywhere (a user's part raising, a bug): the run catches that in one place
        (run.py), and until the first optimizer step the weights and ``objective_state()`` are still the last
        completed iteration's, so that one can be saved. Before each collective that follows code which can fail on
        one process alone, the processes check on each other (``check_peers``), so that such a failure ends the
        iteration on every process instead of leaving the others waiting."""
        self._objective_before = copy.deepcopy(self.objective.state_dict())  # prepare() and losses() may change it
        self.updating = False
        rates = self.set_learning_rates(iteration)
        phases = Phases(iteration + 1)
        self.flops.start()
        started = time.perf_counter()
        # each finished rollout chunk is handed over to `scoring`: decoded, and with rollout.overlap_reward also scored
        # on a worker thread while the next chunk is generated (modalities/reward_overlap.py)
        with contextlib.closing(RolloutScoring(self.reward, self.config.rollout.overlap_reward)) as scoring:
            with phases("collect", "perf/rollout_s"):
                batch = self.collect(iteration, scoring)
            with phases("score", "perf/score_s"):
                batch = self.score(batch, scoring)
                check_peers(self.world)  # the rollouts and the reward ran on each process alone: a failure there, say it
                reward_metrics = self.reward_metrics(batch, iteration)  # of everything collected, before prepare() reorders
                self.check_learnable(iteration)  # a batch with nothing to learn from never reaches an optimizer
        with phases("advantages", "perf/update_s"):
            batch = self.prepare(batch)
            check_peers(self.world)  # and so did the objective's prepare()
        with phases("update", "perf/update_s"):
            metrics = self.update(batch, iteration)
        self.updating, self._objective_before = False, None
        return {
            **metrics,
            **reward_metrics,
            **rates,
            **phases.seconds,
            "perf/reward_wait_s": phases.seconds["perf/score_s"],  # the loop blocked on the reward: all of it when serial
            "perf/reward_hidden_s": 0.0,
            **scoring.perf(),  # decode_s; when overlapped the reward's own score_s and the part of it hidden
            **self.flops.metrics(time.perf_counter() - started, self.world),  # iteration_s, model FLOPs, FLOP/s, MFU
        }

    def set_learning_rates(self, iteration: int) -> dict[str, float]:
        """Every trained role's optimizer at its schedule's rate for this iteration; the rates logged: the policy's as
        ``train/learning_rate``, a role clipped apart from the policy under ``train/learning_rate/<role>``."""
        logged = {}
        for role in self.roles.trained:
            rate = role.settings.learning_rate_at(iteration, self.config.train.iterations)
            for group in role.optimizer.param_groups:
                group["lr"] = rate
            if role.clip_with is None:
                logged["train/learning_rate" if role.name == POLICY else f"train/learning_rate/{role.name}"] = rate
        return logged

    def collect(self, iteration: int, scoring: RolloutScoring | None = None) -> Any:
        """This process's batch for ``iteration``: what the objective trains on, each finished chunk handed to the
        scorer (``scoring``; None: decoded at once, the reward left to ``score``)."""
        return collect_batch(self.collector, iteration, self.rank, self.world, scoring or RolloutScoring(self.reward, False))

    def score(self, batch: Any, scoring: RolloutScoring | None = None) -> Any:
        """Attach rewards (and their gradients, where the objective trains on them); non-finite rewards stay NaN and are
        left out of the update (and counted). A reward that fails for good (a server that stayed down) raises; the run
        then stops with the last completed iteration on disk."""
        out, grads = self.collector.score(batch, self.reward, scoring)
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
    def prepare(self, batch: Any) -> Any:
        """The objective's prepare(): advantages, pairs or labels; no gradient."""
        return self.objective.prepare(self.modality.for_update(batch))

    def update(self, batch: Any, iteration: int) -> dict[str, float]:
        """The objective's inner epochs over minibatches; one engine step per minibatch. Rows are shuffled in whole
        units of ``objective.minibatch_unit`` (D3PO's and Diffusion-DPO's pairs stay together)."""
        tc, unit = self.config.train, self.objective.minibatch_unit
        gen = seeding.torch_generator(self.config.seed, iteration, self.rank, "update")
        totals: dict[str, list] = {}
        for role in self.roles.trained:
            role.module.train()
        for epoch in range(tc.inner_epochs):
            order = (torch.randperm(len(batch) // unit, generator=gen)[:, None] * unit + torch.arange(unit)).flatten()
            for start in range(0, len(batch), tc.batch_size):
                minibatch = batch[order[start : start + tc.batch_size]]
                minibatch.inner_epoch = epoch
                for k, v in self.step(minibatch, gen).items():
                    totals.setdefault(k, []).append(v)
        means = {k: float(torch.stack(v).float().mean()) for k, v in totals.items()}
        return gather_means(means, self.world)  # the run's metrics, not the main process's share

    def step(self, minibatch: Any, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """One optimizer step of every role the minibatch's losses are for; the losses' metrics averaged, and the norms."""
        per_step: dict[str, list[torch.Tensor]] = {}

        def record(loss_out: LossOutput) -> None:
            for k, v in loss_out.metrics.items():
                per_step.setdefault(k, []).append(v)

        losses = self.objective.losses(self.modality.pipeline, self.modality.sampler, minibatch, gen)
        norms = self.engine.step(self.roles, self._stepping_after(losses), record)
        return {**{k: torch.stack(v).mean() for k, v in per_step.items()}, **norms}

    def _stepping_after(self, losses: Iterable[LossOutput]) -> Iterator[LossOutput]:
        """The minibatch's losses as the engine takes them; once the last is taken the engine steps the optimizers
        (every engine steps only after the losses are exhausted), and from then on the weights are no longer the
        last completed iteration's (``updating``)."""
        yield from losses
        self.updating = True

    def objective_state(self) -> dict[str, Any]:
        """The objective's state of the last completed iteration: what a checkpoint holds (during an unfinished
        iteration, as it was when that iteration began)."""
        return self._objective_before if self._objective_before is not None else self.objective.state_dict()

    # -- reward accounting ---------------------------------------------------------------------------------------------
    def reward_metrics(self, batch: Any, iteration: int) -> dict[str, float]:
        rewards = torch.cat(gather_object([batch.rewards.cpu()]))
        finite = torch.isfinite(rewards)
        self.nonfinite.append((iteration, int((~finite).sum()), len(rewards)))  # every process sees the same gathered counts
        metrics = {
            "reward/mean": float(rewards[finite].mean()) if finite.any() else float("nan"),
            "reward/std": float(rewards[finite].std(unbiased=False)) if finite.any() else float("nan"),
            "reward/nonfinite_count": int((~finite).sum()),
            "reward/flat_group_fraction": flat_group_fraction(rewards, self.collector.rows_per_prompt),
        }
        self.flat_streak = self.flat_streak + 1 if metrics["reward/flat_group_fraction"] == 1.0 else 0
        for name, values in batch.reward_components.items():
            metrics[f"reward/{name}"] = nanmean(torch.cat(gather_object([values.cpu()])).tolist())
        return metrics

    def _check_reward_spread(self, iteration: int) -> None:
        """Equal rewards within every group, iteration after iteration: zero advantages, nothing learnt. Warn after
        train.flat_reward_warn such iterations in a row, stop after train.flat_reward_stop (0: never)."""
        tc, streak = self.config.train, self.flat_streak
        if not type(self.config.objective).learns_from_reward_differences or self.collector.rows_per_prompt < 2:
            return
        what = (
            f"every group's rewards were equal in the last {streak} iterations (reward components: "
            f"{', '.join(self.config.reward.components)}), so the advantages are zero and the update learns nothing"
        )
        if tc.flat_reward_stop and streak >= tc.flat_reward_stop:
            raise FlowRLError(f"{what}; the run cannot learn (train.flat_reward_stop={tc.flat_reward_stop})")
        if tc.flat_reward_warn and streak == tc.flat_reward_warn:
            warnings.warn(f"{what}: does the reward tell this model's samples apart?", stacklevel=2)

    def check_learnable(self, iteration: int) -> None:
        """Stop a run that cannot learn instead of training on nothing: every reward of this iteration non-finite, or
        more than train.max_nonfinite_fraction of the last train.nonfinite_window iterations' rewards. Rows that are
        labelled already (offline pairs, SePPO's winners) do not learn from the reward, so they are exempt."""
        if not self.collector.learns_from_rewards or not self.nonfinite:
            return
        self._check_reward_spread(iteration)
        tc = self.config.train
        _, bad, total = self.nonfinite[-1]
        if total and bad == total:
            raise FlowRLError(
                f"all {total} rewards of iteration {iteration + 1} were NaN or infinite (reward components: "
                f"{', '.join(self.config.reward.components)}), so the run cannot learn"
            )
        if len(self.nonfinite) == tc.nonfinite_window:
            _, bad, total = (sum(x) for x in zip(*self.nonfinite))
            if total and bad / total > tc.max_nonfinite_fraction:
                raise FlowRLError(
                    f"{bad} of {total} rewards of the last {tc.nonfinite_window} iterations were NaN or infinite, more than "
                    f"train.max_nonfinite_fraction={tc.max_nonfinite_fraction:g}, so the run is not learning"
                )


def flat_group_fraction(rewards: torch.Tensor, group: int) -> float:
    """The fraction of the batch's groups (``group`` consecutive rows each) whose finite rewards are all equal (a group
    with fewer than two finite rewards counts as flat: it has no difference to learn from)."""
    if group < 2 or len(rewards) % group:
        return 0.0
    flat = 0
    for row in rewards.view(-1, group):
        finite = row[torch.isfinite(row)]
        flat += int(len(finite) < 2 or bool((finite == finite[0]).all()))
    return flat / (len(rewards) // group)
