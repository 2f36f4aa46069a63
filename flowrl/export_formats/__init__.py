"""A run checkpoint's LoRA in the layouts other tools load: ``flowrl export CHECKPOINT OUT --format FORMAT``.

``diffusers``: ``pytorch_lora_weights.safetensors`` for ``DiffusionPipeline.from_pretrained(base).load_lora_weights``
(what ``--lora-only`` writes). ``comfy``: one ``.safetensors`` file in the model's original / kohya layout, for
ComfyUI and kohya-style tools (:mod:`.comfy`; the families of :data:`COMFY_FAMILIES`). docs/lora_export.md.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import FlowRLError
from .comfy import COMFY_FAMILIES, comfy_layout, write_comfy_lora

FORMATS: tuple[str, ...] = ("diffusers", "comfy")

__all__ = ["COMFY_FAMILIES", "FORMATS", "comfy_layout", "export_lora", "write_comfy_lora"]


def export_lora(checkpoint: str | Path, out: str | Path, fmt: str) -> Path:
    """Write the LoRA of the run checkpoint ``checkpoint`` in format ``fmt`` (:data:`FORMATS`) into the directory
    ``out`` (created if missing) and return the file written (Wan2.2's two experts: the high-noise one's).

    ``diffusers`` builds the run's pipeline on its base model, loads the checkpoint and writes ``save_lora``'s
    file, as ``flowrl export --lora-only`` does; ``comfy`` reads the checkpoint alone (no base model)."""
    checkpoint, out = Path(checkpoint), Path(out)
    if fmt == "comfy":
        return write_comfy_lora(checkpoint, out)
    if fmt != "diffusers":
        raise FlowRLError(f"unknown LoRA format '{fmt}'; the formats are: {', '.join(FORMATS)}.")
    from ..config import load_config
    from ..pipelines import build_pipeline
    from ..training.checkpoint import load_checkpoint_weights, verify_checkpoint

    if not (checkpoint / "config.yaml").is_file():
        raise FlowRLError(f"'{checkpoint}' is not a run checkpoint directory (it has no config.yaml).")
    verify_checkpoint(checkpoint, ["config.yaml"])
    config = load_config(checkpoint / "config.yaml")
    pipeline = build_pipeline(config.pipeline, "cpu")
    if not pipeline.has_lora:
        raise FlowRLError("a LoRA export needs a LoRA run (this checkpoint fine-tuned the whole denoiser).")
    load_checkpoint_weights(pipeline, checkpoint)
    written = pipeline.save_lora(out)  # a diffusion LM's adapter directory returns nothing: it is out itself
    return out if written is None else Path(written)
