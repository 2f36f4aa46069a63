"""One GRPO iteration of a real-size, randomly initialised transformer (SD3.5-Medium, FLUX.1-dev, FLUX.2-klein-4B or
Z-Image-Turbo architecture) with LoRA and gradient checkpointing, through flowrl's own loading path; prints peak
memory, seconds per denoiser forward and backward, and seconds per iteration.

    python bench/real_size_iteration.py --family sd3  [--size real|tiny] [--device cuda|cpu] [--resolution 512] [--steps 10]
    python bench/real_size_iteration.py --family flux
    OMP_NUM_THREADS=2 python bench/real_size_iteration.py --family flux2_klein --device cpu   # 128 px, 2 samples, 2 steps
    OMP_NUM_THREADS=2 python bench/real_size_iteration.py --family z_image --device cpu

The transformer has the released checkpoint's architecture (configs below, each with its source) with random weights,
initialised directly in bf16; the VAE is real-size too. The text encoders keep their real widths (CLIP-L 768, CLIP-G
1280, T5-XXL 4096, Qwen3-4B 2560) but not their depth: they are frozen, run once per distinct prompt (cached), and are
not part of the step being measured. SD3 / FLUX.1: one layer each. FLUX.2-klein: 27 thin layers (2560 wide, 2 heads,
MLP 512), since the pipeline stacks the hidden states of layers 9, 18 and 27. Z-Image: two real Qwen3-4B layers
(it reads the penultimate hidden state). The tokenizers are small byte-level BPEs with the families' chat templates
(tests/test_family_flux2.py, tests/test_family_z_image.py), so the text token counts are not the real tokenizers'.

The pipeline is built and written with ``save_pretrained`` by a child process (so that building does not count in
the measured process's peak memory), then loaded with ``pipeline.pretrained=<dir>``, as a user's checkpoint would be.
Measured in this process: one denoiser forward without gradient, one with gradient and its backward (LoRA adapters
only, through the gradient-checkpointed blocks), then one full GRPO iteration (rollout / scoring / update).
Peak memory: GPU ``max_memory_allocated`` on CUDA; on the CPU the process's resident set (a sampling thread per phase,
and ``ru_maxrss`` for the whole process), beside docs/distributed.md's computed figure for the same model.
On the CPU the bf16 linear layers compute their GEMMs in float32 by default (``--cpu-gemm fp32``, :func:`fp32_gemm`):
PyTorch's bf16 GEMM for a linear layer's input gradient is a naive kernel on CPUs without AVX512-BF16 / AMX, and one
stock backward of a 4-6 B model takes hours there; one stock bf16 forward is still timed. Results: bench/RESULTS.md.
``--size tiny`` runs the same path at a tiny config on a CPU (to check the script itself).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FAMILIES = ("sd3", "flux", "flux2_klein", "z_image")
PIPELINE_NAME = {"sd3": "sd3", "flux": "flux", "flux2_klein": "flux2", "z_image": "z_image"}
# docs/distributed.md's memory table, LoRA r=32 rows, DDP column (one process holds everything): bf16 frozen base
# (2 B a parameter) + 16 B a LoRA parameter (weights, gradients, AdamW); activations, text encoders and VAE not counted
DOCS_TABLE_GIB = {"sd3": 4.9, "flux": 22.7, "flux2_klein": 7.8, "z_image": 12.6}
DOCS_TABLE_ROW = {
    "sd3": "SD3.5-Medium, LoRA r=32",
    "flux": "FLUX.1-dev, LoRA r=32",
    "flux2_klein": "FLUX.2-klein-4B, LoRA r=32 (its default targets)",
    "z_image": "Z-Image(-Turbo), LoRA r=32 (attention + feed-forward, its default)",
}

GEMM_WIDTH = {"sd3": 1536, "flux": 3072, "flux2_klein": 3072, "z_image": 3840}  # the transformers' inner width

# Released architectures (the transformer/config.json of each checkpoint).
SD35_MEDIUM = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
FLUX1_DEV = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
# FLUX.2-klein-4B (and klein-base-4B, the same transformer): diffusers' scripts/convert_flux2_to_diffusers.py,
# get_flux2_transformer_config("klein-4b") (huggingface/diffusers, commit 207bae7a); 3,876 M parameters, as
# docs/distributed.md counts. Its text encoder is Qwen3-4B: joint_attention_dim = 3 stacked layers x 2560.
FLUX2_KLEIN_4B = dict(
    patch_size=1,
    in_channels=128,
    num_layers=5,
    num_single_layers=20,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=7680,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=False,
)
# Z-Image-Turbo: the hub's Tongyi-MAI/Z-Image-Turbo transformer/config.json (as copied into several public loaders;
# equal to ZImageTransformer2DModel's defaults except axes_lens, which sizes the RoPE table only); 6,155 M parameters.
Z_IMAGE_TURBO = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=16,
    dim=3840,
    n_layers=30,
    n_refiner_layers=2,
    n_heads=30,
    n_kv_heads=30,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=2560,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=(32, 48, 48),
    axes_lens=(1536, 512, 512),
)
# Qwen3-4B's config.json (Qwen/Qwen3-4B): the text encoder of FLUX.2-klein-4B and of Z-Image (36 layers, not built)
QWEN3_4B = dict(
    hidden_size=2560,
    intermediate_size=9728,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000,
    max_position_embeddings=40960,
)
TINY_SD3 = dict(
    sample_size=32,
    patch_size=2,
    in_channels=16,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=32,
    caption_projection_dim=16,
    pooled_projection_dim=64,
    out_channels=16,
    pos_embed_max_size=64,
)
TINY_FLUX = dict(
    patch_size=1,
    in_channels=64,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)
TINY_FLUX2 = dict(  # tests/test_family_flux2.py's klein transformer
    patch_size=1,
    in_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=48,
    timestep_guidance_channels=256,
    axes_dims_rope=(4, 4, 4, 4),
    guidance_embeds=False,
)
TINY_Z_IMAGE = dict(  # tests/test_family_z_image.py's, on 16 latent channels
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=16,
    dim=32,
    n_layers=1,
    n_refiner_layers=1,
    n_heads=2,
    n_kv_heads=2,
    cap_feat_dim=32,
    axes_dims=[4, 4, 8],
    axes_lens=[256, 32, 32],
)
SD3_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    use_quant_conv=False,
    use_post_quant_conv=False,
    scaling_factor=1.5305,
    shift_factor=0.0609,
)
FLUX1_VAE = {**SD3_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}  # Z-Image decodes through FLUX.1's VAE
TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    block_out_channels=(8, 16),
    layers_per_block=1,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    norm_num_groups=4,
    scaling_factor=1.5305,
    shift_factor=0.0609,
)


def text_encoders(real: bool, family: str):
    """One-layer text encoders with the real widths (tiny widths for --size tiny)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from flowrl.data.digits import build_tokenizer

    def clip(width, projection):
        cfg = CLIPTextConfig(
            hidden_size=width,
            intermediate_size=4 * width,
            num_hidden_layers=1,
            num_attention_heads=max(1, width // 64),
            projection_dim=width,
            vocab_size=1000,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=1,
        )
        return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg)

    t5 = T5EncoderModel(
        T5Config(
            vocab_size=1000,
            d_model=4096 if real else 32,
            d_kv=64 if real else 8,
            d_ff=10240 if real else 37,
            num_layers=1,
            num_heads=64 if real else 4,
        )
    )
    tok = build_tokenizer()
    if family == "sd3":
        widths = (768, 1280) if real else (32, 32)
        return dict(
            text_encoder=clip(widths[0], True),
            tokenizer=tok,
            text_encoder_2=clip(widths[1], True),
            tokenizer_2=tok,
            text_encoder_3=t5,
            tokenizer_3=tok,
        )
    return dict(text_encoder=clip(768 if real else 32, False), tokenizer=tok, text_encoder_2=t5, tokenizer_2=tok)


def qwen3_text_encoder(real: bool, family: str):
    """FLUX.2-klein: Qwen3ForCausalLM, 27 layers (the pipeline stacks layers 9, 18, 27), 2560 wide but thin (2 heads of
    128, MLP 512). Z-Image: Qwen3Model, two layers of Qwen3-4B's real shape. Tiny: the test files' encoders."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    if not real:
        tiny = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
        tiny.update(max_position_embeddings=256, pad_token_id=0)
        if family == "flux2_klein":
            return Qwen3ForCausalLM(Qwen3Config(vocab_size=512, num_hidden_layers=27, **tiny))
        return Qwen3Model(Qwen3Config(vocab_size=320, num_hidden_layers=2, **{**tiny, "hidden_size": 32, "head_dim": 16}))
    if family == "flux2_klein":
        thin = {**QWEN3_4B, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 512}
        return Qwen3ForCausalLM(Qwen3Config(vocab_size=512, num_hidden_layers=27, pad_token_id=0, **thin))
    return Qwen3Model(Qwen3Config(vocab_size=320, num_hidden_layers=2, pad_token_id=0, **QWEN3_4B))


@contextlib.contextmanager
def init_in(device: str, dtype: torch.dtype):
    """Modules built inside are created (and randomly initialised) on ``device`` in ``dtype``: no float32 copy of a
    multi-billion-parameter model on the way."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(before)


def build_checkpoint(family: str, real: bool, directory: Path, device: str) -> None:
    from diffusers import (
        AutoencoderKL,
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
        FluxPipeline,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )

    torch.manual_seed(0)
    with init_in(device, torch.bfloat16):  # random init of a 12B model is slow on a CPU, and float32 would not fit
        if family == "sd3":
            transformer = SD3Transformer2DModel(**(SD35_MEDIUM if real else TINY_SD3))
            scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
            parts = dict(vae=AutoencoderKL(**(SD3_VAE if real else TINY_VAE)), **text_encoders(real, family))
            cls = StableDiffusion3Pipeline
        elif family == "flux":
            transformer = FluxTransformer2DModel(**(FLUX1_DEV if real else TINY_FLUX))
            scheduler = FlowMatchEulerDiscreteScheduler(
                use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
            )
            parts = dict(vae=AutoencoderKL(**(SD3_VAE if real else TINY_VAE)), **text_encoders(real, family))
            cls = FluxPipeline
        elif family == "flux2_klein":
            from tests.test_family_flux2 import chat_tokenizer, tiny_flux2_vae

            transformer = Flux2Transformer2DModel(**(FLUX2_KLEIN_4B if real else TINY_FLUX2))
            scheduler = FlowMatchEulerDiscreteScheduler(
                shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
            )
            vae = AutoencoderKLFlux2() if real else tiny_flux2_vae()  # the defaults are FLUX.2's VAE (32 latent channels)
            parts = dict(vae=vae, text_encoder=qwen3_text_encoder(real, family), tokenizer=chat_tokenizer("klein"), is_distilled=True)
            cls = Flux2KleinPipeline
        else:
            from tests.test_family_z_image import qwen_tokenizer

            transformer = ZImageTransformer2DModel(**(Z_IMAGE_TURBO if real else TINY_Z_IMAGE))
            scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # Z-Image-Turbo's scheduler config
            vae = AutoencoderKL(**(FLUX1_VAE if real else {**TINY_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}))
            parts = dict(vae=vae, text_encoder=qwen3_text_encoder(real, family), tokenizer=qwen_tokenizer())
            cls = ZImagePipeline
    pipe = cls(transformer=transformer, scheduler=scheduler, **parts)
    pipe.save_pretrained(directory)
    print(
        json.dumps(
            {
                "built": family,
                "transformer_params": sum(p.numel() for p in transformer.parameters()),
                "text_encoder_params": sum(
                    sum(p.numel() for p in m.parameters()) for k, m in parts.items() if k.startswith("text_encoder")
                ),
                "vae_params": sum(p.numel() for p in parts["vae"].parameters()),
                "build_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            }
        ),
        flush=True,
    )


# -- measuring -----------------------------------------------------------------------------------------------


def rss_bytes() -> dict[str, int]:
    """Resident memory of this process: total, anonymous (heap, tensors) and file-backed (the safetensors files
    diffusers maps, whose bf16 weights stay mapped when loaded in their saved dtype on the CPU)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:")):
                key, value = line.split(":")
                fields[key] = int(value.split()[0]) * 1024
    return {"total": fields["VmRSS"], "anon": fields.get("RssAnon", 0), "file": fields.get("RssFile", 0)}


class RssMonitor:
    """Peak resident memory of this process per phase (total, anonymous, file-backed; each peak on its own),
    and the machine's 1-minute load average, sampled every ``interval`` seconds by a thread."""

    def __init__(self, interval: float = 0.05):
        self.phase, self.peaks, self.interval = "start", {}, interval
        self.load: dict[str, list[float]] = {}  # the machine's 1-minute load average (this run adds about 2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _record(self, phase: str) -> None:
        now, peak = rss_bytes(), self.peaks.setdefault(phase, {})
        for k, v in now.items():
            peak[k] = max(peak.get(k, 0), v)
        self.load.setdefault(phase, []).append(os.getloadavg()[0])

    def _run(self) -> None:
        while not self._stop.is_set():
            self._record(self.phase)
            self._stop.wait(self.interval)

    def enter(self, phase: str) -> None:
        self._record(self.phase)
        self.phase = phase
        self._record(phase)

    def stop(self) -> dict[str, dict[str, float]]:
        self.enter("end")
        self._stop.set()
        self._thread.join()
        return {phase: {k: round(v / 2**30, 2) for k, v in peak.items()} for phase, peak in self.peaks.items()}

    def mean_load(self) -> dict[str, float]:
        return {phase: round(sum(v) / len(v), 1) for phase, v in self.load.items()}


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):  # accelerate / DDP wrappers
        module = module.module
    return module


def lora_modules(model: torch.nn.Module) -> dict:
    """The modules PEFT wrapped, by name with the block indices folded (``transformer_blocks.*.attn.to_q``)."""
    names = [n for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    patterns = Counter(re.sub(r"\.\d+\.", ".*.", n) for n in names)
    return {"count": len(names), "first": names[:3], "patterns": dict(patterns)}


@contextlib.contextmanager
def counting_calls(owner, attribute: str, record: list):
    """Wrap ``owner.attribute`` (a function) to append each call's first tensor argument's (dtype, shape)."""
    original = getattr(owner, attribute)

    def wrapper(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        record.append((str(first.dtype), tuple(first.shape)) if first is not None else None)
        return original(*args, **kwargs)

    setattr(owner, attribute, wrapper)
    try:
        yield
    finally:
        setattr(owner, attribute, original)


class Fp32GemmLinear(torch.autograd.Function):
    """``F.linear`` on bf16 CPU tensors with the products and sums in float32 (weights cast per call, never kept):
    inputs, outputs, saved tensors and gradients keep their bf16 dtype, so memory and every code path are the stock
    ones; only the GEMM kernel differs. Why: on CPUs without AVX512-BF16 / AMX, PyTorch's bf16 GEMM for the
    ``grad @ weight`` layout of a linear layer's input gradient is its naive scalar kernel (pytorch/pytorch#146508):
    0.2 GFLOPS on this machine against 10 for the forward layout and 50 for float32, so one stock bf16 backward of a
    4-6 B model takes hours here. A GPU's bf16 GEMM accumulates in float32 as well."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        out = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.float()
        gx = (g @ weight.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        rows = g.reshape(-1, g.shape[-1])
        gw = (rows.T @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = rows.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return gx, gw, gb


@contextlib.contextmanager
def fp32_gemm():
    """While active, every ``F.linear`` (nn.Linear, PEFT's LoRA layers, diffusers' direct calls) with a bf16 operand
    on the CPU goes through :class:`Fp32GemmLinear`, after casting the operands as CPU autocast would (to its dtype
    when it is on). A module attribute swap rather than a TorchFunctionMode, so that it is also in force in the
    backward pass, where the checkpointed blocks recompute their forward."""
    original = torch.nn.functional.linear

    def linear(x, weight, bias=None):
        if x.device.type == "cpu" and torch.bfloat16 in (x.dtype, weight.dtype):
            if torch.is_autocast_enabled("cpu"):
                dtype = torch.get_autocast_dtype("cpu")
                x, weight = x.to(dtype), weight.to(dtype)
                bias = None if bias is None else bias.to(dtype)
            with torch.autocast("cpu", enabled=False):
                return Fp32GemmLinear.apply(x, weight, bias)
        return original(x, weight, bias)

    torch.nn.functional.linear = linear
    try:
        yield
    finally:
        torch.nn.functional.linear = original


def gemm_rates(width: int, rows: int) -> dict:
    """GFLOPS of this CPU's GEMMs at one of the model's real layer shapes (width x width, ``rows`` tokens): the
    forward layout ``x @ W.T`` and the input-gradient layout ``g @ W``, in bf16 and in float32."""
    x, w = torch.randn(rows, width), torch.randn(width, width)
    flops = 2 * rows * width * width
    out = {"shape": [rows, width, width]}
    for dtype in (torch.bfloat16, torch.float32):
        xd, wd = x.to(dtype), w.to(dtype)
        for name, b in (("forward", wd.T), ("input_grad", wd)):  # W.T: a view, the layout of F.linear's forward
            xd @ b
            t0 = time.perf_counter()
            xd @ b
            out[f"{name}_{str(dtype).split('.')[-1]}_gflops"] = round(flops / (time.perf_counter() - t0) / 1e9, 2)
    return out


def time_denoiser(trainer, batch: int, steps: int, guidance: float, sync, use_fp32_gemm: bool, enter) -> dict:
    """One denoiser forward without gradient, one with gradient and its backward, at the run's resolution and batch,
    through ``pipeline.predict`` (the adapter's own denoiser call, under the trainer's autocast); which attention
    function ran, in what dtype, how many blocks ran checkpointed, and which LoRA tensors got a gradient. With
    ``use_fp32_gemm``, first one forward with the stock bf16 GEMMs, then everything through :func:`fp32_gemm`."""
    import torch.nn.functional as F

    pipe = trainer.pipeline
    model = unwrap(pipe.denoiser)
    prompts = ["the digit seven", "the digit three"] * batch
    cond = pipe.encode(prompts[:batch])
    x = pipe.initial_noise(batch, torch.Generator().manual_seed(0))
    sigma = pipe.schedule.sigmas(steps)[0]
    out: dict = {"latent_shape": list(x.shape), "gemm": "fp32 (Fp32GemmLinear)" if use_fp32_gemm else "stock"}

    def forward_no_grad(key: str) -> list:
        sdpa: list = []
        with counting_calls(F, "scaled_dot_product_attention", sdpa):
            sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                pipe.predict(x, sigma, cond, guidance)
            sync()
            out[key] = round(time.perf_counter() - t0, 2)
        progress(f"{key}: {out[key]}")
        return sdpa

    if use_fp32_gemm:  # the stock bf16 kernels, forward only: a stock backward takes hours on an AVX2 CPU
        enter("forward_stock_bf16_gemm")
        forward_no_grad("forward_no_grad_stock_bf16_gemm_s")
    enter("forward_backward")
    with fp32_gemm() if use_fp32_gemm else contextlib.nullcontext():
        sdpa = forward_no_grad("forward_no_grad_s")
        out["sdpa_calls_per_forward"] = len(sdpa)
        out["sdpa_query"] = sdpa[0] if sdpa else None  # (dtype, (batch, heads, tokens, head_dim))
        trainer.module.train()
        checkpointed: list = []
        with counting_calls(model, "_gradient_checkpointing_func", checkpointed):
            sync()
            t0 = time.perf_counter()
            pred = pipe.predict(x, sigma, cond, guidance)
            sync()
            out["forward_grad_s"] = round(time.perf_counter() - t0, 2)
        progress(f"forward_grad_s: {out['forward_grad_s']}")
        loss = pred.float().square().mean()
        sync()
        t0 = time.perf_counter()
        loss.backward()
        sync()
        out["backward_s"] = round(time.perf_counter() - t0, 2)
        progress(f"backward_s: {out['backward_s']}")
    out["checkpointed_block_calls"] = len(checkpointed)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    got = [(n, p) for n, p in params if p.grad is not None]
    out["lora_tensors"] = len(params)
    out["lora_tensors_with_grad"] = len(got)
    out["lora_grads_finite"] = all(bool(torch.isfinite(p.grad).all()) for _, p in got)
    out["lora_B_grads_nonzero"] = sum(bool(p.grad.abs().sum() > 0) for n, p in got if "lora_B" in n)
    out["prediction_dtype"], out["prediction_finite"] = str(pred.dtype), bool(torch.isfinite(pred).all())
    trainer.optimizer.zero_grad(set_to_none=True)
    del pred, loss
    return out


def count_forwards(model: torch.nn.Module):
    """(calls, seconds) of every top-level denoiser forward while installed (hooks; recomputation inside the
    checkpointed blocks during backward is not a top-level forward and is not counted)."""
    state = {"calls": 0, "seconds": 0.0, "t": 0.0}

    def before(*_):
        state["t"] = time.perf_counter()

    def after(*_):
        state["calls"] += 1
        state["seconds"] += time.perf_counter() - state["t"]

    handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
    return state, handles


def parse_arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=FAMILIES, default="sd3")
    ap.add_argument("--size", choices=["real", "tiny"], default="real")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--resolution", type=int, default=None, help="pixels (default 512 on CUDA, 128 on the CPU)")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default 10 on CUDA, 2 on the CPU)")
    ap.add_argument("--group", type=int, default=None, help="samples per iteration, one prompt group (default 4 / 2)")
    ap.add_argument("--max-sequence-length", type=int, default=None, help="text tokens (FLUX.2 / Z-Image; default 512 / 64 on the CPU)")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument(
        "--cpu-gemm",
        choices=["fp32", "bf16"],
        default="fp32",
        help="CPU only: bf16 linear layers' GEMMs in float32 (fp32_gemm(); default) or PyTorch's stock bf16 kernels",
    )
    ap.add_argument("--checkpoint-dir", type=Path, default=None, help="build the checkpoint here (reused when it exists)")
    ap.add_argument("--build-only", type=Path, default=None, help=argparse.SUPPRESS)  # the child process
    return ap.parse_args()


@dataclasses.dataclass(frozen=True)
class Setting:
    """What is measured: the command line, with the defaults that depend on the device and the size filled in."""

    args: argparse.Namespace
    real: bool
    cuda: bool
    resolution: int
    steps: int
    group: int

    @classmethod
    def of(cls, args: argparse.Namespace) -> Setting:
        real, cuda = args.size == "real", args.device == "cuda"
        resolution = args.resolution or (512 if cuda else 128)
        steps = args.steps or (10 if cuda else 2)
        group = args.group or (4 if cuda else 2)
        if not real:
            resolution = 32
        return cls(args, real, cuda, resolution, steps, group)


def ready_checkpoint(args: argparse.Namespace, model_dir: Path) -> tuple[float, dict]:
    """The checkpoint in ``model_dir``, built in a child process unless it is there already (the child's peak memory is
    not this process's); returns the seconds that took and the child's record of the build."""
    t0 = time.perf_counter()
    build_info: dict = {"reused": True}
    if not (model_dir / "model_index.json").exists():  # built in a child process: its peak is not this one's
        cmd = [sys.executable, __file__, "--family", args.family, "--size", args.size, "--device", args.device]
        done = subprocess.run([*cmd, "--build-only", str(model_dir)], check=True, stdout=subprocess.PIPE, text=True)
        build_info = json.loads(done.stdout.strip().splitlines()[-1])
    return time.perf_counter() - t0, build_info


def trainer_overrides(setting: Setting, model_dir: Path, run_dir: Path) -> dict[str, object]:
    """The config of the one-iteration GRPO run on the checkpoint in ``model_dir``, as ``key: value`` overrides."""
    args, cuda, real, group = setting.args, setting.cuda, setting.real, setting.group
    overrides = {
        "pipeline.name": PIPELINE_NAME[args.family],
        "pipeline.pretrained": str(model_dir),
        "pipeline.dtype": "bfloat16",
        "pipeline.lora": f"{{r: {args.lora_rank}, alpha: {2 * args.lora_rank}}}",
        "pipeline.gradient_checkpointing": True,
        "pipeline.height": setting.resolution,
        "pipeline.width": setting.resolution,
        "pipeline.device": "auto" if cuda else "cpu",
        "train.mixed_precision": "bf16",
        "sampler.name": "flow_sde",
        "objective.name": "grpo",
        "rollout.num_inference_steps": setting.steps,
        "rollout.batch_size": group,
        # the step-distilled klein and Z-Image-Turbo run without guidance (one forward per step)
        "rollout.guidance_scale": {"flux": 3.5, "sd3": 4.5}.get(args.family, 1.0),
        "rollout.guidance_mode": "embedded" if args.family == "flux" else "cfg",
        "train.iterations": 1,
        "train.prompts_per_iteration": 1,
        "train.num_generations": group,
        "train.batch_size": group,
        "reward.components": "{ink: 1.0}",
        "eval.every": 0,
        "eval.samples_per_prompt": 1,
        "log.grid_prompts": 1,
        "log.checkpoint_every": 0,
        "log.progress": False,
        "output_dir": str(run_dir),
        "prompts.dataset": "digits",
    }
    if args.family in ("flux2_klein", "z_image"):
        tokens = args.max_sequence_length or (512 if cuda and real else 64 if real else 32)
        overrides["pipeline.max_sequence_length"] = tokens
    return overrides


def model_counts(trainer, model: torch.nn.Module) -> dict:
    """The transformer's frozen (``base``) and LoRA parameter counts, their dtypes, and the LoRA targets."""
    params = sum(p.numel() for p in model.parameters())
    lora = sum(p.numel() for p in trainer.trainable_parameters())
    return {
        "base": params - lora,
        "lora": lora,
        "dtypes": Counter(str(p.dtype) for p in model.parameters() if not p.requires_grad),
        "dtypes_lora": Counter(str(p.dtype) for p in model.parameters() if p.requires_grad),
        "targets": lora_modules(model),
    }


def time_iteration(trainer, model: torch.nn.Module, cuda: bool, sync, use_fp32_gemm: bool, enter) -> tuple[dict, float, dict]:
    """One GRPO iteration, its top-level denoiser forwards counted; returns its metrics, seconds and forward counts."""
    if cuda:  # a warm-up iteration (kernels, allocator, prompt cache); on the CPU the timing above warmed up
        trainer.train_iteration(0)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    progress("one GRPO iteration")
    enter("iteration")
    calls, handles = count_forwards(model)
    t0 = time.perf_counter()
    with fp32_gemm() if use_fp32_gemm else contextlib.nullcontext():
        metrics = trainer.train_iteration(1)
    sync()
    seconds = time.perf_counter() - t0
    for h in handles:
        h.remove()
    return metrics, seconds, calls


def described(setting: Setting, model: torch.nn.Module, counts: dict) -> dict:
    """The result's first entries: what ran where, and the transformer with its LoRA adapters."""
    args, cuda = setting.args, setting.cuda
    return {
        "family": args.family,
        "size": args.size,
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)",
        "transformer_params": counts["base"],
        "transformer_class": type(model).__name__,
        "lora_params": counts["lora"],
        "lora_rank": args.lora_rank,
        "lora_modules": counts["targets"],
        "frozen_dtypes": dict(counts["dtypes"]),
        "lora_dtypes": dict(counts["dtypes_lora"]),
        "gradient_checkpointing": bool(getattr(model, "gradient_checkpointing", False)),
    }


def iteration_entries(seconds: float, metrics: dict, calls: dict) -> dict:
    return {
        "iteration_s": round(seconds, 1),
        "rollout_s": round(metrics["perf/rollout_s"], 1),
        "score_s": round(metrics["perf/score_s"], 1),
        "update_s": round(metrics["perf/update_s"], 1),
        "iteration_denoiser_forwards": calls["calls"],
        "iteration_denoiser_forward_s": round(calls["seconds"], 1),
        "losses": {k: v for k, v in metrics.items() if k.startswith("loss/")},
        "loss_finite": any(k.startswith("loss/") for k in metrics)
        and all(math.isfinite(v) for k, v in metrics.items() if k.startswith("loss/")),
    }


def docs_entries(setting: Setting, counts: dict) -> dict:
    """docs/distributed.md's figure for this model (real size, rank 32), and its accounting with this model's counts."""
    args = setting.args
    # docs/distributed.md's accounting with this model's own counts: 2 B a frozen bf16 parameter, 16 B a LoRA one
    accounted = (2 * counts["base"] + 16 * counts["lora"]) / 2**30
    return {
        "docs_table_gib": {"row": DOCS_TABLE_ROW[args.family], "gib": DOCS_TABLE_GIB[args.family]}
        if setting.real and args.lora_rank == 32
        else None,
        "docs_accounting_this_model_gib": round(accounted, 2),
    }


def memory_entries(cuda: bool, peak_fb: float | None, rss: dict | None, monitor: RssMonitor | None) -> dict:
    """The peaks: GPU memory allocated on CUDA; on the CPU the resident set by phase and the process's ru_maxrss."""
    if cuda:
        return {
            "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "peak_gpu_memory_forward_backward_gib": round(peak_fb, 2),
        }
    return {
        "peak_rss_gib_by_phase": rss,
        "load_average_1min_by_phase": monitor.mean_load(),
        "ru_maxrss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }


def measure_trainer(setting: Setting, trainer, overrides: dict, monitor: RssMonitor | None, load_s: float, loading: dict) -> dict:
    """Time one denoiser forward and backward, then one GRPO iteration; returns the result (``loading``: how the
    checkpoint was built and loaded)."""
    cuda = setting.cuda
    pipe = trainer.pipeline
    model = unwrap(pipe.denoiser)
    counts = model_counts(trainer, model)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    guidance = float(overrides["rollout.guidance_scale"])

    use_fp32_gemm = not cuda and setting.args.cpu_gemm == "fp32"
    enter = monitor.enter if monitor else (lambda phase: None)
    progress(f"loaded in {load_s:.0f} s; timing one denoiser forward and backward")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    denoiser = time_denoiser(trainer, setting.group, setting.steps, guidance, sync, use_fp32_gemm, enter)
    peak_fb = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    metrics, seconds, calls = time_iteration(trainer, model, cuda, sync, use_fp32_gemm, enter)
    rss = monitor.stop() if monitor else None
    result = {
        **described(setting, model, counts),
        "resolution": setting.resolution,
        "max_sequence_length": overrides.get("pipeline.max_sequence_length"),
        "steps": setting.steps,
        "samples": setting.group,
        "denoiser": denoiser,
        **iteration_entries(seconds, metrics, calls),
        **docs_entries(setting, counts),
        **loading,
    }
    result.update(memory_entries(cuda, peak_fb, rss, monitor))
    return result


def measure(setting: Setting, gemm: dict | None, monitor: RssMonitor | None) -> None:
    """Build (or reuse) the checkpoint, load it through flowrl and measure it; prints the result as one JSON line."""
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    args = setting.args
    with tempfile.TemporaryDirectory(dir=args.checkpoint_dir.parent if args.checkpoint_dir else None) as tmp:
        model_dir = args.checkpoint_dir or Path(tmp) / "model"
        built, build_info = ready_checkpoint(args, model_dir)
        progress(f"checkpoint ready ({built:.0f} s); loading through flowrl")
        if monitor:
            monitor.enter("load")
        overrides = trainer_overrides(setting, model_dir, Path(tmp) / "run")
        t_load = time.perf_counter()
        trainer = Trainer(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))
        load_s = time.perf_counter() - t_load
        loading = {"cpu_gemm_rates": gemm, "checkpoint_build_s": round(built, 1), "build": build_info, "load_s": round(load_s, 1)}
        print(json.dumps(measure_trainer(setting, trainer, overrides, monitor, load_s, loading)))


def main() -> None:
    args = parse_arguments()
    real, cuda = args.size == "real", args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: no GPU here; use --device cpu")
    if args.build_only is not None:
        build_checkpoint(args.family, real, args.build_only, args.device)
        return
    setting = Setting.of(args)
    gemm = gemm_rates(GEMM_WIDTH[args.family], 128) if real and not cuda else None
    if gemm:
        progress(f"GEMM rates at this model's width: {gemm}")
    monitor = None if cuda else RssMonitor()
    measure(setting, gemm, monitor)


if __name__ == "__main__":
    main()
