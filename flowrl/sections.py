"""Config sections: the base every part's section builds on.

Each part of a run (a model family, a sampler, an objective) declares its own section next to its code: a
pydantic model holding its knobs with their defaults, bounds and comments, and a ``build(...)`` that makes the
runtime object. ``flowrl/config.py`` composes the run from the sections the registries name
(``flowrl/registry.py``); nothing else lists them. A runtime class takes its parameters from its section and
writes no default of its own for them, so every default is written once (tests/test_sections.py checks it).

Rewards need no hand-written section: a reward class's constructor is its section (the parameters, their
annotations and defaults, read by :func:`signature_section`), so a user's reward class validates its
``reward.kwargs`` the same way flowrl's own do.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, create_model
from pydantic.errors import PydanticSchemaGenerationError, PydanticUndefinedAnnotation


class Section(BaseModel):
    # allow_inf_nan=False: a NaN or infinite number (a reward weight, a learning rate) can only train nothing
    # or garbage, so it is refused at load time like any other invalid value.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class PartSection(Section):
    """A section chosen by its ``name`` from a registry (``pipeline``, ``sampler``, ``objective``).

    ``modality`` says which kind of model the part belongs to ("images" for image and video models, "text" for
    masked-diffusion language models); a run whose pipeline, sampler and objective disagree is refused."""

    name: str
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
        fields[pname] = (_schema_safe(annotation), ... if p.default is p.empty else p.default)
    namespace = {
        "model_config": ConfigDict(extra=extra, arbitrary_types_allowed=True),
        "__module__": getattr(target, "__module__", __name__),
    }
    if "target" in getattr(base, "__class_vars__", ()):
        namespace["target"] = target
    parent = type(f"{label}SectionBase", (base,), namespace)
    return create_model(f"{label}Section", __base__=parent, __module__=parent.__module__, **fields)


def _schema_safe(annotation: Any) -> Any:
    """``annotation`` if pydantic can validate it, else ``Any`` (a torch device, a model object)."""
    from pydantic import TypeAdapter

    try:
        TypeAdapter(annotation)
        return annotation
    except (PydanticSchemaGenerationError, PydanticUndefinedAnnotation, TypeError, NameError):
        return Any
