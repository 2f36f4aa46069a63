"""Evidence levels (flowrl/evidence.py): every preset has a record, every record's tests and files exist, the page
and `flowrl presets` show them. The named tests are found by parsing their files, never imported or run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flowrl import evidence
from flowrl.cli import main
from flowrl.evidence import LEVELS, Evidence, PresetEvidence
from flowrl.presets import preset_names

REPO = Path(__file__).resolve().parents[1]


def test_every_preset_has_a_record_and_every_record_a_preset():
    assert set(evidence.records()) == set(preset_names())


def test_every_named_test_and_file_exists():
    assert evidence.validate(evidence.records()) == []


def test_a_record_naming_a_missing_test_or_file_is_reported():
    wrong = Evidence(
        status="verified",
        tests=[
            "tests/test_evidence.py::test_no_such_test",
            "tests/no_such_file.py::test_x",
            # switched off in the class (``= None``): inherited from the mixin, yet not a test that runs
            "tests/test_family_qwen_image.py::TestQwenImageEditPlus::test_sampler_equals_the_diffusers_pipeline",
        ],
        files=["bench/no_such_bench.py"],
        command="pytest -q",
    )
    record = PresetEvidence(exact=wrong, learns=wrong, real_size_cpu=wrong)
    problems = evidence.validate({"digits/wrong": record})
    assert len(problems) == 3 * 4 and all(p.startswith("digits/wrong ") for p in problems), problems
    assert "test tests/test_evidence.py::test_no_such_test does not exist" in problems[0]


def test_numbers_from_a_measurement_record_are_read_not_typed(tmp_path):
    """A level backed by bench/results/NAME.json shows that record's numbers; a record without the preset is named."""
    (tmp_path / "bench" / "results").mkdir(parents=True)
    entry = {
        "date": "2026-11-28",
        "commit": "abc1234",
        "machine": {"cores": 2, "load_1min": 1.5},
        "iterations": 30,
        "samples_per_iteration": 64,
        "wall_s": 78.2,
        "before": {"eval/reward/mean": 1.2985, "eval/reward/ink": 0.3051, "eval/judge/mean": 0.88},
        "after": {"eval/reward/mean": 1.4737, "eval/reward/ink": 0.4812, "eval/judge/mean": 0.78},
    }
    (tmp_path / "bench" / "results" / "runs.json").write_text(json.dumps({"presets": {"digits/grpo": entry}}))
    assert evidence.measured_numbers("runs", "digits/grpo", tmp_path) == (
        "1.298 -> 1.474 (ink 0.305 -> 0.481), 30 iterations x 64 samples, 78 s; measured 2026-11-28 on the 2-core "
        "development machine (load 1.5), commit abc1234 (bench/results/runs.json)."
    )
    backed = Evidence(status="verified", record="runs", command="flowrl train digits/grpo")
    record = PresetEvidence(exact=backed, learns=backed, real_size_cpu=backed)
    assert evidence.validate({"digits/grpo": record}, tmp_path) == []
    assert evidence.validate({"digits/ddpo": record}, tmp_path) == [
        f"digits/ddpo {lv}: record bench/results/runs.json has no entry for it" for lv in ("exact", "learns", "real_size_cpu")
    ]


def test_inherited_and_parametrized_test_ids_are_found():
    assert evidence.test_exists("tests/test_family_sd3_flux.py::TestFlux::test_sampler_equals_the_diffusers_pipeline")
    assert evidence.test_exists("tests/test_family_sd3_flux.py::test_real_configs_validate[configs/sd3/x.yaml]")
    assert not evidence.test_exists("tests/test_family_sd3_flux.py::TestFlux::test_no_such_method")


def test_a_level_says_what_backs_it_or_why_not():
    with pytest.raises(ValueError, match="names its tests or files"):
        Evidence(status="verified", command="flowrl train digits/grpo")
    with pytest.raises(ValueError, match="says why"):
        Evidence(status="not verified")


def test_measurements_carry_numbers_and_gpu_and_checkpoint_are_never_claimed():
    for name, record in evidence.records().items():
        for lv in ("learns", "real_size_cpu"):
            entry = getattr(record, lv)
            has_numbers = entry.numbers or (entry.record and evidence.measured_numbers(entry.record, name))
            assert entry.status == "not verified" or has_numbers, f"{name} {lv}: a measurement without its numbers"
        # no GPU was lent and no hub checkpoint loaded: a record claiming either would be made up
        assert record.gpu.status == record.real_checkpoint.status == "not verified", name


def test_level_is_the_highest_verified_one():
    assert evidence.level("z_image/grpo_pickscore_turbo") == "real_size_cpu"
    assert evidence.badge("z_image/grpo_pickscore_turbo") == "E-R--"
    assert evidence.level("digits/grpo") == "learns" and evidence.badge("digits/grpo") == "-L---"
    assert evidence.badge("no/such_preset") == "?????"


def test_page_is_the_generated_one():
    assert (REPO / "docs" / "evidence.md").read_text() == evidence.page(), "run python -m flowrl.evidence --write"
    assert evidence.main(["--check"]) == 0


def test_flowrl_presets_shows_each_presets_level(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "E exact at tiny size" in lines[0] and "docs/evidence.md" in lines[0]
    shown = {line.split()[0]: line.split()[1] for line in lines[1:]}
    assert set(shown) == set(preset_names())
    assert all(re.fullmatch("".join(f"[{evidence.LETTERS[lv]}-]" for lv in LEVELS), b) for b in shown.values()), shown
    assert all(shown[name] == evidence.badge(name) for name in shown)


def test_records_file_ships_in_the_wheel():
    lines = (REPO / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1].splitlines()
    flowrl_data = next(line for line in lines if line.startswith("flowrl = "))  # tomllib is 3.11+; the line is enough
    assert f'"{evidence.RECORDS_FILE.name}"' in flowrl_data
