"""SePPO (Zhang et al., arXiv:2410.05255): semi-policy preference optimisation for diffusion alignment.

Diffusion-DPO needs (winner, loser) pairs. SePPO needs only winners (real images, as for SFT): the loser
of each pair is an on-policy sample of a *reference model*, a previous checkpoint of the policy, and the
DPO reference of the pair's loss is that same checkpoint. Per iteration:

1. the checkpoint replay (``checkpoint_replay.py``) writes a snapshot when one is due (every
   ``ref_update_every`` iterations, on disk beside the run) and picks the reference: ``rpc`` (the paper's random
   checkpoint replay: uniform over every previous snapshot, the initial model included), ``latest`` (SPIN's
   previous iterate), ``initial`` (the paper's third baseline) or ``psm`` (flowrl's own, not in the paper:
   softmax of each snapshot's measured quality, see below);
2. ``prompts_per_iteration`` winners are drawn from the dataset (``flowrl/data/winners.py``) and the
   reference model samples one image for each winner's prompt with the rollout sampler (chosen in the
   config; the digits presets use the ODE, the model's own distribution);
3. each pair (winner x_w, reference sample x_r) is noised with one shared time and noise, and the
   Anchor-based Adaptive Flipper decides, per pair, how x_r enters the loss.

The flipper (the paper's Sec. 4.2) looks at the anchor alone, the winner: with the policy's and the reference
model's regression errors on the noised winner (``diffusion_dpo.denoising_errors``) and the winner's implicit
reward on the scale of the loss logit, ``s_w = -beta/2 * (err_theta(x_w) - err_ref(x_w))``,

    I = +1 (loser)   if s_w > 0   the policy fits the winner better than the reference: x_r is a loser
    I = -1 (winner)  otherwise    the reference fits the winner at least as well: its sample is learned as a winner

and with flowrl's skip band ``flip_margin`` m > 0: +1 if s_w > m, -1 if s_w < -m, 0 (skipped) in between.

    loser:    -log sigmoid(-beta/2 * [(err_theta(x_w) - err_ref(x_w)) - (err_theta(x_r) - err_ref(x_r))])
    winner:   flipped_loss "dpo" (v1): the same with + instead of -: both likelihoods raised
              flipped_loss "sft" (v2, SSPO): err_theta(x_w), the denoising loss on the winner
    skipped:  -log sigmoid(-beta/2 * (err_theta(x_w) - err_ref(x_w))), the winner's term alone

I is decided without gradient, at the same (t, noise) as the loss.

PSM quality: the running mean of the training reward of a checkpoint's reference samples over the
iterations it was drawn (scored by the run's reward, so psm, unlike the paper's strategies, needs one).

Every choice the paper leaves open is listed in docs/objectives/seppo.md.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from .. import seeding
from ..data.winners import Winners, load_winners, top_fraction
from ..errors import FlowRLError
from ..samplers.forward_process import denoising_errors, noised_and_target, training_sigmas
from ..samplers.rollout import rollout
from ..sections import BuildContext, ObjectiveSection
from ..types import LossOutput, Pipeline, ReferenceModel, Role, Sampler, TrainingData, Trajectory
from .checkpoint_replay import CheckpointReplay, Strategy, running_mean
from .functional import diffusion_dpo_loss

# Stream tags for seeding.derive_seed, far from seeding.PURPOSES' small numbers: SePPO's own draws per iteration.
_WINNERS, _REFERENCE_NOISE, _REFERENCE_CHOICE = 0x5E990, 0x5E991, 0x5E992


FlippedLoss = Literal["dpo", "sft"]


def anchor_flip(err: Tensor, ref_err: Tensor, beta: float, margin: float) -> Tensor:
    """The flipper's decision I per pair (P,) from rows (2i, 2i + 1) = (winner, reference sample) of the
    policy's and the reference's errors (2P,), decided on the winner (the anchor) alone: +1 loser when the
    policy fits the winner better than the reference, -1 learned as a winner otherwise; with ``margin`` m > 0,
    0 (skipped) when the winner's implicit reward lies in [-m, m]."""
    s_w = -0.5 * beta * (err[0::2] - ref_err[0::2])  # the winner's implicit reward, on the scale of the loss logit
    undecided = s_w.abs() <= margin if margin > 0 else torch.zeros_like(s_w, dtype=torch.bool)
    return torch.where(s_w > margin, 1.0, torch.where(undecided, 0.0, -1.0)).to(err.dtype)


def seppo_pair_loss(err: Tensor, ref_err: Tensor, beta: float, margin: float, flipped_loss: FlippedLoss = "dpo") -> tuple[Tensor, Tensor]:
    """Per-pair loss (P,) and the flipper's decisions (P,), decided without gradient. ``dpo``: Diffusion-DPO's
    loss with the reference sample's errors multiplied by I (v1); ``sft``: a flipped pair's loss is the
    denoising error of its winner instead (v2's switch from DPO to SFT)."""
    with torch.no_grad():
        flip = anchor_flip(err.detach(), ref_err.detach(), beta, margin)
    dpo = diffusion_dpo_loss(err[0::2], flip * err[1::2], ref_err[0::2], flip * ref_err[1::2], beta)
    if flipped_loss == "sft":
        return torch.where(flip < 0, err[0::2], dpo), flip
    return dpo, flip


@dataclass
class SePPOObjective:
    beta: float
    reference_strategy: Strategy
    ref_update_every: int  # iterations between snapshots
    max_checkpoints: int | None
    psm_temperature: float
    flip_margin: float
    flipped_loss: FlippedLoss
    winners: str
    winners_select: (
        str | dict[str, float] | None
    )  # a reward name or {name: weight}: keep the best winners_top_fraction of each metadata group by it
    winners_top_fraction: float
    name: str = field(default="seppo", init=False)
    trains_on: TrainingData = field(default="reference_rollouts", init=False)
    needs_log_probs: bool = field(default=False, init=False)
    reference: ReferenceModel = field(
        default="none", init=False
    )  # the reference is a previous checkpoint (checkpoint_replay.py), not the trainer's
    minibatch_unit: int = field(default=2, init=False)  # rows (2i, 2i + 1) are (winner, reference sample)
    run_dir: Any = None  # where the previous checkpoints are written (<run_dir>/reference_checkpoints)
    roles: tuple[Role, ...] = field(default=(), init=False)  # the policy alone

    def __post_init__(self) -> None:
        self.replay = CheckpointReplay(self.ref_update_every, self.max_checkpoints, self.run_dir)
        self.current: int | None = None  # the iteration of this iteration's reference snapshot
        self.quality: dict[int, list[float]] = {}  # PSM: checkpoint iteration -> [mean reward of its samples, count]

    def begin_iteration(self, pipeline: Pipeline, seed: int, iteration: int) -> int:
        """Snapshot the current weights if due, then choose this iteration's reference (same on every process)."""
        self.replay.maybe_snapshot(pipeline, iteration)
        gen = torch.Generator().manual_seed(seeding.derive_seed(seed, iteration, 0, _REFERENCE_CHOICE))
        self.current = self.replay.choose(self.reference_strategy, gen, {k: v[0] for k, v in self.quality.items()}, self.psm_temperature)
        return self.current

    def prepare(self, batch: Trajectory) -> Trajectory:
        """Rows arrive (winner, reference sample); PSM folds the reference samples' reward into the quality
        of the checkpoint that drew them."""
        if batch.rewards is not None and self.current is not None:
            r = batch.rewards[1::2].float()
            r = r[torch.isfinite(r)]
            if r.numel():
                running_mean(self.quality, self.current, float(r.mean()))
        return batch

    def losses(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        if self.current is None:
            raise FlowRLError(
                "SePPO trains on its reference model's samples: no reference was chosen (the batch was not collected by SePPO)."
            )
        x0 = batch.latents[:, -1].float()
        pairs = x0.shape[0] // 2
        sigma = training_sigmas(pipeline, pairs, generator).to(x0.device).repeat_interleave(2)
        noise = torch.randn(x0[0::2].shape, generator=generator).to(x0.device).repeat_interleave(2, dim=0)
        x_t, target = noised_and_target(pipeline, x0, noise, sigma)
        # The reference first: swapping its weights in copies into the live parameters, which would
        # invalidate a graph built before (see checkpoint_replay.py).
        with torch.no_grad(), self.replay.swapped_in(pipeline, self.current):
            ref_err = denoising_errors(pipeline, x_t, sigma, batch.cond, target, batch.guidance_scale)
        err = denoising_errors(pipeline, x_t, sigma, batch.cond, target, batch.guidance_scale)
        per_pair, flip = seppo_pair_loss(err, ref_err, self.beta, self.flip_margin, self.flipped_loss)
        loss = per_pair.mean()  # a skipped reference sample still leaves its winner's term
        with torch.no_grad():
            metrics = {
                "loss/policy": loss.detach(),
                "seppo/loser_fraction": (flip > 0).float().mean(),
                "seppo/flipped_fraction": (flip < 0).float().mean(),
                "seppo/skipped_fraction": (flip == 0).float().mean(),
                "seppo/reference_iteration": torch.tensor(float(self.current)),
                "seppo/checkpoints": torch.tensor(float(len(self.replay.drawable()))),
                "dpo/err_winner": err[0::2].mean(),
                "dpo/err_reference_sample": err[1::2].mean(),
            }
        yield LossOutput(loss=loss, metrics=metrics)

    def state_dict(self) -> dict[str, Any]:
        # JSON: keys become strings. The snapshots are files beside the run; their paths travel here.
        return {"quality": {str(k): v for k, v in self.quality.items()}, "replay": self.replay.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.quality = {int(k): [float(v[0]), int(v[1])] for k, v in state.get("quality", {}).items()}
        self.replay.load_state_dict(state.get("replay", {}))


class SePPOConfig(ObjectiveSection):
    """SePPO: winners from a dataset, losers sampled by a previous checkpoint, the anchor-based flipper (docs/objectives/seppo.md)."""

    name: str = "seppo"
    beta: float = Field(
        5000.0, gt=0, description="DPO temperature on the denoising-loss difference (Diffusion-DPO's scale for SD latents)."
    )
    # rpc: uniform over every previous checkpoint, the initial one included (the paper's); latest: the newest (SPIN);
    # initial: always the initial model (the paper's baseline); psm: softmax of measured quality (flowrl's own)
    reference_strategy: Strategy = Field(
        "rpc", description="Which previous checkpoint samples the losers: rpc, latest, initial or psm (see the comment above)."
    )
    ref_update_every: int = Field(30, ge=1, description="Iterations between checkpoint snapshots (the paper: one every 30 updates).")
    max_checkpoints: int | None = Field(
        None, ge=1, description="Draw from the initial one and the newest N - 1 snapshots; None: from all (the paper)."
    )
    psm_temperature: float = Field(0.1, gt=0, description="psm: p ~ exp(quality / T), quality the mean reward of a checkpoint's samples.")
    flip_margin: float = Field(
        0.0, ge=0, description="Skip a pair whose winner's implicit reward is within +-margin (loss-logit units); flowrl's skip band."
    )
    flipped_loss: FlippedLoss = Field(
        "dpo", description="A reference sample learned as a winner: dpo (v1, DPO with sign -1) or sft (v2, SFT on the winner)."
    )
    winners: str = Field(
        "embedded",
        description='The winners: the embedded digits data, a .jsonl of {"prompt", "image"} lines, or a folder of images + .txt.',
    )
    winners_select: str | dict[str, float] | None = Field(
        None,
        description="A reward name (ink) or weighted names ({ink: 1, digit_classifier: 1}) ranking the winners; None: keep them all.",
    )
    winners_top_fraction: float = Field(
        1.0, gt=0, le=1, description="Keep the best this fraction of each metadata group's winners by winners_select."
    )

    def build(self, context: BuildContext | None = None) -> SePPOObjective:
        return SePPOObjective(**self.target_kwargs(), run_dir=getattr(context, "run_dir", None))


# -- what the modality needs: the winners and the iteration's batch -----------------------------------
def winners_for(objective: SePPOObjective, pipeline: Pipeline) -> Winners:
    """The objective's winners at the model's pixel size, filtered by ``winners_select`` when set."""
    channels, size = pixel_shape(pipeline)
    winners = load_winners(objective.winners, channels, size)
    if objective.winners_select is not None and objective.winners_top_fraction < 1.0:
        from ..reward_models import build_reward
        from ..reward_models.combine import WeightedSum

        select = objective.winners_select
        weights = {select: 1.0} if isinstance(select, str) else select
        score = WeightedSum({name: build_reward(name) for name in weights}, weights)
        scores = score(winners.images, winners.prompts, winners.metadata).scores
        winners = top_fraction(winners, scores, objective.winners_top_fraction)
    return winners


def pixel_shape(pipeline: Pipeline) -> tuple[int, tuple[int, int]]:
    """(channels, (height, width)) of the images a pipeline decodes to; a model whose samples SePPO cannot
    encode winners for (no 2-D image latents, or a VAE with per-channel latent statistics) is refused here,
    before anything is written."""
    vae, shape = getattr(pipeline, "vae", None), tuple(pipeline.latent_shape())
    if len(shape) != 3 or (vae is not None and getattr(vae.config, "latents_mean", None) is not None):
        raise FlowRLError(
            f"SePPO encodes its winners for pixel-space image models and 2-D VAE latents (Stable Diffusion 1.5/2, SDXL, SD3, FLUX); "
            f"{type(pipeline).__name__}'s samples of shape {shape} are not supported."
        )
    if vae is None:  # pixel-space models (the embedded digits): the latents are the images
        return shape[0], shape[1:]
    return 3, pipeline.sample_size()


@torch.no_grad()
def winner_latents(pipeline: Pipeline, images: Tensor) -> Tensor:
    """Images in [0, 1] -> the model's sample space (the inverse of ``pipeline.decode``)."""
    vae = getattr(pipeline, "vae", None)
    x = images.to(pipeline.device) * 2 - 1
    if vae is None:
        return x
    z = vae.encode(x.to(vae.device, vae.dtype)).latent_dist.mode().float()
    return ((z - (getattr(vae.config, "shift_factor", None) or 0.0)) * vae.config.scaling_factor).to(pipeline.device)


@torch.no_grad()
def reference_pair_batch(
    objective: SePPOObjective,
    pipeline: Pipeline,
    sampler: Sampler,
    winners: Winners,
    *,
    seed: int,
    iteration: int,
    rank: int,
    world: int,
    pairs: int,
    num_inference_steps: int,
    guidance_scale: float,
    chunk: int,
) -> Trajectory:
    """This process's ``pairs`` (winner, reference sample) rows for ``iteration``. Winners and initial noise are
    drawn for the whole world and sliced, so the rows do not depend on the number of processes."""
    objective.begin_iteration(pipeline, seed, iteration)
    rng = random.Random(seeding.derive_seed(seed, iteration, 0, _WINNERS))
    mine = slice(rank * pairs, (rank + 1) * pairs)
    idx = [rng.randrange(len(winners)) for _ in range(pairs * world)][mine]
    prompts, metadata = [winners.prompts[i] for i in idx], [dict(winners.metadata[i]) for i in idx]
    x_w = winner_latents(pipeline, winners.images[idx])
    gen = torch.Generator().manual_seed(seeding.derive_seed(seed, iteration, 0, _REFERENCE_NOISE))
    noise = pipeline.initial_noise(pairs * world, gen)[mine]
    step_gen = seeding.RowGenerators.keyed(
        seed, iteration, "rollout", range(rank * pairs, (rank + 1) * pairs)
    )  # an SDE's step noise per pair
    sigmas = pipeline.schedule.sigmas(num_inference_steps).to(noise.device)
    group_ids = torch.arange(pairs) + rank * pairs
    pipeline.denoiser.eval()
    samples = []
    with objective.replay.swapped_in(pipeline, objective.current):
        for start in range(0, pairs, chunk):
            sl = slice(start, start + chunk)
            samples.append(
                rollout(
                    pipeline,
                    sampler,
                    prompts[sl],
                    metadata[sl],
                    group_ids[sl],
                    sigmas,
                    step_gen[sl],
                    guidance_scale,
                    initial_noise=noise[sl],
                    decode=False,
                ).latents[:, -1]
            )
    x_r = torch.cat(samples)
    x0 = torch.stack([x_w, x_r.to(x_w)], 1).flatten(0, 1)  # winner, reference sample, winner, ...
    rows_prompts, rows_metadata = [p for p in prompts for _ in range(2)], [dict(m) for m in metadata for _ in range(2)]
    return Trajectory(
        latents=x0[:, None],
        sigmas=torch.zeros(1),
        log_probs=x0.new_zeros(len(rows_prompts), 0),
        stochastic=torch.zeros(0, dtype=torch.bool),
        cond=pipeline.encode(rows_prompts),
        prompts=rows_prompts,
        metadata=rows_metadata,
        group_ids=group_ids.repeat_interleave(2),
        samples=pipeline.decode(x0),
        guidance_scale=1.0,
    )
