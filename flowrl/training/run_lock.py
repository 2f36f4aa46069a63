"""One run per output directory, enforced by the operating system.

A run holds an exclusive ``flock`` on ``<output_dir>/flowrl.lock`` from before it reads or writes anything there
until it has written its last file. A second run into the same directory, or a resume while the first one still
runs, is refused in one sentence naming the holder (pid and host, written into the file). The kernel releases the
lock when the process dies, however it dies (kill -9 included), so a crashed run never leaves a stale lock: the
file stays, the lock does not. Holding it is what lets a new run remove the temporary files a killed one left
(checkpoint.remove_leftover_temporaries): no live run is writing them.

Where the file system cannot lock (some network file systems answer ENOLCK or EOPNOTSUPP), the run goes on without
the guard and says so once. A run that stops before writing anything removes the lock file and the directories it
created for it, so a refused or failed start leaves no trace.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from ..errors import FlowRLError

LOCK_NAME = "flowrl.lock"  # visible: a hidden file in a run directory is a write in progress (checkpoint.py)


class RunLock:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None
        self._created: list[Path] = []

    def acquire(self) -> None:
        """Take the lock, or raise one sentence naming the run that holds it."""
        try:
            import fcntl
        except ImportError:  # not a POSIX system: no guard (flowrl's targets are Linux and macOS)
            return
        self._created = [d for d in [self.run_dir, *self.run_dir.parents] if not d.exists()]
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            from .checkpoint import os_error_reason

            raise FlowRLError(f"could not create output_dir '{self.run_dir}': {os_error_reason(e)}.") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise FlowRLError(
                f"output_dir '{self.run_dir}' is in use by another flowrl run ({holder}); wait for it to end, or choose another output_dir."
            ) from None
        except OSError as e:  # the file system cannot lock: run unguarded, and say so
            os.close(fd)
            print(
                f"flowrl: output_dir '{self.run_dir}' cannot be locked on this file system ({e.strerror or e}); "
                "nothing stops a second run from writing into it.",
                file=sys.stderr,
                flush=True,
            )
            return
        self._fd = fd
        try:  # who holds it, for the refusal's sentence; a full disk leaves it unsaid (the config write names the disk)
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        except OSError:
            pass

    @property
    def held(self) -> bool:
        """Whether this process holds the lock (False before acquire, after release, and where nothing can lock)."""
        return self._fd is not None

    def release(self) -> None:
        """Let go of the lock; in a directory this run created and left empty, remove the file and the directories."""
        if self._fd is None:
            return
        leftover = [p.name for p in self.run_dir.iterdir() if p.name != LOCK_NAME] if self.run_dir.is_dir() else []
        if self._created and not leftover:
            self.path.unlink(missing_ok=True)
            for d in self._created:  # innermost first
                try:
                    d.rmdir()
                except OSError:
                    break
        os.close(self._fd)  # closing the descriptor releases the flock
        self._fd = None


def _read(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 200).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "its pid is unknown"
