"""`flowrl sample` on every kind of model flowrl trains: the embedded image, video and masked-token models and the
diffusion LMs by name, a diffusion LM's run checkpoint (its completions as text), and an edit model's checkpoint
(its first held-out prompt sampled with that prompt's source image)."""

from __future__ import annotations

import json

import pytest
from conftest import CONFIGS, fast_overrides

from flowrl.cli import main
from flowrl.pipelines.dllm import EMBEDDED_LMS
from flowrl.pipelines.embedded_adapter import shipped_generators
from flowrl.pipelines.embedded_models import EMBEDDED_IMAGE_FAMILIES
from flowrl.presets import embedded_lm_presets


def test_the_embedded_models_are_read_from_the_families():
    assert set(EMBEDDED_IMAGE_FAMILIES) == {"digits_flow", "digits_ddpm", "digits_flow_2step", "digits_video", "digits_masked"}
    presets = {"arith_mdlm": "dllm/bgpo", "arith_bd3lm": "dllm/block_elbo", "sudoku_mdlm": "dllm/sudoku_diffu_grpo"}  # the first by name
    assert embedded_lm_presets() == presets
    assert {*EMBEDDED_IMAGE_FAMILIES, *EMBEDDED_LMS} == {*EMBEDDED_IMAGE_FAMILIES, *presets} == set(shipped_generators())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["digits_flow", "digits_ddpm", "digits_flow_2step", "digits_video", "digits_masked"])
def test_every_embedded_image_model_samples_by_name(name, tmp_path):
    out = tmp_path / "grid.png"
    assert main(["sample", name, "--prompt", "a handwritten seven", "-n", "1", "--steps", "2", "--out", str(out)]) == 0
    assert out.is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, prompt", [("arith_mdlm", "What is 3 + 4?"), ("arith_bd3lm", "What is 3 + 4?"), ("sudoku_mdlm", " ".join("3102200002100320"))]
)
def test_an_embedded_language_model_samples_text(name, prompt, tmp_path, capsys, monkeypatch):
    # sampling given prompts reads no prompt pool: sudoku_mdlm samples even where its task's shared file is absent
    monkeypatch.setenv("FLOWRL_DATA_DIR", str(tmp_path / "no_data_here"))
    out = tmp_path / "completions.jsonl"
    assert main(["sample", name, "--prompt", prompt, "-n", "2", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows == printed and len(rows) == 2 and all(r["prompt"] == prompt and r["completion"] for r in rows)
    assert main(["sample", name, "--prompt", "x", "--out", str(tmp_path / "grid.png")]) == 2
    assert "a diffusion LM's samples are text: give --out a .jsonl file" in capsys.readouterr().err


@pytest.mark.slow
def test_a_diffusion_lm_checkpoint_samples_its_held_out_prompt(tmp_path, capsys):
    run = tmp_path / "run"
    overrides = [*fast_overrides(run), "prompts.eval_size=4", "log.checkpoint_every=1"]
    assert main(["train", str(CONFIGS / "dllm" / "diffu_grpo.yaml"), *overrides, "train.iterations=1"]) == 0
    capsys.readouterr()
    assert main(["sample", str(run / "checkpoints" / "step_000001"), "-n", "1"]) == 0  # no --out: a new folder
    (file,) = (run / "outputs").glob("sample_*/samples.jsonl")
    (row,) = [json.loads(line) for line in file.read_text().splitlines()]
    assert row["prompt"] and isinstance(row["completion"], str)
    assert main(["sample", "digits_flow", "--prompt", "x", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "samples images: give --out a .png grid or a .npy array" in capsys.readouterr().err


@pytest.mark.slow
def test_an_edit_models_sample_takes_its_prompt_with_its_source_image(tmp_path, monkeypatch):
    """Without --prompt, the first held-out item is sampled whole: the edit model gets its source image too."""
    from flowrl.pipelines.tiny import tiny_checkpoint
    from flowrl.pipelines.tiny.runs import RUNS, tiny_overrides
    from flowrl.samplers import rollout

    base = tiny_checkpoint("flux_kontext", tmp_path / "base")
    run = "flux_kontext/grpo_pickscore"
    overrides = [*tiny_overrides(run, base, tmp_path / "run"), "log.checkpoint_every=1"]
    assert main(["train", RUNS[run].preset, *overrides]) == 0
    seen = []
    real = rollout.sample

    def recording(pipeline, sampler, prompts, n, steps, guidance, seed=0, metadata=None):
        seen.append(metadata)
        return real(pipeline, sampler, prompts, n, steps, guidance, seed=seed, metadata=metadata)

    monkeypatch.setattr(rollout, "sample", recording)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    assert main(["sample", str(checkpoint), "-n", "1", "--out", str(tmp_path / "edit.png")]) == 0
    assert (tmp_path / "edit.png").is_file() and seen[0][0].get("image")  # the held-out item's source image


def test_training_on_a_task_whose_file_is_absent_stops_with_nothing_written(tmp_path, monkeypatch, capsys):
    """The text modality reads its prompt pools when first used; the Trainer reads them before a run directory exists,
    so a missing task file is one sentence and no partial run."""
    monkeypatch.setenv("FLOWRL_DATA_DIR", str(tmp_path / "no_data_here"))
    run = tmp_path / "run"
    assert main(["train", "dllm/sudoku_tracerl", f"output_dir={run}", "train.iterations=1"]) != 0
    assert "data file not found" in capsys.readouterr().err and not run.exists()
