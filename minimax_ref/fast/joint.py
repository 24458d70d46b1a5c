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

A routed layer's gate and up stacks (w1, w3) read the same tokens too. The loader allocates them as one buffer, the
gate's E entries then the up's (`weights.loader.GATE_UP`), so `JointStack` reads them in place as one stack of 2 E
entries: a token's chosen experts' gate and up rows in one launch, by ids (a decode step's few tokens), flags or
ranges of rows sorted by expert (`FastExperts`), with the same contract against each stack's own launch. The launch
applies one selection to both halves (`mma_gemv.packed_product_stored(..., copies=2)`), so the step's ids, flags, rows
and range ends go in as they are. Nothing is copied: the joint stack is a view of the stacks' own bytes, taken when
the fast paths are applied (a stack replaced afterwards is not read through it: eager calls check, and `fast.apply`
joins again).
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


class JointStack(nn.Module):
    """The gate and up stacks `parts` (two `FastPackedWeight`s of E entries each, read in place by `fast.mma_gemv`)
    as one stack of 2 E entries, gate's first (the module docstring), built by `of`. Non-persistent buffers: the
    joint views (`weight`, `weight_scale`, `weight_scale_2`: NVFP4's global scales, gate's then up's; None for
    MXFP8) and the split-sum `counters`. Each product returns (gate, up), each as the stack's own launch shapes it."""

    def __init__(self, parts: Sequence[FastPackedWeight], weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor | None):
        super().__init__()
        self.parts = list(parts)  # not submodules: they stay where the experts hold them
        self.fmt, self.entries = parts[0].fmt, parts[0].weight.shape[0]
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("weight_scale", weight_scale, persistent=False)
        self.register_buffer("weight_scale_2", weight_scale_2, persistent=False)
        self.rows = parts[0].shape[-2]
        self.register_buffer("counters", mma_gemv.counters_for(2 * self.entries, self.rows, weight.device),
                             persistent=False)
        self.sms = grouped.sm_count(weight.device)

    @classmethod
    def of(cls, gate: nn.Module, up: nn.Module) -> JointStack | None:
        """The joint stack of `gate` and `up`, or None where their bytes are not one stack: either is not a stack that
        `fast.mma_gemv` reads in place (`gemv_kernel` "mma-stored"), their formats, shapes, compute dtypes or
        devices differ, or up's tensors do not follow gate's in one allocation (a loader other than
        `weights.loader`'s, an offloaded stack's staging buffers)."""
        if not all(isinstance(w, FastPackedWeight) and w.gemv_kernel == "mma-stored" and w.weight.dim() == 3
                   for w in (gate, up)):
            return None
        if (gate.fmt, gate.shape, gate.dtype, gate.device) != (up.fmt, up.shape, up.dtype, up.device):
            return None
        joint = []
        for a, b in zip(gate.parts(), up.parts()):
            if a is None and b is None:
                joint.append(None)
                continue
            if not _follows(a, b):
                return None
            joint.append(a.as_strided((2 * a.shape[0], *a.shape[1:]), a.stride()))
        if not mma_gemv.stored_supports(gate.fmt, joint[0], joint[1]):
            return None
        return cls((gate, up), *joint)

    def current(self) -> bool:
        """Whether the parts still hold the joint stack's halves (not checked while a compiled region is traced,
        where tensors have no addresses)."""
        if torch.compiler.is_compiling():
            return True
        half = self.weight.shape[0] // 2
        return all(getattr(p, name).data_ptr() == getattr(self, name)[i * half:].data_ptr()
                   for i, p in enumerate(self.parts) for name in ("weight", "weight_scale"))

    def takes(self, x: torch.Tensor, rows: int) -> bool:
        """Whether a product of `rows` rows of x goes through the joint stack: both parts would multiply it by
        `fast.mma_gemv` (`FastPackedWeight.takes_gemv`), nothing is attached to a part (a hook sees its own call),
        and the parts still hold the joint's bytes."""
        return all(p.takes_gemv(x, rows) for p in self.parts) and self._untouched()

    def takes_ranged(self, x: torch.Tensor) -> bool:
        """`takes` for rows sorted by entry (`FastPackedWeight.takes_ranged`)."""
        return all(p.takes_ranged(x) for p in self.parts) and self._untouched()

    def _untouched(self) -> bool:
        return not any(p._forward_hooks or p._forward_pre_hooks for p in self.parts) and self.current()

    def _product(self, x: torch.Tensor, **select) -> torch.Tensor:
        return mma_gemv.packed_product_stored(x, self.fmt, self.weight, self.weight_scale, self.weight_scale_2,
                                              sms=self.sms, counters=self.counters, copies=2, **select)

    def by_ids(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's row of x bf16 `[T, K]` times its chosen entries `ids` (`[T, k]`, local expert ids): gate and
        up, each bf16 `[T, k, 1, N]` (what `FastPackedWeight.matmul(x[:, None, None], ids)` gives for one stack)."""
        T, k = ids.shape
        # one token's row is shared by every entry (read in place); otherwise each pair's row is laid out once
        xs = x.reshape(1, 1, -1) if T == 1 else x[:, None].expand(T, k, x.shape[-1]).reshape(T * k, 1, -1)
        y = self._product(xs, index=ids.reshape(-1))
        return y[:T * k].view(T, k, 1, -1), y[T * k:].view(T, k, 1, -1)

    def by_flags(self, x: torch.Tensor, active: torch.Tensor | None = None,
                 busy: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x bf16 `[T, K]` times every entry, or every entry flagged in `active` (int32 `[E]`; unflagged entries give
        zero rows, at most `busy` flagged): gate and up, each bf16 `[E, T, N]`."""
        y = self._product(x, active=active, busy=busy)
        return y[:self.entries], y[self.entries:]

    def by_ranges(self, xs: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows xs bf16 `[R, K]` sorted by entry (entry e's end at ends[e], int32 `[E]`), each times its own entry: gate
        and up, each bf16 `[R, N]` (`FastPackedWeight.ranged_product`). The rows are read once for both."""
        y = self._product(xs, ends=ends)
        return y[:xs.shape[0]], y[xs.shape[0]:]

    def extra_repr(self) -> str:
        return f"{self.fmt}, entries={self.entries} x 2, rows={self.rows}"


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `b` is contiguous, shaped as `a` (contiguous) and starts where `a` ends, in the same allocation."""
    return (a.is_contiguous() and b.is_contiguous() and a.shape == b.shape and a.dtype == b.dtype
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size())
