"""Typed run configuration: YAML presets + ``key.sub=value`` overrides, validated strictly.

OmegaConf parses YAML and dotted overrides (values typed by YAML rules); pydantic validates the merged
tree against the schema below (unknown keys and wrong types rejected). Every error becomes one sentence
naming the dotted key. The schema is the documentation of every knob: field names follow the
ecosystem (diffusers' ``num_inference_steps``/``guidance_scale``, trl's ``num_generations``/``beta``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from .errors import FlowRLError


class Section(BaseModel):
    # allow_inf_nan=False: a NaN or infinite number (a reward weight, a learning rate) can only train nothing
    # or garbage, so it is refused at load time like any other invalid value.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _device_spec(v: str) -> str:
    import re

    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", v):  # what resolve_device() can check exists
        raise ValueError(f"must be auto, cpu, cuda, cuda:N or mps, got {v!r}")
    return v


DeviceSpec = Annotated[str, AfterValidator(_device_spec)]


def resolve_device(spec: str, key: str = "pipeline.device"):
    """The torch device ``spec`` names, or None for "auto" (accelerate's choice: a GPU when present). A device
    this machine does not have is refused in one sentence instead of silently running elsewhere."""
    import torch

    if spec == "auto":
        return None
    device = torch.device(spec)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise FlowRLError(f"{key} is '{spec}' but this machine has no CUDA device (torch.cuda.is_available() is False); "
                              f"use {key}=cpu or {key}=auto.")
        if device.index is not None and device.index >= count:
            raise FlowRLError(f"{key} is '{spec}' but this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1}).")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise FlowRLError(f"{key} is '{spec}' but MPS is not available on this machine; use {key}=cpu or {key}=auto.")
    return device


class LoraConfig(Section):
    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | None = None  # None: the family's default


# Image and video model families (flowrl/pipelines/<family>.py). "digits"/"digits_video" are the
# embedded tiny models; the others load real diffusers checkpoints (hub id or local directory).
IMAGE_FAMILIES = ("digits", "digits_video", "stable_diffusion", "sdxl", "sd3", "flux", "wan", "cogvideox", "wan_i2v", "toy2d")


class PipelineConfig(Section):
    """A diffusion / flow model driven through its diffusers components (see docs/model_families.md)."""

    name: Literal[IMAGE_FAMILIES] = "digits"  # type: ignore[valid-type]
    pretrained: str = "digits_flow"  # an embedded model name, a local directory, or a hub id
    revision: str | None = None  # hub revision (branch, tag or commit)
    variant: str | None = None  # diffusers weight variant, e.g. "fp16"
    device: DeviceSpec = "auto"  # "auto" lets accelerate place it (GPU when present); else exactly this one
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights of the frozen parts and the base model
    lora: LoraConfig | None = None  # None: full fine-tuning of the denoiser
    gradient_checkpointing: bool = False
    attention: Literal["sdpa", "xformers"] = "sdpa"  # xformers needs the [gpu] extra
    offload_frozen: bool = False  # keep text encoders / VAE on the CPU except while they run
    height: int | None = Field(None, ge=8)  # sample size in pixels; None: the family's default
    width: int | None = Field(None, ge=8)
    num_frames: int | None = Field(None, ge=1)  # video families
    max_sequence_length: int | None = Field(None, ge=1)  # text-encoder tokens (T5 families)
    flow_shift: float | None = Field(None, gt=0)  # rectified-flow families: override the checkpoint's sigma shift
    # the sampling grid; default: the family's diffusers pipeline grid for the checkpoint (docs/samplers.md)
    sampling_grid: Literal["default", "linspace", "flux", "flow_match", "unipc", "trailing", "leading"] = "default"


class DLLMPipelineConfig(Section):
    """A masked-diffusion language model (LLaDA, MMaDA, Dream, or the embedded arith_mdlm)."""

    name: Literal["dllm"] = "dllm"
    pretrained: str = "arith_mdlm"  # embedded name, local directory, or hub id
    family: Literal["auto", "llada", "mmada", "dream"] = "auto"
    trust_remote_code: bool = False  # LLaDA/MMaDA/Dream ship their modelling code: opt in explicitly
    device: DeviceSpec = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: LoraConfig | None = None
    prompt_length: int | None = Field(None, ge=1)  # pad prompts (left) to this length; None = longest in batch


def _pipeline_kind(value: Any) -> str:
    """``pipeline.name`` may be omitted for the image pipeline (the default family)."""
    name = value.get("name") if isinstance(value, dict) else getattr(value, "name", None)
    return "dllm" if name == "dllm" else "digits"  # every image/video family validates as PipelineConfig


AnyPipelineConfig = Annotated[Union[Annotated[PipelineConfig, Tag("digits")], Annotated[DLLMPipelineConfig, Tag("dllm")]],
                              Discriminator(_pipeline_kind)]


class FlowSDEConfig(Section):
    name: Literal["flow_sde"] = "flow_sde"
    noise_level: float = Field(0.7, ge=0)  # Flow-GRPO's a, or DanceGRPO's eta
    diffusion: Literal["flow_grpo", "dance_grpo"] = "flow_grpo"
    reduction: Literal["mean", "sum"] = "mean"


class FlowCPSConfig(Section):
    name: Literal["flow_cps"] = "flow_cps"
    noise_level: float = Field(0.7, ge=0, le=1)
    reduction: Literal["mean", "sum"] = "mean"


class FlowMemorylessConfig(Section):
    """The memoryless reverse process of a rectified flow (Adjoint Matching's schedule), exact posterior steps."""

    name: Literal["flow_memoryless"] = "flow_memoryless"
    reduction: Literal["mean", "sum"] = "mean"


class DDIMConfig(Section):
    name: Literal["ddim"] = "ddim"
    eta: float = Field(1.0, ge=0)
    clip_sample: float | None = None
    reduction: Literal["mean", "sum"] = "mean"


class ODEConfig(Section):
    name: Literal["ode"] = "ode"


class MaskedSamplerConfig(Section):
    """LLaDA-style masked-diffusion generation (see flowrl/samplers/masked.py)."""

    name: Literal["masked"] = "masked"
    gen_length: int = Field(16, ge=1)
    steps: int = Field(8, ge=1)
    block_length: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)  # rollouts need > 0 for diversity; evaluation uses eval_temperature
    eval_temperature: float = Field(0.0, ge=0)
    remasking: Literal["low_confidence", "random", "policy"] = "low_confidence"
    threshold: float | None = Field(None, gt=0, lt=1)  # dynamic confidence-threshold decoding
    logit_shift: bool = False

    @model_validator(mode="after")
    def _blocks(self):
        if self.gen_length % self.block_length:
            raise ValueError(f"gen_length ({self.gen_length}) must be a multiple of block_length ({self.block_length})")
        if self.steps % (self.gen_length // self.block_length):
            raise ValueError("steps must be a multiple of the number of blocks (gen_length / block_length)")
        return self


SamplerConfig = Annotated[Union[FlowSDEConfig, FlowCPSConfig, FlowMemorylessConfig, DDIMConfig, ODEConfig, MaskedSamplerConfig], Field(discriminator="name")]


class BranchingConfig(Section):
    """B2-DiffuRL (Hu et al., CVPR 2025; docs/objectives/b2_diffurl.md): backward progressive training with
    branch-based sampling. Each prompt group shares one prefix sampled up to the branch step, and its
    train.num_generations members are branches from there; only the steps after the branch step (the trained
    window, always ending at the data end) are stochastic with log-probs. The window starts at the last
    ``start_steps`` steps and grows towards the noise end in equal stages to ``end_steps`` (default: all)."""

    start_steps: int = Field(2, ge=1)  # trained steps (from the data end) at the first iteration
    end_steps: int | None = Field(None, ge=1)  # trained steps in the last stage; None: rollout.num_inference_steps


class RolloutConfig(Section):
    num_inference_steps: int = Field(10, ge=1)
    guidance_scale: float = 1.0  # 1.0 = no guidance
    # How guidance enters rollout and training (docs/guidance.md): "cfg" both, gradient through both
    # branches; "cfg_detached_uncond" both, unconditional branch without gradient; "cfg_rollout_only"
    # rollout guided, training re-scores the conditional branch alone; "embedded" the scale is a model
    # input (FLUX.1-dev guidance embedding), one forward pass.
    guidance_mode: Literal["cfg", "cfg_detached_uncond", "cfg_rollout_only", "embedded"] = "cfg"
    same_noise_in_group: bool = True
    sde_window_size: int | None = Field(None, ge=1)  # None: every step stochastic
    sde_window_start: int = Field(0, ge=0)
    sde_window_slide_every: int = Field(0, ge=0)  # iterations between one-step slides (MixGRPO); 0 = fixed
    batch_size: int = Field(64, ge=1)  # samples per denoiser call during rollout
    branching: BranchingConfig | None = None  # B2-DiffuRL: shared prefix, branches, backward progressive window

    @model_validator(mode="after")
    def _branching_steps(self):
        b = self.branching
        if b is not None:
            end = b.end_steps or self.num_inference_steps
            if not b.start_steps <= end <= self.num_inference_steps:
                raise ValueError(f"rollout.branching needs start_steps ({b.start_steps}) <= end_steps ({end}) <= num_inference_steps "
                                 f"({self.num_inference_steps})")
            if self.sde_window_size is not None:
                raise ValueError("rollout.branching sets the trained window itself; leave rollout.sde_window_size unset")
        return self


class PolicyObjectiveBase(Section):
    clip_range: float = Field(1e-4, gt=0)
    beta: float = Field(0.0, ge=0)  # KL weight; see docs/objectives for its scaling
    kl_form: Literal["gaussian", "flow_grpo"] = "gaussian"
    timestep_fraction: float = Field(1.0, gt=0, le=1)
    timestep_order: Literal["random", "first"] = "random"
    # GRPO-Guard's ratio normalisation (Wang et al. 2025): each step's log-ratio re-centred and scaled by the
    # transition std, so the ratio is centred at 1 with a step-independent spread (docs/instruments.md)
    ratio_norm: bool = False


class GRPOConfig(PolicyObjectiveBase):
    name: Literal["grpo"] = "grpo"
    std: Literal["unbiased", "biased", "global", "none"] = "unbiased"
    std_eps: float = Field(1e-8, gt=0)
    per_reward_advantages: bool = False  # normalise each reward component in its group, then weight and sum
    adv_clip_max: float | None = None
    best_worst_k: int | None = Field(None, ge=2)
    # TempFlow-GRPO's noise-aware step credit: each trained step's policy term weighted by its transition std,
    # normalised to mean 1 over the trained steps (docs/objectives/grpo.md); none: every step alike
    step_weighting: Literal["none", "noise_level"] = "none"


class DDPOConfig(PolicyObjectiveBase):
    name: Literal["ddpo"] = "ddpo"
    per_prompt_stat_tracking: bool = True
    buffer_size: int = Field(32, ge=1)
    min_count: int = Field(16, ge=1)
    adv_clip_max: float = Field(5.0, gt=0)


class D3POConfig(Section):
    """D3PO: pairs of samples of one prompt, preference from the rewards, DPO loss on every trained step."""

    name: Literal["d3po"] = "d3po"
    beta: float = Field(0.1, gt=0)
    clip_range: float = Field(0.1, gt=0, lt=1)  # the ratio to the reference is clamped to [1 - c, 1 + c]
    # pareto: over the reward components; human: a person's labels of the pairs in prompts.pairs (flowrl label,
    # labels.jsonl), trained on the trajectories stored with them (python -m flowrl.preference_pairs --trajectories)
    preference: Literal["reward", "pareto", "human"] = "reward"
    timestep_fraction: float = Field(1.0, gt=0, le=1)
    timestep_order: Literal["random", "first"] = "random"


class DiffusionDPOConfig(Section):
    """Diffusion-DPO: DPO on the denoising loss, from offline preference pairs (prompts.pairs)."""

    name: Literal["diffusion_dpo"] = "diffusion_dpo"
    beta: float = Field(5000.0, gt=0)  # the reference's value for SD1.5 / SDXL latents
    preference: Literal["stored", "human"] = "stored"  # stored: the pairs' own order; human: their labels.jsonl (flowrl label)


class SePPOConfig(Section):
    """SePPO: winners from a dataset, losers sampled by a previous checkpoint, the anchor-based flipper (docs/objectives/seppo.md)."""

    name: Literal["seppo"] = "seppo"
    beta: float = Field(5000.0, gt=0)  # Diffusion-DPO's scale for SD latents
    reference_strategy: Literal["latest", "rpc", "psm"] = "rpc"  # newest checkpoint / uniform over all (initial included) / softmax of quality
    ref_update_every: int = Field(1, ge=1)  # iterations between checkpoint snapshots
    max_checkpoints: int = Field(8, ge=1)  # snapshots held in memory (and in each checkpoint), the initial one always among them
    psm_temperature: float = Field(0.1, gt=0)  # psm: p ~ exp(quality / T), quality = mean reward of a checkpoint's samples
    flip_margin: float = Field(0.0, ge=0)  # |implicit-reward gap| (loss-logit units) at or below which a reference sample is skipped
    winners: str = "embedded"  # the embedded digits data, a .jsonl of {"prompt", "image"} lines, or a folder of images + .txt prompts
    winners_select: str | dict[str, float] | None = None  # a reward name (ink) or weighted names ({ink: 1, digit_classifier: 1}): keep the best winners_top_fraction of each metadata group by it
    winners_top_fraction: float = Field(1.0, gt=0, le=1)


class AdjointMatchingConfig(Section):
    """Adjoint Matching: regress the control onto the lean adjoint of the reward gradient (needs a differentiable
    reward and a memoryless sampler: flow_memoryless for flow models, ddim with eta 1 for diffusion models)."""

    name: Literal["adjoint_matching"] = "adjoint_matching"
    reward_multiplier: float = Field(1.0, gt=0)  # lambda: the target is p_base(x) exp(lambda r(x)); the authors use 100 with ImageReward
    num_trained_steps: int | None = Field(4, ge=1)  # steps per minibatch with a loss; None: every step below sigma = 1
    early_fraction: float = Field(0.6, gt=0, lt=1)  # stratified draw: half the trained steps from this first fraction
    clip_quantile: float | None = Field(0.9, gt=0, le=1)  # per-sample loss clipping at the EMA'd quantile; None: off
    clip_ema_decay: float = Field(0.9, ge=0, lt=1)
    # The tilt p_base exp(lambda r) is the fixed point only on a memoryless schedule; true lets another
    # sampler run anyway, to measure the bias it leaves (docs/objectives/adjoint_matching.md)
    allow_non_memoryless: bool = False


class DiffusionNFTConfig(Section):
    """DiffusionNFT: flow matching of implicit positive / negative policies on the rollouts' clean samples (no log-probs)."""

    name: Literal["diffusion_nft"] = "diffusion_nft"
    beta: float = Field(1.0, gt=0)  # implicit-policy mixing strength (the authors: 1; 0.1 for OCR)
    std: Literal["unbiased", "biased", "global", "none"] = "global"  # group advantage normalisation before r
    std_eps: float = Field(1e-4, gt=0)
    adv_clip_max: float = Field(5.0, gt=0)  # r = clip(1/2 + A / (2 adv_clip_max), 0, 1)
    timestep_fraction: float = Field(0.99, gt=0, le=1)  # of the rollout grid's times, trained per sample
    old_decay_rate: float = Field(0.0, ge=0)  # old policy soft update eta = min(rate * optimizer steps, max); 0: rollout weights
    old_decay_max: float = Field(0.5, ge=0, lt=1)


class DLLMObjectiveBase(Section):
    clip_range: float = Field(0.2, gt=0)
    beta: float = Field(0.0, ge=0)  # k3 KL to the reference (LoRA disabled / initial weights)
    num_mask_seeds: int = Field(1, ge=1)  # inner iterations each see their own stored mask seed
    # The completions of one prompt share their estimator masks (common random numbers): see modalities/text.py::draw_mask_seeds.
    group_shared_masks: bool = True


class DiffuGRPOConfig(DLLMObjectiveBase):
    """d1: one-pass estimator (completion masked, prompt masked at prompt_mask_prob), r - mean advantages."""

    name: Literal["diffu_grpo"] = "diffu_grpo"
    clip_range: float = Field(0.5, gt=0)
    prompt_mask_prob: float = Field(0.15, ge=0, lt=1)
    std: Literal["unbiased", "biased", "global", "none"] = "none"


class UniGRPOConfig(DLLMObjectiveBase):
    """MMaDA: answer-only masking at a ratio ~ U[low, high], z-scored advantages."""

    name: Literal["unigrpo"] = "unigrpo"
    mask_low: float = Field(0.1, gt=0, lt=1)
    mask_high: float = Field(0.9, gt=0, le=1)
    std: Literal["unbiased", "biased", "global", "none"] = "biased"


class DCoLTConfig(DLLMObjectiveBase):
    """DCoLT: exact per-step action log-probs (Plackett-Luce unmasking policy + token log-probs)."""

    name: Literal["dcolt"] = "dcolt"
    std: Literal["unbiased", "biased", "global", "none"] = "biased"
    std_eps: float = Field(1e-4, gt=0)
    scorer_lr_scale: float = Field(1.0, gt=0)
    # The head starts as confidence_prior * log(confidence): LLaDA's low-confidence order as it grows, 0 = random head.
    confidence_prior: float = Field(0.0, ge=0)


class BGPOConfig(DLLMObjectiveBase):
    """BGPO: linear lower bound of ELBO-GRPO, one backward per Monte Carlo sample."""

    name: Literal["bgpo"] = "bgpo"
    num_mc_samples: int = Field(4, ge=1)
    std: Literal["unbiased", "biased", "global", "none"] = "biased"
    naive: bool = False  # the plain ELBO-GRPO baseline: all MC samples in one graph (for comparison)


ObjectiveConfig = Annotated[Union[GRPOConfig, DDPOConfig, D3POConfig, DiffusionDPOConfig, SePPOConfig, AdjointMatchingConfig, DiffusionNFTConfig, DiffuGRPOConfig, UniGRPOConfig, DCoLTConfig, BGPOConfig],
                            Field(discriminator="name")]


class EnsembleMember(Section):
    name: str  # a registered reward
    kwargs: dict[str, Any] = Field(default_factory=dict)


class EnsembleConfig(Section):
    """Several reward models of the same quantity combined conservatively (WCO / UWO)."""

    members: list[EnsembleMember] = Field(min_length=2)
    mode: Literal["mean", "wco", "uwo"] = "wco"
    coefficient: float = Field(1.0, ge=0)  # UWO's lambda
    uncertainty: Literal["variance", "std"] = "variance"


class FrameSelection(Section):
    """Score videos with an image reward frame by frame (the mean), or only the first frame (the cheap proxy)."""

    first_frame_only: bool = False
    every_n: int = Field(1, ge=1)


class BinaryRewardConfig(Section):
    """A sparse binary reward: 1 when every named reward's score is strictly above its threshold, else 0."""

    all_of: dict[str, float] = Field(min_length=1)  # registered reward name -> threshold


class RewardConfig(Section):
    components: dict[str, float] = Field(default_factory=lambda: {"digit_classifier": 1.0})  # name -> weight
    kwargs: dict[str, dict[str, Any]] = Field(default_factory=dict)  # name -> constructor arguments
    ensembles: dict[str, EnsembleConfig] = Field(default_factory=dict)  # new component names -> ensembles
    video_frames: dict[str, FrameSelection] = Field(default_factory=dict)  # component -> frames an image reward scores
    binary: dict[str, BinaryRewardConfig] = Field(default_factory=dict)  # new component names -> thresholded all-of rewards

    @model_validator(mode="after")
    def _known_names(self):
        from .reward_models import REWARD_NAMES

        known = set(REWARD_NAMES) | set(self.ensembles) | set(self.binary)
        members = [m.name for e in self.ensembles.values() for m in e.members] + [n for b in self.binary.values() for n in b.all_of]
        if set(self.binary) & set(self.ensembles):
            raise ValueError(f"reward names {sorted(set(self.binary) & set(self.ensembles))} are both an ensemble and a binary reward")
        for name in list(self.components) + list(self.kwargs) + members + list(self.video_frames):
            if name not in known or (name in members and (name in self.ensembles or name in self.binary)):
                raise ValueError(f"unknown reward '{name}'; choose one of: {', '.join(REWARD_NAMES)}")
        if not self.components:
            raise ValueError("at least one reward component is needed")
        return self


class PromptsConfig(Section):
    dataset: Literal["digits", "digits_video", "arith", "gsm8k", "math500", "countdown", "sudoku", "file", "toy2d"] = "digits"
    eval_size: int = Field(200, ge=1)  # held-out prompts for text datasets
    train_split: str = "train"
    eval_split: str = "eval"
    # dataset "file": one prompt per line (.txt) or JSON lines with a "prompt" key, the other keys being
    # metadata for the rewards (.jsonl); a bundled name (flowrl/data/prompts/<name>) or a path
    train_file: str | None = None
    eval_file: str | None = None
    pairs: str | None = None  # Diffusion-DPO's offline preference pairs: a directory (python -m flowrl.preference_pairs)

    @model_validator(mode="after")
    def _files(self):
        if self.dataset == "file" and not (self.train_file and self.eval_file):
            raise ValueError("dataset 'file' needs both train_file and eval_file")
        return self


class TrainConfig(Section):
    iterations: int = Field(40, ge=1)
    prompts_per_iteration: int = Field(8, ge=1)  # groups per iteration, across all processes
    num_generations: int = Field(8, ge=1)  # samples per prompt (GRPO group size)
    batch_size: int = Field(16, ge=1)  # samples per optimizer step
    inner_epochs: int = Field(1, ge=1)
    learning_rate: float = Field(1e-4, gt=0)
    # per iteration, from learning_rate at the first to learning_rate * lr_min_fraction at the last (diffusers'
    # --lr_scheduler constant / linear / cosine); a function of the iteration, so a resumed run is exact
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    lr_min_fraction: float = Field(0.0, ge=0, le=1)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    weight_decay: float = 1e-4
    max_grad_norm: float | None = 1.0
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    stop_after: int | None = Field(None, ge=1)  # end this process after N iterations (a planned interruption)
    # A run that cannot learn stops (docs/failure_behaviour.md): at once when every reward of an iteration is
    # NaN or infinite, and when more than this fraction of the last nonfinite_window iterations' rewards are.
    max_nonfinite_fraction: float = Field(0.5, ge=0, le=1)
    nonfinite_window: int = Field(10, ge=1)


class EvalConfig(Section):
    every: int = Field(10, ge=0)  # iterations between evaluations; 0 = only before and after
    samples_per_prompt: int = Field(4, ge=1)
    seed: int = 1234  # held-out seeds, distinct from the training stream
    num_inference_steps: int | None = None  # None: rollout.num_inference_steps
    guidance_scale: float | None = None  # None: rollout.guidance_scale
    # a held-out judge: rewards scored on the evaluation samples only and never given to the objective, logged as
    # eval/judge/* beside the training reward (docs/instruments.md); None: eval/judge/mean repeats eval/reward/mean
    judge: RewardConfig | None = None


def eval_steps_and_guidance(config: "Config") -> tuple[int, float]:
    """The evaluation's denoising steps and guidance scale: eval's own where set, else the rollout's."""
    ec, rc = config.eval, config.rollout
    return ec.num_inference_steps or rc.num_inference_steps, ec.guidance_scale if ec.guidance_scale is not None else rc.guidance_scale


class LogConfig(Section):
    grid_prompts: int = Field(10, ge=1)
    checkpoint_every: int = Field(10, ge=0)  # 0 = only at the end
    progress: bool = True
    trackers: list[str] = Field(default_factory=lambda: ["tensorboard"])  # accelerate's tracker names (flowrl/trackers.py); [] = metrics.jsonl only
    project: str | None = None  # the trackers' project name; default: the output_dir's last component
    tracker_kwargs: dict[str, dict[str, Any]] = Field(default_factory=dict)  # tracker name -> its init kwargs, e.g. wandb: {mode: offline}

    @field_validator("trackers")
    @classmethod
    def _known_trackers(cls, v: list[str]) -> list[str]:
        from .trackers import check_tracker_names

        return check_tracker_names(v)

    @model_validator(mode="after")
    def _kwargs_of_chosen_trackers(self) -> "LogConfig":
        extra = sorted(set(self.tracker_kwargs) - set(self.trackers))
        if extra:
            raise ValueError(f"tracker_kwargs names {', '.join(extra)}, which log.trackers does not list ({self.trackers})")
        return self


class Config(Section):
    seed: int = 0
    output_dir: str = "runs/default"
    resume_from: str | None = None  # a checkpoint directory, or "latest" (in output_dir)
    overwrite: bool = False  # start afresh in an output_dir that already holds a run (its files are replaced)
    pipeline: AnyPipelineConfig = Field(default_factory=PipelineConfig)
    sampler: SamplerConfig = Field(default_factory=FlowSDEConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    objective: ObjectiveConfig = Field(default_factory=GRPOConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    prompts: PromptsConfig = Field(default_factory=PromptsConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    log: LogConfig = Field(default_factory=LogConfig)

    @model_validator(mode="after")
    def _branching_needs_policy_gradient(self) -> "Config":
        if self.rollout.branching is not None:
            if self.objective.name not in ("grpo", "ddpo"):
                raise ValueError(f"rollout.branching (B2-DiffuRL) trains with a policy-gradient objective (grpo or ddpo), not '{self.objective.name}'")
            if self.train.num_generations < 2:
                raise ValueError("rollout.branching needs train.num_generations >= 2: the branches of one prefix are compared with each other")
        return self

    @model_validator(mode="after")
    def _adjoint_matching_is_memoryless(self) -> "Config":
        o, s = self.objective, self.sampler
        memoryless = s.name == "flow_memoryless" or (s.name == "ddim" and s.eta == 1.0)
        if o.name == "adjoint_matching" and not memoryless and not o.allow_non_memoryless:
            raise ValueError(f"adjoint_matching needs a memoryless sampler (flow_memoryless, or ddim with eta 1) but sampler.name is "
                             f"'{s.name}'{' with eta ' + str(s.eta) if s.name == 'ddim' else ''}; on another schedule its fixed point is "
                             f"not p_base exp(lambda r) (set objective.allow_non_memoryless=true to run it anyway)")
        return self

    @field_validator("output_dir")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v


def _describe(error: dict) -> str:
    tags = {"flow_sde", "flow_cps", "flow_memoryless", "ddim", "ode", "masked", "grpo", "ddpo", "d3po", "diffusion_dpo", "seppo", "adjoint_matching", "diffusion_nft", "diffu_grpo", "unigrpo", "dcolt", "bgpo", "digits", "dllm"}
    loc = ".".join(str(p) for p in error["loc"] if not (isinstance(p, str) and p in tags))
    kind, msg = error["type"], error["msg"]
    if kind == "extra_forbidden":
        return f"unknown config key '{loc}'"
    if kind == "union_tag_invalid":
        return f"config key '{loc}.name' has an unknown value: {error['ctx']['tag']!r} (choose one of {error['ctx']['expected_tags']})"
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
        return f"config key '{loc}' is invalid: {msg}" if loc else msg  # a check across sections names its keys itself
    return f"config key '{loc}' is invalid: {msg[0].lower()}{msg[1:]} (got {error.get('input')!r})"


def validate(tree: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise FlowRLError(_describe(e.errors()[0]) + ".") from None


def read_yaml_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping; every problem is one sentence naming ``what`` and the path."""
    path = Path(path)
    if not path.is_file():
        raise FlowRLError(f"{what} '{path}' does not exist.")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise FlowRLError(f"{what} '{path}' is not valid YAML ({str(e).splitlines()[0]}).") from None
    if not isinstance(tree, dict):
        raise FlowRLError(f"{what} '{path}' must hold a mapping of keys to values.")
    return tree


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML preset (or the defaults when ``path`` is None) and apply ``key.sub=value`` overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    tree: dict[str, Any] = read_yaml_mapping(path, "config file") if path is not None else {}
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise FlowRLError(f"override '{bad[0]}' must have the form key.sub=value.")
    try:
        merged = OmegaConf.merge(OmegaConf.create(tree), OmegaConf.from_dotlist(list(overrides)))
        tree = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as e:
        raise FlowRLError(f"could not apply the overrides: {str(e).splitlines()[0]}.") from None
    return validate(tree)


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
