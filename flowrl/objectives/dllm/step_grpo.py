"""GRPO on the exact per-step log-probabilities of a recorded uniform-noise diffusion trajectory (DiffusionGemma).

``objective.name: step_grpo``. The rollout sampler (``samplers/entropy_bound.py``) records, for every denoising step,
the log-probability of the tokens the policy kept; re-scoring replays the recorded canvases under the current weights
(``step_log_probs``). The objective is Flow-GRPO / DanceGRPO's per-step PPO on those exact log-probs, DCoLT's loss
without its unmasking-order term: group advantages, one clipped ratio per counted step, each completion's mean over
its counted steps, then the mean over completions; optionally a k3 KL per step to the initial weights (``beta``).

Why this estimator and not the masked-diffusion ones (docs/objectives/dllm.md, "DiffusionGemma"): d1's diffu-GRPO
and UniGRPO score the completion's tokens from one forward on a masked copy of it, and BGPO from the absorbing-mask
ELBO; both need a mask token (DiffusionGemma has none: its noise is uniform tokens) and score the final tokens, while
DiffusionGemma's final tokens are the argmax of the last step, a deterministic function of the state, not a sample.
DCoLT needs an unmasking order, and a re-noising sampler has none. The per-step log-probs are the policy's exact
transition probabilities up to factors independent of the weights (module docstring of the sampler), so this is the
plain policy gradient of the expected reward, with no estimator bias; the price is a replay of every step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...samplers.entropy_bound import step_log_probs
from ...sections import BuildContext
from ...types import CanvasTrajectory, LossOutput
from ..advantages import std_eps_option, std_option
from ..functional import StdConvention, clipped_surrogate_terms, k3_kl, masked_mean
from .policy import DLLMObjectiveConfig, _DLLMBase, ratio_metrics


@dataclass
class StepGRPOObjective(_DLLMBase):
    """PPO per denoising step on the recorded trajectory's exact kept-token log-probs."""

    def prepare(self, batch: CanvasTrajectory) -> CanvasTrajectory:
        batch.advantages = self.advantages(batch)
        return batch

    def old_and_ref(self, lm, batch: CanvasTrajectory) -> None:
        """The rollout weights' per-step log-probs (B, S) by the same replay training uses (the first ratio is 1), and
        the reference's."""
        with torch.no_grad():
            batch.old_log_probs = step_log_probs(lm, batch)
            if self.beta > 0:
                with lm.reference():
                    batch.ref_log_probs = step_log_probs(lm, batch)

    def losses(self, lm, sampler, batch: CanvasTrajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        new = step_log_probs(lm, batch)  # (B, S), with grad through every replayed step
        counted = batch.counted
        log_ratio = new - batch.old_log_probs
        ratio = torch.exp(log_ratio)
        adv = batch.advantages.to(new.device)[:, None]
        steps = counted.sum(1).clamp(min=1)
        per_seq = (clipped_surrogate_terms(ratio, adv, self.clip_range) * counted).sum(1) / steps
        valid = self._valid(batch)
        loss = masked_mean(per_seq, valid)
        metrics = ratio_metrics(loss, ratio, log_ratio, counted, self.clip_range)
        if self.beta > 0:
            kl = masked_mean((k3_kl(new, batch.ref_log_probs) * counted).sum(1) / steps, valid)
            loss = loss + self.beta * kl
            metrics["loss/kl"] = kl.detach()
        yield LossOutput(loss, metrics)


class StepGRPOConfig(DLLMObjectiveConfig):
    """step_grpo: per-step PPO on the exact log-probs the entropy-bound sampler records (DiffusionGemma)."""

    name: str = "step_grpo"
    std: StdConvention = std_option("biased", "Flow-GRPO's z-score")
    std_eps: float = std_eps_option(1e-4)

    def check_run(self, config: Any) -> None:
        if config.sampler.name != "entropy_bound":
            raise ValueError(
                f"objective step_grpo trains on the per-step log-probs the entropy_bound sampler records, not sampler '{config.sampler.name}'"
            )

    def build(self, context: BuildContext | None = None) -> StepGRPOObjective:
        return StepGRPOObjective(**self._common(), std_eps=self.std_eps)
