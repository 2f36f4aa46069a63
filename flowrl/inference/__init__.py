"""Inference-time search: spend more compute at sampling time to get samples a verifier prefers (docs/inference_scaling.md).

A search is a part, like an objective (search.py: the ``Search`` protocol and ``SearchSection``); flowrl's own are
sections.py's (best-of-N, SVDD, SMC, noise search, RBF as released, flowrl's RBF with rollover), each with its
algorithm beside it, for image / video models and for diffusion LMs. ``SEARCHES`` is the one table of the names
``flowrl eval --search NAME`` and an evaluation spec's method take: flowrl's own, what ``flowrl.register_search``
added, installed packages' entry points (group ``flowrl.searches``), and import paths ``package.module:Class``.

What every search shares: batching.py (the one batching driver), cost.py (the counted cost), run.py (a search run
metered on a config's model, and the record ``flowrl eval`` prints), flags.py (``flowrl eval``'s search flags).
"""

from __future__ import annotations

from typing import Any

from ..errors import FlowRLError
from ..registry import Registry
from .search import ImageSearchModel, Items, Search, SearchOutcome, SearchSection, TextSearchModel, TextVerifier

__all__ = [
    "SEARCHES",
    "ImageSearchModel",
    "Items",
    "Search",
    "SearchOutcome",
    "SearchSection",
    "TextSearchModel",
    "TextVerifier",
    "search_section",
]


def _plain_class_section(target: Any, name: str) -> type[SearchSection]:
    """The section of a search that is not a section class: its constructor's parameters, and its ``modalities`` and
    ``stochastic`` as the class says."""
    from ..registry import section_label
    from ..sections import signature_section

    section = signature_section(target, section_label(name), base=SearchSection)
    for attribute in ("modalities", "stochastic"):
        if hasattr(target, attribute):
            setattr(section, attribute, getattr(target, attribute))
    return section


SEARCHES = Registry(
    "search",
    "--search",
    {
        "best_of": "flowrl.inference.sections:BestOfConfig",
        "svdd": "flowrl.inference.sections:SVDDConfig",
        "smc": "flowrl.inference.sections:SMCConfig",
        "noise_search": "flowrl.inference.sections:NoiseSearchConfig",
        "rbf": "flowrl.inference.sections:RBFConfig",
        "rbf_rollover": "flowrl.inference.sections:RBFRolloverConfig",
    },
    base=SearchSection,
    derive=_plain_class_section,
    group="flowrl.searches",
)


def search_section(method: dict[str, Any], names: dict[str, str] | None = None) -> SearchSection:
    """The search ``method`` describes (``{"name": ..., setting: value}``: an evaluation spec's method, or what the
    command line set), validated by its section. A bad value is one sentence naming the setting as ``names`` calls it
    (a field -> its flag), or, without ``names``, the search and the setting."""
    name = method.get("name")
    if not isinstance(name, str) or name not in SEARCHES:
        raise FlowRLError(SEARCHES.unknown(name))
    return SEARCHES.section(name).validated({**method, "name": name}, names)
