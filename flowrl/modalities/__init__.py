"""What differs between training an image/video model and a diffusion LM, behind one narrow protocol.

The training wing (``flowrl/training/``) owns the loop, the engine, checkpoints and logging and is the same for every
model; a :class:`Modality` builds the model-side parts and supplies what depends on the kind of sample: the collector
of the objective's training data (``collector.py``: collect and score), and the held-out evaluation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from ..types import Reward
from .collector import Collector


class Modality(Protocol):
    pipeline: Any  # types.Pipeline (images, video) or types.MaskedLM (text)
    sampler: Any  # the rollout sampler (text: the masked-sampler config section)
    objective: Any  # types.Objective (text: types.TokenObjective)
    module_attr: str  # the pipeline attribute holding the trained module ("denoiser" / "model")
    train_pool: list  # the training (prompt, metadata) pairs
    collector: Collector  # what the objective trains on, collected and scored (the one lookup of objective.trains_on)

    def check(self) -> None:
        """Refuse, in one sentence, an objective / sampler / batch combination this modality cannot train (the collector
        checks what is particular to its kind of data)."""
        ...

    def for_update(self, batch: Any) -> Any:
        """The scored batch as the update re-scores it (images: ``cfg_rollout_only`` re-scores without guidance)."""
        ...

    def evaluate(self, reward: Reward, rank: int, world: int, judge: Reward | None = None) -> tuple[dict[str, float], Any]:
        """Held-out metrics (identical for any number of processes) and what to show of the samples; ``judge``
        (eval.judge, never trained on) scores the same samples as ``eval/judge/*``."""
        ...

    def sample(self, prompts: list[str], num_samples: int, seed: int, **options: Any) -> Any:
        """``num_samples`` samples of each prompt with the current weights (``flowrl.Trainer.sample``)."""
        ...

    def evaluated_items(self, shown: Any) -> dict[str, Any]:
        """What an evaluation spec records of the held-out evaluation (flowrl/evaluation/spec.py): ``prompts``,
        ``metadata``, ``sampler`` (its name and settings) and ``sample_shape`` (None for text)."""
        ...

    def save_eval_samples(self, shown: Any, run_dir: Path, step: int, tag: str | None) -> None:
        """Write the shown evaluation samples (image grids / videos / decoded text) into the run directory."""
        ...


def build_modality(config, device: torch.device, loaded: Any = None, objective: Any = None) -> Modality:
    """The modality of the config's model family (its section's ``modality``): masked-diffusion text or images and
    video. ``loaded``: a model already in memory to use instead of loading ``pipeline.pretrained``; ``objective``: an
    objective object to train instead of building ``config.objective``."""
    if config.pipeline.modality == "text":
        from .text import TextModality

        return TextModality(config, device, loaded, objective)
    from .images import ImageModality

    return ImageModality(config, device, loaded, objective)
