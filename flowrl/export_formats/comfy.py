"""A run checkpoint's LoRA as one ``.safetensors`` file in the model's original / kohya layout, the one ComfyUI and
the kohya-style trainers load (``flowrl export CHECKPOINT OUT --format comfy``).

Read from the checkpoint alone (its diffusers LoRA file and config.yaml; the base model is not loaded): each
diffusers module's LoRA (``lora_A`` / ``lora_B``, scale ``alpha / r``) becomes the original module's ``lora_down`` /
``lora_up`` with an ``alpha`` tensor, kohya's scale being ``alpha / rank``. Where the original model stacks several
diffusers modules in one weight (FLUX.1's q/k/v), their LoRAs become one: ``lora_down`` is the parts' ``lora_A``
stacked (rank = the sum of the parts' ranks, e.g. 3r for q/k/v), ``lora_up`` is block-diagonal (each part's
``lora_B`` in its own rows and columns, zeros elsewhere, zero rows for a part without a LoRA), and ``alpha`` is
scaled with the rank, so ``alpha / rank * up @ down`` is exactly the parts' updates stacked.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..atomic_files import atomic_path
from ..errors import FlowRLError
from .layouts import LAYOUTS, LEFT_OUT, UNET, Layout

COMFY_FAMILIES: tuple[str, ...] = tuple(LAYOUTS)
LORA_FILE = "pytorch_lora_weights.safetensors"  # the diffusers LoRA file of every LoRA checkpoint
EXPERT_FILE = "pytorch_lora_weights_transformer_2.safetensors"  # Wan2.2's low-noise expert (flowrl.pipelines.wan.LORA_FILES)
COMFY_FILE = "lora.safetensors"  # what write_comfy_lora writes into a directory (Wan2.2: lora_high_noise / lora_low_noise)


def comfy_layout(family: str) -> Layout:
    """The family's original layout; one sentence naming the supported families for any other."""
    if family in LAYOUTS:
        return LAYOUTS[family]
    why = f" ({LEFT_OUT[family]})" if family in LEFT_OUT else ""
    raise FlowRLError(f"--format comfy supports the families {', '.join(COMFY_FAMILIES)}; '{family}' is not one of them{why}.")


def write_comfy_lora(checkpoint: str | Path, out: str | Path, family: str | None = None) -> Path:
    """Write the LoRA of the run checkpoint ``checkpoint`` in its family's original / kohya layout and return the file.

    ``out``: a ``.safetensors`` file, or a directory that receives ``lora.safetensors``. A Wan2.2 checkpoint with its
    low-noise expert's LoRA gets one file per expert (``<stem>_high_noise`` / ``<stem>_low_noise``, loaded by the
    high- and low-noise model of a ComfyUI workflow); the first written is returned. ``family``: the checkpoint's
    ``pipeline.name`` (None: read from its config.yaml). Anything that cannot be written is one sentence."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ..config import load_config
    from ..training.checkpoint import verify_checkpoint

    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.yaml").is_file():
        raise FlowRLError(f"'{checkpoint}' is not a run checkpoint directory (it has no config.yaml).")
    verify_checkpoint(checkpoint, ["config.yaml"])
    config = load_config(checkpoint / "config.yaml")
    name = config.pipeline.name
    if family is not None and family != name:
        raise FlowRLError(f"checkpoint '{checkpoint}' is a '{name}' run, not '{family}'.")
    layout = comfy_layout(name)
    lora = getattr(config.pipeline, "lora", None)
    if lora is None:
        raise FlowRLError(f"a ComfyUI LoRA needs a LoRA run; checkpoint '{checkpoint}' fine-tuned the whole denoiser (export it merged).")
    sources = [f for f in (LORA_FILE, EXPERT_FILE) if (checkpoint / f).is_file()]
    if not sources:
        raise FlowRLError(f"checkpoint '{checkpoint}' is incomplete: its LoRA file '{LORA_FILE}' is missing.")
    verify_checkpoint(checkpoint, sources)
    experts = EXPERT_FILE in sources or getattr(config.pipeline, "train_experts", None) is not None
    out = Path(out)
    directory, stem = (out.parent, out.stem) if out.suffix == ".safetensors" else (out, COMFY_FILE.removesuffix(".safetensors"))
    written = []
    for source in sources:
        with safe_open(str(checkpoint / source), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            header = f.metadata() or {}
        modules, scale = lora_modules(tensors, header, (lora.r, lora.alpha), checkpoint / source)
        state = comfy_state_dict(modules, scale, layout, name)
        expert = ("high_noise" if source == LORA_FILE else "low_noise") if experts else None
        metadata = {
            "format": "pt",
            "flowrl_format": "comfy",
            "flowrl_layout": layout.name,
            "flowrl_family": name,
            "base_model": str(config.pipeline.pretrained),
            "flowrl_version": _version(),
            "flowrl_lora": json.dumps({"r": lora.r, "alpha": lora.alpha}),
        }
        if getattr(config.pipeline, "revision", None):
            metadata["base_model_revision"] = str(config.pipeline.revision)
        if expert is not None:
            metadata["flowrl_expert"] = expert
        path = directory / (f"{stem}_{expert}.safetensors" if expert else f"{stem}.safetensors")
        with atomic_path(path) as tmp:
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata=metadata)
        written.append(path)
    return written[0]


def lora_modules(
    tensors: dict[str, torch.Tensor], header: dict[str, str], fallback: tuple[int, int], source: Path
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """A diffusers LoRA file's tensors as {denoiser module: (lora_A, lora_B)} and the scale of its update: the
    adapter's ``lora_alpha / r`` as diffusers loads it (the file's adapter metadata; ``fallback`` (r, alpha), the
    run's pipeline.lora, for a file without one)."""
    ends = {".lora_A.weight": 0, ".lora.down.weight": 0, ".lora_B.weight": 1, ".lora.up.weight": 1}
    pairs: dict[str, list] = {}
    prefixes = set()
    for key, value in tensors.items():
        end = next((e for e in ends if key.endswith(e)), None)
        if end is None:
            raise FlowRLError(f"'{source}' holds '{key}', which is not a LoRA down / up weight; only plain LoRAs are exported.")
        prefix, _, module = key[: -len(end)].partition(".")
        prefixes.add(prefix)
        pairs.setdefault(module, [None, None])[ends[end]] = value
    if len(prefixes) > 1:
        raise FlowRLError(
            f"'{source}' holds LoRAs of several components ({', '.join(sorted(prefixes))}); flowrl trains the denoiser's alone."
        )
    half = next((m for m, (a, b) in pairs.items() if a is None or b is None), None)
    if half is not None:
        raise FlowRLError(f"'{source}' is corrupt: module '{half}' has only one of its two LoRA matrices.")
    r, alpha, rslora = fallback[0], fallback[1], False
    if "lora_adapter_metadata" in header:
        prefix = next(iter(prefixes), "")
        adapter = json.loads(header["lora_adapter_metadata"])
        if adapter.get(f"{prefix}.rank_pattern") or adapter.get(f"{prefix}.alpha_pattern"):
            raise FlowRLError(f"'{source}' gives some modules their own rank or alpha; only a uniform LoRA is exported.")
        r, alpha = adapter.get(f"{prefix}.r", r), adapter.get(f"{prefix}.lora_alpha", alpha)
        rslora = bool(adapter.get(f"{prefix}.use_rslora", False))
    odd = next((m for m, (a, _) in pairs.items() if a.shape[0] != r), None)
    if odd is not None:
        raise FlowRLError(f"'{source}': module '{odd}' has rank {pairs[odd][0].shape[0]}, not the adapter's {r}.")
    return {m: (a, b) for m, (a, b) in pairs.items()}, alpha / (math.sqrt(r) if rslora else r)


def comfy_state_dict(
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float, layout: Layout, family: str
) -> dict[str, torch.Tensor]:
    """{original-layout key: tensor}: ``<key>.lora_down.weight``, ``<key>.lora_up.weight`` and ``<key>.alpha`` (a
    0-dim float32 tensor, ``scale`` times the module's rank) of every original module the LoRA reaches."""
    if layout is UNET:
        from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya

        peft = {f"unet.{m}.lora_{ab}.weight": t for m, (a, b) in modules.items() for ab, t in (("A", a), ("B", b))}
        state = convert_state_dict_to_kohya(peft)
        # convert_state_dict_to_kohya writes alpha = rank (scale 1); flowrl's scale is alpha / r
        return {k: torch.tensor(scale * float(v), dtype=torch.float32) if k.endswith(".alpha") else v for k, v in state.items()}
    groups: dict[str, tuple] = {}
    unplaced = []
    for module, ab in modules.items():
        found = layout.locate(module)
        if found is None:
            unplaced.append(module)
            continue
        rule, original, part = found
        groups.setdefault(original, (rule, {}))[1][part] = ab
    if unplaced:
        raise FlowRLError(
            f"the {family} LoRA reaches {len(unplaced)} module(s) the original layout that diffusers reads back has no place "
            f"for (e.g. '{sorted(unplaced)[0]}'); --format comfy exports LoRAs of the blocks' attention and MLP layers."
        )
    state = {}
    for original, (rule, parts) in sorted(groups.items()):
        down, up = parts[None] if not rule.parts else _stack(rule.parts, rule.row_ratios(), parts, original)
        key = layout.key(original)
        state[f"{key}.lora_down.weight"] = down
        state[f"{key}.lora_up.weight"] = up
        state[f"{key}.alpha"] = torch.tensor(scale * down.shape[0], dtype=torch.float32)
    return state


def _stack(names: tuple[str, ...], ratios: tuple[int, ...], parts: dict, original: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One LoRA for an original module whose output rows stack ``names`` (rows in ``ratios``): down = the present
    parts' ``lora_A`` stacked, up = their ``lora_B`` block-diagonal in the rows of their part."""
    present = [i for i, n in enumerate(names) if n in parts]
    units = {parts[names[i]][1].shape[0] / ratios[i] for i in present}
    if len(units) != 1 or not next(iter(units)).is_integer():
        raise FlowRLError(f"the LoRAs stacked into '{original}' ({', '.join(names[i] for i in present)}) have unexpected output sizes.")
    rows = [int(next(iter(units))) * r for r in ratios]
    down = torch.cat([parts[names[i]][0] for i in present])
    first = parts[names[present[0]]][1]
    up = first.new_zeros(sum(rows), down.shape[0])
    row, col = 0, 0
    for i, n in enumerate(names):
        if n in parts:
            b = parts[n][1]
            up[row : row + rows[i], col : col + b.shape[1]] = b
            col += b.shape[1]
        row += rows[i]
    return down, up


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flowrl")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree that is not installed
        return "unknown"
