"""The reward server's YAML configuration and its shared secret."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from pydantic import Field, ValidationError, field_validator

from flowrl.config import RewardConfig, Section, _describe, read_yaml_mapping
from flowrl.errors import FlowRLError

DEFAULT_TOKEN_ENV = "FLOWRL_REWARD_TOKEN"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class ServerConfig(Section):
    """``flowrl serve-reward`` configuration (YAML). Unknown keys are rejected."""

    reward: RewardConfig = Field(description="The reward served, the same shape as a training config's reward section.")
    host: str = Field("127.0.0.1", description="Address to listen on; loopback unless another is asked for explicitly.")
    port: int = Field(0, ge=0, le=65535, description="Port to listen on; 0: a free one (printed on start).")
    token_env: str = Field(DEFAULT_TOKEN_ENV, description="Environment variable holding the shared secret clients must send.")
    allow_no_token: bool = Field(False, description="Serve without a token: anyone who can connect can score.")
    max_request_bytes: int = Field(64 * 2**20, ge=1, description="Largest request body in bytes, and the limit of its decoded pixels.")
    max_batch: int = Field(256, ge=1, description="Samples per request at most, and per merged model batch.")
    device: str = Field("auto", description='Where the reward runs: "auto" is CUDA when present, else the CPU.')
    # Dynamic batching; off for a reward whose score of a sample depends on its batch
    coalesce: bool = Field(
        True, description="Merge requests of the same sample shape, from any clients, into one reward call of up to max_batch."
    )
    max_wait_ms: float = Field(
        5.0, ge=0, le=60_000, description="Milliseconds a batch's first request waits for others (a full batch goes at once)."
    )
    max_connections: int = Field(64, ge=1, description="Scoring requests in flight at most; more get 503 + Retry-After at once.")

    @field_validator("host", "token_env")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v == "auto":
            return v
        try:
            torch.device(v)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"{v!r} is not a torch device ({str(e).splitlines()[0]})") from None
        return v


def load_server_config(path: str | Path) -> ServerConfig:
    """Read and validate a server YAML; every problem is a one-sentence FlowRLError."""
    tree = read_yaml_mapping(path, "reward server config")
    try:
        return ServerConfig.model_validate(tree)
    except ValidationError as e:
        raise FlowRLError(_describe(e.errors()[0]) + ".") from None


def resolve_token(config: ServerConfig) -> str | None:
    """The shared secret from ``config.token_env``; None only when ``allow_no_token`` permits it."""
    token = os.environ.get(config.token_env, "")
    if token:
        return token
    if config.allow_no_token:
        return None
    raise FlowRLError(
        f"the reward server needs a shared secret: set the environment variable {config.token_env} "
        "(or set allow_no_token: true to serve without one)."
    )


def resolve_device(device: str) -> str:
    """ "auto": CUDA when present; any other device must exist here (refused in one sentence, not at the first request)."""
    if device != "auto":
        from flowrl.config import resolve_device as resolve

        return str(resolve(device, key="device"))  # the server config's key
    return "cuda" if torch.cuda.is_available() else "cpu"
