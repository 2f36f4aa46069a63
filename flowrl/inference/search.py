"""The Search protocol: what an inference-time search is given and what it returns.

A search is a part, like an objective: a config section (:class:`SearchSection`) holding its budget and settings,
each with its bounds, default and description, written once; and a method
``search(model, verifier, items) -> SearchOutcome``:

* ``model``: what the search samples with. :class:`ImageSearchModel` for image / video models (the pipeline, the
  sampler the search steps with, the time grid, guidance, the rows one batch holds) or :class:`TextSearchModel` for
  diffusion LMs (the model, its sampler section, temperature, seed, batch size);
* ``verifier``: what it selects by. The run's reward for image / video models (``verifier(samples, prompts,
  metadata) -> RewardOutput``); for a diffusion LM a :class:`TextVerifier`: its selection scores (``--select``:
  likelihood, a reward that never sees the gold answer) and the held-out grader, which measures the chosen
  completions and never selects;
* ``items``: the held-out :class:`Items` (prompts, metadata and, for image / video models, item i's random stream);
* the budget: the section's own fields (N candidates, M per step, particles, rounds).

It returns a :class:`SearchOutcome`: the exact numbers (the evaluation spec's result), the lines ``flowrl eval``
prints, what it writes (the chosen samples, or one row per item), and ``cost``: the counted cost
(``inference/cost.py``), filled by whoever ran it metered, ``flowrl eval`` always. A search never meters itself:
the model and the verifier it is handed are already metered, so a user's search is counted like flowrl's own.

flowrl's own searches are in ``inference/sections.py``; the table of names, entry points (group
``flowrl.searches``) and import paths is ``flowrl.inference.SEARCHES``; docs/inference_scaling.md shows a search
written outside flowrl.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import annotated_types

from ..errors import FlowRLError
from ..sections import PartSection

if TYPE_CHECKING:
    from torch import Tensor

    from .cost import SearchCost


_KINDS = {"images": "image and video models", "text": "diffusion LMs"}
_A_KIND = {"images": "an image or video model", "text": "a diffusion LM"}


@dataclass(frozen=True)
class Items:
    """The held-out items a search serves: prompt i with metadata i and, for image / video models, stream i (the
    plain evaluation's per-item random stream, keyed by the item's content: item i's start noise and every noise of
    its search come from it, so its result does not depend on which items are searched beside it)."""

    prompts: Sequence[str]
    metadata: Sequence[dict[str, Any]]
    streams: Any = None  # RowGenerators, one per item; None for a diffusion LM (its streams are keyed by candidate)
    per_prompt: int = 1  # image / video models: samples per prompt (eval.samples_per_prompt), consecutive items

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, rows: Sequence[int]) -> Items:
        """Items ``rows`` (in that order), with their streams (one generator for all serves every subset in turn)."""
        from ..samplers.rollout import rows_of

        streams = rows_of(self.streams, list(rows)) if self.streams is not None else None
        return Items([self.prompts[i] for i in rows], [self.metadata[i] for i in rows], streams, self.per_prompt)


@dataclass(frozen=True)
class ImageSearchModel:
    """What an image / video search samples with: ``pipeline`` (predict, decode, initial noise), the ``sampler`` it
    steps with (the plain evaluation's deterministic one, or the run's stochastic rollout sampler for a search that
    branches: :attr:`SearchSection.stochastic`), the time grid ``sigmas`` (K + 1 values, 1 -> 0), the guidance scale
    and ``batch_size``, the rows one denoiser call holds (``eval.batch_size``)."""

    pipeline: Any
    sampler: Any
    sigmas: Tensor
    guidance_scale: float = 1.0
    batch_size: int = 16
    modality: ClassVar[str] = "images"

    def require_stochastic(self, what: str, width: int) -> None:
        """Refuse a deterministic sampler for a search that branches ``width`` ways (>= 1) on the sampler's transition
        (``what`` it does)."""
        if width < 1:
            raise ValueError(f"a search needs at least 1 candidate or particle per item, got {width}")
        if not self.sampler.stochastic:
            raise FlowRLError(f"{what} a stochastic transition; sampler '{self.sampler.name}' is deterministic.")

    def start(self, items: Items, generator, initial_noise: Tensor | None = None) -> Tensor:
        """The items' start noise as float32: ``initial_noise``, or drawn first from the items' streams (``generator``)."""
        from ..samplers.rollout import start_noise

        return (initial_noise if initial_noise is not None else start_noise(self.pipeline, len(items), generator)).float()

    def encode(self, items: Items):
        """The condition of ``items``' prompts (image-to-video adapters read the first frame in the metadata too)."""
        if getattr(self.pipeline, "needs_metadata", False):
            return self.pipeline.encode(list(items.prompts), list(items.metadata))
        return self.pipeline.encode(list(items.prompts))


@dataclass(frozen=True)
class TextSearchModel:
    """What a diffusion-LM search samples with: ``lm`` (logits, tokenizer; DiffusionGemma's session), the sampler
    section (``samplers/masked.py`` or ``samplers/entropy_bound.py``), the prompt length, the temperature candidates
    are drawn at, the seed their streams are keyed by, ``batch_size`` items per call (``rollout.batch_size``), DCoLT's
    unmasking policy (``position_scorer``)."""

    lm: Any
    sampler: Any
    prompt_length: int | None
    temperature: float
    seed: int
    batch_size: int
    position_scorer: Any = None
    modality: ClassVar[str] = "text"


@dataclass(frozen=True)
class TextVerifier:
    """A diffusion LM's verifier: the ``--select`` rules and the scores they need (``majority`` needs none; the others
    never see the gold answer), and ``grader``, the run's reward, which may read the gold answer: it measures the
    chosen completions, it never selects."""

    rules: list[str]
    scorers: list[Any]
    grader: Any


@dataclass
class SearchOutcome:
    """What a search returns: ``metrics``, the exact numbers (printed rounded, recorded exactly in the evaluation
    spec); ``lines``, the summary ``flowrl eval`` prints, with the counted-cost line at ``cost_line_at`` (default:
    last); ``extra`` record fields after the metrics; ``settings`` added to the printed settings; what it chose:
    ``samples`` (image / video: (P, *S), written as a grid) or ``rows`` (diffusion LMs: one JSON row per item,
    written beside the output as .jsonl) and ``curves`` (a diffusion LM's accuracy against N, plotted); and
    ``cost``, the counted cost, filled by whoever ran the search metered."""

    metrics: dict[str, float]
    lines: list[str] = field(default_factory=list)
    cost_line_at: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    samples: Tensor | None = None
    rows: list[dict[str, Any]] | None = None
    curves: dict[str, dict[int, float]] | None = None
    cost: SearchCost | None = None


@runtime_checkable
class Search(Protocol):
    """An inference-time search: its budget and settings are its own; ``search`` spends them on ``items``."""

    def search(self, model: ImageSearchModel | TextSearchModel, verifier: Any, items: Items) -> SearchOutcome: ...


class SearchSection(PartSection):
    """The base of every search's section (``--search NAME KEY=VALUE ...``; flowrl's own in sections.py).

    A subclass declares its fields (budget and settings, each with bounds, default and description) and implements
    :meth:`search`. A plain class registered as a search gets a section read from its constructor, and its
    ``search`` is called on the object built from the fields."""

    modalities: ClassVar[tuple[str, ...]] = ("images",)  # the kinds of model it searches: "images", "text"
    # image / video models: True when it branches on the run's stochastic rollout sampler (SVDD, SMC, RBF), False
    # when it samples with the plain evaluation's deterministic sampler (best-of-N, noise search)
    stochastic: ClassVar[bool] = False
    budget_field: ClassVar[str | None] = None  # the field that sets how much it searches (N, M, rounds)
    flags: ClassVar[dict[str, str]] = {}  # field -> the flowrl eval flag that sets it (flowrl's own searches)
    wrong_model: ClassVar[str] = ""  # the sentence refusing a model it cannot search ({flag}: how it was named)
    # flowrl's own: modality -> "module:function", called as function(section, model, verifier, items), imported when run
    implementations: ClassVar[dict[str, str]] = {}

    @property
    def flag(self) -> str:
        """How the command line names this search: its flag, or ``--search NAME``."""
        return self.flags.get(self.budget_field or "", f"--search {self.name}")

    def prepare(self, modality: str, sampler: Any) -> SearchSection:
        """This search as it will run on a model of ``modality`` with the sampler section ``sampler``, its defaults
        that depend on them filled in; raises FlowRLError (one sentence) for what it cannot search. Called before any
        model loads."""
        if modality not in self.modalities:
            kinds = " and ".join(_KINDS[m] for m in self.modalities)
            raise FlowRLError(
                self.wrong_model.format(flag=self.flag) or f"{self.flag} searches {kinds}; this run's model is {_A_KIND[modality]}."
            )
        return self

    def method(self) -> dict[str, Any]:
        """What the evaluation spec records as its method (``flowrl eval --spec`` rebuilds the search from it)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    @classmethod
    def as_recorded(cls, method: dict[str, Any]) -> dict[str, Any]:
        """The search an evaluation spec's ``method`` ran: a section whose default changed after specs were written
        (so they do not record the setting) fills in the value they ran with; by default the method as it is."""
        return method

    @classmethod
    def validated(cls, method: dict[str, Any], names: dict[str, str] | None = None) -> SearchSection:
        """``method`` (``{"name": ..., setting: value}``) as this section; a bad value is one sentence naming the setting
        as ``names`` calls it (a field -> its flag), or, without ``names``, the search and the setting."""
        from pydantic import ValidationError

        try:
            return cls.model_validate(method)
        except ValidationError as e:
            sentence = invalid_setting(e.errors()[0], cls, names or {})
            raise FlowRLError(sentence if names else f"search '{method.get('name')}': {sentence}") from None

    def search(self, model: ImageSearchModel | TextSearchModel, verifier: Any, items: Items) -> SearchOutcome:
        if model.modality in self.implementations:
            from ..registry import import_path

            return import_path(self.implementations[model.modality], "search")(self, model, verifier, items)
        if self.target is None:
            raise NotImplementedError(f"{type(self).__name__} does not say how it searches")
        return self.target(**self.target_kwargs()).search(model, verifier, items)


def invalid_setting(error: dict, section: type[SearchSection], names: dict[str, str]) -> str:
    """One sentence for pydantic's first ``error`` validating ``section``: the setting named as the user named it."""
    field = str(error["loc"][0]) if error["loc"] else ""
    by_alias = {info.alias: key for key, info in section.model_fields.items() if info.alias}
    field = by_alias.get(field, field)
    name = names.get(field, field)
    kind, value = error["type"], error.get("input")
    if kind == "extra_forbidden":
        return f"{name} is not one of its settings ({_settings(section)})."
    if kind == "missing":
        return f"{name} is required (it has no default)."
    interval = _interval(section.model_fields[field].metadata) if field in section.model_fields else None
    if interval and kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"{name} must be {interval}, got {value}."
    msg = error["msg"]
    return f"{name} is invalid: {msg[0].lower()}{msg[1:]}, got {value!r}."


def _settings(section: type[SearchSection]) -> str:
    return ", ".join(info.alias or key for key, info in section.model_fields.items() if key != "name")


def _interval(metadata: list) -> str | None:
    """The bounds a field declares, in words: "at least 1", "in (0, 1]"."""
    low = next((("[", m.ge) for m in metadata if isinstance(m, annotated_types.Ge)), None)
    low = low or next((("(", m.gt) for m in metadata if isinstance(m, annotated_types.Gt)), None)
    high = next(((m.le, "]") for m in metadata if isinstance(m, annotated_types.Le)), None)
    high = high or next(((m.lt, ")") for m in metadata if isinstance(m, annotated_types.Lt)), None)
    if low and high:
        return f"in {low[0]}{low[1]:g}, {high[0]:g}{high[1]}"
    if low:
        return f"{'at least' if low[0] == '[' else 'more than'} {low[1]:g}"
    return f"{'at most' if high[1] == ']' else 'less than'} {high[0]:g}" if high else None


__all__ = ["ImageSearchModel", "Items", "Search", "SearchOutcome", "SearchSection", "TextSearchModel", "TextVerifier"]
