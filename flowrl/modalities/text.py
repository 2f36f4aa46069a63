"""Masked-diffusion language models (LLaDA, MMaDA, Dream, the embedded arith_mdlm): LLaDA-style
generations recorded as TokenTrajectory, rewards that read the decoded text, and a held-out evaluation
by greedy decoding (accuracy = mean reward) whose decoded answers are written to the run directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object

from .. import seeding
from ..atomic_files import atomic_path
from ..config import Config
from ..errors import FlowRLError
from ..evaluation.held_out import eval_pool
from ..objectives import BuildContext, build_objective
from ..pipelines import build_pipeline
from ..prompts import prompts_for, sample_prompts
from ..samplers.text_generation import candidate_streams, generate_texts
from ..training.run_logger import nanmean
from ..types import Reward, RewardOutput, TokenTrajectory
from .reward_overlap import RolloutScoring

NUM_EVAL_SAMPLES_SHOWN = 12


def draw_mask_seeds(groups: int, group_size: int, num_seeds: int, shared: bool, gen: torch.Generator) -> torch.Tensor:
    """(groups * group_size, num_seeds) estimator mask seeds for a rollout whose rows come group by group.

    ``shared``: every completion of a prompt gets the same seeds, so the estimator masks the same positions
    in all of them (common random numbers). The group-relative advantages sum to zero within a group, so
    whatever the completions have in common (format tokens, the prompt) then cancels from the gradient
    instead of adding mask noise; d1 goes further and shares one seed across the whole batch. Each row's
    estimate is distributed exactly as with its own seed.
    """
    rows = groups if shared else groups * group_size
    seeds = torch.randint(0, 2**62, (rows, num_seeds), generator=gen)
    return seeds.repeat_interleave(group_size, 0) if shared else seeds


class TextModality:
    module_attr = "model"

    def __init__(self, config: Config, device: torch.device, loaded: Any = None, objective: Any = None):
        """``loaded``: a transformers model (or a (model, tokenizer) pair) already in memory (flowrl.Trainer(pipeline=...))."""
        self.config, self.device = config, device
        self.pipeline = build_pipeline(config.pipeline, device, loaded)
        self.sampler = config.sampler
        context = BuildContext(dict(config.reward.components), config.sampler, self.pipeline, run_dir=config.output_dir)
        self.objective = objective if objective is not None else build_objective(config.objective, context)
        self.train_pool = prompts_for(config.prompts, "train")
        self.eval_pool = eval_pool(config)

    def check(self) -> None:
        if self.config.objective.name == "dcolt" and self.config.sampler.remasking != "policy":
            raise FlowRLError("objective 'dcolt' trains the unmasking policy: set sampler.remasking=policy.")
        if self.config.sampler.remasking == "policy" and self.objective.position_scorer is None:
            raise FlowRLError(f"sampler.remasking=policy needs an objective with an unmasking policy (dcolt), not '{self.objective.name}'.")

    # -- generation -----------------------------------------------------------------------------
    @property
    def position_scorer(self):
        """DCoLT's unmasking policy when the sampler remasks by it, else None."""
        return self.objective.position_scorer if self.config.sampler.remasking == "policy" else None

    def _generate(self, prompts: list[str], temperature: float, gen: torch.Generator) -> TokenTrajectory:
        # one generation path for rollouts, evaluation and inference-time scaling (best-of-1 = the evaluation)
        return generate_texts(
            self.pipeline, prompts, self.config.sampler, self.config.pipeline.prompt_length, temperature, gen, self.position_scorer
        )

    @torch.no_grad()
    def collect(self, iteration: int, rank: int, world: int, scoring: RolloutScoring | None = None) -> TokenTrajectory:
        """This process's completions, recorded with the rollout policy's log-likelihood estimates. With an overlapped
        ``scoring`` (rollout.overlap_reward) the reward scores the decoded completions on its worker while those
        estimates are computed: the whole batch in one call, as the serial loop scores it."""
        tc, seed = self.config.train, self.config.seed
        groups, n = tc.prompts_per_iteration // world, tc.num_generations
        # Every draw is made for the whole world and keyed by global indices, as for images (seeding.RowGenerators):
        # an N-process run generates exactly the completions of a 1-process run, split in N.
        chosen = seeding.global_draw(
            lambda k: sample_prompts(self.train_pool, k, seeding.python_rng(seed, iteration, 0, "prompts")), groups, rank, world
        )
        prompts = [p for p, _ in chosen for _ in range(n)]
        group_ids = torch.arange(groups).repeat_interleave(n) + rank * groups
        rows = seeding.global_rows(group_ids, n)
        self.pipeline.model.eval()
        traj = self._generate(prompts, self.config.sampler.temperature, seeding.RowGenerators.keyed(seed, iteration, "rollout", rows))
        traj.prompts, traj.metadata = prompts, [dict(m) for _, m in chosen for _ in range(n)]
        traj.group_ids = group_ids
        oc = self.config.objective
        traj.mask_seeds = draw_mask_seeds(
            groups * world, n, oc.num_mask_seeds, oc.group_shared_masks, seeding.torch_generator(seed, iteration, 0, "rollout")
        )[rows]
        if scoring is not None and scoring.overlap:
            scoring.chunk(lambda: traj.completions, traj.prompts, traj.metadata)
        # The rollout policy's log-likelihood estimates (and the reference's) are part of the record, computed
        # with the weights that generated it, before any update: the first ratio is exactly 1.
        self.objective.old_and_ref(self.pipeline, traj)
        if scoring is not None:
            scoring.generated()
        return traj

    def for_update(self, batch: TokenTrajectory) -> TokenTrajectory:
        return batch  # training re-scores exactly what was generated

    def score(
        self, batch: TokenTrajectory, reward: Reward, with_gradient: bool, scoring: RolloutScoring | None = None
    ) -> tuple[RewardOutput, None]:
        if with_gradient:
            raise FlowRLError("text rewards have no gradient; the dLLM objectives train on rollouts.")
        if scoring is not None and scoring.scored_on_worker:  # scored on the worker during collect
            return scoring.join()[1], None
        return reward(batch.completions, batch.prompts, batch.metadata), None

    # -- sample (flowrl.Trainer.sample) ----------------------------------------------------------
    @torch.no_grad()
    def sample(self, prompts: list[str], num_samples: int, seed: int, temperature: float | None = None) -> list[str]:
        self.pipeline.model.eval()
        rows = [p for p in prompts for _ in range(num_samples)]
        temperature = self.config.sampler.eval_temperature if temperature is None else temperature
        completions: list[str] = []
        gen = torch.Generator().manual_seed(seed)
        for start in range(0, len(rows), self.config.rollout.batch_size):
            completions += self._generate(rows[start : start + self.config.rollout.batch_size], temperature, gen).completions
        return completions

    # -- evaluate -------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, reward: Reward, rank: int, world: int, judge: Reward | None = None) -> tuple[dict[str, float], list[dict]]:
        """Greedy (eval_temperature) decoding of the held-out prompts; accuracy = mean reward."""
        items = self.eval_pool
        mine = list(range(rank, len(items), world))
        self.pipeline.model.eval()
        rows = []
        for start in range(0, len(mine), self.config.rollout.batch_size):
            idx = mine[start : start + self.config.rollout.batch_size]
            prompts, meta = [items[i][0] for i in idx], [items[i][1] for i in idx]
            # per-item streams keyed by the prompt's text: a prompt's completion does not depend on its batch or
            # on which other prompts are evaluated (the candidate 0 of best-of-N and SVDD)
            streams = candidate_streams(self.config.eval.seed, prompts, 0)
            traj = self._generate(prompts, self.config.sampler.eval_temperature, streams)
            out = reward(traj.completions, prompts, meta)
            judged = judge(traj.completions, prompts, meta) if judge is not None else None  # eval.judge: logged as eval/judge/*
            for j, i in enumerate(idx):
                rows.append(
                    {
                        "index": i,
                        "prompt": prompts[j],
                        "completion": traj.completions[j],
                        "score": float(out.scores[j]),
                        **{k: float(v[j]) for k, v in out.extras.items()},
                        **(
                            {"judge/mean": float(judged.scores[j]), **{f"judge/{k}": float(v[j]) for k, v in judged.extras.items()}}
                            if judged is not None
                            else {}
                        ),
                    }
                )
        rows = sorted((r for part in gather_object([rows]) for r in part), key=lambda r: r["index"])
        metrics = {"eval/reward/mean": nanmean([r["score"] for r in rows])}
        for key in rows[0]:
            if key not in ("index", "prompt", "completion", "score"):
                metrics[f"eval/{key}" if key.startswith("judge/") else f"eval/reward/{key}"] = nanmean([r[key] for r in rows])
        return metrics, rows

    def save_eval_samples(self, rows: list[dict], run_dir: Path, step: int, tag: str | None) -> None:
        text = "".join(json.dumps({k: r[k] for k in ("prompt", "completion", "score")}) + "\n" for r in rows[:NUM_EVAL_SAMPLES_SHOWN])
        for path in [run_dir / "samples" / f"step_{step:06d}.jsonl"] + ([run_dir / f"samples_{tag}.jsonl"] if tag else []):
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:
                tmp.write_text(text)
