"""Every config key explained: each field of each section carries a description, docs/config_reference.md is the
generator's output, and ``flowrl config`` shows a section's keys with their descriptions."""

from __future__ import annotations

import pytest
from pydantic import Field

from flowrl import cli, config_reference
from flowrl.sections import PartSection, Section, documented_args, signature_section


def test_every_field_of_every_section_has_a_description():
    missing = config_reference.missing_descriptions()
    assert not missing, (
        f"{len(missing)} config fields have no description: {', '.join(missing)}. Give each a one-line "
        'Field(..., description="...") (a reward: an Args: entry in its docstring); docs/config_reference.md says how.'
    )


def test_the_reference_page_is_the_generators_output():
    page = config_reference.DOC_PATH.read_text() if config_reference.DOC_PATH.is_file() else ""
    assert page == config_reference.render_markdown(), (
        f"docs/config_reference.md is out of date with the config schema; regenerate it: {config_reference.WRITE_COMMAND}"
    )


def test_the_page_covers_every_section_and_registered_part():
    from flowrl.config import Config

    keys = {t.key for _, tables in config_reference.all_tables() for t in tables}
    registries = config_reference.registries()
    expected = {f"{kind}.{name}" for kind in ("pipeline", "sampler", "objective") for name in registries[kind].builtin_names()}
    expected |= {f"reward.kwargs.{name}" for name in registries["reward"].builtin_names()}
    expected |= {"config", "serve-reward", "rollout", "reward", "prompts", "train", "eval", "log"}
    assert expected <= keys, sorted(expected - keys)
    rows = {r.key for _, tables in config_reference.all_tables() for t in tables for r in t.rows()}
    assert set(Config.model_fields) <= rows
    assert {"rollout.branching.start_steps", "reward.ensembles.<name>.members[].name", "pipeline.lora.r"} <= rows


def test_config_lists_the_sections(capsys):
    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    for key in ("train", "objective", "reward", "log"):
        assert f"\n  {key} " in out, key
    assert "objective.NAME: grpo, ddpo" in out


def test_config_shows_a_sections_keys_types_defaults_and_descriptions(capsys):
    assert cli.main(["config", "train"]) == 0
    out = capsys.readouterr().out
    assert "train.learning_rate: float = 0.0001\n    The optimizer's (AdamW) peak learning rate." in out
    assert 'train.lr_schedule: "constant" | "linear" | "cosine" = "constant"' in out


@pytest.mark.parametrize("argv", [["config", "objective.grpo"], ["config", "objective", "--name", "grpo"]])
def test_config_shows_a_named_parts_section(argv, capsys):
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert 'objective.name: str = "grpo"' in out
    assert "objective.best_worst_k: int | None = null\n    DanceGRPO's subset" in out


def test_config_shows_a_rewards_arguments_from_its_docstring(capsys):
    assert cli.main(["config", "reward.pickscore"]) == 0
    out = capsys.readouterr().out
    assert "reward.kwargs.pickscore.normalize: bool = false\n    divide by 26" in out
    assert "reward.kwargs.pickscore.device: str | None = null\n    where the model runs" in out  # from the base class


def test_config_of_a_preset_shows_its_values_beside_the_defaults(capsys):
    assert cli.main(["config", "digits/grpo"]) == 0
    out = capsys.readouterr().out
    assert "train.iterations = 30   (default 40)\n    Training iterations" in out
    assert "reward.kwargs.ink: " in out and "pipeline.lora.r" not in out  # no LoRA in this preset: no LoRA keys


def test_config_of_an_unknown_target_is_one_sentence(capsys):
    assert cli.main(["config", "no_such_section"]) == 2
    err = capsys.readouterr().err
    assert "'no_such_section' is neither a config section" in err and len(err.strip().splitlines()) == 1


def test_train_help_points_to_flowrl_config(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "flowrl config" in capsys.readouterr().out


# -- the mechanisms -------------------------------------------------------------------------------------------
class _Base:
    """A user's reward base.

    Args:
        device: where it runs.
    """


class _UserReward(_Base):
    """A user's reward.

    Args:
        scale (float): factor on the score,
            continued on a second line.
        low, high: the range kept.

    Extra prose after the block is not a parameter.
    """

    def __init__(self, scale: float = 1.0, low: float = 0.0, high: float = 1.0, device: str | None = None, quiet: bool = False):
        pass


def test_a_signature_section_reads_its_descriptions_from_the_args_block():
    assert documented_args(_UserReward) == {
        "scale": "factor on the score, continued on a second line.",
        "low": "the range kept.",
        "high": "the range kept.",
        "device": "where it runs.",
    }
    fields = signature_section(_UserReward, "User").model_fields
    assert fields["scale"].description == "factor on the score, continued on a second line."
    assert fields["device"].description == "where it runs."  # documented by the base class
    assert fields["quiet"].description is None  # undocumented: the reference test names it for flowrl's own
    assert fields["scale"].default == 1.0


def test_a_field_redeclared_for_its_default_keeps_its_bases_description():
    class Parent(Section):
        size: int = Field(3, ge=1, description="How many.")

    class Child(Parent):
        size: int = 5

    assert Child.model_fields["size"].description == "How many." and Child().size == 5

    class Part(PartSection):
        name: str = "mine"

    assert Part.model_fields["name"].description == PartSection.model_fields["name"].description
