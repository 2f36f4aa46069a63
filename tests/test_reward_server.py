"""The reward server and its client over real loopback HTTP.

A real server process (``python -m flowrl.reward_server``) serves the embedded digit classifier
and ink rewards; the client must get exactly what the in-process reward gives, NaN included, and the
server must refuse bad tokens, oversized, malformed and pickled payloads, and metadata the reward cannot
use, with a 4xx that the client does not retry, while going on serving. All traffic stays on 127.0.0.1
and every wait is bounded.
"""

from __future__ import annotations

import http.client
import io
import json
import math
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
import torch
import yaml

from flowrl.config import RewardConfig
from flowrl.errors import FlowRLError
from flowrl.reward_models import build_reward, build_reward_from_config
from flowrl.reward_models.remote import RemoteReward, RewardServerError
from flowrl.reward_models.wire import _Job
from flowrl.reward_server import RewardServer, ServerConfig, load_server_config, serve_main
from flowrl.reward_server.batcher import Batcher
from flowrl.types import RewardOutput

REPO = Path(__file__).resolve().parents[1]
TOKEN = "test-token-3f9c2a"
COMPONENTS = {"digit_classifier": 1.0, "ink": 0.5}
MAX_REQUEST_BYTES = 32768
MAX_BATCH = 32
LISTENING = re.compile(r"^flowrl reward server listening on (http://127\.0\.0\.1:(\d+))$")


# ----------------------------------------------------------------------------------------- helpers


class ServerProcess:
    """A reward server subprocess on 127.0.0.1, port 0; ``url`` is read from its first stdout line."""

    def __init__(self, config: Path, log: Path, token: str | None = TOKEN) -> None:
        env = {k: v for k, v in os.environ.items() if k != "FLOWRL_REWARD_TOKEN"}
        env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
        if token is not None:
            env["FLOWRL_REWARD_TOKEN"] = token
        self.log = log
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flowrl.reward_server", str(config)],
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            cwd=REPO,
            env=env,
        )
        self.url = self._read_url(deadline=time.monotonic() + 60)

    def _read_url(self, deadline: float) -> str:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                match = LISTENING.match(line.strip())
                if not match:
                    self.stop()
                    raise AssertionError(f"unexpected first line {line!r}; log: {self.log.read_text()}")
                return match.group(1)
            if self.proc.poll() is not None:
                break
        self.stop()
        raise AssertionError(f"the reward server did not start; log: {self.log.read_text()}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log_file.close()
        return self.proc.returncode


def write_config(path: Path, **extra) -> Path:
    tree = {"reward": {"components": COMPONENTS}, "port": 0, **extra}
    path.write_text(yaml.safe_dump(tree))
    return path


def request(
    url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None, content_length: bool = True
) -> tuple[int, dict | None]:
    """One raw HTTP request (10 s timeout); returns (status, JSON body or None)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        if content_length:
            conn.request(method, path, body=body, headers=headers or {})
        else:
            conn.putrequest(method, path)
            for k, v in (headers or {}).items():
                conn.putheader(k, v)
            conn.endheaders()
            if body:
                conn.send(body)
        response = conn.getresponse()
        data = response.read()
        return response.status, (json.loads(data) if data else None)
    finally:
        conn.close()


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", "Content-Type": "application/x-npz"}


def npz(samples, meta: dict | str | None = None, /, **arrays) -> bytes:
    buffer = io.BytesIO()
    if meta is not None:
        arrays["meta"] = np.array(meta if isinstance(meta, str) else json.dumps(meta))
    np.savez(buffer, samples=samples, **arrays)
    return buffer.getvalue()


def digits(n: int) -> tuple[torch.Tensor, list[str], list[dict]]:
    """n images in [0, 1] with prompts and digit metadata (the digit classifier needs one per sample)."""
    g = torch.Generator().manual_seed(n)
    images = torch.rand(n, 1, 8, 8, generator=g) ** 2
    meta = [{"digit": i % 10} for i in range(n)]
    return images, [f"a handwritten {m['digit']}" for m in meta], meta


def assert_same(out: RewardOutput, ref: RewardOutput, extras_prefix: str = "") -> None:
    assert out.scores.dtype == torch.float32 and out.scores.shape == ref.scores.shape
    torch.testing.assert_close(out.scores, ref.scores, atol=1e-6, rtol=0, equal_nan=True)
    assert torch.equal(out.scores.isnan(), ref.scores.isnan())
    for key, value in ref.extras.items():
        torch.testing.assert_close(out.extras[extras_prefix + key], value, atol=1e-6, rtol=0, equal_nan=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference():
    return build_reward_from_config(RewardConfig(components=COMPONENTS))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reward_server")
    config = write_config(tmp / "server.yaml", max_request_bytes=MAX_REQUEST_BYTES, max_batch=MAX_BATCH, coalesce=True, device="cpu")
    proc = ServerProcess(config, tmp / "server.log")
    try:
        yield proc
    finally:
        code = proc.stop()
    assert code == 0, f"SIGTERM should stop the server cleanly; log: {proc.log.read_text()}"


def assert_healthy(url: str) -> None:
    status, body = request(url, "GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["reward"] == list(COMPONENTS)


# ----------------------------------------------------------------------------------------- scores


@pytest.mark.slow
def test_remote_scores_equal_in_process_scores(server, reference):
    images, prompts, meta = digits(7)
    out = RemoteReward(server.url, token=TOKEN)(images, prompts, meta)
    ref = reference(images, prompts, meta)
    assert not out.scores.isnan().any()
    assert set(out.extras) == {"digit_classifier", "digit_classifier/accuracy", "ink"}
    assert_same(out, ref)
    # Several requests per call give the same scores as one.
    assert_same(RemoteReward(server.url, token=TOKEN, batch_size=3)(images, prompts, meta), ref)


@pytest.mark.parametrize("encoding", ["uint8", "png"])
def test_8bit_encodings_score_the_rounded_pixels(server, reference, encoding):
    images, prompts, meta = digits(5)
    rounded = (images * 255).round().clamp(0, 255) / 255
    out = RemoteReward(server.url, token=TOKEN, encoding=encoding)(images, prompts, meta)
    assert_same(out, reference(rounded, prompts, meta))


def test_remote_reward_from_a_training_config(server, reference, monkeypatch):
    # The client config of a training run: the token comes from the environment.
    monkeypatch.setenv("FLOWRL_REWARD_TOKEN", TOKEN)
    reward = build_reward_from_config(RewardConfig(components={"remote": 1.0}, kwargs={"remote": {"url": server.url}}))
    assert not reward.differentiable
    images, prompts, meta = digits(4)
    out = reward(images, prompts, meta)
    assert_same(out, reference(images, prompts, meta), extras_prefix="remote/")
    torch.testing.assert_close(out.extras["remote"], out.scores, equal_nan=True)


def test_concurrent_requests_each_get_their_own_scores(server, reference):
    batches = [digits(n) for n in (2, 3, 4, 5, 6, 7)]
    results: dict[int, RewardOutput | BaseException] = {}

    def score(i: int) -> None:
        try:
            results[i] = RemoteReward(server.url, token=TOKEN, timeout=20)(*batches[i])
        except BaseException as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=score, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for i, batch in enumerate(batches):
        assert isinstance(results.get(i), RewardOutput), results.get(i)
        assert_same(results[i], reference(*batch))


# ----------------------------------------------------------------------------------------- refusals


def test_wrong_or_missing_token_is_401_and_server_keeps_serving(server):
    images, prompts, meta = digits(3)
    body = npz(images.numpy(), {"prompts": prompts, "metadata": meta})
    for headers in (auth("not-the-token"), {"Content-Type": "application/x-npz"}, {"Authorization": TOKEN}):
        status, answer = request(server.url, "POST", "/score", body, headers)
        assert status == 401 and answer == {"error": "wrong or missing token."}
        assert_healthy(server.url)
    start = time.monotonic()
    with pytest.raises(RewardServerError, match=r"refused the request \(HTTP 401: wrong or missing token\)\.$"):
        RemoteReward(server.url, token="not-the-token", retries=3, backoff=5.0)(images, prompts, meta)
    assert time.monotonic() - start < 4, "a 4xx answer must not be retried"
    status, answer = request(server.url, "POST", "/score", body, auth())
    assert status == 200 and len(answer["scores"]) == 3 and all(isinstance(v, float) for v in answer["scores"])


class _Pickled:
    """Unpickling this creates ``marker``: proof that the server never unpickles."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def with_pixel(x: np.ndarray, value: float) -> np.ndarray:
    out = x.copy()
    out[0, 0, 0, 0] = value
    return out


SEVEN = "the reward could not score this request's data (ValueError: invalid literal for int() with base 10: 'seven')."
NO_DIGIT = "sample {} has no 'digit' in its metadata, which reward 'digit_classifier' needs to score it; send a 'digit' with every sample."


def _bad_requests(marker: Path) -> dict[str, tuple[dict, int, str]]:
    images, prompts, meta = digits(3)
    good_meta = {"prompts": prompts, "metadata": meta}
    x = images.numpy()
    objects = np.empty(1, dtype=object)
    objects[0] = _Pickled(marker)
    return {
        "oversized": (dict(body=b"\0" * (MAX_REQUEST_BYTES + 1)), 413, "more than this server's limit"),
        # (bytes sent after the headers without a Content-Length are no body but a malformed next request:
        # the HTTP parser answers those 400 itself)
        "no_content_length": (dict(body=b"", content_length=False), 411, "Content-Length"),
        "not_npz": (dict(body=b"PK\x03\x04 certainly not a zip archive"), 400, "not a valid NPZ archive"),
        "truncated_npz": (dict(body=npz(x, good_meta)[:-40]), 400, "NPZ"),
        "pickled_objects": (dict(body=npz(objects, good_meta)), 400, "Python objects"),
        "pickled_meta": (dict(body=npz(x, None, meta=objects)), 400, "Python objects"),
        "extra_member": (dict(body=npz(x, good_meta, other=x)), 400, "exactly the arrays"),
        "float64": (dict(body=npz(x.astype(np.float64), good_meta)), 400, "expected float32 or uint8"),
        # value ranges per input type: float32 pixels in [0, 1] (uint8 and PNG are in range by construction)
        "float_out_of_range": (dict(body=npz(with_pixel(x, 1e6), good_meta)), 400, "to 1e+06; clamp them or send uint8 in [0, 255]."),
        "float_negative": (dict(body=npz(with_pixel(x, -0.5), good_meta)), 400, "got values from -0.5 to"),
        "float_nan": (dict(body=npz(np.where(x > 0.5, np.nan, x).astype(np.float32), good_meta)), 400, "NaN or infinite values"),
        "three_dims": (dict(body=npz(x[:, 0], good_meta)), 400, "(B, C, H, W)"),
        "meta_not_json": (dict(body=npz(x, "{not json")), 400, "not valid JSON"),
        "prompt_count": (dict(body=npz(x, {"prompts": prompts[:2], "metadata": meta})), 400, "3 samples but 2 prompts"),
        "over_max_batch": (
            dict(body=npz(np.zeros((MAX_BATCH + 1, 1, 8, 8), np.uint8), {"prompts": [""] * (MAX_BATCH + 1)})),
            400,
            "max_batch of 32",
        ),
        "reward_refuses_shape": (
            dict(body=npz(np.zeros((2, 1, 16, 16), np.float32), {"prompts": ["", ""], "metadata": [{"digit": 1}, {"digit": 2}]})),
            400,
            "the digit classifier reads",
        ),
        "digit_out_of_range": (dict(body=npz(x[:1], {"prompts": [""], "metadata": [{"digit": 12}]})), 400, "outside 0-9"),
        # metadata the reward cannot use: the request's fault (400, never retried), not the server's (500)
        "digit_not_a_number": (dict(body=npz(x[:1], {"prompts": [""], "metadata": [{"digit": "seven"}]})), 400, SEVEN),
        "digit_a_list": (
            dict(body=npz(x[:1], {"prompts": [""], "metadata": [{"digit": [7]}]})),
            400,
            "the reward could not score this request's data (TypeError: int() argument must be",
        ),
        "digit_missing": (dict(body=npz(x[:2], {"prompts": ["", ""], "metadata": [{"digit": 1}, {}]})), 400, NO_DIGIT.format(1)),
        "digit_null": (dict(body=npz(x[:1], {"prompts": [""], "metadata": [{"digit": None}]})), 400, NO_DIGIT.format(0)),
        "metadata_left_out": (dict(body=npz(x[:1], {"prompts": [""]})), 400, NO_DIGIT.format(0)),
        "bad_png": (
            dict(
                body=json.dumps({"images": ["bm90IGEgcG5n"], "prompts": [""]}).encode(),
                headers=auth() | {"Content-Type": "application/json"},
            ),
            400,
            "not a base64-encoded PNG",
        ),
        "unknown_path": (dict(body=npz(x, good_meta), path="/admin"), 404, "unknown path"),
    }


@pytest.mark.parametrize("case", list(_bad_requests(Path("unused"))))
def test_bad_requests_are_refused_and_server_keeps_serving(server, tmp_path, case):
    marker = tmp_path / "unpickled"
    kwargs, expected_status, expected_text = _bad_requests(marker)[case]
    kwargs.setdefault("headers", auth())
    status, answer = request(server.url, "POST", kwargs.pop("path", "/score"), **kwargs)
    assert status == expected_status, answer
    message = answer["error"]
    assert expected_text in message and message.endswith(".") and "\n" not in message
    assert not marker.exists(), "the server unpickled a payload"
    assert_healthy(server.url)
    images, prompts, meta = digits(2)
    assert RemoteReward(server.url, token=TOKEN)(images, prompts, meta).scores.shape == (2,)


# ----------------------------------------------------------------------------------------- client errors


def access_log_count(log: Path, status: int) -> int:
    """POST /score requests the server answered with ``status``, from its access log (uvicorn's, on stderr)."""
    return sum(f'"POST /score HTTP/1.1" {status}' in line for line in log.read_text().splitlines())


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_metadata_the_reward_cannot_use_is_a_400_the_client_does_not_retry(server):
    # The digit classifier reads metadata["digit"] with int(): "seven" raises ValueError inside the reward. That
    # is the request's fault, answered 400 with the cause; the client gives up at once instead of retrying
    # for retry_for (120 s by default), and the server has seen exactly one request.
    images, prompts, _ = digits(1)
    before = request(server.url, "GET", "/health")[1]
    refused_before = access_log_count(server.log, 400)
    client = RemoteReward(server.url, token=TOKEN)
    assert client.retry_for == 120.0
    start = time.monotonic()
    with pytest.raises(RewardServerError) as info:
        client(images, prompts, [{"digit": "seven"}])
    elapsed = time.monotonic() - start
    assert str(info.value) == f"reward server {server.url} refused the request (HTTP 400: {SEVEN[:-1]})."
    assert elapsed < 2.0, elapsed
    after = request(server.url, "GET", "/health")[1]
    assert after["requests"] - before["requests"] == 1  # scored (and failed) once
    assert after["samples"] == before["samples"]
    wait_for(lambda: access_log_count(server.log, 400) == refused_before + 1)  # answered once, 400
    time.sleep(0.2)
    assert access_log_count(server.log, 400) == refused_before + 1
    # A missing key is refused before the request is queued: nothing reaches the model.
    with pytest.raises(RewardServerError) as info:
        client(images, prompts, [{}])
    assert str(info.value) == f"reward server {server.url} refused the request (HTTP 400: {NO_DIGIT.format(0)[:-1]})."
    assert request(server.url, "GET", "/health")[1]["requests"] == after["requests"]
    assert "Traceback" not in server.log.read_text()  # a client error is no server failure


def test_a_bad_request_merged_with_good_ones_fails_alone(reference):
    # max_batch 4 = the good client's 3 samples + the bad client's 1: the two requests are merged into one
    # model call, which raises on "seven"; each request is then scored alone, so only the bad one fails.
    with RewardServer(
        ServerConfig(reward=RewardConfig(components=COMPONENTS), device="cpu", max_batch=4, max_wait_ms=20_000), TOKEN
    ) as srv:
        good = digits(3)
        bad = (digits(1)[0], ["a handwritten seven"], [{"digit": "seven"}])
        results: list = [None, None]
        barrier = threading.Barrier(2)

        def score(i: int, batch) -> None:
            client = RemoteReward(srv.url, token=TOKEN, timeout=20)
            barrier.wait(timeout=20)
            try:
                results[i] = client(*batch)
            except BaseException as e:  # noqa: BLE001 - checked below
                results[i] = e

        start = time.monotonic()
        threads = [threading.Thread(target=score, args=(i, b)) for i, b in enumerate((good, bad))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        elapsed = time.monotonic() - start
        stats = request(srv.url, "GET", "/health")[1]
    assert elapsed < 10  # the batch was full when the second request came: no 20 s wait, no retries
    assert isinstance(results[0], RewardOutput), results[0]
    assert_same(results[0], reference(*good))
    assert isinstance(results[1], RewardServerError) and str(results[1]) == (
        f"reward server {srv.url} refused the request (HTTP 400: {SEVEN[:-1]})."
    )
    # one merged call of 4 samples that failed, then each request alone: 3 samples scored, 1 refused
    assert (stats["requests"], stats["batches"], stats["samples"]) == (2, 3, 3)


class _FailsThenScores:
    """A reward whose first ``failures`` calls raise ``error`` (a server-side failure), then scores the mean pixel."""

    name, differentiable = "flaky", False

    def __init__(self, error: BaseException, failures: int) -> None:
        self.error, self.failures, self.calls = error, failures, 0

    def __call__(self, samples, prompts, metadata):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return RewardOutput(scores=samples.mean(dim=(1, 2, 3)))


def test_a_server_side_failure_is_a_500_the_client_retries(capfd):
    images, prompts, meta = digits(2)
    config = ServerConfig(reward=RewardConfig(components=COMPONENTS), device="cpu")
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    reward = _FailsThenScores(oom, failures=2)
    with RewardServer(config, TOKEN, reward=reward) as srv:
        out = RemoteReward(srv.url, token=TOKEN, backoff=0.05, retry_for=20)(images, prompts, meta)
        torch.testing.assert_close(out.scores, images.mean(dim=(1, 2, 3)), atol=1e-6, rtol=0)
        assert reward.calls == 3  # two 500s, retried, then scored
        always = _FailsThenScores(RuntimeError("the model crashed\nin layer 3"), failures=10**6)
    with RewardServer(config, TOKEN, reward=always) as srv:
        with pytest.raises(RewardServerError) as info:
            RemoteReward(srv.url, token=TOKEN, backoff=0.01, retries=3)(images, prompts, meta)
    assert always.calls == 3
    assert (
        str(info.value)
        == f"reward server {srv.url} did not answer after 3 attempts (HTTP 500: the reward raised RuntimeError: the model crashed)."
    )
    assert "RuntimeError: the model crashed" in capfd.readouterr().err  # the traceback is on the server's stderr


def test_nan_and_infinite_scores_cross_the_wire():
    # NaN ("not applicable") is null on the wire and +-inf are "inf"/"-inf": the client gets the same floats.
    class Special:
        name, differentiable = "special", False

        def __call__(self, samples, prompts, metadata):
            scores = torch.tensor([math.nan, math.inf, -math.inf, 0.25])
            return RewardOutput(scores=scores, extras={"twice": 2 * scores})

    with RewardServer(ServerConfig(reward=RewardConfig(components=COMPONENTS), device="cpu"), TOKEN, reward=Special()) as srv:
        images, prompts, meta = digits(4)
        status, answer = request(srv.url, "POST", "/score", npz(images.numpy(), {"prompts": prompts, "metadata": meta}), auth())
        out = RemoteReward(srv.url, token=TOKEN)(images, prompts, meta)
    assert status == 200 and answer == {"scores": [None, "inf", "-inf", 0.25], "extras": {"twice": [None, "inf", "-inf", 0.5]}}
    expected = torch.tensor([math.nan, math.inf, -math.inf, 0.25])
    torch.testing.assert_close(out.scores, expected, equal_nan=True)
    torch.testing.assert_close(out.extras["twice"], 2 * expected, equal_nan=True)


# ----------------------------------------------------------------------------------------- failures


def test_non_finite_samples_score_nan_without_being_sent(server, reference):
    # The server refuses NaN pixels (400); the client scores such a sample NaN itself, as the in-process
    # reward would, and sends only the others.
    images, prompts, meta = digits(5)
    images[1, 0, 3, 3] = float("nan")
    out = RemoteReward(server.url, token=TOKEN, batch_size=2)(images, prompts, meta)
    ref = reference(images, prompts, meta)
    assert out.scores[1].isnan() and out.extras["ink"][1].isnan()
    keep = [0, 2, 3, 4]
    torch.testing.assert_close(out.scores[keep], ref.scores[keep], atol=1e-6, rtol=0)
    assert not out.scores[keep].isnan().any()


@pytest.mark.slow
def test_killed_server_raises_one_sentence_after_bounded_retries(tmp_path, capsys):
    proc = ServerProcess(write_config(tmp_path / "server.yaml", device="cpu"), tmp_path / "server.log")
    try:
        images, prompts, meta = digits(2)
        reward = RemoteReward(proc.url, token=TOKEN, retries=2, backoff=0.05, timeout=5)
        assert reward(images, prompts, meta).scores.shape == (2,)
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait(timeout=15)
        start = time.monotonic()
        with pytest.raises(RewardServerError) as info:
            reward(images, prompts, meta)
        assert time.monotonic() - start < 5
        assert str(info.value) == f"reward server {proc.url} did not answer after 2 attempts (connection refused)."
        assert isinstance(info.value, FlowRLError)
        # Without an attempt limit the client keeps trying for retry_for seconds, then gives up with the same sentence.
        start = time.monotonic()
        with pytest.raises(RewardServerError, match=r"did not answer after \d+ attempts \(connection refused\)\.$"):
            RemoteReward(proc.url, token=TOKEN, retry_for=1.5, backoff=0.1, timeout=5)(images, prompts, meta)
        assert 1.5 <= time.monotonic() - start < 3
        # and says, once, while it waits, that the server is not answering and for how long it will keep trying
        waiting = capsys.readouterr().err.splitlines()
        said = [line for line in waiting if "not answering" in line]
        assert len(said) == 2  # once per call above, when its first round of attempts failed
        assert (
            said[0]
            == f"flowrl: reward server {proc.url} is not answering; retrying, at most 1 more attempt(s) for up to 120 s more (retry_for)."
        )
        assert re.fullmatch(
            rf"flowrl: reward server {re.escape(proc.url)} is not answering; retrying, for up to [12] s more \(retry_for\)\.", said[1]
        )
    finally:
        proc.stop()


def test_a_silent_server_times_out_within_the_retry_budget():
    # A socket that listens but never accepts: the connection opens, no answer ever comes.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(RewardServerError, match=r"did not answer after 2 attempts \(timed out after 0\.2 s\)\.$"):
            RemoteReward(url, token=TOKEN, timeout=0.2, retries=2, backoff=0.01)(*digits(2))
        assert time.monotonic() - start < 3


class _Fixed(BaseHTTPRequestHandler):
    status = 500
    hits = 0

    def do_POST(self):  # noqa: N802
        type(self).hits += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"error": f"status {self.status}."}).encode()
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _Timed(BaseHTTPRequestHandler):
    """Answers every POST with ``status`` (and ``retry_after`` when set), recording when each attempt arrived."""

    status, retry_after, arrivals = 500, None, []

    def do_POST(self):  # noqa: N802
        type(self).arrivals.append(time.monotonic())
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"error": "busy."}).encode()
        self.send_response(self.status)
        if self.retry_after is not None:
            self.send_header("Retry-After", str(self.retry_after))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _serve(handler):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return httpd, thread, f"http://127.0.0.1:{httpd.server_address[1]}"


def test_the_client_backs_off_with_jitter_for_retry_for_seconds():
    handler = type("Handler", (_Timed,), {"status": 500, "retry_after": None, "arrivals": []})
    httpd, thread, url = _serve(handler)
    try:
        start = time.monotonic()
        with pytest.raises(RewardServerError, match=r"did not answer after \d+ attempts \(HTTP 500: busy\)\.$"):
            RemoteReward(url, retry_for=2.0, backoff=0.2, timeout=5)(*digits(2))
        elapsed = time.monotonic() - start
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
    assert 2.0 <= elapsed < 3.0  # the last attempt starts when retry_for is used up, not later
    gaps = np.diff(handler.arrivals)
    assert len(gaps) >= 3
    # The k-th wait is 0.2 * 2**(k-1) s times a random factor in [0.5, 1.5] (the last one cut at retry_for).
    ladder = 0.2 * 2.0 ** np.arange(len(gaps))
    ratios = gaps[:-1] / ladder[:-1]
    assert (ratios >= 0.5 - 0.02).all() and (gaps[:-1] <= 1.5 * ladder[:-1] + 0.3).all(), gaps
    assert (np.abs(ratios - 1) > 0.05).any(), "no jitter"  # all within 5% of the ladder by chance: p = 0.1**len


def test_the_client_waits_at_least_retry_after_on_503():
    handler = type("Handler", (_Timed,), {"status": 503, "retry_after": 1, "arrivals": []})
    httpd, thread, url = _serve(handler)
    try:
        with pytest.raises(RewardServerError, match=r"\(HTTP 503: busy\)\.$"):
            RemoteReward(url, retry_for=2.5, backoff=0.01, timeout=5)(*digits(2))
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
    gaps = np.diff(handler.arrivals)
    assert len(gaps) >= 1 and (gaps[:-1] >= 1.0).all(), gaps  # backoff 0.01 s, but the server asked for 1 s


def raw(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers, JSON body) of one request."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.slow
def test_a_saturated_server_answers_503_with_retry_after_and_the_client_comes_back(tmp_path):
    proc = ServerProcess(write_config(tmp_path / "server.yaml", device="cpu", max_connections=2), tmp_path / "server.log")
    parts = urlsplit(proc.url)
    held: list[socket.socket] = []
    try:
        # Two requests in flight whose bodies never finish arriving: each holds one of the 2 scoring slots.
        for _ in range(2):
            s = socket.create_connection((parts.hostname, parts.port), timeout=10)
            s.sendall(
                f"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                "Content-Type: application/x-npz\r\nContent-Length: 1000\r\n\r\nPK".encode()
            )
            held.append(s)
        deadline = time.monotonic() + 10
        while raw(proc.url, "GET", "/health")[2]["in_flight"] != 2:  # health answers while scoring is saturated
            assert time.monotonic() < deadline
            time.sleep(0.05)
        images, prompts, meta = digits(3)
        status, headers, answer = raw(proc.url, "POST", "/score", npz(images.numpy(), {"prompts": prompts, "metadata": meta}), auth())
        assert status == 503 and headers["retry-after"] == "1" and answer == {"error": "the reward server is busy; retry later."}
        start = time.monotonic()
        with pytest.raises(RewardServerError) as info:
            RemoteReward(proc.url, token=TOKEN, retry_for=1.5, backoff=0.1, timeout=5)(images, prompts, meta)
        assert 1.5 <= time.monotonic() - start < 3.5
        assert re.fullmatch(
            rf"reward server {re.escape(proc.url)} did not answer after \d+ attempts \(HTTP 503: the reward server is "
            r"busy; retry later\)\.",
            str(info.value),
        ), str(info.value)
        # Slots free up while the client waits: it gets its scores.
        release = threading.Timer(1.0, lambda: [s.close() for s in held])
        release.start()
        start = time.monotonic()
        out = RemoteReward(proc.url, token=TOKEN, retry_for=20, backoff=0.1, timeout=5)(images, prompts, meta)
        assert out.scores.shape == (3,) and time.monotonic() - start >= 1.0
        release.join()
        assert_healthy(proc.url)
    finally:
        for s in held:
            s.close()
        assert proc.stop() == 0


@pytest.mark.parametrize("status, attempts", [(500, 3), (503, 3), (400, 1), (403, 1)])
def test_5xx_answers_are_retried_and_4xx_are_not(status, attempts):
    handler = type("Handler", (_Fixed,), {"status": status, "hits": 0})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        with pytest.raises(RewardServerError, match=f"HTTP {status}: status {status}\\)\\.$"):
            RemoteReward(url, retries=3, backoff=0.01, timeout=5)(*digits(2))
        assert handler.hits == attempts
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


# ----------------------------------------------------------------------------------------- config


@pytest.mark.slow
def test_unknown_config_key_fails_to_start_with_one_line(tmp_path):
    config = write_config(tmp_path / "bad.yaml", bogus=1)
    env = dict(os.environ, PYTHONPATH=str(REPO), FLOWRL_REWARD_TOKEN=TOKEN, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "flowrl.reward_server", str(config)], capture_output=True, text=True, cwd=REPO, env=env, timeout=60
    )
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.strip() == "flowrl: error: unknown config key 'bogus'."


def test_config_errors_are_flowrl_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("FLOWRL_REWARD_TOKEN", raising=False)
    with pytest.raises(FlowRLError, match=r"set the environment variable FLOWRL_REWARD_TOKEN"):
        serve_main(str(write_config(tmp_path / "a.yaml")))
    with pytest.raises(FlowRLError, match=r"unknown reward 'no_such_reward'"):
        load_server_config(write_config(tmp_path / "b.yaml", reward={"components": {"no_such_reward": 1.0}}))
    with pytest.raises(FlowRLError, match=r"config key 'max_request_bytes' is invalid"):
        load_server_config(write_config(tmp_path / "c.yaml", max_request_bytes=0))
    with pytest.raises(FlowRLError, match=r"does not exist"):
        serve_main(str(tmp_path / "missing.yaml"))
    defaults = ServerConfig(reward=RewardConfig())
    assert defaults.host == "127.0.0.1" and defaults.max_request_bytes == 64 * 2**20 and defaults.max_batch == 256
    with pytest.raises(FlowRLError, match="cannot be differentiable"):
        RemoteReward("http://127.0.0.1:1", differentiable=True)
    with pytest.raises(FlowRLError, match="must look like http://HOST:PORT"):
        build_reward("remote", url="ftp://127.0.0.1/")


# ----------------------------------------------------------------------------------------- batching


class _Gated:
    """A reward whose first call waits for a gate, so later requests queue up behind it."""

    name = "gated"
    differentiable = False

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.batch_sizes: list[int] = []

    def __call__(self, samples, prompts, metadata):
        if not self.entered.is_set():
            self.entered.set()
            self.gate.wait(timeout=10)
        self.batch_sizes.append(samples.shape[0])
        if any(m.get("fail") for m in metadata):
            raise FlowRLError("this sample fails.")
        return RewardOutput(scores=samples.mean(dim=(1, 2, 3)), extras={"n": torch.full((samples.shape[0],), 1.0)})


def test_queued_requests_are_coalesced_and_split_back():
    reward = _Gated()
    scorer = Batcher(reward, "cpu", max_batch=8, coalesce=True, max_wait_s=0.0, max_queue=16)
    scorer.start()
    try:
        jobs = [_Job(torch.full((n, 1, 2, 2), float(n)), [""] * n, [{}] * n) for n in (1, 2, 3, 4)]
        jobs.append(_Job(torch.zeros(1, 1, 2, 2), [""], [{"fail": True}]))
        scorer.submit(jobs[0])
        assert reward.entered.wait(timeout=10)  # the first job is being scored; the rest must queue
        for job in jobs[1:]:
            scorer.submit(job)
        reward.gate.set()
        for job in jobs:
            assert job.done.wait(timeout=10)
    finally:
        scorer.stop()
    # 1 alone (it was being scored), then 2+3 coalesced (4 more would pass max_batch 8), then 4 + the
    # failing one together, which fails and is retried one by one.
    assert reward.batch_sizes == [1, 5, 5, 4, 1]
    for job, n in zip(jobs[:4], (1, 2, 3, 4)):
        assert job.error is None and job.result == ([float(n)] * n, {"n": [1.0] * n})
    assert isinstance(jobs[4].error, FlowRLError)


# ------------------------------------------------------------------------ the trainer and a dead server


class KillServerAfterFirstCall:
    """The real RemoteReward, with the server process SIGKILLed right after the first batch is scored."""

    def __init__(self, remote: RemoteReward, server: ServerProcess) -> None:
        self.remote, self.server, self.calls = remote, server, 0
        self.name, self.differentiable = remote.name, False

    def __call__(self, samples, prompts, metadata):
        out = self.remote(samples, prompts, metadata)
        self.calls += 1
        if self.calls == 2:  # call 1 is the evaluation before training, call 2 iteration 1's rollout
            self.server.proc.kill()
            self.server.proc.wait(timeout=15)
        return out


@pytest.mark.slow
def test_trainer_stops_cleanly_and_keeps_its_work_when_the_server_dies(tmp_path, monkeypatch, capsys):
    from conftest import CONFIGS, fast_overrides

    from flowrl.config import load_config
    from flowrl.reward_models import build_reward_from_config
    from flowrl.trainer import Trainer
    from flowrl.training.checkpoint import read_checkpoint

    server = ServerProcess(write_config(tmp_path / "server.yaml"), tmp_path / "server.log")
    try:
        monkeypatch.setenv("FLOWRL_REWARD_TOKEN", TOKEN)
        overrides = fast_overrides(
            tmp_path / "run",
            **{
                "train.iterations": 3,
                "reward.components": "{remote: 1.0}",
                "reward.kwargs.remote.url": server.url,
                "reward.kwargs.remote.retries": 2,
                "reward.kwargs.remote.backoff": 0.05,
            },
        )
        config = load_config(CONFIGS / "digits" / "grpo.yaml", overrides)
        remote = build_reward_from_config(config.reward).components["remote"]
        trainer = Trainer(config, reward=KillServerAfterFirstCall(remote, server))
        with pytest.raises(FlowRLError) as info:
            trainer.fit()
    finally:
        server.stop()
    message = str(info.value)
    assert "did not answer after 2 attempts" in message and "iteration 1 saved" in message and "\n" not in message
    weights, _, state = read_checkpoint(tmp_path / "run" / "checkpoints" / "step_000001")
    assert state["iteration"] == 1 and weights
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]
