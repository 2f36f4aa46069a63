"""Wan2.1 text-to-video and image-to-video: WanTransformer3DModel + UMT5 + AutoencoderKLWan.

Rectified flow (velocity = noise - x0, the FlowMatchEulerDiscreteScheduler convention), timestep =
sigma * num_train_timesteps. The default sampling grid is WanPipeline's for the checkpoint's scheduler: the
hub's UniPCMultistepScheduler (``flow_shift``: 3.0 for the 480p checkpoints, 5.0 is Wan's advice for 720p)
samples on ``shift(linspace(1, 1/T, K + 1)[:-1])`` (FlowSchedule's "unipc" grid; UniPC's 1 - 1e-6 first
sigma is kept at 1), a FlowMatchEulerDiscreteScheduler on its own ``set_timesteps(K)`` grid ("flow_match").
UniPC feeds the transformer ``int(sigma * 1000)`` (its timesteps are int64); flowrl feeds the float
``sigma * 1000``, which every flow sampler's step and re-scoring share. Latents are
(B, C, T_lat, H/8, W/8) with T_lat = (num_frames - 1) // 4 + 1; ``decode`` gives (B, 3, T, H, W) in [0, 1].

``pipeline.name=wan pipeline.pretrained=Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` (T2V) or
``pipeline.name=wan_i2v pipeline.pretrained=Wan-AI/Wan2.1-I2V-14B-480P-Diffusers`` (I2V: the first frame is
``metadata["image"]`` of each prompt, a path or a float (3, H, W) tensor in [0, 1]).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..errors import FlowRLError
from ..samplers.schedules import FLOW_GRIDS, FlowSchedule, config_default, sampling_grid
from ..types import Condition, cat_conditions
from .diffusers_base import DiffusersAdapter, PipelineConfig
from .sd3 import flow_shift


class WanAdapter(DiffusersAdapter):
    lora_pipeline_class = "WanPipeline"
    # self- and cross-attention projections of every block (attn1 / attn2); diffusers' Wan LoRA default
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    default_size = (480, 832)  # WanPipeline's defaults (480p)
    default_num_frames = 81
    default_max_sequence_length = 512  # WanPipeline.__call__'s default

    # -- loading --------------------------------------------------------------------------------
    def _model_index(self) -> dict[str, Any]:
        """model_index.json of the checkpoint (which components it has, and their classes)."""
        if not hasattr(self, "_index"):
            from diffusers import DiffusionPipeline

            self._index = self._read_config(DiffusionPipeline, None, "model_index.json")
        return self._index

    def _component_class(self, name: str, default: str) -> Any:
        """The transformers class model_index.json names for a component (UMT5EncoderModel, CLIPVisionModel...)."""
        import transformers

        entry = self._model_index().get(name)
        cls_name = entry[1] if isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[1] else default
        return getattr(transformers, cls_name, getattr(transformers, default))

    def _load_components(self) -> None:
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from transformers import AutoTokenizer

        index = self._model_index()
        if index.get("transformer_2", [None, None])[0] is not None or index.get("boundary_ratio") is not None:
            raise FlowRLError(
                f"'{self.source}' is a two-expert Wan2.2 checkpoint (transformer_2); flowrl trains single-transformer Wan checkpoints only."
            )
        self.expand_timesteps = bool(index.get("expand_timesteps", False))  # Wan2.2 TI2V-5B: one timestep per token
        self.tokenizer = self._load(AutoTokenizer, "tokenizer")
        self.text_encoder = self._load(self._component_class("text_encoder", "UMT5EncoderModel"), "text_encoder")
        # Wan decodes best in float32 (diffusers' advice); the VAE is small next to the transformer
        self.vae = self._load(AutoencoderKLWan, "vae", torch_dtype=torch.float32)
        self.denoiser = self._load(WanTransformer3DModel, "transformer")
        from diffusers import FlowMatchEulerDiscreteScheduler

        # read as a plain config: hub checkpoints ship UniPCMultistepScheduler, only its shift matters here
        scheduler = self._read_config(FlowMatchEulerDiscreteScheduler, "scheduler", "the scheduler config")
        if scheduler.get("use_dynamic_shifting"):
            raise FlowRLError(f"the scheduler of '{self.source}' uses dynamic shifting, which the Wan adapter does not implement.")
        self.num_train_timesteps = int(scheduler.get("num_train_timesteps", 1000))
        self.schedule = self._schedule(scheduler)
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

    # -- denoising ------------------------------------------------------------------------------
    def timestep(self, sigma: Tensor) -> Tensor:
        """The only sigma -> transformer timestep conversion of this family (float, in [0, 1000])."""
        return sigma.float() * self.num_train_timesteps

    def _timesteps(self, sigma: Tensor, x: Tensor) -> Tensor:
        t = self.timestep(sigma).to(self.device).expand(x.shape[0])
        if self.expand_timesteps:  # Wan2.2 TI2V: (B, tokens), all equal for text-to-video
            _, p_h, p_w = self.patch_size
            tokens = x.shape[2] * (x.shape[3] // p_h) * (x.shape[4] // p_w)
            t = t[:, None].expand(-1, tokens)
        return t

    def _model_input(self, x: Tensor, cond: Condition) -> Tensor:
        return x

    def _forward(self, model, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float) -> Tensor:
        image = cond.get("image_embeds")
        return model(
            hidden_states=self._model_input(x, cond).to(self.model_dtype),
            timestep=self._timesteps(sigma, x),
            encoder_hidden_states=cond["prompt_embeds"].to(self.model_dtype),
            encoder_hidden_states_image=None if image is None else image.to(self.model_dtype),
            return_dict=False,
        )[0]

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
    """Wan2.1 I2V: the first frame comes from each prompt's ``metadata["image"]``.

    The condition holds the text embeddings, the VAE-encoded first frame followed by zero frames with the
    4 mask channels in front (``condition``, concatenated to the latents on the channel axis), and the CLIP
    image embeddings (``image_embeds``, when the checkpoint has an image encoder; Wan2.1 does). It is
    stored in the trajectory, so training re-scores with exactly the condition of the rollout. The
    unconditional CFG branch keeps the image and drops the text, as WanImageToVideoPipeline does.
    """

    lora_pipeline_class = "WanImageToVideoPipeline"
    needs_metadata = True

    def _load_components(self) -> None:
        super()._load_components()
        if self.expand_timesteps:
            raise FlowRLError(
                f"'{self.source}' is a Wan2.2 TI2V checkpoint (expand_timesteps), whose first-frame conditioning wan_i2v does not implement."
            )
        from diffusers.video_processor import VideoProcessor

        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor_spatial)
        entry = self._model_index().get("image_encoder")
        self.image_encoder = self.image_processor = None
        if isinstance(entry, (list, tuple)) and entry[0] is not None and self.denoiser.config.image_dim is not None:
            from transformers import CLIPImageProcessor

            self.image_encoder = self._load(
                self._component_class("image_encoder", "CLIPVisionModel"), "image_encoder", torch_dtype=torch.float32
            )
            self.image_processor = self._load(CLIPImageProcessor, "image_processor")
        elif self.denoiser.config.image_dim is not None:
            raise FlowRLError(f"the transformer of '{self.source}' takes CLIP image embeddings but the checkpoint has no image_encoder.")

    def _check_channels(self) -> None:
        expected = 2 * self.latent_channels + self.vae_scale_factor_temporal  # latents + mask + first-frame latents
        if self.denoiser.config.in_channels != expected:
            raise FlowRLError(
                f"'{self.source}' is not a Wan image-to-video checkpoint (transformer in_channels "
                f"{self.denoiser.config.in_channels}, expected {expected}); use pipeline.name=wan."
            )

    # -- conditioning ---------------------------------------------------------------------------
    @staticmethod
    def _read_image(image: Any):
        """A PIL image (from a path or given) or a (1, 3, H, W) float tensor in [0, 1]."""
        import PIL.Image

        if isinstance(image, PIL.Image.Image):
            return image.convert("RGB")
        if isinstance(image, Tensor):
            if image.ndim != 3 or image.shape[0] != 3:
                raise FlowRLError(f"metadata['image'] tensors must be (3, H, W) in [0, 1], got shape {tuple(image.shape)}.")
            return image.detach().float().cpu().clamp(0, 1)[None]
        try:
            with PIL.Image.open(image) as img:
                return img.convert("RGB")
        except (OSError, TypeError, AttributeError) as e:
            raise FlowRLError(
                f"could not read the conditioning image {str(image)[:120]!r}: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}"
            ) from None

    @torch.no_grad()
    def _encode_image(self, image: Any) -> Condition:
        """One conditioning image -> {"condition": (1, 4 + C, T_lat, h, w), "image_embeds": (1, N, D)}."""
        img = self._read_image(image)
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
        text = super().encode(prompts)
        if metadata is None or len(metadata) != len(prompts) or any("image" not in m for m in metadata):
            raise FlowRLError(
                "wan_i2v needs a conditioning image per prompt: metadata['image'] (a path or a (3, H, W) tensor in [0, 1]), "
                'e.g. from a .jsonl prompt file with an "image" key.'
            )
        done: dict[Any, Condition] = {}
        parts = []
        for m in metadata:
            key = m["image"] if isinstance(m["image"], (str, bytes)) or hasattr(m["image"], "__fspath__") else id(m["image"])
            if key not in done:
                done[key] = self._encode_image(m["image"])
            parts.append(done[key])
        return {**text, **cat_conditions(parts)}

    def unconditional(self, batch: int, cond: Condition | None = None) -> Condition:
        """The empty prompt with the same image condition as the conditional branch being guided."""
        if cond is None:
            raise FlowRLError("wan_i2v's unconditional branch needs the conditional branch's image condition.")
        empty = DiffusersAdapter.encode(self, [""])  # text only (the cached empty prompt)
        text = {k: v.expand(batch, *v.shape[1:]) for k, v in empty.items()}
        return {**text, **{k: v for k, v in cond.items() if k not in text}}

    # -- denoising ------------------------------------------------------------------------------
    def _model_input(self, x: Tensor, cond: Condition) -> Tensor:
        return torch.cat([x, cond["condition"].to(x.dtype)], dim=1)


class WanConfig(PipelineConfig):
    """``pipeline.name: wan`` (Wan2.1 text-to-video)."""

    name: str = "wan"
    adapter: ClassVar[Any] = WanAdapter

    def probe_samples(self, n: int) -> Any:
        return torch.rand(n, 3, 2, 32, 32, generator=torch.Generator().manual_seed(0))  # (B, C, T, H, W): two small frames


class WanImageToVideoConfig(PipelineConfig):
    """``pipeline.name: wan_i2v`` (Wan2.1 image-to-video: the first frame from metadata.image)."""

    name: str = "wan_i2v"
    adapter: ClassVar[Any] = WanImageToVideoAdapter

    def probe_samples(self, n: int) -> Any:
        return torch.rand(n, 3, 2, 32, 32, generator=torch.Generator().manual_seed(0))  # (B, C, T, H, W): two small frames
