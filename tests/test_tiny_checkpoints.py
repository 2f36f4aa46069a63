"""``flowrl tiny FAMILY OUT``: a tiny random-weight checkpoint of every family (flowrl/pipelines/tiny/), and every
shipped preset of a real family run on one for an iteration (the overrides of flowrl/pipelines/tiny/runs.py, which
the docs print too): the checkpoint loads through ``pipeline.pretrained=OUT``, the run completes, the weights move."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch
import yaml

from flowrl.cli import main as flowrl_main
from flowrl.pipelines.tiny import FAMILIES, tiny_checkpoint
from flowrl.pipelines.tiny.runs import RUNS, TEXT_FAMILIES, tiny_overrides

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each (family, variant)'s tiny checkpoint, built on first use and shared by the module's runs."""
    built: dict[tuple[str, str], Path] = {}

    def get(family: str, variant: str) -> Path:
        if (family, variant) not in built:
            built[family, variant] = tiny_checkpoint(family, tmp_path_factory.mktemp(f"{family}_{variant}"), variant)
        return built[family, variant]

    return get


def _digit_share(samples, prompts, metadata):
    """A reward a random language model's completions vary in (its presets' math reward is 0 on random text)."""
    return [sum(c.isdigit() for c in s) / max(len(s), 1) for s in samples]


def main(argv: list[str]) -> int:
    """`flowrl tiny ARGS` through the command line flowrl installs."""
    return flowrl_main(["tiny", *argv])


def test_an_unknown_family_is_one_sentence_and_writes_nothing(tmp_path, capsys):
    assert main(["flux3", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flowrl: error: no tiny checkpoint for family 'flux3'; the families are: ")
    assert "flux2 (dev, klein, klein-base)" in err and "dllm (mdlm, bd3lm)" in err
    assert main(["digits", str(tmp_path / "out")]) == 2 and "digits's models ship with flowrl" in capsys.readouterr().err
    assert main(["flux2", str(tmp_path / "out"), "--variant", "pro"]) == 2
    assert "its variants are: dev, klein, klein-base." in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_an_existing_out_is_refused_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert main(["dllm", str(out)]) == 2
    assert "'" + str(out) + "' exists and is not an empty directory" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    assert main(["dllm", str(out), "--overwrite"]) == 0
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directory left beside it


def test_a_seed_gives_the_same_weights_and_leaves_the_rng_alone(tmp_path):
    state = torch.random.get_rng_state()
    weights = [
        (tiny_checkpoint("dllm", tmp_path / f"s{seed}_{i}", seed=seed) / "model.safetensors").read_bytes()
        for seed, i in ((0, 0), (0, 1), (1, 0))
    ]
    assert weights[0] == weights[1] and weights[0] != weights[2]
    assert torch.equal(torch.random.get_rng_state(), state)


def test_every_variant_runs_and_every_preset_of_a_family_is_run():
    """Each checkpoint a family builds is run by at least one entry of RUNS, and every shipped preset whose
    pipeline.name is such a family is one of them."""
    from flowrl.presets import PRESET_DIR, preset_names

    covered = {(run.family, run.variant) for run in RUNS.values()}
    assert covered == {(family, variant) for family, variants in FAMILIES.items() for variant in variants}
    for name in preset_names():
        family = yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text())["pipeline"]["name"]
        assert family not in FAMILIES or name in RUNS, f"preset {name} ({family}) has no tiny run"


@pytest.mark.parametrize("name", list(RUNS))
def test_every_run_validates(name, tmp_path):
    """The overrides make a valid config of every run without building anything (a typo fails here, fast)."""
    from flowrl.config import load_config

    config = load_config(RUNS[name].preset, tiny_overrides(name, tmp_path))
    assert config.pipeline.name == RUNS[name].family and config.train.iterations == 1 and config.pipeline.pretrained == str(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_one_iteration_of_every_run_on_its_tiny_checkpoint(name, checkpoints, tmp_path):
    from accelerate.state import AcceleratorState

    from flowrl.config import load_config
    from flowrl.trainer import Trainer
    from tests.conftest import skip_without_sudoku_file

    run = RUNS[name]
    if run.preset.startswith("dllm/sudoku"):
        skip_without_sudoku_file("the Sudoku presets")
    out = checkpoints(run.family, run.variant)
    assert sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) < 4e6  # a few MB at most
    AcceleratorState._reset_state(True)
    reward = {"reward": {"digits": _digit_share}} if run.family in TEXT_FAMILIES else {}
    trainer = Trainer(load_config(run.preset, tiny_overrides(name, out, tmp_path / "run")), **reward)
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters() if p.requires_grad}
    summary = trainer.fit()
    after = dict(trainer.module.named_parameters())
    unchanged = [n for n, p in before.items() if torch.equal(p, after[n].detach())]
    assert summary["status"] == "completed", summary
    assert before and not unchanged, f"{len(unchanged)} of {len(before)} trainable tensors did not change, e.g. {unchanged[:3]}"


@pytest.mark.slow
def test_the_printed_command_trains_through_flowrl_train(tmp_path, monkeypatch, capsys):
    """The user's path: flowrl tiny prints the flowrl train command of the family's preset; that command runs."""
    from accelerate.state import AcceleratorState

    from flowrl.cli import main as flowrl

    monkeypatch.chdir(tmp_path)
    assert main(["z_image", "tiny_z"]) == 0
    printed = capsys.readouterr().out
    assert "random" in printed and "z_image/grpo_pickscore:" in printed
    command = next(line.strip() for line in printed.splitlines() if line.strip().startswith("flowrl train z_image/grpo_pickscore_turbo "))
    AcceleratorState._reset_state(True)
    assert flowrl(shlex.split(command)[1:]) == 0
    assert (tmp_path / "runs" / "tiny_z_image_grpo_pickscore_turbo" / "summary.json").is_file()


def test_the_docs_table_names_every_run_and_variant():
    from tests.conftest import REPO

    page = (REPO / "docs" / "model_families.md").read_text()
    section = page[page.index("## Try any family without weights") : page.index("## The families")]
    missing = [name for name in RUNS if f"`{name}`" not in section]
    missing += [f"{family} {variant}" for family, variants in FAMILIES.items() for variant in variants if f"`{variant}`" not in section]
    assert not missing, f"docs/model_families.md's table lacks {missing}"
