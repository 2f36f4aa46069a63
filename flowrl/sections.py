"""Config sections: the base every part's section builds on.

Each part of a run (a model family, a sampler, an objective) declares its own section next to its code: a
pydantic model holding its knobs with their defaults, bounds and a one-line ``description`` each
(``Field(default, ge=..., description="...")``; docs/config_reference.md and ``flowrl config`` are generated from
them), and a ``build(...)`` that makes the runtime object. ``flowrl/config.py`` composes the run from the sections the registries name
(``flowrl/registry.py``); nothing else lists them. A runtime class takes its parameters from its section and
writes no default of its own for them, so every default is written once (tests/test_sections.py checks it).

Rewards need no hand-written section: a reward class's constructor is its section (the parameters, their
annotations and defaults, read by :func:`signature_section`; their descriptions from the Google-style ``Args:``
block of the class's or the constructor's docstring), so a user's reward class validates its ``reward.kwargs`` the
same way flowrl's own do.
"""

from __future__ import annotations

import inspect
import re
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.errors import PydanticSchemaGenerationError, PydanticUndefinedAnnotation


class Section(BaseModel):
    # allow_inf_nan=False: a NaN or infinite number (a reward weight, a learning rate) can only train nothing
    # or garbage, so it is refused at load time like any other invalid value.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """A field a subclass declares again only to change its default (``name: str = "grpo"``) keeps the
        description its base gave it: pydantic would drop it, and the meaning is written once."""
        super().__pydantic_init_subclass__(**kwargs)
        for key, field in cls.model_fields.items():
            if not field.description:
                field.description = _inherited_description(cls, key)


class PartSection(Section):
    """A section chosen by its ``name`` from a registry (``pipeline``, ``sampler``, ``objective``).

    ``modality`` says which kind of model the part belongs to ("images" for image and video models, "text" for
    masked-diffusion language models); a run whose pipeline, sampler and objective disagree is refused."""

    name: str = Field(description="The registered name (or an import path package.module:Class) choosing this part.")
    modality: ClassVar[str] = "images"
    target: ClassVar[Any] = None  # on a section read from a signature: the class it constructs

    def target_kwargs(self) -> dict[str, Any]:
        """The fields as constructor arguments (``name`` aside), objects kept as they are."""
        return {k: getattr(self, k) for k in type(self).model_fields if k != "name"} | dict(self.model_extra or {})

    def check_run(self, config: Any) -> None:
        """Rules across sections (this part against the rest of the run ``config``): raise ``ValueError`` with
        one sentence naming the keys. Called once the whole run validated."""


class SamplerSection(PartSection):
    """A sampler: ``build(pipeline)`` returns the :class:`flowrl.types.Sampler` for that model."""

    prediction_types: ClassVar[tuple[str, ...]] = ()  # the model outputs it can step with ("flow", "epsilon", ...)

    @property
    def memoryless(self) -> bool:
        """Whether its noise schedule is memoryless (Adjoint Matching's fixed point needs one)."""
        return False

    def build(self, pipeline: Any) -> Any:
        if self.target is None:
            raise NotImplementedError(f"{type(self).__name__} does not say how to build its sampler")
        return self.target(**self.target_kwargs())


@dataclass
class BuildContext:
    """What an objective may need from the rest of the run when it is built."""

    reward_weights: dict[str, float]  # reward component -> weight (GRPO's per-reward advantages, D3PO's Pareto labels)
    sampler: Any  # the run's sampler section
    pipeline: Any  # the built model (``Pipeline``, or ``MaskedLM`` for text)
    run_dir: Any = None  # the run's output_dir (SePPO writes its previous checkpoints there); None outside a run
    group_size: int = 1  # samples per prompt group (train.num_generations): DGPO keeps whole groups in a minibatch


class ObjectiveSection(PartSection):
    """An objective: ``build(context)`` returns the :class:`flowrl.types.Objective`."""

    supports_branching: ClassVar[bool] = False  # B2-DiffuRL's branched rollouts (rollout.branching) train it
    # learns from the differences between a group's rewards (advantages, preferences), so equal rewards in every group
    # teach it nothing; False for one that learns from the reward's gradient (Adjoint Matching)
    learns_from_reward_differences: ClassVar[bool] = True

    def build(self, context: BuildContext) -> Any:
        if self.target is None:
            raise NotImplementedError(f"{type(self).__name__} does not say how to build its objective")
        return self.target(**self.target_kwargs())


class PipelineSection(PartSection):
    """A model family: ``build(device, loaded=None)`` returns the model adapter; ``loaded`` is a model the user
    already has in memory (a diffusers pipeline, a transformers model), used instead of loading ``pretrained``."""

    def build(self, device: Any, loaded: Any = None) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not say how to build its model")

    def default_num_threads(self) -> int | None:
        """torch's intra-op threads this model runs best on, or None for torch's default (train.num_threads overrides).
        The tiny embedded models say 1: their kernels are too small to share, and more threads only add contention."""
        return None

    def probe_samples(self, n: int) -> Any:
        """``n`` samples shaped like this model's output, small: what a user's reward is tried on at start-up,
        before any model loads, so a reward that cannot score them fails in one sentence instead of mid-run."""
        import torch

        return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _inherited_description(cls: type[BaseModel], key: str) -> str | None:
    """The description of field ``key`` in the nearest base of ``cls`` that gives one."""
    for base in cls.__mro__[1:]:
        field = getattr(base, "__pydantic_fields__", {}).get(key)
        if field is not None and field.description:
            return field.description
    return None


# -- sections read from a signature ---------------------------------------------------------------------------
def signature_section(target: Any, label: str, base: type[Section] = Section, skip: tuple[str, ...] = ()) -> type[Section]:
    """A section whose fields are ``target``'s keyword parameters (a class's ``__init__`` or a function's),
    typed by their annotations (unknown or unsupported types accept anything) with the signature's defaults, on
    top of ``base``'s fields (a part's ``name``). ``skip`` names parameters filled by flowrl, not by the config."""
    function = target.__init__ if inspect.isclass(target) else target
    try:
        parameters = inspect.signature(target).parameters  # a class's: its constructor's, without self (none without __init__)
    except (TypeError, ValueError):
        parameters = {}
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # an annotation that does not resolve (a name imported only for type checking)
        hints = {}
    described = documented_args(target)
    fields: dict[str, Any] = {}
    extra = "forbid"
    for pname, p in parameters.items():
        if pname in skip or pname in base.model_fields:
            continue
        if p.kind in (p.VAR_POSITIONAL,):
            continue
        if p.kind is p.VAR_KEYWORD:
            extra = "allow"  # **kwargs: anything goes through to the constructor
            continue
        annotation = hints.get(pname, Any)
        default = ... if p.default is p.empty else p.default
        fields[pname] = (_schema_safe(annotation), Field(default, description=described.get(pname)))
    namespace = {
        "model_config": ConfigDict(extra=extra, arbitrary_types_allowed=True),
        "__module__": getattr(target, "__module__", __name__),
    }
    if "target" in getattr(base, "__class_vars__", ()):
        namespace["target"] = target
    parent = type(f"{label}SectionBase", (base,), namespace)
    return create_model(f"{label}Section", __base__=parent, __module__=parent.__module__, **fields)


_ARG_ENTRY = re.compile(r"^([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*(?:\([^)]*\))?:\s*(.*)$")


def documented_args(target: Any) -> dict[str, str]:
    """Parameter name -> description, from the Google-style ``Args:`` blocks of ``target``'s docstring and its
    constructor's, then its bases' (a parameter a base class documents needs no second line)::

        Args:
            timeout: seconds each attempt may take.
            use, weights: the dimensions to add up
                (a continuation line joins the description).
    """
    owners = [c for c in target.__mro__ if c is not object] if inspect.isclass(target) else [target]
    found: dict[str, str] = {}
    for owner in owners:
        docs = [vars(owner).get("__doc__"), getattr(vars(owner).get("__init__"), "__doc__", None)]
        for doc in docs if inspect.isclass(owner) else [owner.__doc__]:
            for key, text in _args_block(doc).items():
                found.setdefault(key, text)
    return found


def _args_block(doc: str | None) -> dict[str, str]:
    """The entries of the ``Args:`` block of one docstring (continuation lines joined with a space)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), None)
    if start is None:
        return {}
    header, entry_indent, names = _indent(lines[start]), None, []
    entries: dict[str, str] = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        indent = _indent(line)
        if indent <= header:
            break
        entry_indent = indent if entry_indent is None else entry_indent
        match = _ARG_ENTRY.match(line.strip()) if indent == entry_indent else None
        if match:
            names = [n.strip() for n in match[1].split(",")]
            entries.update(dict.fromkeys(names, match[2].strip()))
        else:
            entries.update({n: f"{entries[n]} {line.strip()}".strip() for n in names})
    return entries


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _schema_safe(annotation: Any) -> Any:
    """``annotation`` if pydantic can validate it, else ``Any`` (a torch device, a model object)."""
    from pydantic import TypeAdapter

    try:
        TypeAdapter(annotation)
        return annotation
    except (PydanticSchemaGenerationError, PydanticUndefinedAnnotation, TypeError, NameError):
        return Any
