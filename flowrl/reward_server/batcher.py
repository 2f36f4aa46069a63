"""Dynamic batching: one worker thread owns the reward model and merges requests from every client.

Requests (``_Job``) are queued by the HTTP side. The worker takes the oldest one and, with ``coalesce``,
gathers every queued or arriving job with the same sample shape until the batch holds ``max_batch``
samples or the oldest job has waited ``max_wait_s`` since it was queued; then it calls the reward once on
the concatenated batch and splits the scores back. The wait is bounded from each job's arrival, so a job
that already queued behind a busy model is scored with whatever else is waiting, without a further wait.
One model call at a time: the model is never run concurrently (one GPU, many trainer processes).
"""

from __future__ import annotations

import collections
import queue
import threading
import time

import torch

from flowrl.reward_models.wire import _Job, encode_list

_STOP = object()


class Batcher:
    """The scoring thread. ``submit`` raises queue.Full when ``max_queue`` jobs are already waiting."""

    def __init__(self, reward, device: str, max_batch: int, coalesce: bool, max_wait_s: float, max_queue: int) -> None:
        self.reward = reward
        self.device = device
        self.max_batch = max_batch
        self.coalesce = coalesce
        self.max_wait_s = max_wait_s
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)
        # Counters read by GET /health (ints: a torn read is impossible under the GIL).
        self.requests = 0  # jobs scored (or failed)
        self.batches = 0  # reward calls
        self.samples = 0  # samples scored
        self._thread = threading.Thread(target=self._run, name="flowrl-reward-batcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.queue.put(_STOP)
            self._thread.join(timeout=30)

    def submit(self, job: _Job) -> None:
        job.arrived = time.monotonic()
        self.queue.put_nowait(job)

    # ------------------------------------------------------------------ gathering
    def _run(self) -> None:
        waiting: collections.deque = collections.deque()  # taken from the queue but left for a later batch, oldest first
        while True:
            first = waiting.popleft() if waiting else self.queue.get()
            if first is _STOP:
                return
            group = [first]
            if self.coalesce:
                waiting = self._gather(group, waiting)
            self._score_group(group)

    def _gather(self, group: list[_Job], waiting: collections.deque) -> collections.deque:
        """Add jobs of ``group[0]``'s shape to ``group``, in arrival order, until the next one would overflow
        ``max_batch`` or the first job's wait is up; return the jobs left for later batches."""
        first, total = group[0], len(group[0])
        left_over: collections.deque = collections.deque()
        full = False

        def take(job) -> None:
            nonlocal total, full
            if full or job is _STOP or job.samples.shape[1:] != first.samples.shape[1:]:
                left_over.append(job)  # another shape: its own batch later; never merged across shapes
            elif total + len(job) > self.max_batch:
                full = True  # as full as arrival order allows: score now, this job opens the next batch
                left_over.append(job)
            else:
                group.append(job)
                total += len(job)

        for job in waiting:
            take(job)
        deadline = first.arrived + self.max_wait_s
        while not full and total < self.max_batch and _STOP not in left_over:
            wait = deadline - time.monotonic()
            try:
                take(self.queue.get(timeout=wait) if wait > 0 else self.queue.get_nowait())
            except queue.Empty:
                break
        return left_over

    # ------------------------------------------------------------------ scoring
    def _score_group(self, group: list[_Job]) -> None:
        try:
            if len(group) == 1:
                self._score(group)
            else:
                try:
                    self._score(group)
                except Exception:  # noqa: BLE001 - retry alone, so only the bad request fails
                    for job in group:
                        try:
                            self._score([job])
                        except Exception as e:  # noqa: BLE001
                            job.error = e
        except Exception as e:  # noqa: BLE001 - reported to the client as 400 or 500
            for job in group:
                job.error = e
        finally:
            self.requests += len(group)
            for job in group:
                job.done.set()
                if job.on_done is not None:
                    job.on_done()

    def _score(self, group: list[_Job]) -> None:
        self.batches += 1
        samples = torch.cat([j.samples for j in group]) if len(group) > 1 else group[0].samples
        prompts = [p for j in group for p in j.prompts]
        metadata = [m for j in group for m in j.metadata]
        with torch.no_grad():
            out = self.reward(samples.to(self.device), prompts, metadata)
        n = samples.shape[0]
        if out.scores.numel() != n:
            raise RuntimeError(f"the reward returned {out.scores.numel()} scores for {n} samples")
        self.samples += n
        scores = out.scores.reshape(-1)
        extras = {k: v.reshape(-1) for k, v in out.extras.items() if v.numel() == n}
        start = 0
        for job in group:
            end = start + len(job)
            job.result = (
                encode_list(scores[start:end]),
                {k: encode_list(v[start:end]) for k, v in extras.items()},
            )
            start = end
