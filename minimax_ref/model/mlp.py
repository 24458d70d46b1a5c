"""SwiGLU-OAI feed-forward: the dense MLP of the first layers and the shared expert.

`g = clamp(gate(x), max=limit)`, `u = clamp(up(x), -limit, limit)`,
`out = down((u + 1) * g * sigmoid(alpha * g))`, with alpha = 1.702 and limit = 7.0 in the release.
The same activation is used by the routed experts (moe.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .parallel import ColumnParallelLinear, RowParallelLinear, World


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """SwiGLU-OAI activation in the dtype of its inputs (elementwise; no accumulation)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(alpha * gate))


class MLP(nn.Module):
    """`gate_proj`/`up_proj` [I, H] and `down_proj` [H, I]: the release's tensor names.

    Tensor parallel: gate/up hold this rank's intermediate rows, down_proj the same columns, so the
    activation is computed on the local channels only. down_proj all-reduces (once per block) unless
    `reduce_output=False`: then forward returns this rank's partial sum (the shared expert, which the
    MoE adds to the routed experts' partial sum before its one all-reduce).
    """

    def __init__(self, hidden: int, intermediate: int, alpha: float, limit: float, world: World | None = None,
                 reduce_output: bool = True):
        super().__init__()
        world = world or World.single()
        channels = world.split(intermediate, "MLP intermediate size")
        self.gate_proj = ColumnParallelLinear(hidden, channels)
        self.up_proj = ColumnParallelLinear(hidden, channels)
        self.down_proj = RowParallelLinear(hidden, channels, world, reduce=reduce_output)
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu_oai(gate, up, self.alpha, self.limit)
