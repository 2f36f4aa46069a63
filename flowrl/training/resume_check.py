"""What a resumed run may change: the config of a resume is compared with the checkpoint's own.

A checkpoint's weights mean something only under the config that trained them: its model family and weights, its
sampler, objective, reward and prompts. Resuming under another one (a flow model's weights into a DDPM pipeline, a
GRPO run continued as DDPO) is refused in one sentence naming the keys and both values. What does not change what
the weights mean stays free: more iterations, a new learning rate or schedule, evaluation and logging, where the
model runs. ``resume_allow`` lists keys (or key prefixes, ``objective``) that may differ anyway, ``["*"]`` all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..errors import FlowRLError

MAY_CHANGE = (
    "output_dir", "resume_from", "overwrite", "resume_allow",
    "train.iterations", "train.stop_after", "train.learning_rate", "train.lr_schedule", "train.lr_min_fraction",
    "train.max_grad_norm", "train.max_nonfinite_fraction", "train.nonfinite_window", "train.num_threads",
    "train.flat_reward_warn", "train.flat_reward_stop",
    "eval", "log", "pipeline.device", "pipeline.offload_frozen", "pipeline.gradient_checkpointing", "pipeline.attention",
    "rollout.batch_size",
)  # fmt: skip


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and scalars are leaves."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _covered(key: str, prefixes: tuple[str, ...] | list[str]) -> bool:
    return any(p == "*" or key == p or key.startswith(p + ".") for p in prefixes)


def changed_keys(before: dict[str, Any], after: dict[str, Any], allowed: list[str]) -> list[tuple[str, Any, Any]]:
    """(key, the checkpoint's value, the new value) for every key that differs and may not."""
    old, new = flatten(before), flatten(after)
    first = ("pipeline.name", "pipeline.pretrained", "objective.name", "sampler.name")  # what a reader recognises at once
    keys = sorted(set(old) | set(new), key=lambda k: (first.index(k) if k in first else len(first), k))
    return [(k, old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k) and not _covered(k, MAY_CHANGE + tuple(allowed))]


def check_resume_config(config: Any, checkpoint: Path, spec: str) -> None:
    """Refuse, in one sentence, resuming ``checkpoint`` under a ``config`` that changes what its weights mean."""
    from ..config import validate

    path = Path(checkpoint) / "config.yaml"
    if not path.is_file():
        return  # a checkpoint from before checkpoints carried their config
    tree = yaml.safe_load(path.read_text()) or {}
    try:  # the checkpoint's config as this version of flowrl reads it (fields added since take their defaults)
        before = validate(tree).model_dump(mode="json")
    except FlowRLError:
        before = tree  # e.g. a plug-in no longer importable: compare the file as written
    changes = changed_keys(before, config.model_dump(mode="json"), list(config.resume_allow))
    if not changes:
        return
    key, old, new = changes[0]
    keys = [k for k, _, _ in changes]
    more = f" (and {len(keys) - 1} more: {', '.join(keys[1:])})" if len(keys) > 1 else ""
    sections = sorted({k.split(".")[0] for k in keys})
    whole = f" (or whole sections: resume_allow=[{','.join(sections)}])" if len(sections) < len(keys) else ""
    raise FlowRLError(
        f"resume_from={spec} continues a run trained with {key}={old!r}, but this config has {key}={new!r}{more}; resume with "
        f"the run's own config ({path}), or, to continue anyway with the new values, add resume_allow=[{','.join(keys)}]{whole}."
    )
