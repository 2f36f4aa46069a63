"""``flowrl eval``'s search flags, read into a search section before any model loads.

Each of flowrl's own searches says which flags set its fields (``SearchSection.flags``: ``--best-of`` is best_of's
``n``, ``--smc-lambda`` smc's ``lambda``); the first, its budget flag, chooses it. ``--search NAME [KEY=VALUE ...]``
chooses any search and sets its fields by name. The bounds are the sections' own: a value out of them is one sentence
naming the flag, with the section's interval (``--noise-step must be in (0, 1], got 1.5``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import FlowRLError
from . import SEARCHES, search_section
from .search import SearchSection


def builtin_sections() -> list[type[SearchSection]]:
    return [SEARCHES.section(name) for name in SEARCHES.builtin_names()]


def flag_fields() -> dict[str, Any]:
    """Every flag that sets up one of flowrl's own searches (--best-of, --stop-at, --select, --svdd, ...) -> the field it
    sets (its description, default and bounds)."""
    return {flag: cls.model_fields[field] for cls in builtin_sections() for field, flag in cls.flags.items()}


def budget_flags() -> list[str]:
    """The flags that choose one of flowrl's own searches: --best-of, --svdd, --smc, --noise-search, --rbf."""
    return [cls.flags[cls.budget_field] for cls in builtin_sections()]


def search_from_flags(given: dict[str, Any], search: str | None = None, settings: Sequence[str] = ()) -> SearchSection | None:
    """The search the command line asks for: ``given`` maps each search flag given to its value (``--best-of``: 4);
    ``search`` is ``--search NAME`` and ``settings`` its ``KEY=VALUE`` settings. None: the plain evaluation."""
    chosen = [cls for cls in builtin_sections() if cls.flags[cls.budget_field] in given]
    if len(chosen) + (search is not None) > 1:
        raise FlowRLError(f"give only one of {', '.join(budget_flags())} and --search.")
    if search is not None:
        if given:
            raise FlowRLError(f"{_and(list(given))} set up flowrl's own searches; give --search's settings as --search NAME KEY=VALUE.")
        return search_section({**_read_settings(settings), "name": search})
    if not chosen:
        _refuse_settings_alone(given)
        return None
    cls = chosen[0]
    stray = [flag for flag in given if flag not in cls.flags.values()]
    if stray:
        raise FlowRLError(f"{_and(stray)} do{'es' if len(stray) == 1 else ''} not set up {cls.flags[cls.budget_field]}.")
    fields = {flag: field for field, flag in cls.flags.items()}
    method = {cls.model_fields[fields[flag]].alias or fields[flag]: value for flag, value in given.items()}
    return search_section({**method, "name": cls.model_fields["name"].default}, names={fields[f]: f for f in given})


def _refuse_settings_alone(given: dict[str, Any]) -> None:
    """A setting's flag (``--stop-at``, ``--smc-lambda``) without the flag that chooses its search."""
    if not given:
        return
    owners = [cls for cls in builtin_sections() if set(given) & set(cls.flags.values())]
    choose = _or([f"{cls.flags[cls.budget_field]} {cls.budget_field.upper()}" for cls in owners])
    raise FlowRLError(
        f"{_and(list(given))} set{'s' if len(given) == 1 else ''} up {_or([c.flags[c.budget_field] for c in owners])}; give {choose} too."
    )


def _read_settings(settings: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` settings as a mapping (values read by YAML rules, as config overrides are)."""
    from ..config import apply_override

    tree: dict[str, Any] = {}
    for setting in settings:
        if "=" not in setting or setting.startswith("=") or "." in setting.split("=", 1)[0]:
            raise FlowRLError(f"--search setting '{setting}' must have the form KEY=VALUE.")
        tree = apply_override(tree, setting)
    return tree


def _and(flags: list[str]) -> str:
    return " and ".join(flags) if len(flags) <= 2 else ", ".join(flags[:-1]) + " and " + flags[-1]


def _or(flags: list[str]) -> str:
    return " or ".join(flags) if len(flags) <= 2 else ", ".join(flags[:-1]) + " or " + flags[-1]
