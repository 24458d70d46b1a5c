"""MiniMax Sparse Attention (MSA): the lightning indexer, block selection, and block-sparse
attention computed by gathering the selected key blocks.

Contract (spec `model.md`, "MiniMax Sparse Attention"), for queries at absolute positions `pos`:
* index scores `s[h, q, k] = iq[h, q] . ik[k]` in fp32, no scale; `-inf` where `k > pos(q)`;
* block score `b[h, q, j] = max_k s[h, q, k]` over keys `j*bs .. j*bs+bs-1` (the last block padded
  with -inf);
* forced blocks get `+inf`: the `local_blocks` blocks ending at `pos(q) // bs` and the first
  `init_blocks` blocks (only those at or before the query's block);
* the `min(topk, num_blocks)` largest block scores are selected; a selected score of -inf (a block
  with no causal key) becomes -1. Valid ids are left-packed, in descending score order;
* index head h serves kv head h: query heads `h*G .. h*G+G-1` attend only to keys in their kv head's
  selected blocks, intersected with causality; softmax in fp32, scale `head_dim ** -0.5`.

Memory grows linearly with the context: queries are processed in chunks, each chunk scores all
keys (chunk x L) and gathers at most `topk * bs` keys per query and kv head. There is no S x S mask.
Only the gathered keys are converted to fp32, never the whole cache. The selection of every query comes
first (`select_blocks_chunked`), then the attention over the selected blocks (`block_sparse_attention`), in the
same query chunks; each query's result depends on nothing else of its chunk.

`BlockSelection` and `BlockSparseAttention` are those two steps as modules without parameters (each attention
layer holds one of each), so that what records or replaces a selection attaches to them from outside.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import SparseAttentionConfig

# Elements of the largest temporary (index scores of a query chunk, or its gathered keys) that one
# chunk may create; bounds peak memory independently of the context length.
CHUNK_ELEMENTS = 1 << 24


def index_scores(iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Indexer scores of queries `iq` [B, T, Hi, Di] against cached index keys `ik` [B, L, Di].

    `q_pos` [B, T] are the queries' absolute positions; key slot k is position k. Returns fp32
    [B, Hi, T, L] with -inf at future keys.
    """
    return mask_future(torch.einsum("bthd,bld->bhtl", iq.float(), ik.float()), q_pos)


def mask_future(scores: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Index scores [B, Hi, T, L] with -inf where key slot k > q_pos [B, T]."""
    k_pos = torch.arange(scores.shape[-1], device=scores.device)
    return scores.masked_fill(k_pos[None, None, None, :] > q_pos[:, None, :, None], float("-inf"))


def block_scores(scores: torch.Tensor, q_pos: torch.Tensor, block_size: int, local_blocks: int = 1,
                 init_blocks: int = 0) -> torch.Tensor:
    """Block scores [B, Hi, T, nb] of index scores [B, Hi, T, L]: each block's max score (the last block padded
    with -inf), +inf for the forced blocks (the `local_blocks` ending at the query's block, the first
    `init_blocks` at or before it)."""
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
    return block.masked_fill(forced, float("inf"))


def select_blocks(scores: torch.Tensor, q_pos: torch.Tensor, block_size: int, topk_blocks: int,
                  local_blocks: int = 1, init_blocks: int = 0) -> torch.Tensor:
    """Block selection from index scores [B, Hi, T, L] -> block ids [B, Hi, T, min(topk, nb)] (long),
    -1 for slots with no causal block. See the module docstring for the exact rule."""
    block = block_scores(scores, q_pos, block_size, local_blocks, init_blocks)
    vals, ids = block.topk(min(topk_blocks, block.shape[-1]), dim=-1)
    return ids.masked_fill(vals == float("-inf"), -1)


def gather_blocks(k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, q_pos: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys and values of the selected blocks, as given (no conversion): k_sel, v_sel [B, Hkv, T, kb, bs, D]
    from k, v [B, L, Hkv, D] and blocks [B, Hkv, T, kb], and `valid` [B, Hkv, T, kb, bs] (bool): the key is in a
    selected block (not an empty slot) and at or before its query. A last block running past L is clamped to slot
    L - 1: those keys are future keys, masked."""
    B, L, Hkv = k.shape[0], k.shape[1], k.shape[2]
    safe = blocks.clamp(min=0)
    key_pos = safe[..., None] * block_size + torch.arange(block_size, device=k.device)  # [B, Hkv, T, kb, bs]
    valid = (blocks[..., None] >= 0) & (key_pos <= q_pos[:, None, :, None, None])
    slot = key_pos.clamp(max=L - 1)
    bi = torch.arange(B, device=k.device)[:, None, None, None, None]
    hi = torch.arange(Hkv, device=k.device)[None, :, None, None, None]
    return k[bi, slot, hi], v[bi, slot, hi], valid


def block_attention(q: torch.Tensor, k_sel: torch.Tensor, v_sel: torch.Tensor, valid: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Attention of q [B, T, Hq, D] over gathered fp32 keys and values [B, Hkv, T, kb, bs, D] where `valid`
    [B, Hkv, T, kb, bs]; query head h reads kv head h // (Hq / Hkv). fp32 scores, softmax over every gathered key
    of the query, value sum; returns fp32 [B, T, Hq, D]."""
    B, T, Hq, D = q.shape
    Hkv = k_sel.shape[1]
    qg = q.float().view(B, T, Hkv, Hq // Hkv, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    s = torch.einsum("bhgtd,bhtkld->bhgtkl", qg, k_sel) * scale
    s = s.masked_fill(~valid[:, :, None], float("-inf"))
    p = torch.softmax(s.flatten(-2), dim=-1).view_as(s)
    o = torch.einsum("bhgtkl,bhtkld->bhgtd", p, v_sel)  # [B, Hkv, G, T, D]
    return o.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)


def gather_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                           q_pos: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """Attention of queries `q` [B, T, Hq, D] over the selected blocks of keys `k`, values `v`
    [B, L, Hkv, D]; `blocks` [B, Hkv, T, kb] (-1 = empty slot). Returns fp32 [B, T, Hq, D].

    Scores, softmax and the value sum are fp32. Keys at positions > q_pos and empty slots are
    masked; the local block is always selected, so no row is fully masked. Only the selected keys are
    gathered and converted to fp32.
    """
    k_sel, v_sel, valid = gather_blocks(k, v, blocks, q_pos, block_size)
    return block_attention(q, k_sel.float(), v_sel.float(), valid, scale)


def query_chunk(q: torch.Tensor, k: torch.Tensor, iq: torch.Tensor, block_size: int, topk_blocks: int,
                chunk_elements: int) -> int:
    """Queries per chunk of `msa_attention`, so that no temporary (index scores, gathered keys, scores) exceeds
    `chunk_elements` elements."""
    B, _, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    kb = min(topk_blocks, -(-L // block_size))
    per_query = max(B * iq.shape[2] * L, B * Hkv * kb * block_size * D, B * Hq * kb * block_size)
    return max(1, chunk_elements // per_query)


def select_blocks_chunked(iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor, block_size: int,
                          topk_blocks: int, local_blocks: int, init_blocks: int, chunk: int) -> torch.Tensor:
    """`select_blocks(index_scores(...))` of queries iq [B, T, Hi, Di] against index keys ik [B, L, Di], `chunk`
    queries at a time (only one chunk's scores [B, Hi, chunk, L] exist at once) -> block ids [B, Hi, T, kb]."""
    out = []
    for s0 in range(0, iq.shape[1], chunk):
        sl = slice(s0, s0 + chunk)
        scores = index_scores(iq[:, sl], ik, q_pos[:, sl])
        out.append(select_blocks(scores, q_pos[:, sl], block_size, topk_blocks, local_blocks, init_blocks))
        del scores
    return torch.cat(out, dim=2)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                           q_pos: torch.Tensor, block_size: int, scale: float, chunk: int) -> torch.Tensor:
    """`gather_block_attention` of queries q [B, T, Hq, D] over their selected blocks [B, Hkv, T, kb], `chunk`
    queries at a time -> fp32 [B, T, Hq, D]."""
    return torch.cat([gather_block_attention(q[:, s0:s0 + chunk], k, v, blocks[:, :, s0:s0 + chunk],
                                              q_pos[:, s0:s0 + chunk], block_size, scale)
                      for s0 in range(0, q.shape[1], chunk)], dim=1)


def msa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor,
                  q_pos: torch.Tensor, scale: float, block_size: int, topk_blocks: int, local_blocks: int,
                  init_blocks: int, chunk_elements: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Full MSA for queries q [B, T, Hq, D] / iq [B, T, Hi, Di] against keys k, v [B, L, Hkv, D] and
    index keys ik [B, L, Di]. Returns (attention output fp32 [B, T, Hq, D], selected blocks
    [B, Hi, T, kb]). Queries are processed in chunks (`query_chunk`)."""
    chunk = query_chunk(q, k, iq, block_size, topk_blocks, chunk_elements)
    blocks = select_blocks_chunked(iq, ik, q_pos, block_size, topk_blocks, local_blocks, init_blocks, chunk)
    return block_sparse_attention(q, k, v, blocks, q_pos, block_size, scale, chunk), blocks


class BlockSelection(nn.Module):
    """The lightning indexer's choice of key blocks (`select_blocks_chunked`) for one layer's geometry."""

    def __init__(self, geometry: SparseAttentionConfig):
        super().__init__()
        self.geometry = geometry

    def forward(self, iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor, chunk: int) -> torch.Tensor:
        """Block ids [B, Hi, T, kb] of queries iq [B, T, Hi, Di] at q_pos [B, T] over index keys ik [B, L, Di],
        `chunk` queries at a time."""
        g = self.geometry
        return select_blocks_chunked(iq, ik, q_pos, g.block_size, g.topk_blocks, g.local_blocks, g.init_blocks,
                                     chunk)


class BlockSparseAttention(nn.Module):
    """The MSA layers' attention core: queries over their selected key blocks (`block_sparse_attention`)."""

    def __init__(self, scale: float, block_size: int):
        super().__init__()
        self.scale, self.block_size = scale, block_size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, blocks: torch.Tensor,
                chunk: int) -> torch.Tensor:
        """fp32 [B, T, Hq, D]: q [B, T, Hq, D] at q_pos over keys, values [B, L, Hkv, D] in `blocks`
        [B, Hkv, T, kb] (-1 = empty slot), `chunk` queries at a time."""
        return block_sparse_attention(q, k, v, blocks, q_pos, self.block_size, self.scale, chunk)
