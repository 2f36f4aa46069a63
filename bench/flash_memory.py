"""Peak memory and seconds per iteration of full-trajectory GRPO (every SDE step trained) against Flash-GRPO (one
trained SDE step per trajectory) at equal samples, on video: (a) the embedded digits_video model with
configs/digits_video/grpo.yaml's settings, (b) a Wan2.1-T2V-1.3B-architecture transformer with random weights on the
CPU (5 frames, 64x64, gradient checkpointing, LoRA r=64 as configs/wan/grpo_motion.yaml). #40 item 3.

    python bench/flash_memory.py                 # both sizes (the Wan one takes about ten minutes on one thread)
    python bench/flash_memory.py --quick         # digits_video only, one iteration, a smaller group
    python bench/flash_memory.py --sizes wan --threads 2

Each (size, method) runs in its own child process, so one method's peak never includes the other's. In the child the
trainer is built (model loaded, LoRA added), then ``gc.collect()`` and glibc's ``malloc_trim(0)`` hand freed heap
back, the resident set is read (``VmRSS``, the baseline) and the kernel's peak-RSS counter is reset (writing ``5`` to
``/proc/self/clear_refs`` resets ``VmHWM``); after the iterations the peak is ``VmHWM``. The figure reported is
**peak RSS during the iterations minus the RSS before them**: what training adds on top of the loaded model (the
activations, their recomputation, gradients, the trajectory store, optimizer state, reward), measured by the kernel
on every page fault, so no short spike is missed (a sampling thread can miss one; torch's CPU memory profiler sees
only tensors allocated through its allocator, not the reward's OpenCV buffers or the VAE's workspace, and slows
every op). The whole-process peak (import, load and iterations: VmHWM read before the reset, and the iterations'
peak) is reported beside it; ``ru_maxrss`` is not, since resetting VmHWM resets it too.

The Wan model (``--sizes wan``): WanTransformer3DModel with Wan2.1-T2V-1.3B's config (30 layers, 12 heads x 128 =
1536, FFN 8960, freq 256, 16 latent channels, patch (1,2,2), text_dim 4096, qk RMS-norm across heads, cross-attention
norm: the released wan_t2v_1_3B config, also diffusers' Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer), random
weights in float32; the Wan2.1 VAE at its real size (AutoencoderKLWan's defaults, random weights); a TINY UMT5 text
encoder (one layer, 4096 wide so its output fits text_dim; a real UMT5-XXL, 5.7 B parameters, would not fit beside the
transformer here, and the point is the denoiser's activation memory) with a tiny byte-level BPE tokenizer and 64
text tokens (the preset: 512). 5 frames at 64x64 are 2 latent frames of 8x8, 32 video tokens per sample. No CFG
(the preset's 5.0 doubles every forward). The checkpoint is built and saved by a child process, then loaded through
flowrl (``pipeline.pretrained=<dir>``) by each method's process.

Both methods: the same prompts, seed, group (prompts x samples), rollout batch, minibatch (the whole group in one)
and steps. GRPO: every step SDE and every step trained (``objective.timestep_fraction=1.0``); its update
backpropagates each trained step before the next forward (objectives/grpo.py), on all rows of the minibatch.
Flash-GRPO: one SDE step per trajectory, the same for a prompt's samples, drawn from the first half of the steps;
its update runs one forward + backward per distinct drawn step, on that step's rows. Results: bench/RESULTS.md,
bench/results/flash_memory.json.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

METHODS = ("grpo_full", "flash_grpo")
METHOD_LABEL = {"grpo_full": "GRPO, every step trained", "flash_grpo": "Flash-GRPO, one step"}

# Wan2.1-T2V-1.3B (Wan-AI's wan/configs/wan_t2v_1_3B.py: dim 1536, ffn_dim 8960, freq_dim 256, 12 heads, 30 layers,
# qk_norm, cross_attn_norm, eps 1e-6, patch (1, 2, 2); the Diffusers checkpoint's transformer/config.json in
# diffusers' names; rope_max_seq_len is WanTransformer3DModel's default, 1024)
WAN21_1P3B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
)
WAN_TEXT_TOKENS = 64


def build_wan(directory: Path) -> None:
    """A WanPipeline checkpoint: the 1.3B transformer and the real-size VAE with random weights (float32), a tiny UMT5."""
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from flowrl.pipelines.tiny.components import tiny_tokenizer

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(**WAN21_1P3B)
    vae = AutoencoderKLWan().eval()  # the defaults are Wan2.1's VAE (z_dim 16, 8x spatial, 4x temporal)
    text = UMT5EncoderModel(
        UMT5Config(vocab_size=512, d_model=4096, d_kv=8, d_ff=37, num_layers=1, num_heads=4, relative_attention_num_buckets=8)
    ).eval()
    WanPipeline(
        tokenizer=tiny_tokenizer(max_length=WAN_TEXT_TOKENS),
        text_encoder=text,
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # the Wan preset's shift
    ).save_pretrained(directory)
    print(
        json.dumps(
            {
                "transformer_params": sum(p.numel() for p in transformer.parameters()),
                "vae_params": sum(p.numel() for p in vae.parameters()),
                "text_encoder_params": sum(p.numel() for p in text.parameters()),
            }
        ),
        flush=True,
    )


def overrides(size: str, method: str, model_dir: Path | None, run_dir: Path, iterations: int, quick: bool) -> tuple[str | None, list[str]]:
    """(config file, overrides) of one run."""
    common = {
        "train.iterations": iterations,
        "eval.every": 0,
        "log.checkpoint_every": 0,
        "log.progress": False,
        "output_dir": str(run_dir),
    }
    if size == "digits_video":
        base = "configs/digits_video/grpo.yaml"
        if quick:  # 2 prompts x 4 samples, 5 steps: the test's budget
            common.update(
                {"train.prompts_per_iteration": 2, "train.num_generations": 4, "train.batch_size": 8, "rollout.num_inference_steps": 5}
            )
        grpo = {"objective.timestep_fraction": 1.0}
        # configs/digits/flash_grpo.yaml's objective and sampler; the rest as the digits_video GRPO preset
        flash = {
            "objective": "{name: flash_grpo, std: biased, std_eps: 1.0e-4, clip_range: 1.0e-3, adv_clip_max: 5.0, step_fraction: 0.5, rectify: true}",
            "sampler": "{name: flash_sde, noise_floor: 0.0, noise_ceiling: 1.0}",
        }
    else:
        base = None
        common.update(
            {
                # configs/wan/grpo_motion.yaml's model settings, at a CPU size
                "pipeline.name": "wan",
                "pipeline.pretrained": str(model_dir),
                "pipeline.device": "cpu",
                "pipeline.dtype": "float32",
                "pipeline.lora": "{r: 64, alpha: 128}",
                "pipeline.gradient_checkpointing": True,
                "pipeline.height": 64,
                "pipeline.width": 64,
                "pipeline.num_frames": 5,
                "pipeline.max_sequence_length": WAN_TEXT_TOKENS,
                "rollout.num_inference_steps": 10,
                "rollout.guidance_scale": 1.0,
                "rollout.same_noise_in_group": False,
                "rollout.batch_size": 4,
                "train.prompts_per_iteration": 2,
                "train.num_generations": 2,
                "train.batch_size": 4,
                "train.learning_rate": 2.0e-5,
                "train.max_grad_norm": 1.0,
                "reward.components": "{motion_quality: 1.0}",
                "prompts.dataset": "file",
                "prompts.train_file": "motion.txt",
                "prompts.eval_file": "motion_eval.txt",
                "eval.samples_per_prompt": 1,
                "log.grid_prompts": 1,
                "seed": 42,
            }
        )
        grpo = {
            "sampler": "{name: flow_sde, diffusion: dance_grpo, noise_level: 0.3}",
            "objective": "{name: grpo, clip_range: 1.0e-4, adv_clip_max: 5.0, timestep_fraction: 1.0, beta: 0.0}",
        }
        flash = {
            "sampler": "{name: flash_sde, noise_floor: 0.0, noise_ceiling: 1.0}",
            "objective": "{name: flash_grpo, clip_range: 1.0e-3, adv_clip_max: 5.0, step_fraction: 0.5}",
        }
    extra = grpo if method == "grpo_full" else flash
    return base, [f"{k}={v}" for k, v in {**common, **extra}.items()]


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS counter of this process (VmHWM); False where /proc/self/clear_refs is not writable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim_heap() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class PhasePeaks:
    """The peak RSS of each phase of an iteration: the loop's ``collect`` and ``score`` (rollout, decoding, reward)
    and ``prepare`` and ``update`` (advantages, the objective's forwards and backwards, the optimizer step) are
    wrapped; VmHWM is folded into the phase that ran and reset at each boundary, after ``gc.collect()`` and
    ``malloc_trim(0)`` (else glibc keeps the update's freed heap resident and the next rollout starts from it)."""

    PHASES = {"collect": "rollout", "score": "rollout", "prepare": "update", "update": "update"}

    def __init__(self, loop) -> None:
        self.peaks: dict[str, int] = {}
        self.current = "other"
        for name, phase in self.PHASES.items():
            setattr(loop, name, self._wrapped(getattr(loop, name), phase))

    def fold(self, phase: str) -> None:
        self.peaks[phase] = max(self.peaks.get(phase, 0), status_kib("VmHWM"))

    def _wrapped(self, method, phase: str):
        def run(*args, **kwargs):
            self.fold(self.current)
            trim_heap()  # freed heap handed back, so a phase does not start from the last one's high water
            reset_peak()
            self.current = phase
            try:
                return method(*args, **kwargs)
            finally:
                self.fold(phase)
                trim_heap()
                reset_peak()
                self.current = "other"

        return run


def touch_weights(pipeline) -> int:
    """Read every parameter and buffer of the pipeline's modules once, so that weights diffusers left memory-mapped
    from the safetensors files are resident before the baseline (else the first forward pages them in and the
    weights would count as the iteration's memory); returns the bytes touched."""
    import torch

    seen, total = set(), 0
    for module in vars(pipeline).values():
        if isinstance(module, torch.nn.Module):
            for t in (*module.parameters(), *module.buffers()):
                if id(t) not in seen and t.numel():
                    seen.add(id(t))
                    t.detach().float().sum()
                    total += t.numel() * t.element_size()
    return total


def run_one(size: str, method: str, model_dir: Path | None, iterations: int, quick: bool, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from flowrl.config import load_config
    from flowrl.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        base, ovr = overrides(size, method, model_dir, Path(tmp) / "run", iterations, quick)
        t0 = time.perf_counter()
        trainer = Trainer(load_config(str(REPO / base) if base else None, ovr))
        load_s = time.perf_counter() - t0
        model = trainer.pipeline.denoiser
        calls = {"n": 0, "rows": 0}

        def count(_module, args, kwargs):  # top-level denoiser calls and their rows (checkpoint recomputation is not one)
            first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
            calls["n"] += 1
            calls["rows"] += int(first.shape[0]) if first is not None and first.dim() else 0

        handle = model.register_forward_pre_hook(count, with_kwargs=True)
        touched = touch_weights(trainer.pipeline)
        trim_heap()
        baseline_kib = status_kib("VmRSS")
        load_peak_kib = status_kib("VmHWM")  # import and load; read before the counter is reset
        exact = reset_peak()
        phases = PhasePeaks(trainer.loop)
        seconds, per_iteration = [], []
        for i in range(iterations):
            t = time.perf_counter()
            metrics = trainer.train_iteration(i)
            seconds.append(time.perf_counter() - t)
            per_iteration.append(
                {
                    k: round(float(v), 4)
                    for k, v in metrics.items()
                    if k in ("perf/rollout_s", "perf/score_s", "perf/update_s", "loss/policy", "reward/mean", "flash/trained_step")
                }
            )
        handle.remove()
        phases.fold("other")
        peak_kib = max(phases.peaks.values())
        cfg = trainer.config
        return {
            "size": size,
            "method": method,
            "objective": cfg.objective.name,
            "sampler": cfg.sampler.name,
            "steps": cfg.rollout.num_inference_steps,
            "samples_per_iteration": cfg.train.prompts_per_iteration * cfg.train.num_generations,
            "group": f"{cfg.train.prompts_per_iteration} prompts x {cfg.train.num_generations} samples",
            "minibatch": cfg.train.batch_size,
            "iterations": iterations,
            "threads": torch.get_num_threads(),
            "denoiser_params": sum(p.numel() for p in model.parameters()),
            "trained_params": sum(p.numel() for p in trainer.trainable_parameters()),
            "load_s": round(load_s, 1),
            "weights_touched_gib": round(touched / 2**30, 3),
            "s_per_iteration": round(sum(seconds) / len(seconds), 2),
            "iteration_s": [round(s, 2) for s in seconds],
            "rollout_s": round(sum(m.get("perf/rollout_s", 0.0) for m in per_iteration) / iterations, 2),
            "update_s": round(sum(m.get("perf/update_s", 0.0) for m in per_iteration) / iterations, 2),
            "denoiser_calls_per_iteration": calls["n"] / iterations,
            "denoiser_rows_per_iteration": calls["rows"] / iterations,  # forward rows, rollout and update
            "rss_before_iterations_gib": round(baseline_kib / 2**20, 3),
            "peak_rss_during_iterations_gib": round(peak_kib / 2**20, 3),
            "peak_rss_delta_gib": round((peak_kib - baseline_kib) / 2**20, 3),
            "peak_rss_delta_by_phase_gib": {k: round((v - baseline_kib) / 2**20, 3) for k, v in phases.peaks.items()},
            "peak_exact": exact,  # False: clear_refs not writable, the peak is the process's since its start
            # the whole process (import, load, iterations); ru_maxrss is not used: resetting VmHWM resets it too
            "peak_whole_process_gib": round(max(load_peak_kib, peak_kib) / 2**20, 3),
            "metrics": per_iteration,
        }


def child(args: list[str]) -> dict:
    done = subprocess.run([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, cwd=REPO)
    if done.returncode:
        raise SystemExit(f"child {' '.join(args)} failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    from bench.record import cpu_name

    return cpu_name()


def table(rows: list[dict]) -> str:
    lines = [
        f"{'size':<13} {'method':<26} {'samples':>7} {'steps':>5} {'rows/it':>7} {'calls':>5} {'s/it':>8} {'rollout s':>9} {'update s':>8} {'RSS before':>10} {'peak delta':>10} {'in rollout':>10} {'in update':>9} {'process':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r['size']:<13} {METHOD_LABEL[r['method']]:<26} {r['samples_per_iteration']:>7} {r['steps']:>5} "
            f"{r['denoiser_rows_per_iteration']:>7.0f} {r['denoiser_calls_per_iteration']:>5.0f} {r['s_per_iteration']:>8.2f} {r['rollout_s']:>9.2f} {r['update_s']:>8.2f} {r['rss_before_iterations_gib']:>9.2f}G "
            f"{r['peak_rss_delta_gib']:>9.3f}G {r['peak_rss_delta_by_phase_gib'].get('rollout', 0):>9.3f}G {r['peak_rss_delta_by_phase_gib'].get('update', 0):>8.3f}G {r['peak_whole_process_gib']:>8.2f}G"
        )
    return "\n".join(lines)


def ratios(rows: list[dict]) -> dict:
    out = {}
    for size in dict.fromkeys(r["size"] for r in rows):
        by = {r["method"]: r for r in rows if r["size"] == size}
        if len(by) == 2:
            g, f = by["grpo_full"], by["flash_grpo"]
            out[size] = {
                "s_per_iteration_grpo_over_flash": round(g["s_per_iteration"] / f["s_per_iteration"], 2),
                "peak_delta_grpo_over_flash": round(g["peak_rss_delta_gib"] / max(f["peak_rss_delta_gib"], 1e-9), 2),
                "peak_total_grpo_over_flash": round(g["peak_rss_during_iterations_gib"] / f["peak_rss_during_iterations_gib"], 3),
                "forward_rows_grpo_over_flash": round(g["denoiser_rows_per_iteration"] / f["denoiser_rows_per_iteration"], 2),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="digits_video only, one iteration, 2 prompts x 4 samples, 5 steps")
    ap.add_argument("--sizes", nargs="+", choices=["digits_video", "wan"], default=["digits_video", "wan"])
    ap.add_argument("--iterations", type=int, default=None, help="per method (default 2; --quick 1)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--checkpoint-dir", type=Path, default=None, help="build the Wan checkpoint here (reused when it exists)")
    ap.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "flash_memory.json")
    ap.add_argument("--one", nargs=3, metavar=("SIZE", "METHOD", "MODEL_DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--build-wan", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.build_wan:
        build_wan(a.build_wan)
        return
    if a.one:
        size, method, model_dir = a.one
        print(json.dumps(run_one(size, method, Path(model_dir) if model_dir != "-" else None, a.iterations, a.quick, a.threads)))
        return

    import torch

    sizes = ["digits_video"] if a.quick else a.sizes
    rows, build = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            iterations = a.iterations or (1 if a.quick else 2)
            model_dir = "-"
            if size == "wan":
                model_dir = a.checkpoint_dir or Path(tmp) / "wan21_1p3b_random"
                if not (Path(model_dir) / "model_index.json").exists():
                    print(f"[{time.strftime('%H:%M:%S')}] building the Wan2.1-1.3B-architecture checkpoint", file=sys.stderr, flush=True)
                    done = subprocess.run(
                        [sys.executable, __file__, "--build-wan", str(model_dir)], stdout=subprocess.PIPE, text=True, check=True
                    )
                    build = json.loads(done.stdout.strip().splitlines()[-1])
            for method in METHODS:
                print(f"[{time.strftime('%H:%M:%S')}] {size}: {method}", file=sys.stderr, flush=True)
                extra = ["--quick"] if a.quick else []
                rows.append(
                    child(["--one", size, method, str(model_dir), "--iterations", str(iterations), "--threads", str(a.threads), *extra])
                )
    print(table(rows))
    rat = ratios(rows)
    for size, r in rat.items():
        print(
            f"{size}: GRPO / Flash-GRPO: s/iteration x{r['s_per_iteration_grpo_over_flash']}, "
            f"peak RSS delta x{r['peak_delta_grpo_over_flash']}, total peak x{r['peak_total_grpo_over_flash']}, "
            f"forward rows x{r['forward_rows_grpo_over_flash']}"
        )
    from bench.record import commit, this_command

    record = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": lscpu_model(),
        "cores": os.cpu_count(),
        "load_1min": round(os.getloadavg()[0], 1),
        "torch": torch.__version__,
        "command": this_command(),
        "commit": commit(),
        "memory_method": "peak RSS delta: VmHWM after the iterations (reset via /proc/self/clear_refs once the model is "
        "loaded) minus VmRSS before them, after gc.collect() and malloc_trim(0); one child process per method",
        "wan_build": build,
        "rows": rows,
        "ratios": rat,
    }
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
