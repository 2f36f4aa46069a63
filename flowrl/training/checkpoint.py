"""Checkpoints: safetensors weights + optimizer state, JSON trainer state, written atomically and durably
(flowrl/atomic_files.py), verified by checksum when read.

Layout of ``<run>/checkpoints/step_000020/``: ``denoiser.safetensors`` (trainable weights),
``optimizer.safetensors`` (every optimizer tensor, keyed ``<param index>.<name>``), ``config.yaml``,
optional extra files (a diffusers LoRA), and ``trainer_state.json`` (step, param-group hyper-parameters,
per-process objective state, ``files``: the sha256 of every other file, and ``state_sha256``: the
sha256 of the state itself). A checkpoint is written into a hidden temporary directory, every file and
directory is fsynced, and only then is it renamed into place, so neither a crash nor a power loss leaves
a partial one; ``checkpoints/latest`` names the newest complete checkpoint. Reading a checkpoint checks
the checksums of the files it reads and names the first one that does not match.

A run killed mid-write leaves temporary names (``TEMP_PREFIX``) behind; the next run in the directory, once it holds
the run lock, removes exactly those names and nothing else (``remove_leftover_temporaries``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..atomic_files import TEMP_PREFIX, atomic_directory, atomic_path, os_error_reason, writing
from ..errors import FlowRLError
from . import fault_injection
from .distributed import shard_optimizer_tensors

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# the names earlier versions of flowrl gave temporary checkpoints, pointers and DeepSpeed staging (checkpoints/ only)
_LEGACY_CHECKPOINT_TEMP = re.compile(r"^\.(step_\d+|latest)-(old-)?[a-z0-9_]{8}$|^\.step_\d+\.deepspeed$")


def remove_leftover_temporaries(run_dir: Path) -> list[Path]:
    """Remove what writes cut short by a killed process left under ``run_dir``: flowrl's temporary files and
    directories (a half-written checkpoint, pointer, metrics rewrite, sample), recognised by ``TEMP_PREFIX`` (and,
    in ``checkpoints/``, by the names earlier versions of flowrl gave them). Nothing else is touched, nothing inside
    them is looked at, symbolic links are not followed. Call it only while holding the run lock
    (flowrl/training/run_lock.py): a live run's temporaries are its writes in progress. Returns what went, relative to
    ``run_dir``."""
    run_dir = Path(run_dir)
    removed: list[Path] = []
    for parent, dirs, files in os.walk(run_dir):
        here = Path(parent)
        legacy = here == run_dir / "checkpoints"
        leftovers = {n for n in [*dirs, *files] if n.startswith(TEMP_PREFIX) or (legacy and _LEGACY_CHECKPOINT_TEMP.match(n))}
        for name in sorted(leftovers):
            path = here / name
            with writing(path):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
            removed.append(path.relative_to(run_dir))
        dirs[:] = [d for d in dirs if d not in leftovers]  # removed: nothing to walk into
    return sorted(removed)


def optimizer_tensors(optimizer: torch.optim.Optimizer | dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer's (or an already gathered state_dict's, see flowrl.training.distributed) tensors by 'index.name'."""
    state = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    tensors = {f"{idx}.{name}": v.contiguous() for idx, s in state["state"].items() for name, v in s.items() if torch.is_tensor(v)}
    return tensors, {"param_groups": state["param_groups"]}


def load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: dict[str, Any]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    state = shard_optimizer_tensors(optimizer, state)  # under FSDP: this process's shards of the full tensors stored
    optimizer.load_state_dict({"state": state, "param_groups": groups["param_groups"]})


# -- checksums ----------------------------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _state_digest(state: dict[str, Any]) -> str:
    """The checksum of the state file's content (everything but this checksum), independent of layout."""
    body = {k: v for k, v in state.items() if k != "state_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def save_checkpoint(
    directory: Path,
    weights: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | dict[str, Any],
    trainer_state: dict[str, Any],
    config_yaml: str,
    extra: Callable[[Path], Any] | None = None,
) -> Path:
    """Write a checkpoint directory atomically and durably; ``extra(tmp_dir)`` may add files (e.g. a
    diffusers LoRA). The state file, written last, records the sha256 of every other file."""
    with atomic_directory(directory, world_readable=False) as tmp:
        if extra is not None:
            extra(tmp)
        fault_injection.reached("checkpoint:denoiser.safetensors", checkpoint_step(directory))
        # clone: tied weights (an LM's input/output embeddings) share storage, which safetensors refuses
        save_file({k: v.detach().cpu().clone().contiguous() for k, v in weights.items()}, str(tmp / "denoiser.safetensors"))
        opt_tensors, groups = optimizer_tensors(optimizer)
        fault_injection.reached("checkpoint:optimizer.safetensors", checkpoint_step(directory))
        save_file({k: v.cpu() for k, v in opt_tensors.items()}, str(tmp / "optimizer.safetensors"))
        fault_injection.reached("checkpoint:config.yaml", checkpoint_step(directory))
        (tmp / "config.yaml").write_text(config_yaml)
        files = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        state = {**trainer_state, "optimizer": groups, "files": files}
        state["state_sha256"] = _state_digest(state)
        fault_injection.reached("checkpoint:trainer_state.json", checkpoint_step(directory))
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        fault_injection.reached("checkpoint:rename", checkpoint_step(directory))
    fault_injection.reached("checkpoint:latest", checkpoint_step(directory))
    with atomic_path(directory.parent / "latest") as pointer:
        pointer.write_text(directory.name + "\n")
    return directory


def _read_state(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise FlowRLError(f"checkpoint directory '{directory}' does not exist.")
    try:
        state = json.loads((directory / STATE_FILE).read_text())
        if not isinstance(state, dict):
            raise ValueError
    except (OSError, UnicodeDecodeError, ValueError):
        raise FlowRLError(f"checkpoint '{directory}' has a missing or corrupt {STATE_FILE}.") from None
    return state


def verify_checkpoint(directory: Path, names: Iterable[str] | None = None) -> dict[str, Any]:
    """Check the state file's own checksum and the sha256 of ``names`` (None: every recorded file) against
    those recorded when the checkpoint was written; return the state or raise one sentence naming the file."""
    directory = Path(directory)
    state = _read_state(directory)
    files = state.get("files")
    if files is None:  # written before checksums existed: readable, but nothing can be verified
        warnings.warn(
            f"checkpoint '{directory}' carries no checksums (written by an older flowrl); its files are not verified.", stacklevel=2
        )
        return state
    if not isinstance(files, dict) or state.get("state_sha256") != _state_digest(state):
        raise FlowRLError(f"checkpoint file '{directory / STATE_FILE}' is corrupt (its checksum does not match its content).")
    for name in files if names is None else names:
        file = directory / name
        if not file.is_file():
            raise FlowRLError(f"checkpoint '{directory}' is incomplete: '{name}' is missing.")
        if name not in files:
            continue  # not written by flowrl's checkpoint writer (e.g. added by hand): nothing to compare
        try:
            actual = sha256_file(file)
        except OSError as e:
            raise FlowRLError(f"could not read checkpoint file '{file}': {os_error_reason(e)}.") from None
        if actual != files[name]:
            raise FlowRLError(f"checkpoint file '{file}' is corrupt (its sha256 differs from the one recorded when it was written).")
    return state


def checkpoint_step(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def find_latest(output_dir: Path) -> tuple[Path, str]:
    """The newest checkpoint of ``output_dir`` that verifies, and a sentence saying which it is and why.

    The ``latest`` pointer is only a hint: a crash between writing a checkpoint and the pointer, a deleted
    pointer or a corrupt newest checkpoint must not hide an older valid one."""
    root = Path(output_dir) / "checkpoints"
    candidates = (
        sorted((p for p in root.glob("step_*") if p.is_dir() and checkpoint_step(p) is not None), key=checkpoint_step, reverse=True)
        if root.is_dir()
        else []
    )
    if not candidates:
        raise FlowRLError(f"resume_from=latest but '{output_dir}' has no checkpoint yet.")
    pointer_file = root / "latest"
    pointer = pointer_file.read_text().strip() if pointer_file.is_file() else None
    skipped: list[str] = []
    for candidate in candidates:
        try:
            verify_checkpoint(candidate)
        except FlowRLError as e:
            skipped.append(f"{candidate.name}: {str(e).rstrip('.')}")
            continue
        if skipped:
            why = f"; skipped {len(skipped)} newer one(s) that failed verification ({skipped[0]})"
        elif pointer != candidate.name:
            why = " (the 'latest' pointer is missing)" if pointer is None else f" (the 'latest' pointer names '{pointer}')"
        else:
            why = ""
        return candidate, f"resuming from '{candidate}', the newest valid checkpoint{why}."
    raise FlowRLError(f"resume_from=latest but none of the {len(candidates)} checkpoint(s) in '{root}' is valid (newest: {skipped[0]}).")


def resolve_checkpoint(spec: str, output_dir: Path) -> Path:
    """``latest`` -> the newest valid checkpoint of ``output_dir``; otherwise a checkpoint directory."""
    return find_latest(output_dir)[0] if spec == "latest" else Path(spec)


def checkpoint_directory(path: Path) -> Path:
    """``path`` as given, unless it is a run's ``checkpoints/latest`` pointer file: then the newest valid checkpoint of
    that run (what a user copies from a run directory for ``flowrl eval`` or a bench's ``--checkpoint``)."""
    path = Path(path)
    if path.name == "latest" and path.is_file() and path.parent.name == "checkpoints":
        return find_latest(path.parent.parent)[0]
    return path


def read_weights(directory: Path, verify: bool = True) -> dict[str, torch.Tensor]:
    if verify:
        verify_checkpoint(directory, ["denoiser.safetensors"])
    return _load(directory / "denoiser.safetensors")


def read_checkpoint(directory: Path, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """Return (weights, optimizer tensors, trainer state), or raise one clear sentence. ``verify``: check every
    recorded file's checksum first (False only for a directory that was just verified)."""
    directory = Path(directory)
    state = verify_checkpoint(directory) if verify else _read_state(directory)
    weights = _load(directory / "denoiser.safetensors")
    optim = _load(directory / "optimizer.safetensors")
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


def load_checkpoint_weights(pipeline, checkpoint: Path) -> None:
    """Load a run checkpoint's trained weights into ``pipeline`` (an objective's own module, saved under
    ``objective.``, and the other trained roles' tensors, under the prefixes ``trainer_state.json`` records, e.g.
    DMD2's ``fake_score.``, are left out: the policy's alone); a checkpoint of another model is one sentence."""
    others = [p for p in _read_state(Path(checkpoint)).get("roles", {}).values() if p]
    weights = {k: v for k, v in read_weights(checkpoint).items() if not k.startswith(("objective.", *others))}
    try:
        pipeline.load_trainable_state_dict(weights)
    except (RuntimeError, KeyError, ValueError) as e:
        raise FlowRLError(f"checkpoint '{checkpoint}' does not match its model ({str(e).splitlines()[0][:160]}).") from None
