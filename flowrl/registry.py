"""What a run's config can name, one table per kind, open to users' own code.

A config names parts by name: ``pipeline.name`` (a model family), ``sampler.name``, ``objective.name``, the keys
of ``reward.components`` and ``prompts.dataset``. Each kind has one :class:`Registry`; a name is looked up in
this order:

1. the table: flowrl's own parts (``name -> "module:attribute"``, imported only when used, so naming one reward
   never imports another's heavy dependencies) and whatever ``flowrl.register_*`` added in this process;
2. installed packages' entry points in the group ``flowrl.<kind>s`` (``flowrl.rewards``, ``flowrl.objectives``,
   ``flowrl.pipelines``, ``flowrl.samplers``, ``flowrl.prompts``), so ``pip install my-rewards`` is enough::

       [project.entry-points."flowrl.rewards"]
       sharpness = "my_rewards.scores:sharpness"

3. an import path ``"package.module:attribute"`` written in the config itself.

Every failure (an unknown name, a module that does not import, a missing attribute) is one sentence naming the
config key and the name, raised before any model loads. This module is the base layer: it imports nothing of
flowrl but its error type and the section base.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import sys
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import SerializeAsAny, WrapValidator
from pydantic_core import PydanticCustomError

from .errors import FlowRLError
from .sections import Section, signature_section

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_entry_point_cache: dict[tuple, dict[str, importlib.metadata.EntryPoint]] = {}


def is_import_path(name: str) -> bool:
    """``"package.module:attribute"`` (the attribute may be dotted: ``module:Class.method``)."""
    return bool(_IMPORT_PATH.match(name))


def import_path(spec: str, what: str) -> Any:
    """The object ``"package.module:attribute"`` names; one sentence (naming ``what``) when it cannot be had."""
    module_name, _, attribute = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # a module in the working directory, as `python -m` finds it (installed ones first)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        where = "" if missing == module_name else f" (it needs '{missing}', which is not installed)"
        if missing == module_name.split(".")[0] or missing == module_name:
            where = f" (no module named '{missing}' on the Python path; is its package installed?)"
        raise FlowRLError(f"{what} '{spec}' cannot be imported{where}.") from None
    except Exception as e:  # the user's module raised while importing
        raise FlowRLError(f"{what} '{spec}': importing '{module_name}' failed ({type(e).__name__}: {_first_line(e)}).") from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise FlowRLError(f"{what} '{spec}': module '{module_name}' has no attribute '{attribute}'.")
        obj = getattr(obj, part)
    return obj


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


class Registry:
    """One kind's name table (see the module docstring). ``kind`` is the singular noun used in messages
    ("reward"); ``key`` the config key that names it ("reward.components")."""

    def __init__(
        self,
        kind: str,
        key: str,
        builtins: dict[str, str],
        base: type[Section] = Section,
        derive: Callable[[Any, str], type[Section]] | None = None,
        group: str | None = None,
    ):
        self.kind, self.key, self.base = kind, key, base
        self.derive = derive  # the section of a target that is not a section class; default: its signature
        self.group = group or f"flowrl.{kind}s"
        self._table: dict[str, Any] = dict(builtins)  # name -> "module:attribute" or the object itself
        self._builtins = frozenset(builtins)
        self._loaded: dict[str, Any] = {}
        self._sections: dict[str, type[Section]] = {}

    # -- what is known -------------------------------------------------------------------------------------
    def builtin_names(self) -> list[str]:
        return [n for n in self._table if n in self._builtins]

    def names(self) -> list[str]:
        """flowrl's own names, then those registered in this process, then installed packages' entry points."""
        return list(dict.fromkeys([*self._table, *self._entry_points()]))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._table or name in self._entry_points() or is_import_path(name))

    def register(self, name: str, target: Any, *, overwrite: bool = False) -> None:
        """Make ``name`` refer to ``target`` (an object, or a ``"module:attribute"`` string) in this process."""
        if not isinstance(name, str) or not name or is_import_path(name) or ":" in name:
            raise FlowRLError(f"a {self.kind} name must be a non-empty string without ':', got {name!r}.")
        if name in self._table and not overwrite:
            raise FlowRLError(f"{self.kind} '{name}' is already registered; pass overwrite=True to replace it.")
        self._table[name] = target
        self._loaded.pop(name, None)
        self._sections.pop(name, None)

    def unregister(self, name: str) -> None:
        """Forget a name registered in this process (flowrl's own parts stay)."""
        if name in self._builtins:
            raise FlowRLError(f"{self.kind} '{name}' is one of flowrl's own and cannot be unregistered.")
        self._table.pop(name, None)
        self._loaded.pop(name, None)
        self._sections.pop(name, None)

    def choices(self) -> str:
        return ", ".join(self.names())

    # -- resolving ----------------------------------------------------------------------------------------
    def load(self, name: str) -> Any:
        """The object ``name`` refers to (imported on first use)."""
        if name in self._loaded:
            return self._loaded[name]
        what = self.kind
        if name in self._table:
            target = self._table[name]
            obj = import_path(target, what) if isinstance(target, str) else target
        elif name in self._entry_points():
            entry = self._entry_points()[name]
            try:
                obj = entry.load()
            except Exception as e:
                raise FlowRLError(
                    f"{what} '{name}' (entry point '{entry.value}' of group {self.group}) could not be loaded "
                    f"({type(e).__name__}: {_first_line(e)})."
                ) from None
        elif is_import_path(name):
            obj = import_path(name, what)
        else:
            raise FlowRLError(self.unknown(name))
        self._loaded[name] = obj
        return obj

    def unknown(self, name: Any) -> str:
        return f"unknown {self.kind} {name!r}; choose one of: {self.choices()}, or give an import path 'package.module:attribute'."

    def section(self, name: str) -> type[Section]:
        """The config section of ``name``: the registered object itself when it is a section class, else one read
        from its signature (a class's constructor, a function's parameters; ``derive`` where the kind says how)."""
        if name not in self._sections:
            target = self.load(name)
            if isinstance(target, type) and issubclass(target, Section):
                if not issubclass(target, self.base):
                    raise FlowRLError(f"{self.key} '{name}' is a {target.__name__}, which is not a {self.base.__name__}.")
                self._sections[name] = target
            elif self.derive is not None:
                self._sections[name] = self.derive(target, name)
            else:
                self._sections[name] = signature_section(target, section_label(name), base=self.base)
        return self._sections[name]

    def _entry_points(self) -> dict[str, importlib.metadata.EntryPoint]:
        key = (self.group, tuple(sys.path))  # a package installed (or a path added) since is seen
        if key not in _entry_point_cache:
            found = {ep.name: ep for ep in importlib.metadata.entry_points(group=self.group)}
            _entry_point_cache[key] = found
        return _entry_point_cache[key]

    # -- a config field chosen by name --------------------------------------------------------------------
    def field(self, default: str) -> Any:
        """The type of a config field that holds one part of this kind, chosen by its ``name`` key (``default``
        when the mapping has none) and validated by that part's own section."""

        base = self.base

        def dispatch(value: Any, handler: Callable, info: Any) -> Any:
            if isinstance(value, Section):
                try:
                    if type(value) is self.section(getattr(value, "name", "")):
                        return value
                except FlowRLError:
                    pass
                value = value.model_dump()  # e.g. the generic PipelineConfig of a family with a section of its own
            if not isinstance(value, dict):
                raise PydanticCustomError("part_mapping", "must be a mapping with a 'name' key, got {got}", {"got": repr(value)[:80]})
            name = value.get("name", default)
            if not isinstance(name, str) or name not in self:
                raise PydanticCustomError("part_name", "{message}", {"message": self.unknown(name), "name": name})
            try:
                section = self.section(name)
            except FlowRLError as e:
                raise PydanticCustomError("part_name", "{message}", {"message": str(e).rstrip("."), "name": name}) from None
            return section.model_validate({**value, "name": name})

        return Annotated[SerializeAsAny[base], WrapValidator(dispatch)]


def section_label(name: str) -> str:
    """A class-name-like label for the section read from a registered target's signature (``"my_pkg.mod:sharp_ness"`` ->
    ``"SharpNess"``): what a validation error names."""
    return re.sub(r"\W", "_", name.split(":")[-1]).title().replace("_", "") or "Part"
