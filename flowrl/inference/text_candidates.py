"""What inference-time scaling on a masked-diffusion LM shares: generating held-out completions (the code
path the training-time evaluation uses too), verifier-free scores of a completion, and the answer key
majority voting compares.

Verifier-free means the score never sees the gold answer. ``likelihood`` is the model's own
log-likelihood of its completion as generated: the sum over the completion's positions of the
log-prob each committed token had at its commit step (``TokenTrajectory.token_log_probs``, recorded by
the sampler, so it costs no forward pass). A reward rule is any registered reward, called with the
completions and prompts and *empty* metadata, so a reward that grades against the reference answer
(which lives in the metadata) cannot be used by accident; the known gold graders are refused by name.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import Tensor

from ..errors import FlowRLError

MAJORITY, LIKELIHOOD = "majority", "likelihood"
# Rewards that score a completion against the item's reference answer or solution: selecting with them
# would be pass@N (an oracle), not inference-time scaling.
GOLD_GRADERS = frozenset({"math_answer", "sudoku"})


def check_candidates_differ(flag: str, count: int, temperature: float, remasking: str) -> None:
    """Refuse ``count`` > 1 candidates when every candidate would be the same completion."""
    if count > 1 and temperature == 0 and remasking != "random":
        raise FlowRLError(
            f"{flag} {count} at temperature 0 draws {count} identical completions; "
            f"sample them at a temperature, e.g. sampler.eval_temperature=1."
        )


class TextScorer(Protocol):
    """A verifier-free score of completions: (texts, prompts, log-likelihoods (B,)) -> (B,) float, higher is better."""

    name: str

    def __call__(self, texts: Sequence[str], prompts: Sequence[str], log_likelihood: Tensor) -> Tensor: ...


class LikelihoodScorer:
    """The model's own log-likelihood of the completion (sum of its tokens' log-probs at their commit steps)."""

    name = LIKELIHOOD

    def __call__(self, texts: Sequence[str], prompts: Sequence[str], log_likelihood: Tensor) -> Tensor:
        return log_likelihood.double().cpu()


class RewardScorer:
    """A registered reward, called without the items' metadata (where the gold answer lives)."""

    def __init__(self, name: str, reward) -> None:
        self.name, self.reward = name, reward

    def __call__(self, texts: Sequence[str], prompts: Sequence[str], log_likelihood: Tensor) -> Tensor:
        scores = self.reward(list(texts), list(prompts), [{} for _ in texts]).scores.double().cpu()
        if not torch.isfinite(scores).any():
            raise FlowRLError(
                f"the reward '{self.name}' gives no finite score without the items' metadata, "
                f"so it cannot select; use majority, likelihood or a reward that reads only the completion."
            )
        return scores


def build_scorer(rule: str, reward_kwargs: dict[str, dict[str, Any]] | None = None) -> TextScorer:
    """``likelihood`` or a registered reward's name (built with ``reward_kwargs[name]``); gold graders refused."""
    from ..reward_models import build_reward

    if rule == LIKELIHOOD:
        return LikelihoodScorer()
    if rule in GOLD_GRADERS:
        raise FlowRLError(
            f"'{rule}' grades against the gold answer, so selecting with it measures pass@N, "
            f"not inference-time scaling; select by majority, likelihood or a verifier-free reward such as format."
        )
    return RewardScorer(rule, build_reward(rule, **(reward_kwargs or {}).get(rule, {})))


def build_scorers(rules: Sequence[str], reward_config) -> list[TextScorer]:
    """The scorers the selection ``rules`` need (majority needs none): ``likelihood``, a reward's name, or
    ``reward``: the run's own reward (``reward_config``), allowed only when none of its parts reads the gold answer."""
    from ..reward_models import build_reward_from_config

    scorers: list[TextScorer] = []
    for rule in dict.fromkeys(rules):
        if rule == MAJORITY:
            continue
        if rule == "reward":
            names = set(reward_config.components) | {m.name for e in reward_config.ensembles.values() for m in e.members}
            gold = sorted(names & GOLD_GRADERS)
            if gold:
                raise FlowRLError(
                    f"--select reward: the run's reward reads the gold answer ({', '.join(gold)}), so it would select "
                    f"with the answer in hand; select by a reward that does not, e.g. --select format."
                )
            scorers.append(RewardScorer("reward", build_reward_from_config(reward_config)))
        else:
            scorers.append(build_scorer(rule, reward_config.kwargs))
    return scorers


def grade_choices(verifier, items, completions: Sequence[str], values: Tensor, tag: str, rule: str) -> tuple[dict, list[dict]]:
    """The run's reward (the held-out grader, which may read the gold answer) of the completions a search chose by
    ``rule``: the metrics ``eval/reward/mean@TAG/RULE`` and each reward component's, and one row per item (prompt,
    completion, its grade and the ``values`` the search chose it by)."""
    graded = verifier.grader(list(completions), list(items.prompts), list(items.metadata))
    metrics = {
        f"eval/reward/mean@{tag}/{rule}": float(graded.scores.float().nanmean()),
        **{f"eval/reward/{k}@{tag}": float(v.float().nanmean()) for k, v in graded.extras.items()},
    }
    rows = [
        {"prompt": prompt, "completion": completions[i], "score": float(graded.scores[i]), "value": float(values[i])}
        for i, prompt in enumerate(items.prompts)
    ]
    return metrics, rows


@contextmanager
def progress_bar(desc: str, total: int, unit: str) -> Iterator:
    """A progress bar on a terminal (none otherwise); yields the function that advances it."""
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit=unit, disable=None) as bar:
        yield bar.update


_NUMBER_SEPARATOR = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def answer_key(answer: str | None) -> str | None:
    """The form answers are compared in for voting: "12", "12.0", "$12$" and "12." vote together.

    Numbers compare by value (thousands separators, "$" and a final "." dropped); anything else by its
    text with whitespace collapsed. None (nothing extracted) stays None and never votes.
    """
    if answer is None:
        return None
    a = answer.replace("$", "").replace("\\,", "").replace("\\!", "").strip().rstrip(".").strip()
    try:
        value = float(_NUMBER_SEPARATOR.sub("", a))
    except ValueError:
        return " ".join(a.split()) or None
    if math.isfinite(value) and value == int(value):
        return str(int(value))
    return repr(value)


def majority_choice(keys: Sequence[str | None]) -> int:
    """Index of the candidate majority voting keeps: the first candidate holding the most frequent answer.

    A tie between answers goes to the answer that appeared first, so the choice depends only on the
    candidates' order (candidate 0 when N = 1). Candidates without an answer do not vote; when none has
    one, candidate 0 is kept.
    """
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return 0
    top = max(counts.values())
    return next(i for i, k in enumerate(keys) if k is not None and counts[k] == top)


__all__: Sequence[str] = [
    "GOLD_GRADERS",
    "LIKELIHOOD",
    "MAJORITY",
    "LikelihoodScorer",
    "RewardScorer",
    "TextScorer",
    "answer_key",
    "build_scorer",
    "build_scorers",
    "check_candidates_differ",
    "grade_choices",
    "majority_choice",
    "progress_bar",
]
