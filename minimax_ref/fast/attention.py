"""The attention twin (`FastAttention`, installed by `fast.apply`): the same function as `attention.Attention`,
equal to fp32 rounding, with

* `static_kv` (through the model twin's `kv_len`): attention over the whole cache in decode steps (static shapes,
  no host synchronisation; later slots are future keys, masked);
* `sdpa`: the fp32 attention core through `F.scaled_dot_product_attention`, and MSA gathers its selected blocks
  from the cache's storage and converts only those (an fp8 cache is never converted whole);
* `prefill_attention="triton"` (prefill calls: more than `sync_free_tokens` tokens) and `decode_attention="triton"`
  (decode-sized calls), for a bf16 model on CUDA: the block-sparse attention kernel (`fast.attention_kernel`) over the
  cache as stored in decode steps; a prefill widens an fp8 cache's keys and values to bf16 once (`widen_keys`: the
  same values) where its query tiles would convert more keys than the cache holds (`widening_pays`); the MSA
  selection by `select_blocks_chunked`;
* `block_selection="triton"` (prefill calls and calls of few query rows, such as decode steps, of a bf16 model on
  CUDA): the MSA block scores by one Triton kernel (`fast.selection_kernel`: no [T, L] index scores; a decode step's
  fp8 index keys read as stored), then the same top-k (`select_blocks_kernel`);
* `gemv="mma"` (decode-sized calls of packed linears with `fast.mma_gemv` copies): the input's projections (q, k, v
  and the indexer's) as one product, one launch (`fast.joint`; not while a hook watches one of them);
* in a compiled region (`FastPaths.compile_layers`): the contractions as broadcast products (`contract`), block
  selection by unsorted top-k (nothing in a compiled decode step reads the order of the ids; only the order of the
  fp32 sums changes), and the queries and softmax probabilities stored once (`compiled.materialize`).

The pieces that are not different (masks, block scores, gathering, chunk sizes) are msa.py's own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..model.attention import Attention, gqa_chunks, merge_heads
from ..model.cache import LayerCache
from ..model.msa import CHUNK_ELEMENTS, BlockSelection, block_scores, gather_blocks, mask_future, query_chunk
from . import attention_kernel, selection_kernel
from .compiled import materialize, top_k
from .joint import JointProduct
from .prefill import fused_norm_rope


def contract(equation: str, a: torch.Tensor, b: torch.Tensor, broadcast: bool | None = None) -> torch.Tensor:
    """`torch.einsum(equation, a, b)` for the attention cores' two-operand contractions ("ab,cb->ac" style: one
    output order, any letters summed). Exact contract: what einsum computes, the sums in the operands' dtype
    (fp32 here) in an unspecified order.

    broadcast (default: inside a `torch.compile`d region): written as the broadcast product of the operands summed
    over the contracted letters. Inductor compiles that into one reduction that reads both operands where they
    lie (converting an fp8 cache on the fly) and spreads a long sum over the GPU, where an einsum becomes a cuBLAS
    call on materialised fp32 copies whose kernels for a one-query decode step do not split the keys. Eagerly the
    broadcast product would be a large temporary, so einsum it is.
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


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                     chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """`attention.causal_attention` with `contract` and the probabilities stored once when compiled."""
    kf, vf, chunks = gqa_chunks(q, k, v, q_pos, chunk_elements)
    outs = []
    for qg, future in chunks:
        s = contract("bhgtd,bhld->bhgtl", qg, kf) * scale
        p = materialize(torch.softmax(s.masked_fill(future, float("-inf")), dim=-1))
        outs.append(merge_heads(contract("bhgtl,bhld->bhgtd", p, vf)))
    return torch.cat(outs, dim=1)


def causal_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                          chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """`attention.causal_attention` through `F.scaled_dot_product_attention` in fp32: the G query heads of a kv
    head are folded into the query length, so no kv head is repeated. Same chunking of queries."""
    kf, vf, chunks = gqa_chunks(q, k, v, q_pos, chunk_elements)
    outs = []
    for qg, future in chunks:
        B, Hkv, G, t, D = qg.shape
        mask = (~future).expand(B, 1, G, t, future.shape[-1]).reshape(B, 1, G * t, -1)
        o = F.scaled_dot_product_attention(qg.reshape(B, Hkv, G * t, D), kf, vf, attn_mask=mask, scale=scale)
        outs.append(merge_heads(o.view(B, Hkv, G, t, D)))
    return torch.cat(outs, dim=1)


def top_blocks(block: torch.Tensor, topk_blocks: int, by_sort: bool = False) -> torch.Tensor:
    """`msa.select_blocks`' choice from block scores [B, Hi, T, nb]: the ids of the min(topk, nb) largest, -1 where
    the score is -inf (`compiled.top_k`: unsorted when compiled, or `by_sort`)."""
    vals, ids = top_k(block, min(topk_blocks, block.shape[-1]), by_sort)
    return ids.masked_fill(vals == float("-inf"), -1)


def select_blocks(iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor, block_size: int, topk_blocks: int,
                  local_blocks: int, init_blocks: int, by_sort: bool = False) -> torch.Tensor:
    """`msa.index_scores` then `msa.select_blocks`, with `contract` and `top_blocks`."""
    scores = mask_future(contract("bthd,bld->bhtl", iq.float(), ik.float()), q_pos)
    return top_blocks(block_scores(scores, q_pos, block_size, local_blocks, init_blocks), topk_blocks, by_sort)


def select_blocks_chunked(iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor, block_size: int, topk_blocks: int,
                          local_blocks: int, init_blocks: int, chunk: int, by_sort: bool = False) -> torch.Tensor:
    """`msa.select_blocks_chunked` with this module's `select_blocks`: block ids [B, Hi, T, kb], `chunk` queries at
    a time."""
    return torch.cat([select_blocks(iq[:, s:s + chunk], ik, q_pos[:, s:s + chunk], block_size, topk_blocks,
                                    local_blocks, init_blocks, by_sort) for s in range(0, iq.shape[1], chunk)], dim=2)


def select_blocks_kernel(iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor, block_size: int, topk_blocks: int,
                         local_blocks: int, init_blocks: int, chunk: int,
                         tiles: selection_kernel.Tiles | None = None, ik_scale: float = 1.0,
                         sms: int = 1, by_sort: bool = False) -> torch.Tensor:
    """`select_blocks_chunked` with the block scores by `fast.selection_kernel` (bf16 iq, bf16 or fp8 ik read as
    bf16(fp32(ik) * ik_scale); `tiles` the prefill grid's launch configuration, `sms` the SMs the decode grid fills):
    block ids [B, Hi, T, kb], `chunk` queries at a time (only one chunk's block scores [B, Hi, chunk, nb] exist at
    once). The same ids up to ties within the fp32 sums' rounding (the kernel module's contract)."""
    return torch.cat([top_blocks(selection_kernel.block_scores(iq[:, s:s + chunk], ik, q_pos[:, s:s + chunk],
                                                               block_size, local_blocks, init_blocks, ik_scale,
                                                               tiles, sms),
                                 topk_blocks, by_sort)
                      for s in range(0, iq.shape[1], chunk)], dim=2)


def index_chunk(iq: torch.Tensor, ik: torch.Tensor, chunk_elements: int) -> int:
    """Queries per chunk whose index scores [B, Hi, chunk, L] stay within `chunk_elements` (what the selection alone
    needs when the attention kernel, which gathers nothing, runs beside it)."""
    B, _, Hi = iq.shape[:3]
    return max(1, chunk_elements // (B * Hi * ik.shape[1]))


class FastBlockSelection(BlockSelection):
    """`msa.BlockSelection` through this module's `select_blocks` (`contract`; unsorted top-k when compiled), or with
    `block_selection="triton"` where the kernel runs, `select_blocks_kernel`: prefill calls, and calls of few query
    rows (decode steps, speculative verification: queries x index heads <= `selection_kernel.DECODE_ROWS`), which
    read an fp8 cache's index keys as stored (`reads_stored`)."""

    sm_count = 1  # the GPU's SMs (`fast.apply`): the kernel's decode grid fills them

    def forward(self, iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor, chunk: int,
                ik_scale: float = 1.0) -> torch.Tensor:
        """Block ids as `BlockSelection`'s; ik may be an fp8 cache's stored index keys where `reads_stored` allows,
        read as bf16(fp32(ik) * ik_scale) (`LayerCache.load`)."""
        g = self.geometry
        if self.kernel_selects(iq, ik.dtype):
            # the kernel's temporary is nb block scores a query where the reference's is L index scores: the same
            # element budget takes block_size times the queries
            return select_blocks_kernel(iq, ik, q_pos, g.block_size, g.topk_blocks, g.local_blocks, g.init_blocks,
                                        chunk * g.block_size, ik_scale=ik_scale, sms=self.sm_count,
                                        by_sort=self.paths.sort_topk)
        return select_blocks_chunked(iq, ik, q_pos, g.block_size, g.topk_blocks, g.local_blocks, g.init_blocks, chunk,
                                     self.paths.sort_topk)

    def kernel_selects(self, iq: torch.Tensor, ik_dtype: torch.dtype) -> bool:
        """Whether this call's block scores come from `fast.selection_kernel`: `block_selection="triton"`, a prefill
        call (more than `sync_free_tokens` queries) or one of few query rows (`decode_grid`; other decode-sized calls
        keep the compiled-friendly path), and operands the kernel handles (bf16 index queries on CUDA with triton; index
        keys of `ik_dtype`)."""
        return (self.paths.block_selection == "triton"
                and (iq.shape[1] > self.paths.sync_free_tokens or self.decode_grid(iq))
                and selection_kernel.handles(iq.device, iq.dtype, ik_dtype, iq.shape[-1]))

    @staticmethod
    def decode_grid(iq: torch.Tensor) -> bool:
        """Whether a call of index queries `iq` [B, T, Hi, Di] has few enough query rows for the kernel's decode
        grid."""
        return iq.shape[1] * iq.shape[2] <= selection_kernel.DECODE_ROWS

    def reads_stored(self, iq: torch.Tensor, stored: torch.dtype) -> bool:
        """Whether this call takes the cache's index keys as stored (`stored` their dtype): the kernel's decode grid
        reads them once, converting in registers, where loading them first would write and read them again. Not
        while hooks watch the selection (they get the keys as the reference gives them)."""
        return (not (self._forward_hooks or self._forward_pre_hooks) and self.decode_grid(iq)
                and self.kernel_selects(iq, stored))


def gather_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                           q_pos: torch.Tensor, block_size: int, scale: float, *,
                           load: Callable[[torch.Tensor], torch.Tensor] | None = None,
                           sdpa: bool = False) -> torch.Tensor:
    """`msa.gather_block_attention`. `load`: k, v are a cache's stored tensors and `load` converts the gathered
    ones to the compute dtype. `sdpa`: the core through `F.scaled_dot_product_attention` in fp32; else `contract`
    with the probabilities stored once when compiled."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    k_sel, v_sel, valid = gather_blocks(k, v, blocks, q_pos, block_size)
    if load is not None:
        k_sel, v_sel = load(k_sel), load(v_sel)
    k_sel, v_sel = k_sel.float(), v_sel.float()
    if sdpa:
        # one SDPA batch entry per (sequence, kv head, query): its G query heads over its kb*bs keys
        N, S = B * Hkv * T, blocks.shape[-1] * block_size
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


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                           q_pos: torch.Tensor, block_size: int, scale: float, chunk: int, *,
                           load: Callable[[torch.Tensor], torch.Tensor] | None = None,
                           sdpa: bool = False) -> torch.Tensor:
    """`msa.block_sparse_attention` with this module's `gather_block_attention` (same chunks of queries)."""
    return torch.cat([gather_block_attention(q[:, s:s + chunk], k, v, blocks[:, :, s:s + chunk], q_pos[:, s:s + chunk],
                                             block_size, scale, load=load, sdpa=sdpa)
                      for s in range(0, q.shape[1], chunk)], dim=1)


def widening_pays(queries: int, cached: int, group: int, sparse_keys: int | None, device: torch.device) -> bool:
    """Whether a call of `queries` tokens over `cached` stored fp8 keys (a kv head's query `group`) converts fewer
    keys by widening the cache once (`widen_keys`: every cached key read, converted and written, counted as two) than
    the attention kernel converts in its tiles: each query tile (`tile_tokens` of the kernel's default fp8 tiles)
    converts at least the keys one of its tokens reads: `sparse_keys` (MSA: its top-k blocks' slots) or, dense, half
    the cache (causal tiles read up to their position). A long cache and a short prefill call convert in the
    kernel; an 8K prompt widens."""
    tiles = attention_kernel.tiles_for("sparse" if sparse_keys else "dense", device, "fp8")
    n_tiles = -(-queries // attention_kernel.tile_tokens(tiles.rows, group, queries))
    per_tile = min(cached, sparse_keys) if sparse_keys else cached // 2
    return n_tiles * per_tile >= 2 * cached


def widen_keys(cache: LayerCache, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored keys or values (fp8) in the compute dtype `dtype`: `cache.load`'s bf16(fp32(x) * scale); at the
    cache's unit scale one conversion (every e4m3 value is a bf16 value: the same bits without the multiply)."""
    return stored.to(dtype) if cache.scale == 1.0 else cache.load(stored)


class FastAttention(Attention):
    """`Attention` with the fast paths `paths` (a `FastPaths`, set by `fast.apply`). Same parameters. The block
    selection goes through `self.selection` on every path (its twin, `FastBlockSelection`), so what records or
    replaces it attaches as on the reference; what attaches to the reference core (its operands) gets the
    reference forward."""

    def join_projections(self) -> None:
        """Hold the input's projections (q, k, v and the indexer's) as one product where they can be
        (`fast.joint.JointProduct`, the child `joint`): what `forward` then runs for decode-sized inputs."""
        indexer = [self.index_q_proj, self.index_k_proj] if self.sparse else []
        joint = JointProduct.of([self.q_proj, self.k_proj, self.v_proj, *indexer])
        if joint is not None:
            self.joint = joint

    def fuses(self, x: torch.Tensor, *norms: nn.Module) -> bool:
        """Whether this call's `norms` and rotations run fused (`prefill_fusion`, a prefill call, nothing attached to
        the norms: they are not called as modules then)."""
        return (self.paths.prefill_fusion and x.shape[1] > self.paths.sync_free_tokens
                and not any(n._forward_hooks or n._forward_pre_hooks for n in norms))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.fuses(x, self.q_norm, self.k_norm):
            return super().qkv(x, cos, sin)
        B, T, _ = x.shape
        qn, kn = self.q_norm, self.k_norm
        q = fused_norm_rope(self.q_proj(x).view(B, T, self.n_heads, self.head_dim), qn.weight, qn.eps, cos, sin)
        k = fused_norm_rope(self.k_proj(x).view(B, T, self.n_kv, self.head_dim), kn.weight, kn.eps, cos, sin)
        return q, k, self.v_proj(x).view(B, T, self.n_kv, self.head_dim)

    def index_qk(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fuses(x, self.index_q_norm, self.index_k_norm):
            return super().index_qk(x, cos, sin)
        B, T, _ = x.shape
        qn, kn = self.index_q_norm, self.index_k_norm
        iq = fused_norm_rope(self.index_q_proj(x).view(B, T, self.n_kv, self.index_dim), qn.weight, qn.eps, cos, sin)
        ik = fused_norm_rope(self.index_k_proj(x).view(B, T, 1, self.index_dim), kn.weight, kn.eps, cos, sin)
        return iq, ik[:, :, 0]

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: LayerCache | None = None, kv_len: int | None = None) -> torch.Tensor:
        if self.core._forward_hooks:
            return super().forward(x, pos, cos, sin, cache, kv_len)
        B, T, _ = x.shape
        prefill = T > self.paths.sync_free_tokens
        mode = self.paths.prefill_attention if prefill else self.paths.decode_attention
        sdpa = self.paths.sdpa
        stored = cache.k.dtype if cache is not None else x.dtype
        kernel = mode == "triton" and attention_kernel.handles(x.device, x.dtype, stored, self.head_dim)
        joint = self.joint(x) if "joint" in self._modules and self.joint.takes(x) else None
        q, k, v = self.qkv(x, cos, sin) if joint is None else self.heads(*joint[:3], cos, sin)
        q = materialize(q)  # compiled: computed once, not once per key
        iq = ik = None
        ik_scale = 1.0
        if self.sparse:
            iq, ik = self.index_qk(x, cos, sin) if joint is None else self.index_heads(*joint[3:], cos, sin)
            iq = materialize(iq)
        load = None
        kv_scale = 1.0
        if cache is not None:
            length = kv_len if kv_len is not None else int(pos.max()) + 1
            cache.write(k, v, pos)
            if kernel:  # the kernel reads the cache as stored and converts in registers
                k, v = cache.stored_keys_values(length)
                kv_scale = cache.scale
                sparse_keys = self.geometry.topk_blocks * self.geometry.block_size if self.sparse else None
                if prefill and k.dtype != x.dtype and widening_pays(T, length, self.n_heads // self.n_kv, sparse_keys,
                                                                  x.device):
                    # a prefill's query tiles read each key many times: convert the keys once, not in every tile
                    k, v = widen_keys(cache, k, x.dtype), widen_keys(cache, v, x.dtype)
                    kv_scale = 1.0
            elif self.sparse and sdpa:  # gather blocks from storage, convert only those
                k, v = cache.stored_keys_values(length)
                load = cache.load
            else:
                k, v = cache.keys_values(length)
            if self.sparse:
                cache.write_index(ik, pos)
                if self.selection.reads_stored(iq, cache.index_k.dtype):
                    ik, ik_scale = cache.stored_index_keys(length), cache.scale
                else:
                    ik = cache.index_keys(length)
        sp = self.geometry if self.sparse else None
        split = self.paths.attention_probabilities == "split"
        if kernel and self.sparse:
            blocks = self.selection(iq, ik, pos, index_chunk(iq, ik, self.chunk_elements), ik_scale=ik_scale)
            # the output in the model's dtype, rounded once by the kernel as the `.to` below would
            o = attention_kernel.block_attention(q, k, v, pos, self.scale, blocks, sp.block_size, kv_scale,
                                                 self.sm_count, out_dtype=x.dtype, split_probabilities=split)
        elif kernel:
            o = attention_kernel.block_attention(q, k, v, pos, self.scale, kv_scale=kv_scale, sms=self.sm_count,
                                                 out_dtype=x.dtype, split_probabilities=split)
        elif self.sparse:
            chunk = query_chunk(q, k, iq, sp.block_size, sp.topk_blocks, self.chunk_elements)
            blocks = self.selection(iq, ik, pos, chunk, ik_scale=ik_scale)
            o = block_sparse_attention(q, k, v, blocks, pos, sp.block_size, self.scale, chunk, load=load, sdpa=sdpa)
        elif sdpa:
            o = causal_attention_sdpa(q, k, v, pos, self.scale, self.chunk_elements)
        else:
            o = causal_attention(q, k, v, pos, self.scale, self.chunk_elements)
        return self.o_proj(o.to(x.dtype).reshape(B, T, -1))
