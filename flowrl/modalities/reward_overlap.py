"""Where a modality's collect hands each finished rollout chunk: decoded at once (the default), or, with
``rollout.overlap_reward: true``, decoded and scored on a worker thread while the next chunk is generated.

The worker is one ``concurrent.futures`` thread: torch releases the GIL inside its kernels and a remote reward
releases it while it waits on HTTP, so the reward's work runs beside the rollout's. The chunks' results are joined
in the order the chunks were made, so the batch is the one a serial run builds; the rewards are the same bits as
long as the reward scores a row the same whatever batch it is in (docs/rewards.md "Overlapping the reward with the
rollout": true of the digits rewards in chunks of 4 or more samples, not quite of the CLIP-family ones).

What the loop paid and what it hid are timed here (``perf()``, logged as ``perf/*``):

- ``perf/decode_s``: the decoding of the final states into samples (the VAE of a latent model), wherever it ran;
- ``perf/score_s`` (overlapped): the reward's own time on the worker (serial: the loop's score phase, as always);
- ``perf/reward_hidden_s``: decode and reward time spent while the rollout was still generating, i.e. hidden.

The loop itself adds ``perf/reward_wait_s``: the time it blocked on the reward after the rollout.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..types import Reward, RewardOutput

# Below this many rows a chunk's reward may round differently from the whole batch's: measured on an x86 CPU, the
# digits classifier scores a row bit-identically in any batch of 4 or more rows, but not in batches of 1 to 3
SMALL_CHUNK = 4


def cat_reward_outputs(outputs: Sequence[RewardOutput]) -> RewardOutput:
    """The chunks' reward outputs as one, rows in chunk order (scores and every extra)."""
    first = outputs[0]
    return RewardOutput(
        scores=torch.cat([o.scores for o in outputs]),
        extras={key: torch.cat([o.extras[key] for o in outputs]) for key in first.extras},
    )


class RolloutScoring:
    """One iteration's hand-over of rollout chunks. ``overlap=False``: ``chunk`` decodes at once (timed) and returns
    the samples; the loop scores the whole batch afterwards, as it always has. ``overlap=True``: ``chunk`` queues
    decode + reward on the worker and returns None; ``join`` waits for them and returns the samples and rewards."""

    def __init__(self, reward: Reward, overlap: bool):
        self.reward, self.overlap = reward, overlap
        self.chunks = 0
        self.decode_s = self.score_s = self.hidden_s = 0.0
        self._futures: list[Future] = []
        self._warned = False
        self._generated_at: float | None = None  # when the rollout's last chunk was handed over
        # one worker: chunks are scored one after another, in order, so a reward never runs twice at once
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowrl-reward") if overlap else None

    def chunk(self, decode: Callable[[], Any], prompts: Sequence[str], metadata: Sequence[dict]) -> Any | None:
        """A finished chunk: ``decode()`` makes its samples (a callable, so the overlapped path runs it on the worker)."""
        self.chunks += 1
        if not self.overlap:
            start = time.perf_counter()
            samples = decode()
            self.decode_s += time.perf_counter() - start
            return samples
        self._raise_failed()  # a reward that failed on an earlier chunk stops the rollout now, not after it
        if len(prompts) < SMALL_CHUNK and not self._warned:
            self._warned = True
            warnings.warn(
                f"rollout.overlap_reward scores each rollout chunk by itself, and this one holds {len(prompts)} sample(s): a "
                "matrix product of so few rows may take another CPU kernel than the whole batch's and round differently; "
                f"a rollout.batch_size that leaves no chunk under {SMALL_CHUNK} samples keeps the rewards bit-identical to the "
                "serial loop's.",
                stacklevel=2,
            )
        self._futures.append(self._executor.submit(self._decode_and_score, decode, list(prompts), [dict(m) for m in metadata]))
        return None

    @property
    def scored_on_worker(self) -> bool:
        """Whether collect handed chunks to the worker to be scored: then the modality's score joins them."""
        return self.overlap and self.chunks > 0

    def generated(self) -> None:
        """The rollout has made its last chunk: reward work after this moment is waited for, not hidden."""
        self._generated_at = time.perf_counter()

    def join(self) -> tuple[list[Any], RewardOutput]:
        """The chunks' samples and their rewards joined in chunk order (overlapped only); a chunk's error is raised."""
        if self._generated_at is None:
            self.generated()
        results = [f.result() for f in self._futures]
        self.close()
        for _, _, (start, decoded, scored) in results:
            self.decode_s += decoded - start
            self.score_s += scored - decoded
            self.hidden_s += max(0.0, min(scored, self._generated_at) - start)
        return [r[0] for r in results], cat_reward_outputs([r[1] for r in results])

    def perf(self) -> dict[str, float]:
        """This iteration's ``perf/*`` of the hand-over (nothing when no chunk came through it: offline pairs, text)."""
        if not self.chunks:
            return {}
        out = {"perf/decode_s": self.decode_s}
        if self.overlap:
            out.update({"perf/score_s": self.score_s, "perf/reward_hidden_s": self.hidden_s})
        return out

    def close(self) -> None:
        """Stop the worker; chunks not started yet are dropped (after an error, or a stop mid-rollout)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def _raise_failed(self) -> None:
        for future in self._futures:
            if future.done() and future.exception() is not None:
                self.close()
                raise future.exception()

    def _decode_and_score(self, decode: Callable[[], Any], prompts: list[str], metadata: list[dict]):
        start = time.perf_counter()
        with torch.no_grad():  # grad mode is per thread: the worker sets its own
            samples = decode()
            decoded = time.perf_counter()
            out = self.reward(samples, prompts, metadata)
        return samples, out, (start, decoded, time.perf_counter())
