"""Masked-diffusion language models (LLaDA, MMaDA, Dream, the embedded arith_mdlm): LLaDA-style
generations recorded as TokenTrajectory, rewards that read the decoded text, and a held-out evaluation
by greedy decoding (accuracy = mean reward) whose decoded answers are written to the run directory."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object

from ..atomic_files import atomic_path
from ..config import Config
from ..errors import FlowRLError
from ..evaluation.aggregate import nanmean
from ..evaluation.held_out import eval_pool
from ..objectives import BuildContext, build_objective
from ..pipelines import build_pipeline
from ..prompts import prompts_for
from ..samplers.text_generation import candidate_streams, generate_texts
from ..training.distributed import check_peers
from ..types import Reward, TokenTrajectory
from .collector import collector_for
from .text_rollouts import TextRollouts

NUM_EVAL_SAMPLES_SHOWN = 12


class TextModality:
    module_attr = "model"

    def __init__(self, config: Config, device: torch.device, loaded: Any = None, objective: Any = None):
        """``loaded``: a transformers model (or a (model, tokenizer) pair) already in memory (flowrl.Trainer(pipeline=...))."""
        self.config, self.device = config, device
        self.pipeline = build_pipeline(config.pipeline, device, loaded)
        self.sampler = config.sampler
        context = BuildContext(dict(config.reward.components), config.sampler, self.pipeline, run_dir=config.output_dir)
        self.objective = objective if objective is not None else build_objective(config.objective, context)
        self.collector = collector_for({"rollouts": lambda: TextRollouts(self)}, self.objective, "diffusion language")

    # read when first used, not at construction: sampling given prompts (``flowrl sample NAME --prompt``) needs neither
    # pool, so a model whose task file is absent (../shared/data) still samples; the Trainer reads both right after
    # building the modality, so a missing file still stops a run before anything is written
    @functools.cached_property
    def train_pool(self) -> list:
        return prompts_for(self.config.prompts, "train")

    @functools.cached_property
    def eval_pool(self) -> list:
        return eval_pool(self.config)

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

    def generate(self, prompts: list[str], temperature: float, gen: torch.Generator, sampler: Any = None) -> TokenTrajectory:
        # one generation path for rollouts, evaluation and inference-time scaling (best-of-1 = the evaluation);
        # ``sampler``: the rollout's own settings where the objective rolls out differently (rollout_sampler)
        return generate_texts(
            self.pipeline,
            prompts,
            sampler or self.config.sampler,
            self.config.pipeline.prompt_length,
            temperature,
            gen,
            self.position_scorer,
        )

    @property
    def rollout_sampler(self) -> Any:
        """The sampler settings training rollouts use: the objective's ``rollout_sampler(sampler)`` where it has one
        (JustGRPO rolls out left to right, one token per step), else the run's sampler, which evaluation always uses."""
        rollout = getattr(self.objective, "rollout_sampler", None)
        return rollout(self.config.sampler) if rollout is not None else self.config.sampler

    def for_update(self, batch: TokenTrajectory) -> TokenTrajectory:
        return batch  # training re-scores exactly what was generated

    # -- sample (flowrl.Trainer.sample) ----------------------------------------------------------
    @torch.no_grad()
    def sample(self, prompts: list[str], num_samples: int, seed: int, temperature: float | None = None) -> list[str]:
        self.pipeline.model.eval()
        rows = [p for p in prompts for _ in range(num_samples)]
        temperature = self.config.sampler.eval_temperature if temperature is None else temperature
        completions: list[str] = []
        gen = torch.Generator().manual_seed(seed)
        for start in range(0, len(rows), self.config.rollout.batch_size):
            completions += self.generate(rows[start : start + self.config.rollout.batch_size], temperature, gen).completions
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
            traj = self.generate(prompts, self.config.sampler.eval_temperature, streams)
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
        check_peers(world)  # a reward that failed on another process ends this evaluation too, not a wait
        rows = sorted((r for part in gather_object([rows]) for r in part), key=lambda r: r["index"])
        metrics = {"eval/reward/mean": nanmean([r["score"] for r in rows])}
        for key in rows[0]:
            if key not in ("index", "prompt", "completion", "score"):
                metrics[f"eval/{key}" if key.startswith("judge/") else f"eval/reward/{key}"] = nanmean([r[key] for r in rows])
        return metrics, rows

    def evaluated_items(self, shown: list[dict]) -> dict[str, Any]:
        """What an evaluation spec records of the held-out evaluation: its prompts, metadata and sampler settings."""
        return {
            "prompts": [p for p, _ in self.eval_pool],
            "metadata": [m for _, m in self.eval_pool],
            "sampler": {"name": "masked", **self.config.sampler.model_dump(mode="json")},
            "sample_shape": None,
        }

    def save_eval_samples(self, rows: list[dict], run_dir: Path, step: int, tag: str | None) -> None:
        text = "".join(json.dumps({k: r[k] for k in ("prompt", "completion", "score")}) + "\n" for r in rows[:NUM_EVAL_SAMPLES_SHOWN])
        for path in [run_dir / "samples" / f"step_{step:06d}.jsonl"] + ([run_dir / f"samples_{tag}.jsonl"] if tag else []):
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:
                tmp.write_text(text)
