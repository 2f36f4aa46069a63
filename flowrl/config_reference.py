"""The config reference: every key of every section with its type, default and description, read from the schema.

    python -m flowrl.config_reference --write    # regenerate docs/config_reference.md
    python -m flowrl.config_reference --check    # exit 1 when the committed page is out of date
    flowrl config [SECTION | KIND.NAME | PRESET]  # the same on the terminal (flowrl/cli.py)

A description is the section's own ``Field(..., description="...")`` (flowrl/sections.py); a reward's
(``reward.kwargs.<name>``) comes from the ``Args:`` block of its class's or constructor's docstring. Nothing here
lists a section by hand: the tables follow ``Config``'s fields and the registries' names.
"""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from .errors import FlowRLError

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "config_reference.md"
WRITE_COMMAND = "python -m flowrl.config_reference --write"
PART_KINDS = ("pipeline", "sampler", "objective")


@dataclass(frozen=True)
class Row:
    key: str  # dotted, from the top of the config file: train.iterations, reward.ensembles.<name>.mode
    type: str
    default: str
    description: str
    nested: bool = False  # a section whose own keys follow it (pipeline.lora.r after pipeline.lora)


@dataclass(frozen=True)
class Table:
    key: str  # what `flowrl config KEY` shows it for: train, objective.grpo, reward.kwargs.pickscore, serve-reward
    section: type[BaseModel]
    prefix: str  # the dotted prefix of its keys ("" for the top level and the reward server's file)
    summary: str  # one paragraph: the section's docstring (a reward's: its class's)
    expand: bool = True  # list the keys of the sections nested in it (False: the top level, whose sections have tables)
    shared: type[BaseModel] | None = None  # the page leaves out the keys this section holds alike (the common pipeline keys)

    def rows(self) -> list[Row]:
        return section_rows(self.section, self.prefix, self.expand)


# -- the schema, walked ------------------------------------------------------------------------------------------
def section_rows(section: type[BaseModel], prefix: str, expand: bool = True) -> list[Row]:
    """One row per field of ``section`` (keys under ``prefix``), then, with ``expand``, the fields of the sections
    nested in it (``rollout.branching.start_steps``; ``reward.ensembles.<name>.members[].name``), except those with a
    table of their own (``eval.judge`` is a reward section)."""
    out: list[Row] = []
    fields = sorted(section.model_fields.items(), key=lambda item: item[0] != "name")  # a part's name first
    for key, field in fields:
        dotted = f"{prefix}.{key}" if prefix else key
        nested = _nested_section(field.annotation) if expand else None
        expanded = nested is not None and nested[0] not in _own_table_sections()
        out.append(Row(dotted, type_name(field.annotation), default_text(field), field.description or "", expanded))
        if expanded:
            out += section_rows(nested[0], dotted + nested[1])
    return out


def _own_table_sections() -> tuple[type[BaseModel], ...]:
    from .reward_models.mix import RewardConfig

    return (RewardConfig,)


def _nested_section(tp: Any) -> tuple[type[BaseModel], str] | None:
    """The section inside the annotation ``tp`` and the key suffix of its entries: a section "", ``dict[str, X]``
    ".<name>", ``list[X]`` "[]"; None when it holds none."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp, ""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        found = [n for n in map(_nested_section, args) if n is not None]
        return found[0] if found else None
    suffix = {dict: ".<name>", list: "[]"}.get(origin)
    inner = _nested_section(args[-1]) if suffix and args else None
    return (inner[0], suffix + inner[1]) if inner else None


def type_name(tp: Any) -> str:
    """A short, readable type: ``int | None``, ``"constant" | "linear"``, ``dict[str, float]``, ``LoraConfig``."""
    if tp is type(None):
        return "None"
    if tp is Any:
        return "any"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def default_text(field: Any) -> str:
    """The default as YAML would write it (``null``, ``true``, ``"digits_flow"``); "required" when it has none."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def summary_of(obj: Any) -> str:
    """The first paragraph of ``obj``'s own docstring, on one line ("" without one)."""
    doc = inspect.cleandoc(vars(obj).get("__doc__") or "") if isinstance(obj, type) else inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split())


# -- which tables ------------------------------------------------------------------------------------------------
def registries() -> dict[str, Any]:
    """Part kind -> its registry (pipeline.name, sampler.name, objective.name, the keys of reward.components)."""
    from .inference import SEARCHES
    from .objectives import OBJECTIVES
    from .pipelines import FAMILIES
    from .reward_models.registry import REWARDS
    from .samplers import SAMPLERS

    return {"pipeline": FAMILIES, "sampler": SAMPLERS, "objective": OBJECTIVES, "reward": REWARDS, "search": SEARCHES}


def part_table(kind: str, name: str, shared: type[BaseModel] | None = None) -> Table:
    """The table of one registered part: ``objective.grpo``; a reward's arguments: ``reward.kwargs.<name>``."""
    registry = registries()[kind]
    section = registry.section(name)
    if kind == "reward":
        target = registry.load(name)
        summary = summary_of(target)
        return Table(f"reward.kwargs.{name}", section, f"reward.kwargs.{name}", summary)
    return Table(f"{kind}.{name}", section, kind, summary_of(section), shared=shared)


def section_table(key: str) -> Table:
    """The table of a top-level section that is not a part (rollout, reward, prompts, train, eval, log)."""
    from .config import Config

    section = Config.model_fields[key].annotation
    return Table(key, section, key, summary_of(section) or Config.model_fields[key].description or "")


def top_table() -> Table:
    from .config import Config

    summary = "The keys at the top of a run's config file; each section below has a table of its own."
    return Table("config", Config, "", summary, expand=False)


def server_table() -> Table:
    from .reward_server.config import ServerConfig

    return Table("serve-reward", ServerConfig, "", summary_of(ServerConfig))


def all_tables() -> list[tuple[str, list[Table]]]:
    """Every table of the page, grouped under a heading, in the order of ``Config``'s fields."""
    from .config import Config
    from .pipelines.diffusers_base import PipelineConfig

    groups: list[tuple[str, list[Table]]] = [("Top level", [top_table()])]
    for key in Config.model_fields:
        if key in PART_KINDS:
            shared = PipelineConfig if key == "pipeline" else None
            common = [Table("pipeline", PipelineConfig, "pipeline", summary_of(PipelineConfig))] if shared else []
            names = registries()[key].builtin_names()
            groups.append((key, common + [part_table(key, n, shared) for n in names]))
        elif _nested_section(Config.model_fields[key].annotation) is not None:
            groups.append((key, [section_table(key)]))
        if key == "reward":
            groups.append(("reward.kwargs", [part_table("reward", n) for n in registries()["reward"].builtin_names()]))
    searches = [part_table("search", n) for n in registries()["search"].builtin_names()]
    groups.append(("search (flowrl eval --search NAME KEY=VALUE, or its flag)", searches))
    groups.append(("Reward server (flowrl serve-reward)", [server_table()]))
    return groups


# -- the page ----------------------------------------------------------------------------------------------------
INTRO = f"""# Config reference

Generated from the config schema by `{WRITE_COMMAND}`; do not edit it by hand
(tests/test_config_reference.py fails when it is out of date). The same on the terminal:
`flowrl config` (the sections), `flowrl config train` (one section), `flowrl config objective.grpo` (a part chosen
by name), `flowrl config reward.pickscore` (a reward's arguments), `flowrl config digits/grpo` (a preset's values
beside the descriptions).

A key is written dotted from the top of the config file (`train.iterations=10` on the command line); `<name>`
stands for a key of your choosing (`reward.ensembles.<name>.mode`), `[]` for each entry of a list.

## Adding a config field

Declare it on its section with its default, its bounds and a one-line description in plain English (what it does,
its unit or effect): `num_times: int = Field(6, ge=1, description="(time, noise) draws per sample, one backward
each.")`. Keep a comment beside it only for the *why*. A reward's arguments are its constructor's parameters,
described in a Google-style `Args:` block of the class's or the constructor's docstring (a base class's block
covers the parameters it documents). A subclass that only changes a default keeps its base's description. Then
run `{WRITE_COMMAND}` and commit the page.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _page_rows(table: Table) -> tuple[list[Row], str]:
    """The rows the page shows for ``table`` and a line before them: a section built on ``table.shared`` shows
    only the keys it adds or gives another default (its ``name`` is in the heading)."""
    rows = table.rows()
    if table.shared is None or not issubclass(table.section, table.shared):
        return rows, "" if rows else "Takes no arguments." if table.key.startswith("reward.") else "No keys."
    common = set(section_rows(table.shared, table.prefix))
    rows = [r for r in rows if r not in common and r.key != f"{table.prefix}.name"]
    return rows, f"Every key of `{table.prefix}` above" + (", and these (its own, or with its own default):" if rows else ".")


def table_markdown(table: Table) -> str:
    rows, note = _page_rows(table)
    lines = [f"### `{table.key}`", "", table.summary, ""] if table.summary else [f"### `{table.key}`", ""]
    lines += [note, ""] if note else []
    if not rows:
        return "\n".join(lines)
    lines += ["| key | type | default | description |", "|---|---|---|---|"]
    lines += [f"| `{_cell(r.key)}` | `{_cell(r.type)}` | `{_cell(r.default)}` | {_cell(r.description)} |" for r in rows]
    return "\n".join([*lines, ""])


def render_markdown() -> str:
    parts = [INTRO]
    for heading, tables in all_tables():
        parts.append(f"## {heading}\n")
        parts += [table_markdown(t) for t in tables]
    return "\n".join(parts).rstrip() + "\n"


def missing_descriptions() -> list[str]:
    """Every field without a description, named by its table and key: ``objective.grpo.std``,
    ``reward.kwargs.pickscore.device``, ``serve-reward.port`` (empty: every field is described)."""
    missing = []
    for _, tables in all_tables():
        for table in tables:
            for row in table.rows():
                if not row.description.strip():
                    missing.append(table.key + row.key.removeprefix(table.prefix) if table.prefix else f"{table.key}.{row.key}")
    return list(dict.fromkeys(missing))


# -- the terminal: flowrl config ---------------------------------------------------------------------------------
def table_for(target: str, name: str | None = None) -> Table | None:
    """The table ``flowrl config TARGET [--name NAME]`` shows: a section (train), a part (objective.grpo, or
    objective with ``name``), a reward's arguments (reward.pickscore, reward.kwargs.pickscore), serve-reward;
    None when ``target`` names none of them (a preset, perhaps)."""
    from .config import Config

    kind, _, rest = target.partition(".")
    rest = rest or name or ""
    if kind == "reward" and rest:
        return part_table("reward", rest.removeprefix("kwargs."))
    if (kind in PART_KINDS or kind == "search") and rest:
        return part_table(kind, rest)
    if target == "serve-reward":
        return server_table()
    if target in Config.model_fields and target not in PART_KINDS and _nested_section(Config.model_fields[target].annotation):
        return section_table(target)
    return None


def _entry(row: Row, width: int, value: str | None = None) -> str:
    head = f"{row.key}: {row.type} = {row.default}" if value is None else f"{row.key} = {value}"
    if value is not None and value != row.default and not value.startswith("("):
        head += f"   (default {row.default})"
    body = textwrap.fill(row.description or "(no description)", width, initial_indent="    ", subsequent_indent="    ")
    return f"{head}\n{body}"


def render_table_text(table: Table, values: Any = None) -> str:
    """One section on the terminal: each key, its type and default (or its value in ``values``, a loaded run), its
    description."""
    width = max(60, min(110, shutil.get_terminal_size((100, 20)).columns - 2))
    summary = table.summary.replace("``", "")
    lines = [f"{table.key}: {summary}" if summary else table.key, ""]
    for row in table.rows():
        if values is None:
            lines.append(_entry(row, width))
            continue
        value = _value_at(values, row.key)
        if value is not _ABSENT and not (isinstance(value, BaseModel) and not table.expand):  # the top's sections: below
            lines.append(_entry(row, width, "(its keys follow)" if row.nested and isinstance(value, BaseModel) else value_text(value)))
    return "\n".join(lines)


_ABSENT = object()  # a key under a section that is null in the run (pipeline.lora.r without LoRA), or a template key


def _value_at(config: Any, key: str) -> Any:
    if "<name>" in key or "[]" in key:
        return _ABSENT
    value = config
    for part in key.split("."):
        if value is None:
            return _ABSENT
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
    return value


def value_text(value: Any) -> str:
    """A value as YAML would write it; a section (eval.judge) as its mapping."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def overview_text() -> str:
    """``flowrl config``: the sections, the parts each kind can name, and how to see one."""
    from .config import Config

    lines = ["The sections of a run's config (flowrl config SECTION shows one; docs/config_reference.md has all):", ""]
    width = max(len(k) for k in Config.model_fields)
    for key, field in Config.model_fields.items():
        lines.append(f"  {key:<{width}}  {field.description}")
    lines.append("")
    for kind, registry in registries().items():
        how = "reward.NAME" if kind == "reward" else f"{kind}.NAME"
        lines += textwrap.wrap(f"{how}: {', '.join(registry.names())}", 110, subsequent_indent="    ")
    lines += ["serve-reward: the reward server's YAML", "PRESET (digits/grpo) or FILE.yaml: its values beside the descriptions"]
    return "\n".join(lines)


def kind_text(kind: str) -> str:
    """``flowrl config objective``: the names a kind can choose, each with its section's summary."""
    registry = registries()[kind]
    head = f"{kind}.name chooses one of these (flowrl config {kind}.NAME shows its keys):"
    if kind == "reward":
        head = "reward.components names rewards from these (flowrl config reward.NAME shows a reward's arguments):"
    lines = [head, ""]
    width = max(len(n) for n in registry.builtin_names())
    for name in registry.builtin_names():
        target = registry.load(name) if kind == "reward" else registry.section(name)
        lines.append(f"  {name:<{width}}  {textwrap.shorten(summary_of(target).replace('``', ''), 100, placeholder=' ...')}")
    if kind == "reward":
        lines += ["", render_table_text(section_table("reward"))]
    return "\n".join(lines)


def preset_text(source: str) -> str:
    """``flowrl config digits/grpo``: every section of that run with its values beside the descriptions."""
    from .config import load_config

    config = load_config(source)
    tables = [top_table()]
    for key in type(config).model_fields:
        if key in PART_KINDS:
            tables.append(part_table(key, getattr(config, key).name))
        elif isinstance(getattr(config, key), BaseModel):
            tables.append(section_table(key))
    texts = [render_table_text(t, config) for t in tables]
    texts += [_reward_kwargs_text(config, c) for c in config.reward.components if config.reward.source(c) in registries()["reward"]]
    return f"{source}: each key's value (and its default where they differ)\n\n" + "\n\n".join(texts)


def _reward_kwargs_text(config: Any, component: str) -> str:
    """A reward component's arguments in a loaded run: those its config gives, else the constructor's defaults."""
    table = part_table("reward", config.reward.source(component))
    table = Table(f"reward.kwargs.{component}", table.section, f"reward.kwargs.{component}", table.summary)
    given = config.reward.kwargs.get(component, {})
    fields = table.section.model_fields
    values = {k: given.get(k, None if f.is_required() else f.get_default(call_default_factory=True)) for k, f in fields.items()}
    return render_table_text(table, {"reward": {"kwargs": {component: values}}})


def config_text(target: str | None, name: str | None = None) -> str:
    """What ``flowrl config [TARGET] [--name NAME]`` prints (see :func:`table_for`); a preset or a YAML file shows
    its values; anything else is one sentence naming the choices."""
    if target is None:
        return overview_text()
    if target in registries() and name is None:
        return kind_text(target)
    table = table_for(target, name)
    if table is not None:
        return render_table_text(table)
    from .presets import preset_path

    if preset_path(target) is not None or Path(target).is_file():
        return preset_text(target)
    raise FlowRLError(
        f"'{target}' is neither a config section ({', '.join(_section_keys())}), a part (objective.grpo, "
        "reward.pickscore), serve-reward, a preset (flowrl presets) nor a YAML file."
    )


def _section_keys() -> list[str]:
    from .config import Config

    return [k for k, f in Config.model_fields.items() if _nested_section(f.annotation) is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowrl.config_reference", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOC_PATH.name} (docs/)")
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed page is out of date")
    args = parser.parse_args(argv)
    page = render_markdown()
    if args.write:
        DOC_PATH.write_text(page)
        print(f"wrote {DOC_PATH}")
    elif args.check:
        current = DOC_PATH.read_text() if DOC_PATH.is_file() else ""
        if current != page:
            print(f"{DOC_PATH} is out of date; run {WRITE_COMMAND}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
