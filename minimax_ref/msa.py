"""MiniMax Sparse Attention (MSA): the lightning indexer, block selection, and block-sparse
attention computed by gathering the selected key blocks.

Contract (spec `model.md`, "MiniMax Sparse Attention"), for queries at absolute positions `pos`:
* index scores `s[h, q, k] = iq[h, q] . ik[k]` in fp32, no scale; `-inf` where `k > pos(q)`;
* block score `b[h, q, j] = max_k s[h, q, k]` over keys `j*bs .. j*bs+bs-1` (the last block padded
  with -inf);
* forced blocks get `+inf`: the `local_blocks` blocks ending at `pos(q) // bs` and the first
  `init_blocks` blocks (only those at or before the query's block);
* the `min(topk, num_blocks)` largest block scores are selected; a selected score of -inf (a block
  with no causal key) becomes -1. Valid ids are left-packed, in descending score order (in a compiled
  decode step, where nothing reads the ids, in topk's unsorted order: only the fp32 sums' order changes);
* index head h serves kv head h: query heads `h*G .. h*G+G-1` attend only to keys in their kv head's
  selected blocks, intersected with causality; softmax in fp32, scale `head_dim ** -0.5`.

Memory grows linearly with the context: queries are processed in chunks, each chunk scores all
keys (chunk x L) and gathers at most `topk * bs` keys per query and kv head. There is no S x S mask.
Only the gathered keys are converted to fp32, never the whole cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .fast import materialize

# Elements of the largest temporary (index scores of a query chunk, or its gathered keys) that one
# chunk may create; bounds peak memory independently of the context length.
CHUNK_ELEMENTS = 1 << 24


def contract(equation: str, a: torch.Tensor, b: torch.Tensor, broadcast: bool | None = None) -> torch.Tensor:
    """`torch.einsum(equation, a, b)` for the attention cores' two-operand contractions ("ab,cb->ac" style: one
    output order, any letters summed). Exact contract: what einsum computes, the sums in the operands' dtype
    (fp32 here) in an unspecified order.

    broadcast (default: inside a `torch.compile`d region): written as the broadcast product of the operands summed
    over the contracted letters. Inductor compiles that into one reduction that reads both operands where they
    lie (converting an fp8 cache on the fly) and spreads a long sum over the GPU; an einsum there becomes a cuBLAS
    call on materialised fp32 copies, whose kernels for a one-query decode step do not split the keys (measured
    on an H200: 95 us for 8K keys). Eagerly the broadcast product would be a large temporary, so einsum it is.
    """
    if broadcast is None:
        broadcast = torch.compiler.is_compiling()
    if not broadcast:
        return torch.einsum(equation, a, b)
    inputs, out = equation.replace(" ", "").split("->")
    left, right = inputs.split(",")
    summed = [c for c in dict.fromkeys(left + right) if c not in out]
    order = list(out) + summed

    def aligned(t: torch.Tensor, letters: str) -> torch.Tensor:  # t's dims in `order`, size 1 where it has none
        present = [c for c in order if c in letters]
        t = t.permute(*[letters.index(c) for c in present])
        return t.reshape([t.shape[present.index(c)] if c in letters else 1 for c in order])

    return (aligned(a, left) * aligned(b, right)).sum(dim=list(range(len(out), len(order))))


def index_scores(iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Indexer scores of queries `iq` [B, T, Hi, Di] against cached index keys `ik` [B, L, Di].

    `q_pos` [B, T] are the queries' absolute positions; key slot k is position k. Returns fp32
    [B, Hi, T, L] with -inf at future keys.
    """
    s = contract("bthd,bld->bhtl", iq.float(), ik.float())
    k_pos = torch.arange(ik.shape[1], device=ik.device)
    future = k_pos[None, None, None, :] > q_pos[:, None, :, None]
    return s.masked_fill(future, float("-inf"))


def select_blocks(scores: torch.Tensor, q_pos: torch.Tensor, block_size: int, topk_blocks: int,
                  local_blocks: int = 1, init_blocks: int = 0) -> torch.Tensor:
    """Block selection from index scores [B, Hi, T, L] -> block ids [B, Hi, T, min(topk, nb)] (long),
    -1 for slots with no causal block. See the module docstring for the exact rule."""
    B, H, T, L = scores.shape
    nb = -(-L // block_size)
    pad = nb * block_size - L
    if pad:
        scores = F.pad(scores, (0, pad), value=float("-inf"))
    block = scores.view(B, H, T, nb, block_size).amax(-1)
    q_block = (q_pos // block_size)[:, None, :, None]  # [B, 1, T, 1]
    j = torch.arange(nb, device=scores.device)
    forced = (j <= q_block) & (j > q_block - local_blocks)
    if init_blocks:
        forced |= (j < init_blocks) & (j <= q_block)
    block = block.masked_fill(forced, float("inf"))
    k = min(topk_blocks, nb)
    vals, ids = block.topk(k, dim=-1, sorted=not torch.compiler.is_compiling())  # unsorted: as in `moe.route`
    return ids.masked_fill(vals == float("-inf"), -1)


def gather_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                           q_pos: torch.Tensor, block_size: int, scale: float, *,
                           load: Callable[[torch.Tensor], torch.Tensor] | None = None,
                           sdpa: bool = False) -> torch.Tensor:
    """Attention of queries `q` [B, T, Hq, D] over the selected blocks of keys `k`, values `v`
    [B, L, Hkv, D]; `blocks` [B, Hkv, T, kb] (-1 = empty slot). Returns fp32 [B, T, Hq, D].

    Scores, softmax and the value sum are fp32. Keys at positions > q_pos and empty slots are
    masked; the local block is always selected, so no row is fully masked. Only the selected keys are
    gathered and converted to fp32 (a last block running past L is clamped to slot L - 1: those keys are
    future keys, masked). `load` (fast path): k, v are a cache's stored tensors and `load` converts the
    gathered ones to the compute dtype first. `sdpa` (fast path): the core runs through
    `F.scaled_dot_product_attention` in fp32, equal to the einsum/softmax reference to fp32 rounding.
    """
    B, T, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    kb = blocks.shape[-1]
    safe = blocks.clamp(min=0)
    key_pos = safe[..., None] * block_size + torch.arange(block_size, device=q.device)  # [B,Hkv,T,kb,bs]
    valid = (blocks[..., None] >= 0) & (key_pos <= q_pos[:, None, :, None, None])
    slot = key_pos.clamp(max=L - 1)
    bi = torch.arange(B, device=q.device)[:, None, None, None, None]
    hi = torch.arange(Hkv, device=q.device)[None, :, None, None, None]
    k_sel, v_sel = k[bi, slot, hi], v[bi, slot, hi]  # [B, Hkv, T, kb, bs, D]
    if load is not None:
        k_sel, v_sel = load(k_sel), load(v_sel)
    k_sel, v_sel = k_sel.float(), v_sel.float()
    if sdpa:
        # one SDPA batch entry per (sequence, kv head, query): its G query heads over its kb*bs keys
        N, S = B * Hkv * T, kb * block_size
        qs = q.float().view(B, T, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(N, 1, G, D)
        o = F.scaled_dot_product_attention(qs, k_sel.reshape(N, 1, S, D), v_sel.reshape(N, 1, S, D),
                                           attn_mask=valid.reshape(N, 1, 1, S), scale=scale)
        return o.view(B, Hkv, T, G, D).permute(0, 2, 1, 3, 4).reshape(B, T, Hq, D)
    qg = q.float().view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    s = contract("bhgtd,bhtkld->bhgtkl", qg, k_sel) * scale
    s = s.masked_fill(~valid[:, :, None], float("-inf"))
    p = materialize(torch.softmax(s.flatten(-2), dim=-1).view_as(s))
    o = contract("bhgtkl,bhtkld->bhgtd", p, v_sel)  # [B, Hkv, G, T, D]
    return o.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)


def msa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor,
                  q_pos: torch.Tensor, scale: float, block_size: int, topk_blocks: int, local_blocks: int,
                  init_blocks: int, chunk_elements: int = CHUNK_ELEMENTS, *,
                  load: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  sdpa: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Full MSA for queries q [B, T, Hq, D] / iq [B, T, Hi, Di] against keys k, v [B, L, Hkv, D] and
    index keys ik [B, L, Di]. Returns (attention output fp32 [B, T, Hq, D], selected blocks
    [B, Hi, T, kb]). Queries are processed in chunks sized so that no temporary exceeds
    `chunk_elements` elements. `load`, `sdpa`: the fast paths of `gather_block_attention`."""
    B, T, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    kb = min(topk_blocks, -(-L // block_size))
    per_query = max(B * iq.shape[2] * L, B * Hkv * kb * block_size * D, B * Hq * kb * block_size)
    chunk = max(1, chunk_elements // per_query)
    outs, sels = [], []
    for s0 in range(0, T, chunk):
        sl = slice(s0, s0 + chunk)
        scores = index_scores(iq[:, sl], ik, q_pos[:, sl])
        blocks = select_blocks(scores, q_pos[:, sl], block_size, topk_blocks, local_blocks, init_blocks)
        del scores
        outs.append(gather_block_attention(q[:, sl], k, v, blocks, q_pos[:, sl], block_size, scale, load=load,
                                           sdpa=sdpa))
        sels.append(blocks)
    return torch.cat(outs, dim=1), torch.cat(sels, dim=2)
