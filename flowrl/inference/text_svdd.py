"""``flowrl eval --svdd M`` on a diffusion LM: SVDD on the masked sampler (masked_svdd.py) or on DiffusionGemma's
entropy-bound canvases (canvas_svdd.py), the chosen completions graded by the run's reward.

``last_step`` (best_of_m, as the authors' discrete-diffusion SVDD; or plain) is the masked sampler's choice at its
final step. A
DiffusionGemma canvas's last step has no choice to make (its candidates share the step's argmax, canvas_svdd.py), as
in the release, so both settings run the same there."""

from __future__ import annotations

from .canvas_svdd import canvas_svdd_in_batches
from .masked_svdd import masked_svdd_in_batches
from .search import Items, SearchOutcome, TextSearchModel, TextVerifier
from .text_candidates import grade_choices, progress_bar


def text_svdd_search(section, model: TextSearchModel, verifier: TextVerifier, items: Items) -> SearchOutcome:
    """``flowrl eval --svdd M`` on a diffusion LM: the run's reward of the completions SVDD chose by ``--select``."""
    m, rule = section.m, section.rules[0]
    with progress_bar(f"svdd-{m}", len(items), "item") as progress:
        if model.sampler.name == "entropy_bound":  # DiffusionGemma's canvases
            result = canvas_svdd_in_batches(model, verifier.scorers[0], items.prompts, m, progress=progress)
        else:
            result = masked_svdd_in_batches(model, verifier.scorers[0], items.prompts, m, progress, section.last_step)
    metrics, rows = grade_choices(verifier, items, result.completions, result.scores, f"svdd{m}", rule)
    return SearchOutcome(
        metrics=metrics,
        extra={"denoiser_forwards_per_item": round(result.forwards / len(items), 3)},
        settings={"svdd": m, "svdd_last_step": section.last_step, "select": rule},
        rows=rows,
    )
