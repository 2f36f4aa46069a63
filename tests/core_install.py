"""An environment holding exactly what `make install` gives (flowrl and its core dependencies, no extras), or the core
plus named extras, made in a second from the test environment: a venv without pip whose site-packages links only the
files of the distributions in that dependency closure (read from their installed metadata), with a console script for
each of their entry points. A command run in it finds what a user's install has and nothing more: an extra's package is
absent, not mocked.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def _requirements(name: str) -> list[str]:
    """A distribution's requirement lines; flowrl's own from this checkout's pyproject.toml (the installed metadata of
    an editable install can predate the file)."""
    if _name(name) == "flowrl":
        project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
        lines = list(project["dependencies"])
        for extra, reqs in project["optional-dependencies"].items():
            lines += [f'{r}; extra == "{extra}"' for r in reqs]
        return lines
    return _distribution(name).requires or []


def _site() -> Path:
    """The test environment's site-packages."""
    return Path(md.distribution("torch").locate_file(""))


def _distribution(name: str) -> md.Distribution:
    """The installed distribution ``name`` of the test environment (never a build's metadata in the working
    directory, such as the checkout's own flowrl.egg-info)."""
    found = list(md.Distribution.discover(name=name, path=[str(_site())]))
    if not found:
        raise md.PackageNotFoundError(name)
    return found[0]


def closure(extras: tuple[str, ...] = ()) -> set[str]:
    """The normalised names of flowrl's distributions with ``extras``: flowrl, every core requirement, and their own
    (marker-evaluated, without any extra of theirs unless asked for), recursively."""
    names: set[str] = set()
    done: set[tuple[str, tuple[str, ...]]] = set()
    todo: list[tuple[str, tuple[str, ...]]] = [("flowrl", tuple(extras))]
    while todo:
        name, wanted = todo.pop()
        if (_name(name), wanted) in done:
            continue
        done.add((_name(name), wanted))
        try:
            lines = _requirements(name)
        except md.PackageNotFoundError:
            continue  # an optional, platform-specific requirement this machine does not have
        names.add(_name(name))
        for line in lines:
            req = Requirement(line)
            envs = [{"extra": e} for e in (wanted or ("",))]
            if req.marker is not None and not any(req.marker.evaluate(e) for e in envs):
                continue
            todo.append((req.name, tuple(sorted(req.extras))))
    return names


def _top_entries(dist: md.Distribution, site: Path) -> set[str]:
    """The first path component of each of the distribution's files that lies in ``site`` (its packages, modules,
    dist-info, .pth and editable finder)."""
    entries = set()
    for file in dist.files or []:
        parts = Path(file).parts
        if parts and parts[0] not in ("..", "") and not parts[0].startswith("__pycache__"):
            entries.add(parts[0])
    return {e for e in entries if (site / e).exists()}


def make_environment(where: Path, extras: tuple[str, ...] = ()) -> Path:
    """A venv at ``where`` with flowrl's core (and ``extras``) linked in; returns its bin directory."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    site = _site()
    (target,) = list(where.glob("lib/python*/site-packages"))
    bin_dir = where / "bin"
    for name in sorted(closure(extras)):
        try:
            dist = _distribution(name)
        except md.PackageNotFoundError:
            continue
        for entry in _top_entries(dist, site):
            link = target / entry
            if not link.exists():
                link.symlink_to(site / entry)
        for ep in dist.entry_points.select(group="console_scripts"):
            module, _, attr = ep.value.partition(":")
            script = bin_dir / ep.name
            script.write_text(
                f"#!{bin_dir / 'python'}\nimport sys\nfrom {module} import {attr.split('.')[0]} as _main\n"
                f"sys.exit(_main{('.' + attr.split('.', 1)[1]) if '.' in attr else ''}())\n"
            )
            script.chmod(0o755)
    return bin_dir


def environment_variables(bin_dir: Path) -> dict[str, str]:
    """os.environ with ``bin_dir`` first on PATH and this test run's own interpreter settings removed."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(bin_dir.parent)
    return env
