"""The records that flow through flowrl and the narrow protocols that connect its parts.

Time convention everywhere outside a pipeline adapter: ``sigma`` in [0, 1], ``sigma = 1`` is pure
noise, ``sigma = 0`` is data. A trajectory is ordered noise -> data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

PredictionType = Literal["flow", "epsilon", "v_prediction"]

# A condition is whatever the denoiser needs besides (x, sigma): prompt embeddings, pooled
# embeddings, masks. Every tensor in it has the batch on dim 0 so it can be indexed with the batch.
Condition = dict[str, Tensor]


def index_condition(cond: Condition, index: Tensor | slice) -> Condition:
    return {k: v[index] for k, v in cond.items()}


def cat_conditions(conds: Sequence[Condition]) -> Condition:
    return {k: torch.cat([c[k] for c in conds]) for k in conds[0]}


def select_rows(record: Any, index: Tensor | slice | list[int], shared: tuple[str, ...]) -> Any:
    """The rows ``index`` of a trajectory record (``Trajectory``, ``TokenTrajectory``, ``CanvasTrajectory``): dim 0 of
    every per-sample tensor, the chosen items of the per-sample lists (prompts, metadata, completions), each reward
    component's rows and the condition's; the fields named in ``shared`` (the time grid, step counts, settings) and
    unset ones (None) are passed through as they are, since they hold no batch dimension."""
    if isinstance(index, list):
        index = torch.tensor(index, dtype=torch.long)
    idx_list = index.tolist() if isinstance(index, Tensor) else list(range(len(record)))[index]
    out: dict[str, Any] = {}
    for f in fields(record):
        v = getattr(record, f.name)
        if f.name in shared or v is None:
            out[f.name] = v
        elif f.name == "cond":
            out[f.name] = index_condition(v, index)
        elif f.name == "reward_components":
            out[f.name] = {k: c[index] for k, c in v.items()}
        elif f.name in ("prompts", "metadata", "completions"):
            out[f.name] = [v[i] for i in idx_list] if v else v
        else:
            out[f.name] = v[index]
    return type(record)(**out)


@dataclass
class StepOutput:
    """One sampler step.

    x_next:   (B, *S) the next state (sampled, or the one given for re-scoring).
    log_prob: (B,) log p(x_next | x) reduced over non-batch dims by the sampler's reduction;
              None for a deterministic step.
    mean:     (B, *S) the transition mean.
    std:      the transition std: a 0-dim tensor, or (B, 1, ..., 1) for a per-sample sigma (0 for a
              deterministic step; a per-sample step's log_prob is NaN on the rows whose std is 0).
    """

    x_next: Tensor
    log_prob: Tensor | None
    mean: Tensor
    std: Tensor


@dataclass
class RewardOutput:
    """scores: (B,) float32, NaN meaning "not applicable"; extras: named (B,) tensors to log."""

    scores: Tensor
    extras: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class LossOutput:
    """One backward pass worth of loss. ``loss`` is already scaled so that summing the gradients of all
    LossOutputs of a minibatch gives the gradient of the minibatch objective. ``metrics`` are detached
    scalar tensors (converted to floats once per update, so a GPU is not synchronised every step)."""

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    role: str = "policy"  # the trained role whose optimizer this loss's gradient is for (Objective.roles)


@dataclass
class Trajectory:
    """Everything needed to replay a rollout exactly.

    latents:    (B, K+1, *S) states ordered noise -> data.
    sigmas:     (K+1,) the time grid, sigmas[0] = start, sigmas[K] = 0.
    log_probs:  (B, K) log-prob of each transition under the rollout policy; NaN on deterministic steps.
    stochastic: (K,) bool, which steps were sampled stochastically (trainable with a likelihood ratio).
    cond:       the condition the denoiser saw, batch on dim 0.
    prompts:    B prompt strings.
    metadata:   B dicts (ground truth for rewards, e.g. {"digit": 7}).
    group_ids:  (B,) int64, samples with the same id share a prompt (a GRPO group).
    samples:    (B, C, H, W) decoded images in [0, 1] (or None before decoding).
    rewards:    (B,) float32 combined reward; NaN for samples to drop.
    reward_components: name -> (B,) per-component reward.
    advantages: (B,) or (B, K), filled by an objective's prepare().
    reward_grads: (B, *S) gradient of the combined reward with respect to the final state latents[:, K]
                (through the decoder), filled by the score phase for objectives that train on
                "reward_gradient_rollouts"; None otherwise.
    step_means: (B, Ks, *S) float32, the transition mean the rollout sampled each stochastic step from, in step
                order (Ks = stochastic.sum(); ``step_mean(k)`` reads step k's), recorded only for an objective that
                declares ``needs_step_means`` (GRPO-Guard's exact ratio normalisation), None otherwise: it is as
                large as the latents of the stochastic steps.
    guidance_scale: the CFG scale the rollout used (training re-scores with the same one).
    """

    latents: Tensor
    sigmas: Tensor
    log_probs: Tensor
    stochastic: Tensor
    cond: Condition
    prompts: list[str]
    metadata: list[dict[str, Any]]
    group_ids: Tensor
    samples: Tensor | None = None
    rewards: Tensor | None = None
    reward_components: dict[str, Tensor] = field(default_factory=dict)
    advantages: Tensor | None = None
    reward_grads: Tensor | None = None
    step_means: Tensor | None = None
    guidance_scale: float = 1.0
    inner_epoch: int = 0  # set by the trainer for each pass over the rollout

    def __len__(self) -> int:
        return self.latents.shape[0]

    @property
    def num_steps(self) -> int:
        return self.sigmas.shape[0] - 1

    def step_mean(self, k: int) -> Tensor:
        """(B, *S): the transition mean the rollout sampled stochastic step ``k`` from (``step_means``)."""
        if self.step_means is None or not bool(self.stochastic[k]):
            raise ValueError(f"step {k} has no recorded rollout mean (recorded: stochastic steps, when the objective needs them)")
        return self.step_means[:, int(self.stochastic[:k].sum())]

    def __getitem__(self, index: Tensor | slice | list[int]) -> Trajectory:
        """Select samples (dim 0 of every per-sample field)."""
        return select_rows(self, index, shared=("sigmas", "stochastic", "guidance_scale", "inner_epoch"))

    @staticmethod
    def cat(trajs: Sequence[Trajectory]) -> Trajectory:
        first = trajs[0]
        out: dict[str, Any] = {
            "sigmas": first.sigmas,
            "stochastic": first.stochastic,
            "guidance_scale": first.guidance_scale,
            "inner_epoch": first.inner_epoch,
        }
        for f in fields(first):
            if f.name in out:
                continue
            vals = [getattr(t, f.name) for t in trajs]
            if vals[0] is None:
                out[f.name] = None
            elif f.name == "cond":
                out[f.name] = cat_conditions(vals)
            elif f.name == "reward_components":
                out[f.name] = {k: torch.cat([v[k] for v in vals]) for k in vals[0]}
            elif f.name in ("prompts", "metadata"):
                out[f.name] = [x for v in vals for x in v]
            else:
                out[f.name] = torch.cat(vals)
        return Trajectory(**out)

    def to(self, device: torch.device | str) -> Trajectory:
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                moved[f.name] = v.to(device)
            elif f.name in ("cond", "reward_components"):
                moved[f.name] = {k: t.to(device) for k, t in v.items()}
        return replace(self, **moved)


@runtime_checkable
class Pipeline(Protocol):
    """A model adapter. It owns the only conversion from sigma to the model's own timestep."""

    denoiser: torch.nn.Module
    prediction_type: PredictionType
    schedule: Any  # samplers.schedules.FlowSchedule | DiscreteSchedule: the time grid and sigma <-> alpha-bar

    def encode(self, prompts: Sequence[str]) -> Condition: ...

    def initial_noise(self, batch: int, generator: torch.Generator) -> Tensor: ...

    def predict(self, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float = 1.0) -> Tensor:
        """Return the model output (velocity / epsilon / v) at noise level sigma, with CFG applied."""
        ...

    def decode(self, x: Tensor) -> Tensor:
        """Return images (B, C, H, W) float32 in [0, 1]."""
        ...

    def trainable_parameters(self) -> list[torch.nn.Parameter]: ...

    # -- what the training loop needs besides sampling ---------------------------------------------
    has_lora: bool  # a checkpoint then also holds the diffusers LoRA file (save_lora)

    def enable_reference(self) -> None:
        """Make ``reference()`` available (full fine-tuning: freeze a copy of the current weights; LoRA: nothing)."""
        ...

    def reference(self) -> contextlib.AbstractContextManager:
        """Context in which predict() uses the frozen reference (initial) model."""
        ...

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """What a checkpoint stores (the LoRA tensors, or the whole trained module)."""
        ...

    def load_trainable_state_dict(self, weights: dict[str, Tensor]) -> None: ...

    def save_lora(self, directory: Any) -> Any:
        """Write the adapter in its library's own format (diffusers LoRA / peft) into ``directory``."""
        ...


@runtime_checkable
class Sampler(Protocol):
    """A stateless transition kernel. ``step`` samples when ``x_next`` is None and otherwise returns the
    log-prob of the given ``x_next``: rollout and training share one code path by construction."""

    name: str
    prediction_types: tuple[PredictionType, ...]
    stochastic: bool

    def step(
        self,
        model_output: Tensor,
        x: Tensor,
        sigma: Tensor,
        sigma_next: Tensor,
        x_next: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> StepOutput: ...

    def deterministic_step(self, model_output: Tensor, x: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
        """The ODE / eta = 0 step used outside an SDE window and for evaluation."""
        ...


@runtime_checkable
class Reward(Protocol):
    name: str
    differentiable: bool

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput: ...


TrainingData = Literal["rollouts", "offline_pairs", "reward_gradient_rollouts", "reference_rollouts"]
"""What an objective trains on, i.e. what the loop's collect and score phases hand to ``prepare``:

- ``"rollouts"``: on-policy trajectories from the rollout sampler, with their per-step log-probs when
  the objective ``needs_log_probs`` (GRPO, DDPO, D3PO: pairs are consecutive rows of a group; the
  diffusion-LM objectives: :class:`TokenTrajectory`).
- ``"offline_pairs"``: (winner, loser) rows read from a pairs directory (``prompts.pairs``), no
  sampling (Diffusion-DPO).
- ``"reward_gradient_rollouts"``: on-policy trajectories plus the gradient of the reward with respect
  to the final state, ``Trajectory.reward_grads`` (Adjoint Matching); the reward must be differentiable.
- ``"reference_rollouts"``: (winner, reference sample) rows: a winner from a dataset and a clean sample
  of a reference model the objective chooses among previous checkpoints (SePPO); the reward is only logged.
"""

PAIRED_ROWS: tuple[TrainingData, ...] = ("offline_pairs", "reference_rollouts")
"""The kinds whose batch rows come in (winner, loser) pairs, two per prompt, labelled before training."""

GuidanceMode = Literal["cfg", "cfg_detached_uncond", "cfg_rollout_only", "embedded"]
"""How classifier-free guidance enters rollout and training (``rollout.guidance_mode``; docs/guidance.md): "cfg"
both, gradient through both branches; "cfg_detached_uncond" both, the unconditional branch without gradient;
"cfg_rollout_only" rollouts guided, training re-scores the conditional branch alone; "embedded" the scale is a
model input (FLUX.1-dev's guidance embedding), one forward pass."""

ReferenceModel = Literal["none", "initial"]
"""Which frozen model ``pipeline.reference()`` must provide: none, or the initial (pre-training)
weights (LoRA: the adapters switched off; full fine-tuning: a frozen copy)."""


@dataclass(frozen=True)
class TrainedRole:
    """A module an objective trains beside the policy (the model's trained module, always the role ``"policy"``).

    The module is the objective's attribute ``attribute``; the run gives it its own parameter group, optimizer,
    learning-rate schedule and checkpoint entry (its tensors under ``checkpoint_prefix`` in the checkpoint's weights
    and optimizer files), and may replace the attribute by the engine's wrapped module. ``lr_scale``: its learning rate
    relative to ``train.learning_rate`` (``train.roles.<name>`` overrides any setting). ``sharded``: handed to the
    engine to wrap and shard like the policy (DDP, FSDP2, a DeepSpeed engine of its own); False for a small module that
    every process keeps whole and that is called several times per backward pass (DCoLT's head): its gradients are
    averaged over the processes by the engine itself. ``clip_with``: another trained role whose gradient norm this
    role's gradients are measured and clipped with (DCoLT: the head and the language model are one policy).
    ``adapter``: instead of a module of its own, a named LoRA adapter on the policy's base model (``attribute`` unused)."""

    name: str
    attribute: str | None = None
    lr_scale: float = 1.0
    sharded: bool = True
    clip_with: str | None = None
    checkpoint_prefix: str | None = None  # None: "<name>."
    adapter: str | None = None

    @property
    def prefix(self) -> str:
        return self.checkpoint_prefix if self.checkpoint_prefix is not None else f"{self.name}."


@dataclass(frozen=True)
class FrozenRole:
    """A model an objective reads but never trains (a teacher, a reference): ``source="initial"``: the policy's
    starting weights (LoRA: the adapters switched off, full fine-tuning: a frozen copy), reached with
    ``pipeline.reference()``; ``source="attribute"``: the objective's own module ``attribute``, which the run moves to
    the device, freezes (no gradient) and keeps out of every optimizer and checkpoint."""

    name: str
    source: Literal["initial", "attribute"] = "initial"
    attribute: str | None = None


Role = TrainedRole | FrozenRole


@runtime_checkable
class Objective(Protocol):
    """Everything the training loop needs from an objective, declared (the loop never probes).

    The loop calls, per iteration: collect (what ``trains_on`` names) -> score -> ``prepare`` (no grad:
    advantages, pairs, labels) -> for each minibatch of ``minibatch_unit``-aligned rows, one optimizer
    step over the ``LossOutput``s that ``losses`` yields (each is backpropagated before the next is
    produced, so an objective can keep memory flat in the number of denoising steps). A LossOutput names the
    trained role it updates (``"policy"`` unless the objective declares ``roles``); every role that received a loss
    takes one step of its own optimizer after the minibatch's last loss.

    Two optional declarations change how its rollouts are collected (the collectors read them, the loop does not):
    ``rollout_layout`` (image rollouts laid out by the objective: Flash-GRPO's one shared SDE step, TreeGRPO's trees,
    stepwise GRPO's x0 rewards; modalities/image_rollouts.py, samplers/step_credit.py) and ``rollout_sampler(sampler)``
    (a diffusion LM's rollouts with sampler settings of its own, JustGRPO's left to right; modalities/text.py).
    Without them the run's rollout and sampler are used.
    """

    name: str
    trains_on: TrainingData  # what collect() gathers for it
    needs_log_probs: bool  # the rollout sampler must be stochastic and record per-step log-probs
    reference: ReferenceModel  # the frozen model losses() may switch to with pipeline.reference()
    minibatch_unit: int  # rows that stay together when minibatches are shuffled (2: winner/loser pairs)
    roles: tuple[Role, ...]  # modules it trains beside the policy and frozen models it reads (usually none)

    def prepare(self, batch: Trajectory) -> Trajectory:
        """Without grad: fill ``advantages`` (or reorder into pairs, drop rows); return the batch to train on."""
        ...

    def losses(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        """Yield the minibatch's loss in backward-sized pieces; ``generator`` keys every random draw."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Objective state that a resumed run needs (DDPO's per-prompt reward buffers); {} for most."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# ---------------------------------------------------------------------------------------------
# Diffusion language models (masked diffusion: LLaDA, MMaDA, Dream)
# ---------------------------------------------------------------------------------------------


@runtime_checkable
class MaskedLM(Protocol):
    """A masked-diffusion language model adapter.

    ``logits(input_ids)`` maps token ids (B, L) with ``mask_token_id`` at masked positions to
    logits (B, L, V) for every position (Dream-style AR-adapted models already shifted by one inside
    the adapter, so position i's logits always predict token i). Bidirectional attention.
    """

    model: torch.nn.Module
    tokenizer: Any
    mask_token_id: int
    eos_token_id: int | None

    def logits(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor: ...

    def trainable_parameters(self) -> list[torch.nn.Parameter]: ...

    # the training loop's needs, as for Pipeline
    has_lora: bool

    def enable_reference(self) -> None: ...

    def reference(self) -> contextlib.AbstractContextManager: ...

    def trainable_state_dict(self) -> dict[str, Tensor]: ...

    def load_trainable_state_dict(self, weights: dict[str, Tensor]) -> None: ...

    def save_lora(self, directory: Any) -> Any: ...


@runtime_checkable
class TokenObjective(Objective, Protocol):
    """An objective for masked-diffusion LMs: batches are :class:`TokenTrajectory` and losses() gets the MaskedLM."""

    position_scorer: Callable[[Tensor, Tensor], Tensor] | None  # (logits, state) -> scores: an unmasking-order policy (DCoLT)

    def old_and_ref(self, lm: MaskedLM, batch: TokenTrajectory) -> None:
        """Without grad, at the rollout weights: fill ``batch.old_log_probs`` (and ``ref_log_probs``), so the first ratio is 1."""
        ...


@dataclass
class TokenTrajectory:
    """One masked-diffusion generation per row, recorded so any estimator or objective can replay it.

    prompt_ids:     (B, P) prompt tokens (left-padded with pad_token_id; prompt_mask marks real ones).
    prompt_mask:    (B, P) bool.
    completion_ids: (B, G) the final generated tokens.
    unmask_step:    (B, G) int64, the denoising step at which each completion position was unmasked
                    (0-based; every position is unmasked exactly once, LLaDA never re-masks).
    unmask_rank:    (B, G) int64, the order of unmasking within the whole generation (0..G-1); inside a
                    step, the order in which the positions were chosen (the Plackett-Luce order).
    token_log_probs:(B, G) log-prob the sampling policy gave the chosen token at its unmasking step
                    (at temperature 1 semantics of the model's softmax; see the sampler for T != 1).
    num_steps:      total denoising steps.
    prompts, metadata, group_ids, completions (decoded text), rewards, reward_components, advantages:
                    as in Trajectory.
    mask_seeds:     (B, N) int64 seeds for the log-likelihood estimator's random masks, one per inner
                    iteration, drawn at rollout time so old and new policy see the same masks.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    unmask_step: Tensor
    unmask_rank: Tensor
    token_log_probs: Tensor
    num_steps: int
    prompts: list[str]
    metadata: list[dict[str, Any]]
    group_ids: Tensor
    completions: list[str] = field(default_factory=list)
    rewards: Tensor | None = None
    reward_components: dict[str, Tensor] = field(default_factory=dict)
    advantages: Tensor | None = None
    mask_seeds: Tensor | None = None
    old_log_probs: Tensor | None = None  # filled by an objective's prepare(); batch on dim 0
    ref_log_probs: Tensor | None = None
    inner_epoch: int = 0  # set by the trainer for each pass; selects mask_seeds[:, inner_epoch % N]

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def log_likelihood(self) -> Tensor:
        """(B,) float64: the sum of the committed tokens' log-probs at their commit steps (best-of-N's likelihood rule)."""
        return self.token_log_probs.double().sum(1)

    def state_at(self, step: int, mask_token_id: int) -> Tensor:
        """Completion tokens (B, G) as they were *before* denoising step ``step`` (masked if not yet unmasked)."""
        return torch.where(self.unmask_step < step, self.completion_ids, torch.full_like(self.completion_ids, mask_token_id))

    def __getitem__(self, index: Tensor | slice | list[int]) -> TokenTrajectory:
        """Select samples (dim 0 of every per-sample field)."""
        return select_rows(self, index, shared=("num_steps", "inner_epoch"))


@dataclass
class CanvasTrajectory:
    """One uniform-noise block-diffusion generation per row (DiffusionGemma's entropy-bound sampler,
    ``samplers/entropy_bound.py``), recorded so re-scoring replays every step. Tokens can be re-noised, so unlike
    :class:`TokenTrajectory` the final tokens do not replay the states: every step's input canvas is stored.

    prompt_ids, prompt_mask: (B, P) as in TokenTrajectory (left padding).
    completion_ids: (B, G) the output, canvas by canvas (each canvas's last-step argmax; padding after the end token
                    and for canvases never run); G = canvases x canvas_length.
    canvases:       (B, S, L) int64, the canvas each step read (S = canvases x steps per canvas); the kept tokens of
                    step s are canvases[:, s + 1] at the kept positions.
    kept:           (B, S, L) bool, the positions step s kept (its entropy-bound selection).
    frozen:         (B, S) bool, the row was stopped (or the step never ran) before step s: nothing was drawn for it.
    counted:        (B, S) bool, the steps whose kept tokens reach the output: the policy's actions.
    step_log_probs: (B, S) float64, the sum over kept positions of log softmax(logits / T)[token] at sampling time.
    settings:       the resolved sampler settings (samplers/entropy_bound.py::EntropyBoundSettings).
    The rest as in TokenTrajectory; old_log_probs / ref_log_probs are (B, S).
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    canvases: Tensor
    kept: Tensor
    frozen: Tensor
    counted: Tensor
    step_log_probs: Tensor
    settings: Any
    prompts: list[str]
    metadata: list[dict[str, Any]]
    group_ids: Tensor
    completions: list[str] = field(default_factory=list)
    rewards: Tensor | None = None
    reward_components: dict[str, Tensor] = field(default_factory=dict)
    advantages: Tensor | None = None
    mask_seeds: Tensor | None = None  # unused: the log-probs are exact, no estimator masks
    old_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None
    inner_epoch: int = 0

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def num_steps(self) -> int:
        return self.canvases.shape[1]

    def log_likelihood(self) -> Tensor:
        """(B,) float64: the policy's log-probability of its own choices (the counted steps' kept tokens)."""
        return (self.step_log_probs * self.counted).sum(1)

    def __getitem__(self, index: Tensor | slice | list[int]) -> CanvasTrajectory:
        """Select samples (dim 0 of every per-sample field)."""
        return select_rows(self, index, shared=("settings", "inner_epoch"))
