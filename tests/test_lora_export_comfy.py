"""``flowrl export CHECKPOINT OUT --format comfy``: a run checkpoint's LoRA in the model's original / kohya layout
(flowrl/export_formats/), loaded back through diffusers' own readers of that layout.

Each family's round trip: a flowrl LoRA pipeline on the family's tiny checkpoint, its adapters set to random non-zero
values (a freshly initialized LoRA changes nothing), saved as a run checkpoint by flowrl's checkpoint writer; the
export loaded into the base model with the family's diffusers pipeline ``load_lora_weights(file)`` (which detects
the layout and runs diffusers' converter) gives flowrl's own samples, as does the checkpoint's diffusers-layout file,
and both differ from the base model's. ``test_a_trained_checkpoint_exports`` does the same for a real training run.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from flowrl.errors import FlowRLError
from flowrl.export_formats import COMFY_FAMILIES, FORMATS, comfy_layout, export_lora, write_comfy_lora
from flowrl.export_formats.comfy import _stack, comfy_state_dict
from flowrl.export_formats.layouts import FLUX1
from flowrl.pipelines.tiny import tiny_checkpoint
from flowrl.pipelines.tiny.runs import RUNS, runs_for, tiny_overrides

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["a fox", "a car"]
LORA = "pipeline.lora={r: 4, alpha: 8}"  # scale alpha / r = 2


# -- the layout itself, on plain tensors --------------------------------------------------------------------------
def test_stacked_parts_are_exactly_the_parts_updates():
    """q, k, v (and FLUX.1's MLP input without a LoRA) stacked into one LoRA: up @ down is each part's B @ A in its
    own rows, zero rows for the part without one; the rank is the sum of the parts' (3r)."""
    g = torch.Generator().manual_seed(0)
    parts = {n: (torch.randn(4, 8, generator=g), torch.randn(8, 4, generator=g)) for n in ("attn.to_q", "attn.to_k", "attn.to_v")}
    down, up = _stack(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), (1, 1, 1, 4), parts, "single_blocks.0.linear1")
    assert down.shape == (12, 8) and up.shape == (8 * 3 + 32, 12)
    expected = torch.cat([b @ a for a, b in parts.values()] + [torch.zeros(32, 8)])
    assert torch.equal(up @ down, expected)


def test_flux_keys_and_alpha():
    """FLUX.1's keys are kohya sd-scripts' (lora_unet_double_blocks_N_img_attn_qkv, ...); alpha keeps alpha / rank
    at the run's scale for the stacked rank too."""
    g = torch.Generator().manual_seed(0)
    lora = lambda out=8: (torch.randn(4, 8, generator=g), torch.randn(out, 4, generator=g))  # noqa: E731
    modules = {f"transformer_blocks.0.attn.{p}": lora() for p in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out")}
    modules |= {f"single_transformer_blocks.1.attn.{p}": lora() for p in ("to_q", "to_k", "to_v")}
    modules["single_transformer_blocks.1.proj_out"] = lora()
    state = comfy_state_dict(modules, 2.0, FLUX1, "flux")
    names = sorted({k.split(".")[0] for k in state})
    assert names == [
        "lora_unet_double_blocks_0_img_attn_proj",
        "lora_unet_double_blocks_0_img_attn_qkv",
        "lora_unet_double_blocks_0_txt_attn_proj",
        "lora_unet_double_blocks_0_txt_attn_qkv",
        "lora_unet_single_blocks_1_linear1",
        "lora_unet_single_blocks_1_linear2",
    ]
    assert state["lora_unet_double_blocks_0_img_attn_qkv.alpha"].item() == 24.0  # 2 x rank 12
    assert state["lora_unet_double_blocks_0_txt_attn_qkv.lora_down.weight"].shape == (4, 8)  # only add_q_proj: rank 4
    assert state["lora_unet_double_blocks_0_img_attn_proj.alpha"].item() == 8.0
    with pytest.raises(FlowRLError, match=r"has no place for \(e\.g\. 'x_embedder'\)"):
        comfy_state_dict({"x_embedder": lora()}, 2.0, FLUX1, "flux")


def test_an_unsupported_family_is_one_sentence():
    with pytest.raises(FlowRLError) as e:
        comfy_layout("sd3")
    message = str(e.value)
    assert message.startswith("--format comfy supports the families stable_diffusion, sdxl, flux, flux_kontext, flux2, ")
    assert "'sd3' is not one of them (diffusers reads an SD3 LoRA only in its own layout" in message
    assert message.count(". ") == 0 and message.endswith(".") and "\n" not in message
    assert "not one of them." in str(pytest.raises(FlowRLError, comfy_layout, "mochi").value)
    assert FORMATS == ("diffusers", "comfy") and "sd3" not in COMFY_FAMILIES


def test_a_checkpoint_that_cannot_be_exported_is_one_sentence(tmp_path):
    """A full fine-tune, a family without a layout, a family argument that is not the checkpoint's: one sentence each,
    nothing written."""
    from flowrl.config import load_config, to_yaml
    from flowrl.training.checkpoint import save_checkpoint

    def checkpoint(name: str, preset: str, *overrides: str) -> Path:
        config = load_config(preset, list(overrides))
        return save_checkpoint(tmp_path / name / "step_000001", {}, {"state": {}, "param_groups": []}, {}, to_yaml(config))

    full = checkpoint("full", "stable_diffusion/ddpo_aesthetic", "pipeline.lora=null")
    with pytest.raises(FlowRLError, match=r"^a ComfyUI LoRA needs a LoRA run; checkpoint '.*' fine-tuned the whole denoiser"):
        write_comfy_lora(full, tmp_path / "out")
    sd3 = checkpoint("sd3", "sd3/flow_grpo_pickscore")
    with pytest.raises(FlowRLError, match="'sd3' is not one of them"):
        export_lora(sd3, tmp_path / "out", "comfy")
    with pytest.raises(FlowRLError, match=r"is a 'sd3' run, not 'flux'\.$"):
        write_comfy_lora(sd3, tmp_path / "out", family="flux")
    with pytest.raises(FlowRLError, match="is not a run checkpoint directory"):
        write_comfy_lora(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- round trips through diffusers ---------------------------------------------------------------------------------
def lora_checkpoint(family: str, variant: str | None, tmp_path: Path, extra: tuple[str, ...] = ()):
    """(flowrl LoRA pipeline with random adapters, its run checkpoint, the tiny base checkpoint, the config)."""
    from flowrl.config import load_config, to_yaml
    from flowrl.pipelines import build_pipeline
    from flowrl.pipelines.tiny import variant_of
    from flowrl.training.checkpoint import save_checkpoint

    variant, _ = variant_of(family, variant)
    base = tiny_checkpoint(family, tmp_path / "base", variant)
    run = runs_for(family, variant)[0]
    config = load_config(RUNS[run].preset, [*tiny_overrides(run, base, tmp_path / "run"), LORA, *extra])
    pipeline = build_pipeline(config.pipeline, "cpu")
    g = torch.Generator().manual_seed(1)
    for name, p in pipeline.denoiser.named_parameters():
        if "lora_" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.2
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    save_checkpoint(checkpoint, pipeline.trainable_state_dict(), {"state": {}, "param_groups": []}, {}, to_yaml(config), pipeline.save_lora)
    return pipeline, checkpoint, base, config


def samples(pipeline, base: Path | None = None):
    """Deterministic samples of PROMPTS; an image-conditioned family's with the tiny checkpoint's source images."""
    from flowrl.pipelines.tiny.components import PROMPT_FOLDER
    from tests.tiny_components import ode_sample

    metadata = None
    if base is not None and (base / PROMPT_FOLDER).is_dir():
        metadata = [{"image": str(base / PROMPT_FOLDER / f"source{i}.png")} for i in range(len(PROMPTS))]
    return ode_sample(pipeline, PROMPTS, seed=3, steps=2, metadata=metadata)


def diffusers_denoiser(pipeline, base: Path, lora: Path):
    """The denoiser of the base checkpoint loaded by the family's diffusers pipeline, with ``load_lora_weights(lora)``."""
    import diffusers

    # the Qwen-Image edit pipelines' processor needs torchvision to load, and no LoRA goes near it
    skip = {"processor": None} if "processor" in json.loads((base / "model_index.json").read_text()) else {}
    pipe = getattr(diffusers, pipeline.lora_pipeline_class).from_pretrained(base, **skip)
    pipe.load_lora_weights(lora)
    return getattr(pipe, pipeline.denoiser_subfolder)


def lora_modules(model) -> set[str]:
    return {n.removesuffix(".lora_A") for n, m in model.named_modules() if n.endswith(".lora_A")}


def unused_rules(pipeline) -> list[str]:
    """The original modules of the family's layout that none of the pipeline's LoRA modules maps to."""
    layout = comfy_layout(pipeline.config.name)
    used = {layout.locate(m)[0] for m in lora_modules(pipeline.denoiser)}
    return [r.original for r in layout.rules if r not in used]


def assert_round_trip(pipeline, checkpoint: Path, base: Path, config, out: Path, key_start: str, own_file: bool = True) -> dict[str, float]:
    """The export's keys are the original layout's; diffusers' loader given the export (and, with ``own_file``, given
    the checkpoint's diffusers-layout file) reproduces flowrl's samples; the LoRA changes them. Returns the max abs
    differences."""
    from flowrl.pipelines import build_pipeline

    file = write_comfy_lora(checkpoint, out)
    assert file == out / "lora.safetensors"
    with safe_open(str(file), "pt") as f:
        keys, metadata = list(f.keys()), f.metadata()
        alphas = {k: f.get_tensor(k) for k in keys if k.endswith(".alpha")}
    assert keys and all(k.startswith(key_start) for k in keys), sorted(keys)[:4]
    assert all(k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")) for k in keys)
    assert len(alphas) * 3 == len(keys) and all(a.dim() == 0 and a.dtype == torch.float32 for a in alphas.values())
    assert metadata["format"] == "pt" and metadata["flowrl_family"] == config.pipeline.name
    assert (
        metadata["base_model"] == str(base) and metadata["flowrl_version"] and json.loads(metadata["flowrl_lora"]) == {"r": 4, "alpha": 8}
    )
    assert "lora_adapter_metadata" not in metadata  # diffusers would build its LoraConfig from it

    ours = samples(pipeline, base)
    plain = build_pipeline(config.pipeline.model_copy(update={"lora": None}), "cpu")
    plain.guidance_mode = pipeline.guidance_mode
    base_samples = samples(plain, base)
    plain.denoiser = diffusers_denoiser(pipeline, base, file)
    assert lora_modules(pipeline.denoiser) <= lora_modules(plain.denoiser), "diffusers did not load every LoRA"
    comfy = samples(plain, base)
    differences = {"comfy": (comfy - ours).abs().max().item(), "lora effect": (base_samples - ours).abs().max().item()}
    if own_file:
        plain.denoiser = diffusers_denoiser(pipeline, base, checkpoint)  # flowrl's own diffusers-layout file
        differences["diffusers"] = (samples(plain, base) - ours).abs().max().item()
    print(config.pipeline.name, differences)
    assert differences["comfy"] < 1e-5 and differences.get("diffusers", 0.0) < 1e-5, differences
    assert differences["lora effect"] > 1e-3, "the LoRA did not change the samples, so the round trip proves nothing"
    return differences


def targets(*modules: str) -> str:
    return "pipeline.lora={r: 4, alpha: 8, target_modules: [" + ", ".join(modules) + "]}"


# every module kind the layouts place, on the tiny models (one double / one single block where there are two kinds)
WIDE = {
    "stable_diffusion": targets(
        "to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2", "conv1", "conv2", "time_emb_proj"
    ),
    "flux": targets(
        *(
            f"transformer_blocks.0.{m}"
            for m in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj")
        ),
        *(
            f"transformer_blocks.0.{m}"
            for m in ("attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj")
        ),
        *(f"transformer_blocks.0.{m}" for m in ("ff_context.net.2", "norm1.linear", "norm1_context.linear")),
        *(f"single_transformer_blocks.0.{m}" for m in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out", "norm.linear")),
    ),
    "flux2": targets(
        *(
            f"transformer_blocks.0.{m}"
            for m in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj")
        ),
        *(
            f"transformer_blocks.0.{m}"
            for m in ("attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in")
        ),
        "transformer_blocks.0.ff_context.linear_out",
        *(f"single_transformer_blocks.0.attn.{m}" for m in ("to_qkv_mlp_proj", "to_out")),
        *(
            "x_embedder",
            "context_embedder",
            "time_guidance_embed.timestep_embedder.linear_1",
            "time_guidance_embed.timestep_embedder.linear_2",
        ),
        "proj_out",
    ),
    "qwen_image": targets(
        *(
            f"transformer_blocks.0.{m}"
            for m in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj")
        ),
        *(
            f"transformer_blocks.0.{m}"
            for m in ("attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj")
        ),
        *(f"transformer_blocks.0.{m}" for m in ("txt_mlp.net.2", "img_mod.1", "txt_mod.1")),
        *(
            "img_in",
            "txt_in",
            "proj_out",
            "norm_out.linear",
            "time_text_embed.timestep_embedder.linear_1",
            "time_text_embed.timestep_embedder.linear_2",
        ),
    ),
    "wan": targets("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"),
}


@pytest.mark.parametrize("family", ["stable_diffusion", "sdxl", "stable_diffusion-wide"])
def test_unet_families_round_trip(family, tmp_path):
    family, wide = family.removesuffix("-wide"), family.endswith("-wide")
    pipeline, checkpoint, base, config = lora_checkpoint(family, None, tmp_path, (WIDE[family],) if wide else ())
    # with proj_in / proj_out / ff.net.* among the targets, diffusers loads the checkpoint's own diffusers-layout file
    # (SD's convert_state_dict_to_diffusers keys) without its attention LoRAs (16 of 48 modules): not compared there
    assert_round_trip(pipeline, checkpoint, base, config, tmp_path / "comfy", "lora_unet_", own_file=not wide)


def kohya_flux_reader_for(dim: int, monkeypatch) -> None:
    """diffusers' kohya FLUX.1 reader spells FLUX.1-dev's sizes for the single blocks' fused linear1
    (``dims=[3072, 3072, 3072, 12288]``, asserted); for the tiny model the same reader with its sizes instead."""
    import diffusers.loaders.lora_conversion_utils as conversion
    import diffusers.loaders.lora_pipeline as loaders

    source = inspect.getsource(conversion._convert_kohya_flux_lora_to_diffusers)
    sizes = "dims=[3072, 3072, 3072, 12288]"
    assert source.count(sizes) == 1, "diffusers' kohya FLUX.1 reader changed: look again"
    namespace = dict(vars(conversion))
    exec(compile(source.replace(sizes, f"dims=[{dim}, {dim}, {dim}, {4 * dim}]"), conversion.__file__, "exec"), namespace)
    monkeypatch.setattr(loaders, "_convert_kohya_flux_lora_to_diffusers", namespace["_convert_kohya_flux_lora_to_diffusers"])


@pytest.mark.parametrize("family", ["flux", "flux_kontext", "flux-wide"])
def test_flux_round_trip(family, tmp_path, monkeypatch):
    """FLUX.1's default targets reach q/k/v of both block kinds: stacked into img_attn.qkv / txt_attn.qkv and
    single_blocks.N.linear1 (rank 12 for r = 4; with proj_mlp too, 16)."""
    family, wide = family.removesuffix("-wide"), family.endswith("-wide")
    pipeline, checkpoint, base, config = lora_checkpoint(family, None, tmp_path, (WIDE[family],) if wide else ())
    assert not wide or unused_rules(pipeline) == []  # every module kind FLUX.1's layout places
    model = pipeline.denoiser
    kohya_flux_reader_for(model.config.num_attention_heads * model.config.attention_head_dim, monkeypatch)
    assert_round_trip(pipeline, checkpoint, base, config, tmp_path / "comfy", "lora_unet_")
    with safe_open(str(tmp_path / "comfy" / "lora.safetensors"), "pt") as f:
        assert f.get_tensor("lora_unet_single_blocks_0_linear1.lora_down.weight").shape[0] == (16 if wide else 12)
        assert f.get_tensor("lora_unet_double_blocks_0_img_attn_qkv.alpha").item() == 24.0


@pytest.mark.parametrize(
    ("family", "variant", "key_start"),
    [
        ("flux2", "klein", "lora_unet_"),
        ("qwen_image", None, "lora_unet_transformer_blocks_"),
        ("qwen_image_edit_plus", "2511", "lora_unet_transformer_blocks_"),
        ("z_image", None, "lora_unet_"),
        ("wan", "t2v", "diffusion_model.blocks."),
        ("wan_i2v", "i2v", "diffusion_model.blocks."),
        ("flux2-wide", "klein", "lora_unet_"),
        ("qwen_image-wide", None, "lora_unet_"),
        ("wan-wide", "t2v", "diffusion_model.blocks."),
    ],
)
def test_transformer_families_round_trip(family, variant, key_start, tmp_path):
    family, wide = family.removesuffix("-wide"), family.endswith("-wide")
    pipeline, checkpoint, base, config = lora_checkpoint(family, variant, tmp_path, (WIDE[family],) if wide else ())
    if wide or family == "z_image":  # every module kind the layout places (the tiny Wan models have no image keys k_img / v_img)
        assert unused_rules(pipeline) == (["blocks.{}.cross_attn.k_img", "blocks.{}.cross_attn.v_img"] if family == "wan" else [])
    assert_round_trip(pipeline, checkpoint, base, config, tmp_path / "comfy", key_start)


@pytest.mark.slow
def test_a_trained_checkpoint_exports(tmp_path):
    """A real one-iteration LoRA run's checkpoint (the tiny run of flowrl/pipelines/tiny/runs.py): export_lora writes
    both formats; diffusers loads the comfy one into the base model and reproduces the trained pipeline's samples."""
    from accelerate.state import AcceleratorState

    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    base = tiny_checkpoint("stable_diffusion", tmp_path / "base")
    run = "stable_diffusion/ddpo_aesthetic"
    overrides = [*tiny_overrides(run, base, tmp_path / "run"), LORA, "log.checkpoint_every=1", "train.learning_rate=0.05"]
    AcceleratorState._reset_state(True)
    trainer = Trainer(load_config(RUNS[run].preset, overrides))
    trainer.fit()
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    file = export_lora(checkpoint, tmp_path / "comfy", "comfy")
    diffusers_file = export_lora(checkpoint, tmp_path / "diffusers", "diffusers")
    from flowrl.cli import main  # the command line writes the same file, with the model card beside it

    assert main(["export", str(checkpoint), str(tmp_path / "cli"), "--format", "comfy"]) == 0
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == ["README.md", "lora.safetensors", "samples.png"]
    with safe_open(str(file), "pt") as a, safe_open(str(tmp_path / "cli" / "lora.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys()) and all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
    assert diffusers_file == tmp_path / "diffusers" / "pytorch_lora_weights.safetensors"
    with safe_open(str(diffusers_file), "pt") as a, safe_open(str(checkpoint / "pytorch_lora_weights.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys()) and all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
    ours = samples(trainer.pipeline)
    from flowrl.pipelines import build_pipeline

    plain = build_pipeline(trainer.config.pipeline.model_copy(update={"lora": None}), "cpu")
    before = samples(plain)
    plain.denoiser = diffusers_denoiser(trainer.pipeline, base, file)
    difference = (samples(plain) - ours).abs().max().item()
    print("trained", difference, (before - ours).abs().max().item())
    assert difference < 1e-5 and (before - ours).abs().max() > 0
    with pytest.raises(FlowRLError, match="unknown LoRA format 'kohya'; the formats are: diffusers, comfy."):
        export_lora(checkpoint, tmp_path / "x", "kohya")


def test_wan22_two_experts_write_one_file_each(tmp_path):
    """Wan2.2 A14B: one file per expert (lora_high_noise / lora_low_noise, a ComfyUI workflow's two models); diffusers
    loads them into transformer and transformer_2 (load_into_transformer_2=True) and reproduces flowrl's samples."""
    from diffusers import WanPipeline

    from flowrl.pipelines import build_pipeline

    pipeline, checkpoint, base, config = lora_checkpoint("wan", "a14b", tmp_path)
    high = write_comfy_lora(checkpoint, tmp_path / "comfy" / "mine.safetensors")
    low = tmp_path / "comfy" / "mine_low_noise.safetensors"
    assert high == tmp_path / "comfy" / "mine_high_noise.safetensors" and sorted((tmp_path / "comfy").iterdir()) == [high, low]
    for file, expert in ((high, "high_noise"), (low, "low_noise")):
        with safe_open(str(file), "pt") as f:
            assert f.metadata()["flowrl_expert"] == expert and all(k.startswith("diffusion_model.blocks.") for k in f.keys())
    user = WanPipeline.from_pretrained(base)
    user.load_lora_weights(high)
    user.load_lora_weights(low, load_into_transformer_2=True)
    plain = build_pipeline(config.pipeline.model_copy(update={"lora": None}), "cpu")
    base_samples = samples(plain)
    plain.denoiser.transformer, plain.denoiser.transformer_2 = user.transformer, user.transformer_2
    ours, theirs = samples(pipeline), samples(plain)
    print("wan a14b", (theirs - ours).abs().max().item(), (base_samples - ours).abs().max().item())
    assert (theirs - ours).abs().max() < 1e-5 and (base_samples - ours).abs().max() > 1e-3
