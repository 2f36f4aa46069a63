"""Throughput accounting (flowrl/training/flops.py, docs/throughput.md): the per-call FLOPs against hand-derived counts
and against torch.profiler's count (with_flops=True) on the embedded digits UNet and a tiny FLUX transformer, one
count per distinct input shape, backward = 2 x forward, guidance passes counted, counting that leaves outputs bit for
bit unchanged, and a run's per-iteration totals equal to its calls x the per-call count (from the rows it reports),
summed into summary.json."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fast_overrides
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from flowrl.config import PipelineConfig, load_config
from flowrl.pipelines import build_pipeline
from flowrl.pipelines.tiny.components import tiny_flux_transformer
from flowrl.trainer import Trainer
from flowrl.training import flops as F
from flowrl.training.flops import ModelFlops, count_flops, throughput_summary

PROFILER_MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::conv2d")


def profiler_flops(fn) -> int:
    """torch.profiler's FLOPs of ``fn()``, its matmuls and convolutions (it also counts elementwise mul / add, which
    model FLOPs leave out), with attention in its math form (the profiler has no formula for the fused kernels)."""
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        fn()
    return sum(e.flops for e in prof.events() if e.flops and e.name in PROFILER_MATMULS)


@pytest.fixture(scope="module")
def digits(one_thread):
    torch.manual_seed(0)
    return build_pipeline(PipelineConfig(pretrained="digits_flow"), "cpu")


def digits_inputs(batch: int):
    g = torch.Generator().manual_seed(batch)
    return torch.randn(batch, 1, 8, 8, generator=g), torch.full((batch,), 500.0), torch.randn(batch, 8, 32, generator=g)


def test_a_linear_stack_hand_derived_once_per_shape_backward_twice(one_thread):
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    per_row = 2 * (8 * 16 + 16 * 4)  # 2 FLOPs per multiply-accumulate; biases and the GELU are not model FLOPs
    counter = ModelFlops(lambda: [net], "cpu")
    with torch.no_grad():
        for _ in range(5):
            net(torch.randn(3, 8))
    y = net(torch.randn(6, 8))
    y.square().sum().backward()
    net(torch.randn(6, 8))  # a forward whose output never gets a gradient: no backward counted
    assert counter.calls == 7 and counter.forward_rows == 5 * 3 + 2 * 6 and counter.backward_rows == 6
    assert counter.forward_flops == per_row * (5 * 3 + 2 * 6)
    assert counter.backward_flops == 2 * per_row * 6
    assert counter.counted_signatures == 2  # (3, 8) and (6, 8): each counted once, every other call from the cache
    assert counter.cache == {(id(net), (((3, 8), torch.float32),), ()): per_row * 3, (id(net), (((6, 8), torch.float32),), ()): per_row * 6}
    counter.start()  # a new iteration: zeroed, the cache kept
    assert counter.flops == 0 and counter.counted_signatures == 2
    counter.close()


def test_a_hooked_module_inside_another_is_part_of_its_call(one_thread):
    inner = torch.nn.Linear(4, 4, bias=False)
    outer = torch.nn.Sequential(inner, torch.nn.Linear(4, 2, bias=False))
    counter = ModelFlops(lambda: [outer, inner], "cpu")
    with torch.no_grad():
        outer(torch.randn(5, 4))
        inner(torch.randn(5, 4))  # called alone: a call of its own
    assert counter.calls == 2
    assert counter.forward_flops == 2 * 5 * (16 + 8) + 2 * 5 * 16
    counter.close()


def test_the_digits_unet_per_call_equals_the_profilers_count_and_leaves_outputs_unchanged(digits):
    unet = digits.denoiser
    x, t, c = digits_inputs(4)
    with torch.no_grad():
        plain = unet(x, t, c).sample
        counted, flops = count_flops(lambda: unet(x, t, c).sample)
        assert torch.equal(plain, counted)  # counting changes no kernel
        assert flops == profiler_flops(lambda: unet(x, t, c))
        assert flops == 170_098_688  # the 8x8 model at 4 rows: convolutions 123.6M, linears 39.0M, attention 7.5M
        counter = ModelFlops(lambda: [unet], "cpu")
        for batch in (4, 8):
            unet(*digits_inputs(batch))
        counter.close()
    assert counter.cache[(id(unet), F._signature(digits_inputs(8)), ())] == 2 * flops  # linear in the rows


def test_a_tiny_flux_transformer_per_call_equals_the_profilers_count(one_thread):
    model = tiny_flux_transformer().eval()
    b, n, t = 2, 16, 8
    kw = dict(
        hidden_states=torch.randn(b, n, 16),
        timestep=torch.full((b,), 0.5),
        guidance=torch.full((b,), 3.5),
        pooled_projections=torch.randn(b, 32),
        encoder_hidden_states=torch.randn(b, t, 32),
        txt_ids=torch.zeros(t, 3),
        img_ids=torch.zeros(n, 3),
        return_dict=False,
    )
    with torch.no_grad():
        plain = model(**kw)[0]
        counted, flops = count_flops(lambda: model(**kw)[0])
    assert torch.equal(plain, counted)
    # the joint attention (fused sdpa kernel in the count, its math form's two bmm in the profiler's) included
    assert flops == profiler_flops(lambda: model(**kw)) == 2_904_064
    # of which attention: 2 blocks x 2 matmuls (QK^T, AV) x 2 FLOPs per multiply-accumulate x b x 2 heads x
    # (n + t)^2 tokens x 16 per head; without the CPU kernel's formula torch's counter would miss it
    attention = 2 * 2 * 2 * b * 2 * (n + t) ** 2 * 16
    with torch.no_grad(), FlopCounterMode(display=False) as plain_counter:
        model(**kw)
    assert flops - plain_counter.get_total_flops() == attention == 294_912


@pytest.mark.parametrize("mode, calls, rows, backward_rows", [("cfg", 1, 8, 8), ("cfg_detached_uncond", 2, 8, 4)], ids=["cfg", "detached"])
def test_guidance_passes_are_counted(digits, mode, calls, rows, backward_rows):
    x, _, _ = digits_inputs(4)
    cond = digits.encode(["a 3"] * 4)
    per_row = count_flops(lambda: digits.denoiser(*digits_inputs(1)))[1]
    before = digits.guidance_mode
    digits.guidance_mode = mode
    counter = ModelFlops(lambda: [digits.denoiser], "cpu")
    try:
        x.requires_grad_(True)
        digits.predict(x, torch.tensor(0.5), cond, guidance_scale=4.0).sum().backward()
    finally:
        digits.guidance_mode = before
        counter.close()
    assert (counter.calls, counter.forward_rows, counter.backward_rows) == (calls, rows, backward_rows)
    assert counter.forward_flops == rows * per_row and counter.backward_flops == 2 * backward_rows * per_row


def test_peaks_mfu_and_the_summary(monkeypatch):
    assert F.peak_flops_per_s("cpu") is None and F.peak_flops_per_s("cpu", 5e12) == 5e12
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, peak in [("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("Tesla T4", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert F.peak_flops_per_s("cuda:0") == peak, name
    counter = ModelFlops(lambda: [], "cpu", peak=1e9)
    counter.forward_flops, counter.backward_flops = 3e8, 6e8
    m = counter.metrics(0.5)
    assert m["perf/achieved_flops_per_s"] == 1.8e9 and m["perf/mfu"] == pytest.approx(1.8)
    assert "perf/mfu" not in ModelFlops(lambda: [], "cpu").metrics(0.5)  # no peak: no MFU
    records = [{"step": 0}, {"perf/model_flops": 10, "perf/iteration_s": 2.0}, {"perf/model_flops": 30, "perf/iteration_s": 2.0}]
    s = throughput_summary(records, "cpu", None)
    assert (s["iterations"], s["model_flops"], s["achieved_flops_per_s"], s["mfu"]) == (2, 40, 10.0, None)
    assert throughput_summary(records, "NVIDIA H200", 20.0, world=2)["mfu"] == 0.25


@pytest.mark.slow
def test_a_runs_flops_are_its_calls_times_the_per_call_count(digits, tmp_path):
    """The digits GRPO preset, 2 iterations: every denoiser call is a UNet forward of the same FLOPs per row, so each
    iteration's forward FLOPs are its forward rows x the profiler's per-row count and its backward FLOPs 2 x its
    backward rows x that; summary.json's totals are the iterations' sums."""
    per_row = profiler_flops(lambda: digits.denoiser(*digits_inputs(1)))
    cfg = load_config("flowrl/configs/digits/grpo.yaml", fast_overrides(tmp_path, **{"log.trackers": "[]"}))
    trainer = Trainer(cfg)
    summary = trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    iterations = [r for r in records if "perf/model_flops" in r]
    assert len(iterations) == 2
    for r in iterations:
        rollout_rows = cfg.train.prompts_per_iteration * cfg.train.num_generations * cfg.rollout.num_inference_steps
        assert r["perf/model_forward_rows"] > rollout_rows and r["perf/model_backward_rows"] > 0
        assert r["perf/model_flops_forward"] == r["perf/model_forward_rows"] * per_row
        assert r["perf/model_flops_backward"] == 2 * r["perf/model_backward_rows"] * per_row
        assert r["perf/model_flops"] == r["perf/model_flops_forward"] + r["perf/model_flops_backward"]
        assert r["perf/achieved_flops_per_s"] == pytest.approx(r["perf/model_flops"] / r["perf/iteration_s"])
        assert r["perf/iteration_s"] >= r["perf/rollout_s"] + r["perf/score_s"] + r["perf/update_s"]
        assert "perf/mfu" not in r  # a CPU, no log.peak_flops
    t = summary["throughput"]
    assert t["model_flops"] == sum(r["perf/model_flops"] for r in iterations) and t["iterations"] == 2
    assert t["device"] == "cpu" and t["peak_flops_per_s"] is None and t["mfu"] is None
    assert json.loads((tmp_path / "summary.json").read_text())["throughput"] == json.loads(json.dumps(t))


def test_the_signature_keys_shapes_flags_and_cache_lengths_not_numbers():
    class Cache:  # a transformers KV cache: attention's keys grow with it
        def __init__(self, n):
            self.n = n

        def get_seq_length(self):
            return self.n

    x = torch.zeros(2, 3)
    assert F._signature((x, 0.5, 7)) == F._signature((torch.ones(2, 3), 0.9, 8))  # a timestep changes no FLOPs
    assert F._signature((x,)) != F._signature((torch.zeros(4, 3),)) != F._signature((x.double(),))
    assert F._signature({"return_dict": False}) != F._signature({"return_dict": True})
    assert F._signature({"cache": Cache(4)}) != F._signature({"cache": Cache(8)})
