"""Previous checkpoints kept in memory as reference models (SePPO), and the choice among them.

A snapshot is a copy of the pipeline's trainable state (``trainable_state_dict``: the whole denoiser for
full fine-tuning, the adapter tensors only for LoRA) taken at the start of every ``every``-th iteration,
iteration 0's being the initial model. At most ``capacity`` are kept: when one more arrives, the oldest
*after the initial one* goes, so the initial model stays drawable (SePPO's random previous checkpoint
includes it).

A reference forward swaps a snapshot into the live module and copies the current weights back
afterwards (``swapped_in``): exact, and it needs no second model. The copies are in place, so autograd
refuses a backward through any graph built before the swap: the objective computes its reference
outputs first.

The ring is the objective's ``extra_module``: its tensors travel in the checkpoint's weights file as
``objective.<iteration>.<name>`` (it has no parameters, so the optimizer never sees it), which makes a
resumed run draw from exactly the snapshots the uninterrupted run held.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import Tensor

Strategy = Literal["latest", "rpc", "psm"]


class ReferenceRing(torch.nn.Module):
    def __init__(self, every: int, capacity: int):
        super().__init__()
        self.every, self.capacity = every, capacity
        self.snapshots: dict[int, dict[str, Tensor]] = {}  # iteration -> trainable state, ascending

    def maybe_snapshot(self, pipeline, iteration: int) -> None:
        """Keep the current weights as iteration ``iteration``'s checkpoint when one is due."""
        if iteration % self.every or iteration in self.snapshots:
            return
        self.snapshots[iteration] = {k: v.detach().clone() for k, v in pipeline.trainable_state_dict().items()}
        while len(self.snapshots) > self.capacity:
            del self.snapshots[sorted(self.snapshots)[1]]  # the oldest after the initial one

    def choose(
        self, strategy: Strategy, generator: torch.Generator, quality: dict[int, float] | None = None, temperature: float = 1.0
    ) -> int:
        """The iteration of the snapshot to use as reference.

        latest: the newest (SPIN's previous iterate). rpc: uniform over every snapshot held, the initial
        one included. psm: ``softmax(quality / temperature)`` over the snapshots, a snapshot never measured
        taking the best measured quality (so each new checkpoint is tried soon), all alike before any is.
        """
        keys = sorted(self.snapshots)
        if strategy == "latest":
            return keys[-1]
        if strategy == "rpc":
            return keys[int(torch.randint(len(keys), (1,), generator=generator))]
        known = [quality[k] for k in keys if quality and k in quality]
        best = max(known) if known else 0.0
        q = torch.tensor([quality.get(k, best) if quality else best for k in keys], dtype=torch.float64)
        probs = torch.softmax(q / temperature, 0)
        return keys[int(torch.multinomial(probs, 1, generator=generator))]

    @contextlib.contextmanager
    def swapped_in(self, pipeline, iteration: int) -> Iterator[None]:
        """Run the pipeline with snapshot ``iteration``'s weights; the current ones are restored bit for bit."""
        current = {k: v.detach().clone() for k, v in pipeline.trainable_state_dict().items()}
        with torch.no_grad():
            pipeline.load_trainable_state_dict(self.snapshots[iteration])
        try:
            yield
        finally:
            with torch.no_grad():
                pipeline.load_trainable_state_dict(current)

    # -- checkpointing: the trainer saves an objective's extra_module with the weights --------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:  # type: ignore[override]
        return {f"{it}.{name}": t for it, weights in self.snapshots.items() for name, t in weights.items()}

    def load_state_dict(self, state: dict[str, Tensor], strict: bool = True, assign: bool = False):  # type: ignore[override]
        snapshots: dict[int, dict[str, Tensor]] = {}
        for key, t in state.items():
            it, name = key.split(".", 1)
            snapshots.setdefault(int(it), {})[name] = t.clone()
        self.snapshots = dict(sorted(snapshots.items()))
        return torch.nn.modules.module._IncompatibleKeys([], [])


def running_mean(stats: dict[int, list[float]], key: int, value: float) -> None:
    """Fold ``value`` into ``stats[key] = [mean, count]`` (non-finite values are left out)."""
    if not math.isfinite(value):
        return
    mean, count = stats.get(key, [0.0, 0])
    stats[key] = [(mean * count + value) / (count + 1), count + 1]
