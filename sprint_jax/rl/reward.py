"""Rewards and group advantages of P-GRPO (ThreadWeaver, Lian et al., arXiv 2512.07843, section 4).

Reward of one trajectory (one orchestrator run):
    r = correct + [correct] * min(rho * eta, rho_clip),   eta = 1 - L_longest / L_total
where L_longest is the run's sequential (critical-path) token count and L_total its total generated
tokens (RunRecord accounting, docs/design.md
"The orchestrator and its accounting"). The acceleration bonus is granted only to
a correct answer, so a wrong but parallel trajectory is never preferred to a right serial one; a
sequential run has eta = 0 and so no bonus (the RFT-side baseline is this recipe with rho = 0).

Advantage: the reward minus the mean of its prompt's group of G runs (no division by the standard
deviation by default, as in the paper; `std_normalise` divides by std + eps for the ablation).
Every completion token of every unit of the trajectory gets that one number (rl/layout.py).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass
class RewardConfig:
    """The acceleration reward (ThreadWeaver §4)."""
    rho: float = 0.5                 # bonus per unit of eta
    rho_clip: float = 0.2            # the bonus never exceeds this
    std_normalise: bool = False      # divide group-centred rewards by the group std (ablation)
    std_eps: float = 1e-6            # added to the std when std_normalise

    def __post_init__(self) -> None:
        if self.rho < 0 or self.rho_clip < 0:
            raise ValueError(f"rho and rho_clip must be >= 0, got {self.rho}, {self.rho_clip}")
        if self.std_eps <= 0:
            raise ValueError(f"std_eps must be > 0, got {self.std_eps}")


def acceleration(sequential_tokens: int, total_tokens: int) -> float:
    """eta = 1 - L_longest / L_total (0 for an empty run)."""
    if total_tokens <= 0:
        return 0.0
    return 1.0 - sequential_tokens / total_tokens


def reward(correct: bool, sequential_tokens: int, total_tokens: int, cfg: RewardConfig) -> tuple[float, float, float]:
    """(reward, eta, bonus) of one trajectory."""
    eta = acceleration(sequential_tokens, total_tokens)
    bonus = min(cfg.rho * eta, cfg.rho_clip) if correct else 0.0
    return float(correct) + bonus, eta, bonus


def group_advantages(rewards: Sequence[float], cfg: RewardConfig) -> np.ndarray:
    """Mean-centred rewards of one prompt's group (optionally divided by std + eps)."""
    r = np.asarray(rewards, np.float64)
    a = r - r.mean()
    if cfg.std_normalise:
        a = a / (r.std() + cfg.std_eps)
    return a


__all__ = ["RewardConfig", "acceleration", "reward", "group_advantages"]
