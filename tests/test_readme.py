"""README.md says only what is true of this checkout: every command it tells a user to type parses (a `train` or
`eval` command's config and overrides resolve too), every preset, config file and page it names exists, and the
evidence levels in its two tables are the ones flowrl's records give."""

from __future__ import annotations

import re
import shlex

import pytest
from conftest import REPO

from flowrl import evidence
from flowrl.cli import _parser
from flowrl.config import load_config
from flowrl.presets import preset_names, resolve_config

README = (REPO / "README.md").read_text()
FENCED = re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def readme_commands() -> list[list[str]]:
    """The flowrl argv of every command in the README's bash blocks (`flowrl ...`, `.venv/bin/flowrl ...`,
    `... -m flowrl.cli ...`), comments stripped."""
    commands = []
    for block in FENCED:
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if not words:
                continue
            if words[0].endswith("flowrl"):
                commands.append(words[1:])
            elif "flowrl.cli" in words:
                commands.append(words[words.index("flowrl.cli") + 1 :])
    return commands


def test_the_readme_has_commands_to_check():
    verbs = {c[0] for c in readme_commands()}
    assert {"train", "sample", "eval", "presets"} <= verbs


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda a: " ".join(a)[:60])
def test_every_readme_command_parses(argv):
    args = _parser().parse_args(argv)  # argparse exits (SystemExit) on a flag or argument that does not exist
    source = getattr(args, "config", None) or getattr(args, "source", None)
    if args.command == "train" or (args.command == "eval" and str(source).endswith(".yaml")):
        load_config(resolve_config(source), list(getattr(args, "overrides", []) or []))  # a wrong key raises


def test_every_preset_config_and_page_the_readme_names_exists():
    presets = set(preset_names())
    named = set(
        re.findall(
            r"`((?:digits|digits_video|dllm|toy|flux|flux2|flux_kontext|qwen_image|sd3|"
            r"stable_diffusion|wan|z_image)/\w+)`",
            README,
        )
    )
    assert named and named <= presets, sorted(named - presets)
    for path in re.findall(r"\b(configs/[\w/]+\.yaml)", README):
        assert (REPO / path).is_file(), path
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert (REPO / target).exists(), target
    assert f"the {len(presets)} presets" in README


def test_the_tables_evidence_levels_are_the_records():
    """Each table row names presets and their badges in the same order; both come from one place, the records."""
    rows = [line for line in README.splitlines() if line.startswith("| ") and re.search(r"`[-ELRGC]{5}`", line)]
    assert len(rows) >= 20
    for row in rows:
        cells = row.split("|")
        preset_cell = next(c for c in cells if re.search(r"`\w+/\w+`", c))
        badges = re.findall(r"`([-ELRGC]{5})`", row)
        presets = re.findall(r"`(\w+/\w+)`", preset_cell)
        assert badges == [evidence.badge(p) for p in presets], row


def test_the_math_grader_is_in_the_core_install():
    """The README's dLLM and grading commands (flowrl train dllm/..., flowrl eval FILE.jsonl) run after `make install`
    alone: math-verify is a core dependency, not an extra."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("math-verify") for d in project["dependencies"])
    assert "math-verify (the math grader)" in README
