"""Model cards of exports (README.md: base model, method, reward, key config, held-out metrics, sample grid, license,
how to load it) and `flowrl export --push-to-hub`, whose failure against a hub that cannot be reached or refuses is
one sentence with the local export left complete (it is written, atomically, before anything is sent)."""

from __future__ import annotations

import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading

import pytest
from conftest import CONFIGS, REPO, fast_overrides
from huggingface_hub import ModelCard

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.model_card import build_model_card
from flowrl.trainer import Trainer

GRPO = CONFIGS / "digits" / "grpo.yaml"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread):
    """Two real 2-iteration digits GRPO runs: full fine-tuning and LoRA (held-out evaluation before and after)."""
    root = tmp_path_factory.mktemp("runs")
    for name, extra in {"full": {}, "lora": {"pipeline.lora": "{r: 4, alpha: 8}"}}.items():
        Trainer(load_config(GRPO, fast_overrides(root / name, **extra))).fit()
    return root


def _python_block(text: str) -> str:
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


@pytest.mark.slow
def test_full_export_card(runs, tmp_path):
    run, out = runs / "full", tmp_path / "model"
    assert main(["export", str(run / "checkpoints" / "step_000002"), str(out), "--license", "apache-2.0"]) == 0
    card = ModelCard.load(out / "README.md")  # the YAML front matter parses
    assert card.data.library_name == "diffusers" and card.data.license == "apache-2.0"
    assert {"flowrl", "grpo"} <= set(card.data.tags) and card.data.pipeline_tag == "text-to-image"
    text = card.text
    assert "`digits_flow`" in text and "`grpo`" in text and "`clip_range=0.001`" in text
    assert "1 × `ink` + 1 × `digit_classifier`" in text and "`digit_realism`" in text  # reward and the held-out judge
    summary = json.loads((run / "summary.json").read_text())
    row = next(line for line in text.splitlines() if line.startswith("| `eval/reward/mean`"))
    assert row == f"| `eval/reward/mean` | {summary['eval_reward_initial']:.4f} | {summary['eval_reward_final']:.4f} |"
    final = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert "| `eval/reward/ink` | " in text and f"{final['eval/reward/ink']:.4f} |" in text
    assert (out / "samples.png").read_bytes() == (run / "samples" / "step_000002.png").read_bytes()
    assert "](samples.png)" in text and "`apache-2.0`" in text
    # the snippet is real: run it as written
    scope: dict = {}
    exec(_python_block(text), scope)  # noqa: S102
    assert scope["pipe"].source == str(out)


@pytest.mark.slow
def test_lora_export_card_and_default_license(runs, tmp_path):
    checkpoint, out = runs / "lora" / "checkpoints" / "step_000002", tmp_path / "lora"
    assert main(["export", str(checkpoint), str(out), "--lora-only"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "pytorch_lora_weights.safetensors", "samples.png"]
    card = ModelCard.load(out / "README.md")
    assert "lora" in card.data.tags and card.data.license is None
    assert "inherits the license of its base model" in card.text
    scope: dict = {}
    exec(_python_block(card.text), scope)  # noqa: S102 - the embedded model takes the LoRA through diffusers' loader
    assert any("lora" in n for n, _ in scope["pipe"].denoiser.named_parameters())

    # a LoRA of a diffusers family: the card names the hub base model and loads with load_lora_weights
    config = load_config(checkpoint / "config.yaml", ["pipeline.name=stable_diffusion", "pipeline.pretrained=org/base-model"])
    hub = build_model_card(checkpoint, config, "lora", "me/my-lora")
    assert hub.data.base_model == "org/base-model"
    assert 'DiffusionPipeline.from_pretrained("org/base-model"' in hub.text and 'pipe.load_lora_weights("me/my-lora")' in hub.text
    full = build_model_card(checkpoint, config, "full", "me/my-model")
    assert 'DiffusionPipeline.from_pretrained("me/my-model"' in full.text and "load_lora_weights" not in full.text


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_push_to_unreachable_hub_is_one_sentence_and_keeps_the_export_whole(runs, tmp_path):
    endpoint, out = f"http://127.0.0.1:{_closed_port()}", tmp_path / "pushed"
    env = {
        **os.environ,
        "HF_ENDPOINT": endpoint,
        "HF_TOKEN": "hf_not_a_real_token",
        "HF_HOME": str(tmp_path / "hf"),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flowrl.cli",
            "export",
            str(runs / "lora" / "checkpoints" / "step_000002"),
            str(out),
            "--lora-only",
            "--push-to-hub",
            "me/digits-lora",
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("flowrl: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"hub unreachable at {endpoint}" in errors[0] and f"the local export '{out}' is complete" in errors[0]
    # the export is whole: the same files as one never pushed, and no temporary leftovers beside it
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "pytorch_lora_weights.safetensors", "samples.png"]
    assert "load_lora_into_unet" in (out / "README.md").read_text()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


class _Refusing(http.server.BaseHTTPRequestHandler):
    def _refuse(self):
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "internal error"}')

    do_GET = do_POST = do_PUT = do_HEAD = _refuse

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_push_to_a_refusing_hub_and_a_bad_repo_id(runs, tmp_path, monkeypatch, capsys):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    checkpoint = str(runs / "lora" / "checkpoints" / "step_000002")
    try:
        assert main(["export", checkpoint, str(tmp_path / "a"), "--lora-only", "--push-to-hub", "me/digits-lora", "--private"]) == 2
    finally:
        server.shutdown()
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"the hub at {endpoint} refused the upload to 'me/digits-lora' (HTTP 500)" in err, err
    assert (tmp_path / "a" / "README.md").is_file()
    # an invalid repo id is refused before anything is written
    assert main(["export", checkpoint, str(tmp_path / "b"), "--lora-only", "--push-to-hub", "not a repo"]) == 2
    assert "is not a hub repository id" in capsys.readouterr().err and not (tmp_path / "b").exists()


def test_edit_models_and_a_second_expert_get_their_own_load_lines():
    """An edit model's snippet passes the source image; a Wan2.2 LoRA export with the low-noise expert's file loads
    it into transformer_2 (and only then)."""
    from flowrl.config import load_config
    from flowrl.model_card import SECOND_EXPERT_LORA, _load_snippet

    kontext = load_config(None, ["pipeline.name=flux_kontext", "pipeline.pretrained=black-forest-labs/FLUX.1-Kontext-dev"])
    snippet = _load_snippet(kontext, "lora", "me/kontext-lora")
    assert 'result = pipe(image=load_image("source.png"), prompt="your instruction").images[0]' in snippet
    assert "from diffusers.utils import load_image" in snippet
    wan = load_config(None, ["pipeline.name=wan", "pipeline.pretrained=Wan-AI/Wan2.2-T2V-A14B-Diffusers"])
    both = _load_snippet(wan, "lora", "me/wan-lora", frozenset({"pytorch_lora_weights.safetensors", SECOND_EXPERT_LORA}))
    assert f'pipe.load_lora_weights("me/wan-lora", weight_name="{SECOND_EXPERT_LORA}", load_into_transformer_2=True)' in both
    assert 'result = pipe("your prompt").frames[0]' in both
    assert "transformer_2" not in _load_snippet(wan, "lora", "me/wan-lora", frozenset({"pytorch_lora_weights.safetensors"}))
