"""Previous checkpoints of the policy kept on disk as reference models (SePPO's random checkpoint replay),
and the choice among them.

A snapshot is a copy of the pipeline's trainable state (``trainable_state_dict``: the whole denoiser for full
fine-tuning, the adapter tensors only for LoRA), taken at the start of every ``every``-th iteration,
iteration 0's being the initial model. Snapshots are written beside the run
(``<output_dir>/reference_checkpoints/iteration_<N>.safetensors``), never held together in memory: the paper
draws uniformly over *every* previous checkpoint, which a long run with full fine-tuning could not keep in RAM.
Only the snapshot in use is read back (and cached until another is chosen).

``keep`` (``max_checkpoints``), when set, is flowrl's window: only the initial snapshot and the newest
``keep - 1`` are drawn. Files that leave the window stay on disk, since a checkpoint written earlier may still
name them (a resume from it draws from the snapshots it recorded).

A reference forward swaps a snapshot into the live module and copies the current weights back afterwards
(``swapped_in``): exact, and it needs no second model. The copies are in place, so autograd refuses a backward
through any graph built before the swap: the objective computes its reference outputs first.

Resume: the snapshots' iterations and files are part of the objective's state (``state_dict``, in the
checkpoint's ``trainer_state.json``); a resumed run draws from exactly the snapshots the uninterrupted run held.
Every process writes the same bytes (the weights are equal across processes) through an atomic rename, so a
shared and a per-node output directory both work.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..atomic_files import atomic_path
from ..errors import FlowRLError

# latest: SPIN's previous iterate; rpc: the paper's random checkpoint replay; initial: the paper's third
# baseline, always the initial model; psm: flowrl's own reward-weighted choice (not in the paper).
Strategy = Literal["latest", "rpc", "initial", "psm"]
FOLDER = "reference_checkpoints"


class CheckpointReplay:
    def __init__(self, every: int, keep: int | None = None, run_dir: Path | str | None = None):
        self.every, self.keep = every, keep
        # outside a run (an objective built by hand) the snapshots go to a temporary folder of this process
        self.directory = Path(run_dir) / FOLDER if run_dir is not None else Path(tempfile.mkdtemp(prefix="flowrl-replay-"))
        self.snapshots: dict[int, Path] = {}  # iteration -> its file, ascending
        self._cached: tuple[int, dict[str, Tensor]] | None = None

    def drawable(self) -> list[int]:
        """The snapshots a choice draws from: all of them, or the initial one and the newest ``keep - 1``."""
        keys = sorted(self.snapshots)
        if self.keep is None or len(keys) <= self.keep:
            return keys
        return keys[:1] + (keys[len(keys) - self.keep + 1 :] if self.keep > 1 else [])

    def maybe_snapshot(self, pipeline, iteration: int) -> None:
        """Write the current weights as iteration ``iteration``'s checkpoint when one is due."""
        if iteration % self.every or iteration in self.snapshots:
            return
        path = self.directory / f"iteration_{iteration:06d}.safetensors"
        weights = {k: v.detach().to("cpu").contiguous() for k, v in pipeline.trainable_state_dict().items()}
        with atomic_path(path) as tmp:
            save_file(weights, str(tmp))
        self.snapshots[iteration] = path

    def choose(
        self, strategy: Strategy, generator: torch.Generator, quality: dict[int, float] | None = None, temperature: float = 1.0
    ) -> int:
        """The iteration of the snapshot to use as reference.

        latest: the newest. rpc: uniform over every drawable snapshot, the initial one included. initial: the
        initial model. psm (flowrl's own): ``softmax(quality / temperature)`` over the drawable snapshots, a
        snapshot never measured taking the best measured quality (so each new checkpoint is tried soon), all
        alike before any is.
        """
        keys = self.drawable()
        if strategy == "latest":
            return keys[-1]
        if strategy == "initial":
            return keys[0]
        if strategy == "rpc":
            return keys[int(torch.randint(len(keys), (1,), generator=generator))]
        known = [quality[k] for k in keys if quality and k in quality]
        best = max(known) if known else 0.0
        q = torch.tensor([quality.get(k, best) if quality else best for k in keys], dtype=torch.float64)
        probs = torch.softmax(q / temperature, 0)
        return keys[int(torch.multinomial(probs, 1, generator=generator))]

    def weights(self, iteration: int) -> dict[str, Tensor]:
        """Snapshot ``iteration``'s tensors, read from its file (the last one read is cached)."""
        if self._cached is None or self._cached[0] != iteration:
            path = self.snapshots[iteration]
            try:
                self._cached = (iteration, load_file(str(path)))
            except (OSError, ValueError) as e:
                raise FlowRLError(f"reference checkpoint '{path}' cannot be read ({str(e).splitlines()[0][:120]}).") from None
        return self._cached[1]

    @contextlib.contextmanager
    def swapped_in(self, pipeline, iteration: int) -> Iterator[None]:
        """Run the pipeline with snapshot ``iteration``'s weights; the current ones are restored bit for bit."""
        snapshot = self.weights(iteration)
        current = {k: v.detach().clone() for k, v in pipeline.trainable_state_dict().items()}
        with torch.no_grad():
            pipeline.load_trainable_state_dict(snapshot)
        try:
            yield
        finally:
            with torch.no_grad():
                pipeline.load_trainable_state_dict(current)

    # -- resume: the snapshots' files travel in the objective's state ---------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"snapshots": {str(k): str(v) for k, v in self.snapshots.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A recorded file that has moved with its run (the run folder copied or renamed) is found in this run's
        folder; one that is nowhere is refused in one sentence."""
        snapshots: dict[int, Path] = {}
        for key, recorded in state.get("snapshots", {}).items():
            path = Path(recorded)
            if not path.is_file() and (self.directory / path.name).is_file():
                path = self.directory / path.name
            if not path.is_file():
                raise FlowRLError(
                    f"the run's reference checkpoint for iteration {key} ('{recorded}') is missing; SePPO's checkpoint replay "
                    f"draws from the files in '{FOLDER}/' beside the run, so resume with that folder in place."
                )
            snapshots[int(key)] = path
        self.snapshots = dict(sorted(snapshots.items()))
        self._cached = None


def running_mean(stats: dict[int, list[float]], key: int, value: float) -> None:
    """Fold ``value`` into ``stats[key] = [mean, count]`` (non-finite values are left out)."""
    if not math.isfinite(value):
        return
    mean, count = stats.get(key, [0.0, 0])
    stats[key] = [(mean * count + value) / (count + 1), count + 1]
