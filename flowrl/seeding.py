"""Deterministic random streams derived from (seed, iteration, process, purpose).

Every random draw of a training iteration comes from a stream keyed by the iteration, so a run resumed
from a checkpoint replays exactly the draws an uninterrupted run would make: no RNG state to save.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

PURPOSES = {
    "prompts": 0,
    "rollout": 1,
    "update": 2,
    "eval": 3,
    "init": 4,
    "pairs": 5,
    "pair_prompts": 6,
    "initial_noise": 7,
    "eval_content": 8,
}


def derive_seed(seed: int, *keys: int) -> int:
    return int(np.random.SeedSequence([seed, *keys]).generate_state(1, dtype=np.uint64)[0] % (2**63 - 1))


def torch_generator(seed: int, iteration: int, rank: int, purpose: str, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(derive_seed(seed, iteration, rank, PURPOSES[purpose]))


def python_rng(seed: int, iteration: int, rank: int, purpose: str) -> random.Random:
    return random.Random(derive_seed(seed, iteration, rank, PURPOSES[purpose]))


def seed_initialisation(seed: int) -> None:
    """Seed the global torch RNG that fresh modules draw their initial weights from (LoRA adapters, DCoLT's
    unmasking-policy head), identically on every process, so a run's seed fixes its initial weights."""
    torch.manual_seed(derive_seed(seed, 0, 0, PURPOSES["init"]))


def global_draw(draw, per_process: int, rank: int, world: int) -> list:
    """This process's share of a draw made for the whole world: ``draw(per_process * world)`` returns the
    global list (from a stream keyed without the rank), and process ``rank`` keeps its contiguous slice. So
    the prompts an N-process run trains on are exactly a 1-process run's, split in N."""
    return list(draw(per_process * world))[rank * per_process : (rank + 1) * per_process]


def global_rows(group_ids: torch.Tensor, per_group: int) -> torch.Tensor:
    """The global sample index of each row of a batch laid out group by group, ``per_group`` rows a group:
    the key of each row's own random stream (``RowGenerators``)."""
    return group_ids * per_group + torch.arange(per_group).repeat(len(group_ids) // per_group)


_ROW_STREAM = 2**31


def content_key(prompt: str, metadata: dict[str, Any] | None = None) -> int:
    """A 128-bit integer naming a held-out item by its content: the prompt text and the metadata values that
    are plain JSON (a digit label, a gold answer, an image path). Values that are not (a PIL image, a tensor)
    are left out, so two items that differ only there share a key."""
    plain = {k: v for k, v in sorted((metadata or {}).items()) if _is_plain_json(v)}
    text = json.dumps([prompt, plain], sort_keys=True, ensure_ascii=False)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:16], "big")


def _is_plain_json(value: Any) -> bool:
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain_json(v) for k, v in value.items())
    return False


class RowGenerators:
    """One random stream per sample row, keyed by (seed, iteration, purpose, the row's global key).

    A rollout drawn from a single ``torch.Generator`` depends on how the rows are batched: which process
    holds them and which rollout chunk. Keying each row's stream by its global index (a global group id,
    or a global sample index) makes every sample's noise, initial and per step, the same whichever
    process and chunk it lands in, so an N-process run samples exactly what a 1-process run samples.
    Rows that share a key (every member of a group sharing its initial noise) draw identical numbers.
    """

    def __init__(self, generators: list[torch.Generator]):
        self.generators = generators

    @classmethod
    def keyed(cls, seed: int, iteration: int, purpose: str, keys) -> RowGenerators:
        """CPU streams (the draws are moved to the model's device), one per key."""
        tag = _ROW_STREAM + PURPOSES[purpose]  # where a per-process stream has its rank: never a rank, so no stream is shared
        return cls([torch.Generator().manual_seed(derive_seed(seed, iteration, tag, int(k))) for k in keys])

    @classmethod
    def by_content(
        cls, seed: int, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], sample_index: Sequence[int]
    ) -> RowGenerators:
        """Evaluation streams, one per item, keyed by (seed, the item's prompt content, its sample index among
        that prompt's samples) and nothing else: the same prompt gets the same noise whichever other prompts
        are evaluated with it, in whatever order, on however many processes (training keys by global index
        instead, see ``keyed``)."""
        if not len(prompts) == len(metadata) == len(sample_index):
            raise ValueError(f"{len(prompts)} prompts, {len(metadata)} metadata and {len(sample_index)} sample indices")
        tag = PURPOSES["eval_content"]
        return cls(
            [
                torch.Generator().manual_seed(derive_seed(seed, tag, content_key(p, m), int(i)))
                for p, m, i in zip(prompts, metadata, sample_index, strict=True)
            ]
        )

    def __len__(self) -> int:
        return len(self.generators)

    def __getitem__(self, index) -> RowGenerators:
        if isinstance(index, slice):
            return RowGenerators(self.generators[index])
        return RowGenerators([self.generators[int(i)] for i in index])

    def randn(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(B, *shape[1:]) standard normal noise, row b drawn from stream b; ``shape[0]`` must equal B."""
        return self._rows(torch.randn, shape, dtype)

    def rand(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(B, *shape[1:]) uniforms on [0, 1), row b drawn from stream b."""
        return self._rows(torch.rand, shape, dtype)

    def _rows(self, draw, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if shape[0] != len(self.generators):
            raise ValueError(f"{shape[0]} rows asked of {len(self.generators)} row streams")
        return torch.stack([draw(tuple(shape[1:]), generator=g, device=g.device, dtype=dtype) for g in self.generators])
