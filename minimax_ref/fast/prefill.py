"""Prefill's elementwise glue fused (`FastPaths(prefill_fusion=True)`): each RMSNorm, and each q / k / index norm
with the RoPE rotation after it, of a prefill call (more than `sync_free_tokens` tokens) as one compiled kernel; the
routed experts' weighted combine (`combine_sorted`) as one kernel that reads each expert row once, on one rank with
the block's scaling, the shared expert's output and the rounding to the compute dtype in the same kernel
(`moe_output`); and the SwiGLU-OAI activation of the MLPs and routed experts as one kernel.

Eagerly each is a chain of fp32 elementwise kernels over [tokens, heads x dim]: the norm's upcast, square, mean,
rsqrt and two products and its downcast; the rotation's upcast, halves, negation, concatenations, products, sum and
downcast; about a dozen passes over the activations where one suffices. `torch.compile` fuses each into one kernel
that reads the input once and writes the output once: one graph for every prompt length (the token and row counts
dynamic), the model's widths (hidden size, head dim, top-k) constants of the norm, SwiGLU and combine kernels.

Numerics: the same operations in the same dtypes as `model.norm.gemma_rms_norm` and `model.rope.apply_rope`, the
bf16 rounding between the norm and the rotation kept (on the bits: `norm_rope`); only the order of the fp32 sum in
the norm's mean differs, so an output element differs from the reference's by at most one unit in the last place of
its dtype, where the fp32 value lies at a rounding boundary (tests/test_prefill_fusion.py). The combine computes
the same fp32 products and sums a token's k slots in slot order as `FastExperts.forward_sorted` does unfused: equal
to fp32 rounding of that sum's order; `moe_output` then multiplies, adds and rounds as `MoE.forward` does (fp32, then
one rounding to the compute dtype), so its output is within one unit in the last place of that dtype of the
unfused block's where the fp32 sums differ at a rounding boundary. The activation keeps each operation's rounding to
the inputs' dtype (`emulate_precision_casts`), as eager computes it.
"""

from __future__ import annotations

from functools import cache

import torch

from ..model.mlp import swiglu_oai
from ..model.norm import gemma_rms_norm
from ..model.rope import apply_rope
from .packed import widen_bf16_bits

# emulate_precision_casts keeps eager's rounding after each bf16 operation (the SwiGLU); disable_ftz keeps fp32
# subnormals
PREFILL_INDUCTOR_OPTIONS = {"emulate_precision_casts": True, "eager_numerics.disable_ftz": True}


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope(gemma_rms_norm(x, weight, eps), cos, sin)`: x [B, T, heads, D], cos / sin fp32 [B, T, rot].

    A bf16 norm reaches the rotation as its bits widened to fp32 (`packed.widen_bf16_bits`, exact): compiled Triton
    kernels can elide a `.to(bfloat16)` followed by `.float()` even with `emulate_precision_casts`, and would rotate
    the unrounded norm; the rotation then computes in fp32 from the same values as `apply_rope` and casts once."""
    n = gemma_rms_norm(x, weight, eps)
    if n.dtype == torch.bfloat16:
        n = widen_bf16_bits(n)
    return apply_rope(n, cos, sin).to(x.dtype)


def combine_sorted(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, rows: int) -> torch.Tensor:
    """The routed experts' output of each token: fp32 [T, H], token t's sum over its slots j = 0..k-1 (in that order)
    of `weights[t, j] * y[inv[t, j]]` (fp32 products), where `y` [rows, H] holds the expert outputs of the (token,
    slot) pairs sorted by expert (`rows` >= 1) and `inv` [T, k] (int64) is each pair's row in it; a pair whose row is
    `rows` or more (another rank's expert) adds 0. Reads each row of y once; no [T*k, H] fp32 intermediate.

    The slots are added one after another (k is small: the routing's top-k), so that a compiled kernel is one
    elementwise pass over [T, H] with k gathers, not a reduction over a dimension of k."""
    out = None
    for j in range(inv.shape[1]):
        row = inv[:, j]
        term = torch.where((row < rows)[:, None], y[row.clamp(max=rows - 1)].float() * weights[:, j, None], 0.0)
        out = term if out is None else out + term
    return out


def moe_output(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, rows: int, scaling: float,
               shared: torch.Tensor | None) -> torch.Tensor:
    """A MoE block's output on one rank (`model.moe.MoE.forward` without tensor parallelism) from its routed experts'
    sorted rows (`combine_sorted`'s y, inv, weights, rows >= 1) and its shared expert's output `shared` [T, H] (or
    None): `combine_sorted(...) * scaling + shared` in fp32, rounded once to y's dtype. [T, H] in y's dtype."""
    out = combine_sorted(y, inv, weights, rows) * scaling
    if shared is not None:
        out = out + shared.float()
    return out.to(y.dtype)


@cache
def _compiled(fn):
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(fn, dynamic=True, fullgraph=True, options=dict(PREFILL_INDUCTOR_OPTIONS))


def _static(t: torch.Tensor, dims: int) -> torch.Tensor:
    """`t` with its last `dims` dimensions (hidden, heads, head or rotary width, top-k: the model's, not the call's)
    compiled as constants, the rest (tokens, rows) dynamic: with the row width known, the kernels' index arithmetic
    (a row's gather, a norm's reduction, the rotation's halves) has constant divisors and their loads vectorise."""
    for d in range(t.dim() - dims, t.dim()):
        torch._dynamo.mark_static(t, d)
    return t


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`gemma_rms_norm` as one compiled kernel (compiled on first use; one graph for every shape)."""
    return _compiled(gemma_rms_norm)(_static(x, 1), _static(weight, 1), eps)


def fused_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor:
    """`norm_rope` as one compiled kernel (compiled on first use; one graph for every shape). Its widths stay
    dynamic: compiled with them constant, the CUDA kernel broke the one-ulp contract at release widths (head 128,
    rotary 64; tests/test_prefill_fusion.py), which the dynamic kernel passes."""
    return _compiled(norm_rope)(x, weight, eps, cos, sin)


def fused_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """`swiglu_oai` as one compiled kernel (compiled on first use; one graph for every shape)."""
    return _compiled(swiglu_oai)(_static(gate, 1), _static(up, 1), alpha, limit)


def fused_combine_sorted(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, rows: int) -> torch.Tensor:
    """`combine_sorted` as one compiled kernel (compiled on first use; one graph for every shape)."""
    if rows == 0:  # nothing of this rank's: no row to read
        return torch.zeros(*weights.shape[:1], y.shape[-1], dtype=torch.float32, device=y.device)
    return _compiled(combine_sorted)(_static(y, 1), _static(inv, 1), _static(weights, 1), rows)


def fused_moe_output(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, rows: int, scaling: float,
                     shared: torch.Tensor | None) -> torch.Tensor:
    """`moe_output` as one compiled kernel (compiled on first use; one graph for every shape)."""
    if rows == 0:  # no routed row to read: the shared expert's output alone
        out = torch.zeros(*weights.shape[:1], y.shape[-1], dtype=torch.float32, device=y.device)
        return (out if shared is None else out + shared.float()).to(y.dtype)
    return _compiled(moe_output)(_static(y, 1), _static(inv, 1), _static(weights, 1), rows, scaling,
                                 None if shared is None else _static(shared, 1))


__all__ = ["PREFILL_INDUCTOR_OPTIONS", "norm_rope", "combine_sorted", "moe_output", "fused_rms_norm",
           "fused_norm_rope", "fused_swiglu", "fused_combine_sorted", "fused_moe_output"]
