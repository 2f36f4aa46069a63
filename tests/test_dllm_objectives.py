"""dLLM objectives on the embedded masked-diffusion LM: on-policy ratio == 1, BGPO == ELBO-GRPO on-policy
(value and gradient), and two Trainer iterations per objective."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CONFIGS, REPO

from flowrl.config import BGPOConfig, DCoLTConfig, DiffuGRPOConfig, MaskedSamplerConfig, UniGRPOConfig, load_config
from flowrl.data.arith import PROMPT_LEN, problems
from flowrl.pipelines.dllm import load_masked_lm
from flowrl.samplers.masked import generate
from flowrl.sections import BuildContext

ASSET = str(REPO / "flowrl" / "assets" / "arith_mdlm")
_LM = {}


def _lm():
    if "lm" not in _LM:
        _LM["lm"] = load_masked_lm(ASSET)
    return _LM["lm"]


def _rollout(lm, remasking="low_confidence", scorer=None, n=8, seeds=2):
    tok = lm.tokenizer
    tok.padding_side = "left"
    enc = tok([p for p, _ in problems("train", n, seed=3)], padding="max_length", max_length=PROMPT_LEN, return_tensors="pt")
    traj = generate(
        lm,
        enc.input_ids,
        enc.attention_mask.bool(),
        16,
        8,
        16,
        temperature=1.0,
        remasking=remasking,
        position_scorer=scorer,
        generator=torch.Generator().manual_seed(0),
    )
    traj.group_ids = torch.arange(n) // 4
    traj.rewards = torch.arange(n, dtype=torch.float32) % 3
    traj.mask_seeds = torch.randint(0, 2**62, (n, seeds), generator=torch.Generator().manual_seed(1))
    return traj


@pytest.mark.parametrize(
    "config",
    [DiffuGRPOConfig(num_mask_seeds=2), UniGRPOConfig(num_mask_seeds=2), BGPOConfig(num_mask_seeds=2), DCoLTConfig()],
    ids=lambda c: c.name,
)
def test_first_update_ratio_is_one(config):
    lm = _lm()
    objective = config.build(BuildContext({}, MaskedSamplerConfig(remasking="policy" if config.name == "dcolt" else "low_confidence"), lm))
    traj = _rollout(lm, "policy" if config.name == "dcolt" else "low_confidence", getattr(objective, "position_scorer", None))
    objective.old_and_ref(lm, traj)
    traj = objective.prepare(traj)
    for epoch in range(config.num_mask_seeds):
        traj.inner_epoch = epoch
        for out in objective.losses(lm, None, traj, torch.Generator()):
            assert float(out.metrics["policy/ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
            if "policy/clipfrac" in out.metrics:
                assert float(out.metrics["policy/clipfrac"]) == 0.0


@pytest.mark.parametrize("config", [DiffuGRPOConfig(), UniGRPOConfig(), BGPOConfig()], ids=lambda c: c.name)
def test_group_shared_masks_cancel_what_a_group_has_in_common(config):
    """Four identical completions of one prompt with advantages summing to zero: with the group's masks shared
    (draw_mask_seeds(shared=True)) the policy gradient is exactly zero; with a seed per row it is mask noise."""
    from flowrl.modalities.text_rollouts import draw_mask_seeds

    lm = _lm()
    objective = config.build(BuildContext({}, MaskedSamplerConfig(), lm))
    params = [p for p in lm.model.parameters() if p.requires_grad]
    norms = {}
    for shared in (True, False):
        traj = _rollout(lm, n=4, seeds=1)[torch.zeros(4, dtype=torch.long)]  # one prompt, one completion, 4 times
        traj.group_ids, traj.rewards = torch.zeros(4, dtype=torch.long), torch.tensor([1.0, 0.0, 1.0, 0.0])
        traj.mask_seeds = draw_mask_seeds(1, 4, 1, shared, torch.Generator().manual_seed(0))
        assert (traj.mask_seeds == traj.mask_seeds[0]).all() == shared
        objective.old_and_ref(lm, traj)
        traj = objective.prepare(traj)
        assert traj.advantages.sum().abs() < 1e-6 and traj.advantages.abs().sum() > 1
        for p in params:
            p.grad = None
        for out in objective.losses(lm, None, traj, torch.Generator()):
            out.loss.backward()
        norms[shared] = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params if p.grad is not None)).item()
    for p in params:
        p.grad = None
    assert norms[False] > 1e-3 and norms[True] < 1e-4 * norms[False]  # zero up to float32 rounding


def test_bgpo_equals_elbo_grpo_on_policy_in_value_and_gradient():
    """On-policy (ratio 1) BGPO's bound and its gradient equal ELBO-GRPO's: the tangent (A >= 0) and the
    Jensen bound (A < 0) both touch exp at d = 0 with slope 1."""
    lm = _lm()
    traj = _rollout(lm, seeds=1)
    params = [p for p in lm.model.parameters() if p.requires_grad]

    def run(naive: bool):
        objective = BGPOConfig(num_mc_samples=3, naive=naive).build()
        objective.old_and_ref(lm, traj)
        batch = objective.prepare(traj)
        lm.model.zero_grad(set_to_none=True)
        total = 0.0
        for out in objective.losses(lm, None, batch, torch.Generator()):
            out.loss.backward()
            total += float(out.loss)
        return total, [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]

    value_naive, grads_naive = run(True)
    value_bgpo, grads_bgpo = run(False)
    assert value_bgpo == pytest.approx(value_naive, abs=1e-6)
    assert any(g.abs().sum() > 0 for g in grads_naive)
    for a, b in zip(grads_naive, grads_bgpo):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("name", ["diffu_grpo", "unigrpo", "bgpo", "dcolt"])
@pytest.mark.slow
def test_text_trainer_two_iterations(tmp_path, name):
    from flowrl.trainer import Trainer

    overrides = [
        f"output_dir={tmp_path}",
        "train.iterations=2",
        "train.prompts_per_iteration=2",
        "train.num_generations=4",
        "train.batch_size=8",
        "prompts.eval_size=8",
        "eval.every=0",
        "log.checkpoint_every=0",
        "log.progress=false",
        "train.learning_rate=1e-3",
    ]
    trainer = Trainer(load_config(CONFIGS / "dllm" / f"{name}.yaml", overrides))
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    summary = trainer.fit()
    changed = sum(not torch.equal(before[n], p.detach()) for n, p in trainer.module.named_parameters())
    assert changed > 0 and summary["iterations_completed"] == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert {"reward/mean", "reward/math_answer", "loss/policy", "policy/ratio_mean", "train/grad_norm"} <= set(r)
    assert "eval/reward/mean" in rows[0] and (tmp_path / "samples_after.jsonl").is_file()
    assert (tmp_path / "checkpoints" / "step_000002" / "denoiser.safetensors").is_file()


def test_dcolt_head_learning_rate_scale(tmp_path):
    """objective.scorer_lr_scale sets the unmasking-policy head's learning rate relative to the LM's."""
    from flowrl.trainer import Trainer

    trainer = Trainer(
        load_config(
            CONFIGS / "dllm" / "dcolt.yaml",
            [f"output_dir={tmp_path}", "train.learning_rate=1e-5", "objective.scorer_lr_scale=50", "log.progress=false"],
        )
    )
    (lm_group,), (head_group,) = trainer.optimizer.param_groups, trainer.roles["unmasking_head"].optimizer.param_groups
    assert lm_group["lr"] == pytest.approx(1e-5) and head_group["lr"] == pytest.approx(5e-4)
    assert {id(p) for p in head_group["params"]} == {id(p) for p in trainer.objective.head.parameters()}


def test_seed_fixes_the_initial_weights_of_fresh_modules(tmp_path):
    """DCoLT's unmasking-policy head is created by the trainer: the same config seed gives the same head."""
    from flowrl.trainer import Trainer

    heads = []
    for seed in (0, 0, 1):
        torch.randn(7)  # whatever the global RNG did before must not matter
        trainer = Trainer(
            load_config(CONFIGS / "dllm" / "dcolt.yaml", [f"output_dir={tmp_path / str(len(heads))}", f"seed={seed}", "log.progress=false"])
        )
        heads.append(torch.cat([p.detach().flatten() for p in trainer.objective.head.parameters()]))
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])


@pytest.mark.slow
def test_confidence_prior_head_starts_at_low_confidence_decoding():
    """objective.confidence_prior=c: the head's initial score is c * (top log-prob) exactly, so its greedy order
    (temperature 0: the top-k scores) is LLaDA's low-confidence order and the completions are identical."""
    lm = _lm()
    objective = DCoLTConfig(confidence_prior=5.0).build(BuildContext({}, MaskedSamplerConfig(remasking="policy"), lm))
    tok = lm.tokenizer
    tok.padding_side = "left"
    enc = tok([p for p, _ in problems("eval", 64, seed=5)], padding="max_length", max_length=PROMPT_LEN, return_tensors="pt")
    state = torch.full((64, 16), lm.mask_token_id)
    logits = lm.logits(torch.cat([enc.input_ids, state], 1), attention_mask=torch.cat([enc.attention_mask.bool(), state > -1], 1))[:, -16:]
    top = torch.log_softmax(logits.float(), -1).max(-1).values
    assert torch.equal(objective.position_scorer(logits, state), 5.0 * top)
    runs = {
        r: generate(
            lm,
            enc.input_ids,
            enc.attention_mask.bool(),
            16,
            8,
            16,
            temperature=0.0,
            remasking=r,
            position_scorer=objective.position_scorer if r == "policy" else None,
        )
        for r in ("policy", "low_confidence")
    }
    assert torch.equal(runs["policy"].completion_ids, runs["low_confidence"].completion_ids)
    assert torch.equal(runs["policy"].unmask_step, runs["low_confidence"].unmask_step)
