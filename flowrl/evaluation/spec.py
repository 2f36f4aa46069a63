"""The evaluation spec: one complete, versioned record of what an evaluation number depends on.

Every evaluation flowrl prints (training-time, ``flowrl eval``, best-of-N, SVDD) carries one: the model and
a hash of the weights it evaluated, the sampler and its parameters, steps, guidance, resolution or generation
length, seeds, the prompt set and its hash, the reward and judge, the library versions, the whole resolved
config, and the result at full precision. ``flowrl eval --spec FILE`` reads it back (from a spec file, a run's
summary.json or eval_spec.json, or a line ``flowrl eval`` printed), re-runs exactly that evaluation and says
whether the number came back bit for bit, and which recorded fields differ when it did not (docs/reproducibility.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sys
from collections.abc import Iterable
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import torch

from ..errors import FlowRLError
from ..seeding import content_key

SPEC_FORMAT = "flowrl.eval_spec"
SPEC_VERSION = 1
# the libraries whose code computes an evaluation number; a different version may move its bits
LIBRARIES = ("flowrl", "torch", "diffusers", "transformers", "peft", "accelerate", "numpy", "safetensors")
# fields that describe the machine rather than the evaluation: a difference there is reported, never refused
ENVIRONMENT_FIELDS = ("environment",)


def weights_sha256(modules: Iterable[tuple[str, torch.nn.Module]]) -> str:
    """sha256 over every tensor of the named modules' state dicts (name, dtype, shape and raw bytes, in name
    order): the weights an evaluation actually ran, base and fine-tuned parts alike. Reads every weight once."""
    digest = hashlib.sha256()
    for prefix, module in modules:
        state = module.state_dict()
        for name in sorted(state):
            tensor = state[name]
            if not isinstance(tensor, torch.Tensor):
                continue
            if hasattr(tensor, "full_tensor"):  # a sharded (FSDP2 DTensor) parameter: its full value
                tensor = tensor.full_tensor()
            data = tensor.detach().to("cpu").contiguous()
            digest.update(f"{prefix}{name}|{data.dtype}|{tuple(data.shape)}|".encode())
            digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def prompt_set_sha256(prompts: list[str], metadata: list[dict[str, Any]]) -> str:
    """sha256 of the ordered held-out items, each named by its content key (its prompt and plain metadata)."""
    return hashlib.sha256(",".join(f"{content_key(p, m):032x}" for p, m in zip(prompts, metadata, strict=True)).encode()).hexdigest()


def environment() -> dict[str, Any]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            versions[name] = None
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or platform.machine()
    return {
        "versions": versions,
        "python": platform.python_version(),
        "platform": f"{sys.platform}-{platform.machine()}",
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def reward_description(reward) -> dict[str, Any] | None:
    """The reward's components and the classes that compute them (their code is versioned by the library
    versions in the environment); None when there is no reward (no judge configured)."""
    if reward is None:
        return None
    components = getattr(reward, "components", None)
    parts = components.items() if isinstance(components, dict) else [(getattr(reward, "name", "reward"), reward)]
    return {
        name: f"{type(part).__module__}.{type(part).__qualname__}"
        + (f" {part.version}" if isinstance(getattr(part, "version", None), str) else "")
        for name, part in parts
    }


def text_generation_settings(sc) -> dict[str, Any]:
    """The generation settings a diffusion LM's evaluation number depends on: the masked sampler's length, steps, block
    layout, temperature and remasking; another sampler's own section (DiffusionGemma's entropy_bound: None is the
    checkpoint's generation config) with its evaluation temperature."""
    if sc.name != "masked":
        return {
            **{k: v for k, v in sc.model_dump(mode="json").items() if k not in ("name", "temperature", "eval_temperature")},
            "temperature": sc.eval_temperature,
        }
    return {
        "gen_length": sc.gen_length,
        "steps": sc.steps,
        "block_length": sc.block_length,
        "temperature": sc.eval_temperature,
        "remasking": sc.remasking,
        "threshold": sc.threshold,
    }


PATH_KEYS = ("pretrained", "train_file", "eval_file", "pairs", "winners", "resume_from")  # config values naming files


def absolute_paths(value: Any, key: str = "") -> Any:
    """``value`` (a config's dump, or one value of it) with every relative path under a key of ``PATH_KEYS`` that
    names an existing file or directory made absolute: a spec must re-run from any directory. Names that are not
    paths here (a hub id, an embedded model's name, ``latest``) stay as they are."""
    if isinstance(value, dict):
        return {k: absolute_paths(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [absolute_paths(v, key) for v in value]
    if key in PATH_KEYS and isinstance(value, str) and value and not Path(value).is_absolute() and Path(value).exists():
        return str(Path(value).resolve())
    return value


def build_spec(
    config,
    *,
    method: dict[str, Any],
    checkpoint: Path | None,
    weights: str | None,
    sampler: dict[str, Any],
    prompts: list[str],
    metadata: list[dict[str, Any]],
    reward,
    judge,
    result: dict[str, float],
    sample_shape: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """The spec of one evaluation (see the module docstring). ``method``: {"name": "plain" | "best_of" | "svdd",
    and its parameters}; ``sampler``: its name and parameters; ``result``: the metrics at full precision;
    ``sample_shape``: one sample's shape (channels, [frames,] height, width), the resolution actually sampled."""
    from ..config import eval_steps_and_guidance

    text = config.pipeline.modality == "text"
    if text:
        generation = text_generation_settings(config.sampler)
    else:
        steps, guidance = eval_steps_and_guidance(config)
        pc = config.pipeline.model_dump(mode="json")
        generation = {
            "steps": steps,
            "guidance_scale": guidance,
            "resolution": {k: pc[k] for k in ("height", "width", "num_frames") if pc.get(k) is not None} or "the model's default",
            "sample_shape": list(sample_shape) if sample_shape is not None else None,
        }
    return {
        "format": SPEC_FORMAT,
        "version": SPEC_VERSION,
        "method": method,
        "model": {
            "family": config.pipeline.name,
            "pretrained": absolute_paths(config.pipeline.pretrained, "pretrained"),
            "revision": getattr(config.pipeline, "revision", None),
            "checkpoint": str(Path(checkpoint).resolve()) if checkpoint is not None else None,
            "weights_sha256": weights,
        },
        "sampler": sampler,
        "generation": generation,
        "seeds": {
            "eval_seed": config.eval.seed,
            "samples_per_prompt": 1 if text else config.eval.samples_per_prompt,
            "batch_size": config.rollout.batch_size if text else config.eval.batch_size,
            "noise": "per item, keyed by the prompt's content and the sample index",
        },
        "prompts": {
            "source": absolute_paths(config.prompts.model_dump(mode="json")),
            "count": len(prompts),
            "sha256": prompt_set_sha256(prompts, metadata),
        },
        "reward": {"config": config.reward.model_dump(mode="json"), "components": reward_description(reward)},
        "judge": (
            {"config": config.eval.judge.model_dump(mode="json"), "components": reward_description(judge)}
            if config.eval.judge is not None
            else None
        ),
        "environment": environment(),
        "config": absolute_paths(config.model_dump(mode="json")),
        # NaN as null, as every JSON flowrl writes has it: a re-run compares like with like
        "result": {k: None if v is None or math.isnan(float(v)) else float(v) for k, v in result.items()},
    }


def _json_records(text: str) -> list[Any]:
    """The JSON in ``text``: the whole of it, or else each line that parses as a JSON object (the output of flowrl
    eval: text lines and one JSON line)."""
    try:
        return [json.loads(text)]
    except json.JSONDecodeError:
        pass
    records = []
    for line in text.splitlines():
        if line.lstrip().startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def _spec_of(record: Any) -> dict[str, Any] | None:
    """The spec a record is or holds (a spec, a summary's ``eval_spec``, an eval line's ``spec``), or None."""
    if not isinstance(record, dict):
        return None
    spec = record if record.get("format") == SPEC_FORMAT else record.get("spec") or record.get("eval_spec")
    return spec if isinstance(spec, dict) and spec.get("format") == SPEC_FORMAT else None


def read_spec(path: str | Path) -> dict[str, Any]:
    """The spec in ``path``: a spec file, a run's summary.json (its ``eval_spec``), or the output of ``flowrl
    eval`` (the last JSON line holding a ``spec``)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FlowRLError(f"spec file '{path}' does not exist.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FlowRLError(f"could not read spec file '{path}': {e}.") from None
    for record in reversed(_json_records(text)):
        spec = _spec_of(record)
        if spec is not None:
            if spec.get("version") != SPEC_VERSION:
                raise FlowRLError(
                    f"'{path}' holds an evaluation spec of version {spec.get('version')}; this flowrl reads version {SPEC_VERSION}."
                )
            return spec
    raise FlowRLError(f"'{path}' holds no flowrl evaluation spec (a spec file, a run's summary.json or a `flowrl eval` output line).")


def differences(recorded: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted names of the fields that differ between two specs (the result excluded), each with both values."""
    found = []
    for key in sorted(set(recorded) | set(now)):
        if not prefix and key == "result":
            continue
        a, b = recorded.get(key), now.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            found += differences(a, b, name + ".")
        elif a != b:
            found.append(f"{name}: {json.dumps(a)} -> {json.dumps(b)}")
    return found
