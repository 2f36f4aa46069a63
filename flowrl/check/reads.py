"""Config fields that are set but read by no part of the run.

A key a user writes and no code reads is a silent no-op: a guidance scale under the wrong section, a sampler knob of
a sampler the run does not use, a setting of an objective the run no longer trains. The config refuses unknown keys
(``extra="forbid"``); this finds the known ones that do nothing. While the check builds the run and runs one
iteration, its evaluation and its sampling paths, every attribute read of a config section is recorded (a
temporary ``__getattribute__`` on :class:`~flowrl.sections.Section`, removed afterwards); a key set in the YAML or
the overrides (pydantic's ``model_fields_set``, section by section) that was never read is reported by its dotted
name. A read is a read by code: a section field handed to a constructor counts, whether or not that object is used
later. Reads while the config is validated do not count (a field that only feeds a validator changes nothing).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from ..sections import PartSection, Section

# Keys the check's run does not reach, each read where the reason says; every other set key must be read by it.
# tests/test_check.py runs flowrl train on a preset with all of them set and asserts each of the first group is read.
LIFECYCLE: dict[str, str] = {
    "train.stop_after": "read between iterations by flowrl train (training/run.py), which the check does not loop",
    "eval.every": "the evaluation cadence of flowrl train (training/run.py)",
    "log.checkpoint_every": "the checkpoint cadence of flowrl train (training/run.py)",
    "log.progress": "flowrl train's progress bar (training/run.py)",
}
CHECK_OWN: dict[str, str] = {  # keys the check sets itself for its run, whatever the config says
    "output_dir": "the check runs in a temporary directory of its own",
    "train.prompts_per_iteration": "the check rolls out one prompt group",
    "resume_from": "the check starts afresh (a resume reads it)",
    "resume_allow": "read when a run resumes, which the check does not",
    "overwrite": "read when a run claims an output directory that holds a run, which the check's never does",
}


def set_keys(section: Section, prefix: str = "") -> list[tuple[str, Section, str]]:
    """(dotted key, section, field) of every field set explicitly in ``section`` and the sections under it. A part's
    ``name`` is left out: it chose the section when the config loaded."""
    found = []
    for name in sorted(section.model_fields_set):
        if name == "name" and isinstance(section, PartSection):
            continue
        value, key = object.__getattribute__(section, name), f"{prefix}{name}"
        if isinstance(value, Section) and value.model_fields_set:
            found += set_keys(value, key + ".")
        elif isinstance(value, dict) and value and all(isinstance(v, Section) for v in value.values()):
            for k, v in value.items():
                found += set_keys(v, f"{key}.{k}.") if v.model_fields_set else [(f"{key}.{k}", section, name)]
        else:
            found.append((key, section, name))
    return found


class ReadRecorder:
    """The (section, field) pairs read while ``recording()`` is on, from any thread (a reward worker's too)."""

    def __init__(self):
        self.reads: set[tuple[int, str]] = set()
        self._lock = threading.Lock()
        self._depth = 0

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        reads = self.reads

        def getattribute(obj: Any, name: str) -> Any:
            if name in type(obj).__pydantic_fields__:
                reads.add((id(obj), name))
            return object.__getattribute__(obj, name)

        with self._lock:
            self._depth += 1
            if self._depth == 1:
                Section.__getattribute__ = getattribute  # type: ignore[method-assign]  # every section class inherits it
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    del Section.__getattribute__

    def unread(self, config: Section) -> list[str]:
        """The dotted keys set in ``config`` that were not read, less the ones the check cannot reach or sets itself."""
        exempt = LIFECYCLE | CHECK_OWN
        return [key for key, section, name in set_keys(config) if (id(section), name) not in self.reads and key not in exempt]
