"""Gemma RMSNorm, the only norm of the text model (input, post-attention, final, per-head q/k,
indexer q/k).

Contract: `y = x_f32 * rsqrt(mean(x_f32^2, -1) + eps) * (1 + w_f32)`, computed in fp32 and cast to
the dtype of `x` at the end. Weights are stored as offsets from 1 (a zero weight is the identity).
"""

from __future__ import annotations

import torch
from torch import nn


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim of `x` ([..., D]) with Gemma's (1 + w) scale, `weight` [D].

    fp32 throughout: the scale is applied before the single cast back to `x.dtype`.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)
