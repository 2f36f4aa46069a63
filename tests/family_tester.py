"""The checks every model family shares, written once: diffusers' ``PipelineTesterMixin`` is the model.

A family's test class (``tests/test_family_<name>.py``) subclasses :class:`FamilyTesterMixin` and sets what is its
own, the way a diffusers pipeline test sets ``pipeline_class`` and ``get_dummy_components``: its ``pipeline.name``,
the module fixture that builds its tiny checkpoint, the diffusers pipeline class that checkpoint is, the overrides of
its training runs, its tolerances, and a few small hooks (its conditioning oracle, its pipeline call, what a check
adds for it). A check the family does not run is switched off diffusers' way, ``test_xxx = None`` in the class; a
variant of a family (v-prediction, another objective) is a subclass. The family's own checks stay beside the class
as plain functions of its module.

Each check keeps the tolerances the families' own copies had (the class attributes say them per family); a hook
that adds assertions for one family runs after the shared ones. The training checks (two real iterations) are
marked slow: ``make test-fast`` (``pytest -m "not slow"``) leaves them out, ``make test`` runs them.
"""

from __future__ import annotations

import json
import operator
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from tests.tiny_components import (
    as_adjoint_matching,
    as_diffusion_nft,
    euler_final_latents,
    family_config,
    ode_sample,
    rescoring_ratio_is_one,
    two_iterations_change_every_parameter,
)

# -- helpers the family modules share ---------------------------------------------------------------------------


def pipeline_default_grid(pipe, steps: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(timesteps, sigmas) a diffusers pipeline sets up for ``num_inference_steps=steps`` with its default
    arguments (no ``sigmas=`` / ``timesteps=``): the real ``__call__``, interrupted after its first step so that
    K = 1..50 stays cheap (``set_timesteps`` has run by then; the interrupt only skips the remaining steps)."""

    def stop(pipeline, i, t, callback_kwargs):
        pipeline._interrupt = True
        return callback_kwargs

    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        pipe(num_inference_steps=steps, output_type="latent", callback_on_step_end=stop, **kwargs)
    sigmas = getattr(pipe.scheduler, "sigmas", None)
    return pipe.scheduler.timesteps.clone(), None if sigmas is None else sigmas.clone()


def assert_ddpm_grid_step(adapter, steps: int, theirs: torch.Tensor) -> None:
    """flowrl's K-step grid, mapped through the adapter's timestep(), is the pipeline's own timesteps ``theirs``
    (then -1: clean data), and those are integers (nothing was rounded away)."""
    ours = adapter.timestep(adapter.schedule.sigmas(steps))
    assert ours[-1] == -1 and torch.equal(ours[:-1], theirs.to(torch.int64)), (steps, ours, theirs)
    assert torch.equal(theirs.to(torch.int64).double(), theirs.double())


def tiny_checkpoint(build: Callable[..., Path], *args, **kwargs):
    """A module fixture (assigned to the fixture's name): the directory into which ``build(directory, *args,
    **kwargs)`` saves a tiny checkpoint, built once per test module."""

    @pytest.fixture(scope="module")
    def checkpoint_directory(tmp_path_factory):
        return build(tmp_path_factory.mktemp(build.__name__.removeprefix("build_")), *args, **kwargs)

    return checkpoint_directory


def with_scheduler(directory, tmp_path: Path, scheduler) -> Path:
    """A copy of a tiny checkpoint with another scheduler (config and model_index.json entry); the models are
    shared, not rebuilt."""
    copy = tmp_path / f"{Path(directory).name}_{type(scheduler).__name__}"
    shutil.copytree(directory, copy)
    shutil.rmtree(copy / "scheduler")
    scheduler.save_pretrained(copy / "scheduler")
    index = json.loads((copy / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", type(scheduler).__name__]
    (copy / "model_index.json").write_text(json.dumps(index))
    return copy


def with_model_index(directory, tmp_path: Path, **changes) -> Path:
    """A copy of a tiny checkpoint whose model_index.json has ``changes`` (the components are shared, not rebuilt)."""
    copy = tmp_path / f"{Path(directory).name}_{'_'.join(changes)}"
    shutil.copytree(directory, copy)
    index = json.loads((copy / "model_index.json").read_text())
    (copy / "model_index.json").write_text(json.dumps({**index, **changes}))
    return copy


def plain_adapter(trainer, denoiser=None):
    """flowrl's adapter of a run's base model (its pipeline config without the LoRA, the run's guidance mode),
    optionally around another denoiser: the user's diffusers-loaded model, or a merged one."""
    from flowrl.pipelines import build_pipeline

    adapter = build_pipeline(trainer.config.pipeline.model_copy(update={"lora": None}), "cpu")
    adapter.guidance_mode = trainer.pipeline.guidance_mode
    if denoiser is not None:
        adapter.denoiser = denoiser
    return adapter


def assert_frozen(adapter, count: int | None = None) -> None:
    """The adapter's frozen modules (text encoders, VAE, image encoder) hold no trainable tensor; ``count`` of them."""
    frozen = adapter.frozen_modules()
    assert not any(p.requires_grad for m in frozen for p in m.parameters())
    assert count is None or len(frozen) == count, (len(frozen), count)


def flow_match(**config) -> Callable[[], Any]:
    """A :class:`Grid`'s scheduler: ``FlowMatchEulerDiscreteScheduler(**config)``, built when the check runs."""

    def build():
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(**config)

    return build


@dataclass(frozen=True)
class Grid:
    """One case of the default-grid check: the checkpoint as built, or a copy with another scheduler config
    (``scheduler`` builds it), loaded with further ``load`` options (another output size)."""

    scheduler: Callable[[], Any] | None = None
    load: dict = field(default_factory=dict)


# -- the tester ----------------------------------------------------------------------------------------------------


class FamilyTesterMixin:
    """The checks every model family runs, each at the family's own settings (class attributes and hooks below).

    ``test_sampler_equals_the_diffusers_pipeline``: flowrl's deterministic sampler = the pipeline's ``__call__`` with
    its default arguments (its own grid) from the same initial latents; the decoded images too.
    ``test_default_grid_is_the_pipelines_for_k_1_to_50``: flowrl's sampling grid = the one the pipeline sets up.
    ``test_two_grpo_iterations`` / ``test_two_adjoint_matching_iterations`` / ``test_two_diffusion_nft_iterations``:
    two real training iterations change every trainable tensor (and GRPO's re-scoring gives ratio 1).
    ``test_lora_round_trip_through_diffusers_load_lora_weights``: a LoRA run's checkpoint loads with the pipeline's
    own ``load_lora_weights`` and gives flowrl's samples; so do the merged model and ``flowrl export``.
    ``test_loads_through_flowrl_and_samples``: loading, sampling, frozen encoders, the prompt cache.
    """

    # -- what a family sets -------------------------------------------------------------------------------------
    name: ClassVar[str]  # pipeline.name
    checkpoint: ClassVar[str]  # the module fixture that builds the tiny checkpoint directory
    pipeline_class: ClassVar[str]  # the diffusers pipeline class the checkpoint is saved as
    denoiser: ClassVar[str] = "transformer"  # that pipeline's trained model
    prompts: ClassVar[tuple[str, ...]] = ("a photo of a cat", "a dog")
    flow: ClassVar[bool] = True  # a rectified-flow model; False: a DDPM parametrisation (DDIM samplers)
    sampler: ClassVar[str] = "flow_sde"  # the training runs' sampler
    run_settings: ClassVar[dict] = {}  # overrides of every training run (sizes, text length, guidance)
    load_options: ClassVar[dict] = {}  # PipelineConfig options of every adapter the checks load
    frozen_modules: ClassVar[int | None] = None  # how many frozen modules the adapter holds (None: not counted)
    prediction_type: ClassVar[str | None] = None  # what the adapter reads from the scheduler config (None: not checked)

    @pytest.fixture(autouse=True)
    def _family_test(self, request, tmp_path):
        self.request, self.tmp_path = request, tmp_path

    def pytest_generate_tests(self, metafunc):
        """A check with several cases in the family (``oracle_cases``, ``grids``) runs once per case."""
        for argument, cases in (("oracle_case", self.oracle_cases), ("grid", self.grids)):
            if argument in metafunc.fixturenames and len(cases) > 1:
                metafunc.parametrize(argument, list(cases))

    @pytest.fixture
    def oracle_case(self) -> str:
        return next(iter(self.oracle_cases))

    @pytest.fixture
    def grid(self) -> str:
        return next(iter(self.grids))

    def fixture(self, name: str):
        return self.request.getfixturevalue(name)

    @property
    def directory(self) -> Path:
        return self.fixture(self.checkpoint)

    @property
    def run_dir(self) -> Path:
        return self.tmp_path / "run"

    def config(self, **extra) -> list[str]:
        """The overrides of a fast training run of this family (GRPO unless ``extra`` says otherwise)."""
        return family_config(self.name, self.directory, self.run_dir, sampler=self.sampler, **{**self.run_settings, **extra})

    def load(self, directory=None, **options):
        """flowrl's adapter of the tiny checkpoint (or of ``directory``), through ``pipeline.pretrained``."""
        from flowrl.pipelines import FAMILIES, build_pipeline

        section = FAMILIES.section(self.name)
        return build_pipeline(section(pretrained=str(directory or self.directory), device="cpu", **{**self.load_options, **options}), "cpu")

    def diffusers_pipeline(self, directory=None):
        """The checkpoint loaded by diffusers itself, nothing of flowrl."""
        import diffusers

        pipe = getattr(diffusers, self.pipeline_class).from_pretrained(directory or self.directory)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def metadata(self) -> list[dict] | None:
        """The per-prompt metadata of ``prompts`` (a source image, a first frame); None: text only."""
        return None

    # -- 1. the sampler against the pipeline's own __call__ ------------------------------------------------------
    oracle_steps: ClassVar[int] = 2
    oracle_guidance_scale: ClassVar[float] = 4.0
    oracle_noise_seed: ClassVar[int] = 1
    # (op, bound): op(max |flowrl - diffusers| of the final latents, bound) must hold; a case may carry its own
    oracle_bound: ClassVar[tuple[Callable[[float, float], bool], float]] = (operator.lt, 1e-5)
    oracle_decode_atol: ClassVar[float | None] = None  # the decoded images against output_type="pt"; None: not compared
    oracle_cases: ClassVar[dict[str, dict]] = {"default": {}}  # case id -> what the hooks read (guidance_scale, bound, ...)

    def oracle_adapter(self, case: dict):
        return self.load()

    def oracle_pipeline(self):
        return self.diffusers_pipeline()

    def oracle_inputs(self, case: dict) -> tuple[list[str], list[dict] | None]:
        return list(self.prompts), self.metadata()

    def check_conditioning(self, adapter, pipe, case: dict) -> None:
        """The family's conditioning oracle: flowrl's encoding against the pipeline's encode_prompt."""

    def pipeline_call(self, pipe, noise: torch.Tensor, steps: int, scale: float, output_type: str, case: dict) -> torch.Tensor:
        """The pipeline's ``__call__`` with its default arguments from flowrl's ``noise``: its latents or images."""
        raise NotImplementedError(f"{type(self).__name__} sets pipeline_call (or test_sampler_equals_the_diffusers_pipeline = None)")

    def pipeline_latents(self, adapter, ours: torch.Tensor) -> torch.Tensor:
        """flowrl's final latents in the layout of the pipeline's output_type="latent" (packed, denormalised)."""
        return ours

    def flowrl_guidance(self, scale: float) -> float:
        """flowrl's guidance scale for the pipeline's ``scale``."""
        return scale

    def flowrl_final_latents(self, adapter, noise, steps: int, scale: float, case: dict) -> torch.Tensor:
        """flowrl's deterministic sampler from ``noise``: the Euler step (flow models) or DDIM with eta 0."""
        prompts, metadata = self.oracle_inputs(case)
        if self.flow:
            return euler_final_latents(adapter, noise, steps, self.flowrl_guidance(scale), prompts, metadata)
        from flowrl.config import ODEConfig
        from flowrl.samplers import build_sampler
        from flowrl.samplers.rollout import rollout

        traj = rollout(
            adapter,
            build_sampler(ODEConfig(), adapter),
            prompts,
            metadata or [{} for _ in prompts],
            torch.arange(len(prompts)),
            adapter.schedule.sigmas(steps),
            torch.Generator().manual_seed(0),
            self.flowrl_guidance(scale),
            initial_noise=noise,
            decode=False,
        )
        return traj.latents[:, -1]

    def check_oracle(self, adapter, pipe, noise: torch.Tensor, ours: torch.Tensor, case: dict) -> None:
        """Further assertions of the family after the oracle (the guidance branch matters, ...)."""

    def test_sampler_equals_the_diffusers_pipeline(self, oracle_case):
        """flowrl's deterministic sampler from the pipeline's initial latents = the diffusers pipeline's ``__call__``
        with its default arguments (the same grid, checked), and the decoded images = its output_type="pt"."""
        case = self.oracle_cases[oracle_case]
        adapter, pipe = self.oracle_adapter(case), self.oracle_pipeline()
        self.check_conditioning(adapter, pipe, case)
        steps, scale = self.oracle_steps, case.get("guidance_scale", self.oracle_guidance_scale)
        noise = adapter.initial_noise(len(self.oracle_inputs(case)[0]), torch.Generator().manual_seed(self.oracle_noise_seed))
        theirs = self.pipeline_call(pipe, noise, steps, scale, "latent", case)
        if self.flow:
            assert torch.equal(pipe.scheduler.sigmas, adapter.schedule.sigmas(steps))
        else:
            assert torch.equal(adapter.timestep(adapter.schedule.sigmas(steps))[:-1], pipe.scheduler.timesteps)
        ours = self.flowrl_final_latents(adapter, noise, steps, scale, case)
        diff = float((self.pipeline_latents(adapter, ours) - theirs).abs().max())
        print(f"{type(self).__name__} oracle ({oracle_case}, guidance {scale}, {steps} steps): max |flowrl - diffusers| = {diff:.2e}")
        op, bound = case.get("bound", self.oracle_bound)
        assert op(diff, bound), f"flowrl's sampler differs from {self.pipeline_class} by {diff} (bound {bound})"
        if self.oracle_decode_atol is not None:
            images = self.pipeline_call(pipe, noise, steps, scale, "pt", case)
            torch.testing.assert_close(adapter.decode(ours), images, atol=self.oracle_decode_atol, rtol=0)
        assert_frozen(adapter, self.frozen_modules)
        self.check_oracle(adapter, pipe, noise, ours, case)

    # -- 2. the default sampling grid ------------------------------------------------------------------------------
    grids: ClassVar[dict[str, Grid]] = {"default": Grid()}
    grid_call: ClassVar[dict] = {"prompt": "a cat", "guidance_scale": 1.0}  # the pipeline call's other arguments

    def grid_call_arguments(self, adapter, pipe) -> dict:
        return dict(self.grid_call)

    def check_grid(self, adapter, grid: str) -> None:
        """What the adapter read from the scheduler config (its grid, spacing, shift)."""

    def compare_grid(self, adapter, steps: int, timesteps: torch.Tensor, sigmas: torch.Tensor | None, grid: str) -> None:
        """flowrl's K-step grid against the pipeline's: its sigmas (flow models) or its timesteps (DDPM)."""
        if self.flow:
            assert torch.equal(adapter.schedule.sigmas(steps), sigmas), (grid, steps)
        else:
            assert_ddpm_grid_step(adapter, steps, timesteps)

    def check_grid_extras(self, adapter, pipe, directory: Path, grid: str) -> None:
        """Further assertions (another grid stays selectable, a foreign one is refused)."""

    def test_default_grid_is_the_pipelines_for_k_1_to_50(self, grid):
        """flowrl's grid = the one the diffusers pipeline sets up with its default arguments, for K = 1..50."""
        case = self.grids[grid]
        directory = self.directory if case.scheduler is None else with_scheduler(self.directory, self.tmp_path, case.scheduler())
        adapter, pipe = self.load(directory, **case.load), self.diffusers_pipeline(directory)
        self.check_grid(adapter, grid)
        call = self.grid_call_arguments(adapter, pipe)
        for steps in range(1, 51):
            timesteps, sigmas = pipeline_default_grid(pipe, steps, **call)
            self.compare_grid(adapter, steps, timesteps, sigmas, grid)
        self.check_grid_extras(adapter, pipe, directory, grid)

    # -- 3. training ------------------------------------------------------------------------------------------------
    grpo_overrides: ClassVar[dict] = {}
    ratio_atol: ClassVar[float] = 1e-5  # the re-scoring's |log ratio| bound
    adjoint_matching_overrides: ClassVar[dict] = {}
    adjoint_matching_guidance_mode: ClassVar[str] = "cfg_rollout_only"
    diffusion_nft_overrides: ClassVar[dict] = {}
    diffusion_nft_guidance_scale: ClassVar[float] = 1.0

    def check_grpo_run(self, trainer, worst: float) -> None:
        """Further assertions on the trained GRPO run (``worst``: the re-scoring's largest |log ratio|)."""

    @pytest.mark.slow
    def test_two_grpo_iterations(self):
        """Two GRPO iterations change every trainable tensor; re-scoring the rollout at unchanged weights gives ratio 1."""
        trainer = two_iterations_change_every_parameter(self.config(**self.grpo_overrides))
        worst = rescoring_ratio_is_one(trainer, atol=self.ratio_atol)
        print(f"{type(self).__name__} re-scoring at unchanged weights: max |log ratio| = {worst:.2e}")
        assert self.prediction_type is None or trainer.pipeline.prediction_type == self.prediction_type
        self.check_grpo_run(trainer, worst)

    @pytest.mark.slow
    def test_two_adjoint_matching_iterations(self):
        """Adjoint Matching (the memoryless sampler of the family's kind, the reward's gradient through the VAE
        decoder) changes every trainable tensor."""
        overrides = self.config(**self.adjoint_matching_overrides)
        two_iterations_change_every_parameter(
            as_adjoint_matching(overrides, flow=self.flow, guidance_mode=self.adjoint_matching_guidance_mode)
        )

    @pytest.mark.slow
    def test_two_diffusion_nft_iterations(self):
        """DiffusionNFT (deterministic ODE rollouts, the forward-process loss) changes every trainable tensor."""
        overrides = self.config(**self.diffusion_nft_overrides)
        two_iterations_change_every_parameter(as_diffusion_nft(overrides, guidance_scale=self.diffusion_nft_guidance_scale))

    # -- 4. LoRA round trip through diffusers --------------------------------------------------------------------------
    lora_overrides: ClassVar[dict] = {"pipeline.lora": "{r: 4, alpha: 8}"}
    lora_guidance_scale: ClassVar[float] = 1.0  # of the samples compared
    lora_state: ClassVar[bool] = True  # diffusers loads every tensor of flowrl's adapter, bit for bit (peft state dicts)
    lora_merged: ClassVar[bool] = True  # merged_denoiser(): a plain model whose samples are base + LoRA's
    lora_export: ClassVar[bool] = True  # `flowrl export`: the merged pipeline directory, and --lora-only

    def check_lora_run(self, trainer) -> None:
        """Further assertions on the trained LoRA run (before the round trip)."""

    def lora_sample_inputs(self, trainer) -> tuple[list[str], list[dict] | None]:
        """The prompts (and metadata) of the samples the round trip compares."""
        return list(self.prompts), self.metadata()

    @pytest.mark.slow
    def test_lora_round_trip_through_diffusers_load_lora_weights(self):
        """Two LoRA GRPO iterations (every adapter tensor moves, ratio 1); the run's checkpoint loaded into the base
        checkpoint with the pipeline's own load_lora_weights reproduces flowrl's samples, which differ from the base
        model's; the merged model and `flowrl export` (merged, --lora-only) agree."""
        from flowrl.cli import main

        trainer = two_iterations_change_every_parameter(self.config(**self.lora_overrides))
        rescoring_ratio_is_one(trainer)
        self.check_lora_run(trainer)
        checkpoint = self.run_dir / "checkpoints" / "step_000002"
        assert (checkpoint / "pytorch_lora_weights.safetensors").is_file()
        prompts, metadata = self.lora_sample_inputs(trainer)

        def sample(pipeline) -> torch.Tensor:
            return ode_sample(pipeline, prompts, seed=3, guidance_scale=self.lora_guidance_scale, metadata=metadata)

        ours = sample(trainer.pipeline)
        # the user's path: the base checkpoint + load_lora_weights(run checkpoint), nothing of flowrl
        pipe = self.diffusers_pipeline()
        pipe.load_lora_weights(checkpoint)
        theirs_model = getattr(pipe, self.denoiser)
        if self.lora_state:
            from peft.utils import get_peft_model_state_dict

            ours_lora = get_peft_model_state_dict(trainer.pipeline.denoiser)
            theirs_lora = get_peft_model_state_dict(theirs_model, adapter_name=next(iter(theirs_model.peft_config)))
            assert set(theirs_lora) == set(ours_lora), "diffusers did not load every LoRA tensor"
            assert all(torch.equal(theirs_lora[k].float(), v) for k, v in ours_lora.items())
        adapter = plain_adapter(trainer)
        base = sample(adapter)
        adapter.denoiser = theirs_model  # flowrl's sampler around the diffusers-loaded model + LoRA
        torch.testing.assert_close(sample(adapter), ours, atol=1e-5, rtol=0)
        assert (base - ours).abs().max() > 1e-4, "the LoRA did not change the samples, so the round trip proves nothing"
        if self.lora_merged:  # a plain model whose outputs equal base + LoRA
            merged = trainer.pipeline.merged_denoiser()
            assert not any("lora" in n for n, _ in merged.named_parameters())
            adapter.denoiser = merged
            torch.testing.assert_close(sample(adapter), ours, atol=1e-4, rtol=0)
        if not self.lora_export:
            return
        # `flowrl export`: a standalone diffusers directory with the LoRA merged in, and the LoRA file alone
        assert main(["export", str(checkpoint), str(self.tmp_path / "merged")]) == 0
        adapter.denoiser = getattr(self.diffusers_pipeline(self.tmp_path / "merged"), self.denoiser)
        torch.testing.assert_close(sample(adapter), ours, atol=1e-4, rtol=0)
        lora_only = self.tmp_path / "lora"
        assert main(["export", str(checkpoint), str(lora_only), "--lora-only"]) == 0
        assert (lora_only / "pytorch_lora_weights.safetensors").is_file()
        pipe = self.diffusers_pipeline()
        pipe.load_lora_weights(lora_only)
        adapter.denoiser = getattr(pipe, self.denoiser)
        torch.testing.assert_close(sample(adapter), ours, atol=1e-5, rtol=0)
        assert main(["export", str(checkpoint), str(lora_only)]) == 2  # exists: refused, nothing touched

    # -- 5. loading ----------------------------------------------------------------------------------------------------
    sample_shape: ClassVar[tuple[int, ...] | None] = None  # the shape of the deterministic samples of ``prompts``
    sample_guidance_scale: ClassVar[float] = 1.0

    def check_loaded(self, adapter) -> None:
        """Further assertions on the loaded adapter (its class, prediction type, sizes)."""

    def test_loads_through_flowrl_and_samples(self):
        """The checkpoint loads through pipeline.pretrained, samples in [0, 1], its frozen modules hold no trainable
        tensor, and the prompt cache returns exactly what the text encoders give."""
        adapter = self.load()
        self.check_loaded(adapter)
        images = ode_sample(adapter, list(self.prompts), guidance_scale=self.sample_guidance_scale, metadata=self.metadata())
        assert images.shape == self.sample_shape and 0 <= images.min() and images.max() <= 1
        assert_frozen(adapter, self.frozen_modules)
        prompts = list(reversed(self.prompts))
        cached, fresh = adapter.encode(prompts), adapter._encode_prompts(prompts)
        assert cached.keys() == fresh.keys() and all(torch.equal(cached[k], fresh[k]) for k in fresh)


class EmbeddedGuidanceTesterMixin:
    """The checks of a guidance-distilled family (FLUX.1-dev, FLUX.2-dev, Kontext): the guidance scale is an input of
    the model's guidance embedding, one forward a step, never true CFG. Mixed in before :class:`FamilyTesterMixin`."""

    guidance_embedder: ClassVar[str]  # the denoiser's guidance-embedding module (a dotted name)
    embedded_guidance_scale: ClassVar[float]

    def encode(self, adapter, prompts: list[str], metadata: list[dict] | None):
        return adapter.encode(prompts) if metadata is None else adapter.encode(prompts, metadata)

    def test_embedded_guidance_one_forward_per_step_with_gradient(self):
        """One transformer call per sampling step and per prediction; the gradient reaches the guidance embedding;
        the scale changes the prediction; true CFG is refused in one sentence."""
        from flowrl.errors import FlowRLError

        adapter, scale = self.load(), self.embedded_guidance_scale
        prompts, metadata = list(self.prompts), self.metadata()
        calls = []
        hook = adapter.denoiser.register_forward_hook(lambda module, args, out: calls.append(1))
        try:
            ode_sample(adapter, prompts, steps=3, guidance_scale=scale, metadata=metadata)
            assert len(calls) == 3, f"{len(calls)} transformer calls for 3 steps"
            calls.clear()
            x = adapter.initial_noise(len(prompts), torch.Generator().manual_seed(0))
            cond = self.encode(adapter, prompts, metadata)
            out = adapter.predict(x, torch.tensor(0.6), cond, scale)
            assert len(calls) == 1
            out.square().mean().backward()
        finally:
            hook.remove()
        grads = [p.grad for p in adapter.denoiser.get_submodule(self.guidance_embedder).parameters()]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads), "no gradient through the guidance embedding"
        with torch.no_grad():  # the scale is a real model input
            assert (adapter.predict(x, torch.tensor(0.6), cond, 1.0) - out).abs().max() > 1e-4
        with pytest.raises(FlowRLError, match="guidance-distilled"):
            adapter.guidance_mode = "cfg"

    def test_guidance_mode_cfg_fails_with_one_sentence_at_start_up(self):
        from flowrl.config import load_config
        from flowrl.errors import FlowRLError
        from flowrl.trainer import Trainer

        with pytest.raises(FlowRLError, match="rollout.guidance_mode"):
            Trainer(load_config(None, self.config(**{"rollout.guidance_mode": "cfg"})))
