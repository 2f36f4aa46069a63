"""Checkpoints: safetensors weights + optimizer state, JSON trainer state, written atomically.

Layout of ``<run>/checkpoints/step_000020/``: ``denoiser.safetensors`` (trainable weights),
``optimizer.safetensors`` (every optimizer tensor, keyed ``<param index>.<name>``), ``trainer_state.json``
(step, param-group hyper-parameters, per-process objective state), ``config.yaml``. A checkpoint is
written into a hidden temporary directory and renamed into place, so a crash never leaves a partial one;
``checkpoints/latest`` names the newest complete checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import FlowRLError


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary file path beside ``path``; move it into place only if the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_directory(path: Path, world_readable: bool = True) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; replace ``path`` with it only if the block succeeds.
    ``world_readable``: mkdtemp makes the folder private, shipped assets must be readable by everyone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    try:
        yield tmp
        if world_readable:
            for p in [tmp, *tmp.rglob("*")]:
                p.chmod(0o755 if p.is_dir() else 0o644)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state = optimizer.state_dict()
    tensors = {f"{idx}.{name}": v.contiguous() for idx, s in state["state"].items() for name, v in s.items() if torch.is_tensor(v)}
    return tensors, {"param_groups": state["param_groups"]}


def load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: dict[str, Any]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    optimizer.load_state_dict({"state": state, "param_groups": groups["param_groups"]})


def save_checkpoint(directory: Path, weights: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], config_yaml: str, extra: Callable[[Path], Any] | None = None) -> Path:
    """Write a checkpoint directory atomically; ``extra(tmp_dir)`` may add files (e.g. a diffusers LoRA)."""
    with atomic_directory(directory, world_readable=False) as tmp:
        if extra is not None:
            extra(tmp)
        # clone: tied weights (an LM's input/output embeddings) share storage, which safetensors refuses
        save_file({k: v.detach().cpu().clone().contiguous() for k, v in weights.items()}, str(tmp / "denoiser.safetensors"))
        opt_tensors, groups = optimizer_tensors(optimizer)
        save_file({k: v.cpu() for k, v in opt_tensors.items()}, str(tmp / "optimizer.safetensors"))
        (tmp / "trainer_state.json").write_text(json.dumps({**trainer_state, "optimizer": groups}, indent=1))
        (tmp / "config.yaml").write_text(config_yaml)
    with atomic_path(directory.parent / "latest") as pointer:
        pointer.write_text(directory.name + "\n")
    return directory


def resolve_checkpoint(spec: str, output_dir: Path) -> Path:
    """``latest`` -> the newest checkpoint of ``output_dir``; otherwise a checkpoint directory."""
    if spec == "latest":
        pointer = output_dir / "checkpoints" / "latest"
        if not pointer.is_file():
            raise FlowRLError(f"resume_from=latest but '{output_dir}' has no checkpoint yet.")
        return output_dir / "checkpoints" / pointer.read_text().strip()
    return Path(spec)


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    return _load(directory / "denoiser.safetensors")


def read_checkpoint(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """Return (weights, optimizer tensors, trainer state), or raise one clear sentence."""
    weights = read_weights(directory)
    optim = _load(directory / "optimizer.safetensors")
    try:
        state = json.loads((directory / "trainer_state.json").read_text())
    except (OSError, json.JSONDecodeError):
        raise FlowRLError(f"checkpoint '{directory}' has a missing or corrupt trainer_state.json.") from None
    return weights, optim, state


def _load(file: Path) -> dict[str, torch.Tensor]:
    if not file.parent.is_dir():
        raise FlowRLError(f"checkpoint directory '{file.parent}' does not exist.")
    if not file.is_file():
        raise FlowRLError(f"checkpoint '{file.parent}' is incomplete: '{file.name}' is missing.")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise FlowRLError(f"checkpoint file '{file}' is corrupt ({str(e).splitlines()[0]}).") from None
