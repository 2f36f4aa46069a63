"""Rewards: callables that score decoded samples against their prompts (see ``flowrl.types.Reward``).

``registry.py`` holds the table of reward names (``REWARDS``) and builds one by name; ``mix.py`` the ``reward``
section of a run and the weighted sum it describes; one file per reward beside them.
"""

from __future__ import annotations

from .mix import RewardConfig, build_reward_from_config
from .registry import REWARD_NAMES, REWARDS, as_reward, build_reward

__all__ = ["REWARDS", "REWARD_NAMES", "RewardConfig", "as_reward", "build_reward", "build_reward_from_config"]
