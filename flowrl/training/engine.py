"""The engine: how the trained roles run on this launch. One protocol, three implementations:

* ``DataParallelEngine``: one process, or ``accelerate launch`` with DDP (configs/accelerate/ddp.yaml);
* ``FSDP2Engine``: the roles' weights, gradients and AdamW moments sharded with torch's ``fully_shard``
  (configs/accelerate/fsdp.yaml; training/distributed.py has what flowrl adds around accelerate's plugin);
* ``DeepSpeedEngine``: ZeRO-2 / ZeRO-3, one DeepSpeed engine per sharded role (configs/accelerate/deepspeed_zero*.yaml;
  training/deepspeed_zero.py bridges accelerate's DeepSpeed defaults and flowrl's loop).

Each does five things for the loop and the run: ``prepare`` (wrap every role's module for the launch, build its
AdamW), ``step`` (one optimizer step of every role that received a loss of the minibatch: backward, gradients
averaged across processes, clipped, stepped), ``gather`` (the roles' weights and optimizer states whole, for a
checkpoint), ``save_extra`` (what the launch keeps beside them: DeepSpeed's partitions) and ``load``. A role that is
not ``sharded`` (a small module every process keeps whole, called several times per backward: DCoLT's head) is never
wrapped; its gradients are averaged here. The loop above never asks which engine it has.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate.utils import DistributedDataParallelKwargs, gather_object

from ..errors import FlowRLError
from ..types import LossOutput
from . import deepspeed_zero
from .distributed import choose_blocks_to_wrap, full_optimizer_state, full_tensors, is_fsdp, shard_state_dict
from .roles import POLICY, Roles, Trained

GRAD_NORM = "train/grad_norm"


class Engine(Protocol):
    accelerator: Any
    shards_weights: bool  # a process holds part of the weights (no hash of them on one process)

    def prepare(self, roles: Roles) -> None:
        """Wrap each role's module for the launch (``role.module`` becomes the wrapper) and build ``role.optimizer``."""
        ...

    def step(self, roles: Roles, losses: Iterable[LossOutput], record: Callable[[LossOutput], None]) -> dict[str, torch.Tensor]:
        """Back-propagate every loss (``record`` sees each), then one optimizer step of each role that received one;
        returns the gradient norms (``train/grad_norm``, and ``train/grad_norm/<role>`` for a role clipped apart)."""
        ...

    def gather(self, roles: Roles, keep: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Every role's checkpoint weights (under its prefix) and optimizer state, whole, on the process that writes
        (``keep``); a collective: every process calls it."""
        ...

    def save_extra(self, roles: Roles, staging: Path) -> dict[str, Any]:
        """Write what this launch keeps beside the gathered tensors into ``staging`` (collective); the trainer-state
        entries that say so."""
        ...

    def check_resumable(self, state: dict, directory: Path) -> None:
        """Refuse, in one sentence, a checkpoint this launch cannot resume (one written under another engine)."""
        ...

    def load(self, roles: Roles, weights: dict, optimizer: dict, state: dict, directory: Path) -> None:
        """Resume every role from a checkpoint's tensors (and this launch's own files in ``directory``)."""
        ...

    def load_weights(self, roles: Roles, weights: dict) -> None:
        """Load a checkpoint's weights into every role (no optimizer state: an evaluation, a warm start)."""
        ...


def build_engine(accelerator, config) -> Engine:
    """The engine of this launch (accelerate's distributed type decides)."""
    if deepspeed_zero.is_deepspeed(accelerator):
        return DeepSpeedEngine(accelerator, config)
    if is_fsdp(accelerator):
        return FSDP2Engine(accelerator, config)
    return DataParallelEngine(accelerator, config)


# -- what every engine shares ---------------------------------------------------------------------------------------
def new_optimizer(role: Trained) -> torch.optim.Optimizer:
    s = role.settings
    return torch.optim.AdamW(role.parameters, lr=s.learning_rate, betas=s.betas, weight_decay=s.weight_decay)


def combined_optimizer_state(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The roles' optimizer state_dicts as one, parameters numbered on from role to role (the policy's first): the
    layout of a checkpoint's optimizer file, the same as one optimizer with a parameter group per role."""
    state, groups, offset = {}, [], 0
    for s in states:
        count = sum(len(g["params"]) for g in s["param_groups"])
        state.update({offset + int(i): v for i, v in s["state"].items()})
        groups += [{**g, "params": [offset + int(i) for i in g["params"]]} for g in s["param_groups"]]
        offset += count
    return {"state": state, "param_groups": groups}


def split_optimizer_state(roles: Roles, tensors: dict[str, torch.Tensor], groups: list[dict]) -> dict[str, tuple[dict, dict]]:
    """A checkpoint's optimizer tensors (``<param index>.<name>``) and parameter groups (one per role, in role order),
    by role, each renumbered from 0: the inverse of ``combined_optimizer_state``."""
    if len(groups) != len(roles.trained):
        raise FlowRLError(
            f"the checkpoint's optimizer holds {len(groups)} parameter group(s) but this run trains {len(roles.trained)} role(s)."
        )
    out, offset = {}, 0
    for role, group in zip(roles.trained, groups):
        count = len(role.parameters)
        mine = {}
        for key, value in tensors.items():
            index, name = key.split(".", 1)
            if offset <= int(index) < offset + count:
                mine[f"{int(index) - offset}.{name}"] = value
        out[role.name] = (mine, {"param_groups": [{**group, "params": list(range(count))}]})
        offset += count
    return out


class _Stepping:
    """The parts of a minibatch step that do not depend on the launch: which roles received a loss, and the
    gradient norms of each clip group, reported under the group leader's name."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def zero_grad(self, roles: Roles) -> None:
        for role in roles.trained:
            role.optimizer.zero_grad(set_to_none=True)

    def average_replicated(self, roles: Roles, stepped: set[str]) -> None:
        """A role every process keeps whole is not wrapped by DDP or FSDP, so nothing averages its gradients: average
        them here, or each process's copy would drift apart."""
        if self.accelerator.num_processes == 1:
            return
        for role in roles.trained:
            if role.sharded or role.name not in stepped:
                continue
            params = [p for p in role.parameters if p.requires_grad]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]  # a process may not have reached it
            flat = self.accelerator.reduce(torch.cat([g.flatten() for g in grads]), reduction="mean")
            for p, g in zip(params, torch.split(flat, [g.numel() for g in grads])):
                p.grad = g.view_as(p).clone()

    def clip(self, groups: list[list[Trained]], stepped: set[str]) -> dict[str, torch.Tensor]:
        """Clip each group's gradients (together) to its leader's max_grad_norm; the norms measured before clipping."""
        norms = {}
        for group in groups:
            leader = group[0]
            limit = leader.settings.max_grad_norm
            if limit is None or leader.name not in stepped:
                continue
            params = [p for r in group for p in r.parameters]
            norm = self.accelerator.clip_grad_norm_(params, limit)
            norms[GRAD_NORM if leader.name == POLICY else f"{GRAD_NORM}/{leader.name}"] = torch.as_tensor(norm).detach()
        return norms


# -- one process, or DDP --------------------------------------------------------------------------------------------
class DataParallelEngine:
    """accelerate's default launch: every process holds the whole model; DDP averages the wrapped roles' gradients."""

    shards_weights = False

    def __init__(self, accelerator, config):
        self.accelerator, self.config = accelerator, config
        self.stepping = _Stepping(accelerator)

    def prepare(self, roles: Roles) -> None:
        adapters = any(r.adapter is not None for r in roles.trained)
        if (adapters or getattr(roles.policy.module, "may_leave_parameters_unused", False)) and self.accelerator.ddp_handler is None:
            # a module that routes each call to part of its weights (Wan2.2's two experts, one LoRA adapter of several):
            # DDP must find the parameters that got no gradient rather than wait for them (their gradient stays None)
            self.accelerator.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=True)
        for module_roles in _by_module(roles):
            self._prepare_module(module_roles)

    def _prepare_module(self, module_roles: list[Trained]) -> None:
        """One module and the optimizers of the roles that train it (several LoRA adapters on one base share it)."""
        first = module_roles[0]
        optimizers = [new_optimizer(r) for r in module_roles]
        if not first.sharded:
            prepared = self.accelerator.prepare(*optimizers)  # a whole-kept module: only its optimizer (mixed precision's scaler)
            prepared = prepared if isinstance(prepared, tuple) else (prepared,)
        else:
            self.before_prepare(first.module)
            module, *prepared = self.accelerator.prepare(first.module, *optimizers)
            first.module = module
        for role, optimizer in zip(module_roles, prepared):
            role.optimizer = optimizer

    def before_prepare(self, module: torch.nn.Module) -> None:
        """What the launch needs to know of a module before accelerate wraps it (FSDP: its blocks)."""

    def step(self, roles: Roles, losses: Iterable[LossOutput], record: Callable[[LossOutput], None]) -> dict[str, torch.Tensor]:
        self.stepping.zero_grad(roles)
        hit: set[str] = set()
        for loss_out in losses:
            record(loss_out)
            if loss_out.loss.requires_grad:  # else no trained weight shaped it (a frozen Wan2.2 expert's step): nothing to do
                self.accelerator.backward(loss_out.loss)
                hit.add(loss_out.role)
        stepped = roles.stepped(hit)
        self.stepping.average_replicated(roles, stepped)
        norms = self.stepping.clip(roles.clip_groups(), stepped)
        for role in roles.trained:
            if role.name in stepped:
                role.optimizer.step()
        return norms

    def gather(self, roles: Roles, keep: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return roles.weights(), combined_optimizer_state([r.optimizer.state_dict() for r in roles.trained])

    def save_extra(self, roles: Roles, staging: Path) -> dict[str, Any]:
        return {}

    def check_resumable(self, state: dict, directory: Path) -> None:
        if "deepspeed_zero_stage" in state:
            raise FlowRLError(
                f"checkpoint '{directory}' was written by a DeepSpeed run, whose AdamW state lies in its partitioned deepspeed/ "
                "files; resume it under the same DeepSpeed launch (flowrl export reads its weights under any launch)."
            )

    def load_weights(self, roles: Roles, weights: dict) -> None:
        by_role = roles.split(weights)
        for role in roles.trained:
            role.load_state_dict(self.local_weights(role, by_role[role.name]))

    def load(self, roles: Roles, weights: dict, optimizer: dict, state: dict, directory: Path) -> None:
        from .checkpoint import load_optimizer

        by_role = roles.split(weights)
        optimizers = split_optimizer_state(roles, optimizer, state["optimizer"]["param_groups"])
        for role in roles.trained:
            role.load_state_dict(self.local_weights(role, by_role[role.name]))
            load_optimizer(_inner(role.optimizer), *optimizers[role.name])

    def local_weights(self, role: Trained, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A role's checkpoint weights as this process loads them (FSDP: its shards)."""
        return weights


def _by_module(roles: Roles) -> list[list[Trained]]:
    """The trained roles grouped by the module they train: a role of its own, or the policy's base with its adapters."""
    groups: dict[int, list[Trained]] = {}
    for role in roles.trained:
        groups.setdefault(id(role.module), []).append(role)
    return list(groups.values())


# -- FSDP2 ----------------------------------------------------------------------------------------------------------
class FSDP2Engine(DataParallelEngine):
    """Every sharded role fully_shard-ed over its family's blocks; checkpoints gather full tensors and resume splits
    them back into each process's shards."""

    shards_weights = True

    def before_prepare(self, module: torch.nn.Module) -> None:
        self.accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = None  # each role's own blocks, not the last one's
        choose_blocks_to_wrap(self.accelerator, module)

    def gather(self, roles: Roles, keep: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        weights = full_tensors(roles.weights(), keep)
        states = [full_optimizer_state(_inner(r.optimizer), keep) for r in roles.trained]
        return weights, combined_optimizer_state(states)

    def local_weights(self, role: Trained, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not role.sharded:
            return weights
        current = {k: v for k, v in role.state_dict().items()}
        return shard_state_dict(current, weights)


# -- DeepSpeed ZeRO-2 / ZeRO-3 --------------------------------------------------------------------------------------
class DeepSpeedEngine:
    """One DeepSpeed engine per sharded role, driven by flowrl (one accumulation boundary per minibatch, clipping to
    the role's max_grad_norm inside the engine's step); a whole-kept role steps a plain AdamW beside them."""

    shards_weights = True

    def __init__(self, accelerator, config):
        self.accelerator, self.config = accelerator, config
        self.stepping = _Stepping(accelerator)

    def prepare(self, roles: Roles) -> None:
        for role in roles.trained:
            if role.adapter is not None:
                raise FlowRLError(
                    f"role '{role.name}' is a LoRA adapter on the policy's base, which a DeepSpeed engine would step together with "
                    "the policy's adapter; launch with DDP or FSDP2 (configs/accelerate/ddp.yaml, fsdp.yaml)."
                )
            if role.clip_with is not None and roles[role.clip_with].sharded:
                raise FlowRLError(
                    f"role '{role.name}' is clipped together with '{role.clip_with}', but a DeepSpeed engine clips its own gradients "
                    "inside its step; launch this objective with DDP or FSDP2 (configs/accelerate/ddp.yaml, fsdp.yaml)."
                )
            if not role.sharded:
                role.optimizer = new_optimizer(role)
                continue
            deepspeed_zero.configure(self.accelerator, self.config.train.batch_size, role.settings.max_grad_norm)
            role.module, role.optimizer = self.accelerator.prepare(role.module, new_optimizer(role))

    def step(self, roles: Roles, losses: Iterable[LossOutput], record: Callable[[LossOutput], None]) -> dict[str, torch.Tensor]:
        for role in roles.trained:
            if not role.sharded:
                role.optimizer.zero_grad(set_to_none=True)
        engines = {r.name: r.module for r in roles.trained if r.sharded}
        hit = deepspeed_zero.backward_roles(engines, losses, record)  # each engine has taken its step
        stepped = roles.stepped(hit)
        self.stepping.average_replicated(roles, stepped)
        norms = {}
        for name in engines.keys() & hit:
            norm = deepspeed_zero.grad_norm(engines[name])
            if roles[name].settings.max_grad_norm is not None and norm is not None:
                norms[GRAD_NORM if name == POLICY else f"{GRAD_NORM}/{name}"] = norm
        whole = [group for group in roles.clip_groups() if not group[0].sharded]
        norms.update(self.stepping.clip(whole, stepped))
        for role in roles.trained:
            if not role.sharded and role.name in stepped:
                role.optimizer.step()
        return norms

    def gather(self, roles: Roles, keep: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        weights: dict[str, torch.Tensor] = {}
        for role in roles.trained:
            state = deepspeed_zero.full_weights(role.module, role.state_dict, keep) if role.sharded else role.state_dict()
            weights.update({role.prefix + k: v for k, v in state.items()})
        # the moments of an engine's role are in its partitions (save_extra): only its hyperparameters are stored here
        states = [_hyperparameters(r) if r.sharded else r.optimizer.state_dict() for r in roles.trained]
        return weights, combined_optimizer_state(states)

    def save_extra(self, roles: Roles, staging: Path) -> dict[str, Any]:
        if self.accelerator.is_main_process and staging.exists():
            shutil.rmtree(staging)  # left by a run killed while saving
        self.accelerator.wait_for_everyone()
        for role in roles.trained:
            if role.sharded:
                deepspeed_zero.save_engine_state(role.module, staging, deepspeed_zero.engine_tag(role.name))
        return {"deepspeed_zero_stage": deepspeed_zero.zero_stage(roles.policy.module)}

    def check_resumable(self, state: dict, directory: Path) -> None:
        """A checkpoint without engine partitions is refused when its engine state is read (load)."""

    def load_weights(self, roles: Roles, weights: dict) -> None:
        by_role = roles.split(weights)
        for role in roles.trained:
            role.load_state_dict(by_role[role.name])

    def load(self, roles: Roles, weights: dict, optimizer: dict, state: dict, directory: Path) -> None:
        by_role = roles.split(weights)
        for role in roles.trained:
            if role.sharded:  # weights, fp32 master copies and AdamW moments from the engine's own checkpoint
                deepspeed_zero.load_engine_state(role.module, directory, deepspeed_zero.engine_tag(role.name))
            else:
                from .checkpoint import load_optimizer

                role.load_state_dict(by_role[role.name])
                load_optimizer(role.optimizer, *split_optimizer_state(roles, optimizer, state["optimizer"]["param_groups"])[role.name])


def _hyperparameters(role: Trained) -> dict[str, Any]:
    """A DeepSpeed role's optimizer as a checkpoint's optimizer file records it: AdamW's hyperparameters (its moments
    are in the engine's partitions), its parameters numbered as in any other launch."""
    group = {k: v for k, v in role.optimizer.param_groups[0].items() if k != "params"}
    return {"state": {}, "param_groups": [{**group, "params": list(range(len(role.parameters)))}]}


def _inner(optimizer):
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def gather_means(values: dict[str, float], world: int) -> dict[str, float]:
    """Each metric averaged over the processes that have it (the run's metrics, not the main process's share)."""
    if world == 1:
        return values
    shares = gather_object([values])
    keys = dict.fromkeys(k for m in shares for k in m)
    return {k: sum(m[k] for m in shares if k in m) / sum(k in m for m in shares) for k in keys}
