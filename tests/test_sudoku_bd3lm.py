"""The block-diffusion Sudoku LM (train_sudoku_bd3lm.py, block_elbo's model in bench/sudoku_rl_comparison.py) and the
generalised arith_bd3lm builder and loss it reuses: arith's loss unchanged, the loss on the Sudoku shapes against a
per-block hand computation through flowrl's loader, and the script's model loading back with blocks of 9."""

from __future__ import annotations

import pytest
import torch

from flowrl.data import arith, sudoku
from flowrl.pipelines.dllm import load_masked_lm
from flowrl.pipelines.embedded.train_arith import encode as encode_arith
from flowrl.pipelines.embedded.train_arith_bd3lm import block_diffusion_loss, build_model
from flowrl.pipelines.embedded.train_sudoku import encode as encode_sudoku
from flowrl.samplers.masked import generate

BLOCK = 9  # two blocks of the 18-token completion: <answer> and rows 1-2, rows 3-4 and </answer>


def test_arith_loss_is_the_value_before_the_generalisation():
    """On a fixed seed the default call (arith's vocabulary, PROMPT_LEN, COMPLETION_LEN) gives the value measured
    before block_diffusion_loss took the lengths as arguments, and passing arith's own values changes nothing."""
    torch.manual_seed(0)
    model = build_model(4, hidden=32, layers=2, heads=2)
    tok = arith.build_tokenizer()
    ids, attn = encode_arith(tok, arith.problems("train", 6, 0, 0.3))
    default = block_diffusion_loss(4)(model, tok, ids, attn, torch.Generator().manual_seed(1))
    explicit = block_diffusion_loss(4, arith.PROMPT_LEN, arith.COMPLETION_LEN)(model, tok, ids, attn, torch.Generator().manual_seed(1))
    assert default.item() == pytest.approx(4.358518600463867, rel=1e-5)  # measured at 502743e, before the change
    assert torch.equal(default, explicit)


@pytest.fixture(scope="module")
def sudoku_lm(tmp_path_factory):
    """A tiny Sudoku block-diffusion model at random weights, saved and loaded back through load_masked_lm."""
    path = tmp_path_factory.mktemp("sudoku_bd3lm")
    tok = sudoku.build_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_model(BLOCK, hidden=32, layers=2, heads=2, tokenizer=tok, vocab_size=len(sudoku.vocabulary()))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return load_masked_lm(str(path))


def test_sudoku_loss_equals_the_per_block_hand_computation(sudoku_lm):
    """The vectorised loss on [prompt ; x_t ; x_0] equals the mean cross-entropy of the masked tokens computed block by
    block in the sampling-time context: block b's logits from (prompt, clean blocks < b, noised block b) through the
    loaded model's block-causal forward. The mask is the loss's own draws from the same seed (one rate per block,
    then one uniform per token, then one forced position per row)."""
    lm = sudoku_lm
    assert lm.block_length == BLOCK and lm.supports_cache
    pairs = [sudoku.example(p, s) for p, s in sudoku.train_puzzles(5, seed=3, exclude=set())]  # no shared file needed
    ids = encode_sudoku(lm.tokenizer, pairs)
    P, G, B = sudoku.PROMPT_LEN, sudoku.COMPLETION_LEN, ids.shape[0]
    with torch.no_grad():
        loss = block_diffusion_loss(BLOCK, P, G)(lm.model, lm.tokenizer, ids, torch.ones_like(ids), torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(7)
    t = torch.rand(B, G // BLOCK, generator=gen).repeat_interleave(BLOCK, 1)
    masked = torch.rand(B, G, generator=gen) < t
    masked[torch.arange(B), torch.randint(0, G, (B,), generator=gen)] = True
    x0 = ids[:, P:]
    xt = torch.where(masked, lm.mask_token_id, x0)
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(G // BLOCK):
            lo, hi = b * BLOCK, (b + 1) * BLOCK
            logits = lm.logits(torch.cat([ids[:, :P], x0[:, :lo], xt[:, lo:hi]], 1))[:, P + lo :]
            logp = logits.log_softmax(-1).gather(-1, x0[:, lo:hi, None])[..., 0]
            total -= logp[masked[:, lo:hi]].sum().item()
            count += int(masked[:, lo:hi].sum())
    assert 0 < count < B * G
    assert loss.item() == pytest.approx(total / count, abs=1e-5)


def test_block_length_must_divide_the_completion(tmp_path):
    from flowrl.pipelines.embedded.train_sudoku_bd3lm import train

    with pytest.raises(SystemExit, match="must divide the completion length 18"):
        train(tmp_path / "m", steps=1, block_length=4)


def test_training_script_writes_a_loadable_block_model(tmp_path):
    from tests.conftest import skip_without_sudoku_file

    skip_without_sudoku_file("the training puzzles exclude the test puzzles, so training")
    from flowrl.pipelines.embedded.train_sudoku_bd3lm import train

    torch.set_num_threads(1)
    info = train(tmp_path / "m", steps=2, batch_size=4, num_puzzles=8, hidden=16, layers=1, heads=2)
    assert info["block_length"] == BLOCK and info["steps"] == 2 and "train_sudoku_bd3lm" in info["command"]
    lm = load_masked_lm(str(tmp_path / "m"))
    assert lm.model.config.diffusion_block_length == BLOCK and lm.block_length == BLOCK and lm.supports_cache
    assert lm.tokenizer.tokenize("<answer> 1 2 </answer>") == ["<answer>", "1", "2", "</answer>"]
    ids = lm.tokenizer([p for p, _ in sudoku.held_out(limit=3)], return_tensors="pt").input_ids
    kw = dict(gen_length=sudoku.COMPLETION_LEN, steps=sudoku.COMPLETION_LEN, block_length=BLOCK, temperature=0.0)
    cached = generate(lm, ids, torch.ones_like(ids), **kw, kv_cache="exact")
    full = generate(lm, ids, torch.ones_like(ids), **kw)
    assert cached.completion_ids.shape == (3, sudoku.COMPLETION_LEN) and torch.equal(cached.completion_ids, full.completion_ids)
