"""Human preference labels of a pairs directory: ``labels.jsonl``, written by ``flowrl label``, read by training.

The file is an append-only log, one JSON object per line, so a crash or a restart never loses a click:

    {"seq": 0, "pair": 3, "choice": "left", "preferred": "loser", "time": "2025-01-01T12:00:00Z"}
    {"seq": 1, "undo": 0, "time": "..."}

``choice`` is what the person pressed (left / right / tie / skip); ``preferred`` is what it means for the
stored pair: ``winner`` or ``loser`` (the side of pairs.safetensors the person preferred), ``tie`` or
``skip``. The page shows each pair's two samples in an order fixed by the pair's index (``left_slot``), so
the stored order (the builder's reward) is not always on the same side. An undo record withdraws an earlier
label; a pair's label is its last label not withdrawn. Training uses the pairs whose label is ``winner``
or ``loser``; ties and skips carry no preference and are counted, not trained on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..atomic_files import _fsync as fsync_path
from ..atomic_files import os_error_reason, writing
from ..errors import FlowRLError
from .pairs import SLOTS, PreferencePairs, read_pairs

LABELS_FILE = "labels.jsonl"
CHOICES = ("left", "right", "tie", "skip")


def left_slot(pair: int) -> str:
    """Which stored sample of ``pair`` the page shows on the left: a fixed coin flip per index, so a restart
    shows the same layout and the reward's favourite is on the left only half of the time."""
    return SLOTS[hashlib.sha256(f"flowrl-pair-{pair}".encode()).digest()[0] & 1]


def preferred_slot(pair: int, choice: str) -> str:
    """What a click means for the stored pair: ``winner`` / ``loser``, or ``tie`` / ``skip``."""
    if choice in ("tie", "skip"):
        return choice
    left = left_slot(pair)
    return left if choice == "left" else SLOTS[1 - SLOTS.index(left)]


@dataclass
class LabelState:
    """The labels in force after replaying the log."""

    total: int
    labels: dict[int, dict[str, Any]] = field(default_factory=dict)  # pair -> its label record
    history: list[int] = field(default_factory=list)  # seqs of the labels in force, oldest first (undo pops the last)
    by_seq: dict[int, dict[str, Any]] = field(default_factory=dict)
    next_seq: int = 0

    def apply(self, record: dict[str, Any]) -> None:
        """Replay one record; a record that cannot be applied raises ValueError saying why."""
        seq = record.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < self.next_seq:
            raise ValueError(f"its 'seq' must be an integer above the previous line's ({self.next_seq - 1})")
        if "undo" in record:
            target = record["undo"]
            if target not in self.history:
                raise ValueError(f"it undoes seq {target!r}, which is not a label in force")
            self.history.remove(target)
            del self.labels[self.by_seq[target]["pair"]]
        else:
            pair, choice, preferred = record.get("pair"), record.get("choice"), record.get("preferred")
            if not isinstance(pair, int) or isinstance(pair, bool) or not 0 <= pair < self.total:
                raise ValueError(f"its 'pair' must be an index from 0 to {self.total - 1}")
            if choice not in CHOICES or preferred != preferred_slot(pair, choice):
                raise ValueError(f"its 'choice' must be one of {', '.join(CHOICES)} with the matching 'preferred'")
            if pair in self.labels:  # a relabelled pair (a hand-edited file): the later label stands
                self.history.remove(self.labels[pair]["seq"])
            self.labels[pair] = record
            self.history.append(seq)
        self.by_seq[seq] = record
        self.next_seq = seq + 1

    def first_unlabelled(self) -> int | None:
        return next((i for i in range(self.total) if i not in self.labels), None)

    def counts(self) -> dict[str, int]:
        kinds = [r["preferred"] for r in self.labels.values()]
        return {
            "labelled": len(self.labels),
            "total": self.total,
            "preferences": sum(k in SLOTS for k in kinds),
            "ties": kinds.count("tie"),
            "skips": kinds.count("skip"),
        }


def read_labels(path: Path, total: int) -> LabelState:
    """Replay ``labels.jsonl`` (a missing file: nothing labelled). A line that is not a valid record stops
    everything with one sentence naming it: no label is guessed, dropped or rewritten."""
    state = LabelState(total)
    if not path.exists():
        return state
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise FlowRLError(f"could not read '{path}': {e}.") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("it is not a JSON object")
            state.apply(record)
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            reason = "it is not valid JSON" if isinstance(e, json.JSONDecodeError) else str(e)
            raise FlowRLError(
                f"'{path}' line {number} is not a valid label record ({reason}); nothing was changed: "
                "fix or delete that line and start again."
            ) from None
    return state


class LabelLog:
    """``labels.jsonl`` open for appending: every record is written whole (unbuffered, O_APPEND) and fsynced
    before the caller is told it was saved."""

    def __init__(self, directory: Path, total: int):
        self.path = Path(directory) / LABELS_FILE
        self.state = read_labels(self.path, total)
        created = not self.path.exists()
        with writing(self.path):
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if created:  # the new name must survive a power loss too
            fsync_path(self.path.parent)
        elif os.fstat(self._fd).st_size and not self.path.read_bytes().endswith(b"\n"):
            self._write(b"\n")  # a last line without its newline (edited by hand): the next record starts on its own line

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # os.write may write less than asked
            view = view[os.write(self._fd, view) :]
        os.fsync(self._fd)

    def append(self, record: dict[str, Any]) -> dict[str, Any]:
        """Write ``record`` (seq and time filled in) durably, then apply it. If the write fails the file is cut
        back to what it held, the state is unchanged, and the one-sentence error says nothing was saved."""
        record = {"seq": self.state.next_seq, **record, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        LabelState(self.state.total, dict(self.state.labels), list(self.state.history), dict(self.state.by_seq), self.state.next_seq).apply(
            record
        )  # validate on a copy: a refused record never reaches the file
        end = os.fstat(self._fd).st_size
        try:
            self._write((json.dumps(record) + "\n").encode())
        except OSError as e:
            with contextlib.suppress(OSError):  # no torn line may stay behind for the next reader
                os.ftruncate(self._fd, end)
                os.fsync(self._fd)
            raise FlowRLError(f"could not save the label to '{self.path}': {os_error_reason(e)}; nothing was saved.") from None
        self.state.apply(record)
        return record

    def close(self) -> None:
        os.close(self._fd)


@dataclass
class LabelledPairs:
    pairs: PreferencePairs  # the decisive pairs, the preferred sample first
    counts: dict[str, int]


def labelled_pairs(directory: str | Path) -> LabelledPairs:
    """The pairs of ``directory`` as a person ordered them in its labels.jsonl: winner first, ties, skips and
    unlabelled pairs left out (counted); refused in one sentence when none is left."""
    directory = Path(directory)
    pairs = read_pairs(directory)
    path = directory / LABELS_FILE
    if not path.exists():
        raise FlowRLError(f"'{directory}' has no {LABELS_FILE}; label its pairs first with `flowrl label {directory}`.")
    state = read_labels(path, len(pairs))
    decisive = sorted(i for i, r in state.labels.items() if r["preferred"] in SLOTS)
    counts = state.counts()
    if not decisive:
        raise FlowRLError(
            f"'{path}' prefers one sample in none of the {len(pairs)} pairs ({counts['ties']} ties, {counts['skips']} skips, "
            f"{len(pairs) - counts['labelled']} unlabelled); label some with `flowrl label {directory}`."
        )
    swap = [state.labels[i]["preferred"] == "loser" for i in decisive]
    return LabelledPairs(pairs.reordered(decisive, swap), counts)
