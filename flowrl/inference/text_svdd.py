"""``flowrl eval --svdd M`` on a diffusion LM: SVDD on the masked sampler (masked_svdd.py) or on DiffusionGemma's
entropy-bound canvases (canvas_svdd.py), the chosen completions graded by the run's reward."""

from __future__ import annotations

from .canvas_svdd import canvas_svdd_in_batches
from .masked_svdd import masked_svdd_in_batches
from .search import Items, SearchOutcome, TextSearchModel, TextVerifier
from .text_candidates import grade_choices, progress_bar


def text_svdd_search(section, model: TextSearchModel, verifier: TextVerifier, items: Items) -> SearchOutcome:
    """``flowrl eval --svdd M`` on a diffusion LM: the run's reward of the completions SVDD chose by ``--select``."""
    m, rule = section.m, section.rules[0]
    svdd_in_batches = canvas_svdd_in_batches if model.sampler.name == "entropy_bound" else masked_svdd_in_batches  # DiffusionGemma's
    with progress_bar(f"svdd-{m}", len(items), "item") as progress:
        result = svdd_in_batches(model, verifier.scorers[0], items.prompts, m, progress=progress)
    metrics, rows = grade_choices(verifier, items, result.completions, result.scores, f"svdd{m}", rule)
    return SearchOutcome(
        metrics=metrics,
        extra={"denoiser_forwards_per_item": round(result.forwards / len(items), 3)},
        settings={"svdd": m, "select": rule},
        rows=rows,
    )
