"""The overrides that run a shipped preset (or, for a family without one, a sister preset) on a tiny checkpoint: one
place the docs, the tests and ``flowrl tiny``'s printed command share.

``tiny_overrides(run, checkpoint)`` = :data:`SMALL` (one iteration of one small group, two denoising steps, the
evaluations before and after training on two prompts, no tracker) + :data:`CPU` (float32 on the CPU, no held-out judge) + a reward that needs no hub weights
(``ink`` for images, ``motion_quality`` for videos: flowrl[video]) + the checkpoint's prompt file where the family
reads source images or first frames + the family's tiny sizes + the run's own. Everything else (the sampler, the
objective and its settings, LoRA, guidance) stays as the preset has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...errors import FlowRLError
from .components import PROMPT_FOLDER

SMALL = [
    "train.iterations=1",
    "train.prompts_per_iteration=2",
    "train.num_generations=2",
    "train.batch_size=2",
    "rollout.batch_size=2",
    "rollout.num_inference_steps=2",
    "eval.num_inference_steps=2",
    "eval.every=0",
    "eval.samples_per_prompt=1",
    "eval.batch_size=1",
    "prompts.eval_size=2",
    "log.checkpoint_every=0",
    "log.grid_prompts=1",
    "log.trackers=[]",
    "log.progress=false",
]
CPU = ["pipeline.device=cpu", "pipeline.dtype=float32", "train.mixed_precision=no", "eval.judge=null"]
IMAGE_REWARD = ["reward.components={ink: 1.0}", "reward.kwargs={}"]  # the share of dark pixels: no weights at all
VIDEO_REWARD = ["reward.components={motion_quality: 1.0}", "reward.kwargs={}", "reward.video_frames={}"]  # OpenCV optical flow
VIDEO = ["pipeline.num_frames=5", "pipeline.max_sequence_length=16"]
# (pipeline.name, variant) -> the sizes its tiny model takes (None: every variant of the family)
SIZES: dict[tuple[str, str | None], list[str]] = {
    ("stable_diffusion", None): ["pipeline.height=16", "pipeline.width=16"],
    ("sdxl", None): ["pipeline.height=16", "pipeline.width=16"],
    ("sd3", None): ["pipeline.height=16", "pipeline.width=16", "pipeline.max_sequence_length=8"],
    ("flux", None): ["pipeline.height=16", "pipeline.width=16", "pipeline.max_sequence_length=8"],
    ("flux_kontext", None): [
        "pipeline.height=16",
        "pipeline.width=16",
        "pipeline.condition_height=16",
        "pipeline.condition_width=16",
        "pipeline.max_sequence_length=8",
    ],
    ("flux2", "dev"): ["pipeline.height=16", "pipeline.width=16", "pipeline.max_sequence_length=64"],
    ("flux2", None): ["pipeline.height=16", "pipeline.width=16", "pipeline.max_sequence_length=32"],
    ("z_image", None): ["pipeline.height=16", "pipeline.width=16", "pipeline.max_sequence_length=48"],
    ("qwen_image", None): ["pipeline.height=32", "pipeline.width=32", "pipeline.max_sequence_length=32"],
    ("qwen_image_edit", None): [
        "pipeline.height=32",
        "pipeline.width=32",
        "pipeline.max_sequence_length=32",
        "pipeline.condition_area=9216",
    ],
    ("qwen_image_edit_plus", None): [
        "pipeline.height=32",
        "pipeline.width=32",
        "pipeline.max_sequence_length=32",
        "pipeline.condition_area=9216",
        "pipeline.vlm_condition_area=9216",
    ],
    ("wan", "ti2v"): ["pipeline.height=64", "pipeline.width=64", *VIDEO],
    ("wan_i2v", "ti2v"): ["pipeline.height=64", "pipeline.width=64", *VIDEO],
    ("wan", None): ["pipeline.height=32", "pipeline.width=32", *VIDEO],
    ("wan_i2v", None): ["pipeline.height=32", "pipeline.width=32", *VIDEO],
    ("cogvideox", None): ["pipeline.height=32", "pipeline.width=32", "pipeline.num_frames=9", "pipeline.max_sequence_length=16"],
    ("amused", None): [],
    ("dllm", None): [],
    ("diffusion_gemma", None): [],
}
VIDEO_FAMILIES = ("wan", "wan_i2v", "cogvideox")
TEXT_FAMILIES = ("dllm", "diffusion_gemma")  # their presets' rewards (math answers) need no weights: kept
SOURCE_FAMILIES = ("flux_kontext", "qwen_image_edit", "qwen_image_edit_plus", "wan_i2v")  # read OUT/prompts/prompts.jsonl


@dataclass(frozen=True)
class TinyRun:
    """A preset run on a family's tiny checkpoint: ``preset`` with the family set by ``extra`` when it is a sister
    preset (a family without a preset of its own)."""

    preset: str
    family: str
    variant: str
    extra: tuple[str, ...] = ()


def _runs(preset: str, family: str, variants: tuple[str, ...]) -> dict[str, TinyRun]:
    """The preset on its family's first variant, and the other variants (``FAMILY:VARIANT``) on the same preset."""
    return {preset: TinyRun(preset, family, variants[0])} | {f"{family}:{v}": TinyRun(preset, family, v) for v in variants[1:]}


FLUX_UNGUIDED = ("rollout.guidance_mode=cfg", "rollout.guidance_scale=1.0")  # no guidance embedding to use
# DMD2 steps the student on every ratio-th minibatch: four minibatches of one row, the student on the 2nd and 4th (a
# LoRA's down-projection gets its first gradient on its adapter's second step: its up-projection starts at zero); at
# the presets' rate 1e-5 that gradient is below AdamW's eps on a random tiny model and leaves klein's unchanged
DMD2_TINY = ("train.batch_size=1", "objective.fake_steps_per_student_step=2", "train.learning_rate=1e-3")
# run name (a preset, or FAMILY:VARIANT for a checkpoint without a preset of its own) -> the run
RUNS: dict[str, TinyRun] = {
    **_runs("stable_diffusion/ddpo_aesthetic", "stable_diffusion", ("epsilon", "v_prediction")),
    "sdxl:epsilon": TinyRun("stable_diffusion/ddpo_aesthetic", "sdxl", "epsilon", ("pipeline.name=sdxl",)),
    "sdxl:v_prediction": TinyRun("stable_diffusion/ddpo_aesthetic", "sdxl", "v_prediction", ("pipeline.name=sdxl",)),
    **_runs("sd3/flow_grpo_pickscore", "sd3", ("sd3.5", "no-t5")),
    "flux/dance_grpo_hpsv2": TinyRun("flux/dance_grpo_hpsv2", "flux", "dev"),
    "flux/dance_grpo_hpsv2_full": TinyRun("flux/dance_grpo_hpsv2_full", "flux", "dev"),
    "flux:schnell": TinyRun("flux/dance_grpo_hpsv2", "flux", "schnell", FLUX_UNGUIDED),
    "flux_kontext/grpo_pickscore": TinyRun("flux_kontext/grpo_pickscore", "flux_kontext", "dev"),
    "flux2/grpo_dev_clip_pickscore": TinyRun("flux2/grpo_dev_clip_pickscore", "flux2", "dev"),
    "flux2/grpo_klein_base_pickscore": TinyRun("flux2/grpo_klein_base_pickscore", "flux2", "klein-base"),
    "flux2/grpo_klein_pickscore": TinyRun("flux2/grpo_klein_pickscore", "flux2", "klein"),
    "flux2/dmd2_klein": TinyRun("flux2/dmd2_klein", "flux2", "klein", DMD2_TINY),
    "z_image/grpo_pickscore": TinyRun("z_image/grpo_pickscore", "z_image", "turbo"),
    "z_image/grpo_pickscore_turbo": TinyRun("z_image/grpo_pickscore_turbo", "z_image", "turbo"),
    "z_image/dmd2_turbo": TinyRun("z_image/dmd2_turbo", "z_image", "turbo", DMD2_TINY),
    "qwen_image/grpo_pickscore": TinyRun("qwen_image/grpo_pickscore", "qwen_image", "t2i"),
    "qwen_image_edit:edit": TinyRun("qwen_image/grpo_pickscore", "qwen_image_edit", "edit", ("pipeline.name=qwen_image_edit",)),
    **_runs("qwen_image/edit_plus_grpo_pickscore", "qwen_image_edit_plus", ("2509", "2511")),
    "wan/grpo_motion": TinyRun("wan/grpo_motion", "wan", "t2v"),
    "wan/wan22_t2v_a14b_grpo": TinyRun("wan/wan22_t2v_a14b_grpo", "wan", "a14b"),
    "wan/wan22_ti2v_5b_grpo": TinyRun("wan/wan22_ti2v_5b_grpo", "wan", "ti2v"),
    "wan_i2v:i2v": TinyRun("wan/grpo_motion", "wan_i2v", "i2v", ("pipeline.name=wan_i2v",)),
    "wan_i2v:a14b": TinyRun("wan/wan22_t2v_a14b_grpo", "wan_i2v", "a14b", ("pipeline.name=wan_i2v",)),
    "wan_i2v:ti2v": TinyRun("wan/wan22_ti2v_5b_grpo", "wan_i2v", "ti2v", ("pipeline.name=wan_i2v",)),
    "cogvideox:rotary": TinyRun("stable_diffusion/ddpo_aesthetic", "cogvideox", "rotary", ("pipeline.name=cogvideox",)),
    "cogvideox:sincos": TinyRun("stable_diffusion/ddpo_aesthetic", "cogvideox", "sincos", ("pipeline.name=cogvideox",)),
    "digits/masked_grpo": TinyRun("digits/masked_grpo", "amused", "256"),
    **{f"dllm/{name}": TinyRun(f"dllm/{name}", "dllm", "mdlm") for name in ("bgpo", "dcolt", "diffu_grpo", "unigrpo")},
    "dllm/diffu_grpo_block_cache": TinyRun("dllm/diffu_grpo_block_cache", "dllm", "bd3lm"),
    "dllm/just_grpo": TinyRun("dllm/just_grpo", "dllm", "mdlm"),
    "dllm/sudoku_diffu_grpo": TinyRun("dllm/sudoku_diffu_grpo", "dllm", "mdlm"),  # the arith vocabulary holds 0-4 and the tags
    "dllm/sudoku_tracerl": TinyRun("dllm/sudoku_tracerl", "dllm", "mdlm"),
    "dllm/block_elbo": TinyRun("dllm/block_elbo", "dllm", "bd3lm"),
    "dllm/diffusion_gemma_step_grpo": TinyRun("dllm/diffusion_gemma_step_grpo", "diffusion_gemma", "tiny"),
}


def runs_for(family: str, variant: str) -> list[str]:
    """The runs (preset names, or FAMILY:VARIANT) of a family's variant, the presets first."""
    return [name for name, run in RUNS.items() if (run.family, run.variant) == (family, variant)]


def sizes(family: str, variant: str) -> list[str]:
    return SIZES.get((family, variant), SIZES.get((family, None), []))


def tiny_overrides(run: str, checkpoint: str | Path, output_dir: str | Path | None = None) -> list[str]:
    """The overrides that run ``run`` (a preset name of :data:`RUNS`, or ``FAMILY:VARIANT``) on the tiny checkpoint
    directory ``checkpoint`` (``flowrl tiny FAMILY OUT``): pass them after ``flowrl train RUNS[run].preset``.
    ``output_dir``: the run's directory (default ``runs/tiny_<run>``, away from the preset's own)."""
    if run not in RUNS:
        raise FlowRLError(f"no tiny run '{run}'; the runs are: {', '.join(RUNS)}.")
    r = RUNS[run]
    text = r.family in TEXT_FAMILIES
    steps = [o for o in SMALL if not (text and "num_inference_steps" in o)]  # a dLLM's steps are its sampler's
    reward = [] if text else VIDEO_REWARD if r.family in VIDEO_FAMILIES else IMAGE_REWARD
    prompts = []
    if r.family in SOURCE_FAMILIES:
        file = Path(checkpoint) / PROMPT_FOLDER / "prompts.jsonl"
        prompts = ["prompts.dataset=file", f"prompts.train_file={file}", f"prompts.eval_file={file}"]
    output_dir = output_dir or "runs/tiny_" + run.replace("/", "_").replace(":", "_")
    return [
        *steps,
        *CPU,
        f"pipeline.pretrained={checkpoint}",
        *reward,
        *prompts,
        *sizes(r.family, r.variant),
        *r.extra,
        f"output_dir={output_dir}",
    ]
