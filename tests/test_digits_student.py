"""The shipped 2-step student flowrl/assets/digits_flow_2step (python -m flowrl.pipelines.embedded.distil_digits_student):
the digits_flow architecture with other weights, its record naming the command and its 2 steps, and its held-out
evaluation at 2 steps equal to the one recorded when it was written (the merged LoRA reproduces the DMD2 run's)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from flowrl.pipelines.embedded.training import ASSETS

STUDENT = ASSETS / "digits_flow_2step"


def test_the_student_is_the_teachers_architecture_with_its_own_weights_and_record():
    info = json.loads((STUDENT / "training_info.json").read_text())
    assert info["num_inference_steps"] == 2 and info["distilled_from"] == "digits_flow"
    assert info["command"].startswith("python -m flowrl.pipelines.embedded.distil_digits_student")
    assert info["held_out"] == info["held_out_lora_run"]  # the merged model evaluates as the LoRA run did
    teacher_config = json.loads((ASSETS / "digits_flow" / "unet" / "config.json").read_text())
    student_config = json.loads((STUDENT / "unet" / "config.json").read_text())
    assert {k: v for k, v in student_config.items() if not k.startswith("_")} == {
        k: v for k, v in teacher_config.items() if not k.startswith("_")
    }
    student = load_file(STUDENT / "unet" / "diffusion_pytorch_model.safetensors")
    teacher = load_file(ASSETS / "digits_flow" / "unet" / "diffusion_pytorch_model.safetensors")
    assert student.keys() == teacher.keys() and not any("lora" in k for k in student)
    assert any(not torch.equal(student[k], teacher[k]) for k in student)


@pytest.mark.slow
def test_the_shipped_student_reproduces_its_recorded_held_out_evaluation(tmp_path, one_thread):
    from accelerate.state import AcceleratorState

    from flowrl.pipelines.embedded.distil_digits_student import evaluate_model

    AcceleratorState._reset_state(True)
    info = json.loads((STUDENT / "training_info.json").read_text())
    # by name, through the digits family's loading path; the held-out setting of configs/digits/dmd2.yaml at 2 steps
    measured = evaluate_model("digits_flow_2step", tmp_path / "eval")
    assert measured == pytest.approx(info["held_out"], abs=2e-6)
