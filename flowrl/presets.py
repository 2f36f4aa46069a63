"""The presets shipped with flowrl: ``flowrl/configs/<group>/<name>.yaml``, named ``<group>/<name>``.

``flowrl train digits/grpo`` runs the shipped ``digits/grpo.yaml`` from any directory (a checkout's
``configs/digits/grpo.yaml`` is the same file, so the README's commands work in a checkout and from an installed
wheel alike); a path to an existing YAML file always means that file. ``flowrl presets`` lists them.
``configs/accelerate/`` holds accelerate launch configs (``accelerate launch --config_file``), not flowrl presets.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

from .errors import FlowRLError

PRESET_DIR = Path(__file__).resolve().parent / "configs"
NOT_PRESETS = ("accelerate",)  # launcher configs shipped beside the presets


def preset_names() -> list[str]:
    """Every shipped preset's name, sorted (``digits/grpo``, ``dllm/unigrpo``, ...)."""
    return sorted(
        str(p.relative_to(PRESET_DIR).with_suffix(""))
        for p in PRESET_DIR.rglob("*.yaml")
        if p.relative_to(PRESET_DIR).parts[0] not in NOT_PRESETS
    )


def preset_path(name: str) -> Path | None:
    """The shipped file a preset name (or a checkout-relative path ``configs/<name>.yaml``) refers to, if any."""
    key = name.removeprefix("./").removeprefix("configs/").removesuffix(".yaml").removesuffix(".yml")
    path = PRESET_DIR / f"{key}.yaml"
    return path if key and ".." not in Path(key).parts and path.is_file() else None


def resolve_config(spec: str | Path) -> Path:
    """The YAML file ``spec`` names: an existing file, else a shipped preset; one sentence when neither."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    shipped = preset_path(str(spec))
    if shipped is not None:
        return shipped
    if path.suffix in (".yaml", ".yml") or path.parent != Path("."):
        raise FlowRLError(f"config file '{spec}' does not exist (and is no shipped preset; `flowrl presets` lists them).")
    raise FlowRLError(f"'{spec}' is neither a config file nor a shipped preset; `flowrl presets` lists the presets.")


DESCRIPTION = "# description: "  # the one header line every preset declares; `flowrl presets` shows it


def summary(name: str) -> str:
    """The preset's declared one-line description (its ``# description:`` header line; tests/test_configs_and_errors.py
    checks that every preset has exactly one, of at most 100 characters)."""
    lines = (PRESET_DIR / f"{name}.yaml").read_text().splitlines()
    declared = [line.removeprefix(DESCRIPTION).strip() for line in lines if line.startswith(DESCRIPTION)]
    if len(declared) != 1:
        raise FlowRLError(f"preset '{name}' declares {len(declared)} '{DESCRIPTION.strip()}' lines; it needs exactly one.")
    return declared[0]


def embedded_lm_presets() -> dict[str, str]:
    """Each shipped diffusion LM and the first preset that trains it (``flowrl sample NAME`` samples as it does)."""
    import yaml

    from .pipelines.dllm import EMBEDDED_LMS

    found: dict[str, str] = {}
    for name in preset_names():
        pipeline = (yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text()) or {}).get("pipeline") or {}
        if pipeline.get("pretrained") in EMBEDDED_LMS:
            found.setdefault(pipeline["pretrained"], name)
    return found


class _CallablePresets(types.ModuleType):
    """This module, callable: ``flowrl.presets()`` is ``preset_names()`` (the Python API's list of preset names)."""

    def __call__(self) -> list[str]:
        """The names of the presets shipped with flowrl (``flowrl.Trainer("digits/grpo")``, ``flowrl train digits/grpo``)."""
        return preset_names()


sys.modules[__name__].__class__ = _CallablePresets
