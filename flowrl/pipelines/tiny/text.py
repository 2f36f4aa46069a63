"""Tiny diffusion language models with the embedded arithmetic tokenizer: a masked-diffusion LM (BertForMaskedLM,
arith_mdlm's class), a block-diffusion LM (LlamaForCausalLM with block-causal attention, arith_bd3lm's class) and
DiffusionGemma (transformers' DiffusionGemmaForBlockDiffusion), random weights at a tiny config."""

from __future__ import annotations

from pathlib import Path

import torch

from ...data.arith import COMPLETION_LEN, PROMPT_LEN, build_tokenizer, vocabulary


def build_tiny_mdlm(directory, seed: int = 0):
    """arith_mdlm's architecture (a bidirectional BertForMaskedLM) at 2 layers of width 32, with its tokenizer."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=len(vocabulary()),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=PROMPT_LEN + COMPLETION_LEN,
        type_vocab_size=1,
        pad_token_id=0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(seed)
    return _save(BertForMaskedLM(config), directory)


def build_tiny_bd3lm(directory, block_length: int = 4, seed: int = 0):
    """arith_bd3lm's architecture (a LlamaForCausalLM run with block-causal attention: the config's
    ``diffusion_block_length``) at 2 layers of width 32, with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(vocabulary()),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    config.diffusion_block_length = block_length  # read by flowrl's load_masked_lm: block-causal attention
    config.mask_token_id = tokenizer.mask_token_id
    torch.manual_seed(seed)
    return _save(LlamaForCausalLM(config), directory)


def _save(model, directory) -> Path:
    model.eval().save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return Path(directory)


def build_tiny_diffusion_gemma(directory, seed: int = 0):
    """A 2-layer DiffusionGemma (canvas of 8 tokens, 2 experts) with the arithmetic tokenizer: the plumbing preset's
    model (``pipeline.pretrained: diffusion_gemma_tiny_random``), written to ``directory``."""
    from ..diffusion_gemma import write_tiny_random

    return write_tiny_random(directory, seed)
