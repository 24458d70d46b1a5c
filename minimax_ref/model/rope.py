"""Partial NeoX rotary position embedding of the text model.

Only the first `rotary_dim` channels of each head rotate; the rest pass through. Positions are
plain token indices (images do not shift them).

Contract (decided here for bf16 mode): cos/sin are computed in fp32 from fp32 angles and the
rotation itself is done in fp32, then cast back to the input dtype. In fp32 mode this equals the
transformers implementation exactly; in bf16 mode it rounds once instead of three times.
"""

from __future__ import annotations

import torch


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """`inv_freq[i] = theta ** (-2i / rotary_dim)` for i < rotary_dim/2, fp32 [rotary_dim/2]."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for integer `positions` [...]: fp32 [..., rotary_dim].

    The angle is `float(pos) * inv_freq`, duplicated (`cat(angle, angle)`) for NeoX pairing.
    """
    angles = positions.float()[..., None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` channels of `x` [B, T, heads, D] (NeoX rotate_half).

    `cos`, `sin`: fp32 [B, T, rotary_dim]. Returns `x.dtype`.
    """
    rot = cos.shape[-1]
    xf = x.float()
    xr, xp = xf[..., :rot], xf[..., rot:]
    half = rot // 2
    rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    out = xr * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return torch.cat((out, xp), dim=-1).to(x.dtype)
