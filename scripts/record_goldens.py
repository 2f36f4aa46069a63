"""Frozen bits (issue #31 item 4): record, or check, golden values of flowrl's numbers on fixed inputs.

Every quantity below is computed by flowrl's own code (samplers, objectives, models, the trainer) on inputs fixed by
seeds, on the CPU in float32, with torch pinned to one intra-op thread. ``tests/test_frozen_bits.py`` recomputes each
one and compares it bit for bit with ``tests/goldens/frozen_bits.json``; when a bit moves, the failure names the
quantity and says by how much. This module is the one definition of the quantities: the test imports it by path.

    python scripts/record_goldens.py                  # re-record every quantity (after judging why bits moved)
    python scripts/record_goldens.py NAME [NAME ...]  # re-record only these (a name or a prefix such as sampler/)
    python scripts/record_goldens.py --check          # compare with the file, write nothing; exit 1 if bits moved
    python scripts/record_goldens.py --check --threads 2   # the same at two threads (does a quantity depend on them?)
    python scripts/record_goldens.py --list           # the quantities' names

docs/frozen_bits.md says what is frozen, why, and what to do when a dependency upgrade moves bits.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import functools
import hashlib
import json
import math
import platform
import struct
import sys
import tempfile
from collections.abc import Callable, Iterator
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[1]
GOLDENS = REPO / "tests" / "goldens" / "frozen_bits.json"
FORMAT = 1
RECORD_COMMAND = "python scripts/record_goldens.py"

# Intra-op threads the quantities are computed with. One, because a reduction split over threads may add in another
# order; --threads changes it for a check of exactly that.
THREADS = 1
# Tensors up to this many elements are stored whole (base64 of their bytes), so a failure can count the elements
# that moved; larger ones (weights, gradients) keep a sha256, sums and PROBES evenly spaced elements.
WHOLE_UP_TO = 4096
PROBES = 64

Fields = dict[str, Any]  # a quantity's named values: tensors, floats, ints, bools, strings, None, or {name: tensor}
QUANTITIES: dict[str, Callable[[], Fields]] = {}


def quantity(name: str):
    """Register ``fn`` as the quantity ``name`` (its fields are recorded and compared one by one)."""

    def register(fn: Callable[[], Fields]) -> Callable[[], Fields]:
        if name in QUANTITIES:
            raise ValueError(f"quantity {name!r} defined twice")
        QUANTITIES[name] = fn
        return fn

    return register


# ---------------------------------------------------------------------------------------------------------------
# Computing a quantity: pinned threads, a private global RNG
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def pinned_threads(threads: int | None = None) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads or THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def compute(name: str) -> Fields:
    """The fields of quantity ``name``, computed at ``THREADS`` threads. The global RNG is forked and seeded, so
    a quantity neither depends on what ran before it nor disturbs what runs after it (in the test process too)."""
    with pinned_threads(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return flatten(QUANTITIES[name]())


def flatten(fields: Fields, prefix: str = "") -> Fields:
    """Nested dicts of fields as one level with "/"-joined keys; a dict of tensors whose key ends in "@tensors" stays
    one field (a state dict: compared tensor by tensor)."""
    out: Fields = {}
    for key, value in fields.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and not full.endswith("@tensors"):
            out.update(flatten(value, full + "/"))
        else:
            out[full] = value
    return out


def selected(names: list[str]) -> list[str]:
    """Quantity names matching ``names`` (exact names, or prefixes)."""
    chosen = [q for q in QUANTITIES if any(q == n or q.startswith(n) for n in names)]
    unknown = [n for n in names if not any(q == n or q.startswith(n) for q in QUANTITIES)]
    if unknown:
        raise SystemExit(f"unknown quantity {', '.join(unknown)}; --list shows them")
    return chosen


# ---------------------------------------------------------------------------------------------------------------
# Encoding: exact, compact, and with enough readable context to say how far a value moved
# ---------------------------------------------------------------------------------------------------------------


def _raw(t: Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _b64(t: Tensor) -> str:
    return base64.b64encode(_raw(t)).decode("ascii")


def _from_b64(text: str, dtype: torch.dtype, shape: list[int]) -> Tensor:
    raw = bytearray(base64.b64decode(text))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape) if raw else torch.empty(shape, dtype=dtype)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def probe_indices(numel: int) -> Tensor:
    return torch.linspace(0, numel - 1, min(PROBES, numel), dtype=torch.float64).round().long().unique()


def tensor_record(t: Tensor) -> dict[str, Any]:
    t = t.detach().cpu().contiguous()
    flat = t.reshape(-1)
    record: dict[str, Any] = {
        "kind": "tensor",
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "sha256": hashlib.sha256(_raw(t)).hexdigest(),
    }
    if t.dtype.is_floating_point:  # summaries for readers of the file and of a failure; the comparison is the sha256
        finite = flat.double()[torch.isfinite(flat)]
        record["sum"] = float(finite.sum()) if finite.numel() else 0.0
        record["abs_max"] = float(finite.abs().max()) if finite.numel() else 0.0
    elif t.numel():
        record["sum"] = int(flat.long().sum())
    if t.numel() <= WHOLE_UP_TO:
        record["data"] = _b64(t)
    else:
        record["probe"] = _b64(flat[probe_indices(t.numel())])
    return record


def encode(value: Any) -> dict[str, Any]:
    """The stored form of one field. Floats keep their exact bits as float.hex (plus a decimal for readers)."""
    if isinstance(value, Tensor):
        return tensor_record(value)
    if isinstance(value, dict):  # a state dict: each tensor's sha256, plus the whole as one flat tensor
        tensors = {k: v.detach().cpu() for k, v in value.items()}
        flat = torch.cat([v.reshape(-1).float() for v in tensors.values()]) if tensors else torch.zeros(0)
        return {
            "kind": "tensors",
            "sha256": {k: hashlib.sha256(_raw(v)).hexdigest()[:8] for k, v in tensors.items()},  # to say which moved
            "flat": tensor_record(flat),
        }
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return {"kind": "exact", "value": value}
    if isinstance(value, int):
        return {"kind": "exact", "value": value}
    if isinstance(value, float):
        return {"kind": "float", "hex": value.hex(), "value": repr(value)}
    raise TypeError(f"cannot freeze a {type(value).__name__}")


# ---------------------------------------------------------------------------------------------------------------
# Comparing: None when every bit is the same, else one line saying how far it moved
# ---------------------------------------------------------------------------------------------------------------


def _ulps(a: float, b: float) -> int | None:
    """Distance in float32 units in the last place (None if either is not finite or not a float32)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return None
    try:
        ia, ib = (struct.unpack("<i", struct.pack("<f", v))[0] for v in (a, b))
    except OverflowError:
        return None
    if any(struct.unpack("<f", struct.pack("<f", v))[0] != v for v in (a, b)):
        return None  # not float32 values: a float32 ulp means nothing here
    ia = ia if ia >= 0 else -(ia & 0x7FFFFFFF)
    ib = ib if ib >= 0 else -(ib & 0x7FFFFFFF)
    return abs(ia - ib)


def _g(x: float) -> str:
    return f"{x:.9g}"


def _float_diffs(old: Tensor, new: Tensor) -> tuple[float, float]:
    """Max abs and max relative difference of two float tensors (float64; a NaN on one side only is inf)."""
    a, b = old.double(), new.double()
    both_nan = torch.isnan(a) & torch.isnan(b)
    diff = torch.where(both_nan, torch.zeros_like(a), (a - b).abs())
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    rel = diff / torch.maximum(a.abs(), b.abs()).clamp(min=torch.finfo(torch.float64).tiny)
    rel = torch.where(diff == 0, torch.zeros_like(rel), rel)
    return float(diff.max()), float(rel.max())


def _elementwise(old: Tensor, new: Tensor, what: str) -> str:
    """How many of ``what`` (elements) moved and by how much, for two same-shape tensors (recorded, now)."""
    o, n = old.reshape(-1), new.reshape(-1)
    moved = torch.tensor([a != b for a, b in zip(_split_raw(o), _split_raw(n))], dtype=torch.bool)
    count = int(moved.sum())
    if not count:
        return f"0 of {o.numel()} {what} moved"
    first = int(moved.nonzero()[0])
    where = f"[{', '.join(str(int(i)) for i in torch.unravel_index(torch.tensor(first), old.shape))}]" if old.ndim > 1 else f"[{first}]"
    where = "" if old.ndim == 0 else f" at {where}"
    text = f"{count} of {o.numel()} {what} moved"
    if o.dtype.is_floating_point:
        max_abs, max_rel = _float_diffs(o[moved], n[moved])
        text += f", max abs diff {max_abs:.3g}, max rel diff {max_rel:.3g}"
        if o.dtype == torch.float32:
            ulps = [_ulps(float(a), float(b)) for a, b in zip(o[moved].tolist(), n[moved].tolist())]
            if all(u is not None for u in ulps):
                text += f" (up to {max(ulps)} ulp)"
        text += f"; first{where}: recorded {_g(float(o[first]))}, now {_g(float(n[first]))}"
    else:
        diff = (o[moved].long() - n[moved].long()).abs()
        text += f", max abs diff {int(diff.max())}; first{where}: recorded {int(o[first])}, now {int(n[first])}"
    return text


def _split_raw(t: Tensor) -> list[bytes]:
    raw, size = _raw(t), t.element_size()
    return [raw[i : i + size] for i in range(0, len(raw), size)]


def _compare_tensor(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    if old["dtype"] != new["dtype"] or old["shape"] != new["shape"]:
        return f"was {old['dtype']} {old['shape']}, now {new['dtype']} {new['shape']}"
    if old["sha256"] == new["sha256"]:
        return None
    dtype, shape = _dtype(old["dtype"]), old["shape"]
    if "data" in old and "data" in new:
        return _elementwise(_from_b64(old["data"], dtype, shape), _from_b64(new["data"], dtype, shape), "elements")
    numel = math.prod(shape)
    text = f"sha256 of the {numel} elements differs; " + _elementwise(
        _from_b64(old["probe"], dtype, [-1]), _from_b64(new["probe"], dtype, [-1]), "probed elements"
    )
    if "sum" in old and "sum" in new and old["sum"] != new["sum"]:
        text += f"; sum recorded {_g(old['sum'])}, now {_g(new['sum'])} (diff {abs(new['sum'] - old['sum']):.3g})"
    return text


def compare_field(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """None if the field's bits are the same, else how it moved."""
    if old["kind"] != new["kind"]:
        return f"was a {old['kind']}, now a {new['kind']}"
    kind = old["kind"]
    if kind == "exact":
        return None if old["value"] == new["value"] else f"recorded {old['value']!r}, now {new['value']!r}"
    if kind == "float":
        if old["hex"] == new["hex"]:
            return None
        a, b = float.fromhex(old["hex"]), float.fromhex(new["hex"])
        max_abs, max_rel = _float_diffs(torch.tensor([a], dtype=torch.float64), torch.tensor([b], dtype=torch.float64))
        ulps = _ulps(a, b)
        ulp_text = f", {ulps} float32 ulp" if ulps is not None and ulps < 2**20 else ""
        return f"recorded {_g(a)}, now {_g(b)} (abs diff {max_abs:.3g}, rel diff {max_rel:.3g}{ulp_text})"
    if kind == "tensor":
        return _compare_tensor(old, new)
    if kind == "tensors":
        a, b = old["sha256"], new["sha256"]
        if a == b and old["flat"]["sha256"] == new["flat"]["sha256"]:
            return None
        if a.keys() != b.keys():
            return f"the tensor names changed: lost {sorted(a.keys() - b.keys())[:5]}, gained {sorted(b.keys() - a.keys())[:5]}"
        moved = [k for k in a if a[k] != b[k]]
        shown = ", ".join(moved[:4]) + (", ..." if len(moved) > 4 else "")
        return f"{len(moved)} of {len(a)} tensors moved ({shown}); all of them as one: {_compare_tensor(old['flat'], new['flat'])}"
    raise ValueError(f"unknown field kind {kind!r}")


def compare(golden: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """One line per field that moved (or appeared, or disappeared)."""
    lines = []
    for key in sorted(golden.keys() | actual.keys()):
        if key not in actual:
            lines.append(f"{key}: recorded, but no longer computed")
        elif key not in golden:
            lines.append(f"{key}: computed, but never recorded")
        else:
            moved = compare_field(golden[key], actual[key])
            if moved is not None:
                lines.append(f"{key}: {moved}")
    return lines


def failure_message(name: str, lines: list[str], recorded_env: dict[str, Any]) -> str:
    now = environment()
    changed = [f"{k} {recorded_env.get(k)} -> {now.get(k)}" for k in sorted(now) if recorded_env.get(k) != now.get(k)]
    env = "; ".join(changed) if changed else "the same versions and platform as when recorded"
    return (
        f"frozen bits moved in '{name}' ({len(lines)} field{'s' if len(lines) != 1 else ''}):\n  "
        + "\n  ".join(lines)
        + f"\nenvironment: {env}.\nIf the change is intended (a dependency upgrade judged harmless, a deliberate change "
        f"of the math), re-record on purpose: {RECORD_COMMAND} {name}  (docs/frozen_bits.md)"
    )


# ---------------------------------------------------------------------------------------------------------------
# Environment: what the goldens hold for
# ---------------------------------------------------------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return importlib_metadata.version(package)
    except importlib_metadata.PackageNotFoundError:
        return None


def platform_key() -> dict[str, str]:
    """What must match for the goldens to apply at all: the OS, the CPU architecture, the vector instructions torch's
    CPU kernels dispatch to (AVX2 and AVX-512 kernels may round differently) and the CPU model: two AVX-512 CPUs of
    other generations were seen to round the same float32 matmuls differently (MKL picks its kernels by model)."""
    return {
        "system": platform.system(),
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_model": cpu_model(),
        "byteorder": sys.byteorder,
    }


def cpu_model() -> str:
    """The CPU's vendor, family and model (Linux: /proc/cpuinfo), e.g. "GenuineIntel family 6 model 207"; elsewhere
    what the platform module reports."""
    try:
        fields = dict(
            line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines()[:30] if ":" in line
        )  # the first processor's block
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        return f"{fields['vendor_id']} family {fields['cpu family']} model {fields['model']}"
    except (OSError, KeyError):
        return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    return {
        **platform_key(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **{name: _version(name) for name in ("numpy", "diffusers", "transformers", "accelerate", "safetensors", "scikit-learn")},
        "threads": THREADS,
        "device": "cpu",
        "dtype": "float32",
    }


def load_goldens(path: Path = GOLDENS) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {"format": FORMAT, "environment": {}, "quantities": {}}


# ---------------------------------------------------------------------------------------------------------------
# Fixed inputs and shared, read-only models
# ---------------------------------------------------------------------------------------------------------------

SHAPE = (4, 1, 8, 8)  # the digits models' latents: 4 samples, 1 channel, 8 x 8
DIGIT_PROMPTS = ["a handwritten seven", "a handwritten seven", "the digit two", "the digit two"]
DIGIT_METADATA = [{"digit": 7}, {"digit": 7}, {"digit": 2}, {"digit": 2}]
GROUPS = torch.tensor([0, 0, 1, 1])
REWARDS = torch.tensor([0.30, 0.90, 0.55, 0.10])  # fixed rewards: the objectives are frozen apart from the reward models


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(seed: int, shape=SHAPE) -> Tensor:
    return torch.randn(shape, generator=gen(seed))


@functools.cache
def _loaded_pipeline(name: str):
    from flowrl.config import PipelineConfig
    from flowrl.pipelines import build_pipeline

    return build_pipeline(PipelineConfig(pretrained=name), "cpu")


def pipeline(name: str):
    """A private copy of the embedded model ``name`` (digits_flow, digits_ddpm): quantities may train or perturb it."""
    return copy.deepcopy(_loaded_pipeline(name))


@functools.cache
def arith_lm():
    from flowrl.pipelines.dllm import DLLMPipelineConfig

    return DLLMPipelineConfig(pretrained="arith_mdlm").build("cpu")


def perturb(pipe, seed: int, scale: float = 1e-3) -> None:
    """Move every trainable weight by ``scale`` N(0, 1): a policy that is no longer the rollout's (or the reference)."""
    g = gen(seed)
    with torch.no_grad():
        for p in pipe.trainable_parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def gradients(pipe) -> dict[str, Tensor]:
    """The trainable weights' gradients by name (zeros where none arrived), then cleared."""
    out = {}
    for name, p in pipe.denoiser.named_parameters():
        if p.requires_grad:
            out[name] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            p.grad = None
    return out


def run_losses(losses, prefix: str, fields: Fields) -> None:
    """Backpropagate each LossOutput (as the trainer does) and keep its loss and metrics as fields."""
    for i, out in enumerate(losses):
        if out.loss.requires_grad:
            out.loss.backward()
        fields[f"{prefix}{i}/loss"] = out.loss.detach()
        for key, value in out.metrics.items():
            fields[f"{prefix}{i}/{key}"] = value.detach() if isinstance(value, Tensor) else value


# ---------------------------------------------------------------------------------------------------------------
# The quantities. rng/: torch's generator itself, so a change of the RNG is told apart from a change of the math
# ---------------------------------------------------------------------------------------------------------------


@quantity("rng/torch")
def _rng() -> Fields:
    g = gen(1234)
    return {
        "randn": torch.randn(64, generator=g),
        "rand_float64": torch.rand(16, generator=g, dtype=torch.float64),
        "randint": torch.randint(0, 1000, (16,), generator=g),
        "randperm": torch.randperm(16, generator=g),
    }


# -- samplers: one step from fixed (model output, state) at the first, a middle and the last step of the digits
#    models' 10-step grid, plus a per-sample sigma; the sampled next state and the log-prob of a fixed next state


def _step_fields(sampler, out: Tensor, x: Tensor, sigma, sigma_next, given: Tensor, seed: int, keep: tuple[str, ...]) -> Fields:
    sampled = sampler.step(out, x, sigma, sigma_next, generator=gen(seed))
    scored = sampler.step(out, x, sigma, sigma_next, x_next=given)
    fields = {
        "mean": sampled.mean,
        "std": sampled.std,
        "x_next": sampled.x_next,
        "log_prob": sampled.log_prob,
        "log_prob_of_given": scored.log_prob,
    }
    return {k: v for k, v in fields.items() if k in keep}


STEP_FIELDS = ("mean", "std", "x_next", "log_prob", "log_prob_of_given")


def _sampler_quantity(pipeline_name: str, build: Callable[[Any], Any], keep: tuple[str, ...] = STEP_FIELDS) -> Callable[[], Fields]:
    """``keep``: the fields that say something this sampler's other quantities do not (the file stays small)."""

    def compute_steps() -> Fields:
        pipe = _loaded_pipeline(pipeline_name)  # read only: its schedule (and prediction type) build the sampler
        sampler = build(pipe)
        grid = pipe.schedule.sigmas(10)
        out, x, given = randn(10), randn(11), randn(12)
        fields: Fields = {}
        for k in (0, 5, 9):  # from pure noise, mid-way, and into sigma = 0
            fields[f"step{k}"] = _step_fields(sampler, out, x, grid[k], grid[k + 1], given, 100 + k, keep)
        rows = torch.tensor([0, 3, 6, 8])  # one (sigma, sigma_next) per sample, as objectives pass them
        fields["per_sample"] = _step_fields(sampler, out, x, grid[rows], grid[rows + 1], given, 200, keep)
        return fields

    return compute_steps


def _register_samplers() -> None:
    from flowrl.samplers import DDIMConfig, FlowCPSConfig, FlowMemorylessConfig, FlowSDEConfig, ODEConfig
    from flowrl.samplers.ddim import DDIMSampler

    def v_prediction(eta: float):
        # digits_ddpm predicts epsilon; the v-prediction branch runs on its schedule
        return lambda pipe: DDIMSampler(pipe.schedule, "v_prediction", eta=eta, clip_sample=None, reduction="mean")

    log_probs = ("log_prob", "log_prob_of_given")  # a variant that changes only the log-prob
    ode = ("mean", "std")  # deterministic: x_next is the mean, and there is no log-prob
    flows = {
        "flow_sde/flow_grpo": (FlowSDEConfig(noise_level=0.7, diffusion="flow_grpo"), STEP_FIELDS),
        "flow_sde/flow_grpo_sum": (FlowSDEConfig(noise_level=0.7, diffusion="flow_grpo", reduction="sum"), log_probs),
        "flow_sde/dance_grpo": (FlowSDEConfig(noise_level=0.3, diffusion="dance_grpo"), STEP_FIELDS),
        "flow_cps": (FlowCPSConfig(noise_level=0.7), STEP_FIELDS),
        "flow_memoryless": (FlowMemorylessConfig(), STEP_FIELDS),
        "ode/flow": (ODEConfig(), ode),
    }
    for name, (section, keep) in flows.items():
        quantity(f"sampler/{name}")(_sampler_quantity("digits_flow", section.build, keep))
    ddpm = {
        "ddim/eta1_epsilon": (DDIMConfig(eta=1.0).build, STEP_FIELDS),
        "ddim/eta0.5_epsilon_clipped": (DDIMConfig(eta=0.5, clip_sample=1.0).build, STEP_FIELDS),
        "ddim/eta1_v_prediction": (v_prediction(1.0), STEP_FIELDS),
        "ode/ddim": (ODEConfig().build, ode),
    }
    for name, (build, keep) in ddpm.items():
        quantity(f"sampler/{name}")(_sampler_quantity("digits_ddpm", build, keep))


_register_samplers()


# -- the masked-diffusion (LLaDA-style) sampler on the embedded arith_mdlm: greedy, Gumbel tokens, random positions
#    (the uniform choice), Plackett-Luce positions from DCoLT's head, dynamic threshold decoding

ARITH_PROMPTS = [
    "dan has 2 books . he buys 9 more . then he gives away 8 . how many books now ?",
    "eve has 10 pens . she buys 5 more . then she gives away 10 . how many pens now ?",
    "what is 7 + 5 ?",
]


def _masked_quantity(**options: Any) -> Callable[[], Fields]:
    def generate_one() -> Fields:
        from flowrl.objectives.dllm.policy import UnmaskingPolicyHead
        from flowrl.samplers.masked import generate
        from flowrl.samplers.text_generation import encode_prompts

        lm = arith_lm()
        ids, mask = encode_prompts(lm, ARITH_PROMPTS, 24)
        kwargs = dict(options)
        if kwargs.get("remasking") == "policy":
            torch.manual_seed(5)  # the head's initialisation (the global RNG is private to this quantity)
            head = UnmaskingPolicyHead(confidence_prior=1.0)
            kwargs["position_scorer"] = lambda logits, state: head(state, logits, mask_token_id=lm.mask_token_id)
        traj = generate(lm, ids, mask, gen_length=16, steps=8, block_length=8, generator=gen(7), **kwargs)
        return {
            "completion_ids": traj.completion_ids,
            "unmask_step": traj.unmask_step,
            "unmask_rank": traj.unmask_rank,
            "token_log_probs": traj.token_log_probs,
        }

    return generate_one


for _name, _options in {
    "low_confidence_greedy": {"temperature": 0.0, "remasking": "low_confidence"},
    "low_confidence_t1": {"temperature": 1.0, "remasking": "low_confidence"},
    "random_t1": {"temperature": 1.0, "remasking": "random"},
    "policy_t1": {"temperature": 1.0, "remasking": "policy"},
    "threshold_0.5_greedy": {"temperature": 0.0, "remasking": "low_confidence", "threshold": 0.5},
}.items():
    quantity(f"sampler/masked/{_name}")(_masked_quantity(**_options))


# -- the models themselves: a change here moves every quantity that calls them


@quantity("model/digits_flow")
def _digits_flow_model() -> Fields:
    pipe = _loaded_pipeline("digits_flow")
    with torch.no_grad():
        cond = pipe.encode(DIGIT_PROMPTS)
        x = randn(20)
        return {
            "predict_sigma0.5": pipe.predict(x, torch.tensor(0.5), cond, 1.0),
            "predict_sigma0.9_cfg4.5": pipe.predict(x, torch.tensor(0.9), cond, 4.5),
            "decode": pipe.decode(x),
        }


@quantity("model/digits_ddpm")
def _digits_ddpm_model() -> Fields:
    pipe = _loaded_pipeline("digits_ddpm")
    with torch.no_grad():
        cond = pipe.encode(DIGIT_PROMPTS)
        return {"predict_sigma0.5": pipe.predict(randn(21), torch.tensor(0.5), cond, 1.0)}


@quantity("model/arith_mdlm")
def _arith_model() -> Fields:
    from flowrl.samplers.text_generation import encode_prompts

    lm = arith_lm()
    ids, mask = encode_prompts(lm, ARITH_PROMPTS, 24)
    full = torch.cat([ids, torch.full((3, 16), lm.mask_token_id, dtype=ids.dtype)], dim=1)
    attention = torch.cat([mask, torch.ones(3, 16, dtype=torch.bool)], dim=1)
    return {"prompt_ids": ids, "logits_first_4_masked": lm.logits(full, attention_mask=attention)[:, -16:-12]}


@quantity("reward/digits")
def _digit_rewards() -> Fields:
    from flowrl.reward_models.mix import RewardConfig, build_reward_from_config

    reward = build_reward_from_config(RewardConfig(components={"ink": 1.0, "digit_classifier": 1.0, "digit_realism": 1.0}))
    pipe = _loaded_pipeline("digits_flow")
    with torch.no_grad():
        samples = pipe.decode(randn(22))
        out = reward(samples, DIGIT_PROMPTS, DIGIT_METADATA)
    return {"scores": out.scores, **{f"extras/{k}": v for k, v in out.extras.items() if isinstance(v, Tensor)}}


# -- the objectives' losses on the embedded digits_flow model: rollouts by flowrl's own loop, fixed rewards,
#    weights moved off the rollout / reference policy, each loss backpropagated; losses, metrics and gradients


def _rollout(pipe, sampler, steps: int, seed: int):
    from flowrl.samplers.rollout import rollout

    return rollout(
        pipe,
        sampler,
        DIGIT_PROMPTS,
        DIGIT_METADATA,
        GROUPS,
        pipe.schedule.sigmas(steps),
        gen(seed),
        same_noise_in_group=False,
        decode=False,
    )


@quantity("objective/grpo")
def _grpo() -> Fields:
    from flowrl.objectives.grpo import GRPOConfig
    from flowrl.samplers import FlowSDEConfig

    pipe = pipeline("digits_flow")
    sampler = FlowSDEConfig(noise_level=0.7).build(pipe)
    objective = GRPOConfig(std="unbiased", clip_range=1e-3, beta=0.01, timestep_fraction=0.5).build()
    pipe.enable_reference()  # beta > 0: the KL term to the initial model is frozen too
    batch = _rollout(pipe, sampler, steps=4, seed=30)
    batch.rewards = REWARDS.clone()
    batch = objective.prepare(batch)
    perturb(pipe, seed=31)
    fields: Fields = {"rollout/log_probs": batch.log_probs, "advantages": batch.advantages}
    run_losses(objective.losses(pipe, sampler, batch, gen(32)), "step", fields)
    fields["grad@tensors"] = gradients(pipe)
    return fields


@quantity("objective/diffusion_dpo")
def _diffusion_dpo() -> Fields:
    from flowrl.objectives.diffusion_dpo import DiffusionDPOConfig
    from flowrl.types import Trajectory

    pipe = pipeline("digits_flow")
    objective = DiffusionDPOConfig(beta=500.0).build()  # the digits preset's beta
    pipe.enable_reference()
    x0 = torch.rand((4, 1, 1, 8, 8), generator=gen(40)) * 2 - 1  # rows (winner, loser, winner, loser)
    with torch.no_grad():
        cond = pipe.encode(DIGIT_PROMPTS)
    batch = Trajectory(
        latents=x0,
        sigmas=torch.tensor([0.0]),
        log_probs=torch.zeros(4, 0),
        stochastic=torch.zeros(0, dtype=torch.bool),
        cond=cond,
        prompts=list(DIGIT_PROMPTS),
        metadata=[dict(m) for m in DIGIT_METADATA],
        group_ids=torch.tensor([0, 0, 1, 1]),
    )
    perturb(pipe, seed=41)
    fields: Fields = {}
    run_losses(objective.losses(pipe, None, objective.prepare(batch), gen(42)), "pass", fields)
    fields["grad@tensors"] = gradients(pipe)
    return fields


@quantity("objective/diffusion_nft")
def _diffusion_nft() -> Fields:
    from flowrl.objectives.diffusion_nft import DiffusionNFTConfig
    from flowrl.samplers import ODEConfig

    pipe = pipeline("digits_flow")
    sampler = ODEConfig().build(pipe)
    objective = DiffusionNFTConfig(beta=0.1, timestep_fraction=0.6).build()  # the digits preset's knobs
    batch = _rollout(pipe, sampler, steps=4, seed=50)
    batch.rewards = REWARDS.clone()
    batch = objective.prepare(batch)
    fields: Fields = {"r": batch.advantages}
    # first minibatch: the old policy is the current one; then the weights move (as after an optimizer step) and the
    # second minibatch trains against the old policy kept from the first
    run_losses(objective.losses(pipe, sampler, batch, gen(51)), "first/time", fields)
    gradients(pipe)
    perturb(pipe, seed=52)
    run_losses(objective.losses(pipe, sampler, batch, gen(53)), "second/time", fields)
    fields["grad@tensors"] = gradients(pipe)
    return fields


@quantity("objective/adjoint_matching")
def _adjoint_matching() -> Fields:
    from flowrl.objectives.adjoint_matching import AdjointMatchingConfig
    from flowrl.samplers import FlowMemorylessConfig

    pipe = pipeline("digits_flow")
    sampler = FlowMemorylessConfig().build(pipe)
    objective = AdjointMatchingConfig(reward_multiplier=300.0, num_trained_steps=4).build()  # the digits preset's
    pipe.enable_reference()
    batch = _rollout(pipe, sampler, steps=6, seed=60)
    batch.rewards = REWARDS.clone()
    batch.reward_grads = 0.01 * randn(61)  # a fixed reward gradient: the adjoint pass is frozen apart from the reward
    batch = objective.prepare(batch)
    perturb(pipe, seed=62)
    fields: Fields = {}
    run_losses(objective.losses(pipe, sampler, batch, gen(63)), "first/step", fields)
    fields["grad@tensors"] = gradients(pipe)
    # the second minibatch is clipped at the EMA of the first one's quantile
    with torch.no_grad():
        run_losses(objective.losses(pipe, sampler, batch, gen(64)), "second/step", fields)
    fields["state"] = {k: v for k, v in objective.state_dict().items()}
    return fields


# -- the digits GRPO preset's first two iterations with the real Trainer and tests/conftest.py's fast settings


@quantity("preset/digits_grpo")
def _digits_grpo_preset() -> Fields:
    if str(REPO / "tests") not in sys.path:  # for the script; the test process already has it
        sys.path.insert(0, str(REPO / "tests"))
    from accelerate.state import AcceleratorState
    from conftest import CONFIGS, fast_overrides

    from flowrl.trainer import Trainer

    AcceleratorState._reset_state(True)  # a trainer built earlier in this process (another test) leaves its state
    fields: Fields = {}
    with tempfile.TemporaryDirectory() as run:
        trainer = Trainer(CONFIGS / "digits" / "grpo.yaml", fast_overrides(Path(run), **{"train.num_threads": THREADS}))
        for iteration in range(2):
            metrics = trainer.train_iteration(iteration)
            fields[f"iteration{iteration}"] = {k: v for k, v in sorted(metrics.items()) if not k.startswith("perf/")}
        fields["weights@tensors"] = trainer.pipeline.trainable_state_dict()
    return fields


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------


def record(names: list[str]) -> dict[str, Any]:
    goldens = load_goldens()
    quantities = goldens.get("quantities", {}) if names != list(QUANTITIES) else {}
    for name in names:
        print(f"recording {name}", file=sys.stderr)
        quantities[name] = {key: encode(value) for key, value in compute(name).items()}
    quantities = {name: quantities[name] for name in QUANTITIES if name in quantities}  # the definitions' order
    return {"format": FORMAT, "environment": environment(), "record_command": RECORD_COMMAND, "quantities": quantities}


def check(names: list[str]) -> int:
    goldens = load_goldens()
    moved = 0
    for name in names:
        golden = goldens["quantities"].get(name)
        if golden is None:
            print(f"{name}: not recorded")
            moved += 1
            continue
        lines = compare(golden, {key: encode(value) for key, value in compute(name).items()})
        if lines:
            moved += 1
            print(failure_message(name, lines, goldens["environment"]))
        else:
            print(f"{name}: same bits")
    print(f"{moved} of {len(names)} quantities moved at {THREADS} thread(s)")
    return 1 if moved else 0


def dumps(data: dict[str, Any]) -> str:
    """JSON with one line per field, so that a re-recording's diff shows which fields moved."""
    quantities = data["quantities"]
    head = {k: v for k, v in data.items() if k != "quantities"}
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + [' "quantities": {']
    for i, (name, fields) in enumerate(quantities.items()):
        lines.append(f"  {json.dumps(name)}: {{")
        lines += [f"   {json.dumps(k)}: {json.dumps(v)}" + ("," if j < len(fields) - 1 else "") for j, (k, v) in enumerate(fields.items())]
        lines.append("  }" + ("," if i < len(quantities) - 1 else ""))
    return "\n".join(lines + [" }", "}"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    global THREADS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="quantities (names or prefixes); default: all")
    parser.add_argument("--check", action="store_true", help="compare with the goldens instead of recording")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads to compute with (default 1)")
    parser.add_argument("--list", action="store_true", help="list the quantities")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(QUANTITIES))
        return 0
    THREADS = args.threads
    names = selected(args.names) if args.names else list(QUANTITIES)
    if args.check:
        return check(names)
    if THREADS != 1:
        raise SystemExit("goldens are recorded at one thread (the test computes at one); use --threads with --check")
    data = record(names)
    GOLDENS.parent.mkdir(parents=True, exist_ok=True)
    GOLDENS.write_text(dumps(data))
    print(f"wrote {GOLDENS.relative_to(REPO)} ({GOLDENS.stat().st_size // 1024} KiB, {len(data['quantities'])} quantities)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
