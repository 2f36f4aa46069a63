"""The ``reward`` section of a run and the reward it builds: a weighted sum of named components.

    reward:
      components: {pickscore: 1.0, "my_pkg.scores:sharpness": 0.5}   # name -> weight
      kwargs: {pickscore: {normalize: true}}                          # name -> constructor arguments
      sources: {sharp: "my_pkg.scores:sharpness"}                     # a component's own name -> the reward it is
      ensembles: {...}      # new component names -> conservative ensembles (combine.py)
      binary: {...}         # new component names -> thresholded all-of rewards (binary.py)
      video_frames: {...}   # component -> which frames an image reward scores of a video (per_frame.py)

Every name is checked when the config loads (registered, an installed entry point, or an import path that
imports), and so are the keyword arguments, against the reward's constructor: a typo is one sentence naming the
key before any model loads. ``eval.judge`` is a section of the same kind.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails

from flowrl.errors import FlowRLError
from flowrl.sections import Section
from flowrl.types import Reward

from .binary import BinaryRewardConfig
from .combine import EnsembleConfig, RewardEnsemble, WeightedSum
from .per_frame import FrameSelection
from .registry import REWARDS, as_reward, build_reward


class RewardConfig(Section):
    components: dict[str, float] = Field(
        default_factory=lambda: {"digit_classifier": 1.0},
        description="Reward name (registered, an entry point or an import path) -> its weight in the summed reward.",
    )
    kwargs: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Reward name -> its constructor's arguments (flowrl config reward.NAME lists them)."
    )
    # so a component can be named for its logs (reward/<name>) whatever its source
    sources: dict[str, str] = Field(
        default_factory=dict,
        description="A component's own name -> the reward it is (a registered name, an entry point or an import path).",
    )
    ensembles: dict[str, EnsembleConfig] = Field(
        default_factory=dict, description="New component names -> conservative ensembles of several reward models (WCO / UWO)."
    )
    video_frames: dict[str, FrameSelection] = Field(
        default_factory=dict, description="Component -> which frames of a video an image reward scores (the mean over them)."
    )
    binary: dict[str, BinaryRewardConfig] = Field(
        default_factory=dict, description="New component names -> sparse rewards: 1 when every named reward passes its threshold, else 0."
    )

    @field_validator("components")
    @classmethod
    def _some_component(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("at least one reward component is needed")
        return v

    @model_validator(mode="after")
    def _known_names(self):
        defined = set(self.ensembles) | set(self.binary)  # component names this section defines itself
        members = [m.name for e in self.ensembles.values() for m in e.members] + [n for b in self.binary.values() for n in b.all_of]
        if set(self.binary) & set(self.ensembles):
            raise ValueError(f"reward names {sorted(set(self.binary) & set(self.ensembles))} are both an ensemble and a binary reward")
        for name in list(self.components) + list(self.kwargs) + members + list(self.video_frames) + list(self.sources):
            if name in defined and name not in members:
                continue
            source = self.source(name)
            if name in defined or source not in REWARDS:  # an ensemble or binary reward cannot be a member of another
                raise ValueError(REWARDS.unknown(source))
            try:
                REWARDS.section(source)  # imports a user's module now, not after the model loaded
            except FlowRLError as e:
                raise ValueError(str(e).rstrip(".")) from None
        for name, kwargs in self.kwargs.items():
            if name not in defined:
                _check_kwargs(self.source(name), kwargs, ("kwargs", name))
        for ensemble_name, ensemble in self.ensembles.items():
            for i, member in enumerate(ensemble.members):
                _check_kwargs(self.source(member.name), member.kwargs, ("ensembles", ensemble_name, "members", i, "kwargs"))
        return self

    def source(self, name: str) -> str:
        """The reward component ``name`` is: its ``sources`` entry, else the name itself."""
        return self.sources.get(name, name)


def _check_kwargs(name: str, kwargs: dict[str, Any], loc: tuple) -> None:
    """``kwargs`` against reward ``name``'s constructor; a mismatch is a validation error at ``reward.<loc>.<key>``."""
    try:
        REWARDS.section(name).model_validate(kwargs)
    except ValidationError as e:
        details = [
            InitErrorDetails(type=err["type"], loc=(*loc, *err["loc"]), input=err["input"], ctx=err.get("ctx", {}))
            for err in e.errors(include_url=False)
        ]
        raise ValidationError.from_exception_data("RewardConfig", details) from None


def build_reward_from_config(config: RewardConfig) -> Reward:
    """The weighted sum of ``config.components`` (name -> weight), each with ``config.kwargs[name]``.

    Always a WeightedSum, even for one component, so every run logs ``reward/<name>`` the same way.
    A component named in ``config.ensembles`` is a RewardEnsemble of its members, one named in
    ``config.binary`` an AllOfReward (1 when every member's score passes its threshold).
    """

    def one(name: str) -> Reward:
        ensemble = config.ensembles.get(name)
        binary = config.binary.get(name)
        if binary is not None:  # a sparse reward: 1 when every member passes its threshold (reward_models/binary.py)
            from .binary import AllOfReward

            inners = {m: build_reward(config.source(m), **config.kwargs.get(m, {})) for m in binary.all_of}
            reward = AllOfReward(inners, binary.all_of, name=name)
        elif ensemble is None:
            reward = build_reward(config.source(name), **config.kwargs.get(name, {}))
        else:
            members = [build_reward(config.source(m.name), **m.kwargs) for m in ensemble.members]
            reward = RewardEnsemble(members, ensemble.mode, ensemble.coefficient, ensemble.uncertainty, name=name)
        frames = config.video_frames.get(name)
        if frames is not None:  # an image reward applied to videos: all frames, every n-th, or the first only
            from .per_frame import PerFrameReward

            reward = PerFrameReward(reward, every_n=frames.every_n, first_frame_only=frames.first_frame_only)
        return reward

    return WeightedSum({name: one(name) for name in config.components}, dict(config.components))


def rewards_from_python(reward: Any, weights: dict[str, float] | None = None) -> tuple[Reward, RewardConfig]:
    """What ``flowrl.Trainer(reward=...)`` takes, as the training reward and the section the run's config records
    (the components by name, and as ``sources`` the import paths of those that can be imported again, so the
    config.yaml of the run names them for ``flowrl eval`` and a resume):

    - a mapping ``{name: reward}``: a weighted sum (``weights[name]``, default 1); each value a flowrl Reward, a
      user's reward object or a plain function;
    - an object with ``name`` and ``differentiable`` (a Reward, e.g. a wrapper around flowrl's own): used as given,
      its answers checked;
    - a plain callable ``fn(samples, prompts, metadata)``: one component named after it.
    """
    weights = dict(weights or {})
    if isinstance(reward, dict):
        unknown = sorted(set(weights) - set(reward))
        if unknown:
            raise FlowRLError(f"reward_weights names {unknown}, which the rewards given do not.")
        table = {str(name): float(weights.get(name, 1.0)) for name in reward}
        return WeightedSum({str(name): _component(r, str(name)) for name, r in reward.items()}, table), _recorded(table, reward)
    if weights:
        raise FlowRLError("reward_weights weighs the parts of a mapping {name: reward}; a single reward has none.")
    if hasattr(reward, "name") and hasattr(reward, "differentiable"):
        return _component(reward, str(reward.name)), _recorded({str(reward.name): 1.0}, {str(reward.name): reward})
    name = getattr(reward, "__name__", None) or type(reward).__name__
    return WeightedSum({name: _component(reward, name)}, {name: 1.0}), _recorded({name: 1.0}, {name: reward})


def _recorded(weights: dict[str, float], objects: dict) -> RewardConfig:
    """The reward section a run given Python rewards writes to config.yaml (not validated: a name may stand for an
    object that cannot be found again, e.g. a lambda; such a run can be evaluated and resumed from Python only)."""
    sources = {str(n): p for n, r in objects.items() if (p := import_path_of(r)) is not None and p != n}
    return RewardConfig.model_construct(**{**RewardConfig().model_dump(), "components": weights, "sources": sources})


def import_path_of(obj: Any) -> str | None:
    """``"module:qualname"`` when importing it gives back ``obj`` itself (a module-level function or class, or a
    registered name's object), else None."""
    import importlib

    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if found is obj else None


def _component(reward: Any, name: str) -> Reward:
    """flowrl's own reward objects as they are; anything else checked by a CallableReward."""
    return reward if type(reward).__module__.startswith("flowrl.") else as_reward(reward, name, probe=False)


def user_parts(reward: Any, name: str = "reward") -> list[tuple[str, Any]]:
    """(name, part) for each top-level part of ``reward`` that holds a user's reward (a :class:`CallableReward`) at
    any depth: what :func:`probe_user_rewards` tries. flowrl's own rewards are tested, so they are not probed."""
    from .binary import AllOfReward
    from .callable_reward import CallableReward
    from .per_frame import PerFrameReward

    def holds_user(r: Any) -> bool:
        if isinstance(r, CallableReward):
            return r.probe
        inner = list(getattr(r, "components", {}).values()) if isinstance(r, WeightedSum) else []
        inner += list(r.members) if isinstance(r, RewardEnsemble) else []
        inner += [p.inner for p in r.parts.values()] if isinstance(r, AllOfReward) else []
        inner += [r.inner] if isinstance(r, PerFrameReward) else []
        return any(holds_user(i) for i in inner)

    if isinstance(reward, WeightedSum):
        return [(key, part) for key, part in reward.components.items() if holds_user(part)]
    return [(getattr(reward, "name", name), reward)] if holds_user(reward) else []


def probe_user_rewards(rewards: list[Any], samples: Any, prompts: list[str], metadata: list[dict]) -> None:
    """Score ``samples`` (a small batch shaped like the model's, ``pipeline.probe_samples``) with the run's first
    prompts through every user's reward part, before any model loads: a reward that raises or answers in the wrong
    shape stops the run here in one sentence."""
    from .callable_reward import probe

    for name, part in [p for r in rewards for p in user_parts(r)]:
        probe(part, samples, prompts, [dict(m) for m in metadata], name)


def required_metadata(reward, weight: float = 1.0) -> set[tuple[str, str]]:
    """(reward name, metadata key) pairs a reward needs, through weighted sums, ensembles and per-frame wrappers."""
    if weight == 0:
        return set()
    found = {(getattr(reward, "name", "reward"), key) for key in getattr(reward, "required_metadata", ())}
    components = getattr(reward, "components", None)
    if isinstance(components, dict):
        weights = getattr(reward, "weights", None) or {}
        for name, part in components.items():
            found |= required_metadata(part, weights.get(name, 1.0))
    for part in [*(getattr(reward, "members", None) or []), getattr(reward, "inner", None)]:
        if part is not None:
            found |= required_metadata(part)
    return found
