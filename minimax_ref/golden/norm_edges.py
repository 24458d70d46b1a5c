"""Edge entries of the norm ops (`rmsnorm`, `qk_norm_rope`, `final_norm`; phase `edge`): rows and weights built so
that a norm kernel with the wrong epsilon, or with its `(1 + weight)` rounded to bf16, fails `compare`.

The captured rows hide both bugs: their mean(x^2) is far above eps (eps moves the output by ~eps / mean(x^2)), and a
bf16 `(1 + w)` moves a pre-rounding value by at most 2^-8 relative, which rounds to at most one bf16 ulp: inside the
bf16 tolerance. An edge entry holds, per norm, `len(ROWS)` rows (per head, for the q / k norms) of four kinds:

- zero: every x = 0; y = 0 exactly (a kernel without eps gives 0 * inf = NaN);
- eps/4, eps: x ~ N(0, 1) scaled to mean(x^2) = eps / 4 and = eps, where eps dominates or matches the mean:
  eps 10x too large or too small, or left out, moves y by 25% or more;
- unit: x ~ N(0, 1).

The weight is not the layer's: w[i] = +-m * 2^-e (m in 1, 3, 5, 7; e in 9..12), values bf16 holds exactly whose
1 + w it cannot (bf16(1 + w) is off by 2^-12 to 2^-8). Each row's values are assigned to channels (a permutation:
mean(x^2) does not change) so that every output's exact value lies at least `MARGIN` (relative) from a bf16
rounding midpoint: a correct kernel (fp32 arithmetic, one rounding) gets the reference's bf16 value exactly, and
one that leaves its fp32 value unrounded is within half a bf16 ulp (<= 2^-8 relative); a bf16 `(1 + w)` moves the
value across a midpoint in many elements, one ulp (> 2^-8 relative) away. Hence the edge entries' bfloat16
tolerance in bfloat16 bundles, `contract.EDGE_TOLERANCE`: rtol 2^-8, atol 0. The q / k edge rows sit at position 0
(cos 1, sin 0): the rotation is the identity, so `{q,k}_rope` = `{q,k}_normed` and a fused norm + RoPE kernel
(one rounding) matches exactly too. On an MSA layer the qk_norm_rope entry's rows cover the lightning indexer's
index_q / index_k norms as well (`contract.QK_NORMS`).
"""

from __future__ import annotations

import math

import torch

from .operands import Entry

NORM_OPS = ("rmsnorm", "qk_norm_rope", "final_norm")


EDGE_PHASE = "edge"


EDGE = "norm-rows"  # the entries' params.edge


ROWS = ("zero", "eps/4", "eps", "unit")  # the row kinds, in order; per head, head h of token t is ROWS[(t + h) % 4]


MARGIN = 2**-13  # every exact output is at least this far (relative) from a bf16 rounding midpoint


# The manifest's `norm_edges` (model-driven bundles with a norm op).
EDGES_NOTE = ("entries of phase 'edge' (params.edge 'norm-rows'): one per chosen norm op (rmsnorm at the first "
              "chosen layer; qk_norm_rope at the first chosen MSA layer, with the indexer's index_q / index_k norms "
              "besides q / k, or, no MSA layer chosen, at the first chosen layer with q / k only; final_norm at the "
              "head), built rows rather than the forward's, in the "
              "entries' usual layout with B = 1 and T = 4 tokens: row kinds zero (x = 0), eps/4 and eps "
              "(mean(x^2) = eps / 4, = eps: eps dominates, so a wrong or missing eps fails) and unit (x ~ N(0, 1)), "
              "per head for q / k / index_q / index_k (head h of token t: kind (t + h) % 4); the norm weights are "
              "the entry's own, not "
              "the layer's: w = +-m * 2^-e (m in 1, 3, 5, 7; e in 9..12), exact in bf16 while 1 + w is not, so a "
              "(1 + w) rounded to bf16 fails; each row's values are arranged so that every output's exact value is "
              "at least 2^-13 (relative) from a bf16 rounding midpoint, whence the bfloat16 tolerance of these "
              "entries in a bfloat16 bundle: rtol 2^-8, atol 0 (a correct kernel rounds to the reference's value, "
              "or stays within half an ulp unrounded; another bf16 value is one ulp, > 2^-8, off). q / k / index_q / "
              "index_k rows sit at position 0 (cos 1, sin 0): each X_rope = X_normed")


def edge_weight(dim: int, g: torch.Generator) -> torch.Tensor:
    """fp32 [dim]: w[i] = sign * m * 2^-e, m in (1, 3, 5, 7), e in 9..12 (exact in bf16; 1 + w is not)."""
    m = torch.tensor((1.0, 3.0, 5.0, 7.0))[torch.randint(0, 4, (dim,), generator=g)]
    e = torch.randint(9, 13, (dim,), generator=g).float()
    sign = torch.randint(0, 2, (dim,), generator=g).float() * 2 - 1
    return sign * m * torch.exp2(-e)


def _row_values(kind: str, dim: int, eps: float, g: torch.Generator) -> torch.Tensor:
    """fp64 [dim] values of one row, each exact in bf16."""
    z = torch.randn(dim, generator=g, dtype=torch.float64)
    if kind == "zero":
        return torch.zeros(dim, dtype=torch.float64)
    if kind == "unit":
        return z.to(torch.bfloat16).double()
    target = eps / 4 if kind == "eps/4" else eps
    return (z * math.sqrt(target / float(z.square().mean()))).to(torch.bfloat16).double()


def clear_of_midpoint(v: float) -> bool:
    """Whether v is 0 or at least `MARGIN * |v|` from every bf16 rounding midpoint (normal bf16 range)."""
    if v == 0:
        return True
    mant, exp = math.frexp(abs(v))  # |v| = mant * 2^exp, mant in [0.5, 1): bf16 ulp 2^(exp - 8)
    ulp = math.ldexp(1.0, exp - 8)
    frac = abs(v) / ulp % 1.0
    return abs(frac - 0.5) * ulp >= MARGIN * abs(v)


def _assign(values: torch.Tensor, scale: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A permutation of `values` (fp64 [D]) such that values[perm[i]] * scale[i] is clear of every bf16 midpoint
    for each channel i (greedy over seeded orders)."""
    D = values.numel()
    vals, sc = values.tolist(), scale.tolist()
    for _ in range(100):
        free = torch.randperm(D, generator=g).tolist()
        out = []
        for i in range(D):
            k = next((k for k, j in enumerate(free) if clear_of_midpoint(vals[j] * sc[i])), None)
            if k is None:
                break
            out.append(free.pop(k))
        if len(out) == D:
            return values[torch.tensor(out)]
    raise RuntimeError("golden: no arrangement of an edge row keeps its outputs clear of bf16 midpoints")


def edge_rows(kinds: list[str], w: torch.Tensor, eps: float, g: torch.Generator) -> torch.Tensor:
    """fp64 [len(kinds), D]: one row per kind (`ROWS`), arranged against weight w (`_assign`)."""
    D = w.numel()
    one_plus = 1.0 + w.double()
    rows = []
    for kind in kinds:
        x = _row_values(kind, D, eps, g)
        r = 1.0 / math.sqrt(float(x.square().mean()) + eps)  # a permutation keeps mean(x^2): r is the row's
        rows.append(x if kind == "zero" else _assign(x, one_plus * r, g))
    return torch.stack(rows)


def _norm_input(kinds: list[str], shape: tuple[int, ...], w: torch.Tensor, eps: float, g: torch.Generator,
                dtype: torch.dtype) -> torch.Tensor:
    return edge_rows(kinds, w, eps, g).reshape(*shape, w.numel()).to(dtype)


def _check(x: torch.Tensor, w: torch.Tensor, eps: float, y: torch.Tensor) -> None:
    """The construction holds: the reference's bf16 output is the exact value's rounding, the exact values clear
    of the midpoints (fp64 computation of the contract from the stored operands)."""
    from .fp64 import rms_norm64

    exact = rms_norm64(x, w, eps)
    if not all(clear_of_midpoint(v) for v in exact.flatten().tolist()):
        raise RuntimeError("golden: an edge row's output lies near a bf16 rounding midpoint")
    if y.dtype == torch.bfloat16 and not torch.equal(exact.float().bfloat16(), y):
        raise RuntimeError("golden: the reference's bf16 edge output is not the exact value's rounding")


def _kinds(n: int, heads: int = 1) -> list[str]:
    return [ROWS[(t + h) % len(ROWS)] for t in range(n) for h in range(heads)]


def rmsnorm_edge(layer: int, norms: dict[str, tuple[int, float, torch.dtype]], dtype: torch.dtype,
                 seed: int) -> Entry:
    """The rmsnorm edge entry of `layer`: for each norm name -> (hidden, eps, weight dtype), `{norm}.x` [1, R, H],
    `{norm}.weight` [H], `{norm}.y` (the reference's `gemma_rms_norm`)."""
    from ..model.norm import gemma_rms_norm

    g = torch.Generator().manual_seed(seed)
    e = Entry("rmsnorm", layer, EDGE_PHASE)
    for norm, (H, eps, wdtype) in norms.items():
        w = edge_weight(H, g).to(wdtype)
        x = _norm_input(_kinds(len(ROWS)), (1, len(ROWS)), w, eps, g, dtype)
        y = gemma_rms_norm(x, w, eps)
        _check(x, w, eps, y)
        e.put(f"{norm}.x", x, "input")
        e.put(f"{norm}.weight", w, "input")
        e.put(f"{norm}.y", y, "output")
        e.params["eps"] = eps
    e.params["edge"] = EDGE
    return e


def final_norm_edge(layer: int, H: int, eps: float, wdtype: torch.dtype, dtype: torch.dtype, seed: int) -> Entry:
    """The final_norm edge entry: `x` [1, R, H], `weight` [H], `y`."""
    from ..model.norm import gemma_rms_norm

    g = torch.Generator().manual_seed(seed)
    w = edge_weight(H, g).to(wdtype)
    x = _norm_input(_kinds(len(ROWS)), (1, len(ROWS)), w, eps, g, dtype)
    y = gemma_rms_norm(x, w, eps)
    _check(x, w, eps, y)
    e = Entry("final_norm", layer, EDGE_PHASE)
    e.put("x", x, "input")
    e.put("weight", w, "input")
    e.put("y", y, "output")
    e.params.update({"eps": eps, "edge": EDGE})
    return e


def qk_norm_rope_edge(layer: int, norms: dict[str, tuple[int, int, torch.dtype]], eps: float, rotary_dim: int,
                      rope_theta: float, dtype: torch.dtype, seed: int) -> Entry:
    """The qk_norm_rope edge entry: for each per-head norm `which` -> (heads, head dim D, weight dtype) of `norms`
    (`QK_NORMS`: q [1, R, Hq, D], k [1, R, Hkv, D]; on an MSA layer also index_q [1, R, Hkv, Di] and index_k
    [1, R, 1, Di]), the input `{which}` (head h of token t: row kind ROWS[(t + h) % 4]) and an edge weight
    `{which}_norm.weight` [D], positions 0 (the tables cos 1, sin 0), and the outputs `{which}_normed`,
    `{which}_rope` as the layer computes them (`gemma_rms_norm`, then `apply_rope`)."""
    from ..model.norm import gemma_rms_norm
    from ..model.rope import apply_rope, rope_cos_sin, rope_inv_freq

    g = torch.Generator().manual_seed(seed)
    R = len(ROWS)
    positions = torch.zeros(1, R, dtype=torch.long)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(rotary_dim, rope_theta))
    e = Entry("qk_norm_rope", layer, EDGE_PHASE)
    for which, (n_heads, D, wdtype) in norms.items():
        w = edge_weight(D, g).to(wdtype)
        x = _norm_input(_kinds(R, n_heads), (1, R, n_heads), w, eps, g, dtype)
        normed = gemma_rms_norm(x, w, eps)
        _check(x, w, eps, normed)
        e.put(which, x, "input")
        e.put(f"{which}_norm.weight", w, "input")
        e.put(f"{which}_normed", normed, "output")
        e.put(f"{which}_rope", apply_rope(normed, cos, sin), "output")
    e.put("positions", positions, "input")
    e.put("cos", cos, "input")
    e.put("sin", sin, "input")
    e.params.update({"eps": eps, "rotary_dim": rotary_dim, "rope_theta": rope_theta, "edge": EDGE})
    return e
