"""flowrl's own searches as config sections: each method's budget and settings with their bounds, defaults and
descriptions, written here once. ``flowrl eval``'s flags (``--best-of N``, ``--smc-lambda``, ...) set these fields
(``flags``), ``--search NAME KEY=VALUE ...`` sets them by name, and the evaluation spec records them
(``SearchSection.method``), so ``flowrl eval --spec`` rebuilds the same search.

The algorithms live beside: best_of_n.py, svdd.py, smc.py, noise_search.py, rbf.py, rbf_rollover.py for image /
video models; text_best_of_n.py, masked_svdd.py, canvas_svdd.py, masked_smc.py for diffusion LMs. This module imports none of
them (nor torch): the command line reads these sections to parse and check its flags before any model loads.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field

from ..errors import FlowRLError
from .search import SearchSection

MAJORITY = "majority"
NOISE_ONLY = "{flag} searches a flow or diffusion model's noise; for a diffusion LM use --best-of, --svdd or --smc."


def select_field() -> Any:
    """The ``select`` field of a search that chooses by rules on a diffusion LM (declared last in each section, where
    the spec records it)."""
    return Field(
        None,
        description="(diffusion LMs) how candidates are chosen without the gold answer, comma-separated: majority, "
        "likelihood, a reward's name, or reward",
    )


def selection_rules(select: str | None, default: str) -> list[str]:
    """``--select``'s comma-separated rules, each once, in order (``default`` when not given)."""
    rules = [r.strip() for r in (select or default).split(",") if r.strip()]
    if not rules:
        raise FlowRLError(f"--select needs at least one rule, got '{select}'.")
    return list(dict.fromkeys(rules))


class SelectingSearch(SearchSection):
    """A search that, on a diffusion LM, chooses by ``--select`` rules (on image / video models: by the run's reward);
    a subclass declares ``select: str | None = select_field()``."""

    default_select: ClassVar[str] = "likelihood"
    one_score: ClassVar[str | None] = None  # what it does with one score ("values each candidate"); None: several rules

    @property
    def rules(self) -> list[str]:
        return selection_rules(self.select, self.default_select)

    def prepare(self, modality: str, sampler: Any) -> SelectingSearch:
        section = super().prepare(modality, sampler)
        if modality != "text":
            if self.select is not None:
                raise FlowRLError(
                    "--select chooses among a diffusion LM's completions; image best-of-N, SVDD and SMC select by the run's reward."
                )
            return section
        rules = self.rules
        if self.one_score and (len(rules) != 1 or rules[0] == MAJORITY):
            raise FlowRLError(
                f"{self.flag} {self.one_score} by one score (likelihood, a reward's name or reward), got --select {self.select}."
            )
        from .text_candidates import check_candidates_differ

        check_candidates_differ(self.flag, getattr(self, self.budget_field), sampler.eval_temperature, sampler.remasking)
        return section.model_copy(update={"select": ",".join(rules)})


class BestOfConfig(SelectingSearch):
    """Best-of-N: N candidates per item, the best kept (docs/inference_scaling.md)."""

    name: str = "best_of"
    n: int = Field(..., ge=1, description="candidates per held-out item")
    stop_at: float | None = Field(None, description="(image and video models) stop an item's search once a candidate's reward reaches this")
    select: str | None = select_field()

    modalities: ClassVar[tuple[str, ...]] = ("images", "text")
    budget_field: ClassVar[str] = "n"
    flags: ClassVar[dict[str, str]] = {"n": "--best-of", "stop_at": "--stop-at", "select": "--select"}
    default_select: ClassVar[str] = "majority,likelihood"
    implementations: ClassVar[dict[str, str]] = {
        "images": "flowrl.inference.best_of_n:best_of_search",
        "text": "flowrl.inference.text_best_of_n:text_best_of_search",
    }

    def prepare(self, modality: str, sampler: Any) -> BestOfConfig:
        if modality == "text" and self.stop_at is not None:
            raise FlowRLError("--stop-at is for image and video models; a diffusion LM's best-of-N selects without a verifier.")
        return super().prepare(modality, sampler)


class SVDDConfig(SelectingSearch):
    """SVDD-PM: at every step the best of M candidate next states by the value of their predicted clean sample; the last
    step as the authors released SVDD for the model's kind (``released_last_step``): one plain step for images and video,
    the best of the M finished candidates for masked-diffusion LMs."""

    name: str = "svdd"
    m: int = Field(..., ge=1, description="candidates per step and item")
    last_step: Literal["plain", "best_of_m"] | None = Field(
        None,
        description="the last step: plain (one step of the sampler, no choice) or best_of_m (the best of M finished "
        "candidates by the verifier itself); unset: as the authors released SVDD for the model, plain for images and "
        "video (masa-ue/SVDD-image), best_of_m for masked-diffusion LMs (masa-ue/SVDD selects at every step, the last too)",
    )
    select: str | None = select_field()

    modalities: ClassVar[tuple[str, ...]] = ("images", "text")
    stochastic: ClassVar[bool] = True
    budget_field: ClassVar[str] = "m"
    flags: ClassVar[dict[str, str]] = {"m": "--svdd", "last_step": "--svdd-last-step", "select": "--select"}
    one_score: ClassVar[str] = "values each candidate"
    implementations: ClassVar[dict[str, str]] = {
        "images": "flowrl.inference.svdd:svdd_search",
        "text": "flowrl.inference.text_svdd:text_svdd_search",
    }

    # The authors' two releases differ at the last step: the image code (SVDD-image, sd_pipeline.py) takes one plain
    # step there, the discrete code (SVDD, diffusion_gosai.py, _ddpm_update_finetune_controlled_twedie) selects among
    # the M candidates at every step, the last included, which on a masked LM is a best-of-M of finished completions.
    released_last_step: ClassVar[dict[str, str]] = {"images": "plain", "text": "best_of_m"}

    def prepare(self, modality: str, sampler: Any) -> SVDDConfig:
        section = super().prepare(modality, sampler)
        if section.last_step is not None:
            return section
        return section.model_copy(update={"last_step": self.released_last_step[modality]})

    @classmethod
    def as_recorded(cls, method: dict[str, Any]) -> dict[str, Any]:
        """A spec written before issue #41 did not record ``last_step``: it ran the final best-of-M."""
        return method if "last_step" in method else {**method, "last_step": "best_of_m"}


class SMCConfig(SelectingSearch):
    """Sequential Monte Carlo: N particles per item toward p_base(x) exp(lambda r(x)) (smc.py)."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = "smc"
    n: int = Field(..., ge=1, description="particles per held-out item")
    lam: float | None = Field(
        None,
        alias="lambda",
        description="the tilt lambda of the target p_base exp(lambda r); default 10 for image / video rewards, 1 for a "
        "diffusion LM's score",
    )
    ess_threshold: float = Field(
        0.5, ge=0, le=1, description="resample an item when its effective sample size falls below this fraction of N"
    )
    tempering: Literal["linear", "final"] | list[float] = Field(
        "linear", description="lambda_j over the steps: linear (lambda j / K), final (lambda at the last step only), or K + 1 values"
    )
    resampling: Literal["systematic", "multinomial"] = Field("systematic", description="how an item's particles are resampled")
    select: str | None = select_field()

    modalities: ClassVar[tuple[str, ...]] = ("images", "text")
    stochastic: ClassVar[bool] = True
    budget_field: ClassVar[str] = "n"
    flags: ClassVar[dict[str, str]] = {"n": "--smc", "lam": "--smc-lambda", "ess_threshold": "--smc-ess-threshold", "select": "--select"}
    one_score: ClassVar[str] = "weights each particle"
    # image / video rewards are of order 1 and differ by ~0.1 among samples; a diffusion LM's likelihood score is a sum
    # of token log-probs, where lambda = 1 already squares the model's distribution
    default_lambda: ClassVar[dict[str, float]] = {"images": 10.0, "text": 1.0}
    implementations: ClassVar[dict[str, str]] = {
        "images": "flowrl.inference.smc:smc_search",
        "text": "flowrl.inference.masked_smc:text_smc_search",
    }

    def prepare(self, modality: str, sampler: Any) -> SMCConfig:
        if modality == "text" and sampler.name == "entropy_bound":
            raise FlowRLError("--smc is not implemented for DiffusionGemma's entropy-bound sampler; use --best-of or --svdd.")
        section = super().prepare(modality, sampler)
        return section if section.lam is not None else section.model_copy(update={"lam": self.default_lambda[modality]})


class NoiseSearchConfig(SearchSection):
    """Zero-order search over each item's start noise (noise_search.py): rounds of neighbours around the best so far."""

    name: str = "noise_search"
    rounds: int = Field(..., ge=0, description="rounds of neighbours around the best noise so far; 0 is the plain evaluation")
    neighbors: int = Field(3, ge=1, description="candidate noises per round")
    step: float = Field(0.5, gt=0, le=1, description="step size s of a neighbour sqrt(1 - s^2) e + s d (1: fresh noises)")

    budget_field: ClassVar[str] = "rounds"
    wrong_model: ClassVar[str] = NOISE_ONLY
    flags: ClassVar[dict[str, str]] = {"rounds": "--noise-search", "neighbors": "--noise-neighbors", "step": "--noise-step"}
    implementations: ClassVar[dict[str, str]] = {"images": "flowrl.inference.noise_search:noise_search"}


class RBFConfig(SearchSection):
    """FlowRBF as its authors released it (rbf.py): rollover budget forcing over ``chains`` chains per item, each from
    the best of ``init_particles`` start noises, that stop advancing two steps before the end and return the x0_hat of
    the best candidate there."""

    name: str = "rbf"
    m: int = Field(..., ge=1, description="candidates per step and chain (the release's default budget per step)")
    chains: int = Field(2, ge=1, description="chains per item, the better returned (the release's batch_size, 2)")
    init_particles: int = Field(
        25, ge=1, description="start noises per chain, the best by its x0_hat's reward kept (the release's init_n_particles, 25)"
    )

    stochastic: ClassVar[bool] = True
    budget_field: ClassVar[str] = "m"
    wrong_model: ClassVar[str] = NOISE_ONLY
    flags: ClassVar[dict[str, str]] = {"m": "--rbf", "chains": "--rbf-chains", "init_particles": "--rbf-init-particles"}
    implementations: ClassVar[dict[str, str]] = {"images": "flowrl.inference.rbf:rbf_search"}

    @classmethod
    def as_recorded(cls, method: dict[str, Any]) -> dict[str, Any]:
        """A spec written before issue #41 records ``rbf`` without ``chains``: it ran what is ``rbf_rollover`` now."""
        return method if "chains" in method else {**method, "name": "rbf_rollover"}


class RBFRolloverConfig(SearchSection):
    """flowrl's rollover budget forcing (rbf_rollover.py): one chain from the evaluation's start noise, M candidates per
    step on average, the unspent budget rolled over up to the last step (flowrl's ``rbf`` before issue #41)."""

    name: str = "rbf_rollover"
    m: int = Field(..., ge=1, description="candidates per step and item on average (1 is the plain stochastic rollout)")

    stochastic: ClassVar[bool] = True
    budget_field: ClassVar[str] = "m"
    wrong_model: ClassVar[str] = NOISE_ONLY
    flags: ClassVar[dict[str, str]] = {"m": "--rbf-rollover"}
    implementations: ClassVar[dict[str, str]] = {"images": "flowrl.inference.rbf_rollover:rbf_rollover_search"}


def as_recorded(method: dict[str, Any]) -> dict[str, Any]:
    """The search an evaluation spec's ``method`` ran, as today's sections name it: a setting whose default changed
    since the spec was written, and that the spec therefore did not record, takes the value the spec ran with
    (``SearchSection.as_recorded`` of flowrl's own sections; every other method as it is)."""
    from . import SEARCHES

    name = method.get("name")
    if not isinstance(name, str) or name not in SEARCHES.builtin_names():
        return method
    return SEARCHES.section(name).as_recorded(method)


__all__ = [
    "BestOfConfig",
    "NoiseSearchConfig",
    "RBFConfig",
    "RBFRolloverConfig",
    "SMCConfig",
    "SVDDConfig",
    "SearchSection",
    "as_recorded",
    "SelectingSearch",
    "selection_rules",
]
