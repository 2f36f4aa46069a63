"""A run's failure in one sentence (docs/failure_behaviour.md): which part raised which error, where, in which iteration.

Any exception that escapes an iteration (or an evaluation, or the writing of its results) reaches one place, the run's
boundary (``Run._fit``, training/run.py). There :func:`describe` names what failed, from the exception's traceback
alone, so nothing in the loop wraps the calls to the parts:

* the part: the outermost frame of the traceback that runs a user's part, one the config names from outside flowrl
  (a reward or judge component, the objective, the model family, the sampler, the prompt source), matched by its
  module and, where one module holds several parts, by the function or class the frame runs;
* the user's own line: the innermost frame in that part's top-level package (below it lie only the libraries it
  called);
* no user's frame: flowrl's own error, an internal error, shown at its innermost line in flowrl (running out of memory
  is said as such).

The full traceback goes to ``error.log`` in the run directory (``error.rank<N>.log`` for process N > 0 of a launch) and,
under ``flowrl train --debug``, to stderr. :class:`RunFailed` carries the sentence the CLI prints, once, with exit 2.
"""

from __future__ import annotations

import datetime
import inspect
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..atomic_files import atomic_path
from ..errors import FlowRLError, first_line, raised_at, shown_path


class RunFailed(FlowRLError):
    """A run ended by a failure: the last completed iteration is on disk where it could be, summary.json says
    ``failed``, the message is the sentence. ``traceback``: this process's own traceback (None when the failure was
    another process's); ``together``: whether every process of a launch agreed on it and stopped together (False
    only when another process could not be reached)."""

    def __init__(self, sentence: str, traceback_text: str | None = None, together: bool = True):
        super().__init__(sentence)
        self.traceback, self.together = traceback_text, together


@dataclass(frozen=True)
class Part:
    """One of a run's parts from outside flowrl: ``kind`` (reward, judge, objective, ...), its name in the config, the
    module it lives in and the qualified names of its own functions or classes there."""

    kind: str
    name: str
    module: str
    owners: tuple[str, ...]

    def runs(self, frame) -> bool:
        """Whether ``frame`` runs code of this part's own function or class (a method, a nested function)."""
        qualname = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
        return any(qualname == owner or qualname.startswith(owner + ".") for owner in self.owners)


def _owner(obj: Any) -> tuple[str, str] | None:
    """(module, qualified name) of a function or class, of a bound method's function, or of an instance's class."""
    target = obj.__func__ if inspect.ismethod(obj) else obj
    if not (inspect.isfunction(target) or inspect.isclass(target)):
        target = type(target)
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    return (module, qualname) if module and qualname else None


def _is_flowrl(module: str) -> bool:
    return module == "flowrl" or module.startswith("flowrl.")


def user_parts(config, reward: Any, judge: Any, modality: Any) -> list[Part]:
    """The parts of this run that come from outside flowrl, in the order they are looked for."""
    from ..prompts import PROMPT_SOURCES
    from ..reward_models.gradients import reward_leaves

    parts: list[Part] = []

    def add(kind: str, name: str, *objects: Any) -> None:
        owners = [o for o in map(_owner, objects) if o is not None and not _is_flowrl(o[0])]
        for module in dict.fromkeys(m for m, _ in owners):
            parts.append(Part(kind, name, module, tuple(q for m, q in owners if m == module)))

    for kind, combined in (("reward", reward), ("judge", judge)):
        if combined is not None:
            for name, leaf in reward_leaves(combined, getattr(combined, "name", kind)):
                while hasattr(leaf, "inner"):  # a user's reward is wrapped (CallableReward.inner, a binary reward's)
                    leaf = leaf.inner
                add(kind, name, leaf)
    add("objective", config.objective.name, type(config.objective), modality.objective)
    add("model family", config.pipeline.name, type(config.pipeline), modality.pipeline)
    add("sampler", config.sampler.name, type(config.sampler), modality.sampler)
    if config.prompts.dataset not in PROMPT_SOURCES.builtin_names():
        add("prompt source", config.prompts.dataset, PROMPT_SOURCES.load(config.prompts.dataset))
    return parts


def blame(error: BaseException, parts: list[Part]) -> Part | None:
    """The part whose code the outermost of ``error``'s user frames runs (None: no part's code is on the traceback)."""
    for frame, _ in traceback.walk_tb(error.__traceback__):
        module = frame.f_globals.get("__name__") or ""
        candidates = [p for p in parts if p.module == module]
        if candidates:
            return next((p for p in candidates if p.runs(frame)), candidates[0])
    return None


def _innermost_flowrl_line(error: BaseException) -> str | None:
    found = None
    for frame, line in traceback.walk_tb(error.__traceback__):
        if _is_flowrl(frame.f_globals.get("__name__") or ""):
            found = f"{shown_path(frame.f_code.co_filename)}:{line}"
    return found


def _out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, MemoryError) or isinstance(error, getattr(torch, "OutOfMemoryError", ()))


def describe(error: BaseException, stage: str, parts: list[Part]) -> tuple[str, bool]:
    """The sentence's first clause for ``error`` raised ``stage`` ("in iteration 2"), and whether it is an internal
    error (flowrl's own bug, to be reported)."""
    if isinstance(error, FlowRLError):  # flowrl's own sentence already says what happened
        return str(error).rstrip().rstrip("."), False
    part = blame(error, parts)
    if part is not None:
        line = raised_at(error, part.module)
        return f"{stage} the {part.kind} '{part.name}' raised {first_line(error)}" + (f" (at {line})" if line else ""), False
    if _out_of_memory(error):
        return f"{stage} the run ran out of memory ({first_line(error)})", False
    line = _innermost_flowrl_line(error)
    return f"{stage} flowrl failed with an internal error, {first_line(error)}" + (f" (at {line})" if line else ""), True


def write_log(run_dir: Path, rank: int, error: BaseException, head: str) -> Path | None:
    """The full traceback, to ``error.log`` (``error.rank<N>.log`` for process N > 0); None when it cannot be written
    (a full disk: the sentence must still be said)."""
    path = run_dir / ("error.log" if rank == 0 else f"error.rank{rank}.log")
    text = f"flowrl: {head}\nprocess {rank}, {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}\n\n" + "".join(
        traceback.format_exception(error)
    )
    try:
        if not run_dir.is_dir():
            return None
        with atomic_path(path) as tmp:
            tmp.write_text(text)
    except (FlowRLError, OSError):
        return None
    return path


def sentence(report: dict[str, Any], saved: str) -> str:
    """The whole sentence: what failed (``report``, agreed by every process), what was saved, where the traceback is."""
    parts = [report["head"], saved]
    log = report.get("log")
    if report.get("internal"):
        parts.append(f"please report this bug in flowrl with the traceback in {log}" if log else "please report this bug in flowrl")
    elif log:
        parts.append(f"the traceback is in {log}")
    return "; ".join(parts) + "."
