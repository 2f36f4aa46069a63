"""The Python API: a run from a preset name plus overrides, a reward that is a plain function, a model already in
memory; train, sample and evaluate without the CLI, and with the same numbers the CLI gives."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from conftest import fast_overrides

import flowrl
from flowrl.cli import main
from flowrl.errors import FlowRLError
from tests.tiny_components import family_config, tiny_sd_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")


def boldness(samples, prompts, metadata):
    """The user's reward: mean intensity, as a numpy array (any array-like of one score per sample will do)."""
    return samples.flatten(1).mean(1).numpy()


def test_importing_flowrl_is_cheap():
    import subprocess

    code = "import sys, flowrl; print('torch' in sys.modules, flowrl.presets()[:1])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False ['digits/adjoint_matching']"


def test_presets_stays_a_function_after_its_module_is_imported():
    """Importing the submodule flowrl.presets (as the CLI does) must not replace the function flowrl.presets."""
    import flowrl.presets
    from flowrl.presets import preset_names

    assert callable(flowrl.presets) and flowrl.presets() == flowrl.presets() == preset_names()


@pytest.mark.slow
def test_a_preset_by_name_a_function_as_reward_train_sample_evaluate(tmp_path):
    run = tmp_path / "run"
    trainer = flowrl.Trainer(
        "digits/grpo",
        fast_overrides(run, **{"log.trackers": "[]", "log.checkpoint_every": 2}),
        reward={"boldness": boldness, "digit_classifier": flowrl.reward("digit_classifier")},
        reward_weights={"boldness": 2.0},
    )
    assert trainer.config.reward.components == {"boldness": 2.0, "digit_classifier": 1.0}
    summary = trainer.train()
    assert summary["status"] == "completed" and summary["iterations_completed"] == 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"reward/boldness", "reward/digit_classifier", "eval/reward/boldness"} <= set(rows[-1])
    assert rows[-1]["eval/reward/mean"] == pytest.approx(
        2 * rows[-1]["eval/reward/boldness"] + rows[-1]["eval/reward/digit_classifier"], abs=1e-6
    )

    metrics = trainer.evaluate()  # the held-out metrics of the trained weights: what the run logged last
    assert metrics["eval/reward/mean"] == rows[-1]["eval/reward/mean"] == summary["eval_reward_final"]

    images = trainer.sample(["a handwritten seven", "the digit two"], num_samples=3, seed=5)
    assert images.shape == (6, 1, 8, 8) and 0 <= float(images.min()) and float(images.max()) <= 1
    assert torch.equal(images, trainer.sample(["a handwritten seven", "the digit two"], num_samples=3, seed=5))
    # the command line samples the saved checkpoint through the same function: the same pixels
    out = tmp_path / "seven.npy"
    assert (
        main(
            [
                "sample",
                str(run / "checkpoints" / "step_000002"),
                "--prompt",
                "a handwritten seven",
                "--prompt",
                "the digit two",
                "-n",
                "3",
                "--seed",
                "5",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert np.array_equal(np.load(out), images.numpy())
    assert "boldness: 2.0" in (run / "config.yaml").read_text()  # config.yaml records the components by name


def test_a_config_object_with_overrides_and_text_samples():
    config = flowrl.load_config("dllm/diffu_grpo", ["prompts.eval_size=8"])
    trainer = flowrl.Trainer(config, ["output_dir=unused", "log.trackers=[]", "pipeline.device=cpu"])
    assert trainer.config.prompts.eval_size == 8 and config.output_dir != "unused"  # overrides on a copy
    texts = trainer.sample("Tom has 3 apples and buys 4 more. How many apples does he have?", num_samples=2, temperature=1.0, seed=1)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    greedy = trainer.sample(["Tom has 3 apples and buys 4 more. How many apples does he have?"] * 2)
    assert greedy[0] == greedy[1]  # temperature 0 (the evaluation's): one answer


@pytest.mark.slow
def test_a_diffusers_pipeline_in_memory_trains_as_its_saved_directory_does(tmp_path):
    """pipeline=<a StableDiffusionPipeline object>: its components are used instead of loading pretrained, and the
    run is the run of the same pipeline saved and loaded by name, bit for bit."""
    from diffusers import StableDiffusionPipeline

    pipe = tiny_sd_pipeline()
    pipe.save_pretrained(tmp_path / "sd")
    on_disk = flowrl.Trainer(flowrl.load_config(None, family_config("stable_diffusion", tmp_path / "sd", tmp_path / "a", sampler="ddim")))
    in_memory = flowrl.Trainer(
        flowrl.load_config(None, family_config("stable_diffusion", tmp_path / "sd", tmp_path / "b", sampler="ddim")),
        pipeline=StableDiffusionPipeline.from_pretrained(tmp_path / "sd"),
    )
    assert in_memory.pipeline.source == str(tmp_path / "sd")  # the pipeline's own name_or_path
    on_disk.fit(), in_memory.fit()
    a, b = on_disk.pipeline.trainable_state_dict(), in_memory.pipeline.trainable_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def strip(run):
        return [
            {k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in (run / "metrics.jsonl").read_text().splitlines()
        ]

    assert strip(tmp_path / "a") == strip(tmp_path / "b")


def test_a_transformers_model_in_memory_for_a_diffusion_lm():
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from flowrl.pipelines.dllm import EMBEDDED_LMS

    path = EMBEDDED_LMS["arith_mdlm"]
    model, tokenizer = AutoModelForMaskedLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    config = flowrl.load_config("dllm/diffu_grpo", ["prompts.eval_size=16", "log.trackers=[]", "pipeline.device=cpu"])
    by_name, given = flowrl.Trainer(config), flowrl.Trainer(config, pipeline=(model, tokenizer))
    assert given.pipeline.model is model
    assert by_name.evaluate()["eval/reward/mean"] == given.evaluate()["eval/reward/mean"]


def test_a_wrong_pipeline_object_is_one_sentence(tmp_path):
    from diffusers import StableDiffusionPipeline

    pipe = tiny_sd_pipeline()
    pipe.save_pretrained(tmp_path / "sd")
    config = flowrl.load_config(None, family_config("sd3", tmp_path / "sd", tmp_path / "run"))
    with pytest.raises(
        FlowRLError,
        match=r"^the pipeline given to flowrl \(StableDiffusionPipeline\) has no 'tokenizer_2' component, "
        r"which pipeline.name=sd3 needs\.$",
    ):
        flowrl.Trainer(config, pipeline=StableDiffusionPipeline.from_pretrained(tmp_path / "sd"))


def test_reward_weights_without_a_mapping_are_refused():
    with pytest.raises(FlowRLError, match="reward_weights weighs the rewards given as reward"):
        flowrl.Trainer("digits/grpo", ["log.trackers=[]"], reward_weights={"ink": 2.0})


def test_a_python_reward_returning_the_wrong_shape_is_one_sentence_at_its_first_call(tmp_path):
    trainer = flowrl.Trainer(
        "digits/grpo",
        fast_overrides(tmp_path / "run", **{"log.trackers": "[]"}),
        reward=lambda samples, prompts, metadata: samples.mean(dim=(2, 3)),
    )
    with pytest.raises(
        FlowRLError,
        match=r"^reward '<lambda>' returned scores of shape \((\d+), 1\) for \1 samples; it must return one score "
        r"per sample, shape \(\1,\); no iteration had completed, so there is nothing to resume\.$",
    ):
        trainer.train()


@pytest.mark.parametrize("answer", [["0.7", "0.2"], np.array(["0.7", "0.2"]), ("0.7", 0.2), [b"0.7", 1.0]])
def test_a_reward_answering_in_text_is_refused_not_parsed(answer):
    """numpy would read '0.7' as 0.7; a reward answering in text (a judge's raw reply) is refused in one sentence."""
    from flowrl.reward_models.callable_reward import as_scores

    with pytest.raises(FlowRLError, match=r"^reward 'judge' returned text \((b?'0\.7')\), not numbers; convert its answer"):
        as_scores(answer, 2, "judge", torch.device("cpu"))
    assert as_scores([0.7, 1], 2, "judge", torch.device("cpu")).scores.tolist() == pytest.approx([0.7, 1.0])


def test_several_trainers_with_other_settings_in_one_session(tmp_path):
    """accelerate keeps one state per process and refuses a second Accelerator with another precision or device; a
    notebook that builds a bf16 Trainer and then a float32 one (or a CPU one and then an automatic one) must not care."""
    base = fast_overrides(tmp_path / "run", **{"log.trackers": "[]"})
    first = flowrl.Trainer("digits/grpo", [*base, "train.mixed_precision=bf16"])
    assert first.accelerator.mixed_precision == "bf16"
    second = flowrl.Trainer("digits/grpo", [*base, "train.mixed_precision=no"])
    assert second.accelerator.mixed_precision == "no"
    third = flowrl.Trainer("digits/grpo", [*base, "pipeline.device=auto"])
    assert third.accelerator.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_every_flowrl_name_the_readme_uses_is_importable():
    """The README's `flowrl.<name>` attributes and `python -m flowrl.<module>` commands resolve (entry-point groups
    such as `flowrl.rewards` are names of groups, not modules, and are left out)."""
    import importlib
    import re

    from conftest import REPO

    text = (REPO / "README.md").read_text()
    groups = {"rewards", "objectives", "pipelines", "samplers", "prompts", "searches"}  # entry-point groups flowrl.<kind>s
    names = set(re.findall(r"\bflowrl\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", text)) - groups
    modules = set(re.findall(r"python -m (flowrl[\w.]*)", text))
    assert {"Trainer", "load_config", "reward", "register_reward"} <= names and modules
    for name in sorted(names):
        head, *rest = name.split(".")
        if rest or head in ("cli",):
            importlib.import_module(f"flowrl.{name}")
        else:
            assert getattr(flowrl, head) is not None, name
    for module in sorted(modules):
        assert importlib.util.find_spec(module) is not None, module
