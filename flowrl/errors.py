"""User-facing errors, and where in a user's own code an exception was raised."""

from __future__ import annotations

import traceback
from pathlib import Path


class FlowRLError(Exception):
    """An error whose message is one sentence for the user (the CLI prints it without a traceback)."""


class Preempted(BaseException):
    """A second SIGTERM: stop at once (a BaseException, so that no ``except Exception`` on the way swallows it)."""


def first_line(error: BaseException, limit: int = 200) -> str:
    """``error`` as ``Type: its message's first line`` (shortened to ``limit`` characters), without a closing period."""
    text = str(error).strip()
    line = text.splitlines()[0].rstrip(".") if text else ""
    line = line if len(line) <= limit else line[: limit - 3] + "..."
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def shown_path(filename: str) -> str:
    """A traceback's file as a person finds it: under the working directory relative to it, flowrl's own files as
    ``flowrl/...``, anything else in full."""
    path = Path(filename)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        pass
    package = Path(__file__).resolve().parent
    try:
        return str(Path(package.name) / path.resolve().relative_to(package))
    except (ValueError, OSError):
        return filename


def raised_at(error: BaseException, module: str) -> str | None:
    """``file:line`` of the innermost frame of ``error``'s traceback that runs code of ``module``'s top-level package
    (a user's own line, below which lie only the libraries it called), or None when no frame does."""
    package = module.split(".")[0]
    found = None
    for frame, line in traceback.walk_tb(error.__traceback__):
        name = frame.f_globals.get("__name__") or ""
        if name == module or name.split(".")[0] == package:
            found = f"{shown_path(frame.f_code.co_filename)}:{line}"
    return found
