"""Sharded training through accelerate (docs/distributed.md): the shipped configs parse with accelerate's own
loader, and a 2-process FSDP2 run of the digits GRPO preset on CPU (gloo) trains as a 1-process run of the same
global batch does, writes full-tensor checkpoints, resumes identically and exports a model that loads back.

Why the runs can match: every rollout draw is made for the whole world and keyed by global indices (prompts by
a rank-free stream, noise per sample: seeding.RowGenerators), so 2 processes sample exactly what 1 process
samples, split in two. The update matches when each process's minibatch is its whole share (train.batch_size 4
per process against 8 in one process) and every step is trained (timestep_fraction 1: the subset of steps is
drawn per process). What is left is the order of float32 sums: DDP all-reduces, FSDP reduce-scatters, one
process sums 8 rows at once. Tolerances: rewards and losses 1e-5 absolute (the runs differ by ~1e-7 per step;
the policy loss is itself ~1e-6 because GRPO's ratio starts at 1), weights 1e-5 absolute after 3 steps.
"""

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

GRPO = CONFIGS / "digits" / "grpo.yaml"
ACCELERATE = CONFIGS / "accelerate"
ITERATIONS = 3
SHARDED = ("ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3")  # configs/accelerate/*.yaml launched with 2 processes


def _launch(config_file: str | None, output_dir: Path, **extra: object) -> None:
    """accelerate launch, 2 CPU processes over gloo, one thread each; ``config_file=None``: one plain process
    with the same global batch (one minibatch of 8 rows where each of 2 processes has 4)."""
    overrides = fast_overrides(
        output_dir,
        **{
            "train.iterations": ITERATIONS,
            "log.checkpoint_every": 1,
            "objective.timestep_fraction": 1.0,
            **({} if config_file else {"train.batch_size": 8}),
            **extra,
        },
    )
    launch = (
        [
            "accelerate.commands.launch",
            "--config_file",
            str(ACCELERATE / config_file),
            "--num_processes",
            "2",
            "--main_process_port",
            "0",
            "-m",
        ]
        if config_file
        else []
    )
    cmd = [sys.executable, "-m", *launch, "flowrl.cli", "train", str(GRPO), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = run_launch(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, launch_report(proc)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _collect(modality, rank: int, world: int):
    """Process ``rank``'s batch of iteration 1 as the loop collects it (chunks decoded as they come)."""
    from flowrl.modalities.reward_overlap import RolloutScoring
    from flowrl.training.loop import collect_batch

    return collect_batch(modality.collector, 1, rank, world, RolloutScoring(None, False))


def _checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:06d}"


@pytest.mark.parametrize(
    "extra",
    [{}, {"rollout.same_noise_in_group": True}, {"rollout.branching.start_steps": 2}],
    ids=["own_noise", "group_noise", "b2_branches"],
)
def test_the_shares_of_two_processes_are_the_one_process_batch_split_in_two(tmp_path, extra):
    """Prompts and noise are drawn for the whole world and keyed by global index, so rank 0's and rank 1's
    rollouts (each in rollout chunks of 3) are the two halves of one process's batch (chunks of 8)."""
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    cfg = {"train.prompts_per_iteration": 4, "rollout.batch_size": 8, **extra}
    modality = Trainer(load_config(GRPO, fast_overrides(tmp_path / "one", **cfg))).modality
    whole = _collect(modality, 0, 1)
    modality.config.rollout.batch_size = 3
    shares = [_collect(modality, rank, 2) for rank in (0, 1)]
    assert [p for s in shares for p in s.prompts] == whole.prompts and len(set(whole.prompts)) > 1
    assert torch.equal(torch.cat([s.group_ids for s in shares]), whole.group_ids)
    latents = torch.cat([s.latents for s in shares])
    assert torch.equal(latents[:, 0], whole.latents[:, 0])  # the initial noise, bit for bit
    # every later state up to float rounding: the denoiser's kernels sum in another order at batch 3 than at 8
    assert (latents - whole.latents).abs().max() <= 1e-5
    log_probs = torch.cat([s.log_probs for s in shares])
    assert torch.equal(log_probs.isnan(), whole.log_probs.isnan())  # the same steps stochastic (B2: the branches' window)
    assert (log_probs - whole.log_probs).nan_to_num().abs().max() <= 1e-4
    first = whole.latents[:, 0].flatten(1)
    shared = bool(extra.get("rollout.same_noise_in_group")) or "rollout.branching.start_steps" in extra
    assert torch.equal(first[0], first[1]) is shared  # group members start from one x_1 exactly when asked (B2: the shared prefix)
    assert not torch.equal(first[0], first[4])  # groups never do


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    _launch(None, root / "single")
    for launch in SHARDED:
        _launch(f"{launch}.yaml", root / launch)
    return root


def test_shipped_accelerate_configs_parse_with_accelerates_loader():
    from accelerate.commands.config.config_args import load_config_from_file

    configs = {p.stem: load_config_from_file(str(p)) for p in sorted(ACCELERATE.glob("*.yaml"))}
    assert set(configs) == {"ddp", "fsdp", "fsdp_offload", "deepspeed_zero2", "deepspeed_zero3"}
    assert configs["ddp"].distributed_type.value == "MULTI_GPU"
    for name in ("fsdp", "fsdp_offload"):
        fsdp = configs[name].fsdp_config
        assert configs[name].distributed_type.value == "FSDP" and fsdp["fsdp_version"] == 2
        assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP" and fsdp["fsdp_reshard_after_forward"] is True
        assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp  # flowrl picks each family's blocks
        assert fsdp["fsdp_offload_params"] is (name == "fsdp_offload")
    for stage in (2, 3):
        config = configs[f"deepspeed_zero{stage}"]
        assert config.distributed_type.value == "DEEPSPEED" and config.deepspeed_config["zero_stage"] == stage


def test_each_family_shards_its_own_blocks():
    """The blocks chosen are the model class's _no_split_modules present in the model: the digits UNet's four."""
    from types import SimpleNamespace

    from diffusers import UNet2DConditionModel

    from flowrl.training.distributed import choose_blocks_to_wrap

    unet = UNet2DConditionModel.from_pretrained(str(REPO / "flowrl" / "assets" / "digits_flow" / "unet"))
    plugin = SimpleNamespace(transformer_cls_names_to_wrap=None)
    chosen = choose_blocks_to_wrap(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)), unet)
    assert chosen == ["BasicTransformerBlock", "ResnetBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"]
    assert plugin.transformer_cls_names_to_wrap == chosen
    unet.up_blocks = unet.up_blocks[1:]  # a model without UpBlock2D: the class is left out instead of refused
    plugin.transformer_cls_names_to_wrap = None
    assert "UpBlock2D" not in choose_blocks_to_wrap(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)), unet)


@pytest.mark.parametrize("launch", SHARDED)
@pytest.mark.slow
def test_two_processes_train_as_one_process_does_per_iteration(runs, launch):
    single, sharded = _rows(runs / "single"), _rows(runs / launch)
    assert [r["step"] for r in sharded] == [r["step"] for r in single] == list(range(ITERATIONS + 1))
    for a, b in zip(single[1:], sharded[1:]):
        for key in ("reward/mean", "reward/std", "reward/ink", "loss/policy"):
            assert abs(a[key] - b[key]) <= 1e-5, (launch, a["step"], key, a[key], b[key])
        assert abs(a["train/grad_norm"] - b["train/grad_norm"]) <= 1e-4 * a["train/grad_norm"]
    assert len({r["reward/mean"] for r in sharded[1:]}) == ITERATIONS  # the policy moved: rewards differ per iteration
    w_single = load_file(_checkpoint(runs / "single", ITERATIONS) / "denoiser.safetensors")
    w_sharded = load_file(_checkpoint(runs / launch, ITERATIONS) / "denoiser.safetensors")
    assert max((w_single[k] - w_sharded[k]).abs().max().item() for k in w_single) <= 1e-5


@pytest.mark.slow
def test_fsdp_checkpoint_holds_full_tensors(runs):
    """The main process writes every weight and AdamW moment whole (gathered from both shards)."""
    base = _base_unet_state()
    weights = load_file(_checkpoint(runs / "fsdp", ITERATIONS) / "denoiser.safetensors")
    assert {k: tuple(v.shape) for k, v in weights.items()} == {k: tuple(v.shape) for k, v in base.items()}
    moments = load_file(_checkpoint(runs / "fsdp", ITERATIONS) / "optimizer.safetensors")
    n = sum(v.numel() for v in base.values())
    assert sum(v.numel() for k, v in moments.items() if k.endswith(("exp_avg", "exp_avg_sq"))) == 2 * n


def _base_unet_state() -> dict:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(str(REPO / "flowrl" / "assets" / "digits_flow" / "unet")).state_dict()


@pytest.mark.slow
def test_zero3_checkpoint_holds_full_weights_and_the_engines_partitions(runs):
    """ZeRO-3 keeps a partition of every parameter per process: the checkpoint's weights are gathered whole, and
    DeepSpeed's own checkpoint beside them holds one AdamW partition file per process."""
    checkpoint = _checkpoint(runs / "deepspeed_zero3", ITERATIONS)
    weights = load_file(checkpoint / "denoiser.safetensors")
    assert {k: tuple(v.shape) for k, v in weights.items()} == {k: tuple(v.shape) for k, v in _base_unet_state().items()}
    partitions = sorted(p.name for p in (checkpoint / "deepspeed" / "engine").glob("*optim_states.pt"))
    assert len(partitions) == 2 and partitions[0] != partitions[1]
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["deepspeed_zero_stage"] == 3 and any(name.startswith("deepspeed/engine/") for name in state["files"])  # checksummed too


@pytest.mark.parametrize("launch", ["fsdp", "deepspeed_zero3"])
@pytest.mark.slow
def test_sharded_resume_continues_identically(runs, tmp_path, launch):
    resumed = tmp_path / "resumed"
    shutil.copytree(runs / launch, resumed)
    for step in range(2, ITERATIONS + 1):
        shutil.rmtree(_checkpoint(resumed, step))
    _launch(f"{launch}.yaml", resumed, resume_from=str(_checkpoint(resumed, 1)))
    original, again = _rows(runs / launch), _rows(resumed)
    assert [r["step"] for r in again] == list(range(ITERATIONS + 1))
    for a, b in zip(original[2:], again[2:]):
        assert (a["reward/mean"], a["loss/policy"], a["train/grad_norm"]) == (b["reward/mean"], b["loss/policy"], b["train/grad_norm"])
    w_original = load_file(_checkpoint(runs / launch, ITERATIONS) / "denoiser.safetensors")
    w_again = load_file(_checkpoint(resumed, ITERATIONS) / "denoiser.safetensors")
    assert all(torch.equal(w_original[k], w_again[k]) for k in w_original)  # bitwise: the shards were restored exactly


@pytest.mark.slow
def test_a_deepspeed_checkpoint_resumed_without_deepspeed_is_refused_in_one_sentence(runs, tmp_path):
    """Its AdamW moments lie in DeepSpeed's partition files, which a DDP or 1-process run cannot read: resuming
    there would restart the moments silently."""
    from flowrl.config import load_config
    from flowrl.errors import FlowRLError
    from flowrl.trainer import Trainer

    run = tmp_path / "run"
    shutil.copytree(runs / "deepspeed_zero2", run)
    before = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    trainer = Trainer(load_config(GRPO, fast_overrides(run, resume_from=str(_checkpoint(run, 1)))))
    with pytest.raises(
        FlowRLError, match=r"^checkpoint '.*step_000001' was written by a DeepSpeed run, .* resume it under the same DeepSpeed launch"
    ):
        trainer.fit()
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == before  # nothing written or removed


# the export reads the checkpoint's full tensors, which both engines write alike (test_fsdp_checkpoint_holds_full_tensors,
# test_zero3_checkpoint_holds_full_weights_...): one engine's export is the test of that path
@pytest.mark.parametrize("launch", ["deepspeed_zero3"])
@pytest.mark.slow
def test_sharded_checkpoint_exports_a_diffusers_model_equal_to_the_gathered_weights(runs, tmp_path, launch):
    from diffusers import UNet2DConditionModel

    checkpoint = _checkpoint(runs / launch, ITERATIONS)
    out = tmp_path / "exported"
    proc = subprocess.run(
        [sys.executable, "-m", "flowrl.cli", "export", str(checkpoint), str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = UNet2DConditionModel.from_pretrained(str(out / "unet")).state_dict()
    weights = load_file(checkpoint / "denoiser.safetensors")
    assert set(exported) == set(weights) and all(torch.equal(exported[k], weights[k]) for k in weights)


@pytest.mark.parametrize("launch", ["fsdp", "deepspeed_zero3"])
@pytest.mark.slow
def test_sharded_lora_run_writes_the_gathered_diffusers_lora(tmp_path, launch):
    """LoRA under FSDP or ZeRO-3: the base weights are sharded too (frozen), the checkpoint stores the adapter whole,
    and the diffusers LoRA file beside it holds the same tensors."""
    run = tmp_path / "lora"
    _launch(f"{launch}.yaml", run, **{"pipeline.lora": "{r: 4, alpha: 8}", "train.learning_rate": 1e-2, "train.iterations": 2})
    checkpoint = _checkpoint(run, 2)
    adapter = load_file(checkpoint / "denoiser.safetensors")
    lora = load_file(checkpoint / "pytorch_lora_weights.safetensors")
    assert adapter and all("lora" in k for k in adapter) and len(lora) == len(adapter)
    ranks = {v.shape[0] for k, v in adapter.items() if "lora_A" in k}
    assert ranks == {4}  # whole tensors: a shard of a rank-4 A would have 2 rows
    by_norm = sorted(v.norm().item() for v in adapter.values())
    assert by_norm == sorted(v.norm().item() for v in lora.values())
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at zero: it was trained


def test_cpu_offload_on_cpu_processes_is_refused_in_one_sentence(monkeypatch):
    """fsdp_offload.yaml on CPU processes: torch's offload policy needs a GPU to offload from."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from flowrl.errors import FlowRLError
    from flowrl.training.distributed import enable_fsdp_on_cpu

    for key, value in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"}.items():
        monkeypatch.setenv(key, value)  # what accelerate launch sets from fsdp_offload.yaml
    state = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, fsdp_plugin=None)
    with pytest.raises(FlowRLError, match=r"^fsdp_offload_params moves the shards .* launch with configs/accelerate/fsdp\.yaml\.$"):
        enable_fsdp_on_cpu(SimpleNamespace(state=state))
    assert state.distributed_type == DistributedType.MULTI_CPU and state.fsdp_plugin is None


HEAD_WORKER = """
import json, sys
from accelerate.utils import gather_object
from flowrl.config import load_config
from flowrl.training.distributed import end_process_group
from flowrl.trainer import Trainer

trainer = Trainer(load_config(sys.argv[1], sys.argv[3:]))
head = trainer.objective.head
before = {k: v.tolist() for k, v in head.state_dict().items()}
trainer.fit()
after = gather_object([{k: v.tolist() for k, v in head.state_dict().items()}])
if trainer.is_main:
    open(sys.argv[2], "w").write(json.dumps({"before": before, "after": after}))
end_process_group()
"""


@pytest.mark.slow
def test_an_objectives_own_module_is_trained_alike_on_every_process(tmp_path):
    """DCoLT's unmasking-policy head is a role every process keeps whole (not wrapped by DDP: it runs at every step
    inside one backward pass), so the engine averages its gradients. Each process samples other completions, so
    without the averaging the two copies differ."""
    script, report = tmp_path / "worker.py", tmp_path / "heads.json"
    script.write_text(HEAD_WORKER)
    overrides = [
        f"output_dir={tmp_path / 'run'}",
        "train.iterations=2",
        "train.prompts_per_iteration=2",
        "train.num_generations=4",
        "train.batch_size=4",
        "prompts.eval_size=4",
        "eval.every=0",
        "log.checkpoint_every=0",
        "log.progress=false",
        "train.learning_rate=1e-3",
    ]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ACCELERATE / "ddp.yaml"),
        "--num_processes",
        "2",
        "--main_process_port",
        "0",
        str(script),
        str(CONFIGS / "dllm" / "dcolt.yaml"),
        str(report),
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = run_launch(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, launch_report(proc)
    heads = json.loads(report.read_text())
    rank0, rank1 = (torch.tensor(sum(map(_flat, h.values()), [])) for h in heads["after"])
    start = torch.tensor(sum(map(_flat, heads["before"].values()), []))
    assert not torch.equal(rank0, start)  # trained
    assert (rank0 - rank1).abs().max() <= 1e-6, (rank0 - rank1).abs().max()


def _flat(x) -> list:
    return [v for item in x for v in _flat(item)] if isinstance(x, list) else [x]


def test_the_text_shares_of_two_processes_are_the_one_process_batch_split_in_two(tmp_path):
    """The same for diffusion LMs (DCoLT: token and unmasking-order draws per completion, mask seeds per row)."""
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    overrides = [f"output_dir={tmp_path}", "train.prompts_per_iteration=4", "train.num_generations=4", "log.progress=false"]
    modality = Trainer(load_config(CONFIGS / "dllm" / "dcolt.yaml", overrides)).modality
    whole = _collect(modality, 0, 1)
    shares = [_collect(modality, rank, 2) for rank in (0, 1)]
    assert [p for s in shares for p in s.prompts] == whole.prompts and len(set(whole.prompts)) > 1
    assert [c for s in shares for c in s.completions] == whole.completions and len(set(whole.completions)) > 4
    assert torch.equal(torch.cat([s.mask_seeds for s in shares]), whole.mask_seeds)
    assert torch.equal(torch.cat([s.group_ids for s in shares]), whole.group_ids)
