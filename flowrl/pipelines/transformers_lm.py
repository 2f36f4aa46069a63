"""What the transformers language-model adapters share: the masked-diffusion LMs (``dllm.py``) and DiffusionGemma
(``diffusion_gemma.py``) load a checkpoint, its tokenizer and a LoRA adapter the same way, and hand the training loop
the same things (trainable parameters, state dicts, the reference policy, the adapter's files).

* Loading: ``torch_dtype`` / ``torch_device`` resolve the config's strings, ``config_dict`` reads config.json without
  running any code, ``load_tokenizer`` and ``attach_lora`` turn every failure into one sentence (``FlowRLError``).
* :class:`TrainableLM`: the training loop's side of an adapter over ``self.model``. The reference policy is the model
  with its LoRA adapter disabled (``PeftModel.disable_adapter``) or, without LoRA, a frozen deep copy made at the first
  call (or at ``enable_reference()``).
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import FlowRLError
from .common import DTYPES

LORA_KEYS = {"r", "alpha", "target_modules", "dropout", "path"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class TrainableLM:
    """Mixin of a language-model adapter: the training loop's needs over ``self.model`` (the module that trains;
    a ``PeftModel`` when LoRA is attached). ``active_model()`` is the module a forward pass runs: the policy, or
    inside :meth:`reference` without LoRA, the frozen copy."""

    model: torch.nn.Module
    _reference: torch.nn.Module | None = None
    _use_reference: bool = False

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def has_lora(self) -> bool:
        return hasattr(self.model, "disable_adapter") and hasattr(self.model, "peft_config")

    def active_model(self) -> torch.nn.Module:
        """The policy's model, or inside :meth:`reference` (full fine-tuning) the frozen copy."""
        return self._reference if self._use_reference and self._reference is not None else self.model

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """What a checkpoint stores: the whole model's state (with its LoRA adapter when it has one)."""
        return dict(unwrap(self.model).state_dict())

    def load_trainable_state_dict(self, weights: dict[str, Tensor]) -> None:
        unwrap(self.model).load_state_dict(weights)

    def enable_reference(self) -> None:
        """Freeze a deep copy of the current weights as the reference (full fine-tuning only; LoRA needs none)."""
        if not self.has_lora and self._reference is None:
            self._reference = copy.deepcopy(self.model).requires_grad_(False).eval()

    @contextlib.contextmanager
    def reference(self):
        """Inside: forward passes run the reference policy (LoRA disabled, or the frozen copy)."""
        if self.has_lora:
            with self.model.disable_adapter():
                yield self
            return
        self.enable_reference()
        previous, self._use_reference = self._use_reference, True
        try:
            yield self
        finally:
            self._use_reference = previous

    def save_lora(self, path: str | Path, state_dict: dict[str, Tensor] | None = None) -> None:
        """Write the LoRA adapter (adapter_config.json + weights) with peft's ``save_pretrained``; ``state_dict``:
        the model's weights gathered whole when they are sharded (FSDP), else the model's own."""
        if not self.has_lora:
            raise FlowRLError("save_lora was called but no LoRA adapter is attached (set pipeline.lora).")
        self.model.save_pretrained(str(path), state_dict=state_dict)


# -- loading ------------------------------------------------------------------------------------------------------


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise FlowRLError(f"pipeline.dtype must be one of {', '.join(DTYPES)}, not '{dtype}'.")
    return DTYPES[dtype]


def torch_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def from_pretrained_kwargs(dtype: torch.dtype, device: torch.device, **extra: Any) -> dict[str, Any]:
    """``from_pretrained``'s keywords: the dtype, and on an accelerator a device map that loads the weights straight
    onto it rather than through host memory."""
    kwargs: dict[str, Any] = {"dtype": dtype, **extra}
    if device.type != "cpu":
        kwargs["device_map"] = {"": str(device)}
    return kwargs


def config_dict(pretrained: str) -> dict[str, Any]:
    """Read config.json without running any code (local directory or hub id)."""
    from transformers import PretrainedConfig

    path = Path(str(pretrained)).expanduser()
    if not path.is_dir() and (path.exists() or not _HUB_ID.match(str(pretrained))):
        raise FlowRLError(f"pipeline.pretrained '{pretrained}' is neither an existing directory nor a hub model id.")
    if path.is_dir() and not (path / "config.json").is_file():
        raise FlowRLError(f"model directory '{pretrained}' has no config.json.")
    try:
        config, _ = PretrainedConfig.get_config_dict(str(path) if path.is_dir() else str(pretrained))
    except (OSError, ValueError) as e:
        raise FlowRLError(f"could not read the config of '{pretrained}': {first_line(e)}") from None
    return config


def load_tokenizer(pretrained: str, trust_remote_code: bool = False) -> Any:
    """The checkpoint's tokenizer (``AutoTokenizer``)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(pretrained, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError, ImportError) as e:
        raise FlowRLError(f"could not load the tokenizer of '{pretrained}': {first_line(e)}") from None


def attach_lora(model: torch.nn.Module, lora: Mapping[str, Any], default_targets: str | list[str], what: str) -> torch.nn.Module:
    """``model`` wrapped by peft with the LoRA adapter ``lora`` describes (``pipeline.lora``): loaded from its
    ``path``, or new with rank ``r``, ``alpha``, ``dropout`` and ``target_modules`` (default: ``default_targets``).
    ``what``: the family, named in the error."""
    try:
        import peft
    except ImportError:
        raise FlowRLError("pipeline.lora needs peft, which is not installed; pip install 'flowrl[lora]'.") from None
    unknown = set(lora) - LORA_KEYS
    if unknown:
        raise FlowRLError(f"unknown pipeline.lora key(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(LORA_KEYS))}.")
    try:
        if lora.get("path"):
            if not Path(str(lora["path"])).is_dir():
                raise FlowRLError(f"pipeline.lora.path '{lora['path']}' is not an existing directory.")
            return peft.PeftModel.from_pretrained(model, str(lora["path"]), is_trainable=True)
        r = int(lora.get("r", 8))
        config = peft.LoraConfig(
            r=r,
            lora_alpha=float(lora.get("alpha", 2 * r)),
            lora_dropout=float(lora.get("dropout", 0.0)),
            target_modules=lora.get("target_modules") or default_targets,
            bias="none",
        )
        return peft.get_peft_model(model, config)
    except (ValueError, TypeError, KeyError, OSError, RuntimeError) as e:
        raise FlowRLError(f"could not attach LoRA ({what}): {first_line(e)}") from None


# -- helpers ------------------------------------------------------------------------------------------------------


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "module", module)  # DDP / accelerate wrappers


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def first_line(e: BaseException | None) -> str:
    """An exception's first line as the end of a one-sentence error."""
    text = str(e).strip().splitlines()[0] if e is not None and str(e).strip() else type(e).__name__
    return text if text.endswith(".") else text + "."
