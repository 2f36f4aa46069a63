"""What differs between training an image/video model and a diffusion LM, behind one narrow protocol.

The Trainer (``flowrl/trainer.py``) owns the loop, the optimizer, checkpoints and logging and is the same
for every model; a :class:`Modality` builds the model-side parts and supplies the phases whose content
depends on the kind of sample: collect, what the reward reads, and the held-out evaluation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from ..types import Reward, RewardOutput
from .reward_overlap import RolloutScoring


class Modality(Protocol):
    pipeline: Any  # types.Pipeline (images, video) or types.MaskedLM (text)
    sampler: Any  # the rollout sampler (text: the masked-sampler config section)
    objective: Any  # types.Objective (text: types.TokenObjective)
    module_attr: str  # the pipeline attribute holding the trained module ("denoiser" / "model")
    train_pool: list  # the training (prompt, metadata) pairs

    def check(self) -> None:
        """Refuse, in one sentence, an objective / sampler / batch combination this modality cannot train."""
        ...

    def collect(self, iteration: int, rank: int, world: int, scoring: RolloutScoring | None = None) -> Any:
        """This process's training batch for ``iteration``: what ``objective.trains_on`` names, keyed by
        (seed, iteration, rank) so a resumed run collects exactly what the uninterrupted one did. ``scoring``
        (``reward_overlap.py``): where finished rollout chunks are handed over to be decoded, and with
        rollout.overlap_reward scored on a worker thread while generation goes on."""
        ...

    def score(
        self, batch: Any, reward: Reward, with_gradient: bool, scoring: RolloutScoring | None = None
    ) -> tuple[RewardOutput, torch.Tensor | None]:
        """The reward of the batch's samples, and with ``with_gradient`` its gradient w.r.t. the final state; with an
        overlapped ``scoring``, the rewards its worker computed during collect, joined in order."""
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
