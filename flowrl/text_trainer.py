"""The trainer for masked-diffusion language models (LLaDA, MMaDA, Dream, the embedded arith_mdlm).

Same loop, optimizer, logging, checkpoints and resume as the image Trainer; what differs is the
modality: rollouts are LLaDA-style generations recorded as TokenTrajectory, rewards read text, and
evaluation is greedy decoding on held-out prompts (accuracy = mean reward), with the decoded answers
written to the run directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from accelerate.utils import gather_object

from . import seeding
from .checkpoint import atomic_path
from .errors import FlowRLError
from .objectives.dllm.policy import build_dllm_objective
from .pipelines.dllm import load_masked_lm
from .prompts import sample_prompts
from .samplers.masked import decode_completions, generate
from .trainer import Trainer, _nanmean
from .types import TokenTrajectory

EMBEDDED_LMS = {"arith_mdlm": Path(__file__).resolve().parent / "assets" / "arith_mdlm"}
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


class TextTrainer(Trainer):
    module_attr = "model"

    def _build_components(self) -> None:
        cfg = self.config
        if cfg.sampler.name != "masked":
            raise FlowRLError(f"a dllm pipeline needs sampler.name=masked, got '{cfg.sampler.name}'.")
        pretrained = str(EMBEDDED_LMS.get(cfg.pipeline.pretrained, cfg.pipeline.pretrained))
        lora = cfg.pipeline.lora.model_dump() if cfg.pipeline.lora else None
        self.pipeline = load_masked_lm(pretrained, family=cfg.pipeline.family, trust_remote_code=cfg.pipeline.trust_remote_code,
                                       dtype=cfg.pipeline.dtype, device=self.accelerator.device, lora=lora)
        self.sampler = cfg.sampler
        self.objective = build_dllm_objective(cfg.objective, cfg.sampler, self.pipeline.mask_token_id)

    def _check_capabilities(self) -> None:
        if self.config.objective.name not in ("diffu_grpo", "unigrpo", "dcolt", "bgpo"):
            raise FlowRLError(f"objective '{self.config.objective.name}' is for image models; use diffu_grpo, unigrpo, dcolt or bgpo.")
        if self.config.objective.name == "dcolt" and self.config.sampler.remasking != "policy":
            raise FlowRLError("objective 'dcolt' trains the unmasking policy: set sampler.remasking=policy.")

    # -- generation -----------------------------------------------------------------------------
    def _generate(self, prompts: list[str], temperature: float, gen: torch.Generator) -> TokenTrajectory:
        tok, sc, pc = self.pipeline.tokenizer, self.config.sampler, self.config.pipeline
        tok.padding_side = "left"
        enc = tok(prompts, padding="max_length" if pc.prompt_length else "longest", max_length=pc.prompt_length,
                  truncation=pc.prompt_length is not None, return_tensors="pt")
        device = self.accelerator.device
        scorer = getattr(self.objective, "position_scorer", None) if sc.remasking == "policy" else None
        traj = generate(self.pipeline, enc.input_ids.to(device), enc.attention_mask.bool().to(device), sc.gen_length, sc.steps,
                        sc.block_length, temperature=temperature, remasking=sc.remasking, threshold=sc.threshold,
                        position_scorer=scorer, logit_shift=sc.logit_shift, generator=gen)
        traj.completions = decode_completions(tok, traj.completion_ids, self.pipeline.eos_token_id)
        return traj

    @torch.no_grad()
    def rollout(self, iteration: int) -> TokenTrajectory:
        tc = self.config.train
        groups = tc.prompts_per_iteration // self.world
        chosen = sample_prompts(self.train_pool, groups, seeding.python_rng(self.config.seed, iteration, self.rank, "prompts"))
        prompts = [p for p, _ in chosen for _ in range(tc.num_generations)]
        gen = seeding.torch_generator(self.config.seed, iteration, self.rank, "rollout")
        self.module.eval()
        traj = self._generate(prompts, self.config.sampler.temperature, gen)
        traj.prompts, traj.metadata = prompts, [dict(m) for _, m in chosen for _ in range(tc.num_generations)]
        traj.group_ids = torch.arange(groups).repeat_interleave(tc.num_generations) + self.rank * groups
        traj.mask_seeds = draw_mask_seeds(groups, tc.num_generations, self.config.objective.num_mask_seeds,
                                          self.config.objective.group_shared_masks, gen)
        # The rollout policy's log-likelihood estimates (and the reference's) are part of the record, computed
        # with the weights that generated it, before any update: the first ratio is exactly 1.
        self.objective.old_and_ref(self.pipeline, traj)
        return traj

    def reward_inputs(self, traj: TokenTrajectory) -> list[str]:
        return traj.completions

    @torch.no_grad()
    def evaluate(self) -> tuple[dict[str, float], list[dict]]:
        """Greedy (eval_temperature) decoding of the held-out prompts; accuracy = mean reward."""
        items = self.eval_pool
        mine = list(range(self.rank, len(items), self.world))
        self.module.eval()
        rows = []
        for start in range(0, len(mine), self.config.rollout.batch_size):
            idx = mine[start : start + self.config.rollout.batch_size]
            prompts, meta = [items[i][0] for i in idx], [items[i][1] for i in idx]
            traj = self._generate(prompts, self.config.sampler.eval_temperature, torch.Generator().manual_seed(self.config.eval.seed))
            out = self.reward(traj.completions, prompts, meta)
            for j, i in enumerate(idx):
                rows.append({"index": i, "prompt": prompts[j], "completion": traj.completions[j], "score": float(out.scores[j]),
                             **{k: float(v[j]) for k, v in out.extras.items()}})
        rows = sorted((r for part in gather_object([rows]) for r in part), key=lambda r: r["index"])
        metrics = {"eval/reward/mean": _nanmean([r["score"] for r in rows])}
        for key in rows[0]:
            if key not in ("index", "prompt", "completion", "score"):
                metrics[f"eval/reward/{key}"] = _nanmean([r[key] for r in rows])
        return metrics, rows

    def _evaluate_and_log(self, step: int, tag: str | None, log: bool = True) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics, rows = self.evaluate()
        metrics["perf/eval_s"] = time.perf_counter() - t0
        if self.is_main:
            text = "".join(json.dumps({k: r[k] for k in ("prompt", "completion", "score")}) + "\n" for r in rows[:NUM_EVAL_SAMPLES_SHOWN])
            for path in [self.run_dir / "samples" / f"step_{step:06d}.jsonl"] + ([self.run_dir / f"samples_{tag}.jsonl"] if tag else []):
                path.parent.mkdir(parents=True, exist_ok=True)
                with atomic_path(path) as tmp:
                    tmp.write_text(text)
        if log:
            self.logger.log(step, metrics)
        return metrics
