"""DiffusionGemma (``transformers.DiffusionGemmaForBlockDiffusion``) as a flowrl diffusion-LM family.

DiffusionGemma is a block-diffusion LM that ships in transformers itself (no ``trust_remote_code``): a causal
encoder writes the prompt and every finished canvas into a KV cache, and a bidirectional decoder that shares the
encoder's weights denoises a canvas of ``config.canvas_length`` tokens that starts as uniformly random tokens (no
mask token), conditioned on the cache and on its own previous step's logits (self-conditioning). Its sampler is
``samplers/entropy_bound.py``; this module only loads the model and runs its two forward passes exactly as
``DiffusionGemmaGenerationMixin.generate`` does (:class:`BlockSession`), with or without gradient.

* Text only: the vision tower and its projection are frozen (a text prompt never reaches them, so they would get no
  gradient).
* The encoder and decoder layers are tied (one set of weights). LoRA (peft) wraps both copies of a tied layer, so
  after attaching it the encoder's adapters are replaced by the decoder's: one adapter per weight, still mergeable into
  the tied checkpoint. The default targets are the attention and MLP projections of the layers and the decoder's
  self-conditioning block (the MoE experts are fused parameter tensors, not ``nn.Linear``, so LoRA leaves them).
* ``pipeline.pretrained: diffusion_gemma_tiny_random`` builds a 2-layer random-weight model with the embedded
  arithmetic tokenizer (seeded, written with ``save_pretrained`` and loaded back): a plumbing preset, not a model.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field
from torch import Tensor

from ..errors import FlowRLError
from ..sections import PipelineSection
from . import transformers_lm as lm
from .common import DeviceSpec, ModelDtype, OptionalLora, PromptLength
from .dllm import EMBEDDED_LMS

TINY_RANDOM = "diffusion_gemma_tiny_random"
# peft full-matches a string target: the text layers' projections (encoder copies included, re-tied after) and the
# decoder's self-conditioning MLP; not the vision tower, whose projections are wrapped (ClippableLinear).
DEFAULT_LORA_TARGETS = (
    r".*\.(language_model\.layers\.\d+\.(self_attn|mlp)|decoder\.layers\.\d+\.(self_attn|mlp)|decoder\.self_conditioning)"
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
)


class BlockSession:
    """One batch's pass through DiffusionGemma's block loop, the model calls of ``generate`` and nothing else: the
    prompt prefill, one encoder call per finished canvas (appending it to the KV cache) and the decoder calls on a
    canvas. Masks and positions are made by the model's own helpers, as ``generate`` makes them (left padding
    included: positions count the padding, as ``generate`` with an ``attention_mask`` does)."""

    def __init__(self, model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor):
        from transformers import DynamicCache

        self.model = model  # the DiffusionGemmaForBlockDiffusion (under peft: the LoRA-injected base model)
        self.config = model.config
        self.canvas_length = int(model.config.canvas_length)
        batch, length = prompt_ids.shape
        device = prompt_ids.device
        self.cache = DynamicCache(config=self.config.get_text_config(decoder=True))
        self.pending = prompt_ids  # tokens the encoder has not seen yet
        self.prefill = True
        self.cur_len = length
        self.attention_mask = prompt_mask.bool()
        self.encoder_position_ids = torch.arange(0, length, dtype=torch.int32, device=device).unsqueeze(0)
        self.decoder_position_ids = torch.arange(length, length + self.canvas_length, dtype=torch.int32, device=device).unsqueeze(0)
        self.decoder_attention_mask = torch.nn.functional.pad(self.attention_mask, (0, self.canvas_length), value=True)
        self.mask_mapping = None
        self.batch = batch

    def encode(self) -> None:
        """Run the encoder on the tokens it has not seen (the prompt, then each finished canvas), growing the cache,
        and make the decoder's attention masks for the next canvas."""
        inner = self.model.model
        ids = self.pending.clone(memory_format=torch.contiguous_format)
        dummy = torch.empty((self.batch, ids.shape[1], 0), dtype=self.model.dtype, device=ids.device)
        mapping = inner.encoder.create_masks_for_generate(
            config=self.config,
            inputs_embeds=dummy,
            attention_mask=self.attention_mask,
            cache=self.cache,
            position_ids=self.encoder_position_ids,
            mm_token_type_ids=None,
        )
        self.cache = inner.encoder(input_ids=ids, attention_mask=mapping, cache=self.cache, position_ids=self.encoder_position_ids).cache
        self.prefill = False
        canvas_like = torch.empty((self.batch, self.canvas_length, 1), device=ids.device)
        self.mask_mapping = inner.decoder.create_diffusion_decoder_attention_mask(
            config=self.config, inputs_embeds=canvas_like, cache=self.cache, decoder_attention_mask=self.decoder_attention_mask
        )

    def denoise(self, canvas: Tensor, self_conditioning: Tensor | None) -> Tensor:
        """(B, L, V) float32 logits of the decoder on ``canvas`` (B, L) with the previous step's logits (or None)."""
        return self.model(
            decoder_input_ids=canvas,
            self_conditioning_logits=self_conditioning,
            decoder_attention_mask=self.mask_mapping,
            cache=self.cache,
            decoder_position_ids=self.decoder_position_ids,
        ).logits

    def finish_canvas(self, tokens: Tensor) -> None:
        """The canvas's final tokens (B, L) join the context; positions and masks move on by one canvas."""
        length = self.canvas_length
        self.pending = tokens
        self.cur_len += length
        self.decoder_attention_mask = torch.nn.functional.pad(self.decoder_attention_mask, (0, length), value=True)
        self.attention_mask = torch.nn.functional.pad(self.attention_mask, (0, length), value=True)
        self.encoder_position_ids = self.decoder_position_ids
        self.decoder_position_ids = torch.arange(
            self.cur_len, self.cur_len + length, dtype=torch.int32, device=self.decoder_position_ids.device
        ).unsqueeze(0)

    @property
    def embedding_dtype(self) -> torch.dtype:
        return self.model.model.decoder.embed_tokens.weight.dtype


class DiffusionGemmaLM(lm.TrainableLM):
    """The adapter the entropy-bound sampler and the step objective use: tokenizer, special tokens, the resolved
    generation config, :meth:`session` (the block loop's model calls) and the training loop's needs (LoRA,
    reference, state dicts: ``TrainableLM``, as the masked-LM adapter has them)."""

    mask_token_id = None  # uniform-noise diffusion: there is no mask token

    def __init__(self, model: torch.nn.Module, tokenizer: Any):
        self.model = model
        self.tokenizer = tokenizer
        base = lm.base_model(model)
        self.canvas_length = int(base.config.canvas_length)
        self.vocab_size = int(base.config.text_config.vocab_size)
        config = self.generation_config()
        eos = config.eos_token_id if config.eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id = None if eos is None else int(eos[0] if isinstance(eos, (list, tuple)) else eos)
        self._reference: torch.nn.Module | None = None
        self._use_reference = False

    def generation_config(self, **overrides: Any):
        """``generate``'s own resolution of its settings: ``overrides`` > the checkpoint's generation_config.json >
        transformers' defaults (``DiffusionGemmaGenerationConfig._get_default_generation_params``)."""
        config, extra = lm.base_model(self.model)._prepare_generation_config(None, **overrides)
        if extra:
            raise FlowRLError(f"unknown DiffusionGemma generation setting(s) {', '.join(sorted(extra))}.")
        return config

    def session(self, prompt_ids: Tensor, prompt_mask: Tensor) -> BlockSession:
        """A block loop over these prompts, on the policy (or, inside :meth:`reference`, the reference) weights."""
        return BlockSession(lm.base_model(self.active_model()), prompt_ids, prompt_mask)


def load_diffusion_gemma(
    pretrained: str,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    lora: Mapping[str, Any] | None = None,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
) -> DiffusionGemmaLM:
    """Load a DiffusionGemma checkpoint (a directory or hub id) with transformers' own class; every failure is one
    sentence. ``model`` / ``tokenizer``: already in memory, used instead of loading ``pretrained``."""
    try:
        from transformers import DiffusionGemmaForBlockDiffusion
    except ImportError:
        raise FlowRLError("pipeline.name diffusion_gemma needs a transformers with DiffusionGemma (5.24 or later).") from None
    dtype, device = lm.torch_dtype(dtype), lm.torch_device(device)
    if model is None:
        model = _load_checkpoint(DiffusionGemmaForBlockDiffusion, pretrained, dtype, device)
    elif not isinstance(lm.base_model(model), DiffusionGemmaForBlockDiffusion):
        raise FlowRLError(f"pipeline diffusion_gemma needs a DiffusionGemmaForBlockDiffusion, got {type(lm.base_model(model)).__name__}.")
    model = model.to(device=device, dtype=dtype)
    if tokenizer is None:
        tokenizer = lm.load_tokenizer(pretrained)
    inner = lm.base_model(model).model.encoder
    for part in (inner.vision_tower, inner.embed_vision):  # text prompts never reach them
        part.requires_grad_(False)
    if lora is not None:
        model = lm.attach_lora(model, lora, DEFAULT_LORA_TARGETS, "diffusion_gemma")
        tie_encoder_adapters(model)
    return DiffusionGemmaLM(model, tokenizer)


def _load_checkpoint(model_class: type, pretrained: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The checkpoint's model, once its config (read without running code) says it is a DiffusionGemma."""
    config = lm.config_dict(pretrained)
    if config.get("model_type") != "diffusion_gemma":
        raise FlowRLError(
            f"the model '{pretrained}' is a '{config.get('model_type')}' model, not diffusion_gemma (DiffusionGemmaForBlockDiffusion)."
        )
    try:
        return model_class.from_pretrained(pretrained, **lm.from_pretrained_kwargs(dtype, device))
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
        raise FlowRLError(f"could not load the DiffusionGemma model in '{pretrained}': {lm.first_line(e)}") from None


def tie_encoder_adapters(model: torch.nn.Module) -> int:
    """Make every LoRA-wrapped encoder layer use its tied decoder layer's adapter modules (one adapter per tied
    weight; a loaded adapter's encoder copies, equal to the decoder's, are replaced the same way). Returns the count."""
    inner = lm.base_model(model).model
    tied = 0
    for name, module in inner.encoder.language_model.layers.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        twin = inner.decoder.layers.get_submodule(name)
        for part in ("lora_A", "lora_B", "lora_dropout"):
            setattr(module, part, getattr(twin, part))
        tied += 1
    return tied


def write_tiny_random(directory: str | Path, seed: int = 0) -> Path:
    """A 2-layer random-weight DiffusionGemma (real classes, canvas of 8 tokens, 2 experts) with the embedded
    arithmetic tokenizer, written with ``save_pretrained``: the plumbing preset's and the tests' model."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    directory = Path(directory)
    tokenizer_dir = EMBEDDED_LMS["arith_mdlm"]
    vocab = 75  # the arithmetic tokenizer's: [PAD] 0, [UNK] 1, [MASK] 2 (an ordinary token here), [EOS] 3
    config = DiffusionGemmaConfig(
        text_config=dict(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            global_head_dim=16,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            num_experts=2,
            top_k_experts=2,
            moe_intermediate_size=16,
            pad_token_id=0,
            eos_token_id=3,
            bos_token_id=None,
        ),
        vision_config=dict(
            model_type="gemma4_vision",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            position_embedding_size=64,
        ),
        canvas_length=8,
        boi_token_id=vocab - 3,
        eoi_token_id=vocab - 2,
        image_token_id=vocab - 1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DiffusionGemmaForBlockDiffusion(config)
    model.generation_config.eos_token_id = 3  # generate stops a row at [EOS] and pads after it, as a real checkpoint's
    model.generation_config.pad_token_id = 0
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory


class DiffusionGemmaPipelineConfig(PipelineSection):
    """``pipeline.name: diffusion_gemma``: transformers' DiffusionGemmaForBlockDiffusion (no remote code), sampled
    by ``sampler.name: entropy_bound``."""

    name: str = "diffusion_gemma"
    pretrained: str = Field(
        TINY_RANDOM, description="A directory, a hub id, or diffusion_gemma_tiny_random (random weights: plumbing tests only)."
    )
    device: DeviceSpec = "auto"
    dtype: ModelDtype = "float32"
    lora: OptionalLora = None
    prompt_length: PromptLength = Field(None, ge=1)
    modality: ClassVar[str] = "text"

    def check_run(self, config: Any) -> None:
        if config.sampler.name != "entropy_bound":
            raise ValueError(f"pipeline diffusion_gemma samples with sampler.name entropy_bound, not '{config.sampler.name}'")

    def build(self, device: Any, loaded: Any = None) -> DiffusionGemmaLM:
        model, tokenizer = loaded if isinstance(loaded, (tuple, list)) else (loaded, None)
        lora = self.lora.model_dump() if self.lora else None
        if self.pretrained == TINY_RANDOM and model is None:
            with tempfile.TemporaryDirectory() as tmp:  # written and loaded back through the same path as a checkpoint
                return load_diffusion_gemma(str(write_tiny_random(tmp)), self.dtype, device, lora)
        return load_diffusion_gemma(self.pretrained, self.dtype, device, lora, model=model, tokenizer=tokenizer)

    def default_num_threads(self) -> int | None:
        return 1 if self.pretrained == TINY_RANDOM else None

    def probe_samples(self, n: int) -> list[str]:
        return ["" for _ in range(n)]
