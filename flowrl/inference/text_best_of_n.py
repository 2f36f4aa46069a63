"""Best-of-N for masked-diffusion LMs with selection rules that do not see the gold answer.

N completions are sampled for every held-out item; a rule keeps one:

* ``majority``: self-consistency; the most frequent extracted answer wins (``text_candidates.majority_choice``);
* ``likelihood``: the model's own log-likelihood of its completion (free: the sampler recorded it);
* a reward's name (e.g. ``format``): that reward, called without the items' metadata.

The run's reward (for math: the gold-answer grader) then measures the kept completion: that is the
accuracy of the rule. pass@N, whether *any* of the N candidates is right, is the same grader choosing
with the answer in hand: an oracle upper bound, reported under its own name and never as accuracy.

Candidate j of an item draws from its own stream keyed by (seed, the prompt's text, j), so candidate 0 is
exactly the completion the plain held-out evaluation draws at the same temperature and every rule at N = 1
equals the plain evaluation (tested), whatever the batching and whichever other items are evaluated. The curves use
nested subsets (the first k candidates), as the image best-of-N does, so every point is a real
selection among the completions the next point also sees.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..errors import FlowRLError
from ..reward_models.math_answer import extract_answer
from ..samplers.masked import MaskedSamplerConfig
from ..samplers.text_generation import candidate_streams, generate_texts
from ..types import MaskedLM
from .text_candidates import MAJORITY, TextScorer, answer_key, check_candidates_differ, majority_choice


@dataclass
class TextBestOfN:
    completions: list[list[str]]  # (P, N) every candidate's decoded completion
    answers: list[list[str | None]]  # (P, N) the answer extracted from it (no gold involved); None: nothing found
    scores: dict[str, Tensor]  # rule -> (P, N) float64 verifier-free score of every candidate
    graded: Tensor  # (P, N) float32: the run's reward of every candidate (the gold grader); only measures
    components: dict[str, Tensor]  # the run's reward components, (P, N) each

    @property
    def n(self) -> int:
        return self.graded.shape[1]

    def ks(self) -> list[int]:
        """1, 2, 4, ..., and N itself."""
        return sorted({2**i for i in range(int(math.log2(self.n)) + 1)} | {self.n})

    def choose(self, rule: str, k: int) -> Tensor:
        """(P,) the index of the candidate ``rule`` keeps among each item's first ``k``."""
        if not 1 <= k <= self.n:
            raise ValueError(f"k must be in 1..{self.n}, got {k}")
        if rule == MAJORITY:
            return torch.tensor([majority_choice([answer_key(a) for a in row[:k]]) for row in self.answers], dtype=torch.long)
        if rule not in self.scores:
            raise KeyError(f"no scores for rule '{rule}'; sampled with {sorted(self.scores)}")
        s = self.scores[rule][:, :k]
        # argmax returns the first maximum: a tie keeps the earlier candidate; a NaN score is never chosen
        return torch.where(torch.isfinite(s), s, float("-inf")).argmax(1)

    def accuracy(self, rule: str, k: int) -> float:
        """Mean over items of the run's reward of the completion ``rule`` keeps among the first ``k``."""
        return _finite_mean(self.graded.gather(1, self.choose(rule, k)[:, None]).squeeze(1))

    def pass_at(self, k: int) -> float:
        """Oracle upper bound: mean over items of the best run's reward among the first ``k`` (pass@k for a 0/1 grader)."""
        g = torch.where(torch.isfinite(self.graded[:, :k]), self.graded[:, :k], float("-inf")).max(1).values
        return _finite_mean(g)

    def sample_accuracy(self) -> float:
        """The run's reward of one sample, averaged over all P x N candidates (the single-sample accuracy,
        with N times the draws of candidate 0 alone)."""
        return _finite_mean(self.graded.flatten())

    def curves(self, rules: Sequence[str]) -> dict[str, dict[int, float]]:
        """{rule: {k: accuracy}} for k = 1, 2, 4, ..., N, plus "pass@k (oracle)": {k: pass@k}."""
        out = {rule: {k: self.accuracy(rule, k) for k in self.ks()} for rule in rules}
        out[ORACLE] = {k: self.pass_at(k) for k in self.ks()}
        return out


ORACLE = "pass@k (oracle)"


def _finite_mean(x: Tensor) -> float:
    finite = x[torch.isfinite(x)]
    return float(finite.double().mean()) if len(finite) else float("nan")


@torch.no_grad()
def text_best_of_n(
    lm: MaskedLM,
    sampler: MaskedSamplerConfig,
    prompt_length: int | None,
    grader,
    scorers: Sequence[TextScorer],
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    n: int,
    temperature: float,
    seed: int,
    batch_size: int,
    position_scorer=None,
    progress=None,
) -> TextBestOfN:
    """Sample ``n`` completions per item at ``temperature``, ``batch_size`` items at a time; score each with
    every scorer (verifier-free) and with ``grader`` (the run's reward, which may read the gold answer in
    ``metadata``: it measures, it never selects).

    ``progress``: called with the number of completions done after each batch (for a progress bar).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    check_candidates_differ("--best-of", n, temperature, sampler.remasking)
    p = len(prompts)
    completions: list[list[str]] = [[] for _ in range(p)]
    graded = torch.full((p, n), float("nan"))
    components: dict[str, Tensor] = {}
    scores = {s.name: torch.full((p, n), float("nan"), dtype=torch.float64) for s in scorers}
    for j in range(n):
        for start in range(0, p, batch_size):
            idx = list(range(start, min(start + batch_size, p)))
            batch_prompts, batch_meta = [prompts[i] for i in idx], [metadata[i] for i in idx]
            # per-item streams, as the plain evaluation draws: candidate 0 is its completion
            streams = candidate_streams(seed, batch_prompts, j)
            traj = generate_texts(lm, batch_prompts, sampler, prompt_length, temperature, streams, position_scorer)
            ll = traj.log_likelihood().cpu()
            for i, text in zip(idx, traj.completions):
                completions[i].append(text)
            out = grader(traj.completions, batch_prompts, batch_meta)
            graded[idx, j] = out.scores.float().cpu()
            for key, v in out.extras.items():
                components.setdefault(key, torch.full((p, n), float("nan")))[idx, j] = v.float().cpu()
            for s in scorers:
                scores[s.name][idx, j] = s(traj.completions, batch_prompts, ll)
            if progress is not None:
                progress(len(idx))
    answers = [[extract_answer(c) for c in row] for row in completions]
    if not torch.isfinite(graded).any():
        raise FlowRLError("the run's reward gave no finite score on any candidate, so no accuracy can be measured.")
    return TextBestOfN(completions=completions, answers=answers, scores=scores, graded=graded, components=components)


__all__: Sequence[str] = ["ORACLE", "TextBestOfN", "text_best_of_n"]
