"""Model cards for exported models and LoRAs, and the upload of an export to the Hugging Face Hub.

``write_model_card(directory, checkpoint, config, kind=...)`` writes a diffusers-style ``README.md`` (YAML front
matter: ``library_name``, ``tags``, ``base_model``, ``pipeline_tag``, ``license`` when one was given) and copies
the run's sample grid beside it as ``samples.png``. Everything comes from the checkpoint: its ``config.yaml``
(base model, method and its hyper-parameters, reward) and, when the checkpoint sits in its run directory
(``RUN/checkpoints/step_N``), the run's ``metrics.jsonl`` / ``summary.json`` (held-out metrics before training
and at step N) and ``samples/`` (the held-out grid of step N). The "how to load it" snippet is the real one for
the family: ``DiffusionPipeline.from_pretrained`` for a merged export, ``load_lora_weights`` for a LoRA of a
diffusers family, flowrl for the embedded models (they have no diffusers pipeline class).

``push_to_hub(folder, repo_id)`` uploads a finished export in one commit (``HfApi.create_repo`` +
``upload_folder``); a hub that cannot be reached or refuses is one FlowRLError sentence.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Literal

from .errors import FlowRLError

GRID_FILE = "samples.png"
EMBEDDED = ("digits", "digits_video", "toy2d")  # the models shipped with flowrl (no diffusers pipeline class)
VIDEO = {"digits_video": "text-to-video", "wan": "text-to-video", "cogvideox": "text-to-video", "wan_i2v": "image-to-video"}
EDIT = ("flux_kontext", "qwen_image_edit", "qwen_image_edit_plus")  # instruction + source image(s) -> image
SECOND_EXPERT_LORA = "pytorch_lora_weights_transformer_2.safetensors"  # Wan2.2's low-noise expert (flowrl/pipelines/wan.py)


def _run_dir(checkpoint: Path) -> Path | None:
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None


def _step(checkpoint: Path) -> int | None:
    from .training.checkpoint import checkpoint_step

    return checkpoint_step(checkpoint)


def _eval_records(run: Path | None) -> dict[int, dict[str, Any]]:
    """step -> the logged held-out metrics of that step (the records carrying eval/reward/mean)."""
    if run is None or not (run / "metrics.jsonl").is_file():
        return {}
    records = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash: the others still count
        if isinstance(row, dict) and row.get("eval/reward/mean") is not None:
            records[int(row["step"])] = {k: v for k, v in row.items() if k.startswith("eval/")}
    return records


def _grid(run: Path | None, step: int | None, final_step: int | None) -> tuple[Path, str] | None:
    """The held-out sample grid of these weights (samples/step_N.png), else the run's last one."""
    if run is None:
        return None
    if step is not None and (run / "samples" / f"step_{step:06d}.png").is_file():
        return run / "samples" / f"step_{step:06d}.png", f"held-out samples of this checkpoint (step {step})"
    if (run / "samples_after.png").is_file() and (final_step is None or final_step == step):
        return run / "samples_after.png", "held-out samples at the end of the run"
    grids = sorted((run / "samples").glob("step_*.png")) if (run / "samples").is_dir() else []
    if grids:
        return grids[-1], f"held-out samples of the run's latest evaluation ({grids[-1].stem.replace('_', ' ')}, not this checkpoint)"
    return None


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4f}"
    return "–" if v is None else str(v)


def _settings(section: Any, skip: tuple[str, ...] = ()) -> str:
    values = section.model_dump(exclude_none=True)
    return ", ".join(f"`{k}={v}`" for k, v in values.items() if k not in skip and not isinstance(v, dict))


def _load_snippet(config, kind: str, where: str, files: frozenset[str] = frozenset()) -> str:
    """How to load the export; ``files``: the names in the exported folder (a second expert's LoRA file adds a line)."""
    p = config.pipeline
    if p.name == "dllm":
        return (
            f"```python\nfrom flowrl.config import DLLMPipelineConfig\nfrom flowrl.pipelines import build_pipeline\n\n"
            f'pipe = build_pipeline(DLLMPipelineConfig(pretrained="{where}"), "cpu")\n```'
        )
    if p.name in EMBEDDED:
        if kind == "lora":
            loader = (
                "load_lora_into_unet(state, alphas, unet=pipe.denoiser, metadata=metadata)"
                if p.name == "digits"
                else "load_lora_into_transformer(state, transformer=pipe.denoiser, metadata=metadata)"
            )
            cls = "StableDiffusionPipeline" if p.name == "digits" else "CogVideoXPipeline"
            unpack = "state, alphas, metadata" if p.name == "digits" else "state, metadata"
            return (
                f"The embedded base model `{p.pretrained}` ships with flowrl and has no diffusers pipeline class; its "
                f"denoiser takes this LoRA through diffusers' own loader (`pip install flowrl`):\n\n"
                f"```python\nfrom diffusers import {cls}\n\nfrom flowrl.config import PipelineConfig\n"
                f"from flowrl.pipelines import build_pipeline\n\n"
                f'pipe = build_pipeline(PipelineConfig(name="{p.name}", pretrained="{p.pretrained}"), "cpu")\n'
                f'{unpack} = {cls}.lora_state_dict("{where}/pytorch_lora_weights.safetensors", return_lora_metadata=True)\n'
                f"{cls}.{loader}\n```"
            )
        return (
            f"An embedded flowrl model (no diffusers pipeline class); load it with flowrl (`pip install flowrl`):\n\n"
            f"```python\nfrom flowrl.config import PipelineConfig\nfrom flowrl.pipelines import build_pipeline\n\n"
            f'pipe = build_pipeline(PipelineConfig(name="{p.name}", pretrained="{where}"), "cpu")\n```'
            + (
                f'\n\nor sample a grid from the command line: `flowrl sample {where} --prompt "a handwritten seven"`.'
                if p.name == "digits"
                else ""
            )
        )
    output = ".frames[0]" if p.name in VIDEO else ".images[0]"
    edit = p.name in EDIT
    imports = "import torch\nfrom diffusers import DiffusionPipeline\n" + ("from diffusers.utils import load_image\n" if edit else "")
    call = 'pipe(image=load_image("source.png"), prompt="your instruction")' if edit else 'pipe("your prompt")'
    if kind == "lora":
        second = (
            f'pipe.load_lora_weights("{where}", weight_name="{SECOND_EXPERT_LORA}", load_into_transformer_2=True)\n'
            if SECOND_EXPERT_LORA in files
            else ""
        )
        return (
            f"```python\n{imports}\n"
            f'pipe = DiffusionPipeline.from_pretrained("{p.pretrained}", torch_dtype=torch.bfloat16)\n'
            f'pipe.load_lora_weights("{where}")\n{second}result = {call}{output}\n```'
        )
    return (
        f"```python\n{imports}\n"
        f'pipe = DiffusionPipeline.from_pretrained("{where}", torch_dtype=torch.bfloat16)\n'
        f"result = {call}{output}\n```"
    )


def _summary(run: Path | None) -> dict[str, Any]:
    """The run's summary.json, or {} (no run directory, no summary, or one cut by a crash)."""
    if run is None or not (run / "summary.json").is_file():
        return {}
    try:
        return json.loads((run / "summary.json").read_text())
    except ValueError:
        return {}


def _hub_base(p: Any) -> bool:
    """Whether the base model is a hub repository (a link and ``base_model`` in the card) rather than an embedded or local one."""
    return p.name not in EMBEDDED and p.modality != "text" and not Path(p.pretrained).exists() and "/" in p.pretrained


def _card_data(config, kind: str, license: str | None):
    """The card's YAML front matter."""
    from huggingface_hub import ModelCardData

    p, o = config.pipeline, config.objective
    text = p.modality == "text"  # a diffusion language model
    return ModelCardData(
        library_name="transformers" if text else "diffusers",
        base_model=p.pretrained if _hub_base(p) else None,
        license=license,
        pipeline_tag="text-generation"
        if text
        else "image-to-image"
        if p.name in EDIT
        else VIDEO.get(p.name, None if p.name == "toy2d" else "text-to-image"),
        tags=[
            "flowrl",
            "distillation" if _distillation(o) else "reinforcement-learning",
            o.name,
            *(["lora"] if kind == "lora" else []),
            p.name,
        ],
    )


def _distillation(objective: Any) -> str | None:
    """The method's name when the objective distils the base into a few-step student (DMD2), else None."""
    return getattr(type(objective), "distillation", None)


def _base_text(p: Any) -> str:
    """The base model as the card names it: a hub link, or where it comes from."""
    if _hub_base(p):
        return f"[`{p.pretrained}`](https://huggingface.co/{p.pretrained})"
    from .pipelines.dllm import EMBEDDED_LMS  # the shipped diffusion LMs, by name

    where = "embedded in flowrl" if p.name in EMBEDDED or p.pretrained in EMBEDDED_LMS else "a local model directory"
    return f"`{p.pretrained}` ({where})"


def sampling_settings(config) -> dict[str, Any]:
    """The settings the held-out evaluation samples with, as the card states them (``flowrl check`` reads them back):
    the deterministic sampler (a masked-token model's own), the evaluation's steps and guidance, and the size and shift
    the config sets (None: the checkpoint's own); a diffusion LM's generation settings at its evaluation temperature."""
    from .config import eval_steps_and_guidance

    if config.pipeline.modality == "text":
        section = config.sampler.model_dump(mode="json")
        kept = {k: v for k, v in section.items() if k not in ("name", "temperature", "eval_temperature") and v is not None}
        return {"sampler": config.sampler.name, **kept, "temperature": config.sampler.eval_temperature}
    steps, guidance = eval_steps_and_guidance(config)
    p = config.pipeline.model_dump(mode="json")
    # what a serving engine must be told besides steps and guidance: size, shift, a second expert's guidance, the
    # negative prompt, wherever the config sets them (otherwise the checkpoint's own apply)
    stated = ("height", "width", "num_frames", "flow_shift", "guidance_scale_2", "negative_prompt")
    sized = {k: p[k] for k in stated if p.get(k) is not None}
    sampler = config.sampler.name if config.sampler.name == "masked_image" else "ode"  # as evaluation builds it
    return {
        "sampler": sampler,
        "num_inference_steps": steps,
        "guidance_scale": guidance,
        "guidance_mode": config.rollout.guidance_mode,
        **sized,
    }


def _sampling_line(config) -> str:
    """The card's statement of how to sample the model as it was evaluated (the numbers below were measured so)."""
    values = sampling_settings(config)
    what = "Generation" if config.pipeline.modality == "text" else "Sampling"
    return f"- **{what}, as evaluated:** `{values.pop('sampler')}`, " + ", ".join(
        f"`{k}={v!r}`" if isinstance(v, str) and k == "negative_prompt" else f"`{k}={v}`" for k, v in values.items()
    )


def _training_section(config, kind: str, step: int | None) -> list[str]:
    """The title, what the export is, and the run's method, sampler, reward, key config and prompts."""
    p, o, r, tc = config.pipeline, config.objective, config.reward, config.train
    lora = getattr(p, "lora", None)
    kind_text = (
        "a LoRA (`pytorch_lora_weights.safetensors`)"
        if kind == "lora"
        else "the full model" + (" with the LoRA merged into the denoiser" if lora else "")
    )
    base_text = _base_text(p)
    how = f"flowrl (objective `{o.name}`" + (f", checkpoint step {step}" if step is not None else "") + ")."
    distillation = _distillation(o)
    return [
        f"# {o.name.upper()} fine-tune of {p.pretrained}",
        "",
        f"This is {kind_text}: a {config.rollout.num_inference_steps}-step student distilled from {base_text} by {distillation} with {how}"
        if distillation
        else f"This is {kind_text}, fine-tuned from {base_text} with reinforcement learning by {how}",
        "",
        "## Training",
        "",
        f"- **Base model:** {base_text}, family `{p.name}`" + (f", revision `{p.revision}`" if getattr(p, "revision", None) else ""),
        f"- **Method:** `{o.name}` — {_settings(o, skip=('name',))}",
        f"- **Sampler:** `{config.sampler.name}` — {_settings(config.sampler, skip=('name',))}; "
        f"{config.rollout.num_inference_steps} denoising steps, guidance {config.rollout.guidance_scale}",
        _sampling_line(config),
        "- **Reward:** "
        + " + ".join(f"{w:g} × `{n}`" for n, w in r.components.items())
        + (
            " (held-out judge, never trained on: " + ", ".join(f"`{n}`" for n in config.eval.judge.components) + ")"
            if config.eval.judge
            else ""
        ),
        f"- **Key config:** {tc.iterations} iterations of {tc.prompts_per_iteration} prompts × {tc.num_generations} samples, "
        f"learning rate {tc.learning_rate:g} ({tc.lr_schedule}), batch {tc.batch_size}, seed {config.seed}"
        + (f"; LoRA r={lora.r}, alpha={lora.alpha}" if lora else "; full fine-tuning of the denoiser"),
        f"- **Prompts:** `{config.prompts.dataset}` (train split `{config.prompts.train_split}`, held-out `{config.prompts.eval_split}`)",
        "",
        "## Held-out metrics",
        "",
    ]


def _evaluated_step(records: dict[int, dict[str, Any]], step: int | None) -> int | None:
    """The step whose metrics stand for this checkpoint: its own, else the nearest earlier evaluation (None: none)."""
    if step is not None and step in records:
        return step
    earlier = [s for s in records if step is None or s <= step]
    return max(earlier) if earlier else None


def _metrics_section(config, records: dict[int, dict[str, Any]], step: int | None, summary: dict[str, Any]) -> list[str]:
    """The held-out metrics before training and at this checkpoint (or the nearest earlier evaluation), and the run's summary."""
    if not records:
        return ["No run metrics were found next to this checkpoint (it is not inside its run directory)."]
    first = records[min(records)]
    mine_step = _evaluated_step(records, step)
    mine = records.get(mine_step) if mine_step is not None else None
    keys = [
        "eval/reward/mean",
        *sorted(k for k in first if k.startswith("eval/reward/") and k != "eval/reward/mean"),
        *[k for k in ("eval/judge/mean", "eval/diversity") if k in first],
    ]
    lines = [
        f"Evaluated on held-out prompts and seeds with the deterministic sampler (samples per prompt: {config.eval.samples_per_prompt}"
        "); `eval/reward/mean` is the training reward, the judge is scored on the evaluation only.",
        "",
        f"| metric | before training (step {min(records)}) | this model (step {_fmt(mine_step)}) |",
        "|---|---|---|",
    ]
    lines += [
        f"| `{k}` | {_fmt(first.get(k))} | {_fmt((mine or {}).get(k))} |"
        for k in keys
        if first.get(k) is not None or (mine or {}).get(k) is not None
    ]
    if mine_step != step:
        lines += ["", f"Step {step} was not evaluated; the right column is the nearest earlier evaluation."]
    if summary:
        lines += [
            "",
            f"Run: {summary.get('iterations_completed')} of {summary.get('iterations_planned')} iterations "
            f"({summary.get('status')}); held-out reward {_fmt(summary.get('eval_reward_initial'))} → "
            f"{_fmt(summary.get('eval_reward_final'))} at step {_fmt(summary.get('eval_reward_final_step'))}.",
        ]
    return lines


def _spec_section(summary: dict[str, Any]) -> list[str]:
    """The evaluation spec the run's final numbers were measured under (none when the summary has none)."""
    spec = summary.get("eval_spec")
    if not isinstance(spec, dict):
        return []
    shown = {k: v for k, v in spec.items() if k != "config"}  # the resolved config is long; it is in summary.json
    return [
        "",
        "### Evaluation spec",
        "",
        f"The run's final held-out numbers (step {_fmt(summary.get('eval_reward_final_step'))}) were measured as this "
        "versioned spec records: weights hash, sampler, steps, guidance, seeds, prompt set and its hash, reward, judge "
        "and library versions. The complete spec, with the resolved config, is `eval_spec` in the run's `summary.json`; "
        "`flowrl eval --spec RUN/summary.json` re-runs that evaluation and says whether it comes back bit for bit.",
        "",
        "<details><summary>eval spec</summary>",
        "",
        "```json",
        json.dumps(shown, indent=2),
        "```",
        "",
        "</details>",
    ]


def build_model_card(
    checkpoint: Path,
    config,
    kind: Literal["full", "lora"],
    where: str,
    license: str | None = None,
    grid_caption: str | None = None,
    files: frozenset[str] = frozenset(),
):
    """The ``huggingface_hub.ModelCard`` of ``checkpoint`` exported as ``kind``; ``where``: the path or repo id
    the load snippet names; ``grid_caption``: set when the sample grid was copied beside the card."""
    from huggingface_hub import ModelCard

    checkpoint = Path(checkpoint)
    run, step = _run_dir(checkpoint), _step(checkpoint)
    summary = _summary(run)
    lines = _training_section(config, kind, step) + _metrics_section(config, _eval_records(run), step, summary) + _spec_section(summary)
    lines += ["", "## Samples", ""]
    lines.append(
        f"![{grid_caption}]({GRID_FILE})\n\n*{grid_caption}*" if grid_caption else "No sample grid was found next to this checkpoint."
    )
    lines += ["", "## How to load it", "", _load_snippet(config, kind, where, files), "", "## License", ""]
    lines.append(
        f"`{license}`."
        if license
        else f"This model inherits the license of its base model, {_base_text(config.pipeline)}; read it before you use or share this model."
    )
    body = "\n".join(lines) + "\n"
    return ModelCard(f"---\n{_card_data(config, kind, license).to_yaml()}\n---\n\n{body}")


def write_model_card(
    directory: Path, checkpoint: Path, config, kind: Literal["full", "lora"], where: str | None = None, license: str | None = None
) -> Path:
    """Write ``directory/README.md`` (and ``samples.png``, the run's grid, when there is one) for ``checkpoint``
    exported as ``kind``. ``where``: what the load snippet loads from (default: the directory's name)."""
    directory, checkpoint = Path(directory), Path(checkpoint)
    run = _run_dir(checkpoint)
    records = _eval_records(run)
    grid = _grid(run, _step(checkpoint), max(records) if records else None)
    caption = None
    if grid is not None:
        shutil.copyfile(grid[0], directory / GRID_FILE)
        caption = grid[1]
    files = frozenset(f.name for f in directory.iterdir())
    card = build_model_card(checkpoint, config, kind, where or directory.name, license, caption, files)
    (directory / "README.md").write_text(str(card))
    return directory / "README.md"


def _is_network_error(error: BaseException) -> bool:
    names = {c.__name__ for c in type(error).__mro__}
    return isinstance(error, (ConnectionError, TimeoutError)) or bool(
        names & {"TransportError", "ConnectionError", "Timeout", "ConnectError"}
    )


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def push_to_hub(folder: Path, repo_id: str, private: bool = False) -> str:
    """Create ``repo_id`` (if needed) and upload ``folder`` in one commit; return the repo's URL. A token comes from
    HF_TOKEN or ``hf auth login``. Every failure is one sentence (the caller says what stays on disk)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalTokenNotFoundError

    endpoint = hub_endpoint()
    api = HfApi(endpoint=endpoint)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", commit_message="Upload model exported by flowrl")
    except LocalTokenNotFoundError:
        raise FlowRLError("no Hugging Face token: set HF_TOKEN or run `hf auth login`") from None
    except HFValidationError as e:
        raise FlowRLError(f"'{repo_id}' is not a valid hub repository id ({str(e).splitlines()[0].rstrip('.')})") from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        why = {401: "not authorised: check HF_TOKEN or `hf auth login`", 403: "forbidden: the token cannot write there"}.get(
            status, f"HTTP {status}"
        )
        raise FlowRLError(f"the hub at {endpoint} refused the upload to '{repo_id}' ({why})") from None
    except Exception as e:  # noqa: BLE001 - the transport's own exception classes are not public API
        if _is_network_error(e):
            reason = str(e).splitlines()[0].rstrip(".") if str(e) else type(e).__name__
            raise FlowRLError(f"hub unreachable at {endpoint} ({reason})") from None
        raise
    return str(url)
