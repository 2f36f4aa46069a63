"""Wan2.1 and Wan2.2 text-to-video and image-to-video: WanTransformer3DModel (one, or Wan2.2's two experts) +
UMT5 + AutoencoderKLWan.

Rectified flow (velocity = noise - x0, the FlowMatchEulerDiscreteScheduler convention), timestep =
sigma * num_train_timesteps. The default sampling grid is WanPipeline's for the checkpoint's scheduler: the
hub's UniPCMultistepScheduler (``flow_shift``: 3.0 for the 480p checkpoints, 5.0 is Wan's advice for 720p)
samples on ``shift(linspace(1, 1/T, K + 1)[:-1])`` (FlowSchedule's "unipc" grid; UniPC's 1 - 1e-6 first
sigma is kept at 1), a FlowMatchEulerDiscreteScheduler on its own ``set_timesteps(K)`` grid ("flow_match").
UniPC feeds the transformer ``int(sigma * 1000)`` (its timesteps are int64); flowrl feeds the float
``sigma * 1000``, which every flow sampler's step and re-scoring share. Latents are
(B, C, T_lat, H/s, W/s) with T_lat = (num_frames - 1) // 4 + 1 and s the VAE's spatial factor (8; 16 for
Wan2.2's VAE); ``decode`` gives (B, 3, T, H, W) in [0, 1].

Wan2.2 (docs/model_families/video.md):

* Two experts (T2V-A14B, I2V-A14B: ``transformer_2`` and ``boundary_ratio`` in model_index.json): the denoiser
  is :class:`WanExperts`, one module holding ``transformer`` (high noise) and ``transformer_2`` (low noise).
  Each call runs, row by row, the expert WanPipeline runs at that timestep (``t >= boundary_ratio *
  num_train_timesteps``: the high-noise one), so the rollout, re-scoring, the reference model, checkpoints and
  FSDP see one module and each step's log-prob comes from the expert that ran it. ``pipeline.train_experts``
  picks the trained experts, ``pipeline.guidance_scale_2`` the low-noise expert's CFG scale.
* TI2V-5B (``expand_timesteps``: one timestep per token; a 48-channel VAE with 16x spatial compression): text-
  to-video, or image-to-video where a prompt's ``metadata["image"]`` is given: the first latent frame of the
  model input is the image's latents and its tokens get timestep 0 (WanImageToVideoPipeline's TI2V branch).

``pipeline.name=wan pipeline.pretrained=Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` (T2V; also Wan2.2 T2V-A14B and
TI2V-5B) or ``pipeline.name=wan_i2v pipeline.pretrained=Wan-AI/Wan2.1-I2V-14B-480P-Diffusers`` (I2V, also Wan2.2
I2V-A14B and TI2V-5B: the first frame is ``metadata["image"]`` of each prompt, a path or a float (3, H, W)
tensor in [0, 1]).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from ..data.files import read_source_image
from ..errors import FlowRLError
from ..samplers.log_prob import as_sigma
from ..samplers.schedules import FLOW_GRIDS, FlowSchedule, config_default, sampling_grid
from ..types import Condition, cat_conditions
from .diffusers_base import DiffusersAdapter, PipelineConfig, _unwrap
from .guidance import rows_sigma
from .sd3 import flow_shift

try:  # torch >= 2.6; FSDP2's fully_shard turns a module into an FSDPModule
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - older torch: no FSDP2, nothing to keep in step
    FSDPModule = ()

# pipeline.train_experts names -> the pipeline's component (and state-dict prefix) of each Wan2.2 expert
EXPERTS = {"high": "transformer", "low": "transformer_2"}
# the diffusers LoRA file of each expert in a checkpoint: WanPipeline.load_lora_weights(dir) reads the first by
# default; the second goes in with weight_name=... and load_into_transformer_2=True
LORA_FILES = {"transformer": "pytorch_lora_weights.safetensors", "transformer_2": "pytorch_lora_weights_transformer_2.safetensors"}


def high_noise_rows(timestep: Tensor, boundary: float, integer_timesteps: bool = False) -> Tensor:
    """(B,) bool: the rows WanPipeline gives to its high-noise expert, ``t >= boundary_ratio * num_train_timesteps``.

    ``timestep``: (B,) or one per token (B, N), where a row's noise level is its largest (TI2V's given first frame
    is at 0). ``integer_timesteps``: the scheduler's timesteps are int64 (UniPC's ``int(sigma * T)``), so the
    pipeline compares their floor; the comparison is otherwise the pipeline's own (float32 tensor >= Python float).
    """
    t = timestep.float()
    if t.ndim > 1:
        t = t.flatten(1).amax(dim=1)
    if integer_timesteps:
        t = t.floor()
    return t >= boundary


class WanExperts(torch.nn.Module):
    """Wan2.2's two experts as the one denoiser flowrl trains: ``transformer`` (high noise) and ``transformer_2``
    (low noise), named as the pipeline's components, so state-dict keys read ``transformer.<...>`` and
    ``transformer_2.<...>``.

    ``forward`` takes WanTransformer3DModel's arguments and runs each row through the expert WanPipeline runs at
    that row's timestep (:func:`high_noise_rows`); a batch at one noise level (every sampler step) runs one expert
    on the whole batch, a batch of per-sample timesteps is split between the two. An expert with no row does not
    run, so its parameters get no gradient (``None``, not zeros: AdamW then leaves them, weight decay included,
    exactly as they were). In a multi-process run the processes keep in step (:meth:`_in_step`).
    """

    _supports_gradient_checkpointing = True
    # the trainer asks DDP to look for parameters without a gradient (find_unused_parameters): one expert per step
    may_leave_parameters_unused = True

    def __init__(
        self, transformer: torch.nn.Module, transformer_2: torch.nn.Module, boundary_timestep: float, integer_timesteps: bool = False
    ):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_timestep = float(boundary_timestep)
        self.integer_timesteps = bool(integer_timesteps)
        # the FSDP units (flowrl/training/distributed.py reads _no_split_modules): the experts' transformer blocks
        self._no_split_modules = list(getattr(transformer, "_no_split_modules", None) or [])

    @property
    def config(self) -> Any:
        """The high-noise expert's config; the two experts share their architecture (checked at load)."""
        return self.transformer.config

    def experts(self) -> dict[str, torch.nn.Module]:
        return {"transformer": self.transformer, "transformer_2": self.transformer_2}

    def with_lora(self) -> list[torch.nn.Module]:
        """The experts that carry a peft adapter (the trained ones of a LoRA run)."""
        return [e for e in self.experts().values() if getattr(e, "_hf_peft_config_loaded", False)]

    # -- what flowrl's adapter base calls on a denoiser (diffusers' ModelMixin names) ---------------
    @property
    def is_gradient_checkpointing(self) -> bool:
        return all(e.is_gradient_checkpointing for e in self.experts().values())

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.experts().values():
            expert.enable_gradient_checkpointing()

    def enable_xformers_memory_efficient_attention(self) -> None:
        for expert in self.experts().values():
            expert.enable_xformers_memory_efficient_attention()

    def disable_adapters(self) -> None:
        for expert in self.with_lora():
            expert.disable_adapters()

    def enable_adapters(self) -> None:
        for expert in self.with_lora():
            expert.enable_adapters()

    # -- the one denoiser call ------------------------------------------------------------------------
    def _in_step(self, needed: list[bool], device: torch.device) -> list[bool]:
        """Which experts run in this call: the ones with rows, and in a multi-process run also the ones another
        process needs, on a stand-in row whose output is dropped. Under FSDP running an expert all-gathers its
        blocks, a collective, so every process must run the same experts in the same order. Under DDP, with
        gradients on, a process whose rows all went to a frozen expert would otherwise skip a backward pass the
        others take (DDP all-reduces in each one): it runs the trained experts the others run (zero gradient)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return needed
        sharded = isinstance(self, FSDPModule)
        if not sharded and not torch.is_grad_enabled():  # DDP: only backward passes are collective
            return needed
        flags = torch.tensor([int(n) for n in needed], dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        anywhere = [bool(f) for f in flags.tolist()]
        if sharded:
            return anywhere
        trains = [any(p.requires_grad for p in e.parameters()) for e in (self.transformer, self.transformer_2)]
        return [n or (a and t) for n, a, t in zip(needed, anywhere, trains)]

    def forward(
        self,
        hidden_states: Tensor,
        timestep: Tensor,
        encoder_hidden_states: Tensor,
        encoder_hidden_states_image: Tensor | None = None,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> Any:
        batch = hidden_states.shape[0]
        high = high_noise_rows(timestep, self.boundary_timestep, self.integer_timesteps).to(hidden_states.device)
        rows = [torch.nonzero(high).flatten(), torch.nonzero(~high).flatten()]
        run = self._in_step([r.numel() > 0 for r in rows], hidden_states.device)
        inputs = {
            "hidden_states": hidden_states,
            "timestep": timestep,
            "encoder_hidden_states": encoder_hidden_states,
            "encoder_hidden_states_image": encoder_hidden_states_image,
        }
        parts, order = [], []
        for expert, index, needed in zip((self.transformer, self.transformer_2), rows, run):
            if not needed:
                continue
            if index.numel() == batch:  # one noise level for the whole batch (every sampler step): no gather
                part = inputs
            else:
                taken = index if index.numel() else index.new_zeros(1)  # kept in step with other processes: a stand-in row
                part = {k: None if v is None else v.index_select(0, taken.to(v.device)) for k, v in inputs.items()}
            out = expert(**part, return_dict=False, **kwargs)[0]
            parts.append(out[: index.numel()])
            order.append(index)
        if len(parts) == 1:
            sample = parts[0]
        else:  # back to the caller's row order
            sample = torch.cat(parts).index_select(0, torch.argsort(torch.cat(order)).to(parts[0].device))
        if return_dict:
            from diffusers.models.modeling_outputs import Transformer2DModelOutput

            return Transformer2DModelOutput(sample=sample)
        return (sample,)


class WanAdapter(DiffusersAdapter):
    lora_pipeline_class = "WanPipeline"
    # self- and cross-attention projections of every block (attn1 / attn2); diffusers' Wan LoRA default
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    default_size = (480, 832)  # WanPipeline's defaults (480p)
    default_num_frames = 81
    default_max_sequence_length = 512  # WanPipeline.__call__'s default
    requires_image = False  # a TI2V checkpoint under `wan`: a prompt's first frame is optional

    # -- loading --------------------------------------------------------------------------------
    def _model_index(self) -> dict[str, Any]:
        """model_index.json of the checkpoint (which components it has, and their classes)."""
        if not hasattr(self, "_index"):
            from diffusers import DiffusionPipeline

            self._index = self._read_config(DiffusionPipeline, None, "model_index.json")
        return self._index

    def _has(self, name: str) -> bool:
        entry = self._model_index().get(name)
        return isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[0] is not None

    def _component_class(self, name: str, default: str) -> Any:
        """The transformers class model_index.json names for a component (UMT5EncoderModel, CLIPVisionModel...)."""
        import transformers

        entry = self._model_index().get(name)
        cls_name = entry[1] if isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[1] else default
        return getattr(transformers, cls_name, getattr(transformers, default))

    def _load_components(self) -> None:
        from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler
        from transformers import AutoTokenizer

        index = self._model_index()
        self.expand_timesteps = bool(index.get("expand_timesteps", False))  # Wan2.2 TI2V-5B: one timestep per token
        self.tokenizer = self._load(AutoTokenizer, "tokenizer")
        self.text_encoder = self._load(self._component_class("text_encoder", "UMT5EncoderModel"), "text_encoder")
        # Wan decodes best in float32 (diffusers' advice); the VAE is small next to the transformer
        self.vae = self._load(AutoencoderKLWan, "vae", torch_dtype=torch.float32)
        # read as a plain config: hub checkpoints ship UniPCMultistepScheduler, only its shift matters here
        scheduler = self._read_config(FlowMatchEulerDiscreteScheduler, "scheduler", "the scheduler config")
        if scheduler.get("use_dynamic_shifting"):
            raise FlowRLError(f"the scheduler of '{self.source}' uses dynamic shifting, which the Wan adapter does not implement.")
        self.num_train_timesteps = int(scheduler.get("num_train_timesteps", 1000))
        self.schedule = self._schedule(scheduler)
        self.denoiser = self._load_denoiser(scheduler)
        self.prediction_type = "flow"
        self.vae_scale_factor_temporal = int(self.vae.config.scale_factor_temporal)
        self.vae_scale_factor_spatial = int(self.vae.config.scale_factor_spatial)
        self.latent_channels = int(self.vae.config.z_dim)
        self.max_sequence_length = self.config.max_sequence_length or self.default_max_sequence_length
        self.patch_size = tuple(self.denoiser.config.patch_size)  # kept: the denoiser may be wrapped (DDP) later
        z = self.latent_channels
        self._latents_mean = torch.tensor(self.vae.config.latents_mean, dtype=torch.float32).view(1, z, 1, 1, 1)
        self._latents_std = torch.tensor(self.vae.config.latents_std, dtype=torch.float32).view(1, z, 1, 1, 1)
        self._check_sizes()
        self._check_channels()
        if self.expand_timesteps:  # TI2V: the rollout hands each prompt's metadata (its optional first frame) to encode
            from diffusers.video_processor import VideoProcessor

            self.needs_metadata = True
            self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor_spatial)

    def _load_denoiser(self, scheduler: dict[str, Any]) -> torch.nn.Module:
        """The transformer, or Wan2.2's two experts as one :class:`WanExperts` (model_index.json's ``boundary_ratio``)."""
        from diffusers import WanTransformer3DModel

        cfg, ratio = self.config, self._model_index().get("boundary_ratio")
        requested = list(dict.fromkeys(cfg.train_experts or []))
        if ratio is None:  # Wan2.1, TI2V-5B; a transformer_2 without boundary_ratio never runs in WanPipeline either
            self.two_experts, self.trained_experts = False, ("transformer",)
            if "low" in requested or cfg.guidance_scale_2 is not None:
                key = "pipeline.train_experts" if "low" in requested else "pipeline.guidance_scale_2"
                raise FlowRLError(
                    f"{key} applies to Wan2.2's two-expert checkpoints, and '{self.source}' has a single transformer (no boundary_ratio)."
                )
            return self._load(WanTransformer3DModel, "transformer")
        missing = [n for n in EXPERTS.values() if not self._has(n)]
        if missing:
            raise FlowRLError(
                f"'{self.source}' sets boundary_ratio {ratio} but has no {' and no '.join(missing)}: "
                "flowrl needs both Wan2.2 experts (transformer: high noise, transformer_2: low noise)."
            )
        high = self._load(WanTransformer3DModel, "transformer")
        low = self._load(WanTransformer3DModel, "transformer_2")
        for key in ("in_channels", "out_channels", "patch_size", "image_dim", "text_dim"):
            if high.config.get(key) != low.config.get(key):
                raise FlowRLError(
                    f"the two experts of '{self.source}' differ in {key} ({high.config.get(key)} vs {low.config.get(key)}); "
                    "flowrl expects Wan2.2's pair of same-shaped transformers."
                )
        self.two_experts = True
        self.trained_experts = tuple(EXPERTS[e] for e in (requested or ["high", "low"]))
        # WanPipeline: boundary_timestep = boundary_ratio * scheduler.config.num_train_timesteps, against the
        # scheduler's timesteps, which UniPC (the hub checkpoints' scheduler) makes int64
        self.boundary_timestep = float(ratio) * self.num_train_timesteps
        self.integer_timesteps = scheduler.get("_class_name") == "UniPCMultistepScheduler"
        return WanExperts(high, low, self.boundary_timestep, self.integer_timesteps)

    def _schedule(self, scheduler: dict[str, Any]) -> FlowSchedule:
        """WanPipeline's default grid for the checkpoint's scheduler: the hub's UniPCMultistepScheduler (flow sigmas,
        ``flow_shift``) or a FlowMatchEulerDiscreteScheduler (``shift``); another scheduler needs an explicit
        ``pipeline.sampling_grid``, since flowrl cannot promise to reproduce its grid."""
        kind = scheduler.get("_class_name")
        if kind == "UniPCMultistepScheduler":
            if not config_default(scheduler, "use_flow_sigmas", False):
                raise FlowRLError(
                    f"the UniPC scheduler of '{self.source}' does not use flow sigmas (use_flow_sigmas), so it does not "
                    "describe a rectified-flow Wan model."
                )
            for option in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "shift_terminal"):
                if scheduler.get(option):
                    raise FlowRLError(
                        f"the scheduler option {option}={scheduler[option]!r} is not supported (flowrl samples on its own shifted sigma grid)."
                    )
            self.shift = float(config_default(scheduler, "flow_shift", 1.0))
            grid = sampling_grid(self.config, "unipc", FLOW_GRIDS)
        else:
            self.shift = flow_shift(scheduler, 0)  # refuses the options that reshape the grid
            default = "flow_match" if kind == "FlowMatchEulerDiscreteScheduler" else None
            grid = sampling_grid(self.config, default, FLOW_GRIDS)
            if grid is None:
                raise FlowRLError(
                    f"the scheduler of '{self.source}' is a {kind}, whose sampling grid flowrl does not reproduce; "
                    "set pipeline.sampling_grid (unipc, flow_match, linspace or flux)."
                )
        return FlowSchedule(shift=self.shift, grid=grid, num_train_timesteps=self.num_train_timesteps)

    def _check_channels(self) -> None:
        if self.denoiser.config.in_channels != self.latent_channels:
            raise FlowRLError(
                f"'{self.source}' is not a Wan text-to-video checkpoint (transformer in_channels {self.denoiser.config.in_channels}, "
                f"latent channels {self.latent_channels}); use pipeline.name=wan_i2v for image-to-video."
            )

    def num_frames(self) -> int:
        return self.config.num_frames or self.default_num_frames

    def _check_sizes(self) -> None:
        h, w = self.sample_size()
        multiple = self.vae_scale_factor_spatial * self.patch_size[1]
        if h % multiple or w % multiple:
            raise FlowRLError(f"pipeline.height and pipeline.width must be multiples of {multiple} for this Wan checkpoint (got {h}x{w}).")
        f, k = self.num_frames(), self.vae_scale_factor_temporal
        if (f - 1) % k:
            raise FlowRLError(
                f"pipeline.num_frames must be {k} * n + 1 for Wan (got {f}; e.g. {(f - 1) // k * k + 1} or {((f - 1) // k + 1) * k + 1})."
            )

    # -- training the experts (Wan2.2) ----------------------------------------------------------
    def _configure_denoiser(self) -> None:
        super()._configure_denoiser()
        if self.two_experts and not self.has_lora:  # full fine-tuning: only the chosen experts' weights train
            for name, expert in self.denoiser.experts().items():
                expert.requires_grad_(name in self.trained_experts)

    def _add_lora(self, lora) -> None:
        if not self.two_experts:
            super()._add_lora(lora)
            return
        # one adapter per trained expert; the other keeps no adapter at all
        self._add_lora_to([getattr(self.denoiser, name) for name in self.trained_experts], lora)

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """The LoRA weights, or (full fine-tuning) the whole denoiser; of two experts, the trained ones only."""
        weights = super().trainable_state_dict()
        if self.two_experts and not self.has_lora:
            prefixes = tuple(f"{name}." for name in self.trained_experts)
            weights = {k: v for k, v in weights.items() if k.startswith(prefixes)}
        return weights

    def load_trainable_state_dict(self, weights: dict[str, Tensor]) -> None:
        if not (self.two_experts and not self.has_lora):
            super().load_trainable_state_dict(weights)
            return
        expected = set(self.trainable_state_dict())
        if set(weights) != expected:
            raise RuntimeError(f"expert keys differ ({len(set(weights) ^ expected)} mismatched, e.g. {sorted(set(weights) ^ expected)[0]})")
        _unwrap(self.denoiser).load_state_dict(weights, strict=False)

    def save_lora(self, directory: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """Two experts: one diffusers LoRA file per trained expert (:data:`LORA_FILES`), each written by
        ``<Pipeline>.save_lora_weights`` with ``transformer.`` keys, as ``load_lora_weights`` reads them (the
        low-noise one with ``load_into_transformer_2=True``). Returns the first file written."""
        if not self.two_experts:
            return super().save_lora(directory, state_dict)
        if not self.has_lora:
            raise FlowRLError("save_lora needs a LoRA run (pipeline.lora is not set).")
        import diffusers
        from peft.utils import get_peft_model_state_dict

        model = _unwrap(self.denoiser)
        pipeline_cls = getattr(diffusers, self.lora_pipeline_class)
        paths = []
        for name in self.trained_experts:
            expert = getattr(model, name)
            part = None if state_dict is None else {k[len(name) + 1 :]: v for k, v in state_dict.items() if k.startswith(f"{name}.")}
            pipeline_cls.save_lora_weights(
                str(directory),
                transformer_lora_layers=get_peft_model_state_dict(expert, state_dict=part),
                transformer_lora_adapter_metadata=expert.peft_config["default"].to_dict(),
                weight_name=LORA_FILES[name],
                safe_serialization=True,
            )
            paths.append(Path(directory) / LORA_FILES[name])
        return paths[0]

    def merged_denoiser(self) -> torch.nn.Module:
        if not self.two_experts:
            return super().merged_denoiser()
        model = copy.deepcopy(_unwrap(self.denoiser))
        for expert in model.with_lora():
            expert.fuse_lora(lora_scale=1.0)
            expert.unload_lora()
        return model.to(self.dtype)

    def merged_components(self) -> dict[str, torch.nn.Module]:
        """An export writes both experts, each under its own component name."""
        if not self.two_experts:
            return super().merged_components()
        return self.merged_denoiser().experts()

    # -- conditioning ---------------------------------------------------------------------------
    def _encode_prompts(self, prompts: list[str]) -> Condition:
        """UMT5 hidden states, zeroed after each prompt's real tokens (WanPipeline._get_t5_prompt_embeds)."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        n = self.max_sequence_length
        inputs = self.tokenizer(
            [prompt_clean(p) for p in prompts],
            padding="max_length",
            max_length=n,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        with self._frozen_on_device(self.text_encoder):
            device = self.text_encoder.device
            hidden = self.text_encoder(inputs.input_ids.to(device), inputs.attention_mask.to(device)).last_hidden_state
        lengths = inputs.attention_mask.gt(0).sum(dim=1).to(hidden.device)
        real = torch.arange(n, device=hidden.device)[None, :] < lengths[:, None]
        hidden = torch.where(real[..., None], hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device))
        return {"prompt_embeds": hidden.float()}

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None) -> Condition:
        """Text embeddings (cached per prompt); for a TI2V checkpoint also each prompt's first frame, if any."""
        text = DiffusersAdapter.encode(self, prompts)
        if not self.expand_timesteps:
            return text
        return {**text, **self._first_frames(len(prompts), metadata)}

    def _missing_image(self) -> FlowRLError:
        return FlowRLError(
            f"{self.config.name} needs a conditioning image per prompt: metadata['image'] (a path or a (3, H, W) tensor in [0, 1]), "
            'e.g. from a .jsonl prompt file with an "image" key.'
        )

    @staticmethod
    def _image_key(image: Any) -> Any:
        """Within one encode call each distinct image is encoded once: a path by its value, an object by identity."""
        return image if isinstance(image, (str, bytes)) or hasattr(image, "__fspath__") else id(image)

    def _first_frames(self, n: int, metadata: Sequence[dict[str, Any]] | None) -> Condition:
        """TI2V's image condition: ``first_frame`` (B, C, 1, h, w), the normalised VAE latents of each prompt's
        ``metadata["image"]`` (zeros where there is none), and ``first_frame_given`` (B,), 1 where there is one.
        Not cached across calls (an image dataset would grow it without bound); one encode per distinct image."""
        metadata = [{}] * n if metadata is None else list(metadata)
        if len(metadata) != n or (self.requires_image and any(m.get("image") is None for m in metadata)):
            raise self._missing_image()
        c, _, h, w = self.latent_shape()
        done: dict[Any, Tensor] = {}
        frames, given = [], []
        for m in metadata:
            image = m.get("image")
            if image is None:  # text-to-video for this prompt
                frames.append(torch.zeros(1, c, 1, h, w, device=self.device))
                given.append(0.0)
                continue
            key = self._image_key(image)
            if key not in done:
                done[key] = self._encode_first_frame(image)
            frames.append(done[key])
            given.append(1.0)
        return {"first_frame": torch.cat(frames), "first_frame_given": torch.tensor(given, device=self.device)}

    @torch.no_grad()
    def _encode_first_frame(self, image: Any) -> Tensor:
        """WanImageToVideoPipeline.prepare_latents with expand_timesteps: the image alone (one frame) through the
        VAE (distribution mode), normalised by latents_mean / latents_std: (1, C, 1, h, w)."""
        height, width = self.sample_size()
        pixels = self.video_processor.preprocess(read_source_image(image), height=height, width=width).float()  # (1, 3, H, W) in [-1, 1]
        with self._frozen_on_device(self.vae):
            latents = self.vae.encode(pixels[:, :, None].to(self.vae.device, self.vae.dtype)).latent_dist.mode().float()
        latents = (latents - self._latents_mean.to(latents.device)) * (1.0 / self._latents_std.to(latents.device))
        return latents.to(self.device)

    def unconditional(self, batch: int, cond: Condition | None = None) -> Condition:
        """The empty prompt, keeping the conditional branch's image parts (a TI2V first frame), as the pipelines do."""
        empty = DiffusersAdapter.encode(self, [""])  # text only (the cached empty prompt)
        text = {k: v.expand(batch, *v.shape[1:]) for k, v in empty.items()}
        if cond is None:
            return text
        return {**text, **{k: v for k, v in cond.items() if k not in text}}

    # -- denoising ------------------------------------------------------------------------------
    def timestep(self, sigma: Tensor) -> Tensor:
        """The only sigma -> transformer timestep conversion of this family (float, in [0, 1000])."""
        return sigma.float() * self.num_train_timesteps

    def _timesteps(self, sigma: Tensor, x: Tensor, cond: Condition | None = None) -> Tensor:
        """(B,), or for ``expand_timesteps`` (B, tokens) with a given first frame's tokens at 0 (WanPipeline /
        WanImageToVideoPipeline: ``first_frame_mask[:, ::2, ::2] * t``, frame-major tokens)."""
        t = self.timestep(sigma).to(self.device).reshape(-1)
        b = x.shape[0]
        if t.numel() not in (1, b) and b % t.numel() == 0:  # a per-sample sigma with CFG's doubled batch
            t = t.repeat(b // t.numel())
        t = t.expand(b)
        if self.expand_timesteps:
            _, p_h, p_w = self.patch_size
            per_frame = (x.shape[3] // p_h) * (x.shape[4] // p_w)
            t = t[:, None].expand(-1, x.shape[2] * per_frame)
            given = None if cond is None else cond.get("first_frame_given")
            if given is not None and bool(given.any()):
                first = torch.arange(t.shape[1], device=t.device) < per_frame
                t = torch.where(given.to(t.device).bool()[:, None] & first[None], torch.zeros((), device=t.device), t)
        return t

    def _model_input(self, x: Tensor, cond: Condition) -> Tensor:
        """TI2V: the first latent frame replaced by the given image's latents (float32, before the model's dtype)."""
        if not self.expand_timesteps or "first_frame" not in cond:
            return x
        given = cond["first_frame_given"].to(x.device).bool().view(-1, 1, 1, 1, 1)
        first = torch.where(given, cond["first_frame"].to(x.device, x.dtype), x[:, :, :1])
        return torch.cat([first, x[:, :, 1:]], dim=2)

    def _forward(self, model, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float) -> Tensor:
        image = cond.get("image_embeds")
        return model(
            hidden_states=self._model_input(x, cond).to(self.model_dtype),
            timestep=self._timesteps(sigma, x, cond),
            encoder_hidden_states=cond["prompt_embeds"].to(self.model_dtype),
            encoder_hidden_states_image=None if image is None else image.to(self.model_dtype),
            return_dict=False,
        )[0]

    def predict(self, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float = 1.0) -> Tensor:
        """Model output with guidance: two experts guide with their own scales (``guidance_scale`` the high-noise
        expert's, ``pipeline.guidance_scale_2`` the low-noise one's, as WanPipeline; no CFG at all when
        ``guidance_scale`` is 1). A TI2V first frame gets the velocity that lands it on the image's latents."""
        out = self._guided(x, sigma, cond, guidance_scale)
        if self.expand_timesteps and "first_frame" in cond:
            out = self._pin_first_frame(out, x, sigma, cond)
        return out

    def _guided(self, x: Tensor, sigma: Tensor, cond: Condition, scale: float) -> Tensor:
        low_scale = getattr(self.config, "guidance_scale_2", None)
        if not self.two_experts or low_scale is None or low_scale == scale or scale == 1.0 or self.guidance_mode == "embedded":
            return super().predict(x, sigma, cond, scale)
        sigma = torch.as_tensor(sigma, device=self.device, dtype=torch.float32)
        t = self.timestep(sigma).reshape(-1).expand(x.shape[0])
        high = high_noise_rows(t, self.boundary_timestep, self.integer_timesteps)
        if bool(high.all()):
            return super().predict(x, sigma, cond, scale)
        if not bool(high.any()):
            return super().predict(x, sigma, cond, low_scale)
        # a per-sample sigma with rows on both sides of the boundary: each row guided by its own expert's scale
        model = self._reference if self._reference is not None and self._use_reference else self.denoiser
        uncond = self.unconditional(x.shape[0], cond)
        per_row = torch.where(high, scale, low_scale).to(x.device).view(-1, *([1] * (x.ndim - 1)))
        if self.guidance_mode == "cfg_detached_uncond":
            with torch.no_grad():
                u = self._forward(model, x, sigma, uncond, scale).float()
            c = self._forward(model, x, sigma, cond, scale).float()
        else:
            both = rows_sigma(sigma, 2 * x.shape[0])
            c, u = self._forward(model, torch.cat([x, x]), both, cat_conditions([cond, uncond]), scale).float().chunk(2)
        return u + per_row * (c - u)

    def _pin_first_frame(self, out: Tensor, x: Tensor, sigma: Tensor, cond: Condition) -> Tensor:
        """Rows with a given first frame: that frame's velocity becomes ``(x - image latents) / sigma``, whose
        ``x0_hat`` is the image latents. The model never denoises that frame (its input is the image at timestep 0,
        and WanImageToVideoPipeline throws its prediction there away), so its transition no longer depends on the
        weights: no log-prob gradient, the same density when re-scored, and the trajectory ends on the image."""
        given = cond["first_frame_given"].to(out.device).bool().view(-1, 1, 1, 1, 1)
        if not bool(given.any()):
            return out
        s = as_sigma(sigma, x)
        first = x[:, :, :1].float()
        pinned = torch.where(s > 0, (first - cond["first_frame"].to(first)) / torch.where(s > 0, s, torch.ones_like(s)), 0.0)
        return torch.cat([torch.where(given, pinned, out[:, :, :1]), out[:, :, 1:]], dim=2)

    def latent_shape(self) -> tuple[int, ...]:
        h, w = self.sample_size()
        frames = (self.num_frames() - 1) // self.vae_scale_factor_temporal + 1
        return (self.latent_channels, frames, h // self.vae_scale_factor_spatial, w // self.vae_scale_factor_spatial)

    def decode(self, x: Tensor) -> Tensor:  # differentiable (reward gradients); samplers call it under no_grad
        """(B, C, T_lat, h, w) latents -> (B, 3, T, H, W) float32 video in [0, 1], one sample at a time."""
        videos = []
        with self._frozen_on_device(self.vae):
            mean, std = self._latents_mean.to(self.vae.device), self._latents_std.to(self.vae.device)
            for latents in x.split(1):
                latents = latents.to(self.vae.device, torch.float32) * std + mean  # undo (z - mean) / std
                videos.append(self.vae.decode(latents.to(self.vae.dtype)).sample.float().to(self.device))
        return ((torch.cat(videos) + 1) / 2).clamp(0, 1)


class WanImageToVideoAdapter(WanAdapter):
    """Image-to-video: the first frame comes from each prompt's ``metadata["image"]``.

    Wan2.1 I2V (and Wan2.2 I2V-A14B): the condition holds the text embeddings, the VAE-encoded first frame
    followed by zero frames with the 4 mask channels in front (``condition``, concatenated to the latents on the
    channel axis), and the CLIP image embeddings (``image_embeds``, when the checkpoint has an image encoder;
    Wan2.1 does, Wan2.2 does not). Wan2.2 TI2V-5B (``expand_timesteps``): the first frame's latents replace the
    first latent frame of the model input (:class:`WanAdapter`'s TI2V path, with an image required). The condition
    is stored in the trajectory, so training re-scores with exactly the condition of the rollout. The
    unconditional CFG branch keeps the image and drops the text, as WanImageToVideoPipeline does.
    """

    lora_pipeline_class = "WanImageToVideoPipeline"
    needs_metadata = True
    requires_image = True

    def _load_components(self) -> None:
        super()._load_components()
        self.image_encoder = self.image_processor = None
        if self.expand_timesteps:  # TI2V: no CLIP, the image enters through the latents
            return
        from diffusers.video_processor import VideoProcessor

        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor_spatial)
        if self._has("image_encoder") and self.denoiser.config.image_dim is not None:
            from transformers import CLIPImageProcessor

            self.image_encoder = self._load(
                self._component_class("image_encoder", "CLIPVisionModel"), "image_encoder", torch_dtype=torch.float32
            )
            self.image_processor = self._load(CLIPImageProcessor, "image_processor")
        elif self.denoiser.config.image_dim is not None:
            raise FlowRLError(f"the transformer of '{self.source}' takes CLIP image embeddings but the checkpoint has no image_encoder.")

    def _check_channels(self) -> None:
        if self.expand_timesteps:  # TI2V-5B: one model for both, the latents' own channels
            super()._check_channels()
            return
        expected = 2 * self.latent_channels + self.vae_scale_factor_temporal  # latents + mask + first-frame latents
        if self.denoiser.config.in_channels != expected:
            raise FlowRLError(
                f"'{self.source}' is not a Wan image-to-video checkpoint (transformer in_channels "
                f"{self.denoiser.config.in_channels}, expected {expected}); use pipeline.name=wan."
            )

    # -- conditioning ---------------------------------------------------------------------------
    @torch.no_grad()
    def _encode_image(self, image: Any) -> Condition:
        """One conditioning image -> {"condition": (1, 4 + C, T_lat, h, w), "image_embeds": (1, N, D)}."""
        img = read_source_image(image)
        height, width = self.sample_size()
        out: Condition = {}
        if self.image_encoder is not None:  # WanImageToVideoPipeline.encode_image
            extra = {"do_rescale": False} if isinstance(img, Tensor) else {}
            pixels = self.image_processor(images=img, return_tensors="pt", **extra).pixel_values
            with self._frozen_on_device(self.image_encoder):
                hidden = self.image_encoder(
                    pixel_values=pixels.to(self.image_encoder.device, self.image_encoder.dtype), output_hidden_states=True
                ).hidden_states[-2]
            out["image_embeds"] = hidden.float().to(self.device)
        # WanImageToVideoPipeline.prepare_latents: the first frame, then zeros, through the VAE (mode)
        first = self.video_processor.preprocess(img, height=height, width=width).float()  # (1, 3, H, W) in [-1, 1]
        video = torch.cat([first[:, :, None], first.new_zeros(1, 3, self.num_frames() - 1, height, width)], dim=2)
        with self._frozen_on_device(self.vae):
            latents = self.vae.encode(video.to(self.vae.device, self.vae.dtype)).latent_dist.mode().float()
        latents = (latents - self._latents_mean.to(latents.device)) * (1.0 / self._latents_std.to(latents.device))
        mask = torch.zeros(1, self.vae_scale_factor_temporal, *latents.shape[2:], device=latents.device)
        mask[:, :, 0] = 1  # the first latent frame is given, the others are generated
        out["condition"] = torch.cat([mask, latents], dim=1).to(self.device)
        return out

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None) -> Condition:
        """Text embeddings (cached per prompt) + the image condition of each sample.

        The image part is not cached across calls (it is a VAE encode of the whole clip, tens of MB per image
        at 81 frames); within one call each distinct image (path, or tensor object) is encoded once, so a
        GRPO group sharing an image costs one encode.
        """
        if self.expand_timesteps:
            return super().encode(prompts, metadata)
        text = DiffusersAdapter.encode(self, prompts)
        if metadata is None or len(metadata) != len(prompts) or any("image" not in m for m in metadata):
            raise self._missing_image()
        done: dict[Any, Condition] = {}
        parts = []
        for m in metadata:
            key = self._image_key(m["image"])
            if key not in done:
                done[key] = self._encode_image(m["image"])
            parts.append(done[key])
        return {**text, **cat_conditions(parts)}

    def unconditional(self, batch: int, cond: Condition | None = None) -> Condition:
        """The empty prompt with the same image condition as the conditional branch being guided."""
        if cond is None:
            raise FlowRLError("wan_i2v's unconditional branch needs the conditional branch's image condition.")
        return super().unconditional(batch, cond)

    # -- denoising ------------------------------------------------------------------------------
    def _model_input(self, x: Tensor, cond: Condition) -> Tensor:
        if self.expand_timesteps:
            return super()._model_input(x, cond)
        return torch.cat([x, cond["condition"].to(x.dtype)], dim=1)


class _WanSection(PipelineConfig):
    """The fields every Wan section adds (Wan2.2's two experts)."""

    # An expert left out keeps no adapter and never changes.
    train_experts: list[Literal["high", "low"]] | None = Field(
        None,
        min_length=1,
        description="Wan2.2 A14B: which experts train (high: transformer, the steps with t >= boundary_ratio * T; low: transformer_2); "
        "None: both.",
    )
    guidance_scale_2: float | None = Field(
        None, ge=0, description="Wan2.2 A14B: the CFG scale of the low-noise expert; None: rollout.guidance_scale."
    )


class WanConfig(_WanSection):
    """``pipeline.name: wan`` (Wan2.1 / Wan2.2 text-to-video; TI2V-5B also from a prompt's image)."""

    name: str = "wan"
    adapter: ClassVar[Any] = WanAdapter

    def probe_samples(self, n: int) -> Any:
        return torch.rand(n, 3, 2, 32, 32, generator=torch.Generator().manual_seed(0))  # (B, C, T, H, W): two small frames


class WanImageToVideoConfig(_WanSection):
    """``pipeline.name: wan_i2v`` (Wan2.1 / Wan2.2 image-to-video: the first frame from metadata.image)."""

    name: str = "wan_i2v"
    adapter: ClassVar[Any] = WanImageToVideoAdapter

    def probe_samples(self, n: int) -> Any:
        return torch.rand(n, 3, 2, 32, 32, generator=torch.Generator().manual_seed(0))  # (B, C, T, H, W): two small frames
