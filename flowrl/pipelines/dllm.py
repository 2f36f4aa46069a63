"""Adapter for masked-diffusion language models (LLaDA, MMaDA, Dream, or any model returning ``.logits``).

``load_masked_lm`` loads a checkpoint (a local directory or a hub id) through the transformers Auto
classes and wraps it in ``MaskedDiffusionLM``, which implements the ``MaskedLM`` protocol of
``flowrl.types``. Families:

* ``llada`` (GSAI-ML/LLaDA-8B-Base/-Instruct): remote code (``modeling_llada.py``, ``LLaDAModelLM``),
  loaded with ``AutoModel``; mask id 126336 when neither the tokenizer nor the config names one.
* ``mmada`` (Gen-Verse/MMaDA-8B-*): LLaDA-based remote code (``MMadaModelLM``); same defaults as llada.
* ``dream`` (Dream-org/Dream-v0-*-7B): Qwen2-based remote code (``DreamModel``), AR-adapted: the model's
  output at position i predicts token i+1, so the adapter shifts logits right by one (position i gets
  the output at i-1; position 0, which has no predecessor, keeps the output at 0 exactly as Dream's own
  ``generation_utils`` does -- in practice position 0 is always a prompt token and never masked).
  Padding is passed as Dream does it: a 4-D boolean mask (B, 1, L, L) plus position ids counting only real
  tokens; unlike Dream's own mask we only mask padding *keys* so no query row is fully masked (NaN-free).
* ``auto``: the family is read from the config's ``model_type`` (llada / mmada / dream); anything else is a
  plain transformers model (``AutoModelForMaskedLM`` for ``*ForMaskedLM`` architectures, else
  ``AutoModelForCausalLM``) whose 2-D attention mask is passed through unchanged.

Block-diffusion models (BD3-LM / SDAR style; the embedded ``arith_bd3lm``) declare ``diffusion_block_length`` in
their config: the adapter then runs them with block-causal attention (``block_attention.py``: each block attends to
itself and the blocks before it) on every forward, sampling and scoring alike, and ``cached_logits`` runs the current
block alone against a key-value cache of the prompt and the finished blocks, which is exact for such attention (the
sampler's ``kv_cache: exact``). Such a model is a decoder class (``*ForCausalLM``) whose attention takes a 4-D mask.

Remote code runs only when ``trust_remote_code=True``: a checkpoint whose ``config.json`` has an
``auto_map`` is refused otherwise, with one sentence naming ``pipeline.trust_remote_code=true``.

Bidirectional attention is checked at load time by a probe (``attends_bidirectionally``): change the last
of 8 tokens and see whether the logits at position 0 move. A causal model leaves them bit-identical, so a
causal checkpoint (e.g. a plain Qwen2 loaded as ``auto``) is refused unless ``require_bidirectional=False``.
The probe tests the same forward path ``logits`` uses, so it also catches a remote-code revision that
silently attends causally. It cannot tell whether padding is honoured (early ``modeling_llada.py``
revisions ignore ``attention_mask``; batch without left padding, or with equal prompt lengths, to be safe).

LoRA goes through peft; ``reference()`` disables the adapter (``PeftModel.disable_adapter``) or, without
LoRA, switches to a frozen deep copy made at the first call (or at ``enable_reference()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import torch
from pydantic import Field
from torch import Tensor

from ..errors import FlowRLError
from ..sections import PipelineSection
from .block_attention import (
    block_causal_mask,
    block_diffusion_training_mask,
    block_diffusion_training_positions,
    position_ids,
)
from .common import DeviceSpec, ModelDtype, OptionalLora, PromptLength
from .transformers_lm import (
    TrainableLM,
    attach_lora,
    base_model,
    config_dict,
    first_line,
    from_pretrained_kwargs,
    load_tokenizer,
    torch_device,
    torch_dtype,
)

DLLMFamily = Literal["auto", "llada", "mmada", "dream"]
FAMILIES: tuple[str, ...] = get_args(DLLMFamily)
_ASSETS = Path(__file__).resolve().parents[1] / "assets"
EMBEDDED_LMS = {name: _ASSETS / name for name in ("arith_mdlm", "arith_bd3lm", "sudoku_mdlm")}  # shipped models by name
LLADA_MASK_TOKEN_ID = 126336  # "<|mdm_mask|>" in the LLaDA / MMaDA tokenizer
LLADA_EOS_TOKEN_ID = 126081  # "<|endoftext|>" (LLaDA's config eos/pad); "<|eot_id|>" is 126348

# LLaDA blocks (OLMo-style LLaDALlamaBlock): q_proj, k_proj, v_proj, attn_out, ff_proj (gate), up_proj, ff_out.
# The LM head is *also* called ``ff_out`` (``model.transformer.ff_out``), so a plain name list would put LoRA on
# the 126k-wide head; the regex (peft full-matches a string) only takes modules inside numbered blocks.
_LLADA_TARGETS = r".*\.\d+\.(q_proj|k_proj|v_proj|attn_out|ff_proj|up_proj|ff_out)"
DEFAULT_LORA_TARGETS: dict[str, str | list[str]] = {
    "llada": _LLADA_TARGETS,
    "mmada": _LLADA_TARGETS,
    "dream": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],  # Qwen2 names
    "auto": "all-linear",  # peft: every Linear except the output head
}

# Auto classes tried, in order, per family (the remote ones must be listed in the config's auto_map).
_REMOTE_AUTO_ORDER = {
    "llada": ("AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM"),
    "mmada": ("AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM"),
    "dream": ("AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM"),
    "auto": ("AutoModelForMaskedLM", "AutoModelForCausalLM", "AutoModel"),
}


class MaskedDiffusionLM(TrainableLM):
    """``MaskedLM`` adapter over any transformers model whose forward returns ``.logits`` (B, L, V).

    ``attention``: how a 2-D padding mask reaches the model -- ``"2d"`` passes it as ``attention_mask``
    (BERT, LLaDA, MMaDA); ``"dream"`` builds Dream's 4-D boolean mask and position ids. Logits come back
    in float32 (the log-softmax of a bf16 model is too coarse for ratios).

    ``block_length``: set for a block-diffusion model (config ``diffusion_block_length``): every forward is
    block-causal (``block_attention.block_causal_mask``, positions counting real tokens), and ``cached_logits``
    runs a few tokens against a key-value cache. None: the model's own (bidirectional) attention.

    The training loop's side (trainable parameters, state dicts, the reference policy, LoRA files): ``TrainableLM``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        mask_token_id: int,
        eos_token_id: int | None,
        shift_logits: bool = False,
        attention: str = "2d",
        family: str = "auto",
        block_length: int | None = None,
    ):
        if attention not in ("2d", "dream"):
            raise FlowRLError(f"attention must be '2d' or 'dream', not '{attention}'.")
        if block_length is not None and (attention != "2d" or shift_logits or block_length < 1):
            raise FlowRLError(
                "a block-causal model (diffusion_block_length) needs a positive block length, unshifted logits and 2-D padding masks."
            )
        self.model = model
        self.tokenizer = tokenizer
        self.mask_token_id = int(mask_token_id)
        self.eos_token_id = None if eos_token_id is None else int(eos_token_id)
        self.shift_logits = bool(shift_logits)
        self.attention = attention
        self.family = family
        self.block_length = block_length
        self._reference: torch.nn.Module | None = None
        self._use_reference = False

    # -- forward ------------------------------------------------------------------------------
    def raw_logits(self, input_ids: Tensor, attention_mask: Tensor | None = None, model: torch.nn.Module | None = None) -> Tensor:
        """The model's own output (no shift), in the model's dtype."""
        model = self.model if model is None else model
        kwargs: dict[str, Any] = {"input_ids": input_ids}
        if self.block_length is not None:
            keys = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            kwargs["attention_mask"] = block_causal_mask(keys, self.block_length, _float_dtype(model))
            kwargs["position_ids"] = position_ids(keys)
        elif self.attention == "dream":
            mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
            # keys only: every query (padding included) sees the real tokens of its row
            kwargs["attention_mask"] = mask[:, None, None, :].expand(-1, 1, input_ids.shape[1], -1)
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)
        elif attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        out = model(**kwargs)
        logits = getattr(out, "logits", None)
        if logits is None:
            raise FlowRLError(f"the model class {type(base_model(model)).__name__} returns no .logits; load a model with an LM head.")
        return logits

    def logits(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """(B, L, V) float32 logits where position i predicts token i (shifted for AR-adapted models)."""
        out = self.raw_logits(input_ids, attention_mask, model=self.active_model()).float()
        if self.shift_logits:
            out = torch.cat([out[:, :1], out[:, :-1]], dim=1)
        return out

    # -- key-value cache (block-causal models) --------------------------------------------------
    @property
    def supports_cache(self) -> bool:
        """Whether ``cached_logits`` is exact: a block-causal model whose forward takes a key-value cache."""
        return self.block_length is not None and _cache_argument(self.model) is not None

    def new_cache(self) -> Any:
        """An empty transformers ``DynamicCache`` for ``cached_logits``."""
        from transformers import DynamicCache

        return DynamicCache(config=base_model(self.active_model()).config)

    def cached_logits(self, input_ids: Tensor, attention_mask: Tensor, cache: Any) -> Tensor:
        """(B, n, V) float32 logits of the ``n`` tokens ``input_ids`` that follow the ones held in ``cache``.

        ``attention_mask``: (B, cached + n), 1 = real token, for the cached tokens and these ones. The forward is
        block-causal exactly as ``logits`` on the whole sequence (same blocks, same positions), and appends these
        tokens' keys and values to ``cache``; drop them with ``drop_from_cache`` to keep the cache as it was.
        """
        n = input_ids.shape[1]
        model = self.active_model()
        out = model(
            input_ids=input_ids,
            attention_mask=block_causal_mask(attention_mask, self.block_length, _float_dtype(model), queries=n),
            position_ids=position_ids(attention_mask)[:, -n:],
            use_cache=True,
            **{_cache_argument(model): cache},
        )
        return out.logits.float()

    def block_diffusion_logits(self, prompt_ids: Tensor, prompt_mask: Tensor, noised: Tensor, clean: Tensor) -> Tensor:
        """(B, G, V) float32 logits of a partly masked completion ``noised`` (B, G) in which each block is predicted
        given the CLEAN blocks before it (``clean`` (B, G), the completion as generated) and its own noised tokens:
        BD3-LM's likelihood factorisation, one forward of ``[prompt ; noised ; clean]`` with the training mask
        (``block_attention.block_diffusion_training_mask``). When the blocks before each masked position are already
        clean in ``noised`` (a sampling state), this equals ``logits`` on ``[prompt ; noised]``."""
        model, G, P = self.active_model(), noised.shape[1], prompt_ids.shape[1]
        out = model(
            input_ids=torch.cat([prompt_ids, noised, clean], 1),
            attention_mask=block_diffusion_training_mask(prompt_mask, G, self.block_length, _float_dtype(model)),
            position_ids=block_diffusion_training_positions(prompt_mask, G),
        )
        return out.logits[:, P : P + G].float()

    @staticmethod
    def drop_from_cache(cache: Any, n: int) -> None:
        """Remove the last ``n`` tokens' keys and values from ``cache`` (a negative crop: the number removed)."""
        if n:
            cache.crop(-n)

    @torch.no_grad()
    def attends_bidirectionally(self) -> bool:
        """Probe: does the output at position 0 depend on the last token? (False for causal attention.) A block-causal
        model is probed within one block: it attends bidirectionally inside a block, which is what masked diffusion needs."""
        base = base_model(self.model)
        vocab = _vocab_size(base)
        ids = (torch.arange(self.block_length or 8, device=self.device) % max(vocab - 1, 1)).unsqueeze(0)
        ids = torch.cat([ids, ids.clone()])
        ids[1, -1] = (ids[0, -1] + 1) % vocab
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.raw_logits(ids).float()
        finally:
            self.model.train(was_training)
        first = out[:, 0]
        return bool((first[0] - first[1]).abs().max() > 1e-6 * (first.abs().max() + 1))


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------


def load_masked_lm(
    pretrained: str,
    family: str = "auto",
    trust_remote_code: bool = False,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    lora: Mapping[str, Any] | None = None,
    mask_token_id: int | None = None,
    require_bidirectional: bool = True,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
) -> MaskedDiffusionLM:
    """Load a masked-diffusion LM; every failure is a one-sentence ``FlowRLError``. ``model`` (and ``tokenizer``):
    a transformers model already in memory, used instead of loading ``pretrained`` (its tokenizer is then read from
    ``pretrained`` unless given).

    mask id: ``mask_token_id`` > tokenizer's mask token > config's ``mask_token_id`` > family default
    (126336 for llada / mmada). eos id: tokenizer > config > family default (126081 for llada / mmada).
    """
    if family not in FAMILIES:
        raise FlowRLError(f"pipeline.family must be one of {', '.join(FAMILIES)}, not '{family}'.")
    dtype, device = torch_dtype(dtype), torch_device(device)
    config = config_dict(pretrained) if model is None else model.config.to_dict()
    family = _resolve_family(family, config)
    auto_map = _trusted_auto_map(pretrained, config, trust_remote_code)
    if model is None:
        model = _load_model(pretrained, family, config, auto_map, trust_remote_code, dtype, device)
    else:
        model = model.to(device=device, dtype=dtype)
    if tokenizer is None:
        tokenizer = load_tokenizer(pretrained, trust_remote_code)
    mask_id, eos_id = _special_tokens(pretrained, family, model, tokenizer, mask_token_id)
    adapter = MaskedDiffusionLM(
        model,
        tokenizer,
        mask_id,
        eos_id,
        shift_logits=family == "dream",
        attention="dream" if family == "dream" else "2d",
        family=family,
        block_length=getattr(model.config, "diffusion_block_length", None),
    )
    if require_bidirectional and not adapter.attends_bidirectionally():
        raise FlowRLError(
            f"the model '{pretrained}' attends causally (position 0 ignores later tokens), but masked diffusion needs bidirectional attention; load a diffusion LM or set pipeline.require_bidirectional=false."
        )
    if lora is not None:
        adapter.model = attach_lora(model, lora, DEFAULT_LORA_TARGETS[family], f"{family} family")
    return adapter


def _resolve_family(family: str, config: Mapping[str, Any]) -> str:
    """``auto`` becomes the config's ``model_type`` when it names a known family (llada / mmada / dream)."""
    model_type = str(config.get("model_type", "")).lower()
    if family == "auto":
        return model_type if model_type in ("llada", "mmada", "dream") else "auto"
    return family


def _trusted_auto_map(pretrained: str, config: Mapping[str, Any], trust_remote_code: bool) -> dict[str, Any]:
    """The config's ``auto_map`` (the checkpoint's own modelling code), refused unless remote code is trusted."""
    auto_map = config.get("auto_map") or {}
    if auto_map and not trust_remote_code:
        raise FlowRLError(
            f"the model '{pretrained}' ships its own modeling code (config auto_map), which flowrl runs only if you set pipeline.trust_remote_code=true."
        )
    return auto_map


def _special_tokens(pretrained: str, family: str, model: torch.nn.Module, tokenizer: Any, mask_token_id: int | None):
    """(mask id, eos id): the first of the explicit id, the tokenizer's, the config's and the family's default."""
    mask_id = _first_not_none(
        mask_token_id,
        getattr(tokenizer, "mask_token_id", None),
        getattr(model.config, "mask_token_id", None),
        LLADA_MASK_TOKEN_ID if family in ("llada", "mmada") else None,
    )
    if mask_id is None:
        raise FlowRLError(f"the model '{pretrained}' defines no mask token (tokenizer or config); pass pipeline.mask_token_id.")
    vocab = _vocab_size(model)
    if not 0 <= int(mask_id) < vocab:
        raise FlowRLError(f"mask token id {mask_id} is outside the vocabulary of '{pretrained}' (size {vocab}).")
    eos_id = _first_not_none(
        getattr(tokenizer, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
        LLADA_EOS_TOKEN_ID if family in ("llada", "mmada") and vocab > LLADA_EOS_TOKEN_ID else None,
    )
    if isinstance(eos_id, (list, tuple)):
        eos_id = eos_id[0] if eos_id else None
    return mask_id, eos_id


def _load_model(pretrained, family, config, auto_map, trust_remote_code, dtype, device) -> torch.nn.Module:
    import transformers

    if auto_map:
        names = [n for n in _REMOTE_AUTO_ORDER[family] if n in auto_map]
        if not names:
            raise FlowRLError(f"the auto_map of '{pretrained}' names none of {', '.join(_REMOTE_AUTO_ORDER[family])}.")
    else:
        archs = [str(a) for a in config.get("architectures") or []]
        if any(a.endswith("ForMaskedLM") for a in archs):
            names = ["AutoModelForMaskedLM"]
        elif any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
            names = ["AutoModelForCausalLM"]
        else:
            names = list(_REMOTE_AUTO_ORDER["auto"])
    kwargs = from_pretrained_kwargs(dtype, device, trust_remote_code=trust_remote_code)
    error: Exception | None = None
    for name in names:
        try:
            model = getattr(transformers, name).from_pretrained(pretrained, **kwargs)
            break
        except (OSError, ValueError, TypeError, KeyError, ImportError, AttributeError, RuntimeError) as e:
            error = e
    else:
        raise FlowRLError(f"could not load the model in '{pretrained}' with {'/'.join(names)}: {first_line(error)}") from None
    return model.to(device)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _float_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype an additive attention mask must have for ``model`` (its floating-point weights')."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _cache_argument(model: torch.nn.Module) -> str | None:
    """The forward's key-value cache keyword (transformers 5.24 renamed ``past_key_values`` to ``cache``), or None."""
    import inspect

    params = inspect.signature(base_model(model).forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def _vocab_size(model: torch.nn.Module) -> int:
    model = base_model(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None:
        return int(weight.shape[0])
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None) or getattr(config, "embedding_size", None)
    if size is None:
        raise FlowRLError(f"cannot tell the vocabulary size of {type(model).__name__} (no output embeddings or config.vocab_size).")
    return int(size)


def _first_not_none(*values):
    return next((v for v in values if v is not None), None)


class DLLMPipelineConfig(PipelineSection):
    """``pipeline.name: dllm``: a masked-diffusion language model (LLaDA, MMaDA, Dream, or the embedded arith_mdlm /
    arith_bd3lm)."""

    name: str = "dllm"
    pretrained: str = Field("arith_mdlm", description="The checkpoint: an embedded model name, a local directory or a Hugging Face Hub id.")
    family: DLLMFamily = Field("auto", description="The model's family (how it is called and masked); auto: read from its config.")
    trust_remote_code: bool = Field(
        False, description="Run the modelling code a checkpoint ships (LLaDA, MMaDA, Dream need it): opt in explicitly."
    )
    device: DeviceSpec = "auto"
    dtype: ModelDtype = "float32"
    lora: OptionalLora = None
    prompt_length: PromptLength = Field(None, ge=1)
    mask_token_id: int | None = Field(None, ge=0, description="The mask token's id; None: the tokenizer's, the config's or the family's.")
    require_bidirectional: bool = Field(True, description="Refuse a model whose attention is causal (not a diffusion LM).")
    modality: ClassVar[str] = "text"

    def build(self, device: Any, loaded: Any = None) -> MaskedDiffusionLM:
        """``loaded``: a transformers model in memory, or a (model, tokenizer) pair."""
        model, tokenizer = loaded if isinstance(loaded, (tuple, list)) else (loaded, None)
        pretrained = str(EMBEDDED_LMS.get(self.pretrained, self.pretrained))
        return load_masked_lm(
            pretrained,
            family=self.family,
            trust_remote_code=self.trust_remote_code,
            dtype=self.dtype,
            device=device,
            lora=self.lora.model_dump() if self.lora else None,
            mask_token_id=self.mask_token_id,
            require_bidirectional=self.require_bidirectional,
            model=model,
            tokenizer=tokenizer,
        )

    def default_num_threads(self) -> int | None:
        return 1 if self.pretrained in EMBEDDED_LMS else None  # the embedded arith_mdlm is too small to share among threads

    def probe_samples(self, n: int) -> list[str]:
        return ["" for _ in range(n)]  # completions are text
