"""flowrl's imports go one way, function-level imports included.

Every module and subpackage of flowrl has its own place in ``ORDER``, lowest first; a module may import modules of
its own unit and of units listed before its own, never after (docs/architecture.md, "Layers"). A module's unit is the
longest entry of ``ORDER`` it falls under: a folder whose modules sit at different layers (the training wing: its
file services low, the loop on top) lists them one by one. Inside a unit the modules import each other without a
cycle. A module missing from ``ORDER`` fails: place it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "flowrl"

ORDER: list[str] = [
    # base: errors, records, keyed randomness, the config-section base and the name tables, files on disk
    "flowrl.errors",
    "flowrl.atomic_files",
    "flowrl.console",  # flowrl's own output on stdout, the libraries' on stderr
    "flowrl.training",  # the training wing's face (its modules are placed one by one below)
    "flowrl.training.fault_injection",
    "flowrl.training.determinism",
    "flowrl.types",
    "flowrl.seeding",
    "flowrl.sections",
    "flowrl.registry",
    "flowrl.training.distributed",
    "flowrl.training.checkpoint",
    "flowrl.training.run_lock",
    "flowrl.training.deepspeed_zero",
    "flowrl.hub",
    "flowrl.data",
    # the parts a run is made of, each with its config section
    "flowrl.samplers",
    "flowrl.reward_models",
    "flowrl.objectives",
    "flowrl.pipelines",
    # run services: prompts, presets, the composed config, logging, evaluation, inference-time scaling, pairs
    "flowrl.prompts.files",
    "flowrl.prompts.datasets",
    "flowrl.prompts",
    "flowrl.presets",
    "flowrl.evidence",  # the presets' evidence records, the page they generate and `flowrl presets`' level column
    "flowrl.training.trackers",
    "flowrl.config",
    "flowrl.training.roles",
    "flowrl.training.resume_check",
    "flowrl.training.run_logger",
    "flowrl.training.flops",  # model FLOPs per call of the run's models, FLOP/s and MFU (torch only)
    "flowrl.visualize",
    "flowrl.model_card",
    "flowrl.export_formats",  # flowrl export --format comfy: a checkpoint's LoRA in the original / kohya layout
    "flowrl.evaluation",
    "flowrl.inference",
    "flowrl.preferences",
    "flowrl.preferences.pairs",
    "flowrl.preferences.labels",
    # the loop
    "flowrl.modalities",
    "flowrl.training.launch",
    "flowrl.training.engine",
    "flowrl.training.preflight",
    "flowrl.training.loop",
    "flowrl.training.failure",  # a run's failure in one sentence: the part that raised, its line, the traceback's log
    "flowrl.training.run",
    "flowrl.trainer",
    "flowrl.eval_command",
    "flowrl.pipelines.embedded.distil_digits_student",  # ships the DMD2 student: runs its preset through the Trainer
    "flowrl.check",  # flowrl check: builds a run and drives its loop, evaluation, sampling and card
    # what users call: the Python API (the package itself), the servers, the command line
    "flowrl",
    "flowrl.reward_server",
    "flowrl.preferences.label_server",
    "flowrl.config_reference",  # the config reference page and `flowrl config`: reads every section
    "flowrl.cli",
]
RANK = {unit: i for i, unit in enumerate(ORDER)}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
    """The module's place in ORDER: the longest entry it falls under (``flowrl.samplers.ddim`` -> ``flowrl.samplers``,
    ``flowrl.training.checkpoint`` -> itself), else its first-level subpackage or module (then missing from ORDER)."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in RANK:
            return ".".join(parts[:n])
    return ".".join(parts[:2])


def flowrl_imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, imported flowrl module) for every import statement in the file, at any depth (``root``: the flowrl
    package directory the file belongs to)."""
    name = module_name(path, root)
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
                is_module = (root.parent / Path(*candidate.split("."))).with_suffix(".py").exists() or (
                    root.parent / Path(*candidate.split("."))
                ).is_dir()
                found.append((node.lineno, candidate if is_module else target))
    return sorted(set(found))


FILES = sorted(ROOT.rglob("*.py"))
GRAPH = {module_name(p): sorted({t for _, t in flowrl_imports(p)} - {module_name(p)}) for p in FILES}


def test_every_unit_has_its_own_place():
    missing = sorted({unit(module_name(p)) for p in FILES} - set(ORDER))
    assert not missing, f"place these in ORDER: {missing}"
    assert len(ORDER) == len(set(ORDER))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down(path: Path):
    me = module_name(path)
    bad = [
        f"line {line}: {me} imports {target}, which is above {unit(me)} in ORDER"
        for line, target in flowrl_imports(path)
        if RANK[unit(target)] > RANK[unit(me)]
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_modules():
    """Within a unit too: a cycle, even through a function-level import, means two modules are one concept."""
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in GRAPH.get(module, []):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target) :] + [module, target]) if target in path else f"{module} -> {target}")
            elif target in GRAPH and state.get(target) is None:
                visit(target, path + [module])
        state[module] = 2

    for module in GRAPH:
        if state.get(module) is None:
            visit(module, [])
    assert not cycles, "\n".join(cycles)


def test_the_check_sees_an_upward_import(tmp_path):
    """The check itself: a function-level import of the trainer, added to a sampler, is found and refused."""
    root = tmp_path / "flowrl"
    (root / "samplers").mkdir(parents=True)
    (root / "samplers" / "ddim.py").write_text(
        (ROOT / "samplers" / "ddim.py").read_text() + "\n\ndef _late():\n    from ..trainer import Trainer\n"
    )
    (root / "trainer.py").write_text("")
    imports = [t for _, t in flowrl_imports(root / "samplers" / "ddim.py", root)]
    assert "flowrl.trainer" in imports and RANK[unit("flowrl.trainer")] > RANK[unit("flowrl.samplers.ddim")]
