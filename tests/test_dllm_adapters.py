"""Masked-diffusion LM adapters (flowrl.pipelines.dllm) on tiny in-process checkpoints.

LLaDA / MMaDA / Dream are remote code that cannot be imported here, so the adapter is exercised on
(a) real transformers classes at tiny size -- BertForMaskedLM (bidirectional masked-LM logits) and
Qwen2ForCausalLM (the Qwen2 stack Dream adapts, to check the Dream logit shift and 4-D mask), and
(b) a faithful tiny *remote-code* checkpoint: ``configuration_tinyllada.py`` / ``modeling_tinyllada.py``
written next to the weights, with LLaDA's layout (``model.transformer.{wte, blocks.N.{q_proj, k_proj,
v_proj, attn_out, ff_proj, up_proj, ff_out}, ln_f, ff_out}``, the LM head sharing the ``ff_out`` name),
LLaDA's vocabulary size (126464, so the 126336 mask default is real) and an ``auto_map`` in config.json.
Every model is saved with ``save_pretrained`` and loaded back through ``load_masked_lm``.
"""

from __future__ import annotations

import importlib
import json
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from flowrl.errors import FlowRLError  # noqa: E402
from flowrl.pipelines.dllm import LLADA_MASK_TOKEN_ID, MaskedDiffusionLM, load_masked_lm  # noqa: E402
from flowrl.types import MaskedLM  # noqa: E402

LLADA_VOCAB = 126464

CONFIGURATION_TINYLLADA = """
from transformers import PretrainedConfig


class TinyLLaDAConfig(PretrainedConfig):
    model_type = "tinyllada"

    def __init__(self, vocab_size=126464, d_model=16, n_heads=2, n_layers=2, mlp_hidden_size=32,
                 max_sequence_length=64, rope_theta=10000.0, rms_norm_eps=1e-5, **kwargs):
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_layers = n_layers
        self.mlp_hidden_size = mlp_hidden_size
        self.max_sequence_length = max_sequence_length
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
"""

MODELING_TINYLLADA = '''
"""A tiny stand-in for LLaDA's modeling_llada.py: same module names, bidirectional attention."""
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_tinyllada import TinyLLaDAConfig


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x, positions, theta):
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions[..., None].float() * freqs  # (L, half)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class LLaDALlamaBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, self.n_heads, self.theta = config.d_model, config.n_heads, config.rope_theta
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        self.ff_norm = RMSNorm(d, config.rms_norm_eps)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_proj = nn.Linear(d, config.mlp_hidden_size, bias=False)
        self.up_proj = nn.Linear(d, config.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(config.mlp_hidden_size, d, bias=False)

    def forward(self, x, key_mask):
        B, L, D = x.shape
        h = self.attn_norm(x)
        q, k, v = (p(h).view(B, L, self.n_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        pos = torch.arange(L, device=x.device)
        q, k = rotate(q, pos, self.theta), rotate(k, pos, self.theta)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, is_causal=False)  # bidirectional
        x = x + self.attn_out(att.transpose(1, 2).reshape(B, L, D))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


class TinyLLaDAModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.d_model),
            blocks=nn.ModuleList([LLaDALlamaBlock(config) for _ in range(config.n_layers)]),
            ln_f=RMSNorm(config.d_model, config.rms_norm_eps),
            ff_out=nn.Linear(config.d_model, config.vocab_size, bias=False),  # LM head, named like LLaDA's
        ))

    def forward(self, input_ids, attention_mask=None):
        x = self.transformer.wte(input_ids)
        key_mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        for block in self.transformer.blocks:
            x = block(x, key_mask)
        return self.transformer.ff_out(self.transformer.ln_f(x))


class TinyLLaDAModelLM(PreTrainedModel):
    config_class = TinyLLaDAConfig
    base_model_prefix = "model"
    _no_split_modules = ["LLaDALlamaBlock"]

    def __init__(self, config):
        super().__init__(config)
        self.model = TinyLLaDAModel(config)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.2)

    def get_input_embeddings(self):
        return self.model.transformer.wte

    def get_output_embeddings(self):
        return self.model.transformer.ff_out

    def forward(self, input_ids=None, attention_mask=None, use_cache=None, return_dict=None, **kwargs):
        return CausalLMOutputWithPast(logits=self.model(input_ids, attention_mask))
'''


def _word_tokenizer(words: list[str], **special: str):
    """A tiny fast tokenizer (WordLevel) with the given special tokens, saved and reloaded by AutoTokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", **special)


# ---------------------------------------------------------------------------------------------
# fixtures: checkpoints written once per module
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_ckpt(tmp_path_factory):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bert")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(59)]
    config = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, max_position_embeddings=32
    )
    model = BertForMaskedLM(config).eval()
    model.save_pretrained(path)
    _word_tokenizer(words, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]").save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def qwen2_ckpt(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen2")
    words = ["<|endoftext|>", "[UNK]", "<|mask|>"] + [f"w{i}" for i in range(61)]
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(path)
    _word_tokenizer(words, eos_token="<|endoftext|>", pad_token="<|endoftext|>", mask_token="<|mask|>").save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def tinyllada_ckpt(tmp_path_factory):
    """Write the remote-code source as a package, instantiate it, register it for AutoModel, save."""
    root = tmp_path_factory.mktemp("tinyllada_src")
    package = "tinyllada_src_pkg"
    (root / package).mkdir()
    (root / package / "__init__.py").write_text("")
    (root / package / "configuration_tinyllada.py").write_text(textwrap.dedent(CONFIGURATION_TINYLLADA))
    (root / package / "modeling_tinyllada.py").write_text(textwrap.dedent(MODELING_TINYLLADA))
    sys.path.insert(0, str(root))
    try:
        conf_mod = importlib.import_module(f"{package}.configuration_tinyllada")
        model_mod = importlib.import_module(f"{package}.modeling_tinyllada")
        conf_mod.TinyLLaDAConfig.register_for_auto_class()
        model_mod.TinyLLaDAModelLM.register_for_auto_class("AutoModel")
        torch.manual_seed(0)
        model = model_mod.TinyLLaDAModelLM(conf_mod.TinyLLaDAConfig()).eval()
        path = tmp_path_factory.mktemp("tinyllada")
        model.save_pretrained(path)
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m.startswith(package)]:
            del sys.modules[name]
    words = ["<|endoftext|>", "[UNK]"] + [f"w{i}" for i in range(30)]
    _word_tokenizer(words, eos_token="<|endoftext|>").save_pretrained(path)  # no mask token, like LLaDA's
    return path, model


def _ids(vocab: int, batch: int = 2, length: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (batch, length), generator=g)


# ---------------------------------------------------------------------------------------------
# (a) real transformers classes
# ---------------------------------------------------------------------------------------------


def test_bert_round_trip_auto_family(bert_ckpt):
    path, original = bert_ckpt
    lm = load_masked_lm(str(path), family="auto")
    assert isinstance(lm, MaskedLM) and type(lm.model).__name__ == "BertForMaskedLM"
    assert lm.mask_token_id == lm.tokenizer.convert_tokens_to_ids("[MASK]") == 4
    assert not lm.shift_logits and lm.attends_bidirectionally()
    ids = _ids(64)
    ids[:, 3] = lm.mask_token_id
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    with torch.no_grad():
        expected = original(input_ids=ids, attention_mask=mask).logits
        got = lm.logits(ids, mask)
    assert got.shape == (2, 8, 64) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # full fine-tuning: everything trainable, the reference is a frozen copy taken at first use
    assert len(lm.trainable_parameters()) == len(list(lm.model.parameters()))
    with torch.no_grad():
        with lm.reference():
            ref0 = lm.logits(ids, mask)
        lm.model.cls.predictions.decoder.bias.add_(1.0)  # "train" the policy
        with lm.reference():
            torch.testing.assert_close(lm.logits(ids, mask), ref0, rtol=0, atol=0)
        assert not torch.allclose(lm.logits(ids, mask), ref0)


def test_bert_lora_all_linear_default(bert_ckpt):
    path, _ = bert_ckpt
    lm = load_masked_lm(str(path), lora={"r": 4, "alpha": 8})
    names = [n for n, p in lm.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert not any("decoder" in n for n in names)  # peft's all-linear leaves the LM head alone


def test_qwen2_dream_shift(qwen2_ckpt):
    """family=dream: position i's logits are the model's output at i-1; position 0 keeps its own output."""
    path, original = qwen2_ckpt
    lm = load_masked_lm(str(path), family="dream")
    assert lm.shift_logits and lm.attention == "dream"
    assert lm.mask_token_id == 2 and lm.eos_token_id == 0
    ids = _ids(64)
    with torch.no_grad():
        raw = lm.raw_logits(ids).float()
        got = lm.logits(ids)
        # Dream's convention: all-True 4-D boolean mask (full attention) and positions 0..L-1
        full = torch.ones(2, 1, 8, 8, dtype=torch.bool)
        expected_raw = original(input_ids=ids, attention_mask=full, position_ids=torch.arange(8).expand(2, -1)).logits
    torch.testing.assert_close(raw, expected_raw, rtol=0, atol=0)
    torch.testing.assert_close(got[:, 1:], raw[:, :-1], rtol=0, atol=0)
    torch.testing.assert_close(got[:, 0], raw[:, 0], rtol=0, atol=0)
    # the 4-D mask makes the Qwen2 stack attend both ways, as Dream's does
    assert lm.attends_bidirectionally()


def test_dream_left_padding_matches_unpadded(qwen2_ckpt):
    path, _ = qwen2_ckpt
    lm = load_masked_lm(str(path), family="dream")
    ids = _ids(64, batch=1, length=6)
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], dim=1)
    with torch.no_grad():
        plain, pad = lm.logits(ids), lm.logits(padded, mask)
    assert torch.isfinite(pad).all()
    # shifted position 0 of a row is its own output (no predecessor); compare positions 1.. of the real tokens
    torch.testing.assert_close(pad[:, 3:], plain[:, 1:], rtol=1e-5, atol=1e-5)


def test_causal_model_is_refused(qwen2_ckpt):
    path, _ = qwen2_ckpt
    with pytest.raises(FlowRLError, match="bidirectional"):
        load_masked_lm(str(path), family="auto")
    lm = load_masked_lm(str(path), family="auto", require_bidirectional=False)
    assert type(lm.model).__name__ == "Qwen2ForCausalLM" and not lm.attends_bidirectionally()


def test_constructor_shift_on_any_model(qwen2_ckpt):
    _, model = qwen2_ckpt
    lm = MaskedDiffusionLM(model, None, mask_token_id=2, eos_token_id=0, shift_logits=True)
    ids = _ids(64)
    with torch.no_grad():
        out = model(input_ids=ids).logits
        got = lm.logits(ids)
    torch.testing.assert_close(got, torch.cat([out[:, :1], out[:, :-1]], 1), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# (b) faithful tiny remote-code checkpoint (LLaDA layout)
# ---------------------------------------------------------------------------------------------


def test_remote_code_checkpoint_layout(tinyllada_ckpt):
    path, _ = tinyllada_ckpt
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "tinyllada"
    assert config["auto_map"]["AutoModel"] == "modeling_tinyllada.TinyLLaDAModelLM"
    assert (path / "modeling_tinyllada.py").is_file() and (path / "configuration_tinyllada.py").is_file()


def test_remote_code_needs_opt_in(tinyllada_ckpt):
    path, _ = tinyllada_ckpt
    with pytest.raises(FlowRLError) as info:
        load_masked_lm(str(path), family="llada")
    message = str(info.value)
    assert "pipeline.trust_remote_code=true" in message and "\n" not in message and message.count(". ") == 0


def test_remote_code_loads_and_matches(tinyllada_ckpt):
    path, original = tinyllada_ckpt
    lm = load_masked_lm(str(path), family="llada", trust_remote_code=True)
    assert type(lm.model).__name__ == "TinyLLaDAModelLM"
    assert type(lm.model).__module__.startswith("transformers_modules")  # the checkpoint's own code ran
    assert lm.mask_token_id == LLADA_MASK_TOKEN_ID  # tokenizer has none -> LLaDA default
    assert lm.eos_token_id == 0 and not lm.shift_logits and lm.attends_bidirectionally()
    ids = _ids(LLADA_VOCAB)
    ids[:, 2:5] = LLADA_MASK_TOKEN_ID
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        torch.testing.assert_close(lm.logits(ids, mask), original(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=0)
    assert lm.logits(ids).shape == (2, 8, LLADA_VOCAB)


def test_remote_code_lora_reference(tinyllada_ckpt, tmp_path):
    path, _ = tinyllada_ckpt
    lm = load_masked_lm(str(path), family="llada", trust_remote_code=True)
    ids = _ids(LLADA_VOCAB, seed=1)
    targets = ids.clone()
    ids[:, 3:] = lm.mask_token_id
    with torch.no_grad():
        base = lm.logits(ids)

    lm = load_masked_lm(str(path), family="llada", trust_remote_code=True, lora={"r": 4, "alpha": 8, "dropout": 0.0})
    trainable = [n for n, p in lm.model.named_parameters() if p.requires_grad]
    wrapped = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable})
    assert all("lora_" in n for n in trainable)
    assert wrapped == ["attn_out", "ff_out", "ff_proj", "k_proj", "q_proj", "up_proj", "v_proj"]
    assert not any(n.startswith("base_model.model.model.transformer.ff_out") for n in trainable)  # not the LM head
    assert len(trainable) == 2 * 7 * 2  # A and B, 7 projections, 2 blocks
    assert {id(p) for p in lm.trainable_parameters()} == {id(p) for p in lm.model.parameters() if p.requires_grad}

    with torch.no_grad():
        torch.testing.assert_close(lm.logits(ids), base, rtol=0, atol=1e-6)  # LoRA B starts at zero
    # one real optimizer step on the masked positions
    opt = torch.optim.Adam(lm.trainable_parameters(), lr=1e-2)
    logits = lm.logits(ids)
    loss = torch.nn.functional.cross_entropy(logits[:, 3:].reshape(-1, LLADA_VOCAB), targets[:, 3:].reshape(-1))
    loss.backward()
    opt.step()
    with torch.no_grad():
        trained = lm.logits(ids)
        assert not torch.allclose(trained, base, atol=1e-4)
        with lm.reference():
            torch.testing.assert_close(lm.logits(ids), base, rtol=0, atol=1e-6)
        torch.testing.assert_close(lm.logits(ids), trained, rtol=0, atol=0)  # adapter back on

    # save_lora -> reload through lora.path gives the trained policy
    lm.save_lora(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    again = load_masked_lm(str(path), family="llada", trust_remote_code=True, lora={"path": str(tmp_path / "adapter")})
    with torch.no_grad():
        torch.testing.assert_close(again.logits(ids), trained, rtol=0, atol=1e-6)


def test_auto_family_on_unknown_model_type(tinyllada_ckpt):
    """family=auto only applies LLaDA defaults to model_type llada/mmada; otherwise the mask id must be given."""
    path, _ = tinyllada_ckpt
    with pytest.raises(FlowRLError, match="mask token"):
        load_masked_lm(str(path), family="auto", trust_remote_code=True)
    lm = load_masked_lm(str(path), family="auto", trust_remote_code=True, mask_token_id=LLADA_MASK_TOKEN_ID)
    assert lm.family == "auto" and lm.mask_token_id == LLADA_MASK_TOKEN_ID and not lm.shift_logits


def test_bad_paths_and_options(tmp_path, bert_ckpt):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FlowRLError, match="no_such_model"):
        load_masked_lm(str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FlowRLError, match="config.json"):
        load_masked_lm(str(tmp_path / "empty"))
    path, _ = bert_ckpt
    with pytest.raises(FlowRLError, match="family"):
        load_masked_lm(str(path), family="gpt")
    with pytest.raises(FlowRLError, match="rank"):
        load_masked_lm(str(path), lora={"rank": 8})
    with pytest.raises(FlowRLError, match="LoRA"):
        load_masked_lm(str(path), lora={"target_modules": ["no_such_module"]})
    with pytest.raises(FlowRLError, match="outside the vocabulary"):
        load_masked_lm(str(path), mask_token_id=10_000)
