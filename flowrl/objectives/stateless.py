"""The answer to the Objective protocol's ``state_dict`` / ``load_state_dict`` for an objective that keeps nothing
between iterations: a resumed run rebuilds it from its config and continues bit for bit."""

from __future__ import annotations

from typing import Any


class Stateless:
    """Mixed into an objective (or an advantage estimator) whose every number comes from its config and the batch
    (AWM, D3PO, Diffusion-DPO, the diffusion-LM objectives, group advantages): its checkpoint entry is empty."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
