"""Deterministic mode (``train.deterministic: true``): the settings that make a run bit-reproducible on a GPU too.

flowrl is already deterministic run to run on a CPU: every random draw comes from a stream keyed by (seed,
iteration, purpose, row) (seeding.py), and its own reductions run in a fixed order (gathered metrics and
samples are sorted by their global index, losses are summed minibatch by minibatch in order). On a GPU some
kernels are not: atomic-add reductions (index_add, scatter_add, embedding and attention backward),
cuBLAS's split-K workspace reuse, cuDNN's benchmarked algorithm choice. Deterministic mode turns those off:

* ``torch.use_deterministic_algorithms(True)``: deterministic implementations, and an error naming the op
  where none exists (strict, not warn-only: a warning would let the bits drift silently). Under it PyTorch's
  scaled_dot_product_attention keeps to its deterministic flash / memory-efficient backward and excludes cuDNN
  attention;
* ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: cuBLAS gets a fixed workspace, which it needs to be deterministic
  (set before the first CUDA context; an earlier value from the environment is kept);
* ``torch.backends.cudnn.deterministic = True`` and ``benchmark = False``: the same convolution algorithm
  every run;
* ``FLASH_ATTENTION_DETERMINISTIC=1``: read by the flash-attn package, when a model uses it.

Cost: nothing measurable on a CPU; on a GPU the deterministic backward kernels are slower (see
docs/reproducibility.md for what was measured). Bits still depend on the GPU model, the library versions and
the number of processes (NCCL's reduction tree), which the evaluation spec records.
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"


def enable_deterministic_mode() -> dict[str, str | bool]:
    """Apply every setting above to this process (idempotent) and return them, as recorded in the run."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    os.environ.setdefault("FLASH_ATTENTION_DETERMINISTIC", "1")
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return {
        "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"],
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }
