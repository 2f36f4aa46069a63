"""The VLM-judge reward against a real OpenAI-compatible server on loopback.

``transformers serve`` runs in a subprocess on 127.0.0.1 and serves two tiny LLaVA models built here with
random weights (tests/vlm_judge_support.py): one whose vocabulary of answers is the ten digits, so every greedy
answer is a number, and one that answers "yes", "no", "maybe" or "cat", so some answers are not a verdict.
Every score the judge gets over HTTP must equal what the same model answers in-process with ``generate``
(greedy, the same chat template and images): nothing replays canned answers. The local server ignores the
``logprobs`` field, so the log-prob path of yes/no scoring is tested as a pure function on OpenAI-shaped
replies. Failures (a closed port, a server that never answers or answers HTML, a 4xx, a 5xx) must raise one
sentence in bounded time; a small TCP relay in front of the server counts requests and how many are in flight.
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowrl.errors import FlowRLError
from flowrl.reward_models.openai_judge import (
    TEMPLATES,
    JudgeServerError,
    OpenAIJudgeReward,
    answer_text,
    frame_indices,
    image_data_url,
    parse_number,
    parse_yes_no,
    yes_probability,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vlm_judge_support import build_tiny_llava, expected_answer, judge_images  # noqa: E402

try:
    from transformers.utils.import_utils import is_serve_available

    SERVE = is_serve_available()
except ImportError:  # a transformers without `transformers serve`
    SERVE = False
needs_serve = pytest.mark.skipif(
    not SERVE, reason="transformers serve needs fastapi, uvicorn, pydantic and openai (pip install -e '.[test]')"
)
RUNNING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")
DIGITS_SEED, YES_NO_SEED = 3, 7  # random weights under which different test images get different answers


# ----------------------------------------------------------------------------------------- helpers


def one_sentence(message: str) -> str:
    assert "\n" not in message and message.endswith(".") and not message.endswith(".."), message
    return message


class Relay:
    """A TCP relay to ``port`` on 127.0.0.1 that counts connections (the judge opens one per request) and the most
    requests waiting at once: from the connection until the answer's first bytes are passed on, which lies within
    the client's request. ``hold_s`` delays each connection before it is relayed, so that concurrent requests overlap."""

    def __init__(self, port: int, hold_s: float = 0.0) -> None:
        self.upstream, self.hold_s = port, hold_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        self.lock = threading.Lock()
        self.reset()
        threading.Thread(target=self._accept, daemon=True).start()

    def reset(self) -> None:
        with self.lock:
            self.connections, self.open, self.most_open = 0, 0, 0

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                self.open += 1
                self.most_open = max(self.most_open, self.open)
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _answered(self, state: dict) -> None:
        with self.lock:
            if not state["answered"]:
                state["answered"] = True
                self.open -= 1

    def _pipe(self, source: socket.socket, sink: socket.socket, state: dict | None = None) -> None:
        try:
            while data := source.recv(65536):
                if state is not None:
                    self._answered(state)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _relay(self, client: socket.socket) -> None:
        state = {"answered": False}
        try:
            time.sleep(self.hold_s)
            with socket.create_connection(("127.0.0.1", self.upstream), timeout=30) as upstream:
                forward = threading.Thread(target=self._pipe, args=(client, upstream), daemon=True)
                forward.start()
                self._pipe(upstream, client, state)
                forward.join(30)
        finally:
            client.close()
            self._answered(state)

    def close(self) -> None:
        self.listener.close()


class BadServer:
    """A socket server that is not a judge: ``silent`` accepts and reads but never answers; ``html`` answers 200 with a
    web page. Only for the failure cases: every score in this file comes from the real server."""

    def __init__(self, mode: str) -> None:
        self.mode, self.held = mode, []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.held.append(conn)
            if self.mode == "html":
                conn.recv(1 << 20)
                page = b"<html><body>It works!</body></html>"
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(page), page)
                )
                conn.close()

    def close(self) -> None:
        self.listener.close()
        for conn in self.held:
            conn.close()


def in_process(path: Path, images, prompt: str, template: str, media: str, max_tokens: int) -> str:
    return expected_answer(path, images, TEMPLATES[template][0].format(prompt=prompt, media=media), max_tokens)


# ----------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("judges")
    return SimpleNamespace(
        digits=build_tiny_llava(root / "digits", [str(d) for d in range(10)], seed=DIGITS_SEED),
        yes_no=build_tiny_llava(root / "yes_no", ["yes", "no", "maybe", "cat"], seed=YES_NO_SEED),
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory, models):
    """``transformers serve`` on 127.0.0.1 (port 0), not pinned to a model: requests name a model directory."""
    home = tmp_path_factory.mktemp("hf_home")  # an empty hub cache: nothing of this machine's is listed or read
    log = home / "serve.log"
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="warning")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from transformers.cli.transformers import main; main()",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--device",
                "cpu",
                "--dtype",
                "float32",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=home,
            env=env,
        )
    try:
        deadline, port = time.monotonic() + 90, None
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            match = RUNNING.search(log.read_text())
            port = int(match.group(1)) if match else time.sleep(0.2)
        assert port is not None, f"transformers serve did not start; log: {log.read_text()[-3000:]}"
        yield SimpleNamespace(port=port, url=f"http://127.0.0.1:{port}/v1", log=log)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture()
def relay(server):
    relay = Relay(server.port, hold_s=0.3)
    yield relay
    relay.close()


# ----------------------------------------------------------------------------------------- scores from the real server


@needs_serve
@pytest.mark.slow
def test_numbers_equal_in_process_generate_with_bounded_concurrency(models, relay):
    images = judge_images(6, 3, seed=0)
    prompts = [f"a photo of {i}" for i in range(6)]
    judge = OpenAIJudgeReward(
        base_url=relay.url, model=str(models.digits), template="alignment", max_tokens=2, score_range=[0, 9], max_concurrency=2
    )
    out = judge(images, prompts, [{}] * 6)
    digits = [int(in_process(models.digits, [im], p, "alignment", "image", 2).split()[0]) for im, p in zip(images, prompts)]
    assert len(set(digits)) >= 2, f"the tiny judge gives every image the same answer {digits}: the test would prove little"
    assert torch.equal(out.scores, torch.tensor([d / 9 for d in digits], dtype=torch.float32))
    assert out.extras["raw"].tolist() == digits and out.extras["unparsed"].tolist() == [0.0] * 6
    assert relay.connections == 6 and relay.most_open == 2  # six requests, never more than two at once
    # Grey, non-square images travel as RGB PNGs and get the answers the model gives those pixels in-process.
    relay.reset()
    grey = judge_images(3, 1, height=24, width=40, seed=2)
    wide = OpenAIJudgeReward(base_url=relay.url, model=str(models.digits), template="quality", max_tokens=2, normalize=False)
    out = wide(grey, ["-"] * 3, [{}] * 3)
    expected = [float(in_process(models.digits, [im], "-", "quality", "image", 2).split()[0]) for im in grey]
    assert out.scores.tolist() == expected and relay.most_open == 3


@needs_serve
@pytest.mark.slow
def test_video_frames_are_sent_uniformly_spaced_in_one_message(models, server):
    videos = judge_images(14, 3, seed=3).reshape(2, 7, 3, 32, 32).permute(0, 2, 1, 3, 4)  # (B, C, T, H, W)
    judge = OpenAIJudgeReward(base_url=server.url, model=str(models.digits), frames=3, max_tokens=2, score_range=[0, 9])
    out = judge(videos, ["a photo of 5", "a photo of 8"], [{}, {}])
    assert frame_indices(7, 3) == [0, 3, 6]
    expected = [
        int(in_process(models.digits, [v[:, 0], v[:, 3], v[:, 6]], p, "alignment", "video", 2).split()[0])
        for v, p in zip(videos, ["a photo of 5", "a photo of 8"])
    ]
    assert out.extras["raw"].tolist() == expected
    assert torch.equal(out.scores, torch.tensor([d / 9 for d in expected], dtype=torch.float32))


@needs_serve
@pytest.mark.slow
def test_yes_no_answers_and_unparsable_ones_score_nan_counted_and_warned(models, server):
    images = torch.cat([judge_images(6, 3, seed=1), torch.full((1, 3, 32, 32), math.nan)])  # the last one diverged
    prompts = [f"a photo of {i}" for i in range(7)]
    judge = OpenAIJudgeReward(base_url=server.url, model=str(models.yes_no), template="yes_no", max_tokens=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = judge(images, prompts, [{}] * 7)
    answers = [in_process(models.yes_no, [im], p, "yes_no", "image", 1) for im, p in zip(images[:6], prompts)]
    expected = [{"yes": 1.0, "no": 0.0}.get(a, math.nan) for a in answers] + [math.nan]
    bad = [a for a in answers if a not in ("yes", "no")]
    assert bad and len(bad) < 6, f"the tiny judge's answers {answers} should mix verdicts and other words"
    assert torch.allclose(out.scores, torch.tensor(expected), equal_nan=True)
    assert out.extras["unparsed"].tolist() == [float(a not in ("yes", "no")) for a in answers] + [0.0]  # a NaN sample is not sent
    assert out.extras["from_logprobs"].tolist() == [0.0] * 7  # transformers serve returns no log-probs
    messages = [one_sentence(str(w.message)) for w in caught]
    assert (
        f"{len(bad)} of 6 answers of judge server {server.url} did not give yes or no (e.g. '{bad[0]}'), so those samples "
        "score NaN." in messages
    )
    assert f"judge server {server.url} returned no yes/no log-probs, so yes/no scores come from the answer text (0 or 1)." in messages


# ----------------------------------------------------------------------------------------- failures: one sentence, bounded time


@needs_serve
@pytest.mark.slow
def test_a_4xx_is_not_retried_and_a_5xx_is(models, relay):
    refused = OpenAIJudgeReward(base_url=relay.url, model=str(models.digits), extra_body={"not_a_field": 1}, retry_for_s=60)
    start = time.monotonic()
    with pytest.raises(JudgeServerError) as e:
        refused(judge_images(1), ["x"], [{}])
    assert time.monotonic() - start < 10 and relay.connections == 1
    assert re.fullmatch(
        rf"judge server {re.escape(relay.url)} refused the request \(HTTP 422: [^\n]*'not_a_field'[^\n]*\)\.", one_sentence(str(e.value))
    ), str(e.value)  # the server's own message, e.g. "Unexpected fields in the request: ..."
    relay.reset()  # a model the server cannot load (no hub here) is its 500: retried, then one sentence
    missing = OpenAIJudgeReward(base_url=relay.url, model="nobody/no-such-judge", retries=2, backoff_s=0.1)
    with pytest.raises(JudgeServerError) as e:
        missing(judge_images(1), ["x"], [{}])
    assert relay.connections == 2
    assert one_sentence(str(e.value)) == f"judge server {relay.url} did not answer after 2 attempts (HTTP 500: Internal Server Error)."


def test_a_closed_port_ends_in_bounded_time():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    judge = OpenAIJudgeReward(base_url=f"http://127.0.0.1:{port}", model="judge", retry_for_s=1.5, backoff_s=0.2)
    start = time.monotonic()
    with pytest.raises(JudgeServerError) as e:
        judge(judge_images(2), ["a", "b"], [{}, {}])
    assert time.monotonic() - start < 4
    assert re.fullmatch(
        rf"judge server http://127\.0\.0\.1:{port}/v1 did not answer after \d+ attempts \(connection refused\)\.",
        one_sentence(str(e.value)),
    )


def test_a_silent_server_times_out_and_an_html_page_is_not_an_answer():
    silent = BadServer("silent")
    try:
        judge = OpenAIJudgeReward(base_url=silent.url, model="judge", timeout_s=0.5, retries=2, backoff_s=0.1)
        start = time.monotonic()
        with pytest.raises(JudgeServerError) as e:
            judge(judge_images(1), ["a"], [{}])
        assert 1.0 <= time.monotonic() - start < 4
        assert one_sentence(str(e.value)) == f"judge server {silent.url} did not answer after 2 attempts (timed out after 0.5 s)."
    finally:
        silent.close()
    html = BadServer("html")
    try:
        with pytest.raises(JudgeServerError) as e:
            OpenAIJudgeReward(base_url=html.url, model="judge")(judge_images(1), ["a"], [{}])
        assert one_sentence(str(e.value)) == f"judge server {html.url} sent an answer that is not JSON."
    finally:
        html.close()


# ----------------------------------------------------------------------------------------- parsing, as pure functions


def logprob_choice(positions, text=None):
    """An OpenAI chat-completion choice with log-probs: positions are (chosen token, {token: probability})."""
    content = [
        {
            "token": tok,
            "logprob": math.log(top[tok]) if tok in top else -9.0,
            "top_logprobs": [{"token": t, "logprob": math.log(p)} for t, p in top.items()],
        }
        for tok, top in positions
    ]
    return {
        "index": 0,
        "message": {"role": "assistant", "content": text if text is not None else "".join(t for t, _ in positions)},
        "logprobs": {"content": content},
    }


def test_yes_probability_from_top_logprobs():
    # P(yes) = 0.6 ("Yes") + 0.1 (" yes") = 0.7, P(no) = 0.2 ("No"): 0.7 / 0.9.
    choice = logprob_choice([("Yes", {"Yes": 0.6, "No": 0.2, " yes": 0.1, "Maybe": 0.05})])
    assert yes_probability(choice) == pytest.approx(0.7 / 0.9, abs=1e-12)
    # The first token that is yes or no decides: "The" is skipped; "NO" with yes at 0.3 -> 0.3 / (0.3 + 0.65).
    choice = logprob_choice(
        [
            ("The", {"The": 0.9, "Yes": 0.05}),
            (" answer", {" answer": 1.0}),
            (":", {":": 1.0}),
            (" NO", {" NO": 0.65, " Yes": 0.3, "maybe": 0.05}),
        ]
    )
    assert yes_probability(choice) == pytest.approx(0.3 / 0.95, abs=1e-12)
    # "no" alone in the list (yes below the top-k) counts yes as 0; the chosen token counts even if the list misses it.
    assert yes_probability(logprob_choice([("No", {"No": 0.97, "Nope": 0.02})])) == 0.0
    assert yes_probability(logprob_choice([("yes", {"sure": 0.5})])) == 1.0
    assert yes_probability({"message": {"content": "Yes"}}) is None  # no log-probs: the text decides
    assert yes_probability(logprob_choice([("Maybe", {"Maybe": 0.5, "Yes": 0.3})])) is None  # no yes/no token chosen

    judge = OpenAIJudgeReward(base_url="http://127.0.0.1:9/v1", model="judge", template="yes_no")
    with_lp = judge._verdict(logprob_choice([("Yes", {"Yes": 0.6, "No": 0.2, " yes": 0.1})]))
    assert (with_lp.score, with_lp.from_logprobs, with_lp.unparsed) == (pytest.approx(0.7 / 0.9), True, False)
    without = OpenAIJudgeReward(base_url="http://127.0.0.1:9/v1", model="judge", template="yes_no", logprobs=False)
    assert without._verdict(logprob_choice([("Yes", {"Yes": 0.6, "No": 0.2})])).score == 1.0


def test_number_and_text_parsing():
    assert parse_number("7") == 7.0 and parse_number("Score: 8.5/10") == 8.5 and parse_number(" -2 ") == -2.0
    assert parse_number("no idea") is None and parse_number("") is None
    unified = "The image shows a red car ... Alignment: 3\nFinal Score: 4.5"
    assert parse_number(unified) == 3.0 and parse_number(unified, r"Final Score:\s*([0-9.]+)") == 4.5
    assert answer_text({"message": {"content": "<think>maybe 3, maybe 9</think>\n6"}}) == "6"
    assert answer_text({"message": {"content": "reasoning about 2 things</think> 7"}}) == "7"
    assert answer_text({"message": {"content": None}}) == ""
    assert parse_yes_no("Yes, it does.") == 1.0 and parse_yes_no("**No**") == 0.0 and parse_yes_no("It does, yes.") == 1.0
    assert parse_yes_no("Could be yes or no.") is None and parse_yes_no("cat") is None and parse_yes_no("Nothing") is None
    judge = OpenAIJudgeReward(base_url="http://127.0.0.1:9/v1", model="judge")  # alignment: 0-10
    assert judge._verdict({"message": {"content": "8"}}).score == pytest.approx(0.8)
    out_of_range = judge._verdict({"message": {"content": "42"}})
    assert math.isnan(out_of_range.score) and out_of_range.unparsed
    # Images travel as RGB PNGs; image_size sets the longer side.
    import base64
    import io

    from PIL import Image

    url = image_data_url(judge_images(1, 1, height=24, width=40)[0], image_size=80)
    image = Image.open(io.BytesIO(base64.b64decode(url.removeprefix("data:image/png;base64,"))))
    assert url.startswith("data:image/png;base64,") and image.mode == "RGB" and image.size == (80, 48)


def test_configuration_errors_are_one_sentence(monkeypatch):
    monkeypatch.delenv("FLOWRL_JUDGE_URL", raising=False)
    cases = [
        (dict(), "the judge reward needs model: the name the server serves the judge under."),
        (
            dict(model="m", template="alignmnet"),
            "unknown judge template 'alignmnet'; choose one of alignment, quality, yes_no or write a sentence.",
        ),
        (dict(model="m", score_range=[5, 1]), "judge score_range must be two finite numbers with low < high, got [5, 1]."),
        (dict(model="m", score="stars"), "judge score must be one of number, yes_no, got 'stars'."),
        (dict(model="m", base_url="ftp://host"), "judge base_url 'ftp://host' must look like http://HOST:PORT/v1."),
        (dict(model="m", max_concurrency=0), "judge max_concurrency must be a positive integer, got 0."),
    ]
    for kwargs, message in cases:
        with pytest.raises(FlowRLError) as e:
            OpenAIJudgeReward(**kwargs)
        assert one_sentence(str(e.value)) == message
    with pytest.raises(FlowRLError) as e:
        OpenAIJudgeReward(model="m")(judge_images(1), ["a"], [{}])
    assert one_sentence(str(e.value)) == "the judge reward has no base_url; set reward.kwargs.openai_judge.base_url or FLOWRL_JUDGE_URL."
    custom = OpenAIJudgeReward(model="m", base_url="http://127.0.0.1:9", template="Is this the digit {digit}? Say {prompt}.")
    with pytest.raises(FlowRLError) as e:
        custom(judge_images(1), ["a"], [{}])
    assert one_sentence(str(e.value)) == "the judge template asks for {digit}, which sample 0's metadata does not have."
    assert custom._text(0, "a", {"digit": 7}, "image") == "Is this the digit 7? Say a."


def test_a_server_that_refuses_logprobs_is_asked_again_without_them(monkeypatch):
    """The fallback's control flow, with the transport replaced (no server here refuses log-probs with a 400)."""
    from flowrl.reward_models import openai_judge

    judge = OpenAIJudgeReward(base_url="http://127.0.0.1:9/v1", model="judge", template="yes_no")
    sent = []

    def post(endpoint, body, abort):
        sent.append(body)
        if "logprobs" in body:
            raise openai_judge._Refused("judge server http://127.0.0.1:9/v1 refused the request (HTTP 400: no logprobs).", 400)
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Yes."}}]}

    monkeypatch.setattr(judge, "_post", post)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = judge(judge_images(1), ["a"], [{}])
        judge(judge_images(1), ["a"], [{}])
    assert out.scores.tolist() == [1.0] and out.extras["from_logprobs"].tolist() == [0.0]
    assert [("logprobs" in b, b.get("top_logprobs")) for b in sent] == [(True, 10), (False, None), (False, None)]
    assert [str(w.message) for w in caught if "refused log-probs" in str(w.message)] == [
        "judge server http://127.0.0.1:9/v1 refused log-probs (HTTP 400), so yes/no scores come from the answer text."
    ]
