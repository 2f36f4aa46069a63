"""`flowrl eval`, `flowrl sample` and `flowrl export` on run checkpoints of the kinds the image tests do not cover: a
masked-diffusion LM, DiffusionGemma and the 2-D toy, then the image kinds as a matrix. A diffusion LM (masked or
DiffusionGemma) exports as a transformers model directory (LoRA merged) whose logits are the trained model's; the toy
(no model format) is refused in one sentence. (An earlier DiffusionGemma refusal rested on a comparison that was
wrong: its forward draws a random canvas when given none, so two calls of the same model differ by ~0.6.)"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CONFIGS, fast_overrides

from flowrl.cli import main

FAST = ["train.iterations=1", "log.checkpoint_every=1", "prompts.eval_size=4"]


def _trained(preset: str, run) -> str:
    assert main(["train", str(CONFIGS / f"{preset}.yaml"), *fast_overrides(run), *FAST]) == 0
    return str(run / "checkpoints" / "step_000001")


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["dllm/diffu_grpo", "dllm/diffusion_gemma_step_grpo"])
def test_a_diffusion_lm_checkpoint_evaluates_samples_and_exports(preset, tmp_path, capsys):
    from flowrl.config import load_config
    from flowrl.eval_command import text_model

    checkpoint = _trained(preset, tmp_path / "run")
    capsys.readouterr()
    assert main(["eval", checkpoint, "prompts.eval_size=4"]) == 0
    assert 0 <= json.loads(capsys.readouterr().out.splitlines()[-1])["eval/reward/mean"] <= 1
    assert main(["sample", checkpoint, "-n", "1", "--out", str(tmp_path / "s.jsonl")]) == 0
    out = tmp_path / "export"
    assert main(["export", checkpoint, str(out)]) == 0
    assert {"README.md", "config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    # the exported directory, loaded as the run's model, gives the trained model's logits
    config = load_config(tmp_path / "run" / "config.yaml")
    trained, _ = text_model(config, tmp_path / "run" / "checkpoints" / "step_000001")
    exported, _ = text_model(load_config(tmp_path / "run" / "config.yaml", [f"pipeline.pretrained={out}"]), None)
    ids = torch.randint(4, 20, (2, 12), generator=torch.Generator().manual_seed(0))

    def logits(model):  # seeded: DiffusionGemma's forward draws a random canvas when given none
        torch.manual_seed(0)
        with torch.no_grad():
            return model.pipeline.active_model()(input_ids=ids).logits

    a, b = logits(trained), logits(exported)
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


@pytest.mark.slow
def test_the_toy_evaluates_samples_and_refuses_export_in_one_sentence(tmp_path, capsys):
    checkpoint = _trained("toy/grpo_kl_linear", tmp_path / "run")
    capsys.readouterr()
    assert main(["eval", checkpoint]) == 0
    assert main(["sample", checkpoint, "-n", "4", "--out", str(tmp_path / "points.npy")]) == 0
    assert (tmp_path / "points.npy").is_file()
    capsys.readouterr()
    assert main(["export", checkpoint, str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowrl: error: the 2-D toy has no model format to export") and not (tmp_path / "export").exists()


def _trained_tiny_edit(run_dir) -> str:
    """An edit model's run (FLUX.1 Kontext, a tiny random checkpoint from `flowrl tiny`), one iteration."""
    from flowrl.pipelines.tiny import tiny_checkpoint
    from flowrl.pipelines.tiny.runs import RUNS, tiny_overrides

    base = tiny_checkpoint("flux_kontext", run_dir.parent / "base")
    run = "flux_kontext/grpo_pickscore"
    assert main(["train", RUNS[run].preset, *tiny_overrides(run, base, run_dir), "log.checkpoint_every=1"]) == 0
    return str(run_dir / "checkpoints" / "step_000001")


# The rest of the matrix of checkpoint kinds x (eval, sample, export): the embedded image, video and masked-token image
# models and an edit model (the diffusion LM, DiffusionGemma and the toy are above).
IMAGE_KINDS = {
    "image": "digits/grpo",
    "video": "digits_video/grpo",
    "masked-token image": "digits/masked_grpo",
    "edit": "edit",
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(IMAGE_KINDS))
def test_every_image_kind_checkpoint_evaluates_samples_and_exports(kind, tmp_path, capsys):
    preset = IMAGE_KINDS[kind]
    checkpoint = _trained_tiny_edit(tmp_path / "run") if kind == "edit" else _trained(preset, tmp_path / "run")
    capsys.readouterr()
    assert main(["eval", checkpoint, "prompts.eval_size=2", "eval.samples_per_prompt=1"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert torch.isfinite(torch.tensor(result["eval/reward/mean"]))
    grid = tmp_path / "s.png"
    assert main(["sample", checkpoint, "-n", "2", "--out", str(grid)]) == 0 and grid.stat().st_size > 0
    out = tmp_path / "export"
    assert main(["export", checkpoint, str(out)]) == 0
    denoisers = [d.name for d in out.iterdir() if d.is_dir() and (d / "config.json").is_file() and d.name != "scheduler"]
    assert (out / "README.md").is_file() and denoisers, sorted(p.name for p in out.iterdir())  # the card, the model
