"""Writing files atomically and durably, and operating-system failures as one sentence.

Every file flowrl writes into a run directory, a checkpoint, a pairs directory or the shipped assets goes through
``atomic_path`` (one file) or ``atomic_directory`` (a whole directory): written under a temporary name beside the
target, fsynced, then renamed into place, so neither a crash nor a power loss leaves a partial one. Every
operating-system failure while writing (permission, not a directory, disk full, read-only file system) becomes one
FlowRLError sentence naming the path (``writing``).

Files and directories written atomically get the mode an ordinary ``open(path, "w")`` or ``mkdir`` gives
(0o666 / 0o777 less the umask, or what a default ACL says): the temporary names are created with those requested
modes, not by ``tempfile`` (whose 0o600 / 0o700 would survive the rename), and a writer that replaces a file with a
private one of its own (safetensors writes 0o600) has its mode set back before the rename.

Every temporary name starts with ``TEMP_PREFIX`` (``.flowrl-tmp-``): a process killed mid-write (kill -9, OOM
killer) leaves that name behind, and the next run in the directory removes exactly those names
(``training/checkpoint.py::remove_leftover_temporaries``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from .errors import FlowRLError

TEMP_PREFIX = ".flowrl-tmp-"  # every temporary name flowrl writes starts with it (remove_leftover_temporaries)

# Plain-language reasons for the failures a user can fix; anything else falls back to strerror.
_REASONS = {
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EISDIR: "it is a directory",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.ENAMETOOLONG: "the file name is too long",
    errno.EFBIG: "the file is too large",
}


def os_error_reason(error: BaseException) -> str:
    """A short lower-case reason for an OSError, or for safetensors' wrapped I/O error (it reports the errno
    only in its message: ``I/O error: No space left on device (os error 28)``)."""
    code = getattr(error, "errno", None)
    if code is None and isinstance(error, SafetensorError):
        match = re.search(r"os error (\d+)|code: (\d+)", str(error))
        code = int(match.group(1) or match.group(2)) if match else None
    if code in _REASONS:
        return _REASONS[code]
    text = getattr(error, "strerror", None) or (os.strerror(code) if code else "") or str(error) or type(error).__name__
    return " ".join(text.split()).rstrip(".").lower()


def _is_io_error(error: BaseException) -> bool:
    return isinstance(error, OSError) or (
        isinstance(error, SafetensorError) and re.search(r"I/O error|IoError|os error", str(error)) is not None
    )


def write_error(path: Path | str, error: BaseException) -> FlowRLError:
    return FlowRLError(f"could not write '{path}': {os_error_reason(error)}.")


@contextlib.contextmanager
def writing(path: Path | str) -> Iterator[None]:
    """Turn an operating-system failure inside the block into one sentence naming ``path`` (what the user
    asked to write, not a temporary name)."""
    try:
        yield
    except FlowRLError:
        raise
    except (OSError, SafetensorError) as e:
        if not _is_io_error(e):
            raise
        raise write_error(path, e) from None


def _fsync(path: Path | str) -> None:
    """Flush a file's or a directory's data and metadata to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):  # some file systems cannot fsync a directory
            raise
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file, then every directory bottom-up (a file's name lives in its directory)."""
    paths = [root, *root.rglob("*")]
    for p in paths:
        if p.is_file() and not p.is_symlink():
            _fsync(p)
    for p in sorted((p for p in paths if p.is_dir() and not p.is_symlink()), key=lambda p: len(p.parts), reverse=True):
        _fsync(p)


def _create_unique(parent: Path, prefix: str, create: Callable[[Path], Any]) -> Path:
    """``create`` (which must fail with FileExistsError on an existing name) a new ``parent/prefix<random>``."""
    for _ in range(100):
        candidate = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            create(candidate)
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(errno.EEXIST, "no unused temporary name", str(parent / prefix))


def _new_file(path: Path) -> None:
    # 0o666 as open(path, "w") asks: the kernel applies the umask (or the directory's default ACL)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))


def temporary_file(parent: Path, prefix: str) -> Path:
    """A new empty file ``parent/<TEMP_PREFIX><prefix><random>`` with the mode ``open(path, "w")`` would give it."""
    return _create_unique(parent, TEMP_PREFIX + prefix, _new_file)


def temporary_directory(parent: Path, prefix: str) -> Path:
    """A new directory ``parent/<TEMP_PREFIX><prefix><random>`` with the mode ``mkdir`` would give it (not mkdtemp's 0o700)."""
    return _create_unique(parent, TEMP_PREFIX + prefix, lambda p: os.mkdir(p, 0o777))


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _set_modes(root: Path, file_mode: int, dir_mode: int) -> None:
    """Give every directory under ``root`` ``dir_mode`` and every file ``file_mode`` (``dir_mode``'s execute bits
    added for an executable one); symbolic links are left alone."""
    for p in [root, *root.rglob("*")]:
        if p.is_symlink():
            continue
        if p.is_dir():
            mode = dir_mode
        else:
            mode = file_mode | (dir_mode & 0o111) if _mode(p) & 0o111 else file_mode
        if _mode(p) != mode:
            p.chmod(mode)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary file path beside ``path``; move it into place only if the block succeeds.

    The file is fsynced before the rename and the directory after it, so after a power loss ``path`` holds
    either its old content or the whole new one. The file gets the mode ``open(path, "w")`` would give a new
    file (0o666 less the umask). OS errors are one sentence naming ``path``."""
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_file(path.parent, f"{path.name}-")
        mode = _mode(tmp)  # what open(path, "w") gives a new file here
    try:
        with writing(path):
            yield tmp
            if _mode(tmp) != mode:  # the writer replaced the file with one of its own
                tmp.chmod(mode)
            _fsync(tmp)
            os.replace(tmp, path)
            _fsync(path.parent)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_directory(path: Path, world_readable: bool = True) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; replace ``path`` with it only if the block succeeds.
    The directory gets the mode ``mkdir`` would give it (0o777 less the umask), as the files written into it
    do; ``world_readable``: everything is then made readable by everyone (0o644 / 0o755) whatever the umask,
    for assets shipped in the package.

    Every file and directory is fsynced before the rename, the parent after it. An existing ``path`` is
    moved aside first and removed only once the new one is in place."""
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_directory(path.parent, f"{path.name}-")
    old = None
    try:
        with writing(path):
            probe = temporary_file(tmp, "mode-")
            file_mode, dir_mode = _mode(probe), _mode(tmp)  # what open(path, "w") and mkdir give here
            probe.unlink()
            yield tmp
            # writers that make private files of their own (safetensors: 0o600) get the mode every other file has
            _set_modes(tmp, *((0o644, 0o755) if world_readable else (file_mode, dir_mode)))
            _fsync_tree(tmp)
            if path.exists():
                old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{TEMP_PREFIX}{path.name}-old-"))
                os.replace(path, old / path.name)
            os.replace(tmp, path)
            _fsync(path.parent)
    finally:
        for leftover in (tmp, old):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
