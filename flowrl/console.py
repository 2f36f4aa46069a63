"""Where flowrl's own output goes: standard output carries only what flowrl prints (JSON lines where documented, the
run's summary, "wrote X"); every library's prints (DeepSpeed's accelerator notice at import, a model's remote code)
go to standard error, so a script reading flowrl's stdout reads flowrl's lines only.

``flowrl.cli`` runs a command inside :func:`libraries_on_stderr`; flowrl's output is written with :func:`say`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TextIO

_STDOUT: TextIO | None = None  # the real standard output while a command runs (None: not redirected)


def say(text: str, end: str = "\n") -> None:
    """One piece of flowrl's own output, on the real standard output, flushed (a pipe's reader sees it at once)."""
    print(text, end=end, file=_STDOUT or sys.stdout, flush=True)


@contextlib.contextmanager
def libraries_on_stderr() -> Iterator[None]:
    """For the duration: ``sys.stdout`` is standard error (what libraries print goes there), :func:`say` writes to the
    real standard output."""
    global _STDOUT
    if _STDOUT is not None:  # nested (a command calling another): already redirected
        yield
        return
    _STDOUT, sys.stdout = sys.stdout, sys.stderr
    try:
        yield
    finally:
        sys.stdout, _STDOUT = _STDOUT, None
