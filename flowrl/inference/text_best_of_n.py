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

import torch
from torch import Tensor

from ..errors import FlowRLError
from ..reward_models.math_answer import extract_answer
from ..samplers.text_generation import candidate_streams, generate_texts
from .batching import in_batches
from .search import Items, SearchOutcome, TextSearchModel, TextVerifier
from .text_candidates import MAJORITY, answer_key, check_candidates_differ, majority_choice, progress_bar


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


@dataclass
class _Candidates:
    """Candidate j of a batch of items: its completions, their grades and components, and every rule's score."""

    completions: list[str]
    graded: Tensor  # (B,) float32
    components: dict[str, Tensor]
    scores: dict[str, Tensor]  # rule -> (B,) float64


def _candidates(model: TextSearchModel, verifier: TextVerifier, items: Items, j: int) -> _Candidates:
    prompts = list(items.prompts)
    # per-item streams, as the plain evaluation draws: candidate 0 is its completion
    streams = candidate_streams(model.seed, prompts, j)
    traj = generate_texts(model.lm, prompts, model.sampler, model.prompt_length, model.temperature, streams, model.position_scorer)
    ll = traj.log_likelihood().cpu()
    out = verifier.grader(traj.completions, prompts, list(items.metadata))
    return _Candidates(
        completions=traj.completions,
        graded=out.scores.float().cpu(),
        components={k: v.float().cpu() for k, v in out.extras.items()},
        scores={s.name: s(traj.completions, prompts, ll).double() for s in verifier.scorers},
    )


@torch.no_grad()
def text_best_of_n(model: TextSearchModel, verifier: TextVerifier, items: Items, n: int, progress=None) -> TextBestOfN:
    """Sample ``n`` completions per item at ``model.temperature``, ``model.batch_size`` items at a time; score each with
    every scorer of ``verifier`` (verifier-free) and with its grader (the run's reward, which may read the gold answer
    in the items' metadata: it measures, it never selects).

    ``progress``: called with the number of completions done after each batch (for a progress bar).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    check_candidates_differ("--best-of", n, model.temperature, model.sampler.remasking)
    rounds = [
        in_batches(len(items), model.batch_size, lambda rows, j=j: _candidates(model, verifier, items.take(rows), j), progress)
        for j in range(n)
    ]
    completions = [[r.completions[i] for r in rounds] for i in range(len(items))]
    graded = torch.stack([r.graded for r in rounds], 1)
    if not torch.isfinite(graded).any():
        raise FlowRLError("the run's reward gave no finite score on any candidate, so no accuracy can be measured.")
    return TextBestOfN(
        completions=completions,
        answers=[[extract_answer(c) for c in row] for row in completions],
        scores={name: torch.stack([r.scores[name] for r in rounds], 1) for name in rounds[0].scores},
        graded=graded,
        components={k: torch.stack([r.components[k] for r in rounds], 1) for k in rounds[0].components},
    )


def text_best_of_search(section, model: TextSearchModel, verifier: TextVerifier, items: Items) -> SearchOutcome:
    """``flowrl eval --best-of N --select RULES`` on a diffusion LM: every rule's accuracy at N = 1, 2, 4, ..., pass@N
    (an oracle bound), and each item's candidates with every rule's choice."""
    n, rules = section.n, section.rules
    with progress_bar(f"best-of-{n}", n * len(items), "completion") as progress:
        result = text_best_of_n(model, verifier, items, n, progress)
    curves = result.curves(rules)
    lines = [
        f"best-of-N on {len(items)} held-out items, candidates at temperature {model.temperature:g}; accuracy of each rule's choice "
        f"(the run's reward), and pass@N: any candidate right, an oracle upper bound, not an accuracy:",
        "  " + f"{'N':>4}" + "".join(f"{r:>14}" for r in rules) + f"{'pass@N oracle':>16}",
    ]
    lines += ["  " + f"{k:>4}" + "".join(f"{curves[r][k]:>14.4f}" for r in rules) + f"{curves[ORACLE][k]:>16.4f}" for k in result.ks()]
    single = result.sample_accuracy()
    lines.append(f"  single-sample accuracy over all {n * len(items)} candidates: {single:.4f}")
    chosen = {r: result.choose(r, n) for r in rules}
    rows = [  # every rule's choice at N, with the candidates' answers it chose from
        {
            "prompt": prompt,
            "answers": result.answers[i],
            "graded": result.graded[i].tolist(),
            "chosen": {r: {"index": int(c[i]), "completion": result.completions[i][int(c[i])]} for r, c in chosen.items()},
        }
        for i, prompt in enumerate(items.prompts)
    ]
    metrics = {
        **{f"eval/reward/mean@{k}/{r}": curves[r][k] for r in rules for k in result.ks()},
        **{f"eval/oracle_pass@{k}": curves[ORACLE][k] for k in result.ks()},
        "eval/reward/mean/single_sample": single,
    }
    return SearchOutcome(metrics=metrics, lines=lines, settings={"n": n, "select": rules}, rows=rows, curves=curves)


__all__: Sequence[str] = ["ORACLE", "TextBestOfN", "text_best_of_n", "text_best_of_search"]
