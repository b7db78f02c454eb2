"""REINFORCE on a cart-pole, in the style of the widely copied policy-gradient example.

A two-layer policy (``F.relu`` then dropout) picks an action for one observation at a time, so
an episode is many single-sample forward calls and one optimizer step: the discounted returns
are standardised and ``-log_prob * return`` summed over the episode. Adam, lr 1e-2.

The environment is a small cart-pole written here (Euler-integrated cart and pole, episode over
when the pole falls past 12 degrees, the cart leaves the track, or after ``max_t`` steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical

from . import Result, attach, detach


@dataclass
class Config:
    gamma: float = 0.99
    lr: float = 1e-2
    hidden: int = 64
    episodes: int = 30
    max_t: int = 60
    seed: int = 543
    # plants
    dead_bias: float | None = None  # affine1's bias starts at this value (e.g. -100: every unit dead)
    # gradwatch
    run: Path | None = None
    watch: dict[str, Any] = field(default_factory=dict)


class CartPole:
    """Cart and pole on a 4.8-unit track; actions push left (0) or right (1)."""

    gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02

    def __init__(self, seed: int) -> None:
        self.rng = torch.Generator().manual_seed(seed)
        self.state = [0.0, 0.0, 0.0, 0.0]

    def reset(self) -> list[float]:
        self.state = (torch.rand(4, generator=self.rng) * 0.1 - 0.05).tolist()
        return list(self.state)

    def step(self, action: int) -> tuple[list[float], float, bool]:
        x, x_dot, theta, theta_dot = self.state
        force = self.force_mag if action == 1 else -self.force_mag
        total = self.masscart + self.masspole
        pml = self.masspole * self.length
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + pml * theta_dot**2 * sin) / total
        theta_acc = (self.gravity * sin - cos * temp) / (self.length * (4.0 / 3.0 - self.masspole * cos**2 / total))
        x_acc = temp - pml * theta_acc * cos / total
        x, x_dot = x + self.tau * x_dot, x_dot + self.tau * x_acc
        theta, theta_dot = theta + self.tau * theta_dot, theta_dot + self.tau * theta_acc
        self.state = [x, x_dot, theta, theta_dot]
        done = abs(x) > 2.4 or abs(theta) > 12 * 2 * math.pi / 360
        return list(self.state), 1.0, done


class Policy(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.affine1 = nn.Linear(4, hidden)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(hidden, 2)
        self.saved_log_probs: list[torch.Tensor] = []
        self.rewards: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.affine1(x))
        x = self.dropout(x)
        return F.softmax(self.affine2(x), dim=1)


def select_action(policy: Policy, state: list[float]) -> int:
    probs = policy(torch.tensor(state).unsqueeze(0))
    m = Categorical(probs)
    action = m.sample()
    policy.saved_log_probs.append(m.log_prob(action))
    return int(action.item())


def finish_episode(policy: Policy, optimizer: torch.optim.Optimizer, gamma: float, observe: Any) -> float:
    eps = 1e-6
    R, returns = 0.0, []
    for r in policy.rewards[::-1]:
        R = r + gamma * R
        returns.insert(0, R)
    ret = torch.tensor(returns)
    ret = (ret - ret.mean()) / (ret.std() + eps)
    policy_loss = torch.cat([-log_prob * R for log_prob, R in zip(policy.saved_log_probs, ret)]).sum()
    optimizer.zero_grad()
    policy_loss.backward()
    observe(loss=policy_loss)
    optimizer.step()
    del policy.rewards[:], policy.saved_log_probs[:]
    return float(policy_loss.detach())


def train(cfg: Config) -> Result:
    torch.manual_seed(cfg.seed)
    env = CartPole(cfg.seed)
    policy = Policy(cfg.hidden)
    if cfg.dead_bias is not None:
        with torch.no_grad():
            policy.affine1.bias.fill_(cfg.dead_bias)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    observe = attach(policy, cfg.run, **cfg.watch)
    losses, lengths = [], []
    try:
        for _episode in range(cfg.episodes):
            state = env.reset()
            for _t in range(cfg.max_t):
                action = select_action(policy, state)
                state, reward, done = env.step(action)
                policy.rewards.append(reward)
                if done:
                    break
            lengths.append(len(policy.rewards))
            losses.append(finish_episode(policy, optimizer, cfg.gamma, observe))
    finally:
        detach(policy, cfg.run)
    return Result(losses, cfg.run, {"lengths": lengths, "model": policy})
