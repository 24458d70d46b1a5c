"""The attention kernel: block-sparse flash attention on the tensor cores, one Triton kernel for prefill calls
(`FastPaths(prefill_attention="triton")`, every preset) and decode steps (`decode_attention="triton"`, `compiled`),
the same function as `msa.msa_attention` on MSA layers and `attention.causal_attention` on dense layers for a bf16
model, within the rounding stated below.

The reference gathers each query's selected key blocks into memory, converts them to fp32 and runs a softmax over
them (for an 8K prompt at release widths that is gigabytes of copies per layer). Here one program keeps a tile of
query rows in registers (`Tiles.rows`: a run of consecutive query tokens of one sequence times the G query heads of
one kv head) and streams key tiles of `Tiles.keys` slots from the cache as it is stored (bf16, or fp8 converted in
registers as `LayerCache.load` converts), with an online softmax:

* MSA layers: the program reads the union of its tokens' selected blocks (`blocks` [B, Hkv, T, kb] from the
  indexer, -1 = empty slot), each block once for the whole tile. `tile_blocks` builds the unions before the launch:
  per tile, its tokens' ids sorted ascending, each once, -1 after them, in a static [B, Hkv, tiles, U] tensor
  (U = min(tokens x kb, blocks in the cache)); two sorts on the device, no host read. In the kernel a row takes a
  block's keys only where its token selected that block (its own ids compared with the block's, in registers) and
  only at or before its position: each query reads exactly the keys of its selection, each once (a selection is a
  set: top-k's distinct ids). Neighbouring tokens share their local blocks and much of their top-k, so a union is
  usually far smaller than tokens x kb (`benchmarks/attention_kernel.py` reports its mean), and every product has
  the tile's rows as the tensor cores' M dimension. A block of more slots than `Tiles.keys` is read as several
  key tiles.
* Dense layers: the key tiles up to the tile's last position; the tiles wholly at or before its first position
  (every row sees every key) without the causal mask, the rest masked; tiles past the last position not read.
* Calls of fewer tokens than a tile (decode steps) get tiles of fewer tokens; one token's tile reads its own
  selection as given (no union). Such calls have a few dozen programs, too few for the GPU: each program's blocks
  or key tiles are then split over several programs (`splits_for`, flash-decoding) and their normalised sums merged
  by their softmax denominators (fp32) in a second kernel, one launch (`_merge_kernel`).

Numerics (the contract the tests check against the reference, which computes in fp32 on bf16-valued operands):
* scores: q . k with bf16 queries and keys (exact in fp32: a product of two bf16 values fits), summed in fp32 on
  the tensor cores in an unspecified order;
* softmax: online, in fp32, with exp2 of (score * scale * log2(e) - the row's running max in those units), the
  argument one fused multiply-add on the GPU (one rounding where the reference rounds the scaled score first), the
  GPU's approximate exp2 (about 2 ulp); the keys in an unspecified order (on MSA layers a tile's union ascending, a
  one-token tile's selection in its own order; on dense layers key tiles ascending);
* values: the probabilities split into two bf16 parts, p = hi + lo + r with |r| <= 2^-18 p, and two tensor-core
  products with the bf16 values (exact products, fp32 sums), so the value sum is the reference's to about 2^-17
  relative, far below the bf16 rounding the layer's output gets next; with `split_probabilities=False`
  (`FastPaths(attention_probabilities="bf16")`, the `compiled` preset) one part, p rounded once to bf16
  (|r| <= 2^-9 p, as flash attention does), one product a key tile; the denominator sums the fp32 p either way;
* split keys: each split's output (its sum divided by its denominator) weighted by exp2 of its log2-sum-exp minus the
  row's largest (the GPU's approximate exp2), the weighted outputs and the weights summed in fp32 in an unspecified
  order, one division;
* output fp32 [B, T, Hq, D], the sum divided by the softmax denominator once (0 for a query with no key); or, with
  `out_dtype` bf16 (a prefill's and decode step's attention in a bf16 model), that fp32 value rounded once to bf16
  (to nearest, ties to even), the bits its `.to(bfloat16)` gives.
The caller selects the blocks (`fast.attention.select_blocks_chunked`: msa.py's rule, the same ids); memory stays
linear in the context (no [Q, K] tensor).

`block_attention` launches it through an opaque registered operator (`minimax_ref::block_attention`): a compiled
decoder layer calls it as it is, and a CUDA graph captures it (static shapes, no host read). `handles` says where it
runs: CUDA with triton, a bf16 model, keys stored as bf16 or fp8. The tile shapes are data (`Tiles`: `TUNED` keyed
by GPU name, else `DEFAULT`). Under `TRITON_INTERPRET=1` (the tests on a CPU) the kernel runs on CPU tensors, with
`fast.grouped`'s exact-fp32 forms of the bf16 roundings and dots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from . import grouped
from .grouped import AVAILABLE, interpreting
from .launch import KernelTiles

if AVAILABLE:
    import triton
    import triton.language as tl

# The tensor cores' smallest tile side (tl.dot): rows and key tiles are at least this.
MIN_TILE = 16
LOG2E = 1.4426950408889634
# Splits the merge loads at once (a [CHUNK, head dim] fp32 tile a program)
MERGE_CHUNK = 16


@dataclass(frozen=True)
class Tiles(KernelTiles):
    """One launch configuration of the attention kernel: `rows` query rows a program (tokens times the group's
    heads, the heads padded to a power of two), `keys` key slots a tile (on MSA layers at most a block: a block of
    more slots is read as several tiles), `num_warps` and `num_stages` for programs of at least 64 rows (smaller
    ones, decode steps, run with 4 warps). All powers of two, at least 16 rows and keys."""

    KIND = "attention"

    rows: int = 128
    keys: int = 64
    num_warps: int = 8
    num_stages: int = 2

    def check(self) -> None:
        if self.rows < MIN_TILE or self.keys < MIN_TILE or self.num_stages < 1:
            raise ConfigError(f"attention tiles: rows={self.rows}, keys={self.keys} (>= {MIN_TILE}), "
                              f"num_stages={self.num_stages} (>= 1)")


# Untuned defaults, flash attention's usual shape for 128-channel heads on sm_90 without a measurement here: 128 query
# rows (8 tokens x 16 heads at release widths) against key tiles of 64, 8 warps.
DEFAULT = {"sparse": Tiles(), "dense": Tiles()}
# Measured configurations (benchmarks/attention_kernel.py --sweep prints entries in this form):
# torch.cuda.get_device_properties().name -> {(kind, cache): Tiles}, kind "sparse" (MSA layers) or "dense", cache
# "bf16" or "fp8" (how the keys are stored: an fp8 tile is converted in the loop, which shifts the best shape).
TUNED: dict[str, dict[tuple[str, str], Tiles]] = {
    # `--prompt-len 8192 --sweep` at release widths (torch 2.11, triton 3.6); an fp8 tile converted in the loop favours
    # 4 tokens a tile (smaller unions of blocks)
    "NVIDIA H100 80GB HBM3": {("sparse", "bf16"): Tiles(128, 64, 8, 3), ("sparse", "fp8"): Tiles(64, 64, 4, 2),
                              ("dense", "bf16"): Tiles(64, 64, 4, 3), ("dense", "fp8"): Tiles(128, 128, 8, 2)},
    "NVIDIA H200": {("sparse", "fp8"): Tiles(64, 64, 4, 2)},
}


def tiles_for(kind: str, device: torch.device, cache: str = "bf16") -> Tiles:
    """The launch configuration of `kind` ("sparse": MSA layers, "dense") over keys stored as `cache` ("bf16",
    "fp8") on `device`: `TUNED`'s entry for this GPU, else `DEFAULT`. Called in compiled layers too: the name comes
    from `get_device_properties`, which dynamo folds into a constant (and only when `TUNED` has entries)."""
    if device.type == "cuda" and TUNED:
        entry = TUNED.get(torch.cuda.get_device_properties(device).name, {})
        if (kind, cache) in entry:
            return entry[kind, cache]
    return DEFAULT[kind]


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def tile_tokens(rows: int, group: int, queries: int) -> int:
    """Query tokens a program takes: `rows` over the group's heads (padded to a power of two), fewer for calls of
    fewer tokens (decode steps), at least one."""
    return max(1, min(rows // _pow2(group), _pow2(queries)))


def tile_blocks(blocks: torch.Tensor, tokens: int, cached_blocks: int) -> torch.Tensor:
    """The union of the selected blocks [B, H, T, kb] (-1 = empty slot) of each tile of `tokens` consecutive queries
    -> int32 [B, H, ceil(T / tokens), min(tokens * kb, cached_blocks)]: each tile's ids ascending, each once, then -1.

    Static shapes and device ops only (it runs in compiled layers and CUDA graphs): the ids sorted with the empty
    slots as the largest int32, every repeat of its left neighbour turned into that largest value too, sorted again
    (the distinct ids now first). No tile selects more distinct blocks than the cache holds, so the list is cut
    there."""
    B, H, T, kb = blocks.shape
    n = -(-T // tokens)
    ids = F.pad(blocks.to(torch.int32), (0, 0, 0, n * tokens - T), value=-1).reshape(B, H, n, tokens * kb)
    none = torch.iinfo(torch.int32).max
    ids = torch.where(ids < 0, none, ids).sort(dim=-1).values
    repeat = F.pad(ids[..., 1:] == ids[..., :-1], (1, 0), value=False)
    ids = ids.masked_fill(repeat, none).sort(dim=-1).values[..., :min(tokens * kb, cached_blocks)]
    return ids.masked_fill(ids == none, -1)


if AVAILABLE:
    _bf16_value = grouped._bf16_value
    _bf16_storable = grouped._bf16_storable
    _e4m3_value = grouped._e4m3_value
    _x_operand = grouped._x_operand

    @triton.jit
    def _kv_tile(ptrs, mask, kv_scale, KV_FP8: tl.constexpr, EXACT_FP32: tl.constexpr):
        """A tile of stored keys or values as a dot operand, in the compute dtype bf16: bf16 as stored (KV_FP8 0); fp8
        (loaded as bytes) as `LayerCache.load` converts, bf16(fp32(e4m3) * scale): KV_FP8 2, or 1 for a scale of
        1.0, whose product is the value itself (no multiply an element). EXACT_FP32: the bf16 value held in fp32."""
        if KV_FP8:
            code = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
            v = _e4m3_value(code, EXACT_FP32)
            if KV_FP8 == 2:
                v = v * kv_scale
            return _bf16_value(v, EXACT_FP32)
        else:
            return _x_operand(ptrs, mask, EXACT_FP32)

    @triton.jit
    def _dot(a, b, acc, EXACT_FP32: tl.constexpr):
        if EXACT_FP32:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _limit(last, takes):
        """Each row's last readable slot: `last` (its position, or less) where `takes` (its token reads the tile's
        keys), else -2^30, below every slot (an empty block slot's are >= -BS). A key at slot kpos <= limit exists
        (kpos <= position < L)."""
        return tl.where(takes, last, -1073741824)

    @triton.jit
    def _attend(q, k_base, v_base, stride_kl, stride_vl, kpos, k_ok, d, d_ok, limit, m_i, l_i, acc,
                scale_log2, kv_scale, ROWS: tl.constexpr, KEYS: tl.constexpr, MASKED: tl.constexpr,
                KV_FP8: tl.constexpr, EXACT_FP32: tl.constexpr, SPLIT_P: tl.constexpr):
        """One key tile of the online softmax: keys at slots `kpos` [KEYS] (`k_ok`: exist). MASKED: row r reads the
        keys at slots <= `limit[r]` (`_limit`: its position where its token takes the tile's keys, else below every
        slot); else every row reads every key (a dense tile before all the rows' positions). SPLIT_P: the
        probabilities multiply the values as two bf16 parts (else one, rounded once). Returns the updated (running
        max in log2 units, denominator, value sum)."""
        load_ok = k_ok[:, None] & d_ok[None, :]
        kt = _kv_tile(k_base + kpos[:, None] * stride_kl + d[None, :], load_ok, kv_scale, KV_FP8, EXACT_FP32)
        s = _dot(q, tl.trans(kt), tl.zeros((ROWS, KEYS), dtype=tl.float32), EXACT_FP32)  # q . k
        if MASKED:  # one comparison an element: the row's conditions are folded into its limit
            s = tl.where(kpos[None, :] <= limit[:, None], s, float("-inf"))
        # the row's max of s * scale_log2 is its max of s times scale_log2 (> 0; rounding is monotone): one product
        # a row, and each exponent's argument one fused multiply-add
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: every term stays 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s * scale_log2 - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = _kv_tile(v_base + kpos[:, None] * stride_vl + d[None, :], load_ok, kv_scale, KV_FP8, EXACT_FP32)
        p_hi = _bf16_value(p, EXACT_FP32)
        acc = _dot(p_hi, vt, acc * alpha[:, None], EXACT_FP32)
        if SPLIT_P:
            acc = _dot(_bf16_value(p - p_hi.to(tl.float32), EXACT_FP32), vt, acc, EXACT_FP32)
        return m_new, l_i, acc

    @triton.jit
    def _attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, pos_ptr, sel_ptr, union_ptr,
        T, L, KB, BS, U, scale_log2, kv_scale,
        stride_qb, stride_qt, stride_qh, stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
        stride_os, stride_ob, stride_ot, stride_oh, stride_ls, stride_lb, stride_lt, stride_pb, stride_pt,
        stride_sb, stride_sh, stride_st, stride_ub, stride_uh, stride_ut,
        G: tl.constexpr, GP: tl.constexpr, TOKENS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
        KEYS: tl.constexpr, BLOCK: tl.constexpr, KBP: tl.constexpr, UP: tl.constexpr, SPLITS: tl.constexpr,
        SPARSE: tl.constexpr, KV_FP8: tl.constexpr, EXACT_FP32: tl.constexpr, OUT_BF16: tl.constexpr,
        SPLIT_P: tl.constexpr,
    ):
        """o[s, b, t, h*G + g] (fp32, or rounded once to bf16 with OUT_BF16) over split s of the keys of kv head h
        that query token t reads (`block_attention`), and with SPLITS > 1 the split's log2-sum-exp
        lse[s, b, t, h*G + g]. Grid: (token tiles, kv heads, sequences x splits). Rows: TOKENS tokens times GP >= G
        heads (rows g >= G idle). Sparse: the tile's blocks are union[b, h, tile, :U] (ascending, -1 after) for
        TOKENS > 1, the token's sel[b, h, t, :KB] (-1 = none) for TOKENS == 1; BLOCK >= BS slots a block, read in
        tiles of KEYS."""
        pid_t = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2) // SPLITS
        split = tl.program_id(2) % SPLITS
        ROWS: tl.constexpr = TOKENS * GP
        r = tl.arange(0, ROWS)
        tok = pid_t * TOKENS + r // GP
        g = r % GP
        row_ok = (tok < T) & (g < G)
        d = tl.arange(0, DP)
        d_ok = d < D
        qpos = tl.load(pos_ptr + b * stride_pb + tok * stride_pt, mask=row_ok, other=-1)
        q_rows = q_ptr + b * stride_qb + tok[:, None] * stride_qt + (h * G + g)[:, None] * stride_qh
        q = _x_operand(q_rows + d[None, :], row_ok[:, None] & d_ok[None, :], EXACT_FP32)
        k_base = k_ptr + b * stride_kb + h * stride_kh
        v_base = v_ptr + b * stride_vb + h * stride_vh
        m_i = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((ROWS,), dtype=tl.float32)
        acc = tl.zeros((ROWS, DP), dtype=tl.float32)
        n = tl.arange(0, KEYS)
        if SPARSE:
            if TOKENS > 1:
                # the tile's union: its distinct ids first, so the slots to read are those >= 0
                ids = union_ptr + b * stride_ub + h * stride_uh + pid_t * stride_ut
                u = tl.arange(0, UP)
                slots = tl.sum((tl.load(ids + u, mask=u < U, other=-1) >= 0).to(tl.int32), 0)
                # the tile's tokens' own selections [TOKENS, KBP], compared with every block read
                kk = tl.arange(0, KBP)
                tt = pid_t * TOKENS + tl.arange(0, TOKENS)
                mine = tl.load(sel_ptr + b * stride_sb + h * stride_sh + tt[:, None] * stride_st + kk[None, :],
                               mask=(tt < T)[:, None] & (kk < KB)[None, :], other=-1)
            else:
                # one token: its own selection, empty slots (-1) anywhere in it
                ids = sel_ptr + b * stride_sb + h * stride_sh + pid_t * stride_st
                slots = KB
            per = (slots + SPLITS - 1) // SPLITS
            # no branch on the id in the loop (the pipeliner prefetches the next block's keys): an empty slot's
            # slots are negative, masked (its tile costs the products, only in contexts shorter than kb blocks)
            for j in range(split * per, tl.minimum(split * per + per, slots)):
                blk = tl.load(ids + j)
                if TOKENS > 1:
                    # whether each token selected the block, given to its GP rows (row r is token r // GP)
                    hit = tl.max((mine == blk).to(tl.int32), 1)
                    takes = tl.reshape(tl.broadcast_to(hit[:, None], (TOKENS, GP)), (ROWS,)) > 0
                else:
                    takes = row_ok
                # the block's own BS slots, at or before the row's position; an empty slot (-1) none
                limit = _limit(tl.minimum(qpos, blk * BS + BS - 1), takes & (blk >= 0))
                for c in tl.static_range(0, BLOCK, KEYS):
                    kpos = blk * BS + c + n
                    k_ok = (c + n < BS) & (kpos >= 0) & (kpos < L)  # what the loads may read
                    m_i, l_i, acc = _attend(q, k_base, v_base, stride_kl, stride_vl, kpos, k_ok, d, d_ok, limit,
                                            m_i, l_i, acc, scale_log2, kv_scale, ROWS, KEYS, True, KV_FP8,
                                            EXACT_FP32, SPLIT_P)
        else:
            # the key tiles up to the tile's last position (this split's share of them); those wholly at or before
            # its first position need no mask
            last = tl.minimum(tl.max(qpos, 0), L - 1)
            first = tl.minimum(tl.min(tl.where(row_ok, qpos, L - 1), 0), L - 1)
            tiles = last // KEYS + 1
            full = (first + 1) // KEYS
            per = (tiles + SPLITS - 1) // SPLITS
            lo = split * per
            hi = tl.minimum(lo + per, tiles)
            limit = _limit(qpos, row_ok)
            for j in range(lo, tl.minimum(hi, full)):
                kpos = j * KEYS + n
                m_i, l_i, acc = _attend(q, k_base, v_base, stride_kl, stride_vl, kpos, kpos < L, d, d_ok, limit,
                                        m_i, l_i, acc, scale_log2, kv_scale, ROWS, KEYS, False, KV_FP8, EXACT_FP32,
                                        SPLIT_P)
            for j in range(tl.maximum(lo, full), hi):
                kpos = j * KEYS + n
                m_i, l_i, acc = _attend(q, k_base, v_base, stride_kl, stride_vl, kpos, kpos < L, d, d_ok, limit,
                                        m_i, l_i, acc, scale_log2, kv_scale, ROWS, KEYS, True, KV_FP8, EXACT_FP32,
                                        SPLIT_P)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = o_ptr + split * stride_os + b * stride_ob + tok[:, None] * stride_ot + (h * G + g)[:, None] * stride_oh
        if OUT_BF16:
            tl.store(o_rows + d[None, :], _bf16_storable(o, EXACT_FP32), mask=row_ok[:, None] & d_ok[None, :])
        else:
            tl.store(o_rows + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
        if SPLITS > 1:
            # a split that read no key weighs nothing in the merge
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + split * stride_ls + b * stride_lb + tok * stride_lt + h * G + g, lse, mask=row_ok)

    @triton.jit
    def _merge_kernel(o_ptr, lse_ptr, out_ptr, stride_os, stride_ls, SPLITS: tl.constexpr, SP: tl.constexpr,
                      CHUNK: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, OUT_BF16: tl.constexpr,
                      EXACT_FP32: tl.constexpr):
        """The splits of `_attention_kernel` merged for one query row r (b, t, head flattened; grid: rows):
        out[r] = sum_s w_s o[s, r] / sum_s w_s with w_s = exp2(lse[s, r] - max_s lse[s, r]), in fp32, the sums in an
        unspecified order; a row no split read (every lse -inf) gives 0. OUT_BF16: rounded once to bf16. o, out
        [rows, D] contiguous a split, lse [rows] a split; SP >= SPLITS and CHUNK powers of two. Every split's
        weight at once, then the outputs CHUNK splits a load (their loads independent: a step of one row has up to
        2 x SMs splits, which one at a time would wait on memory in turn)."""
        r = tl.program_id(0)
        s = tl.arange(0, SP)
        lse = tl.load(lse_ptr + s * stride_ls + r, mask=s < SPLITS, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # a row no split read: every weight 0
        den = tl.sum(tl.exp2(lse - m), 0)
        d = tl.arange(0, DP)
        c = tl.arange(0, CHUNK)
        num = tl.zeros((DP,), dtype=tl.float32)
        for s0 in range(0, SPLITS, CHUNK):
            ok = s0 + c < SPLITS
            wc = tl.exp2(tl.load(lse_ptr + (s0 + c) * stride_ls + r, mask=ok, other=float("-inf")) - m)
            o = tl.load(o_ptr + (s0 + c)[:, None] * stride_os + r * D + d[None, :],
                        mask=ok[:, None] & (d < D)[None, :], other=0.0)
            num += tl.sum(wc[:, None] * o, 0)
        out = num / tl.where(den > 0, den, 1.0)
        if OUT_BF16:
            tl.store(out_ptr + r * D + d, _bf16_storable(out, EXACT_FP32), mask=d < D)
        else:
            tl.store(out_ptr + r * D + d, out, mask=d < D)

    # An opaque operator (not `triton_op`): inductor calls it as it is from a compiled layer, and it launches the
    # kernel through Triton's own compilation, the one the eager calls and the tests use.
    @torch.library.custom_op("minimax_ref::block_attention", mutates_args=())
    def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      blocks: torch.Tensor | None, union: torch.Tensor | None, block_size: int, tokens: int,
                      keys: int, scale: float, kv_scale: float, splits: int, num_warps: int, num_stages: int,
                      exact_fp32: bool, out_bf16: bool = False, split_p: bool = True) -> torch.Tensor:
        """The launch (see `block_attention`); k, v as stored (fp8 as uint8), blocks int32 [B, Hkv, T, kb] or None,
        union (`tile_blocks` of them for `tokens` > 1) or None; out_bf16: the output rounded once to bf16 (by the
        kernel, or after the splits' fp32 merge); split_p: the probabilities in two bf16 parts (else one)."""
        B, T, Hq, D = q.shape
        L, Hkv = k.shape[1], k.shape[2]
        G = Hq // Hkv
        sparse = blocks is not None
        gp = max(_pow2(G), MIN_TILE // tokens)
        kb = blocks.shape[-1] if sparse else 0
        u = union.shape[-1] if union is not None else 0
        sel = blocks if sparse else q_pos  # unread when dense
        ids = union if union is not None else q_pos  # unread unless a sparse tile has several tokens
        direct = out_bf16 and splits == 1  # the kernel rounds its one result; splits merge in fp32 first
        out = torch.empty(*((splits,) if splits > 1 else ()), B, T, Hq, D,
                          dtype=torch.bfloat16 if direct else torch.float32, device=q.device)
        lse = torch.empty(splits, B, T, Hq, dtype=torch.float32, device=q.device) if splits > 1 else q_pos  # unread
        per = (0,) if splits == 1 else (out.stride(0),)
        grid = (triton.cdiv(T, tokens), Hkv, B * splits)
        lse_strides = lse.stride()[:3] if splits > 1 else (0, 0, 0)
        sel_strides = sel.stride()[:3] if sparse else (0, 0, 0)
        ids_strides = ids.stride()[:3] if union is not None else (0, 0, 0)
        block = max(MIN_TILE, _pow2(block_size)) if sparse else keys
        _attention_kernel[grid](
            q, k, v, out, lse, q_pos, sel, ids,
            T, L, kb, max(block_size, 1), u, scale * LOG2E, kv_scale,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *per, *out.stride()[-4:-1], *lse_strides,
            *q_pos.stride(), *sel_strides, *ids_strides,
            G=G, GP=gp, TOKENS=tokens, D=D, DP=max(MIN_TILE, _pow2(D)), KEYS=min(keys, block), BLOCK=block,
            KBP=_pow2(max(kb, 1)), UP=_pow2(max(u, 1)), SPLITS=splits, SPARSE=sparse,
            KV_FP8=fp8_mode(k.dtype, kv_scale), EXACT_FP32=exact_fp32, OUT_BF16=direct, SPLIT_P=split_p,
            num_warps=num_warps if tokens * gp >= 64 else 4, num_stages=num_stages)
        if splits == 1:
            return out
        # the splits merged by one kernel: each split's normalised sum weighted by its share of the denominator
        merged = torch.empty(B, T, Hq, D, dtype=torch.bfloat16 if out_bf16 else torch.float32, device=q.device)
        _merge_kernel[(B * T * Hq,)](
            out, lse, merged, out.stride(0), lse.stride(0), SPLITS=splits, SP=_pow2(splits),
            CHUNK=min(MERGE_CHUNK, _pow2(splits)), D=D, DP=max(MIN_TILE, _pow2(D)), OUT_BF16=out_bf16,
            EXACT_FP32=exact_fp32, num_warps=4)
        return merged

    @_attention_op.register_fake
    def _(q, k, v, q_pos, blocks, union, block_size, tokens, keys, scale, kv_scale, splits, num_warps, num_stages,
          exact_fp32, out_bf16=False, split_p=True):
        return q.new_empty(q.shape, dtype=torch.bfloat16 if out_bf16 else torch.float32)


def fp8_mode(stored: torch.dtype, scale: float) -> int:
    """The kernels' KV_FP8 constexpr for keys stored as `stored` (fp8 passed as uint8 bytes) read with `scale`: 0
    bf16, 1 fp8 at scale 1.0 (the cache's rule: no multiply an element), 2 fp8 scaled."""
    if stored != torch.uint8:
        return 0
    return 1 if scale == 1.0 else 2


def splits_for(programs: int, max_splits: int, sms: int) -> int:
    """Splits of each program's keys so that `programs` times the splits fill `sms` SMs twice over (a decode step
    has one program per sequence and kv head: a few dozen), at most `max_splits`; 1 when the programs alone do."""
    return max(1, min(max_splits, -(-2 * sms // max(programs, 1))))


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                    blocks: torch.Tensor | None = None, block_size: int = 0, kv_scale: float = 1.0,
                    sms: int = 1, tiles: Tiles | None = None, out_dtype: torch.dtype = torch.float32,
                    split_probabilities: bool = True) -> torch.Tensor:
    """Attention of bf16 queries q [B, T, Hq, D] at positions q_pos [B, T] over keys and values k, v [B, L, Hkv, D]
    as a cache stores them (slot = position; bf16, or float8_e4m3fn read as bf16(fp32(x) * kv_scale)).

    blocks None: dense causal attention (`attention.causal_attention`). blocks [B, Hkv, T, kb] (-1 = empty slot;
    a query's ids distinct, as top-k gives them): each query token reads only the keys of its kv head's selected
    blocks of `block_size` slots, at or before its position (`msa.gather_block_attention`). Returns [B, T, Hq, D] in
    `out_dtype`: fp32, or bf16 rounded once (to nearest, ties to even) from that fp32 result, as `.to(bfloat16)` of
    it gives (the kernel stores it so, skipping the fp32 tensor); the numerics are the module docstring's.

    tiles: the launch configuration (default `tiles_for` this device, layer kind and cache storage). sms: the GPU's
    SM count: when the (sequence, kv head, query tile) programs are too few to fill it (decode steps), each program's
    blocks or key tiles are split (`splits_for`) and the splits' partial results merged by their softmax denominators
    (fp32).
    split_probabilities: the value sum takes each probability as two bf16 parts (the module docstring's contract,
    2^-18); False: as one bf16 value, rounded once (2^-9 relative a probability, flash attention's rule; one
    tensor-core product a key tile fewer).
    Static in the shapes, no host synchronisation: it runs in compiled layers and CUDA graphs (a registered
    operator).
    """
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"block_attention: out_dtype {out_dtype} (float32 or bfloat16)")
    B, T, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    sparse = blocks is not None
    if tiles is None:
        tiles = tiles_for("sparse" if sparse else "dense", q.device,
                          "fp8" if k.dtype == torch.float8_e4m3fn else "bf16")
    tokens = tile_tokens(tiles.rows, Hq // Hkv, T)
    programs = B * Hkv * -(-T // tokens)
    union = None
    if sparse:
        blocks = blocks.to(torch.int32).contiguous()
        if tokens > 1:
            union = tile_blocks(blocks, tokens, -(-L // block_size))
        most = union.shape[-1] if union is not None else blocks.shape[-1]
    else:
        most = -(-L // tiles.keys)
    if k.dtype == torch.float8_e4m3fn:
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    return torch.ops.minimax_ref.block_attention(q, k, v, q_pos, blocks, union, block_size, tokens, tiles.keys, scale,
                                                 kv_scale, splits_for(programs, most, sms), tiles.num_warps,
                                                 tiles.num_stages, interpreting(), out_dtype == torch.bfloat16,
                                                 split_probabilities)


def handles(device: torch.device, dtype: torch.dtype, stored: torch.dtype, head_dim: int) -> bool:
    """Whether `block_attention` runs here: a bf16 model whose keys are stored as bf16 or fp8, heads of at most 256
    channels, on CUDA with triton (or CPU tensors under the interpreter, outside compiled regions: those cannot trace
    an interpreted kernel)."""
    if not AVAILABLE or dtype != torch.bfloat16 or stored not in (torch.bfloat16, torch.float8_e4m3fn):
        return False
    if head_dim > 256:
        return False
    if interpreting():
        return device.type == "cpu" and not torch.compiler.is_compiling()
    return device.type == "cuda"
