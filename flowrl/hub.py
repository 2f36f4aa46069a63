"""The Hugging Face Hub, reachable or not: a bounded probe before a hub id is loaded, so a missing network is one
sentence saying so (after at most ``HF_HUB_ETAG_TIMEOUT`` seconds) instead of minutes of retries ending in "the
repository has no model_index.json". Used by the model families (flowrl/pipelines/diffusers_base.py) and the
model-based rewards (flowrl/reward_models/clip_common.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .errors import FlowRLError

_HUB_PROBES: dict[tuple[str, float], str | None] = {}  # (endpoint, timeout) -> None (reachable) or why not, once per process


def hub_unreachable_reason() -> str | None:
    """None when the hub (``HF_ENDPOINT``, default https://huggingface.co) answers within ``HF_HUB_ETAG_TIMEOUT``
    seconds (default 10) with any HTTP status; else why not ("no answer", "[Errno -2] Name or service not known").
    The request runs in a thread joined with that timeout, so even a name lookup that hangs is bounded."""
    import threading

    from huggingface_hub import constants, get_session

    key = (constants.ENDPOINT, float(constants.HF_HUB_ETAG_TIMEOUT))
    if key not in _HUB_PROBES:
        result: list[str | None] = []

        def probe() -> None:
            try:
                get_session().head(key[0], timeout=key[1])
                result.append(None)
            except Exception as e:  # httpx / requests connection errors and timeouts, OfflineModeIsEnabled
                result.append(_connection_reason(e))

        thread = threading.Thread(target=probe, name="flowrl-hub-probe", daemon=True)
        thread.start()
        thread.join(key[1] + 1)
        _HUB_PROBES[key] = result[0] if result else "no answer"
    return _HUB_PROBES[key]


def _connection_reason(e: BaseException) -> str:
    names = " ".join(c.__name__ for c in type(e).__mro__)
    if "Timeout" in names:
        return "no answer"
    first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
    return first


def is_connection_failure(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it was raised from) says the hub could not be reached, as opposed to a file
    the hub or the cache does not have: huggingface_hub's LocalEntryNotFoundError / OfflineModeIsEnabled,
    an httpx or requests connection error or timeout."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        names = {c.__name__ for c in type(e).__mro__}
        if names & {"LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectError", "ConnectionError", "ConnectTimeout"}:
            return True
        if any("Timeout" in n for n in names) or "couldn't connect to" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def hub_unreachable(repo_id: str, what: str, instead: str, reason: str | None = None) -> FlowRLError:
    """The one sentence for a hub id that can be neither downloaded nor found in the local cache."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        why = "HF_HUB_OFFLINE is set"
    else:
        wait = (
            f"{reason}; flowrl waits at most {float(constants.HF_HUB_ETAG_TIMEOUT):g} s, HF_HUB_ETAG_TIMEOUT" if reason else "while loading"
        )
        why = f"the Hugging Face Hub ({constants.ENDPOINT}) could not be reached ({wait})"
    return FlowRLError(
        f"{what} '{repo_id}' is a hub id, but {why} and the model is not in the local cache; download it where the hub "
        f"can be reached (hf download {repo_id} --local-dir DIR) and {instead}."
    )


def check_hub(repo_id: str, revision: str | None, what: str, instead: str) -> bool:
    """Before a hub id is loaded: whether the loads must read the local cache only (the hub cannot be reached, or
    HF_HUB_OFFLINE is set, and the model is cached); FlowRLError (:func:`hub_unreachable`) when it is not cached.
    Without this a missing network shows as minutes of retries, then as a repository that lacks a file."""
    import sys

    from huggingface_hub import constants, snapshot_download

    def cached() -> bool:
        try:
            snapshot_download(repo_id, revision=revision, local_files_only=True)
            return True
        except Exception:  # LocalEntryNotFoundError, an invalid id (left to the load to name)
            return False

    reason = None if constants.HF_HUB_OFFLINE else hub_unreachable_reason()
    if reason is None and not constants.HF_HUB_OFFLINE:
        return False
    if cached():
        if reason is not None:
            print(
                f"flowrl: the Hugging Face Hub ({constants.ENDPOINT}) could not be reached ({reason}); loading '{repo_id}' "
                "from the local cache.",
                file=sys.stderr,
            )
        return True
    raise hub_unreachable(repo_id, what, instead, reason)


def download_files(repo_id: str, filenames: Sequence[str], instead: str) -> list[Path]:
    """Each of ``filenames`` from the hub repo ``repo_id`` (or the local cache), for a model that is a few files rather
    than a ``from_pretrained`` directory (HPSv2, ImageReward); any failure is one sentence naming the files and what
    the user can do ``instead``."""
    try:
        from huggingface_hub import hf_hub_download

        return [Path(hf_hub_download(repo_id, name)) for name in filenames]
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FlowRLError(f"could not fetch {' / '.join(filenames)} from the hub repo '{repo_id}' ({first}); {instead}.") from e
