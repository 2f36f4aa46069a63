"""The one batching driver every search runs its items through: chunks of items in order, one call each, and the
chunks' results joined into one.

A search's per-chunk function returns a dataclass; :func:`in_batches` joins the chunks field by field, as each
field's metadata says (``ITEMS`` by default for tensors, lists and dicts of tensors):

* ``ITEMS``: one entry per item: tensors concatenated on dim 0, lists joined, dicts of tensors joined per key;
* ``STEPS``: one entry per step, then per item: (S, P) tensors concatenated on dim 1 and lists of per-step (P, ...)
  tensors joined step by step, when every chunk ran the same S steps (dynamic decoding can stop a chunk early; then
  the joined value is empty); a list of plain values (a schedule) is the first chunk's;
* ``PER_ITEM``: an integer count per item, the same in every chunk of fixed shape: the mean over items, rounded
  (chunks of different lengths weighted by their items);
* ``TOTAL``: summed over chunks;
* ``SHARED``: the same for every chunk (a schedule): the first chunk's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

ITEMS, STEPS, PER_ITEM, TOTAL, SHARED = "items", "steps", "per_item", "total", "shared"
T = TypeVar("T")


def joined(kind: str, **kwargs: Any) -> Any:
    """A dataclass field joined across chunks as ``kind`` says (module docstring)."""
    return dataclasses.field(metadata={"join": kind}, **kwargs)


def chunks(count: int, size: int) -> list[list[int]]:
    """Items 0 .. count - 1 in order, ``size`` at a time (the last chunk may be shorter)."""
    size = max(1, size)
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


def in_batches(count: int, size: int, run: Callable[[list[int]], T], progress: Callable[[int], Any] | None = None) -> T:
    """``run(rows)`` on the items ``rows`` of each chunk of ``size`` (``progress`` told the items done after each),
    the chunks' results joined into one."""
    parts, sizes = [], []
    for rows in chunks(count, size):
        parts.append(run(rows))
        sizes.append(len(rows))
        if progress is not None:
            progress(len(rows))
    return join(parts, sizes)


def join(parts: Sequence[T], sizes: Sequence[int]) -> T:
    """One result from the chunks' ``parts`` (dataclasses of one type; ``sizes``: items per chunk)."""
    first = parts[0]
    values = {}
    for f in dataclasses.fields(first):
        kind = f.metadata.get("join", ITEMS)
        values[f.name] = _join([getattr(p, f.name) for p in parts], kind, sizes)
    return type(first)(**values)


def _join(values: list, kind: str, sizes: Sequence[int]) -> Any:
    first = values[0]
    if kind == SHARED:
        return first
    if kind == TOTAL:
        return sum(values)
    if kind == PER_ITEM:
        return round(sum(v * n for v, n in zip(values, sizes)) / sum(sizes)) if len(set(values)) > 1 else first
    if kind == STEPS:
        return _join_steps(values, sizes)
    if isinstance(first, Tensor):
        return torch.cat(values)
    if isinstance(first, dict):
        return {k: torch.cat([v[k] for v in values]) for k in first}
    return [x for v in values for x in v]


def _join_steps(values: list, sizes: Sequence[int]) -> Any:
    """Per-step values: joined when every chunk ran as many steps, else empty."""
    first = values[0]
    same = len({len(v) for v in values}) == 1
    if isinstance(first, Tensor):
        return torch.cat(values, 1) if same else first.new_zeros((0, sum(sizes)))
    if first and not isinstance(first[0], Tensor):
        return first if same else []
    return [torch.cat(step) for step in zip(*values)] if same else []


__all__ = ["ITEMS", "PER_ITEM", "SHARED", "STEPS", "TOTAL", "chunks", "in_batches", "join", "joined"]
