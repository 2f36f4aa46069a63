"""Fault injection points for tests and ``scripts/fault_sweep.py``; inert unless an environment variable asks.

A run calls :func:`reached` at each boundary of an iteration and before each file of a checkpoint:

- ``FLOWRL_TEST_KILL_AT=<point>@<step>``: the process SIGKILLs itself there, as a kill -9 (or the OOM killer) from
  outside would;
- ``FLOWRL_TEST_STOP_AT=<point>@<step>``: it SIGSTOPs itself there (once), so that the process watching it can change
  the world at that exact moment (fill the disk, make the run directory read-only, kill the reward server) and then
  let it go on with SIGCONT. The fault it then meets is the real one: the kernel's ENOSPC or EROFS at the real write.

``<step>`` is the iteration the point belongs to, 1-based as in ``metrics.jsonl`` and the checkpoint names
(``evaluate@0`` is the evaluation before training); ``<point>`` alone matches at any step. The points, in the order
a run reaches them:

========================  ===========================================================================================
``collect``               iteration ``step``'s rollouts (flowrl/trainer.py ``train_iteration``)
``score``                 its rewards
``advantages``            the objective's ``prepare()``
``update``                the optimizer steps
``evaluate``              the held-out evaluation and its sample grids (``samples/step_N.png``, ``samples_*.png``)
``log``                   the metrics line (``metrics.jsonl``) and the trackers
``checkpoint``            the checkpoint write (``save``), before anything of it is written
``checkpoint:<file>``     inside it, before ``<file>`` is written into the hidden temporary directory:
                          ``denoiser.safetensors``, ``optimizer.safetensors``, ``config.yaml``, ``trainer_state.json``;
                          ``checkpoint:rename`` once they are all written (before the fsync and the rename into place),
                          ``checkpoint:latest`` before the ``latest`` pointer
``plots``                 ``reward_curve.png`` (after an evaluation); ``plots:instruments.png`` before ``instruments.png``
``finish``                the end: the trackers' last flush and ``reward_curve.png``; ``finish:summary.json`` before
                          ``summary.json``, the run's last write
========================  ===========================================================================================

A point called without a step takes the step of the last point reached (``finish``: the run's last iteration).
"""

from __future__ import annotations

import os
import signal

KILL_ENV = "FLOWRL_TEST_KILL_AT"
STOP_ENV = "FLOWRL_TEST_STOP_AT"

_step: int | None = None
_stopped: set[str] = set()  # STOP fires once per process: a point reached again (a retried write) runs on


def _matches(spec: str, point: str, step: int | None) -> bool:
    name, _, at = spec.partition("@")
    return name == point and (not at or (step is not None and int(at) == step))


def reached(point: str, step: int | None = None) -> None:
    """The run reached ``point`` of iteration ``step``: kill or stop this process there if the environment asks."""
    global _step
    if step is not None:
        _step = step
    kill, stop = os.environ.get(KILL_ENV), os.environ.get(STOP_ENV)
    if kill and _matches(kill, point, _step):
        os.kill(os.getpid(), signal.SIGKILL)
    if stop and stop not in _stopped and _matches(stop, point, _step):
        _stopped.add(stop)
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once the watcher sends SIGCONT
