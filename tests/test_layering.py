"""flowrl's import layers hold everywhere, function-level imports included:

    base (types, errors, seeding, checkpoint, data) -> samplers -> objectives / rewards -> pipelines
      -> run services (config, prompts, evaluation, inference, ...) -> trainer / modalities -> cli / reward server

A module may import its own layer and the ones below it, never one above (docs/architecture.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "flowrl"

# The first matching prefix decides a module's layer.
LAYERS: list[tuple[str, int]] = [
    ("flowrl.types", 0), ("flowrl.errors", 0), ("flowrl.seeding", 0), ("flowrl.checkpoint", 0), ("flowrl.distributed", 0), ("flowrl.deepspeed_zero", 0), ("flowrl.data", 0),
    ("flowrl.samplers", 1),
    ("flowrl.objectives", 2), ("flowrl.reward_models", 2),
    ("flowrl.pipelines", 3),
    ("flowrl.config", 4), ("flowrl.prompts", 4), ("flowrl.prompt_files", 4), ("flowrl.evaluation", 4), ("flowrl.inference", 4),
    ("flowrl.preference_pairs", 4), ("flowrl.preference_labels", 4), ("flowrl.run_logger", 4), ("flowrl.visualize", 4), ("flowrl.trackers", 4),
    ("flowrl.model_card", 4),
    ("flowrl.trainer", 5), ("flowrl.modalities", 5),
    ("flowrl.cli", 6), ("flowrl.reward_server", 6), ("flowrl.label_server", 6), ("flowrl.__main__", 6),
    ("flowrl.__init__", 0),
]
NAMES = {0: "base", 1: "samplers", 2: "objectives/rewards", 3: "pipelines", 4: "run services", 5: "trainer", 6: "cli"}


def layer(module: str) -> int:
    if module == "flowrl":  # the package __init__
        return 0
    for prefix, level in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return level
    raise AssertionError(f"module {module} has no layer; add it to LAYERS")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def flowrl_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported flowrl module) for every import statement in the file, at any depth."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "flowrl"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "flowrl":
                continue
            # "from . import x" / "from .pkg import mod": the imported names may be modules themselves
            for a in node.names:
                candidate = f"{target}.{a.name}"
                is_module = (ROOT.parent / Path(*candidate.split("."))).with_suffix(".py").exists() or (ROOT.parent / Path(*candidate.split("."))).is_dir()
                found.append((node.lineno, candidate if is_module else target))
    return sorted(set(found))


FILES = sorted(ROOT.rglob("*.py"))


def test_every_module_has_a_layer():
    for path in FILES:
        layer(module_name(path))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down_the_layers(path: Path):
    me = module_name(path)
    bad = [f"line {line}: {me} ({NAMES[layer(me)]}) imports {target} ({NAMES[layer(target)]})"
           for line, target in flowrl_imports(path) if layer(target) > layer(me)]
    assert not bad, "\n".join(bad)
