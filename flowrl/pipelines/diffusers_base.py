"""What every adapter over real diffusers components shares: loading, freezing, prompt caching,
guidance, LoRA / full fine-tuning, the KL reference, memory options, and the diffusers LoRA format.

A family file (stable_diffusion.py, sdxl.py, sd3.py, flux.py, wan.py, cogvideox.py) subclasses
:class:`DiffusersAdapter` and supplies only what differs between families:

* ``_load_components()``: ``from_pretrained`` of its denoiser, text encoder(s), tokenizer(s), VAE and
  scheduler config (through :meth:`_load`, which turns every failure into one sentence);
* ``_encode_prompts(prompts) -> Condition``: text encodings, batch on dim 0;
* ``_forward(model, x, sigma, cond) -> Tensor``: one denoiser call. This is the only place where
  flowrl's ``sigma`` becomes the model's own timestep;
* ``latent_shape()`` and ``decode(x)``.

The denoising loop is flowrl's (flowrl/samplers); a diffusers pipeline's ``__call__`` is never used.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from ..errors import FlowRLError
from ..hub import check_hub, hub_unreachable, is_connection_failure
from ..samplers.schedules import SamplingGrid
from ..sections import PipelineSection
from ..types import Condition, cat_conditions
from .common import DTYPES, DeviceSpec, Dtype, LoraConfig
from .guidance import guided_prediction, rows_sigma


class PipelineConfig(PipelineSection):
    """``pipeline``: an image or video model driven through its diffusers components (docs/model_families.md).
    Every family over diffusers components shares these fields; each family's section (in its own file) names
    its adapter and may add fields of its own."""

    name: str = "digits"
    pretrained: str = Field(
        "digits_flow", description="The checkpoint: an embedded model name, a local directory or a Hugging Face Hub id."
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of pretrained; None: the default branch.")
    variant: str | None = Field(None, description='diffusers weight variant to load, e.g. "fp16"; None: the full-precision files.')
    device: DeviceSpec = "auto"
    dtype: Dtype = Field("float32", description="Precision of the frozen parts' weights and of the base model's.")
    lora: LoraConfig | None = Field(None, description="Train low-rank adapters with these settings; None: fine-tune the whole denoiser.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute the denoiser's activations in the backward pass: less memory, more time."
    )
    attention: Literal["sdpa", "xformers"] = Field(
        "sdpa", description="Attention kernel: torch's scaled_dot_product_attention or xformers (needs the [gpu] extra)."
    )
    offload_frozen: bool = Field(False, description="Keep the text encoders and the VAE on the CPU except while they run.")
    height: int | None = Field(None, ge=8, description="Sample height in pixels; None: the family's default.")
    width: int | None = Field(None, ge=8, description="Sample width in pixels; None: the family's default.")
    num_frames: int | None = Field(None, ge=1, description="Frames per video (video families); None: the family's default.")
    max_sequence_length: int | None = Field(
        None, ge=1, description="Text-encoder tokens per prompt (T5 families); None: the family's default."
    )
    flow_shift: float | None = Field(
        None, gt=0, description="Rectified-flow families: the sigma shift of the sampling grid instead of the checkpoint's."
    )
    # docs/samplers.md lists the grids
    sampling_grid: SamplingGrid = Field(
        "default", description="The sampling time grid; default: the family's diffusers pipeline grid for the checkpoint."
    )
    adapter: ClassVar[Any] = None  # the family's adapter class (set by each family's section)

    def build(self, device: Any, loaded: Any = None) -> Any:
        if self.adapter is None:  # the generic section: build through the family's own
            from . import family_section

            return family_section(self).build(device, loaded)
        return self.adapter.from_config(self, device, loaded=loaded)


def resolve_source(pretrained: str) -> str:
    """A local directory (returned as an absolute path) or a hub id (returned as is).

    Anything that looks like a filesystem path but is not a directory fails here with one sentence,
    rather than as a confusing hub lookup later.
    """
    path = Path(pretrained).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if pretrained.startswith((".", "/", "~")) or pretrained.count("/") > 1 or path.exists():
        raise FlowRLError(f"pipeline.pretrained '{pretrained}' is not an existing model directory.")
    return pretrained


def _loaded_source(loaded: Any, pretrained: str) -> str:
    """Where a pipeline given in memory came from: its own ``name_or_path`` (a directory or hub id), else the config's."""
    source = getattr(loaded, "name_or_path", None) or getattr(getattr(loaded, "config", None), "_name_or_path", None)
    return str(source) if source else pretrained


def cut_overlong(tokenizer: Any, prompts: list[str], max_length: int) -> list[str]:
    """``prompts`` with each one longer than the text encoder reads cut to a start that still holds more than its
    ``max_length`` tokens (the same ids after truncation, without tokenizing a 40 MB prompt whole), and a warning
    naming its length (once per prompt length and limit), as a reward that reads the whole prompt would otherwise
    score images against words the model never saw."""
    cut = []
    for prompt in prompts:
        if len(prompt) + 2 <= max_length:  # every token spans at least one character: cannot be over
            cut.append(prompt)
            continue
        head = prompt[: 16 * max_length]
        count = len(tokenizer(head, add_special_tokens=True, truncation=False, verbose=False).input_ids)
        if count > max_length and (len(prompt), max_length) not in _WARNED_LENGTHS:
            _WARNED_LENGTHS.add((len(prompt), max_length))
            over = f"{count} tokens" if head == prompt else f"more than {count} tokens"
            warnings.warn(
                f"a prompt of {len(prompt):,} characters ({over}) is longer than the text encoder's {max_length} tokens; "
                f"only its first {max_length} tokens are read (it starts {prompt[:40]!r}).",
                stacklevel=3,
            )
        cut.append(head if count > max_length + 8 else prompt)  # a margin: a merge at the cut stays past the limit
    return cut


_WARNED_LENGTHS: set[tuple[int, int]] = set()


def prompt_token_ids(tokenizer: Any, prompts: list[str], max_length: int) -> Tensor:
    """(B, max_length) token ids of ``prompts`` as diffusers' pipelines tokenize them for a text encoder: special tokens
    added, truncated and padded to ``max_length`` (with a warning for a prompt that is cut)."""
    return tokenizer(
        cut_overlong(tokenizer, prompts, max_length),
        padding="max_length",
        max_length=max_length,
        truncation=True,
        add_special_tokens=True,
        return_tensors="pt",
    ).input_ids


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "module", module)  # DDP / accelerate wrappers


POLICY_ADAPTER = "default"  # peft's name of the first adapter: the policy's LoRA


class DiffusersAdapter:
    """Base class of the adapters over diffusers components (see the module docstring)."""

    denoiser_subfolder = "transformer"  # "unet" for the UNet families
    lora_pipeline_class = ""  # the diffusers pipeline whose save_lora_weights writes this family's format
    # UNet LoRAs are saved through convert_state_dict_to_diffusers (as diffusers' SD/SDXL LoRA scripts do);
    # transformer LoRAs keep peft's key names: the conversion renames to_q.lora_A to the old UNet-processor
    # to_q.lora.down, which the transformer loaders silently skip (caught by the SD3 round-trip test)
    convert_lora_keys = False
    default_lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    default_size = (512, 512)  # (height, width) when the config gives none
    prediction_type = "flow"

    def __init__(self, config, device: str | torch.device, loaded: Any = None):
        self.config = config
        # ``loaded``: a diffusers pipeline already in memory, whose components are used (not copied) instead of
        # loading ``pretrained``; its own name_or_path is the source a checkpoint and an export refer to
        self.loaded = loaded
        self.source = self._resolve_source(config.pretrained) if loaded is None else _loaded_source(loaded, config.pretrained)
        # a hub id: the hub is probed first (bounded); unreachable with the model cached, every load reads the cache only
        self._local_only = (
            loaded is None
            and not Path(self.source).is_dir()
            and check_hub(self.source, config.revision, "pipeline.pretrained", "use pipeline.pretrained=LOCAL_DIR")
        )
        self.device = torch.device(device)
        self.dtype = DTYPES[config.dtype]
        self._guidance_mode = "cfg"  # set by the trainer from rollout.guidance_mode (checked against the model then)
        self._prompt_cache: dict[str, Condition] = {}
        self._reference: torch.nn.Module | None = None
        self._use_reference = False
        self._role_adapters: list[str] = []  # LoRA adapters of other trained roles on this denoiser (add_role_adapter)
        self.denoiser: torch.nn.Module
        self._load_components()
        if config.flow_shift is not None:  # override the checkpoint's (e.g. Wan 720p: 5.0, DanceGRPO's static 3.0)
            if self.prediction_type != "flow":
                raise FlowRLError(
                    f"pipeline.flow_shift applies to rectified-flow models; '{config.name}' is a {self.prediction_type} model."
                )
            import dataclasses

            # keep the grid the family chose (and pipeline.sampling_grid); only the shift is overridden
            self.schedule = dataclasses.replace(self.schedule, shift=config.flow_shift, dynamic=False)
        for module in self.frozen_modules():
            module.requires_grad_(False).eval()
            module.to("cpu" if config.offload_frozen else self.device)
        self._configure_denoiser()

    # the trainer sets rollout.guidance_mode after construction; a family refuses a mode its model cannot run
    @property
    def guidance_mode(self) -> str:
        return self._guidance_mode

    @guidance_mode.setter
    def guidance_mode(self, mode: str) -> None:
        self.check_guidance_mode(mode)
        self._guidance_mode = mode

    def check_guidance_mode(self, mode: str) -> None:
        """Raise FlowRLError (one sentence) when this model cannot run ``mode`` (e.g. 'embedded' without a guidance
        embedding, or anything else on a guidance-distilled model). Every mode is accepted here."""

    @classmethod
    def from_config(cls, config, device: str | torch.device, loaded: Any = None) -> DiffusersAdapter:
        return cls(config, device, loaded=loaded)

    # -- loading --------------------------------------------------------------------------------
    def _resolve_source(self, pretrained: str) -> str:
        """What ``from_pretrained`` is given: a local directory or a hub id (embedded models override this)."""
        return resolve_source(pretrained)

    def _load(self, cls: Any, subfolder: str | None, **kwargs) -> Any:
        """``cls.from_pretrained(source, subfolder=...)`` with flowrl's options and one-sentence errors (or, for a
        pipeline given in memory, its component of that name)."""
        if self.loaded is not None:
            return self._from_loaded(cls, subfolder, kwargs.get("torch_dtype", self.dtype))
        options: dict[str, Any] = {"revision": self.config.revision}
        if subfolder:
            options["subfolder"] = subfolder
        if getattr(self, "_local_only", False):
            options["local_files_only"] = True
        is_model = hasattr(cls, "save_pretrained") and not cls.__name__.endswith(("Tokenizer", "TokenizerFast", "Processor"))
        if is_model and "Scheduler" not in cls.__name__:
            options["torch_dtype"] = kwargs.pop("torch_dtype", self.dtype)
            if self.config.variant:
                options["variant"] = self.config.variant
        try:
            return cls.from_pretrained(self.source, **options, **kwargs)
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:
            if not Path(self.source).is_dir() and is_connection_failure(e):  # the network went away after the probe
                raise hub_unreachable(self.source, "pipeline.pretrained", "use pipeline.pretrained=LOCAL_DIR") from None
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise FlowRLError(
                f"could not load {cls.__name__} from '{self.source}'{f' ({subfolder}/)' if subfolder else ''}: {first[:200]}"
            ) from None

    def _from_loaded(self, cls: Any, subfolder: str | None, dtype: torch.dtype) -> Any:
        """The given pipeline's ``subfolder`` component as ``cls`` would load it: a model cast to ``dtype``, a
        scheduler of another class rebuilt from its config (as ``from_pretrained`` reads any scheduler's file)."""
        part = getattr(self.loaded, subfolder or "", None)
        if part is None:
            raise FlowRLError(
                f"the pipeline given to flowrl ({type(self.loaded).__name__}) has no '{subfolder}' component, which "
                f"pipeline.name={self.config.name} needs."
            )
        if "Scheduler" in cls.__name__:
            return part if isinstance(part, cls) else cls.from_config(part.config)
        if cls.__name__.startswith("Auto"):  # AutoTokenizer and the like: any tokenizer will do
            return part
        if not isinstance(part, cls):
            raise FlowRLError(
                f"the pipeline given to flowrl has a {type(part).__name__} as '{subfolder}', where "
                f"pipeline.name={self.config.name} needs a {cls.__name__}."
            )
        return part.to(dtype=dtype) if isinstance(part, torch.nn.Module) else part

    def _read_config(self, cls: Any, subfolder: str | None, what: str) -> dict:
        """A component's config (``subfolder`` None: the pipeline's model_index.json) without loading weights, as
        written in the checkpoint (or of the given pipeline's component); ``what`` names it in the error."""
        if self.loaded is not None:
            part = self.loaded if subfolder is None else getattr(self.loaded, subfolder, None)
            if part is None:
                raise FlowRLError(f"the pipeline given to flowrl ({type(self.loaded).__name__}) has no '{subfolder}' component.")
            return dict(part.config)
        options = {"revision": self.config.revision, **({"subfolder": subfolder} if subfolder else {})}
        if getattr(self, "_local_only", False):
            options["local_files_only"] = True
        try:
            return dict(cls.load_config(self.source, **options))
        except (OSError, ValueError) as e:
            if not Path(self.source).is_dir() and is_connection_failure(e):
                raise hub_unreachable(self.source, "pipeline.pretrained", "use pipeline.pretrained=LOCAL_DIR") from None
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise FlowRLError(f"could not read {what} of '{self.source}': {first[:200]}") from None

    def _load_components(self) -> None:
        raise NotImplementedError

    def _load_single_encoder(self, text_encoder_class: Any, vae_class: Any, denoiser_class: Any, vae_subfolder: str = "vae") -> None:
        """The components of a family with one tokenizer and one text encoder, in the order every such family loads
        them: ``tokenizer``, ``text_encoder``, ``vae`` (from ``vae_subfolder``), the denoiser (``denoiser_subfolder``)."""
        from transformers import AutoTokenizer

        self.tokenizer = self._load(AutoTokenizer, "tokenizer")
        self.text_encoder = self._load(text_encoder_class, "text_encoder")
        self.vae = self._load(vae_class, vae_subfolder)
        self.denoiser = self._load(denoiser_class, self.denoiser_subfolder)

    def frozen_modules(self) -> list[torch.nn.Module]:
        """Text encoders, VAE, image encoders: never trained, optionally kept on the CPU."""
        return [
            m
            for m in (getattr(self, n, None) for n in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae", "image_encoder"))
            if m is not None
        ]

    def _configure_denoiser(self) -> None:
        cfg, model = self.config, self.denoiser
        # the dtype of the denoiser's base weights, which its inputs are cast to
        self.model_dtype = self.dtype if cfg.lora is not None else torch.float32
        if cfg.lora is not None:
            self._add_lora(cfg.lora)
        elif self.dtype != torch.float32:
            # full fine-tuning keeps fp32 master weights; bf16/fp16 enter through autocast (train.mixed_precision)
            model.to(torch.float32)
        model.to(self.device)
        if cfg.gradient_checkpointing:
            if not getattr(model, "_supports_gradient_checkpointing", False):
                raise FlowRLError(f"{type(model).__name__} does not support gradient checkpointing.")
            model.enable_gradient_checkpointing()
        if cfg.attention == "xformers":
            try:
                import xformers  # noqa: F401
            except ImportError:
                raise FlowRLError("pipeline.attention=xformers needs the xformers package (pip install 'flowrl[gpu]').") from None
            model.enable_xformers_memory_efficient_attention()
        # otherwise diffusers' default processors call torch's scaled_dot_product_attention (SDPA)

    def _add_lora(self, lora) -> None:
        self._add_lora_to([self.denoiser], lora)

    def _add_lora_to(self, modules: Sequence[torch.nn.Module], lora) -> None:
        """Freeze the denoiser and give each of ``modules`` (the denoiser, or the experts it trains) the policy's LoRA
        adapter with the ``pipeline.lora`` settings; the adapters train in fp32 over a bf16/fp16 base."""
        try:
            from peft import LoraConfig
        except ImportError:
            raise FlowRLError("pipeline.lora needs peft, which is not installed; pip install 'flowrl[lora]'.") from None
        self.denoiser.requires_grad_(False)
        targets = list(lora.target_modules or self.default_lora_targets)
        for module in modules:
            try:
                module.add_adapter(
                    LoraConfig(
                        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, init_lora_weights="gaussian", target_modules=targets
                    )
                )
            except ValueError as e:
                raise FlowRLError(
                    f"pipeline.lora.target_modules {targets} do not match {type(module).__name__}: {str(e).splitlines()[0][:160]}"
                ) from None
        for p in self.denoiser.parameters():
            if p.requires_grad:
                p.data = p.data.float()

    @property
    def has_lora(self) -> bool:
        return self.config.lora is not None

    # -- conditioning ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _frozen_on_device(self, *modules: torch.nn.Module) -> Iterator[None]:
        """With ``offload_frozen``, bring frozen modules to the device only while they run."""
        if self.config.offload_frozen:
            for m in modules:
                m.to(self.device)
        try:
            yield
        finally:
            if self.config.offload_frozen:
                for m in modules:
                    m.to("cpu")

    def _encode_prompts(self, prompts: list[str]) -> Condition:
        raise NotImplementedError

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> Condition:
        """Text encodings (float32, on the device), computed once per distinct prompt and cached."""
        missing = list(dict.fromkeys(p for p in prompts if p not in self._prompt_cache))
        if missing:
            fresh = self._encode_prompts(missing)
            for i, p in enumerate(missing):
                self._prompt_cache[p] = {k: v[i : i + 1].to(self.device) for k, v in fresh.items()}
        return cat_conditions([self._prompt_cache[p] for p in prompts])

    def unconditional(self, batch: int, cond: Condition | None = None) -> Condition:
        """The condition of CFG's unconditional branch: the empty prompt. ``cond`` (the conditional
        branch's condition) lets a family keep its non-text parts, e.g. image-to-video's first frame."""
        return {k: v.expand(batch, *v.shape[1:]) for k, v in self.encode([""]).items()}

    # -- denoising ------------------------------------------------------------------------------
    def _forward(self, model: torch.nn.Module, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float) -> Tensor:
        raise NotImplementedError

    def predict(self, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float = 1.0) -> Tensor:
        """Model output at noise level sigma with guidance applied (float32)."""
        model = self._reference if self._reference is not None and self._use_reference else self.denoiser
        sigma = torch.as_tensor(sigma, device=self.device, dtype=torch.float32)

        def forward(x_in: Tensor, c: Condition) -> Tensor:
            return self._forward(model, x_in, rows_sigma(sigma, x_in.shape[0]), c, guidance_scale)

        if self.guidance_mode == "embedded" or guidance_scale == 1.0:
            return forward(x, cond).float()
        return guided_prediction(forward, x, cond, self.unconditional(x.shape[0], cond), guidance_scale, self.guidance_mode)

    def latent_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def initial_noise(self, batch: int, generator: torch.Generator) -> Tensor:
        return torch.randn((batch, *self.latent_shape()), generator=generator, device=generator.device).to(self.device)

    def decode(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def sample_size(self) -> tuple[int, int]:
        h, w = self.config.height or self.default_size[0], self.config.width or self.default_size[1]
        return h, w

    # -- training support -----------------------------------------------------------------------
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        if self._role_adapters:  # the policy's own adapter; the others belong to their roles
            return self.adapter_parameters(POLICY_ADAPTER)
        return [p for p in self.denoiser.parameters() if p.requires_grad]

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """What a checkpoint stores: the LoRA weights only, or the whole denoiser."""
        model = _unwrap(self.denoiser)
        if not self.has_lora:
            return dict(model.state_dict())
        if self._role_adapters:
            return self.adapter_state_dict(POLICY_ADAPTER)
        names = {n for n, p in model.named_parameters() if p.requires_grad}
        return {k: v for k, v in model.state_dict().items() if k in names}

    # -- LoRA adapters of other trained roles on the same base (training/roles.py) -------------------------------------
    def add_role_adapter(self, name: str, lora) -> None:
        """A second LoRA adapter on this denoiser, with the policy's LoRA settings, trained by a role of its own (a
        critic, DMD2's fake score). The policy's adapter stays the active one except inside ``use_adapter(name)``;
        every adapter's parameters stay trainable, so the engine wraps them all once."""
        from peft import LoraConfig

        model = _unwrap(self.denoiser)
        targets = list(lora.target_modules or self.default_lora_targets)
        config = LoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, init_lora_weights="gaussian", target_modules=targets
        )
        with warnings.catch_warnings():  # peft warns that a second adapter is being added: that is the point
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
            model.add_adapter(config, adapter_name=name)
        self._role_adapters.append(name)
        for p in self.adapter_parameters(name):  # trained in fp32 over a bf16/fp16 base, as the policy's adapter
            p.data = p.data.float()
        self._activate(POLICY_ADAPTER)

    def _activate(self, adapter: str) -> None:
        """Make ``adapter`` the one the denoiser runs with; peft's set_adapter freezes the others, which stay trainable."""
        model = _unwrap(self.denoiser)
        model.set_adapter(adapter)
        for name in [POLICY_ADAPTER, *self._role_adapters]:
            for p in self.adapter_parameters(name):
                p.requires_grad_(True)

    @contextlib.contextmanager
    def use_adapter(self, adapter: str) -> Iterator[DiffusersAdapter]:
        """Inside the block, predict() runs the denoiser with the LoRA adapter ``adapter`` instead of the policy's."""
        self._activate(adapter)
        try:
            yield self
        finally:
            self._activate(POLICY_ADAPTER)

    def _adapter_names(self, adapter: str) -> list[str]:
        return [n for n, _ in _unwrap(self.denoiser).named_parameters() if "lora_" in n and f".{adapter}." in n]

    def adapter_parameters(self, adapter: str) -> list[torch.nn.Parameter]:
        params = dict(_unwrap(self.denoiser).named_parameters())
        return [params[n] for n in self._adapter_names(adapter)]

    def adapter_state_dict(self, adapter: str) -> dict[str, Tensor]:
        names = set(self._adapter_names(adapter))
        return {k: v for k, v in _unwrap(self.denoiser).state_dict().items() if k in names}

    def load_adapter_state_dict(self, adapter: str, weights: dict[str, Tensor]) -> None:
        expected = set(self._adapter_names(adapter))
        if set(weights) != expected:
            raise RuntimeError(f"adapter '{adapter}' keys differ ({len(set(weights) ^ expected)} mismatched)")
        _unwrap(self.denoiser).load_state_dict(weights, strict=False)

    def load_trainable_state_dict(self, weights: dict[str, Tensor]) -> None:
        model = _unwrap(self.denoiser)
        if not self.has_lora:
            model.load_state_dict(weights)
            return
        expected = set(self.trainable_state_dict())
        if set(weights) != expected:
            raise RuntimeError(f"LoRA keys differ ({len(set(weights) ^ expected)} mismatched, e.g. {sorted(set(weights) ^ expected)[0]})")
        model.load_state_dict(weights, strict=False)

    def enable_reference(self) -> None:
        """LoRA: the reference is the base model (adapters disabled), no copy. Full fine-tuning: a frozen copy."""
        if not self.has_lora:
            self._reference = copy.deepcopy(_unwrap(self.denoiser)).requires_grad_(False).eval()

    @contextlib.contextmanager
    def reference(self):
        model = _unwrap(self.denoiser)
        if self.has_lora:
            model.disable_adapters()
            try:
                yield self
            finally:
                model.enable_adapters()
            return
        if self._reference is None:
            raise FlowRLError("a reference model was requested but none was enabled (objective.beta is 0).")
        self._use_reference = True
        try:
            yield self
        finally:
            self._use_reference = False

    @contextlib.contextmanager
    def use_denoiser(self, model: torch.nn.Module):
        """Inside the block, predict() runs ``model`` (a denoiser of this family, e.g. DMDR's separate teacher) in place
        of this one, with this pipeline's conditioning and timestep conventions."""
        saved = self._reference, self._use_reference
        self._reference, self._use_reference = model, True
        try:
            yield self
        finally:
            self._reference, self._use_reference = saved

    # -- export ---------------------------------------------------------------------------------
    def save_lora(self, directory: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """Write ``pytorch_lora_weights.safetensors`` in the diffusers format, so that
        ``DiffusionPipeline.from_pretrained(base).load_lora_weights(directory)`` reproduces this model.
        ``state_dict``: the LoRA weights gathered whole when the denoiser is sharded (FSDP), else read from it."""
        if not self.has_lora:
            raise FlowRLError("save_lora needs a LoRA run (pipeline.lora is not set).")
        import diffusers
        from diffusers.utils import convert_state_dict_to_diffusers
        from peft.utils import get_peft_model_state_dict

        model = _unwrap(self.denoiser)
        layers = get_peft_model_state_dict(model, state_dict=state_dict)
        if self.convert_lora_keys:
            layers = convert_state_dict_to_diffusers(layers)
        prefix = self.denoiser_subfolder
        pipeline_cls = getattr(diffusers, self.lora_pipeline_class)
        pipeline_cls.save_lora_weights(
            str(directory),
            **{f"{prefix}_lora_layers": layers, f"{prefix}_lora_adapter_metadata": model.peft_config["default"].to_dict()},
            safe_serialization=True,
        )
        return Path(directory) / "pytorch_lora_weights.safetensors"

    def merged_denoiser(self) -> torch.nn.Module:
        """A plain copy of the denoiser with the LoRA folded into its weights (for export)."""
        model = copy.deepcopy(_unwrap(self.denoiser))
        if self.has_lora:
            model.fuse_lora(lora_scale=1.0)
            model.unload_lora()
        return model.to(self.dtype)

    def merged_components(self) -> dict[str, torch.nn.Module]:
        """What an export writes in place of the base model's components, by subfolder: the merged denoiser (a
        family whose denoiser spans several components, Wan2.2's two experts, returns each)."""
        return {self.denoiser_subfolder: self.merged_denoiser()}
