"""``flowrl check``: does the run train, evaluate, sample and export one and the same model?

For one prompt group of a run built exactly as ``flowrl train`` builds it: the update's re-score of the rollout's
per-step log-probs at unchanged weights (ratio 1 to rounding, ``rescore.py``); the settings every sampling path ran
with, recorded from the model's calls, against the rollout's and the evaluation's (``paths.py``, ``parity.py``); the
config keys set but read by no part of the run (``reads.py``); the exported model card's sampling settings against
the evaluation's (``card.py``). ``run.py`` runs it, ``report.py`` says it. docs/check.md explains the output.
"""

from __future__ import annotations

from .report import CheckResult, format_report
from .run import SampleCommand, check

__all__ = ["CheckResult", "SampleCommand", "check", "format_report"]
