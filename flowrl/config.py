"""Typed run configuration: YAML presets + ``key.sub=value`` overrides, validated strictly.

OmegaConf parses YAML and dotted overrides (values typed by YAML rules); pydantic validates the merged tree.
Each part of a run declares its own section next to its code (flowrl/sections.py): the model family
(``pipeline``, chosen by ``pipeline.name`` from ``pipelines.FAMILIES``), the sampler (``samplers.SAMPLERS``), the
objective (``objectives.OBJECTIVES``), the rewards (``reward_models.mix.RewardConfig``, whose names come from
``reward_models.REWARDS``), the prompts (``prompts.PromptsConfig``) and the rollout
(``samplers.rollout_config.RolloutConfig``). This module composes them, adds the run's own sections (train, eval,
log), and turns every error into one sentence naming the dotted key. Field names follow the ecosystem
(diffusers' ``num_inference_steps``/``guidance_scale``, trl's ``num_generations``/``beta``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from .errors import FlowRLError
from .objectives import OBJECTIVES
from .objectives.adjoint_matching import AdjointMatchingConfig
from .objectives.d3po import D3POConfig
from .objectives.ddpo import DDPOConfig
from .objectives.diffusion_dpo import DiffusionDPOConfig
from .objectives.diffusion_nft import DiffusionNFTConfig
from .objectives.dllm.policy import BGPOConfig, DCoLTConfig, DiffuGRPOConfig, UniGRPOConfig
from .objectives.grpo import GRPOConfig
from .objectives.seppo import SePPOConfig
from .pipelines import FAMILIES
from .pipelines.common import LoraConfig, resolve_device
from .pipelines.diffusers_base import PipelineConfig
from .pipelines.dllm import DLLMPipelineConfig
from .prompts import PromptsConfig
from .reward_models.mix import RewardConfig
from .samplers import SAMPLERS, DDIMConfig, FlowCPSConfig, FlowMemorylessConfig, FlowSDEConfig, MaskedSamplerConfig, ODEConfig
from .samplers.rollout_config import BranchingConfig, RolloutConfig
from .sections import Section

__all__ = [
    "Config", "TrainConfig", "EvalConfig", "LogConfig", "Section", "load_config", "validate", "to_yaml", "resolve_device",
    "eval_steps_and_guidance", "read_yaml_mapping",
    # the sections of flowrl's own parts, importable from here too (each is defined next to its code)
    "PipelineConfig", "DLLMPipelineConfig", "LoraConfig", "RolloutConfig", "BranchingConfig", "RewardConfig", "PromptsConfig",
    "FlowSDEConfig", "FlowCPSConfig", "FlowMemorylessConfig", "DDIMConfig", "ODEConfig", "MaskedSamplerConfig",
    "GRPOConfig", "DDPOConfig", "D3POConfig", "DiffusionDPOConfig", "SePPOConfig", "AdjointMatchingConfig", "DiffusionNFTConfig",
    "DiffuGRPOConfig", "UniGRPOConfig", "DCoLTConfig", "BGPOConfig",
]  # fmt: skip


class RoleConfig(Section):
    """One trained role's optimizer settings (``train.roles.<name>``); every key left unset takes ``train``'s."""

    learning_rate: float | None = Field(
        None, gt=0, description="This role's base learning rate; unset: train.learning_rate times the role's declared scale."
    )
    lr_schedule: Literal["constant", "linear", "cosine"] | None = Field(
        None, description="This role's learning-rate schedule over the iterations; unset: train.lr_schedule."
    )
    lr_min_fraction: float | None = Field(
        None, ge=0, le=1, description="The fraction of the base rate its schedule ends at; unset: train.lr_min_fraction."
    )
    weight_decay: float | None = Field(None, ge=0, description="AdamW's decoupled weight decay for this role; unset: train.weight_decay.")
    max_grad_norm: float | None = Field(None, gt=0, description="Clip this role's gradient norm to this value; unset: train.max_grad_norm.")


class TrainConfig(Section):
    iterations: int = Field(40, ge=1, description="Training iterations (collect, score, update) the run makes in all.")
    prompts_per_iteration: int = Field(8, ge=1, description="Prompt groups sampled per iteration, across all processes.")
    num_generations: int = Field(8, ge=1, description="Samples generated per prompt (the GRPO group size).")
    batch_size: int = Field(16, ge=1, description="Samples per optimizer step and process; N processes step on N x batch_size samples.")
    inner_epochs: int = Field(1, ge=1, description="Passes over one iteration's samples before collecting new ones.")
    learning_rate: float = Field(1e-4, gt=0, description="The optimizer's (AdamW) peak learning rate.")
    # a function of the iteration, so a resumed run is exact
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="Learning-rate decay per iteration, from learning_rate at the first to learning_rate * lr_min_fraction "
        "at the last (diffusers' --lr_scheduler).",
    )
    lr_min_fraction: float = Field(
        0.0, ge=0, le=1, description="The final learning rate as a fraction of learning_rate (linear and cosine schedules)."
    )
    adam_beta1: float = Field(0.9, description="AdamW's first-moment decay (beta1).")
    adam_beta2: float = Field(0.999, description="AdamW's second-moment decay (beta2).")
    weight_decay: float = Field(1e-4, description="AdamW's decoupled weight decay.")
    max_grad_norm: float | None = Field(1.0, description="Clip the gradient's global L2 norm to this value; None: no clipping.")
    mixed_precision: Literal["no", "bf16", "fp16"] = Field(
        "no", description="Autocast precision of forward and backward passes: no (fp32), bf16 or fp16."
    )
    # 1 for the embedded and toy models, whose kernels are too small to share; torch's default for real checkpoints
    num_threads: int | None = Field(None, ge=1, description="torch's intra-op threads per process; None: the model family's choice.")
    # flowrl/training/determinism.py; docs/reproducibility.md says what it costs
    deterministic: bool = Field(
        False,
        description="Bit-reproducible on a GPU too: deterministic kernels, fixed cuBLAS workspace, no cuDNN benchmarking.",
    )
    stop_after: int | None = Field(
        None, ge=1, description="End this process after N iterations (a planned interruption; resume continues)."
    )
    # A run that cannot learn stops (docs/failure_behaviour.md): at once when every reward of an iteration is
    # NaN or infinite, and when more than this fraction of the last nonfinite_window iterations' rewards are.
    max_nonfinite_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Stop the run when more than this fraction of the last nonfinite_window iterations' rewards are NaN or inf.",
    )
    nonfinite_window: int = Field(10, ge=1, description="Iterations over which max_nonfinite_fraction is measured.")
    # Equal rewards within every group give zero advantages: an objective that learns from reward differences then
    # trains on nothing (a judge that answers one score, a binary reward no sample passes).
    flat_reward_warn: int = Field(
        3, ge=0, description="Warn after this many iterations in a row in which every group's rewards were equal (0: never)."
    )
    flat_reward_stop: int = Field(
        10, ge=0, description="Stop the run after this many iterations in a row in which every group's rewards were equal (0: never)."
    )
    roles: dict[str, RoleConfig] = Field(
        default_factory=dict,
        description="Per trained role (policy, or one the objective declares) optimizer settings that differ from train's.",
    )

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _no_is_not_false(cls, v: Any) -> Any:
        return "no" if v is False else v  # YAML reads a bare `no` (mixed_precision: no) as false


class EvalConfig(Section):
    every: int = Field(10, ge=0, description="Iterations between evaluations; 0: only before and after training.")
    samples_per_prompt: int = Field(
        4, ge=1, description="Samples generated per held-out prompt in an evaluation of an image or video model (a diffusion LM's: one)."
    )
    seed: int = Field(1234, description="Seed of the evaluation's noise, distinct from the training stream.")
    # every call has exactly this many rows, the last one padded, so a sample's bits never depend on the other items
    # evaluated beside it
    batch_size: int = Field(16, ge=1, description="Rows per denoiser call in evaluation (and in best-of-N / SVDD / noise search).")
    num_inference_steps: int | None = Field(None, description="Denoising steps in evaluation; None: rollout.num_inference_steps.")
    guidance_scale: float | None = Field(None, description="Classifier-free guidance in evaluation; None: rollout.guidance_scale.")
    # docs/instruments.md
    judge: RewardConfig | None = Field(
        None,
        description="A held-out judge: rewards scored on evaluation samples only, never trained on, logged as eval/judge/*; "
        "None: eval/judge/mean repeats eval/reward/mean.",
    )


def eval_steps_and_guidance(config: Config) -> tuple[int, float]:
    """The evaluation's denoising steps and guidance scale: eval's own where set, else the rollout's."""
    ec, rc = config.eval, config.rollout
    return ec.num_inference_steps or rc.num_inference_steps, ec.guidance_scale if ec.guidance_scale is not None else rc.guidance_scale


def supported_trackers() -> list[str]:
    """The tracker names the installed accelerate knows (its ``LoggerType``, less "all")."""
    from accelerate.utils import LoggerType

    return [t for t in LoggerType.list() if t != "all"]


def check_tracker_names(names: list[str]) -> list[str]:
    """``names`` if every one is a tracker accelerate supports, without repeats; else a ValueError in one sentence."""
    known = supported_trackers()
    for name in names:
        if name not in known:
            raise ValueError(f"'{name}' is not a tracker accelerate supports; choose from {', '.join(known)}")
    if len(set(names)) != len(names):
        raise ValueError(f"names a tracker twice: {names}")
    return names


class LogConfig(Section):
    grid_prompts: int = Field(10, ge=1, description="Prompts shown in the sample grids written at each evaluation.")
    checkpoint_every: int = Field(10, ge=0, description="Iterations between checkpoints; 0: only at the end.")
    progress: bool = Field(True, description="Show a progress bar on the terminal.")
    trackers: list[str] = Field(
        default_factory=lambda: ["tensorboard"],
        description="accelerate's tracker names (tensorboard, wandb, ...) to log metrics to; []: metrics.jsonl only.",
    )
    project: str | None = Field(None, description="The trackers' project name; None: the output_dir's last component.")
    peak_flops: float | None = Field(
        None, gt=0, description="Peak FLOP/s of one device for perf/mfu (docs/throughput.md); None: the known-GPU table, else no MFU."
    )
    tracker_kwargs: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Tracker name -> keyword arguments of its init, e.g. wandb: {mode: offline}."
    )

    @field_validator("trackers")
    @classmethod
    def _known_trackers(cls, v: list[str]) -> list[str]:
        return check_tracker_names(v)

    @model_validator(mode="after")
    def _kwargs_of_chosen_trackers(self) -> LogConfig:
        extra = sorted(set(self.tracker_kwargs) - set(self.trackers))
        if extra:
            raise ValueError(f"tracker_kwargs names {', '.join(extra)}, which log.trackers does not list ({self.trackers})")
        return self


class Config(Section):
    seed: int = Field(0, description="The run's seed: model init, prompt order and sampling noise derive from it.")
    output_dir: str = Field("runs/default", description="Directory the run writes its checkpoints, logs and samples to.")
    resume_from: str | None = Field(
        None, description='Continue from a checkpoint directory, or "latest" (the newest in output_dir); None: start afresh.'
    )
    overwrite: bool = Field(False, description="Start afresh in an output_dir that already holds a run (its files are replaced).")
    # flowrl/training/resume_check.py; a new learning rate or more iterations need nothing
    resume_allow: list[str] = Field(
        default_factory=list,
        description='Keys (or prefixes such as objective) a resume may change although they change what the weights mean; ["*"]: any.',
    )
    pipeline: FAMILIES.field("digits") = Field(  # type: ignore[valid-type]
        default_factory=lambda: FAMILIES.section("digits")(),
        description="The model family and its checkpoint; pipeline.name picks the family's section.",
    )
    sampler: SAMPLERS.field("flow_sde") = Field(  # type: ignore[valid-type]
        default_factory=lambda: SAMPLERS.section("flow_sde")(),
        description="How rollouts are sampled (the SDE or ODE step); sampler.name picks the sampler's section.",
    )
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="Rollout settings shared by every sampler: steps, guidance, size."
    )
    objective: OBJECTIVES.field("grpo") = Field(  # type: ignore[valid-type]
        default_factory=lambda: OBJECTIVES.section("grpo")(),
        description="The training objective (the RL algorithm); objective.name picks its section.",
    )
    reward: RewardConfig = Field(default_factory=RewardConfig, description="The reward: weighted components and their keyword arguments.")
    prompts: PromptsConfig = Field(default_factory=PromptsConfig, description="Where training and evaluation prompts come from.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The optimisation: iterations, batch sizes, optimizer.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Periodic evaluation on held-out prompts.")
    log: LogConfig = Field(default_factory=LogConfig, description="Logging, trackers and checkpoint cadence.")

    @model_validator(mode="after")
    def _parts_agree(self) -> Config:
        """The sampler and the objective are for the pipeline's kind of model (images and video, or text), then each
        part's own rules across sections (``check_run``)."""
        kind = self.pipeline.modality
        for key, part, registry in (("sampler", self.sampler, SAMPLERS), ("objective", self.objective, OBJECTIVES)):
            if part.modality != kind:
                fitting = [n for n in registry.builtin_names() if registry.section(n).modality == kind]
                raise ValueError(
                    f"{key} '{part.name}' is for {_MODEL_KINDS[part.modality]} but pipeline '{self.pipeline.name}' is "
                    f"{_MODEL_KINDS[kind]}; use {key}.name {' or '.join([', '.join(fitting[:-1]), fitting[-1]] if len(fitting) > 1 else fitting)}"
                )
        for part in (self.pipeline, self.sampler, self.objective):
            part.check_run(self)
        return self

    @model_validator(mode="after")
    def _branching_needs_policy_gradient(self) -> Config:
        if self.rollout.branching is not None:
            if not type(self.objective).supports_branching:
                raise ValueError(
                    f"rollout.branching (B2-DiffuRL) trains with a policy-gradient objective (grpo or ddpo), not '{self.objective.name}'"
                )
            if self.train.num_generations < 2:
                raise ValueError(
                    "rollout.branching needs train.num_generations >= 2: the branches of one prefix are compared with each other"
                )
        return self

    @field_validator("output_dir")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v


_MODEL_KINDS = {"images": "image and video models", "text": "a diffusion language model"}


def _describe(error: dict) -> str:
    loc = ".".join(str(p) for p in error["loc"])
    kind, msg = error["type"], error["msg"]
    if kind == "extra_forbidden":
        return f"unknown config key '{loc}'"
    if kind == "part_name":  # pipeline / sampler / objective .name not found (registry.Registry.field)
        return f"config key '{loc}.name' has an unknown value: {msg}"
    if kind == "part_mapping":
        return f"config key '{loc}' {msg}"
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
        return f"config key '{loc}' is invalid: {msg}" if loc else msg  # a check across sections names its keys itself
    return f"config key '{loc}' is invalid: {msg[0].lower()}{msg[1:]} (got {error.get('input')!r})"


def validate(tree: dict[str, Any], before: dict[str, Any] | None = None, overrides: tuple[str, ...] = ()) -> Config:
    """``tree`` as a Config; the first problem as one sentence. ``before`` (the tree the ``overrides`` were applied
    to) lets an error the user did not write be told in the user's own keys."""
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        error = e.errors()[0]
        raise FlowRLError((_left_by_a_renamed_part(error, before or {}, overrides) or _describe(error)) + ".") from None


def _left_by_a_renamed_part(error: dict, before: dict[str, Any], overrides: tuple[str, ...]) -> str | None:
    """``sampler.name=ddim`` on a preset whose sampler is flow_sde keeps the preset's flow_sde keys, which ddim does
    not have: say so in the keys the user wrote, not as an unknown key they never typed."""
    if error["type"] != "extra_forbidden" or len(error["loc"]) < 2:
        return None
    section, key = str(error["loc"][0]), ".".join(str(p) for p in error["loc"])
    written = {o.split("=", 1)[0].strip(): o.split("=", 1)[1].strip() for o in overrides}
    old = (before.get(section) or {}).get("name") if isinstance(before.get(section), dict) else None
    new = written.get(f"{section}.name")
    if new is None or key in written or old in (None, new):
        return None
    return (
        f"{section}.name={new} replaces {section} '{old}', and the config's key '{key}' belongs to '{old}', not "
        f"'{new}'; give the whole section instead, e.g. {section}={{name: {new}}} (flowrl config {section}.{new} lists its keys)"
    )


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


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), base: Config | None = None) -> Config:
    """Load a YAML file or a shipped preset by name (``"digits/grpo"``; the defaults when ``path`` is None, or
    ``base``'s values) and apply ``key.sub=value`` overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from .presets import resolve_config

    if path is not None:
        tree: dict[str, Any] = read_yaml_mapping(resolve_config(path), "config file")
    else:
        tree = base.model_dump(mode="json") if base is not None else {}
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise FlowRLError(f"override '{bad[0]}' must have the form key.sub=value.")
    before = tree
    try:
        for override in overrides:
            tree = apply_override(tree, override)
        tree = OmegaConf.to_container(OmegaConf.create(tree), resolve=True)
    except OmegaConfBaseException as e:
        raise FlowRLError(f"could not apply the overrides: {str(e).splitlines()[0]}.") from None
    return validate(tree, before, tuple(overrides))


def apply_override(tree: dict[str, Any], override: str) -> dict[str, Any]:
    """``tree`` with ``key.sub=value`` set: the value (read by YAML rules, as OmegaConf reads it) replaces what is at
    that key, a mapping included (``reward.components={ink: 1.0}`` is exactly that mapping, not the preset's plus
    ink); one entry of a mapping is set with its own key (``reward.components.ink=1.0``)."""
    import copy

    from omegaconf import OmegaConf

    key = override.split("=", 1)[0].strip()
    if "[" in key:  # list indices: OmegaConf's own merge
        return OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(tree), OmegaConf.from_dotlist([override])))
    value: Any = OmegaConf.to_container(OmegaConf.from_dotlist([override]))
    path = key.split(".")
    for part in path:
        value = value[part]
    tree = copy.deepcopy(tree)
    node = tree
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[path[-1]] = value
    return tree


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def set_num_threads(config: Config) -> int:
    """Set torch's intra-op threads for ``config``'s run (train.num_threads, else the model family's choice, else
    torch's default) and return how many it runs on."""
    import torch

    threads = config.train.num_threads or config.pipeline.default_num_threads()
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
