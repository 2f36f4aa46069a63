"""Block diffusion with an exact key-value cache (sampler.kv_cache=exact): block-causal attention through transformers'
own Llama at a tiny size, saved and loaded back through load_masked_lm; the cached generation against the
full-sequence one, the rollout's recorded log-probs against the objectives' full-sequence scoring paths, the training
mask against the sampling-time context, and the refusals."""

from __future__ import annotations

import pytest
import torch

from flowrl.data.arith import COMPLETION_LEN, PROMPT_LEN, build_tokenizer, problems
from flowrl.errors import FlowRLError
from flowrl.objectives.dllm.estimators import TrajectoryReplayEstimator
from flowrl.objectives.dllm.policy import DiffuGRPOConfig
from flowrl.pipelines.block_attention import (
    block_causal_mask,
    block_diffusion_training_mask,
    block_diffusion_training_positions,
    position_ids,
)
from flowrl.pipelines.dllm import EMBEDDED_LMS, load_masked_lm
from flowrl.pipelines.embedded.train_arith_bd3lm import build_model
from flowrl.samplers.masked import MaskedSamplerConfig, generate

BLOCK = 4


@pytest.fixture(scope="module")
def bd_lm(tmp_path_factory):
    """The shipped architecture (LlamaForCausalLM, diffusion_block_length 4) at random weights, through load_masked_lm."""
    path = tmp_path_factory.mktemp("bd3lm")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_model(BLOCK)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return load_masked_lm(str(path))


@pytest.fixture(scope="module")
def prompts(bd_lm):
    tok = bd_lm.tokenizer
    tok.padding_side = "left"
    texts = [p for p, _ in problems("eval", 6, seed=3)]
    enc = tok(texts, padding="max_length", max_length=PROMPT_LEN, truncation=True, return_tensors="pt")
    return enc.input_ids, enc.attention_mask.bool()


def test_loaded_model_is_block_causal(bd_lm):
    """Within a block every position sees every other; no position sees a later block (so the load-time probe, which
    tests inside one block, accepts it as a masked-diffusion model)."""
    assert bd_lm.block_length == BLOCK and bd_lm.supports_cache
    # the saved word-level tokenizer comes back (transformers 5 swaps in Qwen2's own for a Qwen2 config)
    assert bd_lm.tokenizer.tokenize("ann has 20 apples") == ["ann", "has", "20", "apples"]
    ids = torch.randint(4, 70, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, 9] = (changed[0, 9] + 1) % 70  # in the last block (positions 8..11, blocks aligned to the end)
    a, b = bd_lm.logits(ids), bd_lm.logits(changed)
    assert torch.equal(a[:, :8], b[:, :8])  # earlier blocks: bit-identical
    assert (a[:, 8] - b[:, 8]).abs().max() > 1e-4  # same block, an earlier position: it moved


@pytest.mark.parametrize("threshold", [None, 0.05])
def test_cached_greedy_generation_equals_full_sequence(bd_lm, prompts, threshold):
    """Greedy decoding with the cache gives the full-sequence (block-causal) generation's tokens, order and log-probs,
    with a fixed schedule and with dynamic (threshold) decoding."""
    ids, mask = prompts
    kw = dict(gen_length=COMPLETION_LEN, steps=8, block_length=BLOCK, temperature=0.0, threshold=threshold)
    full = generate(bd_lm, ids, mask, **kw)
    cached = generate(bd_lm, ids, mask, **kw, kv_cache="exact")
    assert torch.equal(full.completion_ids, cached.completion_ids)
    assert torch.equal(full.unmask_step, cached.unmask_step) and torch.equal(full.unmask_rank, cached.unmask_rank)
    torch.testing.assert_close(full.token_log_probs, cached.token_log_probs, atol=2e-6, rtol=0)


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_cached_rollout_rescored_by_full_sequence_replay(bd_lm, prompts, remasking):
    """At temperature 1 the cached rollout's recorded log-prob of every token equals what the full-sequence replay
    (TraceRL's estimator: one block-causal forward per step on the recorded states) computes: the cache changes
    nothing the scoring path sees, so the importance ratio of an unchanged policy is 1."""
    ids, mask = prompts
    traj = generate(
        bd_lm,
        ids,
        mask,
        COMPLETION_LEN,
        8,
        BLOCK,
        temperature=1.0,
        remasking=remasking,
        generator=torch.Generator().manual_seed(1),
        kv_cache="exact",
    )
    assert not (traj.completion_ids == bd_lm.mask_token_id).any()
    replay = TrajectoryReplayEstimator(1)(bd_lm, traj)
    torch.testing.assert_close(replay.token_log_probs, traj.token_log_probs, atol=2e-6, rtol=0)
    assert torch.exp(replay.token_log_probs.double() - traj.token_log_probs.double()).sub(1).abs().max() < 1e-5


def test_diffu_grpo_ratio_one_on_cached_rollout(bd_lm, prompts):
    """diffu-GRPO's scoring path (one block-causal forward, completion masked) re-scores a cached rollout at ratio 1."""
    ids, mask = prompts
    traj = generate(
        bd_lm, ids, mask, COMPLETION_LEN, 8, BLOCK, temperature=1.0, generator=torch.Generator().manual_seed(2), kv_cache="exact"
    )
    traj.group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    traj.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    traj.mask_seeds = torch.arange(6)[:, None]
    objective = DiffuGRPOConfig().build()
    objective.old_and_ref(bd_lm, traj)
    objective.prepare(traj)
    traj.inner_epoch = 0
    (out,) = list(objective.losses(bd_lm, None, traj, torch.Generator()))
    assert out.metrics["policy/ratio_mean"].item() == 1.0 and out.metrics["policy/clipfrac"].item() == 0.0


def test_training_mask_gives_each_block_its_sampling_context(bd_lm):
    """BD3-LM's vectorised training input [prompt ; x_t ; x_0], which the objectives' scoring also runs: the logits
    of noised block b equal those of the sampling-time sequence (prompt, clean blocks < b, noised block b, anything
    after) under block-causal attention."""
    gen = torch.Generator().manual_seed(4)
    B, P, G = 3, 8, 3 * BLOCK
    prompt = torch.randint(4, 70, (B, P), generator=gen)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :3] = 0  # left padding
    x0 = torch.randint(4, 70, (B, G), generator=gen)
    xt = torch.where(torch.rand(B, G, generator=gen) < 0.5, bd_lm.mask_token_id, x0)
    model = bd_lm.model
    train = model(
        input_ids=torch.cat([prompt, xt, x0], 1),
        attention_mask=block_diffusion_training_mask(prompt_mask, G, BLOCK, torch.float32),
        position_ids=block_diffusion_training_positions(prompt_mask, G),
    ).logits[:, P : P + G]
    # the objectives' scoring path (estimators.completion_logits) runs exactly this forward
    torch.testing.assert_close(bd_lm.block_diffusion_logits(prompt, prompt_mask, xt, x0), train, atol=0, rtol=0)
    keys = torch.cat([prompt_mask, torch.ones(B, G, dtype=torch.long)], 1)
    for b in range(G // BLOCK):
        lo, hi = b * BLOCK, (b + 1) * BLOCK
        later = torch.full((B, G - hi), bd_lm.mask_token_id)
        seq = torch.cat([prompt, x0[:, :lo], xt[:, lo:hi], later], 1)
        sampling = model(
            input_ids=seq, attention_mask=block_causal_mask(keys, BLOCK, torch.float32), position_ids=position_ids(keys)
        ).logits
        torch.testing.assert_close(train[:, lo:hi], sampling[:, P + lo : P + hi], atol=2e-6, rtol=0)


def test_refusals(bd_lm, prompts):
    ids, mask = prompts
    bidirectional = load_masked_lm(str(EMBEDDED_LMS["arith_mdlm"]))
    with pytest.raises(FlowRLError, match="kv_cache=exact needs a block-diffusion model"):
        generate(bidirectional, ids, mask, COMPLETION_LEN, 8, 16, kv_cache="exact")
    with pytest.raises(FlowRLError, match=r"sampler.block_length \(8\) must equal the model's block length \(4\)"):
        generate(bd_lm, ids, mask, COMPLETION_LEN, 8, 8)
    with pytest.raises(FlowRLError, match="low_confidence or random"):
        generate(
            bd_lm, ids, mask, COMPLETION_LEN, 8, BLOCK, remasking="policy", position_scorer=lambda lg, st: lg[..., 0], kv_cache="exact"
        )
    with pytest.raises(ValueError, match="kv_cache"):
        MaskedSamplerConfig(kv_cache="prefix")


def test_shipped_arith_bd3lm_generates_the_same_with_and_without_the_cache():
    """The embedded block-diffusion model loads by name through the pipeline section (block length 4, its word-level
    tokenizer), and greedy decoding of held-out problems is the same with the cache as without; its answers are the
    task's answers (the accuracy itself is measured in bench/block_cache.py)."""
    from flowrl.pipelines.dllm import DLLMPipelineConfig
    from flowrl.reward_models import build_reward
    from flowrl.samplers.text_generation import generate_texts

    lm = DLLMPipelineConfig(pretrained="arith_bd3lm").build("cpu")
    assert lm.block_length == 4 and lm.tokenizer.tokenize("ann has 20 apples") == ["ann", "has", "20", "apples"]
    items = problems("eval", 16, seed=0)
    prompts = [p for p, _ in items]
    runs = {}
    for kv_cache in ("none", "exact"):
        sampler = MaskedSamplerConfig(gen_length=16, steps=16, block_length=4, kv_cache=kv_cache)
        runs[kv_cache] = generate_texts(lm, prompts, sampler, PROMPT_LEN, 0.0, torch.Generator())
    assert torch.equal(runs["none"].completion_ids, runs["exact"].completion_ids)
    assert all("<answer>" in text for text in runs["exact"].completions)
    scores = build_reward("math_answer")(runs["exact"].completions, prompts, [m for _, m in items]).scores
    assert 0 < float(scores.mean()) < 1
