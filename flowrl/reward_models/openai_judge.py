"""A vision-language model as a judge: score images and videos through any OpenAI-compatible chat endpoint.

    reward:
      components: {openai_judge: 1.0}
      kwargs:
        openai_judge: {base_url: "http://127.0.0.1:8000/v1", model: "Qwen/Qwen2.5-VL-7B-Instruct", template: yes_no}

Each sample becomes one ``POST {base_url}/chat/completions`` request: one user message holding the image (a
video: ``frames`` uniformly spaced frames, in order) as base64 PNG data URLs, then the text of a prompt template
filled with the sample's prompt and metadata. The answer becomes a score in one of two ways (``score``):

- ``"number"``: the first number in the answer text (or the first group of ``score_regex``), which must lie in
  ``score_range``; mapped linearly to [0, 1] unless ``normalize`` is false.
- ``"yes_no"``: P(yes) / (P(yes) + P(no)) read from the token log-probs of the first answer token that is "yes"
  or "no", where the server returns them (vLLM and SGLang do, with ``top_logprobs``); otherwise 1 for an answer
  that says yes and 0 for one that says no.

An answer that gives no score (no number, a number out of range, neither yes nor no) is NaN for that sample
("could not score": the trainer leaves it out of the update and counts it), counted in the ``unparsed`` extra
and reported in one warning per call. A server that stays unreachable (connection refused, timeouts, 5xx,
429) after the retries, a request it refuses (other 4xx: a wrong model name, a bad key, a field it does not
know), or a reply that is not a chat completion raises ``JudgeServerError`` with one sentence: a judge that does
not work must stop the run, not train it on NaNs. Requests run at most ``max_concurrency`` at a time.

Only the standard library speaks HTTP here, as in ``remote.py``: the chat-completions request is one JSON
POST, and owning the loop keeps flowrl's retry semantics (a deadline ``retry_for_s`` after which a dead
server ends the run in bounded time, jittered exponential backoff, Retry-After, no retry on 4xx), its
one-sentence errors, and the raw JSON reply (log-probs included) without an SDK between them. The price:
no HTTP proxy support (``HTTP(S)_PROXY`` are not read); reach a remote judge directly or through an SSH tunnel.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import random
import re
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.reward_models import http_post
from flowrl.reward_models.http_post import TRANSPORT_ERRORS, Endpoint, backoff_seconds, failure_cause, is_loopback, parse_server_url, post
from flowrl.types import RewardOutput

URL_ENV = "FLOWRL_JUDGE_URL"
MAX_RESPONSE_BYTES = 16 * 2**20
RETRIED_4XX = (408, 429)  # request timeout and rate limit: the same request may succeed later
SCORE_MODES = ("number", "yes_no")
NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"

# name -> (template, score mode, score range). {media} is "image" or "video"; {prompt} the sample's prompt;
# any other {field} is read from the sample's metadata.
TEMPLATES: dict[str, tuple[str, str, tuple[float, float] | None]] = {
    "alignment": (
        'How well does this {media} match the description "{prompt}"? Rate it from 0 to 10, where 0 means '
        "unrelated and 10 means every part of the description is shown. Answer with the number only.",
        "number",
        (0.0, 10.0),
    ),
    "quality": (
        "Rate the visual quality of this {media} from 0 to 10 (sharpness, detail, absence of artifacts and "
        "distortions, aesthetics), regardless of its subject. Answer with the number only.",
        "number",
        (0.0, 10.0),
    ),
    "yes_no": ('Does this {media} show "{prompt}"? Answer yes or no.', "yes_no", None),
}


class JudgeServerError(FlowRLError):
    """The judge server could not be reached, refused a request or sent something that is not a chat completion."""


class _Refused(JudgeServerError):
    """A 4xx answer that is not worth retrying (the status lets the caller drop log-probs and try once more)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class _Aborted(Exception):
    """Another request of the same call failed for good: stop retrying this one."""


# ---------------------------------------------------------------------------------------------- parsing
_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL | re.IGNORECASE)
_WORD = re.compile(r"[a-z]+")


def answer_text(choice: Mapping[str, Any]) -> str:
    """The answer of one chat-completion choice, reasoning left out (a ``<think>`` block, or all before ``</think>``)."""
    content = (choice.get("message") or {}).get("content") or ""
    if isinstance(content, list):  # content parts, as some servers send them
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    content = str(content)
    if "</think>" in content.lower() and "<think>" not in content.lower():  # the template opened the block itself
        content = content[content.lower().rindex("</think>") + len("</think>") :]
    return _THINK.sub(" ", content).strip()


def parse_number(text: str, score_regex: str | None = None) -> float | None:
    """The first number of ``text`` (or the first group of ``score_regex``, else its whole match); None if none."""
    match = re.search(score_regex, text, re.IGNORECASE | re.DOTALL) if score_regex else re.search(NUMBER, text)
    if match is None:
        return None
    found = match.group(1) if match.re.groups else match.group(0)
    number = re.search(NUMBER, found or "")
    value = float(number.group(0)) if number else math.nan
    return value if math.isfinite(value) else None


def parse_yes_no(text: str) -> float | None:
    """1.0 for an answer that says yes, 0.0 for one that says no, None otherwise.

    The first word decides ("Yes, it does." -> 1, "**No**" -> 0); an answer whose first word is neither
    counts only if it holds exactly one of the two words ("It does, yes." -> 1, "Could be yes or no." -> None).
    """
    words = _WORD.findall(text.lower())
    if words and words[0] in ("yes", "no"):
        return 1.0 if words[0] == "yes" else 0.0
    found = {w for w in words if w in ("yes", "no")}
    return (1.0 if found == {"yes"} else 0.0) if len(found) == 1 else None


def _yes_no_token(token: Any) -> str | None:
    """'yes' or 'no' for a token that spells it (any case, leading space or marker, surrounding punctuation)."""
    if not isinstance(token, str):
        return None
    word = token.replace("\u0120", " ").replace("\u2581", " ").strip().strip("*_.,:;!\"'`").lower()
    return word if word in ("yes", "no") else None


def yes_probability(choice: Mapping[str, Any]) -> float | None:
    """P(yes) / (P(yes) + P(no)) at the first answer token that is "yes" or "no", from OpenAI-style log-probs.

    ``choice["logprobs"]["content"]`` is a list of {"token", "logprob", "top_logprobs": [{"token", "logprob"}]}.
    At the first position whose chosen token spells yes or no, every candidate (the chosen one and its top
    alternatives) that spells yes adds exp(logprob) to P(yes), likewise for no; a word missing from the top
    list counts 0. None when there are no log-probs or no yes/no token (the caller then reads the text).
    """
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), Mapping) else None
    for position in content or []:
        if not isinstance(position, Mapping) or _yes_no_token(position.get("token")) is None:
            continue
        candidates = {}
        for candidate in [position, *(position.get("top_logprobs") or [])]:
            if isinstance(candidate, Mapping) and isinstance(candidate.get("logprob"), (int, float)):
                candidates.setdefault(candidate.get("token"), float(candidate["logprob"]))  # a token listed twice counts once
        p = {"yes": 0.0, "no": 0.0}
        for token, logprob in candidates.items():
            word = _yes_no_token(token)
            if word is not None:
                p[word] += math.exp(logprob)
        total = p["yes"] + p["no"]
        return p["yes"] / total if total > 0 and math.isfinite(total) else None
    return None


# ---------------------------------------------------------------------------------------------- images
def frame_indices(num_frames: int, frames: int) -> list[int]:
    """``frames`` uniformly spaced frame indices from first to last (all frames if there are not more)."""
    if num_frames <= frames:
        return list(range(num_frames))
    if frames == 1:
        return [0]
    return [round(i * (num_frames - 1) / (frames - 1)) for i in range(frames)]


def image_data_url(pixels: Tensor, image_size: int | None = None) -> str:
    """A (C, H, W) image in [0, 1] (C = 1 or 3) as an RGB PNG data URL, its longer side resized to ``image_size``."""
    from PIL import Image

    array = (pixels.detach().to("cpu", torch.float32).clamp(0, 1) * 255).round().to(torch.uint8)
    array = array.expand(3, -1, -1) if array.shape[0] == 1 else array  # judges read RGB; a grey image as three equal channels
    image = Image.fromarray(array.permute(1, 2, 0).contiguous().numpy())
    if image_size is not None and max(image.size) != image_size:
        scale = image_size / max(image.size)
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        image = image.resize(size, Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


# ---------------------------------------------------------------------------------------------- transport
def parse_base_url(url: str) -> Endpoint:
    """``http(s)://HOST[:PORT][/PATH]``: ``/chat/completions`` is appended, and an empty path reads as ``/v1``."""
    return parse_server_url(url, "judge base_url", "http://HOST:PORT/v1", "/chat/completions", "/v1")


def _error_message(data: bytes) -> str:
    """The server's error text: OpenAI's {"error": {"message"}}, vLLM's {"message"}, FastAPI's {"detail"}."""
    try:
        answer = json.loads(data)
    except (ValueError, RecursionError):
        answer = data.decode("utf-8", "replace") if data[:1] not in (b"<",) else ""  # not an HTML error page
    if isinstance(answer, Mapping):
        error = answer.get("error")
        answer = (error.get("message") if isinstance(error, Mapping) else error) or answer.get("message") or answer.get("detail") or ""
    if not isinstance(answer, str):
        answer = json.dumps(answer)
    return " ".join(answer.split()).rstrip(".")[:300]


@dataclass
class _Judged:
    """One sample's verdict."""

    score: float  # NaN when the answer gives no score
    raw: float  # the number answered (number mode), P(yes) or 1/0 (yes/no mode); NaN when unparsed
    unparsed: bool
    from_logprobs: bool
    text: str
    logprobs_returned: bool = False  # the reply carried log-probs (whether or not they held a yes/no token)


class OpenAIJudgeReward:
    """Score images or videos by asking a vision-language model behind an OpenAI-compatible chat endpoint.

    Args:
        base_url:        the server's API root, e.g. ``http://127.0.0.1:8000/v1`` (``/chat/completions`` is appended; a
                         URL without a path gets ``/v1``); None reads FLOWRL_JUDGE_URL when the reward is first called.
        model:           the model name the server serves (vLLM: the ``vllm serve`` argument or ``--served-model-name``).
        api_key_env:     the environment variable that holds the API key (sent as a Bearer token when set); keys never
                         go into configs.
        template:        a preset (``alignment``, ``quality``: a 0-10 number; ``yes_no``) or a template of your own; it is
                         filled with ``{prompt}``, ``{media}`` ("image" or "video") and any metadata field (``{digit}``);
                         write literal braces as ``{{`` and ``}}``.
        score:           "number" or "yes_no"; None takes the preset's ("number" for a template of your own).
        score_range:     [low, high] of the numbers the template asks for (the preset's, else [0, 10]); an answer
                         outside is unparsed.
        normalize:       map numbers to (x - low) / (high - low) in [0, 1]; false keeps the raw number.
        score_regex:     where to find the number in a chatty answer (its first group, else its whole match), e.g.
                         ``"Final Score:\\s*([0-9.]+)"``; None takes the first number of the answer.
        system:          an optional system message.
        logprobs:        ask for token log-probs in yes/no mode and score P(yes) / (P(yes) + P(no)); a server that
                         returns none (or refuses them with a 400) leaves the text answer to decide.
        top_logprobs:    alternatives per token to ask for (vLLM allows 20 unless started with ``--max-logprobs``).
        max_tokens:      answer length limit; give reasoning models and judges that explain (UnifiedReward) more; None
                         leaves it out of the request (for APIs that want ``max_completion_tokens`` in ``extra_body``).
        temperature:     0 for a deterministic judge; None leaves it out of the request.
        frames:          frames of a video sent, uniformly spaced from the first to the last, as images in one message.
        image_size:      resize each image so that its longer side is this many pixels (None: as generated).
        max_concurrency: requests in flight at once.
        timeout_s:       seconds each socket operation of one attempt may take (connect, send, wait for the answer).
        retry_for_s:     seconds from a request's first attempt during which connection errors, timeouts, 5xx, 408 and
                         429 answers are retried with jittered exponential backoff (``backoff_s * 2**k``, at most 30 s,
                         at least the server's Retry-After); then the reward raises.
        retries:         at most this many attempts per request (None: as many as ``retry_for_s`` allows).
        extra_body:      more fields for each request, e.g. ``{"chat_template_kwargs": {"enable_thinking": false}}``.
        backoff_s:       the base of the retry backoff, in seconds (see retry_for_s).
        name:            the component's name in logs and errors.
    """

    def __init__(
        self,
        base_url: str | None = None,
        model: str | None = None,
        api_key_env: str = "OPENAI_API_KEY",
        template: str = "alignment",
        score: str | None = None,
        score_range: Sequence[float] | None = None,
        normalize: bool = True,
        score_regex: str | None = None,
        system: str | None = None,
        logprobs: bool = True,
        top_logprobs: int = 10,
        max_tokens: int | None = 32,
        temperature: float | None = 0.0,
        frames: int = 4,
        image_size: int | None = None,
        max_concurrency: int = 8,
        timeout_s: float = 60.0,
        retry_for_s: float = 120.0,
        retries: int | None = None,
        backoff_s: float = 1.0,
        extra_body: Mapping[str, Any] | None = None,
        name: str = "openai_judge",
    ) -> None:
        if not model or not isinstance(model, str):
            raise FlowRLError("the judge reward needs model: the name the server serves the judge under.")
        self.template, preset_score, preset_range = self._resolve_template(template)
        self.score = score or preset_score
        if self.score not in SCORE_MODES:
            raise FlowRLError(f"judge score must be one of {', '.join(SCORE_MODES)}, got {score!r}.")
        low, high = self._check_range(score_range if score_range is not None else preset_range or (0.0, 10.0))
        max_tokens_given = 1 if max_tokens is None else max_tokens  # None: left out of the request
        self._check_counts(top_logprobs=top_logprobs, max_tokens=max_tokens_given, frames=frames, max_concurrency=max_concurrency)
        if image_size is not None and not (isinstance(image_size, int) and image_size >= 1):
            raise FlowRLError(f"judge image_size must be a positive integer or null, got {image_size!r}.")
        if retries is not None and not (isinstance(retries, int) and retries >= 1):
            raise FlowRLError(f"judge retries must be a positive integer (attempts in all) or null, got {retries!r}.")
        numbers = {"timeout_s": timeout_s, "retry_for_s": retry_for_s, "backoff_s": backoff_s, "temperature": temperature or 0.0}
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in numbers.values()) or timeout_s <= 0:
            raise FlowRLError(f"judge timeout_s must be positive and retry_for_s, backoff_s and temperature non-negative, got {numbers}.")
        self._check_regex(score_regex)
        self.name, self.differentiable = name, False
        self.model, self.api_key_env, self.system = model, api_key_env, system
        self.score_range, self.normalize, self.score_regex = (low, high), bool(normalize), score_regex
        self.logprobs, self.top_logprobs = bool(logprobs) and self.score == "yes_no", top_logprobs
        self.max_tokens, self.temperature, self.frames, self.image_size = max_tokens, temperature, frames, image_size
        self.max_concurrency, self.timeout_s, self.retry_for_s = max_concurrency, float(timeout_s), float(retry_for_s)
        self.retries, self.backoff_s = retries, float(backoff_s)
        self.extra_body = dict(extra_body or {})
        try:
            json.dumps(self.extra_body)
        except (TypeError, ValueError):
            raise FlowRLError(f"judge extra_body must hold JSON values only, got {extra_body!r}.") from None
        self.endpoint = self._set_url(base_url) if base_url is not None else None
        self._jitter = random.Random()  # seeded by the OS: processes that failed together must not retry in step
        self._said: set[str] = set()  # one-time warnings already given

    @staticmethod
    def _resolve_template(template: str) -> tuple[str, str, tuple[float, float] | None]:
        if template in TEMPLATES:
            return TEMPLATES[template]
        if not isinstance(template, str) or not template.split() or len(template.split()) == 1:
            raise FlowRLError(f"unknown judge template {template!r}; choose one of {', '.join(TEMPLATES)} or write a sentence.")
        try:
            template.format_map(_AnyField())
        except (ValueError, IndexError) as e:
            raise FlowRLError(
                f"judge template {template[:60]!r} is not a valid format string ({e}); write literal braces as {{{{ and }}}}."
            ) from None
        return template, "number", None

    @staticmethod
    def _check_counts(**counts: Any) -> None:
        """Each count is a positive integer (checked in the order given: the first bad one is named)."""
        for label, value in counts.items():
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise FlowRLError(f"judge {label} must be a positive integer, got {value!r}.")

    @staticmethod
    def _check_regex(score_regex: str | None) -> None:
        if score_regex is not None:
            try:
                re.compile(score_regex)
            except re.error as e:
                raise FlowRLError(f"judge score_regex {score_regex!r} is not a valid regular expression ({e}).") from None

    @staticmethod
    def _check_range(score_range: Sequence[float]) -> tuple[float, float]:
        try:
            low, high = (float(v) for v in score_range)
        except (TypeError, ValueError):
            raise FlowRLError(f"judge score_range must be [low, high], got {score_range!r}.") from None
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise FlowRLError(f"judge score_range must be two finite numbers with low < high, got {score_range!r}.")
        return low, high

    def _set_url(self, url: str) -> Endpoint:
        endpoint = parse_base_url(url)
        if os.environ.get(self.api_key_env) and endpoint.scheme == "http" and not is_loopback(endpoint.host):
            warnings.warn(
                f"the judge API key is sent in clear text to {endpoint.url}; use https or an SSH tunnel outside a trusted network.",
                stacklevel=3,
            )
        return endpoint

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            warnings.warn(message, stacklevel=4)

    # ------------------------------------------------------------------ requests
    def _text(self, index: int, prompt: str, metadata: Mapping[str, Any], media: str) -> str:
        fields = {str(k): v.item() if isinstance(v, Tensor) and v.numel() == 1 else v for k, v in metadata.items()}
        fields.update(prompt=prompt, media=media)
        try:
            return self.template.format_map(fields)
        except KeyError as e:
            raise FlowRLError(f"the judge template asks for {{{e.args[0]}}}, which sample {index}'s metadata does not have.") from None
        except (AttributeError, IndexError, TypeError, ValueError) as e:
            raise FlowRLError(f"the judge template cannot be filled for sample {index} ({e}).") from None

    def _body(self, sample: Tensor, text: str) -> dict[str, Any]:
        """The chat-completion request for one sample (encoded in a worker thread: PNG compression releases the GIL)."""
        frames = [sample[:, t] for t in frame_indices(sample.shape[1], self.frames)] if sample.ndim == 4 else [sample]
        content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": image_data_url(f, self.image_size)}} for f in frames]
        content.append({"type": "text", "text": text})
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [{"role": "user", "content": content}]
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            body["temperature"] = float(self.temperature)
        if self.logprobs and "logprobs_refused" not in self._said:
            body.update(logprobs=True, top_logprobs=self.top_logprobs)
        body.update(self.extra_body)
        return body

    def _failure(self, endpoint: Endpoint, data: bytes) -> tuple[str | None, int, bytes, float | None]:
        """One attempt: (why it is worth another, or None), status, payload, Retry-After."""
        try:
            status, payload, retry_after = post(
                endpoint, data, "application/json", self.timeout_s, os.environ.get(self.api_key_env), max_bytes=MAX_RESPONSE_BYTES
            )
        except TRANSPORT_ERRORS as e:
            return failure_cause(e, self.timeout_s, "judge server", endpoint.url, JudgeServerError), 0, b"", None
        if status >= 500 or status in RETRIED_4XX:
            message = _error_message(payload)
            return (f"HTTP {status}: {message}" if message else f"HTTP {status}"), status, payload, retry_after
        return None, status, payload, retry_after

    def _post(self, endpoint: Endpoint, body: dict[str, Any], abort: threading.Event) -> dict[str, Any]:
        """POST one request, retrying what may pass later until ``retry_for_s`` is spent; the reply as JSON."""
        data = json.dumps(body).encode()
        cause, attempt, start, retry_after = "", 0, time.monotonic(), None
        while True:
            if attempt:
                left = self.retry_for_s - (time.monotonic() - start)
                if (self.retries is not None and attempt >= self.retries) or left <= 0:
                    break
                wait_s = backoff_seconds(attempt, self.backoff_s, retry_after, self._jitter)
                if abort.wait(min(wait_s, left)):
                    raise _Aborted
            if abort.is_set():
                raise _Aborted
            attempt += 1
            failure, status, payload, retry_after = self._failure(endpoint, data)
            if failure is not None:
                cause = failure
                continue
            if status != 200:
                message = _error_message(payload)
                detail = f"HTTP {status}: {message}" if message else f"HTTP {status}"
                raise _Refused(f"judge server {endpoint.url} refused the request ({detail}).", status)
            return http_post.json_answer(payload, "judge server", endpoint.url, JudgeServerError, MAX_RESPONSE_BYTES)
        raise JudgeServerError(f"judge server {endpoint.url} did not answer after {attempt} attempt{'s' * (attempt != 1)} ({cause}).")

    def _choice(self, endpoint: Endpoint, body: dict[str, Any], abort: threading.Event) -> Mapping[str, Any]:
        """The first choice of the server's chat completion; a request refused because of its log-probs goes again without."""
        try:
            answer = self._post(endpoint, body, abort)
        except _Refused as e:
            if "logprobs" not in body or e.status not in (400, 422):
                raise
            body = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
            answer = self._post(endpoint, body, abort)  # raises again if the log-probs were not the problem
            self._warn_once(
                "logprobs_refused",
                f"judge server {endpoint.url} refused log-probs (HTTP {e.status}), so yes/no scores come from the answer text.",
            )
        choices = answer.get("choices") if isinstance(answer, Mapping) else None
        first = choices[0] if isinstance(choices, list) and choices else None
        if not (isinstance(first, Mapping) and isinstance(first.get("message"), Mapping)):
            raise JudgeServerError(f"judge server {endpoint.url} sent JSON that is not a chat completion (no choices[0].message).")
        return first

    # ------------------------------------------------------------------ scoring
    def _verdict(self, choice: Mapping[str, Any]) -> _Judged:
        text = answer_text(choice)
        if self.score == "yes_no":
            p = yes_probability(choice) if self.logprobs else None
            value = p if p is not None else parse_yes_no(text)
            returned = bool((choice.get("logprobs") or {}).get("content")) if isinstance(choice.get("logprobs"), Mapping) else False
            if value is None:
                return _Judged(math.nan, math.nan, True, False, text, returned)
            return _Judged(value, value, False, p is not None, text, returned)
        value = parse_number(text, self.score_regex)
        low, high = self.score_range
        if value is None or not low <= value <= high:
            return _Judged(math.nan, math.nan, True, False, text)
        return _Judged((value - low) / (high - low) if self.normalize else value, value, False, False, text)

    def _judge_all(self, endpoint: Endpoint, samples: Tensor, texts: dict[int, str]) -> dict[int, _Judged]:
        """Every request, at most ``max_concurrency`` at once; the first failure for good stops the others and is raised."""
        abort = threading.Event()

        def judge(i: int) -> Mapping[str, Any]:
            return self._choice(endpoint, self._body(samples[i], texts[i]), abort)

        pool = ThreadPoolExecutor(min(self.max_concurrency, len(texts)), thread_name_prefix="flowrl-judge")
        try:
            futures = {pool.submit(judge, i): i for i in texts}
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None and not isinstance(f.exception(), _Aborted)]
            if failed:
                raise failed[0].exception()
            return {futures[f]: self._verdict(f.result()) for f in futures}
        finally:  # on a failure (or Ctrl-C) requests waiting to retry give up; one in flight ends within timeout_s
            abort.set()
            pool.shutdown(wait=False, cancel_futures=True)

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        if self.endpoint is None:
            url = os.environ.get(URL_ENV)
            if not url:
                raise FlowRLError(f"the judge reward has no base_url; set reward.kwargs.{self.name}.base_url or {URL_ENV}.")
            self.endpoint = self._set_url(url)
        n = samples.shape[0]
        if samples.ndim not in (4, 5) or samples.shape[1] not in (1, 3):
            raise FlowRLError(
                f"the judge reward scores (B, 1 or 3, H, W) images or (B, 1 or 3, T, H, W) videos, got shape {tuple(samples.shape)}."
            )
        if len(prompts) != n or len(metadata) != n:
            raise FlowRLError(f"the judge reward got {n} samples but {len(prompts)} prompts and {len(metadata)} metadata entries.")
        # A non-finite sample (a diverged rollout) cannot be encoded as an image: NaN without asking, as other rewards score it.
        finite = torch.isfinite(samples.detach().reshape(n, -1)).all(dim=1).cpu().tolist() if n else []
        media = "video" if samples.ndim == 5 else "image"
        texts = {i: self._text(i, str(prompts[i]), metadata[i], media) for i in range(n) if finite[i]}
        verdicts = self._judge_all(self.endpoint, samples.detach().cpu(), texts) if texts else {}
        self._report(verdicts)

        def column(field: str) -> Tensor:
            values = [
                float(getattr(verdicts[i], field)) if i in verdicts else (0.0 if field in ("unparsed", "from_logprobs") else math.nan)
                for i in range(n)
            ]
            return torch.tensor(values, dtype=torch.float32, device=samples.device)

        extras = {"unparsed": column("unparsed"), "raw": column("raw")}
        if self.score == "yes_no":
            extras["from_logprobs"] = column("from_logprobs")
        return RewardOutput(scores=column("score"), extras=extras)

    def _report(self, verdicts: dict[int, _Judged]) -> None:
        """One warning for the answers that gave no score; one (ever) when log-probs were asked for and none came."""
        unparsed = [v for v in verdicts.values() if v.unparsed]
        if unparsed:
            example = " ".join(unparsed[0].text.split())
            example = example if len(example) <= 80 else example[:77] + "..."
            what = f"a number in [{self.score_range[0]:g}, {self.score_range[1]:g}]" if self.score == "number" else "yes or no"
            warnings.warn(
                f"{len(unparsed)} of {len(verdicts)} answers of judge server {self.endpoint.url} did not give {what} "
                f"(e.g. {example!r}), so those samples score NaN.",
                stacklevel=3,
            )
        if self.logprobs and verdicts and not any(v.logprobs_returned for v in verdicts.values()):
            self._warn_once(
                "no_logprobs",
                f"judge server {self.endpoint.url} returned no yes/no log-probs, so yes/no scores come from the answer text (0 or 1).",
            )


class _AnyField(dict):
    """Fills every named field of a template with an empty string: checks a template's syntax without metadata."""

    def __missing__(self, key: str) -> str:
        return ""
