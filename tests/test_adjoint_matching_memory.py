"""The lean adjoint pass keeps one step's autograd graph at a time (issue #13, item 7): memory beyond the
stored trajectory does not grow with the number of denoising steps. Deterministic: every model output made
with a graph is watched through a weak reference, and none may still be alive when the next step starts.
The measured peak memory for K = 10, 20, 40 is in bench/RESULTS.md (bench/adjoint_matching_cost.py)."""

from __future__ import annotations

import weakref

import torch

from flowrl.objectives.adjoint_matching import AdjointMatchingConfig
from flowrl.pipelines.toy2d import Toy2DPipeline
from flowrl.reward_models.gradients import reward_and_gradient
from flowrl.reward_models.toy2d import LinearReward2D
from flowrl.samplers import FlowMemorylessConfig
from flowrl.samplers.rollout import rollout


class WatchedPipeline(Toy2DPipeline):
    """Records a weak reference to every prediction that carries a graph, and how many earlier ones were
    still alive at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: list[weakref.ref] = []
        self.alive_at_call: list[int] = []

    def predict(self, x, sigma, cond, guidance_scale=1.0):
        self.alive_at_call.append(sum(ref() is not None for ref in self.watched))
        out = super().predict(x, sigma, cond, guidance_scale)
        if out.grad_fn is not None:
            self.watched.append(weakref.ref(out))
        return out


def test_the_adjoint_pass_frees_each_steps_graph_before_the_next():
    torch.manual_seed(0)
    pipeline, sampler, steps = WatchedPipeline(), FlowMemorylessConfig().build(), 40
    reward = LinearReward2D((0.5, -1.0))
    batch = rollout(
        pipeline,
        sampler,
        [""] * 8,
        [{}] * 8,
        torch.arange(8),
        pipeline.schedule.sigmas(steps),
        torch.Generator().manual_seed(0),
        same_noise_in_group=False,
    )
    out, grads = reward_and_gradient(reward, pipeline.decode, batch.latents[:, -1], batch.prompts, batch.metadata)
    batch.rewards, batch.reward_grads = out.scores, grads
    pipeline.watched.clear(), pipeline.alive_at_call.clear()
    objective = AdjointMatchingConfig(reward_multiplier=1.0).build()
    adjoint, base_out = objective.adjoints(pipeline, sampler, batch, [1, 20, 39])
    assert len(pipeline.watched) == steps - 1  # one base forward with a graph per step, from K - 1 down to 1
    assert max(pipeline.alive_at_call) == 0  # no earlier step's graph alive when the next step starts
    assert all(ref() is None for ref in pipeline.watched)  # nor after the pass
    assert all(a.grad_fn is None and o.grad_fn is None for a, o in zip(adjoint.values(), base_out.values()))
