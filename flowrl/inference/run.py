"""A search run as ``flowrl eval`` runs it: the model and the verifier metered, the search called, its summary and
counted cost printed, what it chose written, and the record with its evaluation spec built. The same for every
search, flowrl's own and a user's (the model is loaded by eval_command.py, which hands over a :class:`SearchSetup`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..console import say
from .cost import SearchCost, metered
from .search import Items, SearchOutcome, SearchSection, TextSearchModel


@dataclass
class SearchSetup:
    """What a search runs on, loaded from a config: ``model`` and ``verifier`` (not metered yet), the held-out
    ``items``; and what its record says about them: the ``modules`` whose weights it ran (the spec's weights hash),
    the spec's ``sampler`` description, the reward the spec records (``judge``: the run's reward, a diffusion LM's
    grader), the printed ``settings`` and, for a diffusion LM, the line label of its accuracy plot."""

    model: Any
    verifier: Any
    items: Items
    modules: list[tuple[str, Any]]
    sampler: dict[str, Any]
    judge: Any
    settings: dict[str, Any]
    plot_label: str = ""


def metered_search(section: SearchSection, model, verifier, items: Items) -> SearchOutcome:
    """``section.search`` on the metered model and verifier; the outcome carries the counted cost."""
    cost = SearchCost()
    if isinstance(model, TextSearchModel):  # the grader measures, it never selects: not metered
        lm, *scorers = metered(cost, lm=model.lm, verifiers=verifier.scorers)
        model, verifier = replace(model, lm=lm), replace(verifier, scorers=scorers)
    else:
        pipeline, verifier = metered(cost, pipeline=model.pipeline, verifiers=[verifier])
        model = replace(model, pipeline=pipeline)
    with cost:
        outcome = section.search(model, verifier, items)
    outcome.cost = cost
    return outcome


def cost_line(cost: SearchCost, items: int) -> str:
    c = cost.record(items)
    return (
        f"  cost per item: {c['denoiser_rows_per_item']:g} denoiser rows ({c['denoiser_seconds_per_item']:.3f} s), "
        f"{c['verifier_rows_per_item']:g} verifier rows ({c['verifier_seconds_per_item']:.3f} s, decode included), "
        f"wall {c['wall_seconds_per_item']:.3f} s (CPU {c['cpu_seconds_per_item']:.3f} s)"
    )


def run_search(config, checkpoint: Path | None, section: SearchSection, setup: SearchSetup, out: Path) -> dict:
    """Run ``section`` on ``setup``, print its summary and cost, write what it chose to ``out`` and return the record
    ``flowrl eval`` prints, its evaluation spec included."""
    outcome = metered_search(section, setup.model, setup.verifier, setup.items)
    lines = list(outcome.lines)
    lines.insert(len(lines) if outcome.cost_line_at is None else outcome.cost_line_at, cost_line(outcome.cost, len(setup.items)))
    for line in lines:
        say(line)
    files = write_outcome(outcome, setup, out)
    return {
        **{k: round(v, 6) for k, v in outcome.metrics.items()},
        **outcome.extra,
        "cost": outcome.cost.record(len(setup.items)),
        **files,
        "settings": {**setup.settings, **outcome.settings},
        "spec": _spec(config, checkpoint, section, setup, outcome),
    }


def write_outcome(outcome: SearchOutcome, setup: SearchSetup, out: Path) -> dict[str, str]:
    """The chosen samples as a grid at ``out``; a diffusion LM's accuracy plot at ``out`` and its rows beside it as
    .jsonl. Returns the record's fields naming them."""
    from ..atomic_files import atomic_path

    out.parent.mkdir(parents=True, exist_ok=True)  # a new output folder (no --out) is made only now

    files = {}
    if outcome.samples is not None:
        from ..visualize import save_grid

        save_grid(outcome.samples, out, ncol=setup.items.per_prompt)
        files["grid"] = str(out)
    if outcome.curves is not None:
        from .plots import save_scaling_plot

        save_scaling_plot({setup.plot_label: outcome.curves}, out, "held-out accuracy (run's reward)")
        files["plot"] = str(out)
    if outcome.rows is not None:
        rows_path = out.with_suffix(".jsonl")
        with atomic_path(rows_path) as tmp, open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in outcome.rows)
        files["completions"] = str(rows_path)
    return files


def _spec(config, checkpoint: Path | None, section: SearchSection, setup: SearchSetup, outcome: SearchOutcome) -> dict:
    """The evaluation spec of a search: its method, the weights, sampler, items and reward it ran (no judge is scored)."""
    from ..evaluation.spec import build_spec, weights_sha256

    return build_spec(
        config,
        method=section.method(),
        checkpoint=checkpoint,
        weights=weights_sha256(setup.modules),
        sampler=setup.sampler,
        prompts=list(setup.items.prompts),
        metadata=list(setup.items.metadata),
        reward=setup.judge,
        judge=None,
        result=outcome.metrics,
        sample_shape=tuple(outcome.samples.shape[1:]) if outcome.samples is not None else None,
    )


__all__ = ["SearchSetup", "cost_line", "metered_search", "run_search", "write_outcome"]
