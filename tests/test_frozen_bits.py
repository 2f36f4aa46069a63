"""Frozen bits (issue #31 item 4): every quantity of scripts/record_goldens.py, recomputed and compared bit for bit
with tests/goldens/frozen_bits.json. One test per quantity, so a dependency upgrade that moves numbers lists every
quantity it moved, each with how far; docs/frozen_bits.md says how to judge that and re-record on purpose."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from conftest import REPO

SCRIPT = REPO / "scripts" / "record_goldens.py"


def _load_script():
    """The script is the one definition of the quantities and of the comparison; it is imported, not copied."""
    if "record_goldens" not in sys.modules:
        spec = importlib.util.spec_from_file_location("record_goldens", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["record_goldens"] = module
        spec.loader.exec_module(module)
    return sys.modules["record_goldens"]


goldens_script = _load_script()
GOLDENS = goldens_script.load_goldens()


@pytest.fixture(scope="module")
def goldens():
    recorded = {k: GOLDENS["environment"].get(k) for k in goldens_script.platform_key()}
    here = goldens_script.platform_key()
    if GOLDENS["environment"] and recorded != here:
        # Bits are a property of the platform: other vector kernels (AVX2 / AVX-512 / NEON) may round differently, and
        # there are no goldens for another one to hold it to (docs/frozen_bits.md).
        pytest.skip(f"goldens recorded on {recorded}, this is {here}; record this platform's with {goldens_script.RECORD_COMMAND}")
    return GOLDENS


@pytest.mark.parametrize("name", list(goldens_script.QUANTITIES))
def test_bits_are_unchanged(name, goldens):
    golden = goldens["quantities"].get(name)
    assert golden is not None, f"quantity '{name}' has no golden; record it on purpose: {goldens_script.RECORD_COMMAND} {name}"
    actual = {key: goldens_script.encode(value) for key, value in goldens_script.compute(name).items()}
    moved = goldens_script.compare(golden, actual)
    assert not moved, goldens_script.failure_message(name, moved, goldens["environment"])


def test_no_golden_without_a_quantity():
    stale = sorted(set(GOLDENS["quantities"]) - set(goldens_script.QUANTITIES))
    assert not stale, f"goldens of quantities no longer defined: {stale}; re-record: {goldens_script.RECORD_COMMAND}"


def test_a_moved_bit_is_reported_with_its_size():
    """The comparison itself: one float32 ulp in one element of a tensor, and a float scalar, are found and sized."""
    import torch

    base = torch.linspace(-1, 1, 256).reshape(4, 1, 8, 8)
    moved = base.clone()
    moved[1, 0, 2, 3] = torch.nextafter(moved[1, 0, 2, 3], torch.tensor(2.0))
    tensor_lines = goldens_script.compare({"x": goldens_script.encode(base)}, {"x": goldens_script.encode(moved)})
    assert (
        len(tensor_lines) == 1
        and tensor_lines[0].startswith("x: 1 of 256 elements moved")
        and "(up to 1 ulp); first at [1, 0, 2, 3]" in tensor_lines[0]
    )
    scalar_lines = goldens_script.compare({"loss": goldens_script.encode(0.25)}, {"loss": goldens_script.encode(0.25 + 2**-20)})
    assert scalar_lines == ["loss: recorded 0.25, now 0.250000954 (abs diff 9.54e-07, rel diff 3.81e-06, 32 float32 ulp)"]
    big, big_moved = torch.zeros(10_000), torch.zeros(10_000)
    big_moved[-1] = 1.0  # the last element is always probed
    line = goldens_script.compare({"w": goldens_script.encode(big)}, {"w": goldens_script.encode(big_moved)})[0]
    assert "sha256 of the 10000 elements differs" in line and "1 of 64 probed elements moved" in line and "sum recorded 0, now 1" in line
    assert goldens_script.compare({"x": goldens_script.encode(base)}, {"x": goldens_script.encode(base.clone())}) == []
