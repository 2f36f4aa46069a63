"""A 2-D rectified flow whose base model is exact, so a fine-tuned model can be checked against a closed form.

The base data distribution is the Gaussian mixture ``0.5 N((-2, 0), 0.5^2 I) + 0.5 N((2, 0), 0.5^2 I)``
(:data:`TWO_MODES`). Its flow-matching velocity is known in closed form, so nothing is pre-trained: the
model is ``v(x, sigma) = v_base(x, sigma) + net(x, sigma)``, where ``net`` is a small MLP whose output
layer starts at zero (the initial model *is* the base) and ``reference()`` switches it off.

Velocity of a Gaussian mixture (flowrl's convention: ``x_sigma = (1 - sigma) x0 + sigma eps``, the model
predicts ``v = eps - x0 = dx/dsigma``). Take components j with weight pi_j, mean m_j, isotropic std s_j in
d dimensions. Given component j, x_sigma is Gaussian:

    x_sigma | j ~ N(mu_j, D_j I),   mu_j = (1 - sigma) m_j,   D_j = (1 - sigma)^2 s_j^2 + sigma^2

and (x0, eps, x_sigma) are jointly Gaussian, so with Cov(x0, x_sigma) = (1 - sigma) s_j^2 and
Cov(eps, x_sigma) = sigma:

    E[x0  | x, j] = m_j + (1 - sigma) s_j^2 / D_j (x - mu_j)
    E[eps | x, j] =       sigma           / D_j (x - mu_j)
    E[v   | x, j] = (sigma - (1 - sigma) s_j^2) / D_j (x - mu_j) - m_j

and the mixture's velocity is the responsibility-weighted sum, responsibilities
``w_j(x) ∝ pi_j N(x; mu_j, D_j I)`` (computed as a softmax of log-densities). D_j >= s_j^2 / (1 + s_j^2) > 0
for every sigma in [0, 1], so nothing is singular at the ends: at sigma = 1 (D = 1) v = x - sum_j pi_j m_j
(the noise minus the data mean), at sigma = 0 (D = s_j^2) v = -x (E[eps | x0] = 0). Computed in float64.

Tilted targets (:func:`tilt_linear`, :func:`tilt_quadratic`): p*(x) ∝ p_base(x) exp(lambda r(x)) of a
Gaussian mixture is again a Gaussian mixture for a linear or a concave quadratic reward, component by
component (complete the square):

* r(x) = w . x: N(m, s^2 I) exp(lambda w.x) = N(m + lambda s^2 w, s^2 I) exp(lambda w.m + lambda^2 s^2 |w|^2 / 2),
  so every mean moves by lambda s_j^2 w, stds are unchanged, weights scale by the exponential factor.
* r(x) = -(a/2) |x - c|^2, beta = lambda a: precision 1/s^2 + beta, so s'^2 = s^2 / (1 + beta s^2),
  m' = (m + beta s^2 c) / (1 + beta s^2), and the weight scales by
  ``(1 + beta s^2)^(-d/2) exp(-beta |m - c|^2 / (2 (1 + beta s^2)))`` (the integral of the product).

For the two toy tasks: r = 0.5 x1 + 0.5 x2, lambda = 1 gives weights (0.1192, 0.8808) = (1, e^2) / (1 + e^2),
means (-1.875, 0.125) and (2.125, 0.125), std 0.5; r = -0.5 |x - (0, 1)|^2, lambda = 2 gives weights
(0.5, 0.5), means (-4/3, 1/3) and (4/3, 1/3), std 0.5 / sqrt(1.5) = 0.4082.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field
from torch import Tensor, nn

from ..errors import FlowRLError
from ..reward_models.toy2d import LinearReward2D, QuadraticReward2D
from ..samplers.schedules import FlowSchedule
from ..types import Condition
from .diffusers_base import PipelineConfig


@dataclass(frozen=True)
class GaussianMixture:
    """A mixture of isotropic Gaussians: ``weights`` (J,), ``means`` (J, d), ``stds`` (J,)."""

    weights: tuple[float, ...]
    means: tuple[tuple[float, ...], ...]
    stds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not (len(self.weights) == len(self.means) == len(self.stds)) or min(self.stds) <= 0:
            raise FlowRLError("a Gaussian mixture needs one weight, mean and positive std per component.")

    @property
    def dim(self) -> int:
        return len(self.means[0])

    def _tensors(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        pi = torch.tensor(self.weights, dtype=torch.float64, device=device)
        return (
            pi / pi.sum(),
            torch.tensor(self.means, dtype=torch.float64, device=device),
            torch.tensor(self.stds, dtype=torch.float64, device=device),
        )

    def velocity(self, x: Tensor, sigma: Tensor | float) -> Tensor:
        """E[eps - x0 | x_sigma = x] for (B, d) points; sigma a scalar or (B,). float64 (see the module docstring)."""
        pi, m, s = self._tensors(x.device)
        x = x.double()
        sig = torch.as_tensor(sigma, dtype=torch.float64, device=x.device).reshape(-1, 1).expand(x.shape[0], 1)  # (B, 1)
        var = (1 - sig) ** 2 * s**2 + sig**2  # (B, J): D_j
        diff = x[:, None, :] - (1 - sig)[:, :, None] * m[None]  # (B, J, d): x - mu_j
        log_w = torch.log(pi) - 0.5 * self.dim * torch.log(var) - (diff**2).sum(-1) / (2 * var)
        resp = torch.softmax(log_w, dim=1)  # (B, J)
        per_component = ((sig - (1 - sig) * s**2) / var)[:, :, None] * diff - m[None]
        return (resp[:, :, None] * per_component).sum(1)

    def log_prob(self, x: Tensor) -> Tensor:
        """log density of (B, d) points under the mixture (float64)."""
        pi, m, s = self._tensors(x.device)
        diff2 = ((x.double()[:, None, :] - m[None]) ** 2).sum(-1)
        log_n = -diff2 / (2 * s**2) - self.dim * torch.log(s) - 0.5 * self.dim * math.log(2 * math.pi)
        return torch.logsumexp(torch.log(pi) + log_n, dim=1)

    def sample(self, n: int, generator: torch.Generator) -> Tensor:
        """n exact samples (float64), drawn from ``generator``."""
        pi, m, s = self._tensors(torch.device("cpu"))
        j = torch.multinomial(pi, n, replacement=True, generator=generator)
        return m[j] + s[j, None] * torch.randn(n, self.dim, generator=generator, dtype=torch.float64)


TWO_MODES = GaussianMixture(weights=(0.5, 0.5), means=((-2.0, 0.0), (2.0, 0.0)), stds=(0.5, 0.5))


def tilt_linear(base: GaussianMixture, w: Sequence[float], lam: float) -> GaussianMixture:
    """p_base(x) exp(lam * w.x) in closed form (module docstring)."""
    w_t = torch.tensor(w, dtype=torch.float64)
    pi, m, s = base._tensors(torch.device("cpu"))
    log_scale = lam * (m @ w_t) + 0.5 * lam**2 * s**2 * (w_t @ w_t)
    weights = torch.softmax(torch.log(pi) + log_scale, 0)
    means = m + lam * s[:, None] ** 2 * w_t
    return GaussianMixture(tuple(weights.tolist()), tuple(tuple(r) for r in means.tolist()), tuple(s.tolist()))


def tilt_quadratic(base: GaussianMixture, center: Sequence[float], scale: float, lam: float) -> GaussianMixture:
    """p_base(x) exp(-lam * scale / 2 * |x - center|^2) in closed form (module docstring)."""
    c = torch.tensor(center, dtype=torch.float64)
    pi, m, s = base._tensors(torch.device("cpu"))
    beta = lam * scale
    shrink = 1 + beta * s**2  # (J,)
    log_scale = -0.5 * base.dim * torch.log(shrink) - beta * ((m - c) ** 2).sum(1) / (2 * shrink)
    weights = torch.softmax(torch.log(pi) + log_scale, 0)
    means = (m + beta * s[:, None] ** 2 * c) / shrink[:, None]
    return GaussianMixture(tuple(weights.tolist()), tuple(tuple(r) for r in means.tolist()), tuple((s / shrink.sqrt()).tolist()))


def tilted_target(base: GaussianMixture, reward: Any, lam: float) -> GaussianMixture:
    """The distribution p_base(x) exp(lam * r(x)) that Adjoint Matching converges to, for a toy reward."""
    if isinstance(reward, LinearReward2D):
        return tilt_linear(base, reward.weights, lam)
    if isinstance(reward, QuadraticReward2D):
        return tilt_quadratic(base, reward.center, reward.scale, lam)
    raise FlowRLError(
        f"no closed-form tilted target for reward '{getattr(reward, 'name', type(reward).__name__)}'; use linear2d or quadratic2d."
    )


@dataclass
class ModeStatistics:
    """Per component of a reference mixture: the fraction of samples assigned to it, their mean (d,) and
    per-coordinate standard deviation (d,)."""

    weights: Tensor
    means: Tensor
    stds: Tensor


def mode_statistics(samples: Tensor, reference: GaussianMixture) -> ModeStatistics:
    """Assign each sample to the component of ``reference`` with the highest responsibility and measure
    every component's share, mean and std. The toy's modes are 4 stds apart, so the assignment truncates
    a negligible tail (about 3e-5 of a mode's mass)."""
    pi, m, s = reference._tensors(torch.device("cpu"))
    x = samples.detach().double().cpu()
    log_n = -((x[:, None, :] - m[None]) ** 2).sum(-1) / (2 * s**2) - reference.dim * torch.log(s)
    label = (torch.log(pi) + log_n).argmax(1)
    J = len(reference.weights)
    weights = torch.stack([(label == j).double().mean() for j in range(J)])
    means = torch.stack(
        [x[label == j].mean(0) if (label == j).any() else torch.full((reference.dim,), math.nan, dtype=torch.float64) for j in range(J)]
    )
    stds = torch.stack(
        [x[label == j].std(0) if (label == j).sum() > 1 else torch.full((reference.dim,), math.nan, dtype=torch.float64) for j in range(J)]
    )
    return ModeStatistics(weights=weights, means=means, stds=stds)


class Toy2DNet(nn.Module):
    """The fine-tuned part: an MLP of (x, sigma) whose output layer starts at zero, so it adds nothing at first."""

    def __init__(self, dim: int = 2, hidden: int = 64) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(dim + 1, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, dim))
        nn.init.zeros_(self.layers[-1].weight)
        nn.init.zeros_(self.layers[-1].bias)

    def forward(self, x: Tensor, sigma: Tensor) -> Tensor:
        sig = torch.as_tensor(sigma, dtype=x.dtype, device=x.device).reshape(-1, 1).expand(x.shape[0], 1)
        return self.layers(torch.cat([x, sig], dim=1))


def _unwrap(module: nn.Module) -> nn.Module:
    return getattr(module, "module", module)  # DDP / accelerate wrappers


class Toy2DPipeline:
    """Rectified-flow pipeline on 2-D points: exact mixture velocity + a trainable MLP (module docstring).

    Implements :class:`flowrl.types.Pipeline`. Samples and latents are (B, 2); ``decode`` is the identity
    (differentiable). There is no prompt: ``encode`` returns a (B, 1) zero condition and guidance has no
    effect (there is no unconditional branch to contrast).
    """

    prediction_type = "flow"
    has_lora = False
    guidance_mode = "cfg"  # set by the trainer; irrelevant here

    def __init__(
        self,
        base: GaussianMixture = TWO_MODES,
        hidden: int = 64,
        device: str | torch.device = "cpu",
        net: nn.Module | None = None,
        shift: float = 1.0,
    ) -> None:
        self.base = base
        self.device = torch.device(device)
        self.schedule = FlowSchedule(shift=shift)
        self.denoiser: nn.Module = (net if net is not None else Toy2DNet(base.dim, hidden)).to(self.device)
        self._use_reference = False

    @classmethod
    def from_config(cls, config, device: str | torch.device) -> Toy2DPipeline:
        """``pipeline.name: toy2d``; the base is closed form, so ``pretrained`` is not read. LoRA does not
        apply (the MLP is small and trained in full)."""
        if getattr(config, "lora", None) is not None:
            raise FlowRLError("pipeline toy2d trains its small MLP in full; remove pipeline.lora.")
        return cls(device=device, shift=getattr(config, "shift", 1.0), hidden=getattr(config, "hidden", 64))

    def encode(self, prompts: Sequence[str]) -> Condition:
        return {"prompt": torch.zeros(len(prompts), 1, device=self.device)}

    def initial_noise(self, batch: int, generator: torch.Generator) -> Tensor:
        return torch.randn((batch, self.base.dim), generator=generator, device=generator.device).to(self.device)

    def predict(self, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float = 1.0) -> Tensor:
        """Base velocity (exact) plus the MLP, or the base alone inside ``reference()``."""
        v = self.base.velocity(x, sigma).float()
        if self._use_reference:
            return v
        return v + self.denoiser(x.float(), torch.as_tensor(sigma, device=x.device).float())

    def decode(self, x: Tensor) -> Tensor:
        return x.float()

    def latent_shape(self) -> tuple[int, ...]:
        return (self.base.dim,)

    def enable_reference(self) -> None:
        """Nothing to freeze: the reference is the closed-form base."""

    @contextlib.contextmanager
    def reference(self) -> Iterator[Toy2DPipeline]:
        self._use_reference = True
        try:
            yield self
        finally:
            self._use_reference = False

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.denoiser.parameters() if p.requires_grad]

    def trainable_state_dict(self) -> dict[str, Tensor]:
        return dict(_unwrap(self.denoiser).state_dict())

    def load_trainable_state_dict(self, weights: dict[str, Tensor]) -> None:
        _unwrap(self.denoiser).load_state_dict(weights)

    def save_lora(self, directory: Any) -> Any:
        raise FlowRLError("pipeline toy2d has no LoRA to save.")


class Toy2DConfig(PipelineConfig):
    """``pipeline.name: toy2d``: the exact 2-D two-mode base (``pretrained`` is not read)."""

    name: str = "toy2d"
    shift: float = Field(1.0, gt=0, description="SD3-style time shift of the sampling grid: > 1 puts more steps at high noise.")
    hidden: int = Field(64, ge=1, description="Width of the fine-tuned MLP's two hidden layers.")

    def build(self, device: Any, loaded: Any = None) -> Toy2DPipeline:
        if loaded is not None:
            raise FlowRLError("pipeline toy2d is built in closed form; it takes no loaded model.")
        return Toy2DPipeline.from_config(self, device)

    def default_num_threads(self) -> int | None:
        return 1  # a 2-D MLP: too small to share among threads

    def probe_samples(self, n: int) -> Any:
        return torch.randn(n, 2, generator=torch.Generator().manual_seed(0))
