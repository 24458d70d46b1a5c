"""SwiGLU-OAI feed-forward: the dense MLP of the first layers and the shared expert.

`g = clamp(gate(x), max=limit)`, `u = clamp(up(x), -limit, limit)`,
`out = down((u + 1) * g * sigmoid(alpha * g))`, with alpha = 1.702 and limit = 7.0 in the release.
The same activation is used by the routed experts (moe.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .linear import Linear


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """SwiGLU-OAI activation in the dtype of its inputs (elementwise; no accumulation)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(alpha * gate))


class MLP(nn.Module):
    """`gate_proj`/`up_proj` [I, H] and `down_proj` [H, I]: the release's tensor names."""

    def __init__(self, hidden: int, intermediate: int, alpha: float, limit: float):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_oai(self.gate_proj(x), self.up_proj(x), self.alpha, self.limit))
