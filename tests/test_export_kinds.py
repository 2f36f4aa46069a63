"""`flowrl eval`, `flowrl sample` and `flowrl export` on run checkpoints of the kinds the image tests do not cover: a
masked-diffusion LM, DiffusionGemma and the 2-D toy. A masked-diffusion LM exports as a transformers model directory
(LoRA merged) whose logits are the trained model's; DiffusionGemma's export (whose reloaded logits did not match) and
the toy (no model format) are refused in one sentence."""

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
def test_a_diffusion_gemma_checkpoint_evaluates_samples_and_refuses_export_in_one_sentence(tmp_path, capsys):
    checkpoint = _trained("dllm/diffusion_gemma_step_grpo", tmp_path / "run")
    capsys.readouterr()
    assert main(["eval", checkpoint, "prompts.eval_size=4"]) == 0
    assert main(["sample", checkpoint, "-n", "1", "--out", str(tmp_path / "s.jsonl")]) == 0
    capsys.readouterr()
    assert main(["export", checkpoint, str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowrl: error: exporting a DiffusionGemma run is not supported yet") and not (tmp_path / "export").exists()


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["dllm/diffu_grpo"])
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
    with torch.no_grad():
        a, b = trained.pipeline.active_model()(input_ids=ids).logits, exported.pipeline.active_model()(input_ids=ids).logits
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
