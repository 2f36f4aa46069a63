"""Tiny diffusion language models with the embedded arithmetic tokenizer: a masked-diffusion LM (BertForMaskedLM,
arith_mdlm's class), a block-diffusion LM (LlamaForCausalLM with block-causal attention, arith_bd3lm's class) and
DiffusionGemma (transformers' DiffusionGemmaForBlockDiffusion), random weights at a tiny config."""

from __future__ import annotations

from pathlib import Path

import torch

from ...data.arith import build_tokenizer


def build_tiny_mdlm(directory, seed: int = 0):
    """arith_mdlm's architecture (a bidirectional BertForMaskedLM) at 2 layers of width 32, with its tokenizer."""
    from ..embedded.train_arith import build_model

    torch.manual_seed(seed)
    return _save(build_model(hidden=32, layers=2, heads=2), directory)


def build_tiny_bd3lm(directory, block_length: int = 4, seed: int = 0):
    """arith_bd3lm's architecture (a LlamaForCausalLM run with block-causal attention: the config's
    ``diffusion_block_length``) at 2 layers of width 32, with its tokenizer."""
    from ..embedded.train_arith_bd3lm import build_model

    torch.manual_seed(seed)
    return _save(build_model(block_length, hidden=32, layers=2, heads=2), directory)


def _save(model, directory) -> Path:
    model.eval().save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return Path(directory)


def build_tiny_diffusion_gemma(directory, seed: int = 0):
    """A 2-layer DiffusionGemma (canvas of 8 tokens, 2 experts) with the arithmetic tokenizer: the plumbing preset's
    model (``pipeline.pretrained: diffusion_gemma_tiny_random``), written to ``directory``."""
    from ..diffusion_gemma import write_tiny_random

    return write_tiny_random(directory, seed)
