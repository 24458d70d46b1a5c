"""The attention kernel: block-sparse flash attention on the tensor cores, one Triton kernel for prefill calls
(`FastPaths(prefill_attention="triton")`, every preset) and decode steps (`decode_attention="triton"`, `compiled`),
the same function as `msa.msa_attention` on MSA layers and `attention.causal_attention` on dense layers for a bf16
model, within the rounding stated below.

The reference gathers each query's selected key blocks into memory, converts them to fp32 and runs a softmax over
them (for an 8K prompt at release widths that is gigabytes of copies per layer). Here one program keeps a tile of
queries in registers and streams the keys it reads from the cache as it is stored (bf16, or fp8 converted in
registers as `LayerCache.load` converts), with an online softmax:

* MSA layers: one program per (sequence, kv head, query token): the token's G query heads (one kv head's group) as
  the rows of a tile, its selected blocks (`blocks` [B, Hkv, T, kb] from the indexer, -1 = empty slot) as the key
  tiles, masked at the token's position. No union over neighbouring tokens: each reads exactly its selection.
* Dense layers: one program per (sequence, kv head, `DENSE_ROWS` / G tokens, fewer for short calls): every key tile
  up to the last query's position, masked causally.
* Decode steps have a few dozen such programs, too few for the GPU: each program's keys are then split over several
  programs (`splits_for`, flash-decoding) and their normalised sums merged by their softmax denominators (fp32).

Numerics (the contract the tests check against the reference, which computes in fp32 on bf16-valued operands):
* scores: q . k with bf16 queries and keys (exact in fp32: a product of two bf16 values fits), summed in fp32 on
  the tensor cores in an unspecified order, then times `scale`;
* softmax: online, in fp32, with exp2 of the scores times log2(e) (the GPU's approximate exp2, about 2 ulp);
* values: the probabilities split into two bf16 parts, p = hi + lo + r with |r| <= 2^-18 p, and two tensor-core
  products with the bf16 values (exact products, fp32 sums), so the value sum is the reference's to about 2^-17
  relative, far below the bf16 rounding the layer's output gets next;
* output fp32 [B, T, Hq, D], the sum divided by the softmax denominator once.
The caller selects the blocks (`fast.attention.select_blocks_chunked`: msa.py's rule, the same ids); memory stays
linear in the context (no [Q, K] tensor).

`block_attention` launches it through an opaque registered operator (`minimax_ref::block_attention`): a compiled
decoder layer calls it as it is, and a CUDA graph captures it (static shapes, no host read). `handles` says where it
runs: CUDA with triton, a bf16 model, keys stored as bf16 or fp8. Under
`TRITON_INTERPRET=1` (the tests on a CPU) the kernel runs on CPU tensors, with `fast.grouped`'s exact-fp32 forms of
the bf16 roundings and dots.
"""

from __future__ import annotations

import torch

from . import grouped
from .grouped import AVAILABLE, interpreting

if AVAILABLE:
    import triton
    import triton.language as tl

# Query rows of a dense program (tokens times the group's heads): flash attention's usual 128-row tile.
DENSE_ROWS = 128
# Keys per tile on dense layers.
DENSE_KEYS = 64
# The tensor cores' smallest tile side (tl.dot): rows and key tiles are at least this.
MIN_TILE = 16
LOG2E = 1.4426950408889634


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _dense_tokens(group: int, queries: int) -> int:
    """Query tokens per program on dense layers: `DENSE_ROWS` rows, fewer for calls of fewer tokens (decode)."""
    return max(1, min(DENSE_ROWS // _pow2(group), _pow2(queries)))


if AVAILABLE:
    _bf16_value = grouped._bf16_value
    _e4m3_value = grouped._e4m3_value
    _x_operand = grouped._x_operand

    @triton.jit
    def _kv_tile(ptrs, mask, kv_scale, KV_FP8: tl.constexpr, EXACT_FP32: tl.constexpr):
        """A tile of stored keys or values as a dot operand, in the compute dtype bf16: bf16 as stored; fp8 (loaded
        as bytes) as `LayerCache.load` converts, bf16(fp32(e4m3) * scale). EXACT_FP32: the bf16 value held in fp32."""
        if KV_FP8:
            code = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
            return _bf16_value(_e4m3_value(code, EXACT_FP32) * kv_scale, EXACT_FP32)
        else:
            return _x_operand(ptrs, mask, EXACT_FP32)

    @triton.jit
    def _dot(a, b, acc, EXACT_FP32: tl.constexpr):
        if EXACT_FP32:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _attend(q, k_base, v_base, stride_kl, stride_vl, kpos, k_ok, d, d_ok, qpos, m_i, l_i, acc, scale_log2,
                kv_scale, ROWS: tl.constexpr, KEYS: tl.constexpr, KV_FP8: tl.constexpr, EXACT_FP32: tl.constexpr):
        """One key tile of the online softmax: keys at slots `kpos` [KEYS] (`k_ok`: exist), masked at each row's
        position `qpos` [ROWS]. Returns the updated (running max in log2 units, denominator, value sum)."""
        load_ok = k_ok[:, None] & d_ok[None, :]
        kt = _kv_tile(k_base + kpos[:, None] * stride_kl + d[None, :], load_ok, kv_scale, KV_FP8, EXACT_FP32)
        s = _dot(q, tl.trans(kt), tl.zeros((ROWS, KEYS), dtype=tl.float32), EXACT_FP32) * scale_log2
        s = tl.where(k_ok[None, :] & (kpos[None, :] <= qpos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: every term stays 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = _kv_tile(v_base + kpos[:, None] * stride_vl + d[None, :], load_ok, kv_scale, KV_FP8, EXACT_FP32)
        p_hi = _bf16_value(p, EXACT_FP32)
        p_lo = _bf16_value(p - p_hi.to(tl.float32), EXACT_FP32)
        acc = _dot(p_hi, vt, acc * alpha[:, None], EXACT_FP32)
        acc = _dot(p_lo, vt, acc, EXACT_FP32)
        return m_new, l_i, acc

    @triton.jit
    def _attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, pos_ptr, blocks_ptr,
        T, L, KB, BS, PER_SPLIT, scale_log2, kv_scale,
        stride_qb, stride_qt, stride_qh, stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
        stride_os, stride_ob, stride_ot, stride_oh, stride_ls, stride_lb, stride_lt, stride_pb, stride_pt,
        stride_bb, stride_bh, stride_bt,
        G: tl.constexpr, GP: tl.constexpr, TOKENS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
        KEYS: tl.constexpr, SPLITS: tl.constexpr, SPARSE: tl.constexpr, KV_FP8: tl.constexpr,
        EXACT_FP32: tl.constexpr,
    ):
        """o[s, b, t, h*G + g] over split s of the keys of kv head h that query token t reads (`block_attention`),
        and with SPLITS > 1 the split's log2-sum-exp lse[s, b, t, h*G + g]. Grid: (token tiles, kv heads,
        sequences x splits). Rows: TOKENS tokens times GP >= G heads (rows g >= G idle)."""
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
            # TOKENS == 1: the token's own selection (this split's slots of it); an empty slot (-1) reads nothing
            sel = blocks_ptr + b * stride_bb + h * stride_bh + pid_t * stride_bt
            for j in range(split * PER_SPLIT, tl.minimum(split * PER_SPLIT + PER_SPLIT, KB)):
                blk = tl.load(sel + j)
                if blk >= 0:
                    kpos = blk * BS + n
                    k_ok = (n < BS) & (kpos < L)
                    m_i, l_i, acc = _attend(q, k_base, v_base, stride_kl, stride_vl, kpos, k_ok, d, d_ok, qpos,
                                            m_i, l_i, acc, scale_log2, kv_scale, ROWS, KEYS, KV_FP8, EXACT_FP32)
        else:
            # the key tiles up to the tile's last query (its tokens' largest position), this split's share of them
            last = tl.load(pos_ptr + b * stride_pb + pid_t * TOKENS * stride_pt)
            for i in tl.static_range(1, TOKENS):
                t_i = pid_t * TOKENS + i
                last = tl.maximum(last, tl.load(pos_ptr + b * stride_pb + t_i * stride_pt, mask=t_i < T, other=0))
            tiles = tl.minimum(last, L - 1) // KEYS + 1
            per = (tiles + SPLITS - 1) // SPLITS
            for j in range(split * per, tl.minimum(split * per + per, tiles)):
                kpos = j * KEYS + n
                k_ok = kpos < L
                m_i, l_i, acc = _attend(q, k_base, v_base, stride_kl, stride_vl, kpos, k_ok, d, d_ok, qpos,
                                        m_i, l_i, acc, scale_log2, kv_scale, ROWS, KEYS, KV_FP8, EXACT_FP32)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = o_ptr + split * stride_os + b * stride_ob + tok[:, None] * stride_ot + (h * G + g)[:, None] * stride_oh
        tl.store(o_rows + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
        if SPLITS > 1:
            # a split that read no key weighs nothing in the merge
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + split * stride_ls + b * stride_lb + tok * stride_lt + h * G + g, lse, mask=row_ok)

    # An opaque operator (not `triton_op`): inductor calls it as it is from a compiled layer, and it launches the
    # kernel through Triton's own compilation, the one the eager calls and the tests use.
    @torch.library.custom_op("minimax_ref::block_attention", mutates_args=())
    def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      blocks: torch.Tensor | None, block_size: int, scale: float, kv_scale: float, splits: int,
                      exact_fp32: bool) -> torch.Tensor:
        """The launch (see `block_attention`); k, v as stored (fp8 as uint8), blocks int32 or None."""
        B, T, Hq, D = q.shape
        L, Hkv = k.shape[1], k.shape[2]
        G = Hq // Hkv
        sparse = blocks is not None
        tokens = 1 if sparse else _dense_tokens(G, T)
        gp = max(_pow2(G), MIN_TILE // tokens)
        keys = max(MIN_TILE, _pow2(block_size)) if sparse else DENSE_KEYS
        kb = blocks.shape[-1] if sparse else 0
        sel = blocks if sparse else q_pos  # unread when dense
        out = torch.empty(*((splits,) if splits > 1 else ()), B, T, Hq, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, B, T, Hq, dtype=torch.float32, device=q.device) if splits > 1 else q_pos  # unread
        per = (0,) if splits == 1 else (out.stride(0),)
        grid = (triton.cdiv(T, tokens), Hkv, B * splits)
        lse_strides = lse.stride()[:3] if splits > 1 else (0, 0, 0)
        sel_strides = sel.stride()[:3] if sparse else (0, 0, 0)
        _attention_kernel[grid](
            q, k, v, out, lse, q_pos, sel,
            T, L, kb, max(block_size, 1), -(-kb // splits), scale * LOG2E, kv_scale,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *per, *out.stride()[-4:-1], *lse_strides,
            *q_pos.stride(), *sel_strides,
            G=G, GP=gp, TOKENS=tokens, D=D, DP=max(MIN_TILE, _pow2(D)), KEYS=keys, SPLITS=splits, SPARSE=sparse,
            KV_FP8=k.dtype == torch.uint8, EXACT_FP32=exact_fp32, num_warps=4 if tokens * gp <= 32 else 8,
            num_stages=2)
        if splits == 1:
            return out
        # the splits merged: each split's normalised sum weighted by its share of the softmax denominator
        weight = torch.exp2(lse - lse.amax(0))
        return (out * weight[..., None]).sum(0) / weight.sum(0)[..., None]

    @_attention_op.register_fake
    def _(q, k, v, q_pos, blocks, block_size, scale, kv_scale, splits, exact_fp32):
        return q.new_empty(q.shape, dtype=torch.float32)


def splits_for(programs: int, max_splits: int, sms: int) -> int:
    """Splits of each program's keys so that `programs` times the splits fill `sms` SMs twice over (a decode step
    has one program per sequence and kv head: a few dozen), at most `max_splits`; 1 when the programs alone do."""
    return max(1, min(max_splits, -(-2 * sms // max(programs, 1))))


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
                    blocks: torch.Tensor | None = None, block_size: int = 0, kv_scale: float = 1.0,
                    sms: int = 1) -> torch.Tensor:
    """Attention of bf16 queries q [B, T, Hq, D] at positions q_pos [B, T] over keys and values k, v [B, L, Hkv, D]
    as a cache stores them (slot = position; bf16, or float8_e4m3fn read as bf16(fp32(x) * kv_scale)).

    blocks None: dense causal attention (`attention.causal_attention`). blocks [B, Hkv, T, kb] (-1 = empty slot):
    each query token reads only the keys of its kv head's selected blocks of `block_size` slots, at or before its
    position (`msa.gather_block_attention`). Returns fp32 [B, T, Hq, D]; the numerics are the module docstring's.

    sms: the GPU's SM count: when the (sequence, kv head, query tile) programs are too few to fill it (decode
    steps), each program's keys are split (`splits_for`) and the splits' partial results merged by their softmax
    denominators (fp32). Static in the shapes, no host synchronisation: it runs in compiled layers and CUDA graphs
    (a registered operator).
    """
    B, T, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    if blocks is not None:
        blocks = blocks.to(torch.int32)
        programs, most = B * Hkv * T, blocks.shape[-1]
    else:
        programs, most = B * Hkv * -(-T // _dense_tokens(Hq // Hkv, T)), -(-L // DENSE_KEYS)
    if k.dtype == torch.float8_e4m3fn:
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    return torch.ops.minimax_ref.block_attention(q, k, v, q_pos, blocks, block_size, scale, kv_scale,
                                                 splits_for(programs, most, sms), interpreting())


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
