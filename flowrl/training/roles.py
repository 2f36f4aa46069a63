"""The roles of a run: the modules it trains, each with its own optimizer, and the frozen models it reads.

Every run trains the role ``"policy"``: the model's trained module (the denoiser or the language model; its LoRA
adapters, or all of it). An objective declares more in ``Objective.roles`` (flowrl/types.py): a trained role is a
module of the objective's own (DCoLT's unmasking-policy head, a critic, a fake-score model) or a named LoRA adapter on
the policy's base model; a frozen role is a teacher or a reference that no optimizer touches.

Each trained role has its own parameter group and optimizer (AdamW), its own learning-rate schedule (``train.*`` unless
``train.roles.<name>`` says otherwise) and its own entry in a checkpoint: its tensors, under its prefix, in the
checkpoint's weights and optimizer files (the policy's without a prefix, so a one-role checkpoint is what it always
was). The engine (engine.py) wraps each role for the launch (DDP, FSDP2, a DeepSpeed engine per role) and steps them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import RoleConfig
from ..errors import FlowRLError
from ..types import FrozenRole, TrainedRole

POLICY = "policy"


def lr_factor(schedule: str, iteration: int, iterations: int, min_fraction: float = 0.0) -> float:
    """The learning rate of 0-based ``iteration`` of ``iterations`` as a fraction of the base rate: 1 throughout for
    "constant"; for "linear" and "cosine" 1 at the first iteration and ``min_fraction`` at the last."""
    if schedule == "constant" or iterations <= 1:
        return 1.0
    progress = min(max(iteration / (iterations - 1), 0.0), 1.0)
    shape = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_fraction + (1 - min_fraction) * shape


@dataclass
class OptimizerSettings:
    """What a trained role's optimizer and schedule run with, resolved from train.* and train.roles.<name>."""

    learning_rate: float
    lr_schedule: str
    lr_min_fraction: float
    betas: tuple[float, float]
    weight_decay: float
    max_grad_norm: float | None

    def learning_rate_at(self, iteration: int, iterations: int) -> float:
        return self.learning_rate * lr_factor(self.lr_schedule, iteration, iterations, self.lr_min_fraction)


@dataclass
class Trained:
    """A trained role at run time. The module is ``owner.<attribute>`` (the engine may replace it with its wrapper);
    ``state_dict`` / ``load_state_dict`` read and write what its checkpoint entry stores (LoRA adapters only, or the
    whole module), whatever wraps it."""

    name: str
    owner: Any
    attribute: str
    trainable: Callable[[], list[torch.nn.Parameter]]  # read afresh: FSDP2 replaces the parameters when it shards them
    state_dict: Callable[[], dict[str, torch.Tensor]]
    load_state_dict: Callable[[dict[str, torch.Tensor]], None]
    prefix: str
    settings: OptimizerSettings
    sharded: bool = True
    clip_with: str | None = None
    adapter: str | None = None
    optimizer: Any = field(default=None, repr=False)  # set by the engine's prepare

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        """What its optimizer steps (the LoRA adapter's alone, for a LoRA policy or an adapter role)."""
        return self.trainable()

    @property
    def module(self) -> torch.nn.Module:
        return getattr(self.owner, self.attribute)

    @module.setter
    def module(self, value: torch.nn.Module) -> None:
        setattr(self.owner, self.attribute, value)


@dataclass
class Roles:
    """Every role of a run: the trained ones (the policy first) and the frozen ones."""

    trained: list[Trained]
    frozen: list[FrozenRole]

    @property
    def policy(self) -> Trained:
        return self.trained[0]

    def __getitem__(self, name: str) -> Trained:
        for role in self.trained:
            if role.name == name:
                return role
        raise KeyError(name)

    def names(self) -> list[str]:
        return [r.name for r in self.trained]

    def clip_groups(self) -> list[list[Trained]]:
        """The roles whose gradient norms are measured and clipped together: each role alone, except that a role
        declared ``clip_with`` another joins that role's group."""
        groups: dict[str, list[Trained]] = {}
        for role in self.trained:
            groups.setdefault(role.clip_with or role.name, []).append(role)
        return list(groups.values())

    def stepped(self, hit: set[str]) -> set[str]:
        """The roles that take an optimizer step after a minibatch whose losses were for the roles ``hit``: those, and
        every role clipped together with one of them (their gradients flow from the same losses: DCoLT's head from the
        policy's loss)."""
        return {r.name for group in self.clip_groups() if any(m.name in hit for m in group) for r in group}

    def weights(self) -> dict[str, torch.Tensor]:
        """Every trained role's checkpoint tensors, each under its prefix (the policy's without one)."""
        out: dict[str, torch.Tensor] = {}
        for role in self.trained:
            out.update({role.prefix + k: v for k, v in role.state_dict().items()})
        return out

    def split(self, weights: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """A checkpoint's tensors by role (the inverse of ``weights``): a key goes to the role with the longest
        prefix it starts with, the policy's being the empty one."""
        by_prefix = sorted(self.trained, key=lambda r: len(r.prefix), reverse=True)
        out: dict[str, dict[str, torch.Tensor]] = {r.name: {} for r in self.trained}
        for key, value in weights.items():
            role = next(r for r in by_prefix if key.startswith(r.prefix))
            out[role.name][key[len(role.prefix) :]] = value
        return out

    def prefixes(self) -> dict[str, str]:
        """role -> checkpoint prefix, recorded in a checkpoint so a reader can take the policy's weights alone."""
        return {r.name: r.prefix for r in self.trained}


def optimizer_settings(config, role: str, lr_scale: float) -> OptimizerSettings:
    """The settings of ``role``'s optimizer: ``train.roles.<role>`` where set, else ``train``'s."""
    tc = config.train
    own: RoleConfig = tc.roles.get(role, RoleConfig())
    return OptimizerSettings(
        learning_rate=own.learning_rate if own.learning_rate is not None else tc.learning_rate * lr_scale,
        lr_schedule=own.lr_schedule or tc.lr_schedule,
        lr_min_fraction=own.lr_min_fraction if own.lr_min_fraction is not None else tc.lr_min_fraction,
        betas=(tc.adam_beta1, tc.adam_beta2),
        weight_decay=own.weight_decay if own.weight_decay is not None else tc.weight_decay,
        max_grad_norm=own.max_grad_norm if own.max_grad_norm is not None else tc.max_grad_norm,
    )


def build_roles(config, pipeline: Any, module_attr: str, objective: Any, frozen: list[FrozenRole]) -> Roles:
    """The run's roles: the policy (``pipeline.<module_attr>``), then the objective's declared trained roles; the
    frozen ones made ready (the initial model enabled, an objective's own frozen module frozen and on the device)."""
    policy = Trained(
        POLICY,
        pipeline,
        module_attr,
        pipeline.trainable_parameters,
        pipeline.trainable_state_dict,
        pipeline.load_trainable_state_dict,
        prefix="",
        settings=optimizer_settings(config, POLICY, 1.0),
    )
    trained = [policy] + [_declared(config, pipeline, objective, r) for r in objective.roles if isinstance(r, TrainedRole)]
    _check_roles(config, trained)
    for role in frozen:
        _make_ready(pipeline, objective, role)
    return Roles(trained, frozen)


def _declared(config, pipeline: Any, objective: Any, role: TrainedRole) -> Trained:
    settings = optimizer_settings(config, role.name, role.lr_scale)
    common = dict(prefix=role.prefix, settings=settings, sharded=role.sharded, clip_with=role.clip_with)
    if role.adapter is not None:
        add = getattr(pipeline, "add_role_adapter", None)
        if add is None or not pipeline.has_lora:
            raise FlowRLError(
                f"role '{role.name}' is a LoRA adapter on the policy's base model, which needs a diffusers model family trained "
                "with pipeline.lora; set pipeline.lora or give the role a module of its own."
            )
        add(role.adapter, config.pipeline.lora)
        return Trained(
            role.name,
            pipeline,
            "denoiser",
            lambda: pipeline.adapter_parameters(role.adapter),
            lambda: pipeline.adapter_state_dict(role.adapter),
            lambda weights: pipeline.load_adapter_state_dict(role.adapter, weights),
            adapter=role.adapter,
            **common,
        )
    module = getattr(objective, role.attribute)
    module.to(_device_of(pipeline))
    return Trained(
        role.name,
        objective,
        role.attribute,
        lambda: [p for p in getattr(objective, role.attribute).parameters() if p.requires_grad],
        lambda: dict(_unwrap(getattr(objective, role.attribute)).state_dict()),
        lambda weights: _unwrap(getattr(objective, role.attribute)).load_state_dict(weights),
        **common,
    )


def _check_roles(config, trained: list[Trained]) -> None:
    names = [r.name for r in trained]
    if len(set(names)) != len(names):
        raise FlowRLError(f"the objective declares two roles with one name ({', '.join(names)}); give every role its own name.")
    unknown = sorted(set(config.train.roles) - set(names))
    if unknown:
        raise FlowRLError(
            f"train.roles names {', '.join(unknown)}, which this run does not train; its trained roles are {', '.join(names)}."
        )
    for role in trained:
        if role.clip_with is not None and role.clip_with not in names:
            raise FlowRLError(f"role '{role.name}' is clipped with '{role.clip_with}', which is not a trained role of this run.")
        if not role.parameters:
            raise FlowRLError(f"role '{role.name}' has no trainable parameter.")
    prefixes = [r.prefix for r in trained[1:]]
    if "" in prefixes or len(set(prefixes)) != len(prefixes):
        raise FlowRLError("every role but the policy needs a checkpoint prefix of its own.")


def _make_ready(pipeline: Any, objective: Any, role: FrozenRole) -> None:
    if role.source == "initial":
        pipeline.enable_reference()
        return
    module = getattr(objective, role.attribute)
    module.requires_grad_(False).eval().to(_device_of(pipeline))


def _device_of(pipeline: Any) -> torch.device:
    return torch.device(getattr(pipeline, "device", "cpu"))


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "module", module)  # DDP's wrapper holds the module as .module
