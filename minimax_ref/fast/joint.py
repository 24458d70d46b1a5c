"""Linears that read the same input, multiplied as one product in decode steps (`FastPaths(gemv="mma")`).

A decode step multiplies the attention's normed input by q_proj, k_proj, v_proj and, on MSA layers, the indexer's
index_q_proj and index_k_proj; an MLP multiplies its input by gate_proj and up_proj. At a few rows each product is a
launch of `fast.mma_gemv` whose fixed cost (its first loads, its split sum, its last programs) is most of a small
one's time (k_proj reads 3 MB at release widths). `JointProduct` holds those linears' reordered copies as one weight,
their row tiles one after the other, and multiplies the input by it in one launch; each linear's own copy becomes a
view of its rows of the joint one, so nothing is held twice and a linear called alone (a hook attached to it) still
reads its rows.

Contract: part i of the output is the rows of linear i in the joint product, each element the product
`mma_gemv.packed_product` computes for that row (the same decoded bf16 values and fp32 MMAs over K; the K splits
are chosen for the joint launch, so their fp32 partial sums may be added in another grouping than the linear's own
launch would add them: equal to fp32 rounding before the one bf16 rounding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..model.linear import Linear
from . import grouped, mma_gemv
from .packed import FastPackedWeight

# A linear's reordered copy (`mma_gemv.reorder`): words [1, N16, S, 32, W], scales [1, N16, S, 32, 2], glob [1]
COPY = ("gemv_words", "gemv_scales", "gemv_global")


def joined(copies: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
           ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The reordered copies `copies` ((words, scales, glob) of linears of one format and K) as one: (words, scales,
    the first row tile of each) with the copies' row tiles (each padded to whole `mma_gemv.GROUP`s) one after the
    other, which is `mma_gemv.reorder` of the linears' rows stacked, each linear's rows padded with zero rows to its
    tiles."""
    starts, n16 = [], 0
    for words, _, _ in copies:
        starts.append(n16)
        n16 += words.shape[1]
    return (torch.cat([c[0] for c in copies], dim=1), torch.cat([c[1] for c in copies], dim=1), starts)


class JointProduct(nn.Module):
    """The linears `parts` as one `fast.mma_gemv` product (the module docstring), built by `of`. Non-persistent
    buffers: the joint copy (`words`, `scales`, `glob`) and its split-sum `counters`."""

    def __init__(self, parts: Sequence[Linear], words: torch.Tensor, scales: torch.Tensor, glob: torch.Tensor,
                 starts: list[int]):
        super().__init__()
        self.parts = list(parts)  # not submodules: they stay where the model holds them
        self.register_buffer("words", words, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("glob", glob, persistent=False)
        self.rows = words.shape[1] * mma_gemv.ROW_TILE  # the joint weight's rows, padding included
        self.register_buffer("counters", mma_gemv.counters_for(1, self.rows, words.device), persistent=False)
        # each part's first row in the joint output and its output features
        self.bounds = [(start * mma_gemv.ROW_TILE, p.out_features) for start, p in zip(starts, parts)]
        self.sms = grouped.sm_count(words.device)

    @classmethod
    def of(cls, parts: Sequence[Linear]) -> JointProduct | None:
        """The joint product of `parts` (linears called on one input), or None where one cannot hold them: fewer
        than two, a part whose packed weight has no `fast.mma_gemv` copy (another preset, a CPU) or whose input is
        fake-quantized (`emulate_act_quant`), formats, K, compute dtypes or devices that differ, or NVFP4 global
        scales that differ (the launch applies one). Each part's copy becomes a view of the joint one."""
        packed = [getattr(p, "packed", None) for p in parts]
        if len(parts) < 2 or not all(isinstance(w, FastPackedWeight) and w.gemv_kernel == "mma"
                                     and all(name in w._buffers for name in COPY) for w in packed):
            return None
        first = packed[0]
        if any(p.emulate_act_quant for p in parts) or any(
                (w.fmt, w.shape[-1], w.dtype, w.gemv_words.device) != (first.fmt, first.shape[-1], first.dtype,
                                                                        first.gemv_words.device) for w in packed):
            return None
        globs = torch.cat([w.gemv_global.reshape(-1) for w in packed])
        if globs.numel() != len(packed) or not bool((globs == globs[0]).all()):
            return None
        words, scales, starts = joined([tuple(w._buffers[name] for name in COPY) for w in packed])
        for w, start in zip(packed, starts):
            n16 = w.gemv_words.shape[1]
            w.register_buffer("gemv_words", words[:, start:start + n16], persistent=False)
            w.register_buffer("gemv_scales", scales[:, start:start + n16], persistent=False)
        return cls(parts, words, scales, first.gemv_global, starts)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x `[..., K]` goes through the joint product: every part would multiply it by `fast.mma_gemv`
        (`FastPackedWeight.takes_gemv`: its rows, dtype and device) and nothing is attached to a part (a hook on a
        linear sees its own call)."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return all(p.packed.takes_gemv(x, rows) and not (p._forward_hooks or p._forward_pre_hooks
                                                         or p.packed._forward_hooks or p.packed._forward_pre_hooks)
                   for p in self.parts)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each part's `x @ W^T` `[..., out_features]` (views of one bf16 `[rows, joint rows]` product)."""
        rows = x.numel() // x.shape[-1]
        y = mma_gemv.packed_product(x.reshape(rows, x.shape[-1]), self.rows, self.words, self.scales, self.glob,
                                    sms=self.sms, counters=self.counters)[0]
        return [y[:, start:start + n].view(*x.shape[:-1], n) for start, n in self.bounds]

    def extra_repr(self) -> str:
        return f"rows={self.rows}, parts={[n for _, n in self.bounds]}"
