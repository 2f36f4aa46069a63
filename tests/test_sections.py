"""Each part owns its config section, and every default is written once.

A section (flowrl/sections.py) holds a part's knobs and defaults; the runtime object its ``build`` makes takes
them as arguments. If a runtime class kept a default of its own for a knob its section also has, the two could
drift apart silently (45 such pairs existed before the sections moved next to their code), so: no runtime
class reachable from a built part has a default for a parameter its section defines.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch

from flowrl.objectives import OBJECTIVES
from flowrl.pipelines import FAMILIES
from flowrl.prompts import PROMPT_SOURCES
from flowrl.reward_models import REWARDS
from flowrl.reward_models.binary import AllOfReward, BinaryRewardConfig
from flowrl.reward_models.combine import EnsembleConfig, RewardEnsemble
from flowrl.reward_models.per_frame import FrameSelection, PerFrameReward
from flowrl.samplers import SAMPLERS, DiscreteSchedule
from flowrl.sections import BuildContext, PartSection

DDPM_LIKE = SimpleNamespace(schedule=DiscreteSchedule.from_betas(torch.linspace(1e-4, 0.02, 1000)), prediction_type="epsilon")
FLOW_LIKE = SimpleNamespace(prediction_type="flow")
TOKENS_LIKE = SimpleNamespace(prediction_type="masked_tokens", mask_token_id=0, schedule=SimpleNamespace(masking="cosine"))
CONTEXT = BuildContext(
    reward_weights={"ink": 1.0, "digit_classifier": 1.0}, sampler=SAMPLERS.section("masked")(), pipeline=SimpleNamespace(mask_token_id=0)
)
# block_elbo is built for block-diffusion models only (their pipeline has a block length)
BLOCK_CONTEXT = dataclasses.replace(CONTEXT, pipeline=SimpleNamespace(mask_token_id=0, block_length=4))


def runtime_classes(obj, seen=None) -> set[type]:
    """The classes of ``obj`` and of every flowrl object it holds (dataclass fields and attributes), recursively."""
    seen = set() if seen is None else seen
    cls = type(obj)
    if id(obj) in seen or not cls.__module__.startswith("flowrl.") or isinstance(obj, PartSection):  # a section built into itself
        return set()
    seen.add(id(obj))
    found = {cls}
    values = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else list(vars(obj).values())
    for value in values:
        found |= runtime_classes(value, seen)
    return found


def duplicated_defaults(section: type, runtime: type) -> list[str]:
    try:
        parameters = inspect.signature(runtime).parameters
    except (TypeError, ValueError):
        return []
    return [
        f"{runtime.__name__}.{name} = {p.default!r} (also {section.__name__}.{name} = {section.model_fields[name].default!r})"
        for name, p in parameters.items()
        if p.default is not p.empty and name in section.model_fields and name != "name"
    ]


def built(kind: str, name: str):
    section = {"sampler": SAMPLERS, "objective": OBJECTIVES}[kind].section(name)()
    if kind == "sampler":
        like = (
            FLOW_LIKE if "flow" in section.prediction_types else TOKENS_LIKE if "masked_tokens" in section.prediction_types else DDPM_LIKE
        )
        return section, section.build(like)
    return section, section.build(BLOCK_CONTEXT if name == "block_elbo" else CONTEXT)


@pytest.mark.parametrize(
    "kind,name", [("sampler", n) for n in SAMPLERS.builtin_names()] + [("objective", n) for n in OBJECTIVES.builtin_names()]
)
def test_no_runtime_default_repeats_its_sections(kind, name):
    section, obj = built(kind, name)
    duplicates = [d for cls in runtime_classes(obj) for d in duplicated_defaults(type(section), cls)]
    assert not duplicates, "defaults written twice: " + "; ".join(duplicates)


def test_the_reward_combiners_take_their_sections_defaults():
    pairs = [(EnsembleConfig, RewardEnsemble), (FrameSelection, PerFrameReward), (BinaryRewardConfig, AllOfReward)]
    assert not [d for section, runtime in pairs for d in duplicated_defaults(section, runtime)]


def test_the_check_finds_a_duplicate():
    """The check itself, on a runtime class that repeats a section's default."""

    @dataclasses.dataclass
    class Repeats:
        noise_level: float = 0.7

    assert duplicated_defaults(SAMPLERS.section("flow_sde"), Repeats) == [
        "Repeats.noise_level = 0.7 (also FlowSDEConfig.noise_level = 0.7)"
    ]


@pytest.mark.parametrize("registry", [FAMILIES, SAMPLERS, OBJECTIVES], ids=lambda r: r.kind)
def test_every_builtin_part_has_a_section_named_like_it(registry):
    for name in registry.builtin_names():
        section = registry.section(name)
        assert issubclass(section, PartSection) and section.model_fields["name"].default == name, name
        assert section.__doc__ and section.__module__.startswith("flowrl."), name


def test_every_builtin_reward_and_prompt_source_resolves():
    for name in REWARDS.builtin_names():
        REWARDS.section(name)  # the constructor read as a section
    for name in PROMPT_SOURCES.builtin_names():
        assert callable(PROMPT_SOURCES.load(name))


def test_a_reward_constructor_is_its_section():
    """reward.kwargs are checked against the reward class's own signature: types, unknown keys."""
    from flowrl.config import load_config
    from flowrl.errors import FlowRLError

    with pytest.raises(
        FlowRLError, match=r"config key 'reward.kwargs.jpeg_compressibility.upscale' is invalid: input should be a valid integer"
    ):
        load_config(None, ["reward.components={jpeg_compressibility: 1.0}", "reward.kwargs={jpeg_compressibility: {upscale: many}}"])
    with pytest.raises(FlowRLError, match=r"unknown config key 'reward.kwargs.ink.strength'"):
        load_config(None, ["reward.components={ink: 1.0}", "reward.kwargs={ink: {strength: 2}}"])
    config = load_config(None, ["reward.components={jpeg_compressibility: 1.0}", "reward.kwargs={jpeg_compressibility: {upscale: 4}}"])
    from flowrl.reward_models import build_reward_from_config

    assert build_reward_from_config(config.reward).components["jpeg_compressibility"].upscale == 4
