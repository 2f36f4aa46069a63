"""flowrl check (flowrl/check/): it passes on a run whose training, evaluation, sampling and card agree, and names
the setting when one is deliberately dropped or changed on its way to the model, the re-score when the update's
sampler noise differs from the rollout's, the key when a set config field is read by nothing; and it runs on every
shipped preset at tiny size (the embedded models as shipped, the real families on the tests' tiny random builders)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from flowrl.check import check
from flowrl.cli import _sample_command, main
from flowrl.config import load_config
from flowrl.objectives.grpo import GRPOConfig
from flowrl.presets import preset_names

GRPO = "digits/grpo"
FAST = ["train.num_generations=4", "rollout.num_inference_steps=4", "eval.batch_size=1"]

pytestmark = pytest.mark.usefixtures("one_thread")


class GRPOWithUnreadKnob(GRPOConfig):
    """A deliberate fault: a section field its build never reads."""

    name: str = "tests.test_check:GRPOWithUnreadKnob"
    unused_knob: int = 0


def run(config=GRPO, *overrides: str):
    return check(config, [*FAST, *overrides], sample_command=_sample_command)


def test_passes_on_digits_grpo_and_prints_one_json_line(capsys):
    assert main(["check", GRPO, *FAST, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["passed"] and not result["mismatches"] and result["unread"] == []
    assert result["rescore"]["applies"] and all(s["max_abs"] == 0.0 for s in result["rescore"]["steps"])
    settings = result["settings"]
    assert set(settings) == {"rollout", "evaluation", "eval spec", "Trainer.sample", "flowrl sample", "model card"}
    assert {row["steps"] for row in settings.values()} == {4}
    # the one difference from the rollout is the sampler, intended: the evaluation's ODE is the SDE's noise-free step
    assert result["intended"] and all("sampler" in line and "deterministic counterpart" in line for line in result["intended"])


def test_human_report_names_each_part(capsys):
    assert main(["check", GRPO, *FAST]) == 0
    out = capsys.readouterr().out
    assert "flowrl check digits/grpo: PASS" in out and "re-score" in out and "intended differences" in out
    assert "steps: 4 (every path)" in out and "config keys set but read by no part of the run: none" in out


def _held_out_with(monkeypatch, **changes):
    """The evaluation builder with a deliberate fault: its held-out setting changed after it was built."""
    import flowrl.modalities.images as images

    build = images.held_out_images
    monkeypatch.setattr(images, "held_out_images", lambda *a, **k: dataclasses.replace(build(*a, **k), **changes))


def test_guidance_dropped_by_the_evaluation_is_named(monkeypatch):
    _held_out_with(monkeypatch, guidance_scale=1.0)
    result = run(GRPO, "rollout.guidance_scale=2.0")
    assert not result.passed
    assert "evaluation's guidance scale is 1 but the rollout's is 2" in result.mismatches
    assert "evaluation's guidance scale is 1 but the rollout's is 2" not in "".join(d.sentence() for d in result.differences if d.intended)
    # the eval spec still records the config's guidance: what the evaluation ran and what it records disagree
    assert "eval spec's guidance scale is 2 but the evaluation's is 1" in result.mismatches


def test_shift_dropped_by_the_evaluation_is_named(monkeypatch):
    import flowrl.modalities.images as images
    from flowrl.samplers.schedules import FlowSchedule

    build = images.held_out_images
    monkeypatch.setattr(
        images,
        "held_out_images",
        lambda config, pipeline, device: dataclasses.replace(build(config, pipeline, device), sigmas=FlowSchedule(shift=1.0).sigmas(4)),
    )
    result = run(GRPO, "pipeline.flow_shift=3.0")
    assert any(
        m.startswith("evaluation's time grid is [") and "the rollout's is the model's schedule (shift 3)" in m for m in result.mismatches
    )


def test_declared_eval_steps_are_intended_but_flowrl_sample_must_follow_them(monkeypatch):
    assert run(GRPO, "eval.num_inference_steps=3").passed  # declared: the evaluation's 3 steps are intended
    import flowrl.cli as cli

    source = cli._sample_source

    def rollout_defaults(path):  # the fault flowrl sample had: a checkpoint sampled at the rollout's steps
        pipeline, _, guidance, config = source(path)
        return pipeline, config.rollout.num_inference_steps, guidance, config

    monkeypatch.setattr(cli, "_sample_source", rollout_defaults)
    result = run(GRPO, "eval.num_inference_steps=3")
    assert result.mismatches == ["flowrl sample's steps is 4 but the evaluation's is 3"]


def test_model_card_stating_the_rollout_settings_is_named(monkeypatch):
    import flowrl.model_card as card

    monkeypatch.setattr(card, "_sampling_line", lambda config: "- **Sampling, as evaluated:** `flow_sde`, `num_inference_steps=4`")
    result = run(GRPO, "eval.num_inference_steps=3")
    assert set(result.mismatches) == {
        "model card's sampler is flow_sde but the evaluation's is ode",
        "model card's steps is 4 but the evaluation's is 3",
    }


def test_sampler_noise_changed_in_the_update_breaks_ratio_one(monkeypatch):
    from flowrl.samplers.flow_sde import FlowSDESampler

    step = FlowSDESampler.step

    def rescored_with_more_noise(self, model_output, x, sigma, sigma_next, x_next=None, generator=None):
        if x_next is None:
            return step(self, model_output, x, sigma, sigma_next, x_next, generator)
        return step(dataclasses.replace(self, noise_level=self.noise_level * 1.01), model_output, x, sigma, sigma_next, x_next, generator)

    monkeypatch.setattr(FlowSDESampler, "step", rescored_with_more_noise)
    result = run()
    assert not result.passed and result.mismatches
    assert all(m.startswith("re-scoring step ") and "float32 tolerance" in m for m in result.mismatches)


def test_a_set_field_no_part_of_the_run_reads_is_named():
    result = run(GRPO, "objective.name=tests.test_check:GRPOWithUnreadKnob", "objective.unused_knob=3")
    assert result.unread == ["objective.unused_knob"]
    assert result.mismatches == ["config key 'objective.unused_knob' is set but no part of this run reads it"]
    assert main(["check", GRPO, *FAST, "objective.name=tests.test_check:GRPOWithUnreadKnob", "objective.unused_knob=3"]) == 1


def test_objective_without_log_probs_says_the_rescore_does_not_apply():
    result = run("digits/diffusion_nft")
    assert result.passed and not result.rescore.applies and "no per-step log-probs" in result.rescore.note


@pytest.mark.slow
def test_the_keys_the_check_leaves_to_flowrl_train_are_read_by_it(tmp_path):
    """reads.LIFECYCLE: every key the check does not reach is read by a real flowrl train run."""
    from flowrl.check.reads import LIFECYCLE, ReadRecorder, set_keys
    from flowrl.trainer import Trainer

    values = {"train.stop_after": 1, "eval.every": 1, "log.checkpoint_every": 1, "log.progress": "false"}
    assert set(values) == set(LIFECYCLE)
    config = load_config(
        GRPO,
        [*FAST, f"output_dir={tmp_path}", "train.iterations=1", "train.prompts_per_iteration=1"] + [f"{k}={v}" for k, v in values.items()],
    )
    recorder = ReadRecorder()
    with recorder.recording():
        Trainer(config).fit()
    read = {key for key, section, name in set_keys(config) if (id(section), name) in recorder.reads}
    assert set(LIFECYCLE) <= read


# -- every shipped preset at tiny size ---------------------------------------------------------------------------------
# a diffusion LM's evaluation reads neither eval.samples_per_prompt nor eval.batch_size (one greedy completion per
# prompt, rollout.batch_size rows at a time), and offline pairs are not rolled out: the check would name them, rightly
GROUP, EVAL = ["train.num_generations=2", "train.batch_size=2", "rollout.batch_size=2"], ["eval.samples_per_prompt=1", "eval.batch_size=1"]
CPU = ["pipeline.device=cpu", "pipeline.dtype=float32", "train.mixed_precision=no", "eval.judge=null", "reward.kwargs={}"]


def _family(module: str, builder: str, *args, **kwargs):
    def build(directory: Path) -> Path:
        import importlib

        return getattr(importlib.import_module(f"tests.{module}"), builder)(directory, *args, **kwargs)

    return build


# preset family -> (tiny checkpoint builder, overrides that size the run for it)
T5, VIDEO = (
    ["pipeline.max_sequence_length=8"],
    ["pipeline.height=32", "pipeline.width=32", "pipeline.num_frames=5", "pipeline.max_sequence_length=16"],
)
FAMILIES = {
    "flux/dance_grpo_hpsv2": (_family("test_family_sd3_flux", "build_tiny_flux"), [*T5, "pipeline.height=16", "pipeline.width=16"]),
    "flux2/grpo_dev_clip_pickscore": (
        _family("test_family_flux2", "build_tiny_flux2", "dev"),
        ["pipeline.max_sequence_length=64", "pipeline.height=16", "pipeline.width=16"],
    ),
    "flux2/grpo_klein": (
        _family("test_family_flux2", "build_tiny_flux2", "klein"),
        ["pipeline.max_sequence_length=32", "pipeline.height=16", "pipeline.width=16"],
    ),
    "flux2/dmd2_klein": (
        _family("test_family_flux2", "build_tiny_flux2", "klein"),
        ["pipeline.max_sequence_length=32", "pipeline.height=16", "pipeline.width=16"],
    ),
    "flux_kontext/": (
        _family("test_family_flux_kontext", "build_tiny_kontext"),
        [*T5, "pipeline.height=16", "pipeline.width=16", "pipeline.condition_height=16", "pipeline.condition_width=16"],
    ),
    "qwen_image/grpo": (
        _family("test_family_qwen_image", "build_tiny_qwen_image"),
        ["pipeline.max_sequence_length=32", "pipeline.height=32", "pipeline.width=32"],
    ),
    "qwen_image/edit_plus": (
        _family("test_family_qwen_image", "build_tiny_qwen_edit", plus=True),
        ["pipeline.max_sequence_length=32", "pipeline.height=32", "pipeline.width=32", "pipeline.condition_area=9216"],
    ),
    "sd3/": (_family("test_family_sd3_flux", "build_tiny_sd3"), [*T5, "pipeline.height=32", "pipeline.width=32"]),
    "stable_diffusion/": (_family("tiny_components", "build_tiny_sd"), ["pipeline.height=32", "pipeline.width=32"]),
    "wan/grpo_motion": (_family("test_family_video", "build_tiny_wan"), VIDEO),
    "wan/wan22_t2v": (_family("test_family_wan22", "build_tiny_wan22"), VIDEO),
    "wan/wan22_ti2v": (
        _family("test_family_wan22", "build_tiny_ti2v"),
        ["pipeline.height=64", "pipeline.width=64", "pipeline.num_frames=5", "pipeline.max_sequence_length=16"],
    ),
    "z_image/": (
        _family("test_family_z_image", "build_tiny_z_image"),
        ["pipeline.max_sequence_length=48", "pipeline.height=16", "pipeline.width=16"],
    ),
}
EDITS = ("flux_kontext/", "qwen_image/edit_plus")


def _real_family(name: str):
    return next(((prefix, entry) for prefix, entry in FAMILIES.items() if name.startswith(prefix)), (None, None))


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """Each real family's tiny random checkpoint, built on first use."""
    built: dict[str, Path] = {}

    def get(prefix: str) -> Path:
        if prefix not in built:
            built[prefix] = FAMILIES[prefix][0](tmp_path_factory.mktemp(prefix.strip("/").replace("/", "_")))
        return built[prefix]

    return get


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    """The rows the edit presets' hub data set has (an instruction and a source image), two of them, local."""
    import numpy as np
    from PIL import Image

    d = tmp_path_factory.mktemp("check_prompts")
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(d / f"source{i}.png")
    prompts = ["make the cat red", "add a hat to the dog"]
    (d / "edit.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "image": str(d / f"source{i}.png")}) + "\n" for i, p in enumerate(prompts))
    )
    return d


@pytest.fixture(scope="module")
def dpo_pairs(tmp_path_factory):
    """The offline pairs digits/diffusion_dpo's `first` command writes, 4 of them."""
    from flowrl.preferences.pairs import build_pairs, write_pairs

    d = tmp_path_factory.mktemp("dpo")
    pairs, rewards, _ = build_pairs(
        load_config("digits/diffusion_dpo", [f"output_dir={d / 'unused'}", "rollout.num_inference_steps=2"]),
        4,
        torch.Generator().manual_seed(0),
    )
    return write_pairs(d / "pairs", pairs, rewards)


@pytest.fixture(scope="module")
def opd_teachers(tmp_path_factory):
    """A DiffusionOPD teacher checkpoint in flowrl's format (the base digits model's weights): the preset's teachers
    are trained by its bench, which a check at tiny size does not run."""
    from flowrl.pipelines.digits import DigitsConfig
    from flowrl.training.checkpoint import save_checkpoint

    weights = DigitsConfig(pretrained="digits_flow").build("cpu").trainable_state_dict()
    directory = tmp_path_factory.mktemp("opd") / "step_000000"
    return save_checkpoint(directory, weights, {"state": {}, "param_groups": []}, {"step": 0, "roles": {"policy": ""}}, "")


def preset_overrides(name: str, tiny_checkpoints, prompt_files, dpo_pairs, opd_teachers=None) -> list[str]:
    """The preset at tiny size: one small group and few steps; a real family on its tiny random checkpoint, on the CPU in
    float32, with a reward and prompts that need no hub (the edit models' prompts carry source images)."""
    if name.startswith("dllm/"):
        return GROUP
    steps = ["rollout.num_inference_steps=2"] if not name.startswith(("toy/", "digits/b2")) else []
    if "num_inference_steps" in load_config(name).eval.model_fields_set:  # kept apart from the rollout's, as the preset does
        steps.append("eval.num_inference_steps=3")
    if name == "digits/tree_grpo":  # a tree of two leaves (the group) branching at step 0 of 2
        return [*GROUP, *EVAL, *steps, "objective.branch_steps=[0]", "objective.branch_factor=2"]
    if name == "digits/diffusion_dpo":
        return ["train.batch_size=2", *EVAL, *steps, f"prompts.pairs={dpo_pairs}"]
    if name == "digits/diffusion_opd":  # both teachers on one checkpoint, each taking its preset's digits
        teachers = f"[{{name: ink, checkpoint: {opd_teachers}, route: [0, 2, 4, 6, 8]}}, {{name: one, checkpoint: {opd_teachers}, route: [1, 3, 5, 7, 9]}}]"
        return [*GROUP, *EVAL, *steps, f"objective.teachers={teachers}"]
    prefix, entry = _real_family(name)
    if prefix is None:
        return [*GROUP, *EVAL, *steps]
    video = name.startswith("wan/")
    reward = ["reward.components={motion_quality: 1.0}", "reward.video_frames={}"] if video else ["reward.components={ink: 1.0}"]
    if prefix in EDITS:  # the preset's own column mapping (dataset hf) over local rows shaped like its hub data set's
        file = prompt_files / "edit.jsonl"
        prompts = [f"prompts.train_file={file}", f"prompts.eval_file={file}"]
    else:
        prompts = []  # the preset's own prompt files, shipped with flowrl
    return [*GROUP, *EVAL, *steps, *CPU, f"pipeline.pretrained={tiny_checkpoints(prefix)}", *reward, *prompts, *entry[1]]


@pytest.mark.slow
@pytest.mark.parametrize("name", preset_names())
def test_every_preset_passes_at_tiny_size(name, tiny_checkpoints, prompt_files, dpo_pairs, opd_teachers):
    from tests.conftest import skip_without_sudoku_file

    if name.startswith("dllm/sudoku"):
        skip_without_sudoku_file("the Sudoku presets")
    result = check(name, preset_overrides(name, tiny_checkpoints, prompt_files, dpo_pairs, opd_teachers), sample_command=_sample_command)
    assert result.passed, result.mismatches


@pytest.mark.slow
def test_a_tree_is_re_scored_edge_by_edge():
    """TreeGRPO re-scores one row per tree edge, in edge order, not in the minibatch's row order: the re-score pairs each
    new log-prob with the recorded one of the row whose transition it is (found by its recorded next state). Paired by
    position instead, the preset's last branch step read max |log r| 0.22."""
    result = check("digits/tree_grpo", EVAL)
    assert result.passed, result.mismatches
