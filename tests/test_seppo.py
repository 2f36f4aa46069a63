"""SePPO: the flipper's decisions and the pair loss against hand-derived values, log 2 at reference == policy,
the checkpoint replay (snapshots on disk, seeded choice, bit-exact swaps, exact resume), winners from a folder and a
JSONL file with one-sentence errors, and real iterations on the flow, DDPM and tiny Stable Diffusion models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, fast_overrides
from tiny_components import replace_overrides, two_iterations_change_every_parameter

from flowrl.config import load_config
from flowrl.data.winners import load_winners, top_fraction
from flowrl.errors import FlowRLError
from flowrl.objectives.checkpoint_replay import CheckpointReplay
from flowrl.objectives.seppo import anchor_flip, seppo_pair_loss, winner_latents

SEPPO = CONFIGS / "digits" / "seppo.yaml"
pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(*pairs):
    """(err, ref_err) interleaved (winner, reference sample) from ((err_w, ref_w), (err_r, ref_r)) per pair."""
    err = torch.tensor([x for (w, r) in pairs for x in (w[0], r[0])], dtype=torch.float64)
    ref = torch.tensor([x for (w, r) in pairs for x in (w[1], r[1])], dtype=torch.float64)
    return err, ref


def test_flipper_is_the_papers_anchor_rule_with_hand_values():
    # beta 10, no margin. Implicit reward s = -5 (err - ref_err); the decision looks at the winner's s_w alone.
    err, ref = _rows(
        ((0.30, 0.40), (0.50, 0.45)),  # s_w =  0.5 > 0: the policy fits the winner better: loser
        ((0.40, 0.30), (0.10, 0.40)),  # s_w = -0.5: the reference fits it better: its sample is learned as a winner
        ((0.30, 0.30), (0.20, 0.30)),  # s_w =  0 (policy == reference): the paper's "otherwise", a winner
        ((0.30, 0.40), (0.10, 0.40)),  # s_w =  0.5, s_r = 1.5 > s_w: a loser here; the old gap rule (s_r - s_w > 0) flipped it
    )
    loss, flip = seppo_pair_loss(err, ref, 10.0, 0.0)
    assert flip.tolist() == [1.0, -1.0, -1.0, 1.0]
    # loser:   z = -5 ((0.30 - 0.40) - (0.50 - 0.45)) = 0.75 (Diffusion-DPO's logit)
    # flipped: z = -5 ((0.40 - 0.30) + (0.10 - 0.40)) = 1.0;  z = -5 (0 + (0.20 - 0.30)) = 0.5
    # the disputed regime: z = -5 ((0.30 - 0.40) - (0.10 - 0.40)) = -1.0, the reference sample pushed away
    expected = [math.log1p(math.exp(-z)) for z in (0.75, 1.0, 0.5, -1.0)]
    assert loss.tolist() == pytest.approx(expected, abs=1e-12)
    # v2's SFT form: a flipped pair's loss is its winner's denoising error; losers keep Diffusion-DPO's
    sft, flip_sft = seppo_pair_loss(err, ref, 10.0, 0.0, "sft")
    assert flip_sft.tolist() == flip.tolist()
    assert sft.tolist() == pytest.approx([expected[0], 0.40, 0.30, expected[3]], abs=1e-12)


def test_skip_band_is_a_closed_band_on_the_winners_implicit_reward():
    # beta 8: s_w = -4 (err_w - ref_w), exact in binary. s_w = +-0.5 sits on a margin of 0.5 and is skipped.
    above, below = ((0.25, 0.375), (9.0, 0.0)), ((0.375, 0.25), (0.0, 9.0))  # the reference sample's errors play no part
    assert anchor_flip(*_rows(above, below), beta=8.0, margin=0.5).tolist() == [0.0, 0.0]
    assert anchor_flip(*_rows(above, below), beta=8.0, margin=0.49).tolist() == [1.0, -1.0]
    err, ref = _rows(((0.25, 0.375), (0.5, 0.25)))
    loss, _ = seppo_pair_loss(err, ref, 8.0, 0.5)  # skipped: the winner's term alone, z = -4 (0.25 - 0.375) = 0.5
    assert loss.tolist() == pytest.approx([math.log1p(math.exp(-0.5))], abs=1e-12)


def test_flipper_decisions_carry_no_gradient_and_the_loser_case_is_diffusion_dpo():
    from flowrl.objectives.functional import diffusion_dpo_loss

    err = torch.tensor([0.2, 0.6, 0.3, 0.1], requires_grad=True)
    ref = torch.tensor([0.25, 0.5, 0.3, 0.3])
    loss, flip = seppo_pair_loss(err, ref, 20.0, 0.0)
    assert flip.tolist() == [1.0, -1.0] and not flip.requires_grad  # s_w = 0.5, then 0 (a tie: learned as a winner)
    torch.testing.assert_close(loss[0], diffusion_dpo_loss(err[0:1], err[1:2], ref[0:1], ref[1:2], 20.0)[0])
    (g,) = torch.autograd.grad(loss.sum(), err)
    # flipped pair (z = -10 (0 + (-0.2)) = 2): d loss / d err_w = d loss / d err_r = 10 sigmoid(-2)
    assert g[2:].tolist() == pytest.approx([10 / (1 + math.exp(2))] * 2, rel=1e-6)
    # loser pair: opposite signs on winner and reference sample
    assert g[0] > 0 and g[1] < 0 and g[0].item() == pytest.approx(-g[1].item())
    # SFT form: the flipped pair's gradient is 1 on its winner's error and 0 on its reference sample's
    (g,) = torch.autograd.grad(seppo_pair_loss(err, ref, 20.0, 0.0, "sft")[0].sum(), err)
    assert g[2:].tolist() == [1.0, 0.0]


class _Weights:
    """The two calls of a pipeline the replay uses, over a real module."""

    def __init__(self):
        self.module = torch.nn.Linear(3, 2)

    def trainable_state_dict(self):
        return dict(self.module.state_dict())

    def load_trainable_state_dict(self, weights):
        self.module.load_state_dict(weights)


def test_replay_writes_every_snapshot_to_disk_and_swaps_bit_exactly(tmp_path):
    pipe, replay = _Weights(), CheckpointReplay(every=2, run_dir=tmp_path)
    for it in range(8):
        with torch.no_grad():
            pipe.module.weight.fill_(float(it))
        replay.maybe_snapshot(pipe, it)
    assert sorted(replay.snapshots) == [0, 2, 4, 6] == replay.drawable()  # all of them, none evicted
    assert sorted(p.name for p in (tmp_path / "reference_checkpoints").iterdir()) == [
        f"iteration_00000{i}.safetensors" for i in (0, 2, 4, 6)
    ]
    assert float(replay.weights(4)["weight"][0, 0]) == 4.0
    before = {k: v.clone() for k, v in pipe.trainable_state_dict().items()}
    with replay.swapped_in(pipe, 0):
        assert torch.equal(pipe.module.weight, torch.zeros(2, 3))
    assert all(torch.equal(before[k], v) for k, v in pipe.trainable_state_dict().items())
    # the files travel in the objective's state; a copied run folder is found in the new place
    copy = CheckpointReplay(every=2, run_dir=tmp_path)
    copy.load_state_dict(replay.state_dict())
    assert copy.snapshots == replay.snapshots
    import shutil

    shutil.copytree(tmp_path / "reference_checkpoints", tmp_path / "moved" / "reference_checkpoints")
    shutil.rmtree(tmp_path / "reference_checkpoints")
    moved = CheckpointReplay(every=2, run_dir=tmp_path / "moved")
    moved.load_state_dict(replay.state_dict())
    assert float(moved.weights(6)["weight"][0, 0]) == 6.0
    assert moved.snapshots[6] == tmp_path / "moved" / "reference_checkpoints" / "iteration_000006.safetensors"
    with pytest.raises(FlowRLError, match=r"reference checkpoint for iteration 0 .* is missing"):
        CheckpointReplay(every=2, run_dir=tmp_path / "elsewhere").load_state_dict(replay.state_dict())
    # flowrl's window: the initial snapshot and the newest keep - 1
    window = CheckpointReplay(every=2, keep=3, run_dir=tmp_path / "w")
    window.snapshots = dict.fromkeys([0, 2, 4, 6], Path("unused"))
    assert window.drawable() == [0, 4, 6]


def test_replay_choice_per_strategy_is_seeded(tmp_path):
    replay = CheckpointReplay(every=1, run_dir=tmp_path)
    replay.snapshots = dict.fromkeys([0, 5, 10], Path("unused"))

    def draws(strategy, quality=None, n=3000):
        gen = torch.Generator().manual_seed(7)
        return [replay.choose(strategy, gen, quality, temperature=0.1) for _ in range(n)]

    assert set(draws("latest", n=5)) == {10} and set(draws("initial", n=5)) == {0}
    rpc = draws("rpc")
    assert rpc == draws("rpc")  # same seed, same choices
    assert all(abs(rpc.count(k) / len(rpc) - 1 / 3) < 0.04 for k in (0, 5, 10))  # uniform, the initial model included
    # psm: softmax(q / 0.1); 10 never measured takes the best measured quality (1.2):
    # p = (e^10, e^12, e^12) / (e^10 + 2 e^12), p(0) = 1 / (1 + 2 e^2) = 0.0634
    psm = draws("psm", {0: 1.0, 5: 1.2})
    assert psm.count(0) / len(psm) == pytest.approx(1 / (1 + 2 * math.e**2), abs=0.015)
    assert psm.count(5) / len(psm) == pytest.approx(math.e**2 / (1 + 2 * math.e**2), abs=0.03)


def _png(path, value, size=(8, 8), mode="L"):
    from PIL import Image

    Image.new(mode, size, value).save(path)
    return path


def test_winners_from_folder_jsonl_and_embedded(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    _png(folder / "a.png", 255)
    (folder / "a.txt").write_text("digit 1\n")
    _png(folder / "b.png", 51, size=(16, 16))  # resized to the model's 8x8
    (folder / "b.txt").write_text("digit 2")
    w = load_winners(str(folder), 1, (8, 8))
    assert w.prompts == ["digit 1", "digit 2"] and w.images.shape == (2, 1, 8, 8)
    assert w.images[0].eq(1.0).all() and w.images[1].sub(0.2).abs().max() < 1e-6

    lines = [{"prompt": "digit 3", "image": "folder/a.png", "digit": 3}, {"prompt": "digit 4", "image": str(folder / "b.png"), "digit": 4}]
    (tmp_path / "w.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    w = load_winners(str(tmp_path / "w.jsonl"), 3, (8, 8))
    assert w.prompts == ["digit 3", "digit 4"] and w.metadata == [{"digit": 3}, {"digit": 4}] and w.images.shape == (2, 3, 8, 8)

    emb = load_winners("embedded", 1, (8, 8))
    assert len(emb) == 1797 * 4 and emb.images.min() >= 0 and emb.images.max() <= 1
    ink = emb.images.flatten(1).mean(1)
    best = top_fraction(emb, ink, 0.1)
    for d in range(10):  # the boldest tenth of every class: no kept image of a digit is fainter than a dropped one
        kept = {i for i, m in enumerate(best.metadata) if m["digit"] == d}
        assert kept and min(best.images[i].mean() for i in kept) >= ink[
            [i for i, m in enumerate(emb.metadata) if m["digit"] == d]
        ].quantile(0.85)
        # the fraction counts distinct images (each listed once per prompt phrasing), and a kept image keeps all its rows
        images_of_d = sum(m["digit"] == d for m in emb.metadata) // 4
        assert len(kept) == 4 * round(0.1 * images_of_d)
        assert len({best.images[i].numpy().tobytes() for i in kept}) == round(0.1 * images_of_d)

    # weighted rewards select by their weighted sum (the preset: the evaluation reward's own direction)
    from types import SimpleNamespace

    from flowrl.objectives.seppo import SePPOConfig, winners_for
    from flowrl.reward_models import build_reward

    weights = {"ink": 1.0, "digit_classifier": 0.5}
    chosen = winners_for(
        SePPOConfig(winners_select=weights, winners_top_fraction=0.02).build(), SimpleNamespace(latent_shape=lambda: (1, 8, 8))
    )
    score = sum(w * build_reward(n)(emb.images, emb.prompts, emb.metadata).scores for n, w in weights.items())
    expected = top_fraction(emb, score, 0.02)
    assert chosen.prompts == expected.prompts and torch.equal(chosen.images, expected.images)
    ink_only = top_fraction(emb, build_reward("ink")(emb.images, emb.prompts, emb.metadata).scores, 0.02)
    assert not torch.equal(expected.images, ink_only.images)  # the classifier term changes the choice


def test_bad_winners_fail_in_one_sentence(tmp_path):
    (tmp_path / "w.jsonl").write_text('{"prompt": "digit 3", "image": "missing.png"}\n')
    with pytest.raises(FlowRLError, match=r"image '.*missing.png' \(line 1 of .*\) does not exist"):
        load_winners(str(tmp_path / "w.jsonl"), 1, (8, 8))
    (tmp_path / "w.jsonl").write_text('{"prompt": "digit 3", "image": "a.png"}\nnot json\n')
    _png(tmp_path / "a.png", 0)
    with pytest.raises(FlowRLError, match="line 2 of winners file .* is not valid JSON"):
        load_winners(str(tmp_path / "w.jsonl"), 1, (8, 8))
    (tmp_path / "w.jsonl").write_text('{"prompt": 3, "image": "a.png"}\n')
    with pytest.raises(FlowRLError, match="line 1 .* needs a string 'prompt'"):
        load_winners(str(tmp_path / "w.jsonl"), 1, (8, 8))
    (tmp_path / "bad.png").write_text("not an image")
    (tmp_path / "w.jsonl").write_text('{"prompt": "digit 3", "image": "bad.png"}\n')
    with pytest.raises(FlowRLError, match="could not be read"):
        load_winners(str(tmp_path / "w.jsonl"), 1, (8, 8))
    folder = tmp_path / "f"
    folder.mkdir()
    with pytest.raises(FlowRLError, match="holds no images"):
        load_winners(str(folder), 1, (8, 8))
    _png(folder / "x.png", 0)
    with pytest.raises(FlowRLError, match="has no prompt file 'x.txt'"):
        load_winners(str(folder), 1, (8, 8))
    with pytest.raises(FlowRLError, match="neither 'embedded'"):
        load_winners(str(tmp_path / "nothing.txt"), 1, (8, 8))
    with pytest.raises(FlowRLError, match="1x8x8 images"):
        load_winners("embedded", 3, (16, 16))


def _overrides(run, **extra):
    # a constant rate: the preset's cosine would reach 0 at the second of fast_overrides' two iterations
    return fast_overrides(
        run,
        **{"train.num_generations": 2, "train.learning_rate": 1e-3, "train.weight_decay": 0.0, "train.lr_schedule": "constant", **extra},
    )


@pytest.mark.slow
def test_first_iteration_is_log2_all_flipped_and_reference_samples_are_the_initial_models(tmp_path):
    """Iteration 0: the only snapshot is the current model, so every DPO logit is 0 (loss log 2 for any I) and the
    winner's errors tie: the paper's "otherwise" learns every reference sample as a winner (v2: SFT on the
    winners); the reference samples are the ODE samples of the weights in place."""
    from flowrl.samplers.rollout import rollout
    from flowrl.trainer import Trainer

    trainer = Trainer(load_config(SEPPO, _overrides(tmp_path / "run")))
    batch = trainer.objective.prepare(trainer.score(trainer.collect(0)))
    assert len(batch) == 4 and batch.prompts[0::2] == batch.prompts[1::2]
    (out,) = trainer.objective.losses(trainer.pipeline, trainer.sampler, batch, torch.Generator().manual_seed(0))
    assert out.loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert out.metrics["seppo/flipped_fraction"].item() == 1.0 and out.metrics["seppo/reference_iteration"].item() == 0.0
    trainer.objective.flipped_loss = "sft"  # the winners' mean denoising error at the same (t, noise)
    (sft,) = trainer.objective.losses(trainer.pipeline, trainer.sampler, batch, torch.Generator().manual_seed(0))
    assert sft.loss.item() == pytest.approx(out.metrics["dpo/err_winner"].item(), rel=1e-6)
    # the reference rows are what the weights in place sample from the stream collect() used
    from flowrl import seeding
    from flowrl.objectives import seppo

    gen = torch.Generator().manual_seed(seeding.derive_seed(0, 0, 0, seppo._REFERENCE_NOISE))
    noise = trainer.pipeline.initial_noise(2, gen)
    again = rollout(
        trainer.pipeline,
        trainer.sampler,
        batch.prompts[1::2],
        batch.metadata[1::2],
        torch.arange(2),
        trainer.pipeline.schedule.sigmas(4),
        gen,
        1.0,
        initial_noise=noise,
    )
    torch.testing.assert_close(batch.latents[1::2, -1], again.latents[:, -1])


@pytest.mark.parametrize("model", ["digits_flow", "digits_ddpm"])
@pytest.mark.slow
def test_two_iterations_change_every_parameter(tmp_path, model):
    extra = {"objective.ref_update_every": 1, "objective.reference_strategy": "latest"}
    if model == "digits_ddpm":
        extra.update({"pipeline.pretrained": "digits_ddpm", "sampler": "{name: ddim, eta: 0.0}"})
    trainer = two_iterations_change_every_parameter(_overrides(tmp_path / "run", **extra), SEPPO)
    rows = trainer.logger.records()
    assert rows[2]["seppo/reference_iteration"] == 1.0  # iteration 1 drew the newest snapshot, taken after iteration 0
    assert rows[2]["seppo/flipped_fraction"] == 1.0  # ... equal to the weights in place (one optimizer step): a tie, flipped
    assert sorted(trainer.objective.replay.snapshots) == [0, 1]


@pytest.mark.slow
def test_tiny_stable_diffusion_winners_from_jsonl(tmp_path):
    """The paper's setting: an epsilon UNet in VAE latents; winners are PNGs encoded by the VAE."""
    from tiny_components import build_tiny_sd, family_config

    directory = build_tiny_sd(tmp_path / "sd")
    lines = []
    for d in range(3):
        _png(tmp_path / f"{d}.png", (40 * d, 200, 90), size=(16, 16), mode="RGB")
        lines.append(json.dumps({"prompt": f"digit {d}", "image": f"{d}.png", "digit": d}))
    (tmp_path / "w.jsonl").write_text("\n".join(lines))
    overrides = replace_overrides(
        family_config("stable_diffusion", directory, tmp_path / "run", sampler="ddim"),
        ("objective.",),
        ["objective.name=seppo", f"objective.winners={tmp_path / 'w.jsonl'}", "objective.beta=5000"],
    )
    trainer = two_iterations_change_every_parameter(overrides)
    winners = trainer.modality.collector.winners
    assert winners.images.shape == (3, 3, 16, 16) and winners.metadata == [{"digit": d} for d in range(3)]
    # the latents are the VAE's mode times its scaling factor (the inverse of the adapter's decode)
    vae = trainer.pipeline.vae
    z = vae.encode(winners.images * 2 - 1).latent_dist.mode() * vae.config.scaling_factor
    torch.testing.assert_close(winner_latents(trainer.pipeline, winners.images), z)


@pytest.mark.slow
def test_resume_restores_the_replay_and_continues_exactly(tmp_path):
    from safetensors.torch import load_file

    from flowrl.trainer import Trainer

    extra = {
        "train.iterations": 4,
        "eval.every": 2,
        "log.checkpoint_every": 2,
        "objective.ref_update_every": 1,
        "objective.max_checkpoints": 3,  # a window: iteration 3 draws from 0, 2, 3
        "objective.reference_strategy": "psm",
    }
    Trainer(load_config(SEPPO, _overrides(tmp_path / "full", **extra))).fit()
    Trainer(load_config(SEPPO, _overrides(tmp_path / "cut", **extra, **{"train.stop_after": 3}))).fit()
    resumed = Trainer(load_config(SEPPO, _overrides(tmp_path / "cut", **extra, resume_from="latest")))
    assert resumed.fit()["iterations_completed"] == 4

    def metrics(run):
        return [
            {k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in (run / "metrics.jsonl").read_text().splitlines()
        ]

    assert metrics(tmp_path / "cut") == metrics(tmp_path / "full")
    a = load_file(tmp_path / "full" / "checkpoints" / "step_000004" / "denoiser.safetensors")
    b = load_file(tmp_path / "cut" / "checkpoints" / "step_000004" / "denoiser.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(k.startswith("objective.") for k in a)  # the snapshots are files beside the run, not in the weights
    assert sorted(resumed.objective.replay.snapshots) == [0, 1, 2, 3] and resumed.objective.replay.drawable() == [0, 2, 3]
    files = sorted(p.name for p in (tmp_path / "cut" / "reference_checkpoints").iterdir())
    assert files == [f"iteration_00000{i}.safetensors" for i in range(4)]
    for i in range(4):  # the resumed run's snapshots are the uninterrupted run's, bit for bit
        x, y = (load_file(run / "reference_checkpoints" / files[i]) for run in (tmp_path / "full", tmp_path / "cut"))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert set(state["objective"][0]["quality"]) <= {"0", "1", "2", "3"} and state["objective"][0]["quality"]


def test_bad_winners_refused_before_anything_is_written(tmp_path):
    from flowrl.trainer import Trainer

    for winners, needle in ((tmp_path / "none.jsonl", "winners file .* does not exist"), ("embedded", "1x8x8 images")):
        overrides = _overrides(tmp_path / "run", **{"objective.winners": str(winners)})
        if winners == "embedded":  # the embedded digits beside a model of another sample shape: the 2-D toy
            overrides += ["pipeline.name=toy2d", "prompts.dataset=toy2d", "reward.components={linear2d: 1.0}", "eval.judge=null"]
        with pytest.raises(FlowRLError, match=needle if winners != "embedded" else "are not supported"):
            Trainer(load_config(SEPPO, overrides))
        assert not (tmp_path / "run").exists()
    with pytest.raises(FlowRLError, match="unknown reward 'boldness'"):
        Trainer(load_config(SEPPO, _overrides(tmp_path / "run", **{"objective.winners_select": "boldness"})))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_lora_snapshots_hold_only_the_adapter(tmp_path):
    """A LoRA run snapshots the adapter tensors alone (the frozen base is shared), and a reference forward
    with the initial snapshot equals the base model's (LoRA B starts at zero)."""
    extra = {"pipeline.lora": "{r: 4, alpha: 8}", "train.learning_rate": 1e-2, "objective.ref_update_every": 1}
    trainer = two_iterations_change_every_parameter(_overrides(tmp_path / "run", **extra), SEPPO)
    replay, pipe = trainer.objective.replay, trainer.pipeline
    names = {n for n, p in pipe.denoiser.named_parameters() if p.requires_grad}
    snapshots = [replay.weights(i) for i in sorted(replay.snapshots)]
    assert sorted(replay.snapshots) == [0, 1] and all(set(s) == set(pipe.trainable_state_dict()) for s in snapshots)
    assert all("lora" in k for k in snapshots[0]) and len(snapshots[0]) == len(names)
    x, sigma, cond = torch.randn(2, 1, 8, 8), torch.tensor(0.5), pipe.encode(["digit 1", "digit 2"])
    with torch.no_grad():
        with replay.swapped_in(pipe, 0):
            initial = pipe.predict(x, sigma, cond)
        with pipe.reference():  # adapters switched off: the base model
            base = pipe.predict(x, sigma, cond)
        current = pipe.predict(x, sigma, cond)
    torch.testing.assert_close(initial, base)
    assert not torch.allclose(current, base)
