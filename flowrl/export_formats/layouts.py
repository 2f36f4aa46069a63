"""Where each diffusers module of a family's denoiser lives in the model's original layout (the one ComfyUI and the
kohya-style trainers name their LoRA keys after), and which of those original modules stack several diffusers
modules along their output rows (FLUX.1's fused q/k/v).

Each table is the inverse of the diffusers reader named in its ``reader``: what that reader maps a key of the
original layout to is the module the table maps back from (tests/test_lora_export_comfy.py loads every family's
export through it). A module of no table (FLUX.1's embedders and final layer, say) is refused in one sentence rather than
written under a name no reader knows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Rule:
    """``pattern`` (a regular expression over the diffusers module name; its groups are block indices) -> the original
    module ``original`` (``{}`` for each index). ``parts``: the original module stacks these diffusers modules (name
    endings appended to ``pattern``) along its output rows, in this order, ``ratios`` their row counts relative to one
    another (all equal when empty)."""

    pattern: str
    original: str
    parts: tuple[str, ...] = ()
    ratios: tuple[int, ...] = ()

    def regex(self) -> re.Pattern:
        if not self.parts:
            return re.compile(self.pattern)
        return re.compile(self.pattern + "(" + "|".join(re.escape(p) for p in self.parts) + ")")

    def row_ratios(self) -> tuple[int, ...]:
        return self.ratios or (1,) * len(self.parts)


@dataclass(frozen=True)
class Layout:
    """A family's original layout: how its keys are spelled (``kohya``: ``lora_unet_<module with _ for .>`` with
    ``lora_down`` / ``lora_up`` / ``alpha``; ``dotted``: ``diffusion_model.<module>`` with the same suffixes), its
    module rules (None: the diffusers module names are kept and diffusers' ``convert_state_dict_to_kohya`` spells
    them), and the diffusers function that reads it back."""

    name: str
    keys: str  # "kohya" or "dotted"
    reader: str
    rules: tuple[Rule, ...] | None = None
    compiled: tuple[tuple[Rule, re.Pattern], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compiled", tuple((r, r.regex()) for r in self.rules or ()))

    def key(self, original: str) -> str:
        return "lora_unet_" + original.replace(".", "_") if self.keys == "kohya" else "diffusion_model." + original

    def locate(self, module: str) -> tuple[Rule, str, str | None] | None:
        """(rule, original module, part of it or None) of a diffusers module name; None when no rule names it."""
        for rule, regex in self.compiled:
            m = regex.fullmatch(module)
            if m is None:
                continue
            groups = m.groups()
            if rule.parts:
                return rule, rule.original.format(*groups[:-1]), groups[-1]
            return rule, rule.original.format(*groups), None
        return None


B = r"transformer_blocks\.(\d+)\."  # a double-stream block (its index is the group)
S = r"single_transformer_blocks\.(\d+)\."  # a single-stream block
QKV = ("attn.to_q", "attn.to_k", "attn.to_v")
ADD_QKV = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")

# SD 1.x / 2.x and SDXL: kohya names a UNet LoRA after the diffusers module itself (sd-scripts trains SD 1.x on the
# diffusers UNet; ComfyUI maps lora_unet_<diffusers module> for every UNet model)
UNET = Layout(
    name="kohya: lora_unet_<diffusers UNet module>.lora_down / .lora_up / .alpha (diffusers' convert_state_dict_to_kohya)",
    keys="kohya",
    reader="_convert_non_diffusers_lora_to_diffusers",
)

# FLUX.1 (black-forest-labs/flux): double_blocks.N.{img,txt}_attn.qkv stack q, k, v; single_blocks.N.linear1 stacks
# q, k, v and the MLP input (FluxSingleTransformerBlock's mlp_ratio is 4: 3 x dim + 4 x dim rows)
FLUX1 = Layout(
    name="kohya sd-scripts FLUX.1: lora_unet_double_blocks_N_* / lora_unet_single_blocks_N_*, lora_down / lora_up / alpha",
    keys="kohya",
    reader="_convert_kohya_flux_lora_to_diffusers",
    rules=(
        Rule(S, "single_blocks.{}.linear1", parts=(*QKV, "proj_mlp"), ratios=(1, 1, 1, 4)),
        Rule(S + r"proj_out", "single_blocks.{}.linear2"),
        Rule(S + r"norm\.linear", "single_blocks.{}.modulation.lin"),
        Rule(B, "double_blocks.{}.img_attn.qkv", parts=QKV),
        Rule(B, "double_blocks.{}.txt_attn.qkv", parts=ADD_QKV),
        Rule(B + r"attn\.to_out\.0", "double_blocks.{}.img_attn.proj"),
        Rule(B + r"attn\.to_add_out", "double_blocks.{}.txt_attn.proj"),
        Rule(B + r"ff\.net\.0\.proj", "double_blocks.{}.img_mlp.0"),
        Rule(B + r"ff\.net\.2", "double_blocks.{}.img_mlp.2"),
        Rule(B + r"ff_context\.net\.0\.proj", "double_blocks.{}.txt_mlp.0"),
        Rule(B + r"ff_context\.net\.2", "double_blocks.{}.txt_mlp.2"),
        Rule(B + r"norm1\.linear", "double_blocks.{}.img_mod.lin"),
        Rule(B + r"norm1_context\.linear", "double_blocks.{}.txt_mod.lin"),
    ),
)

# FLUX.2 (black-forest-labs/flux2): the double blocks stack q, k, v as FLUX.1's do; a single block's linear1 / linear2
# are diffusers' fused attn.to_qkv_mlp_proj / attn.to_out already
FLUX2 = Layout(
    name="kohya FLUX.2: lora_unet_double_blocks_N_* / lora_unet_single_blocks_N_*, lora_down / lora_up / alpha",
    keys="kohya",
    reader="_convert_kohya_flux2_lora_to_diffusers",
    rules=(
        Rule(S + r"attn\.to_qkv_mlp_proj", "single_blocks.{}.linear1"),
        Rule(S + r"attn\.to_out", "single_blocks.{}.linear2"),
        Rule(B, "double_blocks.{}.img_attn.qkv", parts=QKV),
        Rule(B, "double_blocks.{}.txt_attn.qkv", parts=ADD_QKV),
        Rule(B + r"attn\.to_out\.0", "double_blocks.{}.img_attn.proj"),
        Rule(B + r"attn\.to_add_out", "double_blocks.{}.txt_attn.proj"),
        Rule(B + r"ff\.linear_in", "double_blocks.{}.img_mlp.0"),
        Rule(B + r"ff\.linear_out", "double_blocks.{}.img_mlp.2"),
        Rule(B + r"ff_context\.linear_in", "double_blocks.{}.txt_mlp.0"),
        Rule(B + r"ff_context\.linear_out", "double_blocks.{}.txt_mlp.2"),
        Rule(r"x_embedder", "img_in"),
        Rule(r"context_embedder", "txt_in"),
        Rule(r"time_guidance_embed\.timestep_embedder\.linear_1", "time_in.in_layer"),
        Rule(r"time_guidance_embed\.timestep_embedder\.linear_2", "time_in.out_layer"),
        Rule(r"proj_out", "final_layer.linear"),
    ),
)

# Qwen-Image (QwenLM/Qwen-Image) was released in the diffusers layout: the original module is the diffusers one
_QWEN_BLOCK = (
    *(f"attn.{p}" for p in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")),
    *(f"{s}_mlp.net.{p}" for s in ("img", "txt") for p in ("0.proj", "2")),
    "img_mod.1",
    "txt_mod.1",
)
QWEN_IMAGE = Layout(
    name="kohya (musubi-tuner): lora_unet_transformer_blocks_N_*, lora_down / lora_up / alpha",
    keys="kohya",
    reader="_convert_non_diffusers_qwen_lora_to_diffusers",
    rules=(
        *(Rule(B + re.escape(p), "transformer_blocks.{}." + p) for p in _QWEN_BLOCK),
        *(
            Rule(re.escape(m), m)
            for m in (
                "img_in",
                "txt_in",
                "proj_out",
                "norm_out.linear",
                "time_text_embed.timestep_embedder.linear_1",
                "time_text_embed.timestep_embedder.linear_2",
            )
        ),
    ),
)

# Z-Image (Tongyi-MAI/Z-Image): attention.qkv stacks q, k, v; attention.out is diffusers' attention.to_out.0
_Z = r"(layers|noise_refiner|context_refiner)\.(\d+)\."
Z_IMAGE = Layout(
    name="kohya: lora_unet_{layers,noise_refiner,context_refiner}_N_attention_qkv / _attention_out / _feed_forward_wK, "
    "lora_down / lora_up / alpha",
    keys="kohya",
    reader="_convert_non_diffusers_z_image_lora_to_diffusers",
    rules=(
        Rule(_Z + r"attention\.", "{}.{}.attention.qkv", parts=("to_q", "to_k", "to_v")),
        Rule(_Z + r"attention\.to_out\.0", "{}.{}.attention.out"),
        *(Rule(_Z + rf"feed_forward\.w{k}", "{}.{}.feed_forward.w" + str(k)) for k in (1, 2, 3)),
    ),
)

# Wan2.1 / Wan2.2 (Wan-Video/Wan2.x): blocks.N.self_attn / cross_attn with q, k, v, o (and k_img, v_img for I2V), ffn.0 / ffn.2
_WAN_ATTN = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o"}
WAN = Layout(
    name="original Wan: diffusion_model.blocks.N.{self_attn,cross_attn}.{q,k,v,o} / .ffn.{0,2}, lora_down / lora_up / alpha",
    keys="dotted",
    reader="_convert_non_diffusers_wan_lora_to_diffusers",
    rules=(
        *(Rule(r"blocks\.(\d+)\.attn1\." + re.escape(d), "blocks.{}.self_attn." + o) for d, o in _WAN_ATTN.items()),
        *(Rule(r"blocks\.(\d+)\.attn2\." + re.escape(d), "blocks.{}.cross_attn." + o) for d, o in _WAN_ATTN.items()),
        Rule(r"blocks\.(\d+)\.attn2\.add_k_proj", "blocks.{}.cross_attn.k_img"),
        Rule(r"blocks\.(\d+)\.attn2\.add_v_proj", "blocks.{}.cross_attn.v_img"),
        Rule(r"blocks\.(\d+)\.ffn\.net\.0\.proj", "blocks.{}.ffn.0"),
        Rule(r"blocks\.(\d+)\.ffn\.net\.2", "blocks.{}.ffn.2"),
    ),
)

# pipeline.name -> its layout
LAYOUTS: dict[str, Layout] = {
    "stable_diffusion": UNET,
    "sdxl": UNET,
    "flux": FLUX1,
    "flux_kontext": FLUX1,
    "flux2": FLUX2,
    "qwen_image": QWEN_IMAGE,
    "qwen_image_edit": QWEN_IMAGE,
    "qwen_image_edit_plus": QWEN_IMAGE,
    "z_image": Z_IMAGE,
    "wan": WAN,
    "wan_i2v": WAN,
}
# families with a LoRA but no original layout diffusers reads back -> why
LEFT_OUT: dict[str, str] = {
    "sd3": "diffusers reads an SD3 LoRA only in its own layout (SD3LoraLoaderMixin converts no original keys), "
    "so an original-layout file could not be checked; ComfyUI reads the diffusers layout --lora-only writes for SD3",
    "cogvideox": "diffusers reads a CogVideoX LoRA only in its own layout",
    "amused": "aMUSEd has no ComfyUI model",
    "digits": "the embedded models have no ComfyUI model",
    "digits_video": "the embedded models have no ComfyUI model",
    "toy2d": "the 2-D toy model has no ComfyUI model",
    "dllm": "a diffusion LM's LoRA is a PEFT adapter directory, not a diffusion-model LoRA",
    "diffusion_gemma": "a diffusion LM's LoRA is a PEFT adapter directory, not a diffusion-model LoRA",
}
