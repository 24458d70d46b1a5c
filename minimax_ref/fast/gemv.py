"""Packed products for decode steps (1 to 64 rows) from weights reordered once at load into the order the kernel
reads (`FastPaths(gemv="triton")`): a split-K GEMV on the CUDA cores for one row (`GEMV_ROWS`), tensor-core `tl.dot`
from two rows to 64, one Triton kernel for both.

Layout (`reorder`, made by `FastPackedWeight.configure` on fast models only, kept beside the stored planes as
non-persistent buffers: the reference model and its state_dict are unchanged; it costs the packed bytes once more).
A packed linear `[N, K]` or stack `[E, N, K]` is cut into tiles of `TILE_N` = 32 weight rows by `TILE_K` elements
(256 NVFP4, 128 MXFP8: 128 packed bytes a row either way), N and K padded with zero bytes and zero scales up to whole
tiles, and stored tile after tile:

    words  int32 [E, N_tiles, K_tiles, TILE_N, 32]   the packed bytes of the tile's rows, each row's 128 bytes in
                                                     their stored order (read little-endian: NVFP4 element 8w + j is
                                                     nibble j of word w, MXFP8 element 4w + i is byte i)
    scales uint8 [E, N_tiles, K_tiles, TILE_N, B]    the tile's block scales (B = 16 E4M3 NVFP4, 4 E8M0 MXFP8)
    glob   fp32  [E] or [1]                          NVFP4's weight_scale_2 (MXFP8: an unread 1.0)

so a program streams one contiguous 4 KB chunk of words (and 512 / 128 bytes of scales) a K step, every thread
loading 16-byte vectors, and the K steps of one tile column follow each other in memory (a split of K reads one
contiguous range). Zero padding decodes to +0 (code 0 times any scale, any code times a zero scale) and meets x's
masked zeros. `restore` is the inverse (the bits are the same: `reorder` only moves bytes).

Numerics contract (`packed_product`): y[p, m, n] = bf16( sum_k x[p, m, k] * w_hat[e(p), n, k] ) with w_hat =
`packed.decode_reference(...).to(bfloat16)` bit for bit, decoded by bit operations: an E2M1 nibble placed on fp32
bits as e2m1 * 2^-126, times the reference's block scale fp32(e4m3) * weight_scale_2 (one rounding, as the
reference) times 2^126, rounded to bf16 (`grouped._nibble`; the one-row GEMV places two nibbles at once,
`_nibble_pair`), or with `table` looked up in the block's table of its 8 values (`grouped._TABLE_ASM`, the same
bits); an E4M3 byte converted to fp32, times 2^(code - 127) built from the E8M0 code's bits (exact, and already a
bf16 value in range: the GEMV multiplies it as it is, the dot's tile rounds it, `grouped._e4m3_byte`). This needs
the scales in the normal range (`packed.scales_in_normal_range`) and, MXFP8, no E4M3 NaN byte;
`FastPackedWeight.configure` checks both and keeps its other paths otherwise. Every product is exact in fp32 (two
bf16 values); the GEMV accumulates the row's products in fp32, per (weight row, word lane) across the K steps of a
split and the elements of a word, then adds the 32 lanes in a tree (`tl.sum`); the dot accumulates in fp32 on the
tensor cores; splits of K write fp32 partial sums that a second kernel adds in split order (0, 1, 2, ...) and rounds
once to bf16. Bound (tests): |y - exact| <= gamma_K(2u) * sum_k |x w_hat| before the final rounding, gamma_K(2u) =
2Ku / (1 - 2Ku), u = 2^-24 (twice the unit roundoff: tensor cores may truncate when they align addends). Eager calls
and compiled regions give the same bits.

Routed experts: `index` (a device LongTensor of chosen experts, e.g. the router's top-k ids) makes program p read
entry index[p] only; `active` (int32 flags over the stack) makes the unflagged entries read nothing and give zero
rows. No host synchronisation, static shapes: registered as `minimax_ref::packed_gemv` (`torch.library.triton_op`),
so compiled layers launch it as it is and CUDA graphs capture it.

Under `TRITON_INTERPRET=1` the kernel runs on CPU tensors (tests), with `fast.grouped`'s exact fp32 emulation of the
bf16 roundings and of the bf16 dot (`grouped.interpreting`).
"""

from __future__ import annotations

import torch

from ..weights.checkpoint import MXFP8, NVFP4
from . import grouped

if grouped.AVAILABLE:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    # The shared decoders as globals of this module: a kernel compiled in inductor's worker process resolves its
    # callees by global name, not through a module attribute.
    _decoded_tile = grouped._decoded_tile
    _table_words = grouped._table_words
    _table_planes = grouped._table_planes
    _step_scales = grouped._step_scales
    _x_operand = grouped._x_operand
    _e4m3_value = grouped._e4m3_value
    _bf16_storable = grouped._bf16_storable
    _bf16_value = grouped._bf16_value
    _SIGN_PAIR = tl.constexpr(-2147450880)  # bits 31 and 15
    _E2M1_PAIR = tl.constexpr(0x01C001C0)  # bits 24..22 and 8..6

AVAILABLE = grouped.AVAILABLE
# Rows up to which the product is a GEMV on the CUDA cores; above, up to `MAX_ROWS`, the tensor cores' dot (16 rows
# at least: from two rows on the tile is decoded once for all rows, and the dot's idle columns cost nothing that
# bounds it). One: a GEMV of several rows needs a 3-D accumulator, for which the compiler moves every decoded element
# through shared memory (ptx of sm_90: four barriers per nibble).
GEMV_ROWS = 1
MAX_ROWS = grouped.MAX_ROWS
TILE_N = 32
TILE_K = {NVFP4: 256, MXFP8: 128}
WORDS = 32  # int32 words of a tile row: 128 packed bytes in either format
BLOCK = {NVFP4: 16, MXFP8: 32}  # elements per block scale
# Programs per SM that the K splits aim for: a GEMV program is short (a few 4 KB steps), so several a SM keep enough
# loads in flight to hide the memory latency.
PROGRAMS_PER_SM = 4
NUM_WARPS = 4  # 128 threads: a 4 KB step is two 16-byte loads a thread
# The dot at more than 32 rows: 8 warps, so that a tile's x operand (TILE_K x 64 bf16) fits in registers (ptxas -v for
# sm_90: no spills at 4 warps up to 32 rows, at 8 warps for 64)
DOT_WARPS_ABOVE_32_ROWS = 8
NUM_STAGES = 3


def runs_on(device: torch.device) -> bool:
    """Whether the kernel runs on tensors of `device` here (as `grouped.runs_on`: CUDA, or CPU under the
    interpreter outside compiled regions)."""
    return grouped.runs_on(device)


def supports(fmt: str, k: int) -> bool:
    """Whether a weight of format `fmt` with K decoded columns can be reordered (K a multiple of 32, as the tile
    decoding of `fast.grouped` needs)."""
    return grouped.supports(fmt, k)


def reorder(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
            weight_scale_2: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed linear `[N, K]` or stack `[E, N, K]` (operands as in `packed.decode_reference`) in the kernel's layout
    (module docstring): `(words int32 [E, Nt, Kt, TILE_N, 32], scales uint8 [E, Nt, Kt, TILE_N, B], glob fp32 [E]
    or [1])`, E = 1 for a linear. Only moves bytes (zero padding added); `restore` undoes it."""
    data = weight.view(torch.uint8)
    scale = weight_scale.view(torch.uint8)
    if data.dim() == 2:
        data, scale = data.unsqueeze(0), scale.unsqueeze(0)
    e, n, row_bytes = data.shape
    tile_k, block = TILE_K[fmt], BLOCK[fmt]
    k = 2 * row_bytes if fmt == NVFP4 else row_bytes
    n_tiles, k_tiles = -(-n // TILE_N), -(-k // tile_k)
    padded = data.new_zeros(e, n_tiles * TILE_N, k_tiles * 4 * WORDS)
    padded[:, :n, :row_bytes] = data
    scales = scale.new_zeros(e, n_tiles * TILE_N, k_tiles * (tile_k // block))
    scales[:, :n, :k // block] = scale
    words = padded.view(torch.int32).view(e, n_tiles, TILE_N, k_tiles, WORDS).transpose(2, 3).contiguous()
    scales = scales.view(e, n_tiles, TILE_N, k_tiles, tile_k // block).transpose(2, 3).contiguous()
    if fmt == NVFP4:
        glob = weight_scale_2.reshape(-1).to(torch.float32).contiguous()
    else:
        glob = torch.ones(1, dtype=torch.float32, device=data.device)
    return words, scales, glob


def restore(fmt: str, words: torch.Tensor, scales: torch.Tensor, glob: torch.Tensor, n: int, k: int,
            stack: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of `reorder`: `(weight, weight_scale, weight_scale_2)` as stored (`[N, ...]` for a linear,
    `[E, N, ...]` for a stack: `stack`), the padding dropped. weight_scale_2 is `glob` as `()` for one global, `[E]`
    for one per entry; None for MXFP8."""
    e, n_tiles, k_tiles = words.shape[:3]
    row_bytes = k // 2 if fmt == NVFP4 else k
    data = words.transpose(2, 3).reshape(e, n_tiles * TILE_N, k_tiles * WORDS).view(torch.uint8)[:, :n, :row_bytes]
    scale = scales.transpose(2, 3).reshape(e, n_tiles * TILE_N, -1)[:, :n, :k // BLOCK[fmt]]
    return stored_parts(fmt, data, scale, glob, stack)


def stored_parts(fmt: str, data: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor,
                 stack: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A reordered weight's bytes put back (uint8 `[E, N, K/2 or K]` and `[E, N, blocks]`) as the stored parts: the
    checkpoint's dtypes, one global `()` or one per entry `[E]` (None for MXFP8), `[N, ...]` without `stack`."""
    if fmt == NVFP4:
        scale = scale.view(torch.float8_e4m3fn)
        g = glob.reshape(()) if glob.numel() == 1 and not stack else glob
    else:
        data, g = data.view(torch.float8_e4m3fn), None
    if not stack:
        data, scale = data[0], scale[0]
    return data.contiguous(), scale.contiguous(), g


def splits(programs: int, k_tiles: int, sms: int, per_sm: int = PROGRAMS_PER_SM) -> int:
    """K splits so that `programs` (output entries times tile columns) times the splits reach `per_sm` programs an
    SM; at most one a K step, no empty split."""
    want = -(-per_sm * sms // max(programs, 1))
    split = max(1, min(k_tiles, want))
    per = -(-k_tiles // split)
    return -(-k_tiles // per)


if AVAILABLE:
    @triton.jit
    def _quad_field(quad, i: tl.constexpr):
        """Element i of four bf16 held in an int64 (little-endian: bits 16i..16i+15), as fp32 (exact)."""
        return (((quad >> (16 * i)) & 0xFFFF) << 16).to(tl.int32).to(tl.float32, bitcast=True)

    @triton.jit
    def _nibble_pair(words, scale, J: tl.constexpr, EXACT_FP32: tl.constexpr):
        """Elements 8w + J and 8w + J + 4 (J < 4) of each int32 word of packed NVFP4 bytes, each its nibble times the
        word's block scale times 2^126 (`scale`) rounded to bf16, as `grouped._nibble` gives them: both nibbles
        placed at once as the two halves of an int32 (signs to bits 15 and 31, e e m to bits 8..6 and 24..22: two
        bf16 values e2m1 * 2^-126), then each half widened to fp32 and multiplied, and the two products rounded by one
        conversion. Two shifts and two masks for two elements, where one nibble alone takes the same four."""
        signs = words << (12 - 4 * J)
        if 6 - 4 * J >= 0:
            fields = words << (6 - 4 * J)
        else:  # an arithmetic shift: the sign copies land above bit 24, outside the mask
            fields = words >> (4 * J - 6)
        pair = (signs & _SIGN_PAIR) | (fields & _E2M1_PAIR)
        low = (pair << 16).to(tl.float32, bitcast=True) * scale
        high = (pair & -65536).to(tl.float32, bitcast=True) * scale
        if EXACT_FP32:  # the interpreter has no inline assembly
            return _bf16_value(low, EXACT_FP32), _bf16_value(high, EXACT_FP32)
        # both rounded to bf16 by one conversion (to nearest, ties to even) into the halves of an int32
        rounded = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", [high, low], dtype=tl.int32,
                                            is_pure=True, pack=1)
        return (rounded << 16).to(tl.float32, bitcast=True), (rounded & -65536).to(tl.float32, bitcast=True)

    @triton.jit
    def _split_and_entry(sel_ptr, p, sid, STEPS_PER_SPLIT, STEPS, SELECT: tl.constexpr):
        """The K steps [lo, hi) of split `sid` and the stack entry output entry `p` reads (int64): `p`, or index[p]
        with SELECT 1."""
        lo = sid * STEPS_PER_SPLIT
        hi = tl.minimum(lo + STEPS_PER_SPLIT, STEPS)
        if SELECT == 1:
            e = tl.load(sel_ptr + p).to(tl.int64)
        else:
            e = p.to(tl.int64)
        return lo, hi, e

    @triton.jit
    def _out_tile(y_ptr, sid, p, offs_m, offs_n, m_ok, N, stride_ys, stride_yp, stride_ym):
        """Pointers and mask of a program's [TN, BLOCK_M] output tile: split `sid`, entry `p`, rows `offs_n`."""
        ptrs = y_ptr + sid * stride_ys + p * stride_yp + offs_m[None, :] * stride_ym + offs_n[:, None]
        return ptrs, (offs_n < N)[:, None] & m_ok[None, :]

    @triton.jit
    def _x_quads(x_ptr, row, k0, word, K):
        """x's 8 elements of each word c of the step starting at element k0 (elements k0 + 8c .. k0 + 8c + 7) as two
        int64 loads of 4 bf16 each ([W / 4, 4] each; `row`: the row's offset in int64 units); zeros past K (a
        multiple of 32: a quad is in or past K)."""
        quad = (k0 + word * 8) // 4
        ok = quad * 4 < K
        x64 = x_ptr.to(tl.pointer_type(tl.int64)) + row
        return tl.load(x64 + quad, mask=ok, other=0), tl.load(x64 + quad + 1, mask=ok, other=0)

    @triton.jit
    def _x_quad(x_ptr, row, k0, word, K):
        """x's 4 elements of each MXFP8 word c of the step starting at element k0 (k0 + 4c .. k0 + 4c + 3) as one
        int64 load ([W / 4, 4]); zeros past K."""
        quad = (k0 + word * 4) // 4
        return tl.load(x_ptr.to(tl.pointer_type(tl.int64)) + row + quad, mask=quad * 4 < K, other=0)

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, s_ptr, g_ptr, sel_ptr, y_ptr,
        M, N, K, K_TILES, STEPS_PER_SPLIT,
        stride_xp, stride_xm, stride_ge, stride_ys, stride_yp, stride_ym,
        NVFP4_FMT: tl.constexpr, SELECT: tl.constexpr, DOT: tl.constexpr, OUT_BF16: tl.constexpr,
        EXACT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr, W: tl.constexpr,
        B: tl.constexpr, TABLE: tl.constexpr,
    ):
        """y[split, p, m, n] = sum over this split's K steps of x[p, m, k] * w_hat[e, n, k] (fp32), e = p (SELECT 0),
        index[p] (SELECT 1), or p with entries whose flag active[p] is 0 read as nothing (SELECT 2). Grid:
        (tile columns, output entries, splits). DOT: tensor cores; else fp32 FMAs on the CUDA cores."""
        pid_n = tl.program_id(0)
        p = tl.program_id(1)
        sid = tl.program_id(2)
        k_lo, k_hi, e = _split_and_entry(sel_ptr, p, sid, STEPS_PER_SPLIT, K_TILES, SELECT)
        offs_n = pid_n * TN + tl.arange(0, TN)
        offs_m = tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        if SELECT == 2:
            # an entry no row uses: nothing read, zeros written; leaving here, not looping over no steps, keeps the
            # flag out of the loop's registers
            if tl.load(sel_ptr + p) == 0:
                zero_ptrs, zero_mask = _out_tile(y_ptr, sid, p, offs_m, offs_n, m_ok, N, stride_ys, stride_yp,
                                                 stride_ym)
                tl.store(zero_ptrs, tl.zeros((TN, BLOCK_M), dtype=tl.bfloat16 if OUT_BF16 else tl.float32),
                         mask=zero_mask)
                return
        n_tiles = tl.cdiv(N, TN)
        tile = (e * n_tiles + pid_n) * K_TILES  # the first K step of this tile column
        rows = tl.arange(0, TN)
        w_rows = w_ptr + tile * (TN * W) + rows[:, None] * W  # [TN, 1]
        s_rows = s_ptr + tile * (TN * B) + rows[:, None] * B
        x_rows = x_ptr + p * stride_xp + offs_m * stride_xm  # [BLOCK_M]
        g = tl.load(g_ptr + e * stride_ge)  # NVFP4's global (MXFP8: an unread one)
        if DOT:
            jk = tl.arange(0, TK)
            n_ok = rows < TN  # every row of a tile is stored (padded rows as zeros): none masked
            acc = tl.zeros((TN, BLOCK_M), dtype=tl.float32)
            for ks in range(k_lo, k_hi):
                # grouped's tile decoders read step * (TK's words per row): step ks * TN is tile ks of this layout
                sc = _step_scales(s_rows, ks * TN, n_ok, B)
                w = _decoded_tile(w_rows, sc, g, ks * TN, n_ok, NVFP4_FMT, TABLE, TN, TK, EXACT_FP32)
                kx = ks * TK + jk
                xt = _x_operand(x_rows[None, :] + kx[:, None], m_ok[None, :] & (kx < K)[:, None], EXACT_FP32)
                if EXACT_FP32:
                    acc = tl.dot(w, xt, acc, input_precision="ieee")
                else:
                    acc = tl.dot(w, xt, acc)
            out = acc
            y_ptrs, mask = _out_tile(y_ptr, sid, p, offs_m, offs_n, m_ok, N, stride_ys, stride_yp, stride_ym)
        else:
            # one row (BLOCK_M 1): the words as [W / 4, TN, 4] (four words, 16 bytes, a thread; the groups of a row
            # first, so that a warp reads whole rows), every operand built in their layout: the block scales loaded
            # per group of four words and spread over them in registers, x broadcast over the tile's rows (a scale
            # tensor loaded in a layout of its own made the compiler move every decoded element through shared
            # memory, two barriers a nibble)
            q = tl.arange(0, W // 4)
            r4 = tl.arange(0, 4)
            word = q[:, None] * 4 + r4[None, :]  # [W / 4, 4]: word index within the tile row
            acc = tl.zeros((W // 4, TN, 4), dtype=tl.float32)
            # a step's words (a contiguous 4 KB chunk) and block scales: NVFP4 two blocks (two words each) a group of
            # four words, MXFP8 one E8M0 scale for two groups (8 words)
            w_step = w_rows[None, :, :] + word[:, None, :]  # [W / 4, TN, 4]
            if NVFP4_FMT:
                s_step = s_rows[None, :, :] + q[:, None, None] * 2 + tl.arange(0, 2)[None, None, :]  # [W / 4, TN, 2]
            else:
                s_step = s_ptr + tile * (TN * B) + rows[None, :] * B + (q // 2)[:, None]  # [W / 4, TN]
            # software pipelining by hand (the compiler pipelines only the loads of dots): the next step's words and
            # scales (and x's quads) are loaded before this step is decoded, so that their latency overlaps its work
            words_next = tl.load(w_step + k_lo * (TN * W), mask=k_lo < k_hi, other=0)
            sb_next = tl.load(s_step + k_lo * (TN * B), mask=k_lo < k_hi, other=0)
            # x read four elements (8 bytes) a load, its fields widened in registers: one load and one operation
            # per element cost more instructions than the decoding, which bounds this loop
            if NVFP4_FMT:
                xa_next, xb_next = _x_quads(x_ptr, p * (stride_xp // 4), k_lo * TK, word, K)
            else:
                xa_next = _x_quad(x_ptr, p * (stride_xp // 4), k_lo * TK, word, K)
            for ks in range(k_lo, k_hi):
                words, sb = words_next, sb_next
                words_next = tl.load(w_step + (ks + 1) * (TN * W), mask=ks + 1 < k_hi, other=0)
                sb_next = tl.load(s_step + (ks + 1) * (TN * B), mask=ks + 1 < k_hi, other=0)
                # NVFP4: x's 8 elements of word c as two int64 loads (4 bf16 each), MXFP8: its 4 as one; their 16-bit
                # fields are the elements (K is a multiple of 32: a quad is in or past K)
                if NVFP4_FMT:
                    xa, xb = xa_next, xb_next
                    xa_next, xb_next = _x_quads(x_ptr, p * (stride_xp // 4), (ks + 1) * TK, word, K)
                else:
                    xa = xa_next
                    xa_next = _x_quad(x_ptr, p * (stride_xp // 4), (ks + 1) * TK, word, K)
                if NVFP4_FMT and TABLE:
                    # each block's table (`grouped._TABLE_ASM`), its four words repeated over the block's two words
                    t0, t1, t2, t3 = _table_words(_e4m3_value(sb.to(tl.int32), EXACT_FP32) * g, EXACT_FP32)
                    t0 = tl.reshape(tl.join(t0, t0), (W // 4, TN, 4))
                    t1 = tl.reshape(tl.join(t1, t1), (W // 4, TN, 4))
                    t2 = tl.reshape(tl.join(t2, t2), (W // 4, TN, 4))
                    t3 = tl.reshape(tl.join(t3, t3), (W // 4, TN, 4))
                    # element 8c + j is nibble j of word c
                    e0, e1, e2, e3, e4, e5, e6, e7 = _table_planes(words, t0, t1, t2, t3, EXACT_FP32)
                    acc += e0.to(tl.float32) * _quad_field(xa, 0)[:, None, :]
                    acc += e1.to(tl.float32) * _quad_field(xa, 1)[:, None, :]
                    acc += e2.to(tl.float32) * _quad_field(xa, 2)[:, None, :]
                    acc += e3.to(tl.float32) * _quad_field(xa, 3)[:, None, :]
                    acc += e4.to(tl.float32) * _quad_field(xb, 0)[:, None, :]
                    acc += e5.to(tl.float32) * _quad_field(xb, 1)[:, None, :]
                    acc += e6.to(tl.float32) * _quad_field(xb, 2)[:, None, :]
                    acc += e7.to(tl.float32) * _quad_field(xb, 3)[:, None, :]
                elif NVFP4_FMT:
                    # two blocks (two words each) a group: their E4M3 scales, each repeated over its two words
                    # the reference's block scale fp32(e4m3) * global (one rounding), times 2^126 (exact in range)
                    blk = (_e4m3_value(sb.to(tl.int32), EXACT_FP32) * g) * 8.507059173023462e37
                    scale = tl.reshape(tl.join(blk, blk), (W // 4, TN, 4))  # word r of a group: block r // 2
                    for j in tl.static_range(4):  # nibble j of word c is element 8c + j
                        wj, wj4 = _nibble_pair(words, scale, j, EXACT_FP32)
                        acc += wj * _quad_field(xa, j)[:, None, :]
                        acc += wj4 * _quad_field(xb, j)[:, None, :]
                else:
                    # one E8M0 scale for two groups (8 words): code c -> 2^(c - 127) on the bits (c >= 1 in range)
                    scale = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)[:, :, None]
                    for i in tl.static_range(4):  # byte i of word c is element 4c + i
                        # E4M3 times a power of two in range is a bf16 value already (at most 4 significant bits,
                        # no bf16 subnormal below 2^-133): the fp32 product is w_hat, no rounding to do
                        wi = _e4m3_value((words >> (8 * i)) & 0xFF, EXACT_FP32) * scale
                        acc += wi * _quad_field(xa, i)[:, None, :]
            out = tl.sum(tl.sum(acc, axis=2), axis=0)  # [TN]: each row's 32 word lanes added
            y_ptrs = y_ptr + sid * stride_ys + p * stride_yp + offs_n
            mask = offs_n < N
        if OUT_BF16:
            tl.store(y_ptrs, _bf16_storable(out, EXACT_FP32), mask=mask)
        else:
            tl.store(y_ptrs, out, mask=mask)

    @triton_op("minimax_ref::packed_gemv", mutates_args=())
    def _gemv_op(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, glob: torch.Tensor,
                 sel: torch.Tensor | None, select: int, outputs: int, nvfp4: bool, n: int, split: int,
                 exact_fp32: bool, table: bool = False) -> torch.Tensor:
        """The launch (see `packed_product`): x bf16 `[Px, M, K]` (Px 1: shared by every output entry), words /
        scales / glob in `reorder`'s layout, sel int `[outputs]` (ids, select 1; flags, select 2) or None. Returns
        bf16 `[outputs, M, N]`."""
        m, k = x.shape[1], x.shape[2]
        k_tiles = words.shape[2]
        per = -(-k_tiles // split)
        dot = m > GEMV_ROWS
        shape = (outputs, m, n) if split == 1 else (split, outputs, m, n)
        out = torch.empty(shape, dtype=torch.bfloat16 if split == 1 else torch.float32, device=x.device)
        fmt = NVFP4 if nvfp4 else MXFP8
        grid = (triton.cdiv(n, TILE_N), outputs, split)
        wrap_triton(_gemv_kernel)[grid](
            x, words, scales, glob, words if sel is None else sel, out,
            m, n, k, k_tiles, per,
            x.stride(0) if x.shape[0] > 1 else 0, x.stride(1), 1 if glob.numel() > 1 else 0,
            0 if split == 1 else out.stride(0), out.stride(-3), out.stride(-2),
            NVFP4_FMT=nvfp4, SELECT=select, DOT=dot, OUT_BF16=split == 1, EXACT_FP32=exact_fp32,
            BLOCK_M=max(16, triton.next_power_of_2(m)) if dot else triton.next_power_of_2(m),
            TN=TILE_N, TK=TILE_K[fmt], W=WORDS, B=TILE_K[fmt] // BLOCK[fmt], TABLE=table and nvfp4,
            num_warps=DOT_WARPS_ABOVE_32_ROWS if m > 32 else NUM_WARPS, num_stages=NUM_STAGES)
        if split == 1:
            return out
        y = torch.empty((outputs, m, n), dtype=torch.bfloat16, device=x.device)
        wrap_triton(grouped._sum_splits_kernel)[(triton.cdiv(y.numel(), 1024),)](
            out, y, y.numel(), SPLIT=split, BLOCK=1024, EXACT_FP32=exact_fp32)
        return y


def packed_product(x: torch.Tensor, fmt: str, n: int, words: torch.Tensor, scales: torch.Tensor, glob: torch.Tensor,
                   index: torch.Tensor | None = None, active: torch.Tensor | None = None,
                   split: int | None = None, sms: int = 1, busy: int | None = None, table: bool = False
                   ) -> torch.Tensor:
    """`x @ w_hat^T` for a weight in `reorder`'s layout (N = `n` rows), one launch (two with K splits).

    x: bf16 `[M, K]` (shared by every entry) or `[P, M, K]` (one per output entry), 1 <= M <= `MAX_ROWS`; K is the
    weight's (x's last dimension). index: None or an integer tensor `[P]` of stack entries (P outputs, entry index[p]
    read for output p; repeats allowed); active: None or int32 `[E]` flags over the stack (index None): unflagged
    entries read nothing and give zero rows. Returns bf16 `[P, M, N]` (P = E without index, 1 for a linear).
    Contract: the module docstring (decoded bits of the reference, fp32 sums, splits added in split order).
    split: K splits (default `splits` for `sms` SMs, counting `busy` entries: with `active`, at most that many are
    flagged, e.g. a step's tokens times top-k; default all). table: NVFP4 decoded through each block's table of its
    8 values (`grouped._TABLE_ASM`; the same bits; MXFP8 ignores it). The one-row GEMV reads x as int64 quads (x
    8-byte aligned: torch's allocations and their row views are; an eager call copies another x). Static in the
    shapes: no host synchronisation.
    """
    if not AVAILABLE:
        raise RuntimeError("packed_product needs triton")
    entries = words.shape[0]
    xs = x.unsqueeze(0) if x.dim() == 2 else x
    outputs = entries if index is None else index.shape[0]
    m, k = xs.shape[1], xs.shape[2]
    k_tiles = words.shape[2]
    if (x.dtype != torch.bfloat16 or not 1 <= m <= MAX_ROWS or not supports(fmt, k) or xs.shape[0] not in (1, outputs)
            or -(-k // TILE_K[fmt]) != k_tiles or (index is not None and active is not None)):
        raise ValueError(f"packed_product: x {list(x.shape)} {x.dtype} against {fmt} tiles {list(words.shape)}")
    if split is None:
        working = min(outputs, busy) if busy is not None and active is not None else outputs
        split = splits(working * -(-n // TILE_N), k_tiles, sms)
    split = max(1, min(split, k_tiles))
    split = -(-k_tiles // -(-k_tiles // split))  # no empty split
    if m <= GEMV_ROWS and not torch.compiler.is_compiling() and xs.data_ptr() % 8:
        xs = xs.clone()  # the one-row GEMV reads x four elements (8 bytes) a load
    select, sel = 0, None
    if index is not None:
        select, sel = 1, index
    elif active is not None:
        select, sel = 2, active.to(torch.int32)
    return torch.ops.minimax_ref.packed_gemv(xs.contiguous(), words, scales, glob, sel, select, outputs, fmt == NVFP4,
                                             n, split, grouped.interpreting(), table)
