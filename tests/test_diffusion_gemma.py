"""DiffusionGemma (transformers' DiffusionGemmaForBlockDiffusion, no remote code) as a flowrl family: the entropy-bound
sampler against ``generate`` token for token, exact re-scoring, step_grpo training (full and LoRA), best-of-N and SVDD.

The model is the real class at a tiny random size (``write_tiny_random``), saved and loaded back through flowrl's path.
"""

from __future__ import annotations

import pytest
import torch

from flowrl.errors import FlowRLError
from flowrl.pipelines.diffusion_gemma import TINY_RANDOM, load_diffusion_gemma, write_tiny_random
from flowrl.pipelines.dllm import EMBEDDED_LMS
from flowrl.samplers.entropy_bound import EntropyBoundSamplerConfig, generate, resolve_settings, step_log_probs
from flowrl.seeding import RowGenerators

PRESET = "dllm/diffusion_gemma_step_grpo"
pytestmark = pytest.mark.usefixtures("one_thread")  # a tiny model: more threads only spin


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    lm = load_diffusion_gemma(str(write_tiny_random(tmp_path_factory.mktemp("diffusion_gemma"))))
    lm.model.eval()
    return lm


def _prompts():
    ids = torch.randint(4, 70, (6, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids, dtype=torch.bool)
    ids[0, :2], mask[0, :2] = 0, False  # a left-padded row
    return ids, mask


# Three canvases of 8. "stopping": entropy bound 1 (several kept per step) and a confidence threshold the random model
# reaches mid-canvas on some rows only (4.3 nats mean entropy, stability 0), so rows freeze at different steps.
SETTINGS = {
    "default": dict(gen_length=24, steps=4),
    "stopping": dict(gen_length=24, steps=8, entropy_bound=1.0, confidence_threshold=4.3, stability_threshold=0),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_sampler_equals_generate_token_for_token(lm, name):
    """Same seed, same draws: flowrl's entropy-bound sampler gives generate's sequences exactly, and its recorded
    per-step log-probs are what re-scoring at unchanged weights computes (ratio exactly 1)."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig as HFSampler

    section = EntropyBoundSamplerConfig(**SETTINGS[name])
    settings = resolve_settings(lm, section)
    ids, mask = _prompts()
    kwargs = {k: v for k, v in SETTINGS[name].items() if k in ("confidence_threshold", "stability_threshold")}
    if section.entropy_bound is not None:
        kwargs["sampler_config"] = HFSampler(entropy_bound=section.entropy_bound)
    torch.manual_seed(7)
    reference = lm.model.generate(
        ids, attention_mask=mask, max_new_tokens=settings.gen_length, max_denoising_steps=settings.steps, **kwargs
    )
    traj = generate(lm, ids, mask, settings, torch.Generator().manual_seed(7))
    new = reference.sequences[:, ids.shape[1] :]
    assert torch.equal(traj.completion_ids[:, : new.shape[1]], new)
    assert traj.counted.any()
    if name == "stopping":  # rows froze at different steps: the frozen-row logic was exercised
        stopped_at = traj.frozen.view(6, 3, 8).float().argmax(-1)
        assert traj.frozen.any() and len(set(stopped_at.flatten().tolist())) > 1
    else:  # an end token (3) finished a row early: its later canvases are padding (0) and none of their steps count
        idle = ~traj.counted.view(6, 3, 4).any(-1)  # (row, canvas): no step counted
        assert idle.any()
        row, canvas = map(int, torch.nonzero(idle)[0])
        assert (traj.completion_ids[row, : canvas * 8] == 3).any() and (traj.completion_ids[row, canvas * 8 :] == 0).all()
    rescored = step_log_probs(lm, traj)
    assert torch.equal(rescored, traj.step_log_probs * traj.counted)
    part = step_log_probs(lm, traj[[4, 1]])  # re-scored in another batch
    assert torch.allclose(part, rescored[[4, 1]], atol=1e-5, rtol=0)


def test_row_streams_do_not_depend_on_the_batch(lm):
    """Per-row streams: a prompt's completion is the same alone or batched with others (frozen rows draw nothing)."""
    section = EntropyBoundSamplerConfig(**SETTINGS["stopping"])
    settings = resolve_settings(lm, section)
    ids, mask = _prompts()
    streams = RowGenerators.keyed(0, 0, "rollout", range(6))
    together = generate(lm, ids, mask, settings, streams)
    alone = generate(lm, ids[2:3], mask[2:3], settings, RowGenerators.keyed(0, 0, "rollout", [2]))
    assert torch.equal(together.completion_ids[2], alone.completion_ids[0])
    assert torch.allclose(together.log_likelihood()[2], alone.log_likelihood()[0], atol=1e-5)


def test_kept_tokens_log_prob_by_hand(lm):
    """One step's recorded log-prob is the sum over the kept positions of log softmax(logits / T) of the next canvas's
    token there, with T = t_min + (t_max - t_min) * N / N = t_max at the first step."""
    settings = resolve_settings(lm, EntropyBoundSamplerConfig(gen_length=8, steps=3, entropy_bound=2.0))
    ids, mask = _prompts()
    traj = generate(lm, ids, mask, settings, torch.Generator().manual_seed(1))
    session = lm.session(ids, mask)
    session.encode()
    with torch.no_grad():
        logits = session.denoise(traj.canvases[:, 0], None).double() / settings.t_max
    expected = (torch.log_softmax(logits, -1).gather(-1, traj.canvases[:, 1, :, None]).squeeze(-1) * traj.kept[:, 0]).sum(-1)
    assert torch.allclose(traj.step_log_probs[:, 0], expected, atol=1e-5)
    assert traj.kept[:, 0].sum(-1).min() >= 1  # the entropy bound always keeps the lowest-entropy position


def _overrides(tmp_path, *extra):
    return [
        f"output_dir={tmp_path}",
        "train.iterations=2",
        "train.learning_rate=1e-2",
        "prompts.eval_size=4",
        "eval.every=0",
        "log.progress=false",
        *extra,
    ]


def _digit_share(samples, prompts, metadata):
    """A reward a random model's completions vary in: the share of digits in the completion."""
    return [sum(c.isdigit() for c in s) / max(len(s), 1) for s in samples]


@pytest.mark.parametrize("lora", [False, True])
def test_two_iterations_change_every_trainable_weight(tmp_path, lora):
    from accelerate.state import AcceleratorState

    from flowrl import Trainer

    AcceleratorState._reset_state(True)
    extra = ["pipeline.lora.r=4"] if lora else []
    trainer = Trainer(PRESET, _overrides(tmp_path, *extra), reward={"digits": _digit_share})
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters() if p.requires_grad}
    if lora:
        assert before and all("lora_" in n for n in before)
    else:
        assert not any("vision" in n for n in before)  # a text prompt never reaches the vision tower: frozen
    trainer.fit()
    after = dict(trainer.module.named_parameters())
    unchanged = [n for n, p in before.items() if torch.equal(p, after[n].detach())]
    assert not unchanged, f"{len(unchanged)} of {len(before)} trainable tensors did not change, e.g. {unchanged[:3]}"
    texts = trainer.sample(["ann has 3 apples"], num_samples=2)  # flowrl.Trainer.sample / flowrl sample
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)


def test_lora_encoder_adapters_are_the_decoders_and_round_trip(tmp_path):
    """One adapter per tied weight (the encoder's LoRA modules are the decoder's), kept through save_lora and
    lora.path; the reloaded adapter gives the same logits."""
    ckpt = write_tiny_random(tmp_path / "model")
    lm = load_diffusion_gemma(str(ckpt), lora={"r": 2})
    inner = lm.model.get_base_model().model
    enc, dec = inner.encoder.language_model.layers[0].self_attn.q_proj, inner.decoder.layers[0].self_attn.q_proj
    assert enc.lora_A is dec.lora_A and enc.lora_B is dec.lora_B
    with torch.no_grad():
        for p in lm.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    lm.save_lora(tmp_path / "adapter")
    again = load_diffusion_gemma(str(ckpt), lora={"path": str(tmp_path / "adapter")})
    inner = again.model.get_base_model().model
    assert inner.encoder.language_model.layers[1].mlp.up_proj.lora_B is inner.decoder.layers[1].mlp.up_proj.lora_B
    ids, mask = _prompts()
    canvas = torch.randint(0, 75, (6, 8), generator=torch.Generator().manual_seed(0))
    outs = []
    for model in (lm, again):
        model.model.eval()
        session = model.session(ids, mask)
        session.encode()
        with torch.no_grad():
            outs.append(session.denoise(canvas, None))
    assert torch.equal(outs[0], outs[1])


def test_wrong_sampler_or_objective_is_one_sentence():
    from flowrl.config import load_config

    with pytest.raises(FlowRLError, match="entropy_bound"):
        load_config(PRESET, ["sampler.name=masked"])
    with pytest.raises(FlowRLError, match="step_grpo"):
        load_config(PRESET, ["objective.name=diffu_grpo"])
    with pytest.raises(FlowRLError, match="t_max"):
        load_config(PRESET, ["sampler.t_min=0.9", "sampler.t_max=0.5"])
    with pytest.raises(FlowRLError, match="not diffusion_gemma"):  # a checkpoint of another model type
        load_diffusion_gemma(str(EMBEDDED_LMS["arith_mdlm"]))
    assert load_config(PRESET).pipeline.pretrained == TINY_RANDOM  # the preset's model is the random plumbing one


def test_best_of_n_and_svdd_through_flowrl_eval(lm, tmp_path):
    """flowrl eval --best-of and --svdd on DiffusionGemma: candidate 0 of best-of-N and SVDD with M = 1 are exactly the
    plain evaluation's completions (same per-item streams); SVDD with M = 2 runs M rows per executed look-ahead."""
    import json

    from flowrl.config import load_config
    from flowrl.eval_command import run_evaluation
    from flowrl.inference.search import Items, TextSearchModel, TextVerifier
    from flowrl.inference.text_best_of_n import text_best_of_n
    from flowrl.inference.text_candidates import LikelihoodScorer
    from flowrl.prompts import prompts_for
    from flowrl.reward_models import build_reward
    from flowrl.samplers.text_generation import candidate_streams, generate_texts

    config = load_config(PRESET, ["prompts.eval_size=3", "rollout.batch_size=4", f"output_dir={tmp_path}"])
    prompts = [p for p, _ in prompts_for(config.prompts, "eval")]
    plain = generate_texts(lm, prompts, config.sampler, config.pipeline.prompt_length, 1.0, candidate_streams(config.eval.seed, prompts, 0))
    best = run_evaluation(config, None, {"name": "best_of", "n": 2, "select": "majority,likelihood"}, tmp_path / "best.png")
    assert best["eval/reward/mean@1/majority"] == best["eval/reward/mean@1/likelihood"]  # N = 1: both keep candidate 0
    grader = build_reward("format")
    model = TextSearchModel(lm, config.sampler, config.pipeline.prompt_length, 1.0, config.eval.seed, 4)
    direct = text_best_of_n(model, TextVerifier(["likelihood"], [LikelihoodScorer()], grader), Items(prompts, [{}] * 3), 2)
    assert [row[0] for row in direct.completions] == plain.completions
    assert torch.allclose(direct.scores["likelihood"][:, 0], plain.log_likelihood())
    one = run_evaluation(config, None, {"name": "svdd", "m": 1, "select": "likelihood"}, tmp_path / "svdd1.png")
    assert [json.loads(line)["completion"] for line in open(one["completions"])] == plain.completions
    executed = int((~plain.frozen.all(0)).sum())  # decoder passes of the plain batch of 3 (the encoder's are not counted)
    assert one["cost"]["denoiser_rows"] == 3 * executed == round(3 * one["denoiser_forwards_per_item"])
    two = run_evaluation(config, None, {"name": "svdd", "m": 2, "select": "likelihood"}, tmp_path / "svdd2.png")
    assert len([json.loads(line) for line in open(two["completions"])]) == 3
    with pytest.raises(FlowRLError, match="--smc"):
        run_evaluation(config, None, {"name": "smc", "n": 2, "lambda": 1.0, "ess_threshold": 0.5}, tmp_path / "smc.png")


def test_step_grpo_loss_and_gradient_by_hand(lm):
    """On policy every counted ratio is exactly 1, so the clipped surrogate of a row is -A and the loss -mean_b A_b;
    its gradient is the policy gradient -mean_b A_b mean_{s counted} grad log p_s, flowing into the self-conditioning
    block (the replay recomputes the self-conditioning chain) and the shared layers through the prompt's KV cache."""
    from flowrl.objectives.dllm.step_grpo import StepGRPOConfig

    objective = StepGRPOConfig().build()
    settings = resolve_settings(lm, EntropyBoundSamplerConfig(gen_length=16, steps=3))
    ids, mask = _prompts()
    traj = generate(lm, ids[:4], mask[:4], settings, torch.Generator().manual_seed(2))
    traj.rewards, traj.group_ids = torch.tensor([1.0, 0.0, 0.5, 2.0]), torch.tensor([0, 0, 1, 1])
    objective.prepare(traj)
    objective.old_and_ref(lm, traj)
    params = dict(lm.model.named_parameters())
    out = next(objective.losses(lm, None, traj, None))
    assert out.metrics["policy/ratio_mean"] == 1.0
    adv = traj.advantages
    assert torch.allclose(out.loss, -adv.double().mean(), atol=1e-12)
    counted = traj.counted
    by_hand = -(adv * (step_log_probs(lm, traj) * counted).sum(1) / counted.sum(1)).mean()
    names = ["model.decoder.self_conditioning.gate_proj.weight", "model.encoder.language_model.layers.0.self_attn.k_proj.weight"]
    got = torch.autograd.grad(out.loss, [params[n] for n in names])
    want = torch.autograd.grad(by_hand, [params[n] for n in names])
    for g, w in zip(got, want):
        assert g.abs().max() > 0 and torch.allclose(g, w, atol=1e-10, rtol=1e-6)


def test_step_grpo_kl_to_the_initial_weights(lm):
    """beta > 0: the reference is a frozen copy of the initial weights (full fine-tuning); at those weights its per-step
    log-probs are the policy's, so the k3 KL is exactly 0."""
    from flowrl.objectives.dllm.step_grpo import StepGRPOConfig

    objective = StepGRPOConfig(beta=0.04).build()
    assert objective.reference == "initial"
    settings = resolve_settings(lm, EntropyBoundSamplerConfig(gen_length=8, steps=3))
    ids, mask = _prompts()
    traj = generate(lm, ids[:2], mask[:2], settings, torch.Generator().manual_seed(4))
    traj.rewards, traj.group_ids = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    objective.prepare(traj)
    objective.old_and_ref(lm, traj)
    assert torch.equal(traj.ref_log_probs, traj.old_log_probs)
    out = next(objective.losses(lm, None, traj, None))
    assert out.metrics["loss/kl"] == 0.0
