"""Rollout speed of flowrl's diffusion-LM samplers against reference generation loops, measured in one run (#43 item 4).

    python bench/dllm_rollout_speed.py [--repeats 3] [--repeats-large 2] [--quick] [--json PATH]

One process, one thread (``torch.set_num_threads(1)``); within a case the modes alternate (the order reverses every
repeat), so load on the machine hits them alike; times are medians over the repeats. Cases:

* Masked diffusion, bidirectional (LLaDA-style): flowrl's ``samplers.masked.generate`` (the whole sequence through
  the model at every step: ``kv_cache: none``) against :func:`reference_generate`, the plain loop of LLaDA's released
  ``generate.py`` (full forward each step, Gumbel noise as ``exp(logits) / (-log u)^T`` in float64, the float64
  softmax probability of the drawn token as confidence, a per-row ``topk``), written out here. On the embedded
  ``arith_mdlm`` (trained, tiny) and on ``llada_random``: LLaDA's module layout (``modeling_llada.py``'s names,
  RMSNorm, RoPE, SwiGLU, bidirectional attention) with LLaDA-8B's vocabulary (126464) and head size (128), 4 layers of
  width 512, random weights.
* Block diffusion (block-causal, BD3-LM / SDAR style): the same two plus flowrl's ``kv_cache: exact`` (prompt and
  finished blocks in a key-value cache, each step runs the current block). On the embedded ``arith_bd3lm`` and on
  ``bd3lm_random``: a block-causal Llama (blocks of 4, as SDAR and TraDo) of the same widths and vocabulary.
* DiffusionGemma: flowrl's entropy-bound sampler against transformers' own ``DiffusionGemmaForBlockDiffusion.generate``.
  On the plumbing preset's tiny random model and on ``diffusion_gemma_random``: Gemma's vocabulary (262144), canvases of
  32, 2 layers of width 256 with 4 experts, random weights.

Every mode of the small cases runs once untimed first (the process's first-call costs: imports, generation set-up);
the larger cases come after them. Each masked case runs at temperature 0 (how flowrl evaluates; the tokens of the reference loop, flowrl's full-sequence
sampler and its cached sampler are compared) and at temperature 1 (rollouts: flowrl with per-row random streams, as
training draws them; the reference with torch's global generator). DiffusionGemma runs ``generate`` after
``torch.manual_seed(r)``, flowrl with ``torch.Generator().manual_seed(r)`` (the same draws: tokens compared) and flowrl
with per-row streams (rollouts).

Counted beside the time: tokens generated (batch x completion length) and forward rows (tokens run through the model,
summed over every forward of one generation). A last, separate pass per mode times its phases (exclusive wall time):
the model's forward, the adapter around it (masks, positions, float32 logits), token sampling, confidence and
selection, log-prob recording, cache bookkeeping, and the rest of the loop. It wraps the sampler's own functions with
timers for that pass only and restores them after.

Writes bench/results/dllm_rollout_speed.json (not with ``--quick`` unless ``--json`` is given). Run it under ``nice``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import record  # noqa: E402  (bench/record.py)

from flowrl.pipelines import diffusion_gemma as dg  # noqa: E402
from flowrl.pipelines import dllm  # noqa: E402
from flowrl.prompts import prompt_pool  # noqa: E402
from flowrl.samplers import entropy_bound as eb  # noqa: E402
from flowrl.samplers import masked  # noqa: E402
from flowrl.samplers.text_generation import encode_prompts  # noqa: E402
from flowrl.seeding import RowGenerators  # noqa: E402

LLADA_VOCAB = 126464


# ---------------------------------------------------------------------------------------------------------------------
# the reference loop
# ---------------------------------------------------------------------------------------------------------------------


def _no_phase(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


@torch.no_grad()
def reference_generate(
    forward: Callable[[Tensor, Tensor], Tensor],
    prompt: Tensor,
    prompt_mask: Tensor,
    steps: int,
    gen_length: int,
    block_length: int,
    temperature: float,
    mask_id: int,
    phase: Callable[[str], contextlib.AbstractContextManager] = _no_phase,
) -> Tensor:
    """The completions (B, gen_length) of LLaDA's released ``generate.py`` loop (classifier-free guidance off,
    ``low_confidence`` remasking), batched with a padding mask as its later revisions take one. ``forward(x, mask)``
    is the model's logits on the whole sequence. ``phase`` names the loop's parts for the profile pass."""
    batch, p_len = prompt.shape
    x = torch.full((batch, p_len + gen_length), mask_id, dtype=torch.long, device=prompt.device)
    x[:, :p_len] = prompt
    attention_mask = torch.cat([prompt_mask.long(), torch.ones((batch, gen_length), dtype=torch.long, device=prompt.device)], 1)
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    for block in range(num_blocks):
        end = p_len + (block + 1) * block_length
        # get_num_transfer_tokens: an equal share of the block's masked tokens per step, the remainder first
        n_masked = (x[:, end - block_length : end] == mask_id).sum(1, keepdim=True)
        base, remainder = n_masked // steps_per_block, n_masked % steps_per_block
        transfer_counts = base + (torch.arange(steps_per_block, device=x.device)[None] < remainder).long()
        for i in range(steps_per_block):
            is_masked = x == mask_id
            logits = forward(x, attention_mask)
            with phase("sampling"):
                if temperature == 0:
                    x0 = logits.argmax(-1)
                else:  # add_gumbel_noise: exp(logits) / (-log u)^T, in float64
                    wide = logits.to(torch.float64)
                    x0 = (wide.exp() / (-torch.log(torch.rand_like(wide))) ** temperature).argmax(-1)
            with phase("confidence + selection"):
                confidence = torch.softmax(logits.to(torch.float64), -1).gather(-1, x0[..., None]).squeeze(-1)
                confidence[:, end:] = -math.inf
                x0 = torch.where(is_masked, x0, x)
                confidence = torch.where(is_masked, confidence, -math.inf)
                transfer = torch.zeros_like(is_masked)
                for j in range(batch):
                    transfer[j, torch.topk(confidence[j], k=int(transfer_counts[j, i])).indices] = True
                x[transfer] = x0[transfer]
    return x[:, p_len:]


# ---------------------------------------------------------------------------------------------------------------------
# random-weight models at a CPU-feasible size
# ---------------------------------------------------------------------------------------------------------------------


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: Tensor, theta: float) -> Tensor:
    half, positions = x.shape[-1] // 2, torch.arange(x.shape[-2], device=x.device)
    angles = positions[:, None].float() * theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class LLaDABlock(nn.Module):
    """``LLaDALlamaBlock``'s computation and names: pre-norm attention (bidirectional) and SwiGLU MLP."""

    def __init__(self, d: int, heads: int, mlp: int, theta: float):
        super().__init__()
        self.heads, self.theta = heads, theta
        self.attn_norm, self.ff_norm = _RMSNorm(d), _RMSNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.attn_out = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.ff_proj, self.up_proj = nn.Linear(d, mlp, bias=False), nn.Linear(d, mlp, bias=False)
        self.ff_out = nn.Linear(mlp, d, bias=False)

    def forward(self, x: Tensor, key_mask: Tensor | None) -> Tensor:
        b, length, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (p(h).view(b, length, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        att = F.scaled_dot_product_attention(_rope(q, self.theta), _rope(k, self.theta), v, attn_mask=key_mask)
        x = x + self.attn_out(att.transpose(1, 2).reshape(b, length, d))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


@dataclass
class _Out:
    logits: Tensor


class LLaDARandom(nn.Module):
    """LLaDA's model (``model.transformer.{wte, blocks, ln_f, ff_out}``) at a chosen size, random weights: blocks
    N(0, 0.02), the LM head N(0, 0.2) (logits of a few units' spread, so the confidences are not flat)."""

    def __init__(self, vocab: int = LLADA_VOCAB, d: int = 512, layers: int = 4, heads: int = 4, mlp: int = 1536, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.transformer = nn.ModuleDict(
                dict(
                    wte=nn.Embedding(vocab, d),
                    blocks=nn.ModuleList([LLaDABlock(d, heads, mlp, 500000.0) for _ in range(layers)]),
                    ln_f=_RMSNorm(d),
                    ff_out=nn.Linear(d, vocab, bias=False),
                )
            )
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, 0.0, 0.02)
            nn.init.normal_(self.transformer.ff_out.weight, 0.0, 0.2)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> _Out:
        x = self.transformer.wte(input_ids)
        key_mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        for block in self.transformer.blocks:
            x = block(x, key_mask)
        return _Out(self.transformer.ff_out(self.transformer.ln_f(x)))


def llada_random(d: int, layers: int) -> dllm.MaskedDiffusionLM:
    model = LLaDARandom(d=d, layers=layers, heads=d // 128, mlp=3 * d).eval()
    return dllm.MaskedDiffusionLM(model, None, dllm.LLADA_MASK_TOKEN_ID, dllm.LLADA_EOS_TOKEN_ID, family="llada")


def bd3lm_random(d: int, layers: int, block_length: int = 4) -> dllm.MaskedDiffusionLM:
    """A block-causal Llama (``LlamaForCausalLM`` run block-causally, as the embedded arith_bd3lm) with LLaDA's
    vocabulary and mask id."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=LLADA_VOCAB,
        hidden_size=d,
        intermediate_size=3 * d,
        num_hidden_layers=layers,
        num_attention_heads=d // 128,
        num_key_value_heads=d // 128,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=dllm.LLADA_EOS_TOKEN_ID,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = LlamaForCausalLM(config)
        nn.init.normal_(model.lm_head.weight, 0.0, 0.2)
    return dllm.MaskedDiffusionLM(model.eval(), None, dllm.LLADA_MASK_TOKEN_ID, dllm.LLADA_EOS_TOKEN_ID, block_length=block_length)


def diffusion_gemma_random(vocab: int, hidden: int, canvas: int) -> dg.DiffusionGemmaLM:
    """transformers' DiffusionGemmaForBlockDiffusion at a chosen size, random weights (as ``write_tiny_random``)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    config = DiffusionGemmaConfig(
        text_config=dict(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=hidden // 4,
            global_head_dim=hidden // 4,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention"],
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=hidden // 2,
            pad_token_id=0,
            eos_token_id=1,
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
        canvas_length=canvas,
        boi_token_id=vocab - 3,
        eoi_token_id=vocab - 2,
        image_token_id=vocab - 1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        model = DiffusionGemmaForBlockDiffusion(config).eval()
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return dg.DiffusionGemmaLM(model, None)


# ---------------------------------------------------------------------------------------------------------------------
# phase timers for the profile pass
# ---------------------------------------------------------------------------------------------------------------------


class Phases:
    """Exclusive wall time per named phase (a phase inside another is subtracted from it), and forward rows."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.rows: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.total = 0.0
        self._stack: list[list[Any]] = []

    def enter(self, name: str) -> None:
        self._stack.append([name, time.perf_counter(), 0.0])

    def exit(self) -> None:
        name, start, inner = self._stack.pop()
        elapsed = time.perf_counter() - start
        self.seconds[name] += elapsed - inner
        if self._stack:
            self._stack[-1][2] += elapsed

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.enter(name)
        try:
            yield
        finally:
            self.exit()

    def wrap(self, fn: Callable, name: str, rows: bool = False) -> Callable:
        @functools.wraps(fn)  # the signature stays readable (the adapter inspects the forward's keywords)
        def timed(*args, **kwargs):
            if rows:
                ids = kwargs.get("input_ids", kwargs.get("decoder_input_ids", args[0] if args else None))
                self.rows[name] += int(ids.numel()) if torch.is_tensor(ids) else 0
                self.calls[name] += 1
            self.enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()

        return timed

    def report(self, total: float) -> dict[str, Any]:
        other = total - sum(self.seconds.values())
        parts = dict(sorted(self.seconds.items(), key=lambda kv: -kv[1]))
        parts["rest of the loop"] = max(other, 0.0)
        return {
            "seconds": total,
            "phases_s": {k: round(v, 5) for k, v in parts.items()},
            "phases_share": {k: round(v / total, 4) for k, v in parts.items()},
            "forward_rows": dict(self.rows),
            "forward_calls": dict(self.calls),
        }


@contextlib.contextmanager
def instrumented(ph: Phases, forwards: dict[str, nn.Module], attrs: list[tuple[Any, str, str]]) -> Iterator[None]:
    """Time every module in ``forwards`` (its ``forward``, which ``__call__`` and ``generate``'s direct ``self.forward``
    both reach) and every ``(owner, attribute, phase)`` in ``attrs``; everything is restored on exit."""
    saved = []
    try:
        for name, module in forwards.items():
            module.forward = ph.wrap(module.forward, name, rows=True)  # an instance attribute over the class's method
            saved.append((module, "forward", None))
        for owner, attr, name in attrs:
            original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            fn = original.__func__ if isinstance(original, staticmethod) else original
            wrapped = ph.wrap(fn, name)
            setattr(owner, attr, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
            saved.append((owner, attr, original))
        yield
    finally:
        for owner, attr, original in reversed(saved):
            if original is None:
                del owner.__dict__[attr]
            else:
                setattr(owner, attr, original)


MASKED_PHASES = [
    (masked, "gumbel_sample", "sampling"),
    (masked, "_scores", "confidence + selection"),
    (masked, "_num_to_unmask", "confidence + selection"),
    (masked._Recorder, "commit", "confidence + selection"),  # top-k (a stable sort) and the record's writes
    (masked, "_token_log_probs", "log-prob recording"),
    (masked, "_widen", "cache bookkeeping"),
    (dllm.MaskedDiffusionLM, "new_cache", "cache bookkeeping"),
    (dllm.MaskedDiffusionLM, "drop_from_cache", "cache bookkeeping"),
    (dllm.MaskedDiffusionLM, "logits", "adapter (masks, positions, float32)"),
    (dllm.MaskedDiffusionLM, "raw_logits", "adapter (masks, positions, float32)"),
    (dllm.MaskedDiffusionLM, "cached_logits", "adapter (masks, positions, float32)"),
]
GEMMA_PHASES = [
    (eb, "_sample_tokens", "sampling"),
    (eb, "_random_tokens", "sampling"),
    (eb._Tools, "scaled", "temperature schedule"),
    (eb._Tools, "kept", "confidence + selection"),  # transformers' entropy-bound selection
    (eb, "_token_log_probs", "log-prob recording"),
    (eb._Record, "step", "log-prob recording"),  # the record's writes
    (eb, "finish_canvas", "canvas bookkeeping"),
    (dg.BlockSession, "finish_canvas", "canvas bookkeeping"),
    (dg.BlockSession, "encode", "adapter (masks, positions, float32)"),
]


# ---------------------------------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    about: str
    kind: str  # masked | gemma
    lm: Any
    ids: Tensor
    mask: Tensor
    settings: dict[str, Any]
    modes: dict[str, Callable[[int, Callable], Tensor]] = field(default_factory=dict)
    reference: dict[str, str] = field(default_factory=dict)  # mode -> the mode it is compared with

    @property
    def tokens(self) -> int:
        return self.ids.shape[0] * self.settings["gen_length"]


def masked_case(name: str, about: str, lm, ids: Tensor, mask: Tensor, gen_length: int, steps: int, block_length: int) -> Case:
    settings = dict(gen_length=gen_length, steps=steps, block_length=block_length)
    case = Case(name, about, "masked", lm, ids, mask, dict(settings, batch=ids.shape[0], prompt_length=ids.shape[1]))
    cache = getattr(lm, "supports_cache", False)

    def reference(temperature: float):
        def run(seed: int, phase: Callable) -> Tensor:
            torch.manual_seed(seed)
            return reference_generate(lm.raw_logits, ids, mask, steps, gen_length, block_length, temperature, lm.mask_token_id, phase=phase)

        return run

    def flowrl(temperature: float, kv_cache: str):
        def run(seed: int, phase: Callable) -> Tensor:
            gen = torch.Generator().manual_seed(seed) if temperature == 0 else RowGenerators.keyed(0, seed, "rollout", range(ids.shape[0]))
            traj = masked.generate(
                lm, ids, mask, gen_length, steps, block_length, temperature=temperature, generator=gen, kv_cache=kv_cache
            )
            return traj.completion_ids

        return run

    for t, tag in ((0.0, "T=0"), (1.0, "T=1")):
        case.modes[f"reference loop {tag}"] = reference(t)
        case.modes[f"flowrl full sequence {tag}"] = flowrl(t, "none")
        case.reference[f"flowrl full sequence {tag}"] = f"reference loop {tag}"
        if cache:
            case.modes[f"flowrl block cache {tag}"] = flowrl(t, "exact")
            case.reference[f"flowrl block cache {tag}"] = f"reference loop {tag}"
    return case


def gemma_case(name: str, about: str, lm: dg.DiffusionGemmaLM, ids: Tensor, gen_length: int, steps: int) -> Case:
    mask = torch.ones_like(ids, dtype=torch.bool)
    settings = eb.resolve_settings(lm, eb.EntropyBoundSamplerConfig(gen_length=gen_length, steps=steps))
    info = dict(gen_length=gen_length, steps=steps, canvas_length=lm.canvas_length, batch=ids.shape[0], prompt_length=ids.shape[1])
    case = Case(name, about, "gemma", lm, ids, mask, info)

    def generate(seed: int, phase: Callable) -> Tensor:
        torch.manual_seed(seed)
        out = lm.model.generate(ids, attention_mask=mask, max_new_tokens=gen_length, max_denoising_steps=steps)
        new = out.sequences[:, ids.shape[1] :]
        pad = settings.pad_token_id if settings.pad_token_id is not None else 0
        return F.pad(new, (0, settings.completion_length - new.shape[1]), value=pad)  # rows all finished early: padding

    def flowrl(rows: bool):
        def run(seed: int, phase: Callable) -> Tensor:
            gen = RowGenerators.keyed(0, seed, "rollout", range(ids.shape[0])) if rows else torch.Generator().manual_seed(seed)
            return eb.generate(lm, ids, mask, settings, gen).completion_ids

        return run

    case.modes = {"transformers generate": generate, "flowrl, one generator": flowrl(False), "flowrl, row streams": flowrl(True)}
    case.reference = {"flowrl, one generator": "transformers generate", "flowrl, row streams": "transformers generate"}
    return case


def build_cases(quick: bool) -> list[Case]:
    batch = 4 if quick else 16
    items = prompt_pool("arith", "eval", batch)
    prompts = [p for p, _ in items]
    mdlm = dllm.load_masked_lm(str(dllm.EMBEDDED_LMS["arith_mdlm"]))
    bd = dllm.load_masked_lm(str(dllm.EMBEDDED_LMS["arith_bd3lm"]))
    mdlm.model.eval(), bd.model.eval()
    cases = []
    ids, mask = encode_prompts(mdlm, prompts, 24)
    cases.append(masked_case("arith_mdlm", "embedded, trained (BERT-style, 0.5 M parameters)", mdlm, ids, mask, 16, 8, 16))
    ids, mask = encode_prompts(bd, prompts, 24)
    cases.append(masked_case("arith_bd3lm", "embedded, trained (block-causal Llama, blocks of 4)", bd, ids, mask, 16, 16, 4))
    with tempfile.TemporaryDirectory() as tmp:
        tiny = dg.load_diffusion_gemma(str(dg.write_tiny_random(tmp)))
    tiny.model.eval()
    g_ids = torch.randint(4, 70, (batch, 12), generator=torch.Generator().manual_seed(0))
    cases.append(gemma_case("diffusion_gemma_tiny", "the plumbing preset's random model (width 32, vocabulary 75)", tiny, g_ids, 24, 8))
    if quick:
        return cases
    ids = torch.randint(0, 126000, (1, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    lm = llada_random(512, 4)
    about = "LLaDA layout, vocabulary 126464, 4 layers of width 512, random"
    cases.append(masked_case("llada_random", about, lm, ids, mask, 32, 16, 16))
    lm = bd3lm_random(512, 4)
    about = "block-causal Llama (blocks of 4), vocabulary 126464, 4 layers of width 512, random"
    cases.append(masked_case("bd3lm_random", about, lm, ids, mask, 32, 16, 4))
    lm = diffusion_gemma_random(262144, 256, 16)
    g_ids = torch.randint(3, 262000, (1, 16), generator=torch.Generator().manual_seed(0))
    about = "vocabulary 262144, canvases of 16, 2 layers of width 256, 4 experts, random"
    cases.append(gemma_case("diffusion_gemma_random", about, lm, g_ids, 16, 8))
    return cases


def forwards_of(case: Case) -> dict[str, nn.Module]:
    if case.kind == "gemma":
        return {"model forward (decoder)": case.lm.model, "model forward (encoder)": case.lm.model.model.encoder}
    return {"model forward": case.lm.model}


def time_modes(case: Case, repeats: int, warm_up: bool) -> tuple[dict[str, list[float]], dict[str, Tensor]]:
    """Each mode's wall times over the repeats (alternating order) and its first repeat's tokens."""
    times: dict[str, list[float]] = {m: [] for m in case.modes}
    outputs: dict[str, Tensor] = {}
    if warm_up:  # one untimed call per mode: the process's first-call costs (imports, set-up) are not a rollout's
        for fn in case.modes.values():
            fn(0, _no_phase)
    for r in range(repeats):
        for m in list(case.modes) if r % 2 == 0 else list(reversed(case.modes)):
            t0 = time.perf_counter()
            out = case.modes[m](r, _no_phase)
            times[m].append(time.perf_counter() - t0)
            outputs.setdefault(m, out)
    return times, outputs


def profile_mode(case: Case, fn: Callable) -> Phases:
    """One more generation with phase timers (the profile pass); returns the phases and the total."""
    ph = Phases()
    with instrumented(ph, forwards_of(case), GEMMA_PHASES if case.kind == "gemma" else MASKED_PHASES):
        t0 = time.perf_counter()
        fn(0, ph.phase)
        ph.total = time.perf_counter() - t0
    return ph


def tokens_equal(case: Case, outputs: dict[str, Tensor]) -> dict[str, bool]:
    """Temperature 0 (masked): flowrl's tokens against the reference loop's; DiffusionGemma: against generate's."""
    if case.kind == "gemma":
        key = "flowrl, one generator == transformers generate (same seed)"
        return {key: bool(torch.equal(outputs["flowrl, one generator"], outputs["transformers generate"]))}
    ref = outputs["reference loop T=0"]
    modes = [m for m in ("flowrl full sequence T=0", "flowrl block cache T=0") if m in outputs]
    return {f"{m} == reference loop T=0": bool(torch.equal(outputs[m], ref)) for m in modes}


def run_case(case: Case, repeats: int, warm_up: bool) -> dict[str, Any]:
    times, outputs = time_modes(case, repeats, warm_up)
    modes: dict[str, Any] = {}
    for m, ts in times.items():
        median = statistics.median(ts)
        modes[m] = {"seconds": [round(t, 5) for t in ts], "median_s": round(median, 5), "tokens_per_s": round(case.tokens / median, 2)}
    for m, ref in case.reference.items():
        modes[m]["speed_x_reference"] = round(statistics.median(times[ref]) / statistics.median(times[m]), 3)
        modes[m]["reference"] = ref
    for m, fn in case.modes.items():
        ph = profile_mode(case, fn)
        modes[m].update(profile=ph.report(ph.total), forward_rows=sum(ph.rows.values()), forward_calls=sum(ph.calls.values()))
    return {
        "case": case.name,
        "model": case.about,
        "settings": case.settings,
        "tokens_per_generation": case.tokens,
        "modes": modes,
        "tokens_equal": tokens_equal(case, outputs),
    }


def print_case(res: dict[str, Any]) -> None:
    s = res["settings"]
    print(f"\n{res['case']}: {res['model']}; {s['batch']} prompts of {s['prompt_length']}, {s['gen_length']} tokens, {s['steps']} steps")
    print(f"  {'mode':<28} {'s/gen':>8} {'tok/s':>9} {'fwd rows':>9} {'x ref':>6}  top phases (share of the profiled run)")
    for m, v in res["modes"].items():
        top = list(v["profile"]["phases_share"].items())[:3]
        phases = ", ".join(f"{k} {100 * share:.0f}%" for k, share in top)
        ratio = f"{v['speed_x_reference']:6.2f}" if "speed_x_reference" in v else "     -"
        print(f"  {m:<28} {v['median_s']:8.3f} {v['tokens_per_s']:9.1f} {v['forward_rows']:9d} {ratio}  {phases}")
    for k, v in res["tokens_equal"].items():
        print(f"  tokens equal: {k}: {v}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="repeats of the cases on the embedded and tiny models")
    p.add_argument("--repeats-large", type=int, default=2, help="repeats of the cases at a larger size")
    p.add_argument("--quick", action="store_true", help="the three tiny cases, 4 prompts, one repeat (the test's mode)")
    p.add_argument("--json", type=Path, help="where to write the record (default bench/results/dllm_rollout_speed.json)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for case in build_cases(a.quick):
        repeats = 1 if a.quick else a.repeats_large if case.name.endswith("_random") else a.repeats
        res = run_case(case, repeats, warm_up=not case.name.endswith("_random"))
        print_case(res)
        results.append(res)
    rec = {
        "about": __doc__.split("\n\n")[0],
        **record.stamp(record.this_command()),
        "threads": torch.get_num_threads(),
        "repeats": {"small": 1 if a.quick else a.repeats, "large": a.repeats_large},
        "cases": results,
    }
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(rec, indent=1) + "\n")
    elif not a.quick:
        record.write("dllm_rollout_speed", rec)
    return rec


if __name__ == "__main__":
    main()
