"""Several trained roles in one run (flowrl/training/roles.py): a user's objective (tests/two_role_objective.py) trains a
critic beside the policy, as a module of its own or as a second LoRA adapter on the policy's base, and reads a frozen
role. Each trained role has its own optimizer, learning rate and checkpoint entry; a run of two roles resumes bit for
bit, in one process and under DDP, FSDP2 and DeepSpeed ZeRO-2/3 with 2 CPU processes (the slow launches)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, REPO, fast_overrides, launch_report, run_launch
from safetensors.torch import load_file

from flowrl.errors import FlowRLError

GRPO = CONFIGS / "digits" / "grpo.yaml"
TWO_ROLES = {"objective.name": "two_role_objective:CriticGRPOConfig", "log.checkpoint_every": 1, "log.trackers": "[]"}
ADAPTER = {**TWO_ROLES, "objective.critic": "adapter", "pipeline.lora": "{r: 4, alpha: 8}", "train.learning_rate": 1e-3}


def _trainer(out: Path, **extra):
    from flowrl.trainer import Trainer

    return Trainer(str(GRPO), fast_overrides(out, **{**TWO_ROLES, **extra}))


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:06d}"


@pytest.mark.slow
def test_each_trained_role_has_its_own_optimizer_learning_rate_and_checkpoint_entry(tmp_path):
    trainer = _trainer(tmp_path / "run")
    policy, critic = trainer.roles.trained
    assert trainer.roles.names() == ["policy", "critic"] and [f.name for f in trainer.roles.frozen] == ["anchor"]
    assert policy.optimizer is not critic.optimizer
    assert policy.optimizer.param_groups[0]["lr"] == pytest.approx(3e-4) and critic.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3)
    assert {id(p) for p in critic.parameters} == {id(p) for p in trainer.objective.critic.parameters()}
    assert not {id(p) for p in policy.parameters} & {id(p) for p in critic.parameters}
    anchor = trainer.objective.anchor
    assert not any(p.requires_grad for p in anchor.parameters())  # frozen: no gradient, in no optimizer
    anchor_before = {k: v.clone() for k, v in anchor.state_dict().items()}
    before = {k: v.clone() for k, v in trainer.roles.weights().items()}
    trainer.fit()
    after = trainer.roles.weights()
    assert all(not torch.equal(before[k], after[k]) for k in before)  # every weight of both roles was trained
    assert all(torch.equal(anchor_before[k], v) for k, v in anchor.state_dict().items())
    checkpoint = _step(tmp_path / "run", 2)
    weights = load_file(checkpoint / "denoiser.safetensors")
    assert {k[len("critic.") :] for k in weights if k.startswith("critic.")} == set(trainer.objective.critic.state_dict())
    assert not any("anchor" in k for k in weights)  # a frozen role is not saved
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["roles"] == {"policy": "", "critic": "critic."}
    groups = state["optimizer"]["param_groups"]
    assert [g["lr"] for g in groups] == pytest.approx([3e-4, 3e-3]) and groups[1]["params"][0] == len(policy.parameters)
    moments = load_file(checkpoint / "optimizer.safetensors")  # one file, the critic's parameters numbered after the policy's
    assert len({k.split(".")[0] for k in moments}) == len(policy.parameters) + len(critic.parameters)
    row = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert {"loss/critic", "train/grad_norm", "train/grad_norm/critic", "train/learning_rate/critic"} <= set(row)


def test_train_roles_sets_one_roles_optimizer_and_names_only_trained_roles(tmp_path):
    trainer = _trainer(tmp_path / "a", **{"train.roles.critic.learning_rate": 0.02, "train.roles.critic.max_grad_norm": 0.5})
    critic = trainer.roles["critic"]
    assert critic.optimizer.param_groups[0]["lr"] == 0.02 and critic.settings.max_grad_norm == 0.5
    assert trainer.roles.policy.settings.max_grad_norm == 1.0  # train.max_grad_norm: the policy keeps train's
    with pytest.raises(
        FlowRLError, match=r"^train.roles names teacher, which this run does not train; its trained roles are policy, critic\.$"
    ):
        _trainer(tmp_path / "b", **{"train.roles.teacher.learning_rate": 0.1})


def _resume_from_first(run: Path, resumed: Path, launch=None) -> None:
    shutil.copytree(run, resumed)
    shutil.rmtree(_step(resumed, 2))
    launch(resumed, resume_from=str(_step(resumed, 1)))


def _assert_same_second_iteration(run: Path, resumed: Path) -> None:
    """The second iteration of the resumed run equals the uninterrupted one's: every role's weights and optimizer
    tensors (and DeepSpeed's partitions), and every metric."""
    for name in ("denoiser.safetensors", "optimizer.safetensors"):
        a, b = load_file(_step(run, 2) / name), load_file(_step(resumed, 2) / name)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name
    for partition in sorted((_step(run, 2) / "deepspeed").rglob("*.pt")):
        other = _step(resumed, 2) / partition.relative_to(_step(run, 2))
        _assert_equal_tree(torch.load(partition, weights_only=False), torch.load(other, weights_only=False), partition.name)
    rows = [[json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()] for r in (run, resumed)]
    strip = [[{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rs] for rs in rows]
    assert strip[0] == strip[1]


def _assert_equal_tree(a, b, where: str) -> None:
    if torch.is_tensor(a):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_equal_tree(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal_tree(x, y, f"{where}/{i}")


@pytest.mark.parametrize("extra", [{}, ADAPTER], ids=["module_critic", "adapter_critic"])
@pytest.mark.slow
def test_a_two_role_run_resumes_bit_for_bit_in_one_process(tmp_path, extra):
    def launch(out: Path, **more) -> None:
        _trainer(out, **{**extra, **more}).fit()

    launch(tmp_path / "run")
    _resume_from_first(tmp_path / "run", tmp_path / "resumed", launch)
    _assert_same_second_iteration(tmp_path / "run", tmp_path / "resumed")


@pytest.mark.slow
def test_an_adapter_role_is_a_second_lora_on_the_policys_base(tmp_path):
    trainer = _trainer(tmp_path / "run", **ADAPTER)
    pipeline, critic = trainer.pipeline, trainer.roles["critic"]
    policy_keys = set(pipeline.trainable_state_dict())
    assert policy_keys and all(".default." in k for k in policy_keys)
    assert set(critic.state_dict()) == {k.replace(".default.", ".critic.") for k in policy_keys}
    x = pipeline.initial_noise(2, torch.Generator().manual_seed(0))
    cond, sigma = pipeline.encode(["a 3", "a 7"]), torch.tensor(0.5)
    with torch.no_grad():
        for p in critic.parameters:  # a critic adapter unlike the policy's: its predictions differ from the policy's
            p.add_(0.5)
        own = pipeline.predict(x, sigma, cond)
        with pipeline.use_adapter("critic"):
            other = pipeline.predict(x, sigma, cond)
        again = pipeline.predict(x, sigma, cond)
    assert not torch.equal(own, other) and torch.equal(own, again)
    assert all(p.requires_grad for p in [*trainer.roles.policy.parameters, *critic.parameters])
    trainer.fit()
    lora = load_file(_step(tmp_path / "run", 2) / "pytorch_lora_weights.safetensors")
    assert len(lora) == len(policy_keys)  # the diffusers LoRA file holds the policy's adapter alone


def test_an_adapter_role_without_a_lora_policy_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(FlowRLError, match=r"^role 'critic' is a LoRA adapter on the policy's base model, .* set pipeline\.lora"):
        _trainer(tmp_path / "run", **{"objective.critic": "adapter"})


# -- 2 CPU processes under each launch ----------------------------------------------------------------------------------


def _launcher(config_file: str, extra: dict):
    def launch(out: Path, **more) -> subprocess.CompletedProcess:
        overrides = fast_overrides(out, **{**TWO_ROLES, "objective.timestep_fraction": 0.5, **extra, **more})
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "accelerate" / config_file)]
        cmd += ["--num_processes", "2", "--main_process_port", "0", "-m", "flowrl.cli", "train", str(GRPO), *overrides]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
        return run_launch(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=REPO)

    def checked(out: Path, **more) -> None:
        proc = launch(out, **more)
        assert proc.returncode == 0, launch_report(proc)

    return launch, checked


LAUNCHES = [
    ("ddp.yaml", {}),
    ("fsdp.yaml", {}),
    ("deepspeed_zero2.yaml", {}),
    ("deepspeed_zero3.yaml", {}),
    ("ddp.yaml", ADAPTER),
    ("fsdp.yaml", ADAPTER),
]


@pytest.mark.slow
@pytest.mark.parametrize("config_file, extra", LAUNCHES, ids=["ddp", "fsdp", "zero2", "zero3", "ddp_adapter", "fsdp_adapter"])
def test_a_two_role_run_resumes_bit_for_bit_under_each_launch(tmp_path, config_file, extra):
    _, checked = _launcher(config_file, extra)
    checked(tmp_path / "run")
    _resume_from_first(tmp_path / "run", tmp_path / "resumed", checked)
    _assert_same_second_iteration(tmp_path / "run", tmp_path / "resumed")
    if config_file.startswith("deepspeed"):  # one engine per trained role, each with its partitions
        tags = sorted(p.name for p in (_step(tmp_path / "run", 2) / "deepspeed").iterdir() if p.is_dir())
        assert tags == ["critic", "engine"]


@pytest.mark.slow
def test_an_adapter_role_under_deepspeed_is_refused_in_one_sentence(tmp_path):
    launch, _ = _launcher("deepspeed_zero2.yaml", ADAPTER)
    proc = launch(tmp_path / "run")
    assert proc.returncode != 0
    assert "role 'critic' is a LoRA adapter on the policy's base, which a DeepSpeed engine would step together" in proc.stderr
