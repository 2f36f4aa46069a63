"""flowrl: reinforcement-learning alignment of diffusion and flow generative models.

The Python API (the CLI is a thin layer over it)::

    import flowrl

    def sharpness(samples, prompts, metadata):          # (B, C, H, W) in [0, 1] -> one score per sample
        return samples.diff(dim=-1).abs().mean(dim=(1, 2, 3))

    trainer = flowrl.Trainer("digits/grpo", ["train.iterations=5"], reward={"sharpness": sharpness, "digit_classifier": flowrl.reward("digit_classifier")})
    summary = trainer.train()
    images = trainer.sample(["a handwritten seven"], num_samples=4)
    metrics = trainer.evaluate()

Parts from your own package can also be named in a config: ``reward.components: {"my_pkg.scores:sharpness": 1.0}``,
``objective.name: my_pkg.objectives:MyObjectiveConfig``, or registered (``flowrl.register_reward``) or declared as
entry points (groups ``flowrl.rewards``, ``flowrl.objectives``, ``flowrl.pipelines``, ``flowrl.samplers``,
``flowrl.prompts``, ``flowrl.searches``). Importing flowrl is cheap: torch and the rest load with the first name used.
"""

from __future__ import annotations

from typing import Any

# ``flowrl.presets`` is the submodule, made callable (``flowrl.presets()`` lists the names): a function of that name
# would be replaced by the submodule when it is first imported (the CLI imports it), and ``import flowrl.presets as p``
# would get the function. Loaded now; it needs only pathlib.
from . import presets

__version__ = "0.1.0"

__all__ = [
    "Config",
    "Trainer",
    "load_config",
    "presets",
    "reward",
    "register_reward",
    "register_objective",
    "register_family",
    "register_sampler",
    "register_prompt_source",
    "register_search",
    "__version__",
]


def __getattr__(name: str) -> Any:  # lazy: `import flowrl` does not import torch
    if name == "Trainer":
        from .trainer import Trainer

        return Trainer
    if name in ("Config", "load_config"):
        from . import config

        return getattr(config, name)
    raise AttributeError(f"module 'flowrl' has no attribute {name!r}")


def reward(name: str, **kwargs: Any) -> Any:
    """One of flowrl's rewards (or any registered, installed or importable one) by name, built with ``kwargs``."""
    from .reward_models import build_reward

    return build_reward(name, **kwargs)


def register_reward(name: str, target: Any, *, overwrite: bool = False) -> None:
    """Let configs name ``target`` as a reward: a function ``fn(samples, prompts, metadata) -> scores``, a reward class
    (built with ``reward.kwargs.<name>``) or object, or an import path string."""
    from .reward_models import REWARDS

    REWARDS.register(name, target, overwrite=overwrite)


def register_objective(name: str, target: Any, *, overwrite: bool = False) -> None:
    """Let ``objective.name`` name ``target``: an ``ObjectiveSection`` subclass with ``build(context)`` (see
    docs/architecture.md, "Adding an objective"), or an objective class built from its constructor's keywords."""
    from .objectives import OBJECTIVES

    OBJECTIVES.register(name, target, overwrite=overwrite)


def register_family(name: str, target: Any, *, overwrite: bool = False) -> None:
    """Let ``pipeline.name`` name ``target``: a ``PipelineSection`` subclass whose ``build(device, loaded)`` makes the
    model adapter (docs/architecture.md, "Adding a family")."""
    from .pipelines import FAMILIES

    FAMILIES.register(name, target, overwrite=overwrite)


def register_sampler(name: str, target: Any, *, overwrite: bool = False) -> None:
    """Let ``sampler.name`` name ``target``: a ``SamplerSection`` subclass whose ``build(pipeline)`` makes the sampler."""
    from .samplers import SAMPLERS

    SAMPLERS.register(name, target, overwrite=overwrite)


def register_prompt_source(name: str, target: Any, *, overwrite: bool = False) -> None:
    """Let ``prompts.dataset`` name ``target``: a function ``source(split) -> [(prompt, metadata), ...]``."""
    from .prompts import PROMPT_SOURCES

    PROMPT_SOURCES.register(name, target, overwrite=overwrite)


def register_search(name: str, target: Any, *, overwrite: bool = False) -> None:
    """Let ``flowrl eval --search NAME`` (and an evaluation spec's method) name ``target``: a ``SearchSection`` subclass
    with ``search(model, verifier, items)`` (docs/inference_scaling.md, "A search is a part"), or a plain class whose
    constructor's keywords are its settings and whose objects have that ``search``."""
    from .inference import SEARCHES

    SEARCHES.register(name, target, overwrite=overwrite)
