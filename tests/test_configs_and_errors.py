"""Every preset validates; bad input gets one sentence, a non-zero exit, and leaves no files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import CONFIGS, REPO, fast_overrides

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.presets import summary

PRESETS = sorted(
    p for p in CONFIGS.rglob("*.yaml") if "accelerate" not in p.relative_to(CONFIGS).parts
)  # accelerate configs: tests/test_distributed.py
GRPO = CONFIGS / "digits" / "grpo.yaml"


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_preset_loads_and_names_its_command(path):
    """Every preset (real checkpoints included: no weights needed) validates, names its launch command
    and hardware, resolves its prompt files, and names a pipeline family and rewards that exist."""
    from flowrl.pipelines import FAMILIES
    from flowrl.prompts.files import resolve_prompt_file

    config = load_config(path)
    text = path.read_text()
    first = text.splitlines()[0]
    assert first.startswith(("# flowrl train", "# accelerate launch")) and str(path.relative_to(REPO)) in first
    assert "Hardware:" in text
    description = summary(str(path.relative_to(CONFIGS).with_suffix("")))  # the one declared line flowrl presets shows
    assert 20 <= len(description) <= 100 and not description.endswith((".", ","))
    assert config.output_dir
    if config.prompts.dataset == "file":
        resolve_prompt_file(config.prompts.train_file), resolve_prompt_file(config.prompts.eval_file)
    assert config.pipeline.name in FAMILIES.builtin_names() and type(config.pipeline) is FAMILIES.section(config.pipeline.name)


def test_overrides_apply_with_types():
    cfg = load_config(GRPO, ["train.iterations=3", "sampler.noise_level=0.5", "objective.std=biased", "reward.components.ink=0.5"])
    assert cfg.train.iterations == 3 and cfg.sampler.noise_level == 0.5 and cfg.objective.std == "biased"
    assert cfg.reward.components == {"digit_classifier": 1.0, "ink": 0.5}


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.iteratons=3", "unknown config key 'train.iteratons'"),
        ("train.iterations=abc", "config key 'train.iterations'"),
        ("sampler.name=euler_magic", "'euler_magic'"),
        ("objective.name=ppo2", "'ppo2'"),
        ("reward.components.clip_magic=1.0", "unknown reward 'clip_magic'"),
        ("rollout.num_inference_steps=0", "rollout.num_inference_steps"),
        ("train.iterations", "key.sub=value"),
        # a NaN or infinite weight (or any number) can only train nothing or garbage
        ("reward.components.ink=.nan", "config key 'reward.components.ink' is invalid: input should be a finite number (got nan)."),
        ("train.learning_rate=.inf", "config key 'train.learning_rate' is invalid: input should be a finite number (got inf)."),
        ("train.max_nonfinite_fraction=1.5", "config key 'train.max_nonfinite_fraction'"),
    ],
)
def test_bad_config_is_one_sentence_and_writes_nothing(tmp_path, capsys, override, needle):
    out = tmp_path / "run"
    code = main(["train", str(GRPO), f"output_dir={out}", override])
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err and err.startswith("flowrl: error: ") and err.count("\n") == 1, err
    assert not out.exists()


def _preset(tmp_path, sampler: str, model: str = "digits_flow"):
    path = tmp_path / "preset.yaml"
    path.write_text(f"output_dir: {tmp_path / 'r'}\npipeline: {{pretrained: {model}}}\nsampler: {{name: {sampler}}}\n")
    return str(path)


@pytest.mark.slow
def test_sampler_that_does_not_fit_the_model(tmp_path, capsys):
    assert main(["train", _preset(tmp_path, "ddim")]) == 2
    assert "does not fit this rectified-flow" in capsys.readouterr().err
    assert main(["train", _preset(tmp_path, "flow_sde", "digits_ddpm")]) == 2
    assert "does not fit this diffusion (epsilon)" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_deterministic_sampler_refused_for_policy_gradient(tmp_path, capsys):
    assert main(["train", _preset(tmp_path, "ode")]) == 2
    assert "needs log-probs" in capsys.readouterr().err


def test_missing_config_and_missing_checkpoint(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", str(GRPO), *fast_overrides(tmp_path / "r"), f"resume_from={tmp_path / 'no_ckpt'}"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_corrupt_checkpoint_is_reported_not_loaded(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", str(GRPO), *fast_overrides(run, **{"train.iterations": 1})]) == 0
    capsys.readouterr()
    ckpt = run / "checkpoints" / "step_000001"
    assert main(["eval", str(ckpt)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the number comes with the settings it depends on (the run's eval settings, not defaults)
    assert "eval/reward/mean" in printed and printed["settings"] == {
        "model": "digits_flow",
        "dataset": "digits",
        "samples_per_prompt": 1,
        "seed": 1234,
        "steps": 4,
        "guidance_scale": 1.0,
        "sampler": "ode",
    }
    assert main(["sample", str(ckpt), "--prompt", "digit 4", "-n", "2", "--out", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").is_file()
    bad = tmp_path / "bad_ckpt"
    shutil.copytree(ckpt, bad)
    (bad / "denoiser.safetensors").write_bytes(b"\x00garbage" * 10)
    assert main(["eval", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "corrupt" in err and "denoiser.safetensors" in err and err.count("\n") == 1
    (bad / "denoiser.safetensors").unlink()
    assert main(["train", str(GRPO), *fast_overrides(run, **{"train.iterations": 2}), f"resume_from={bad}"]) == 2
    assert "incomplete" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_process_exit_code_and_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "train", str(GRPO), "train.lr=1"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "flowrl: error: unknown config key 'train.lr'."
    assert "Traceback" not in proc.stderr


def test_sample_command_writes_a_grid(tmp_path):
    out = tmp_path / "grid.png"
    assert main(["sample", "digits_flow", "--prompt", "a handwritten seven", "-n", "3", "--steps", "4", "--out", str(out)]) == 0
    from PIL import Image

    assert Image.open(out).size[0] > 3 * 8


def test_load_config_raises_flowrl_error_for_non_mapping(tmp_path):
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(FlowRLError, match="mapping"):
        load_config(bad)


@pytest.mark.slow
def test_fresh_run_refuses_an_existing_run_dir(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", str(GRPO), *fast_overrides(run, **{"train.iterations": 1})]) == 0
    before = (run / "metrics.jsonl").read_text()
    assert main(["train", str(GRPO), *fast_overrides(run, **{"train.iterations": 1})]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == before  # nothing lost
    assert main(["train", str(GRPO), *fast_overrides(run, **{"train.iterations": 1}), "overwrite=true"]) == 0
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]


def test_renaming_a_part_names_the_keys_the_user_wrote():
    """`sampler.name=ddim` on a flow_sde preset leaves the preset's flow_sde keys behind: the error says so, in the
    user's own override, instead of naming a key the user never typed as unknown."""
    with pytest.raises(FlowRLError) as e:
        load_config(GRPO, ["sampler.name=ddim"])
    assert str(e.value) == (
        "sampler.name=ddim replaces sampler 'flow_sde', and the config's key 'sampler.diffusion' belongs to 'flow_sde', "
        "not 'ddim'; give the whole section instead, e.g. sampler={name: ddim} (flowrl config sampler.ddim lists its keys)."
    )
    assert load_config(GRPO, ["sampler={name: ddim}"]).sampler.name == "ddim"  # what the sentence proposes works
    with pytest.raises(FlowRLError, match=r"^unknown config key 'objective\.std'\.$"):  # a key the user did write
        load_config(GRPO, ["objective.name=ddpo", "objective.std=batch"])
