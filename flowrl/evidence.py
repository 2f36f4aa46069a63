"""Evidence levels: what backs each shipped preset, level by level, and the page that shows it (docs/evidence.md).

Five levels, from the cheapest check to the strongest claim:

* ``exact``: flowrl's sampler gives the reference pipeline's output (diffusers, transformers) at tiny size;
* ``learns``: the preset raises its held-out reward on the CPU, a measurement with its numbers;
* ``real_size_cpu``: one training iteration at the released architecture's size, on the CPU;
* ``gpu``: run on a GPU;
* ``real_checkpoint``: trained from the released checkpoint to a published curve.

They are different kinds of evidence, not rungs every preset climbs: the embedded digits models learn on the CPU
but have no reference pipeline to be exact against, and a real-checkpoint preset is exact at tiny size but cannot
learn on a CPU. So ``flowrl presets`` shows which levels are verified (``EL---``: exact and learns) rather than one
rank; ``level`` still names the highest verified one. The records are ``flowrl/evidence_records.yaml``; a record
names the tests and files behind it, and ``validate`` says which of them do not exist.

``python -m flowrl.evidence --write`` regenerates docs/evidence.md; ``--check`` exits 1 when the page is stale.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from functools import cache
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

RECORDS_FILE = Path(__file__).resolve().parent / "evidence_records.yaml"
REPO = Path(__file__).resolve().parents[1]  # a checkout's root: tests/, bench/ and docs/ live there
PAGE = REPO / "docs" / "evidence.md"

LEVELS = ("exact", "learns", "real_size_cpu", "gpu", "real_checkpoint")  # weakest to strongest
LETTERS = dict(zip(LEVELS, "ELRGC", strict=True))
TITLES = {
    "exact": "exact at tiny size",
    "learns": "learns on the CPU",
    "real_size_cpu": "one real-size iteration on the CPU",
    "gpu": "run on a GPU",
    "real_checkpoint": "real checkpoint to a published curve",
}
NO_GPU = "not verified: no GPU has been lent to this project, so no preset has run on one."
NO_HUB = "not verified: no hub checkpoint was ever loaded (no hub access here), so no preset trained from one."


class Evidence(BaseModel):
    """One level of one preset: verified or not, and what says so."""

    model_config = ConfigDict(extra="forbid")

    status: Literal["verified", "not verified"] = Field(description="whether this level is backed by the evidence below")
    tests: list[str] = Field(default=[], description="test ids, tests/test_x.py::test_name or ::Class::test_name")
    files: list[str] = Field(default=[], description="bench scripts or docs (repository paths) holding the measurement")
    evidence: str = Field(default="", description="what the tests or measurement establish, in a sentence")
    numbers: str = Field(default="", description="a measurement's numbers with the date and source they came with")
    command: str = Field(default="", description="the command that re-derives the evidence")
    record: str = Field(
        default="",
        description="a measurement record, bench/results/NAME.json, whose entry for this preset holds the numbers "
        "(the page reads them from it: a measured number is never typed twice)",
    )
    note: str = Field(default="", description="why a level is not verified, or what the evidence leaves out")

    @model_validator(mode="after")
    def _complete(self) -> Evidence:
        if self.status == "verified" and not (self.command and (self.tests or self.files or self.record)):
            raise ValueError("a verified level names its tests or files and the command that re-derives it")
        if self.status == "not verified" and not self.note:
            raise ValueError("a level that is not verified says why (note)")
        return self


class PresetEvidence(BaseModel):
    """Every level of one preset; the GPU and real-checkpoint levels default to 'not verified' with the reason."""

    model_config = ConfigDict(extra="forbid")

    exact: Evidence = Field(description="exact against the reference pipeline at tiny size")
    learns: Evidence = Field(description="learns on the CPU: held-out reward before -> after")
    real_size_cpu: Evidence = Field(description="one iteration at the real architecture's size on the CPU")
    gpu: Evidence = Field(default=Evidence(status="not verified", note=NO_GPU), description="run on a GPU")
    real_checkpoint: Evidence = Field(
        default=Evidence(status="not verified", note=NO_HUB), description="trained on a real checkpoint to a published curve"
    )


@cache
def records() -> dict[str, PresetEvidence]:
    """The records file, one ``PresetEvidence`` per preset name."""
    raw = yaml.safe_load(RECORDS_FILE.read_text())
    return {name: PresetEvidence.model_validate(entry) for name, entry in raw.items()}


def verified_levels(preset: str) -> list[str]:
    """The preset's verified levels, weakest first; [] when it has no record."""
    record = records().get(preset)
    return [lv for lv in LEVELS if record is not None and getattr(record, lv).status == "verified"]


def level(preset: str) -> str | None:
    """The highest verified level of the preset (None when none is)."""
    found = verified_levels(preset)
    return found[-1] if found else None


def badge(preset: str) -> str:
    """Five characters, one per level: its letter when verified, '-' when not (``EL---``); '?' for no record."""
    if preset not in records():
        return "?????"
    found = set(verified_levels(preset))
    return "".join(LETTERS[lv] if lv in found else "-" for lv in LEVELS)


LEGEND = "evidence: " + ", ".join(f"{LETTERS[lv]} {TITLES[lv]}" for lv in LEVELS) + "; - not verified"


# -- validation: every named test and file exists ---------------------------------------------------------------


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


@cache
def _helper_classes(tests_dir: Path) -> dict[str, ast.ClassDef]:
    """Classes defined in the test directory's modules: a test class's mixin bases live in helpers (family_tester)."""
    found: dict[str, ast.ClassDef] = {}
    for path in sorted(tests_dir.glob("*.py")):
        found.update(_classes(ast.parse(path.read_text())))
    return found


def _member(cls: ast.ClassDef, name: str) -> bool | None:
    """True when the class body defines test ``name``, False when it switches it off (``name = None``), else None."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return not (isinstance(node.value, ast.Constant) and node.value.value is None)
    return None


def _has_method(cls: ast.ClassDef, name: str, classes: dict[str, ast.ClassDef]) -> bool:
    """Whether the class defines or inherits a live test ``name``, in Python's order (depth-first is enough here)."""
    own = _member(cls, name)
    if own is not None:
        return own
    bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls.bases]
    return any(base in classes and _has_method(classes[base], name, classes) for base in bases)


def test_exists(test_id: str, root: Path = REPO) -> bool:
    """Whether ``tests/x.py::name`` or ``tests/x.py::Class::name`` (parameters in [...] ignored) is defined there."""
    path, *parts = re.sub(r"\[.*\]$", "", test_id).split("::")
    file = root / path
    if not file.is_file() or len(parts) not in (1, 2):
        return False
    tree = ast.parse(file.read_text())
    if len(parts) == 1:
        return any(isinstance(n, ast.FunctionDef) and n.name == parts[0] for n in tree.body)
    classes = {**_helper_classes(file.parent), **_classes(tree)}
    return parts[0] in _classes(tree) and _has_method(classes[parts[0]], parts[1], classes)


test_exists.__test__ = False  # a helper named test_*: pytest must not collect it where it is imported


def validate(named: dict[str, PresetEvidence], root: Path = REPO) -> list[str]:
    """One sentence per test or file a record names that does not exist (empty: every one does)."""
    problems = []
    for preset, record in named.items():
        for lv in LEVELS:
            entry = getattr(record, lv)
            problems += [f"{preset} {lv}: test {t} does not exist" for t in entry.tests if not test_exists(t, root)]
            problems += [f"{preset} {lv}: file {f} does not exist" for f in entry.files if not (root / f).is_file()]
            if entry.record and measured(entry.record, preset, root) is None:
                problems.append(f"{preset} {lv}: record bench/results/{entry.record}.json has no entry for it")
    return problems


def measured(record: str, preset: str, root: Path = REPO) -> dict | None:
    """The preset's entry in the measurement record bench/results/RECORD.json (bench/preset_results.py writes it)."""
    path = root / "bench" / "results" / f"{record}.json"
    return json.loads(path.read_text()).get("presets", {}).get(preset) if path.is_file() else None


def measured_numbers(record: str, preset: str, root: Path = REPO) -> str:
    """The record's numbers as a sentence: the held-out reward and its components before -> after, the samples, the
    wall time, with the date, machine load and commit they were measured at."""
    r = measured(record, preset, root)
    if r is None or r.get("before") is None:
        return ""
    before, after = r["before"], r.get("after") or {}
    parts = [
        f"{key.removeprefix('eval/').removeprefix('reward/')} {before[key]:.3f} -> {after.get(key, float('nan')):.3f}"
        for key in sorted(before)
        if key.startswith("eval/reward/") and key != "eval/reward/mean"
    ]
    head = f"{before['eval/reward/mean']:.3f} -> {after.get('eval/reward/mean', float('nan')):.3f}"
    return (
        f"{head} ({', '.join(parts)}), {r['iterations']} iterations x {r['samples_per_iteration']} samples, "
        f"{r['wall_s']:.0f} s; measured {r['date']} on the {r['machine']['cores']}-core development machine "
        f"(load {r['machine']['load_1min']}), commit {r['commit']} (bench/results/{record}.json)."
    )


# -- the page -------------------------------------------------------------------------------------------------

INTRO = """# Evidence levels of the shipped presets

Generated by `python -m flowrl.evidence --write` from `flowrl/evidence_records.yaml`; do not edit by hand
(`python -m flowrl.evidence --check` fails when this page is stale; tests/test_evidence.py checks that every named
test and file exists). `flowrl presets` shows the same levels as five letters beside each name.

| letter | level | what it means |
|---|---|---|
| E | exact at tiny size | flowrl's sampler gives the reference pipeline's output (diffusers / transformers) on a tiny random model of the preset's family, from the same noise |
| L | learns on the CPU | the preset (its model, sampler, objective and reward) raises a held-out reward on the CPU: a measurement, with its numbers and date; two-iteration smoke tests do not count |
| R | one real-size iteration on the CPU | one training iteration of the released architecture at its real width and depth (random weights), on the CPU |
| G | run on a GPU | the preset ran on a GPU |
| C | real checkpoint | trained from the released checkpoint to a published curve |

The levels are different kinds of evidence, not a ladder: the embedded models (digits, arith) learn on the CPU
but have no released pipeline to be exact against; the real-checkpoint presets are exact at tiny size but their
models cannot train on a CPU. **G and C are not verified for any preset**: no GPU has been lent to this project and
no hub checkpoint was ever loaded (no hub access), so nothing here claims either.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _summary_table(named: dict[str, PresetEvidence]) -> list[str]:
    head = "| preset | " + " | ".join(f"{LETTERS[lv]} {TITLES[lv]}" for lv in LEVELS) + " |"
    rows = [head, "|---" * (len(LEVELS) + 1) + "|"]
    for preset in sorted(named):
        marks = ["yes" if getattr(named[preset], lv).status == "verified" else "-" for lv in LEVELS]
        rows.append(f"| [{preset}](#{preset.replace('/', '')}) | " + " | ".join(marks) + " |")
    return rows


def _entry_row(lv: str, entry: Evidence, preset: str) -> str:
    recorded = entry.record and measured_numbers(entry.record, preset)
    other = entry.numbers and (f"Other measurements: {entry.numbers}" if recorded else f"Numbers: {entry.numbers}")
    said = [entry.evidence, recorded and f"Numbers: {recorded}", other, entry.note]
    files = entry.files + ([f"bench/results/{entry.record}.json"] if entry.record else [])
    sources = [f"`{t}`" for t in entry.tests] + [f"[{f}](../{f})" for f in files]
    what = " ".join(s for s in said if s) + (" Sources: " + ", ".join(sources) + "." if sources else "")
    command = f"`{entry.command}`" if entry.command else ""
    return f"| {TITLES[lv]} | {entry.status} | {_cell(what)} | {_cell(command)} |"


def _preset_section(preset: str, record: PresetEvidence) -> list[str]:
    rows = [f"### {preset}", "", "| level | status | evidence | command |", "|---|---|---|---|"]
    return rows + [_entry_row(lv, getattr(record, lv), preset) for lv in LEVELS] + [""]


def page(named: dict[str, PresetEvidence] | None = None) -> str:
    """docs/evidence.md: the intro, the summary table and each preset's levels with evidence and command."""
    named = records() if named is None else named
    counts = {lv: sum(getattr(r, lv).status == "verified" for r in named.values()) for lv in LEVELS}
    tally = ", ".join(f"{TITLES[lv]} {counts[lv]}" for lv in LEVELS)
    lines = [INTRO, f"Verified, of {len(named)} presets: {tally}.", "", *_summary_table(named), "", "## Per preset", ""]
    for preset in sorted(named):
        lines += _preset_section(preset, named[preset])
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowrl.evidence", description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(REPO)}")
    action.add_argument("--check", action="store_true", help="exit 1 when the page differs from the records")
    args = parser.parse_args(argv)
    if args.write:
        PAGE.write_text(page())
        return 0
    if not PAGE.is_file() or PAGE.read_text() != page():
        print(f"{PAGE} is stale: run python -m flowrl.evidence --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
