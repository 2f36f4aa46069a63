"""Dynamic batching across clients, the health endpoint and several replicas, over real loopback HTTP.

In-process servers (``RewardServer``: the Starlette app on uvicorn, on 127.0.0.1) serve the embedded
digit classifier and ink rewards; the clients are the real ``RemoteReward`` on threads, as several trainer
processes would be. Every number is compared with the in-process reward; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from test_reward_server import COMPONENTS, REPO, TOKEN, assert_same, digits, raw, write_config

from flowrl.config import RewardConfig
from flowrl.errors import FlowRLError
from flowrl.reward_models import build_reward_from_config
from flowrl.reward_models.remote import RemoteReward, RewardServerError
from flowrl.reward_server import RewardServer, ServerConfig
from flowrl.types import RewardOutput

pytestmark = pytest.mark.usefixtures("one_thread")


class Recorded:
    """The real reward, recording the batch size of every call the server makes to it."""

    def __init__(self, components: dict[str, float] = COMPONENTS) -> None:
        self.reward = build_reward_from_config(RewardConfig(components=components))
        self.components, self.name, self.differentiable = self.reward.components, "recorded", False
        self.calls: list[int] = []

    def __call__(self, samples, prompts, metadata) -> RewardOutput:
        self.calls.append(samples.shape[0])
        return self.reward(samples, prompts, metadata)


@pytest.fixture(scope="module")
def reference():
    return build_reward_from_config(RewardConfig(components=COMPONENTS))


def serve(reward=None, **config) -> RewardServer:
    settings = dict(reward=RewardConfig(components=COMPONENTS), device="cpu", max_batch=64) | config
    return RewardServer(ServerConfig(**settings), TOKEN, reward=reward)  # start() or a with block serves


def health(server: RewardServer) -> dict:
    status, _, body = raw(server.url, "GET", "/health")  # no token: health is public
    assert status == 200
    return body


def run_clients(url, batches, delays=None, **client) -> tuple[list, list[float]]:
    """Score ``batches`` from one thread each (thread i starts ``delays[i]`` s after a common start);
    returns each thread's RewardOutput (or exception) and its latency."""
    results: list = [None] * len(batches)
    latency = [0.0] * len(batches)
    start = threading.Barrier(len(batches))

    def one(i: int) -> None:
        reward = RemoteReward(url, token=TOKEN, timeout=20, **client)
        start.wait(timeout=20)
        time.sleep(delays[i] if delays else 0)
        t0 = time.monotonic()
        try:
            results[i] = reward(*batches[i])
        except BaseException as e:  # noqa: BLE001 - checked by the caller
            results[i] = e
        latency[i] = time.monotonic() - t0

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results, latency


# ----------------------------------------------------------------------------------------- batching


def test_concurrent_clients_are_merged_into_one_model_call(reference):
    # max_batch is exactly the four requests' samples: the batch is full when the last arrives and goes
    # at once, long before the 20 s window.
    sizes = (2, 3, 4, 5)
    reward = Recorded()
    with serve(reward, max_batch=sum(sizes), max_wait_ms=20_000) as server:
        batches = [digits(n) for n in sizes]
        start = time.monotonic()
        results, _ = run_clients(server.url, batches)
        elapsed = time.monotonic() - start
        stats = health(server)
    assert reward.calls == [sum(sizes)], reward.calls
    assert elapsed < 10
    for out, batch in zip(results, batches):  # each client gets exactly its own rewards, as in process
        assert isinstance(out, RewardOutput), out
        assert out.scores.shape == (len(batch[1]),)
        assert_same(out, reference(*batch))
    assert (stats["requests"], stats["batches"], stats["samples"]) == (4, 1, sum(sizes))


def test_the_wait_for_company_is_bounded_from_the_first_arrival(reference):
    # A at 0 s, B at 0.3 s: merged into one call that starts when A has waited max_wait (1.2 s), whatever
    # B's arrival; C alone after that waits the window once more and no longer.
    reward = Recorded()
    with serve(reward, max_wait_ms=1200) as server:
        batches = [digits(3), digits(4)]
        results, latency = run_clients(server.url, batches, delays=[0.0, 0.3])
        lone, lone_latency = run_clients(server.url, [digits(5)])
        no_wait = serve(Recorded(), max_wait_ms=0)
        with no_wait:
            quick, quick_latency = run_clients(no_wait.url, [digits(5)])
    assert reward.calls == [7, 5], reward.calls
    assert 1.2 <= latency[0] < 1.2 + 1.0, latency  # bounded: the window, plus one tiny model call
    assert 0.5 <= latency[1] < latency[0], latency  # B joined A's batch: it waited only A's remaining time (~0.9 s)
    assert 1.2 <= lone_latency[0] < 1.2 + 1.0, lone_latency
    assert quick_latency[0] < 1.0, quick_latency  # max_wait_ms 0: no wait at all
    for out, batch in zip(results + lone + quick, batches + [digits(5), digits(5)]):
        assert_same(out, reference(*batch))


def test_requests_of_different_shapes_are_never_merged():
    reward = Recorded({"ink": 1.0})
    small = (torch.rand(3, 1, 8, 8), ["a"] * 3, [{}] * 3)
    other = (torch.rand(2, 3, 8, 8), ["b"] * 2, [{}] * 2)  # 3 channels: ink scores it, the shape differs
    with serve(reward, max_wait_ms=800) as server:
        results, _ = run_clients(server.url, [small, other, small])
    assert sorted(reward.calls) == [2, 6], reward.calls
    for out, batch in zip(results, [small, other, small]):
        assert_same(out, reward.reward(*batch))


def test_health_answers_without_a_token_and_reports_the_batching():
    with serve(Recorded(), max_wait_ms=7.5, max_batch=48) as server:
        status, headers, body = raw(server.url, "GET", "/health")
        out = RemoteReward(server.url, token=TOKEN)(*digits(6))
        after = health(server)
    assert status == 200 and headers["content-type"] == "application/json"
    assert body == {
        "status": "ok",
        "reward": list(COMPONENTS),
        "max_batch": 48,
        "max_request_bytes": 64 * 2**20,
        "coalesce": True,
        "max_wait_ms": 7.5,
        "requests": 0,
        "batches": 0,
        "samples": 0,
        "queued": 0,
        "in_flight": 0,
    }
    assert out.scores.shape == (6,)
    assert (after["requests"], after["batches"], after["samples"], after["in_flight"]) == (1, 1, 6, 0)


def test_wrong_token_and_oversized_bodies_are_refused_before_scoring():
    reward = Recorded()
    with serve(reward, max_request_bytes=4096) as server:
        start = time.monotonic()
        with pytest.raises(RewardServerError) as wrong:
            RemoteReward(server.url, token="not-it", backoff=5.0)(*digits(3))
        with pytest.raises(RewardServerError) as large:
            RemoteReward(server.url, token=TOKEN, backoff=5.0)(*digits(20))  # 20 x 64 float32: over 4096 bytes
        elapsed = time.monotonic() - start
        stats = health(server)
    assert str(wrong.value) == f"reward server {server.url} refused the request (HTTP 401: wrong or missing token)."
    assert str(large.value).startswith(f"reward server {server.url} refused the request (HTTP 413: the request body has ")
    assert str(large.value).endswith("bytes, more than this server's limit of 4096).")
    assert elapsed < 4  # a 4xx is final: no backoff of 5 s
    assert reward.calls == [] and stats["requests"] == 0


# ----------------------------------------------------------------------------------------- replicas


def test_several_replicas_share_the_work_and_a_dead_one_is_skipped(reference):
    first, second = Recorded(), Recorded()
    a, b = serve(first, max_wait_ms=0).start(), serve(second, max_wait_ms=0).start()
    try:
        client = RemoteReward([a.url, b.url], token=TOKEN, batch_size=4, backoff=5.0, timeout=5)
        images, prompts, meta = digits(16)
        out = client(images, prompts, meta)  # 4 chunks of 4, on both replicas at once
        assert_same(out, reference(images, prompts, meta))
        # both replicas worked; a replica's server may merge two chunks that reach it together into one model batch
        # (its own batching, even at max_wait_ms=0 on a loaded machine), so the calls are chunks of 4 or merged 8s
        calls = first.calls + second.calls
        assert sum(calls) == 16 and all(c in (4, 8) for c in calls) and first.calls and second.calls
        for _ in range(4):  # whole batches go round-robin
            client(*digits(3))
        assert sum(first.calls) + sum(second.calls) == 16 + 4 * 3 and abs(len(first.calls) - len(second.calls)) <= 2
        a.stop()
        done_before = sum(second.calls)
        start = time.monotonic()
        for n in (5, 6, 7):  # two chunks each; the dead replica costs a refused connection, never a backoff of 5 s
            batch = digits(n)
            assert_same(client(*batch), reference(*batch))
        assert time.monotonic() - start < 4
        assert sum(second.calls) == done_before + 5 + 6 + 7
    finally:
        a.stop()
        b.stop()


class _Down(BaseHTTPRequestHandler):
    """A replica answering every request 503, recording when each attempt arrived and where."""

    arrivals: list = []

    def do_POST(self):  # noqa: N802
        self.arrivals.append((time.monotonic(), self.server.server_address[1]))
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"error": "down."}).encode()
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_failed_replicas_are_tried_in_turn_with_backoff_between_rounds_then_one_sentence():
    handler = type("Handler", (_Down,), {"arrivals": []})
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(2)]
    threads = [threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True) for s in servers]
    for t in threads:
        t.start()
    with socket.socket() as closed:  # a third replica that refuses connections
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    try:
        start = time.monotonic()
        with pytest.raises(RewardServerError) as info:
            RemoteReward(urls + [dead], token=TOKEN, retries=9, backoff=0.5, timeout=5)(*digits(2))
        elapsed = time.monotonic() - start
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
    message = str(info.value)
    assert message.startswith(f"reward servers {urls[0]}, {urls[1]}, {dead} did not answer after 9 attempts (")
    assert message.endswith(": connection refused)." if message.count(dead) == 2 else ": HTTP 503: down).")
    assert "\n" not in message and isinstance(info.value, FlowRLError)
    # 3 rounds over the 3 replicas: within a round the next replica is tried at once, between rounds the
    # client backs off 0.5 s then 1 s (x a random factor in [0.5, 1.5]).
    times = np.array([t for t, _ in handler.arrivals])
    assert len(times) == 6 and [p for _, p in handler.arrivals].count(servers[0].server_address[1]) == 3
    gaps = np.diff(times)
    within = [gaps[0], gaps[2], gaps[4]]  # the two live replicas of one round
    assert max(within) < 0.2, gaps
    assert gaps[1] >= 0.25 and gaps[3] >= 0.5, gaps
    assert 0.75 <= elapsed < 0.75 * 3 + 1.5


def test_replica_urls_are_checked_and_can_come_from_the_environment(monkeypatch, reference):
    with pytest.raises(FlowRLError, match=r"reward server url 'ftp://x' must look like http://HOST:PORT\.$"):
        RemoteReward(["http://127.0.0.1:1", "ftp://x"])
    with pytest.raises(FlowRLError, match=r"url list is empty\.$"):
        RemoteReward([])
    with serve(Recorded(), max_wait_ms=0) as a, serve(Recorded(), max_wait_ms=0) as b:
        monkeypatch.setenv("FLOWRL_REWARD_URL", f"{a.url}, {b.url}")
        client = RemoteReward(token=TOKEN)
        batch = digits(4)
        assert_same(client(*batch), reference(*batch))
        assert client.url == f"{a.url}, {b.url}"


@pytest.mark.slow
def test_without_the_server_extra_the_command_says_so_in_one_sentence(tmp_path):
    config = write_config(tmp_path / "server.yaml", device="cpu")
    code = "import sys; sys.modules['uvicorn'] = None; from flowrl.reward_server import main; sys.exit(main([sys.argv[1]]))"
    env = dict(os.environ, PYTHONPATH=str(REPO), FLOWRL_REWARD_TOKEN=TOKEN, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code, str(config)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "flowrl: error: the reward server needs uvicorn, which is not installed; pip install 'flowrl[server]'.\n"
