"""NVFP4 products of 1 to 8 rows (decode steps) on the tensor cores, the weights reordered once at load so that
every lane of a warp loads, as one int32 word, exactly the 8 weight elements it holds in an `mma.sync.m16n8k16`
(bf16 inputs, fp32 accumulators): no element moves between lanes or through shared memory, and decoding a word
to the four bf16x2 registers of its fragment is the whole of the per-element work.

Layout (`reorder`). A stack `[E, N, K]` (a linear: E = 1) is cut into row tiles of 16 weight rows and K steps of
64 elements (N and K padded with zero codes and zero scales). A step of a row tile is four MMA tiles t = 0..3 of
16 x 16; lane l = 4g + c (g = l // 4, c = l % 4) of tile t holds the elements

    nibble j of its word (j = 0..7, h = j // 4, q = j % 4):
        weight row  16 * tile + g + 8 h
        column      64 * step + 16 c + 4 t + q

so the word's low half holds row g's four elements and its high half row g + 8's. The fragment's column kappa
(2c + {0, 1} and 2c + 8 + {0, 1}) stands for the weight column 64 * step + 16 c + 4 t + q with q = 2 * (kappa >= 8)
+ kappa % 2: nibbles (0, 1), (4, 5), (2, 3), (6, 7) are registers 0..3 of the PTX A fragment (rows g, g + 8, g,
g + 8; columns 2c + {0, 1} for the first two, 2c + 8 + {0, 1} for the others). x is permuted alike (lane c of the B
fragment reads x's columns 64 * step + 16 c + 4 t + 0..3 as one 8-byte load: its two registers), so each MMA sums
the same products a plain order would, in another order. The columns of a lane's row in one step, 16 c .. 16 c + 15,
are NVFP4 block 4 * step + c: one scale per lane and row a step, shared by the step's four words.

    words  int32 [E, N16, S, 32, 4]   words of (row tile, step, lane, MMA tile t): a lane's 16 bytes a step, 512
                                       contiguous bytes a warp
    scales uint8 [E, N16, S, 32, 2]   lane l's block scales (E4M3) in a step: row g's, then row g + 8's
    glob   fp32  [E] or [1]           NVFP4's weight_scale_2

Numerics contract (`packed_product`): y[p, m, n] = bf16( sum_k x[p, m, k] * w_hat[e(p), n, k] ) with w_hat the
reference decoder's bf16 bits (`packed.decode_reference(...).to(bfloat16)`), looked up in the table of the 8 values
of the row's block (`grouped._table_words`: A = bf16(S), B = bf16(fp32(1.5 S)) for the reference's block scale
S = fp32(e4m3) * weight_scale_2, entries {0, A/2, A, B, 2A, 2B, 4A, 4B}) by byte permutes, the nibble's sign applied
(`_TWO_TABLE_ASM`: a word's two halves through the tables of its two rows). The products are exact; the tensor
cores add them in fp32 within an MMA (possibly truncating when they align addends), the MMAs of a split accumulate
in fp32, splits of K write fp32 partial sums that a second kernel adds in split order and rounds once to bf16
(`grouped._sum_splits_kernel`). Bound (tests): |y - exact| <= gamma_K(2u) * sum_k |x w_hat| before the final
rounding, u = 2^-24, as `fast.gemv`'s dot.

The decode needs the block scales in the normal range (`packed.scales_in_normal_range`), which
`FastPackedWeight.configure` checks before it reorders a weight for this kernel (`FastPaths(gemv="mma")`, the
non-user preset `gemv-mma`). x's rows past M: the lanes whose B column is past M read row M - 1, whose products land
in accumulator columns no lane stores; x's columns past K read as zeros.

A Gluon kernel (`triton.experimental.gluon`: explicit layouts, so that the lane that loads a word is the lane whose
fragment it is); the MMA is issued as inline PTX, each lane passing its own registers. It runs on CUDA GPUs of
compute capability 8.0 and above; there is no interpreter path (`emulate` is the CPU statement of the same lane
mapping, tested against the reference).
"""

from __future__ import annotations

import torch

from . import grouped

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # no triton, or one without Gluon
    gluon = None

AVAILABLE = gluon is not None and grouped.AVAILABLE
MAX_ROWS = 8  # the MMA's N: x's rows are the B fragment's columns
ROW_TILE = 16
STEP_K = 64
TILES = STEP_K // 16  # MMA tiles a step
LANES = 32
WARPS = 4
ROW_TILES_PER_WARP = 2
# the nibbles of a lane's word in registers 0..3 of the A fragment (low, high): `_fragment`'s order of its outputs
FRAGMENT_NIBBLES = ((0, 1), (4, 5), (2, 3), (6, 7))
GROUP = WARPS * ROW_TILES_PER_WARP  # row tiles a program (128 weight rows); `reorder` pads N to whole groups
PROGRAMS_PER_SM = 4


def runs_on(device: torch.device) -> bool:
    """Whether the kernel runs on tensors of `device`: a CUDA GPU of compute capability 8.0 or above, with Gluon, not
    under the Triton interpreter (which does not run Gluon kernels)."""
    return (AVAILABLE and device.type == "cuda" and not grouped.interpreting() and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] >= 8)


def reorder(weight: torch.Tensor, weight_scale: torch.Tensor,
            weight_scale_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed NVFP4 linear `[N, K/2]` or stack `[E, N, K/2]` (uint8 codes, low nibble the even element; E4M3 block
    scales `[.., N, K/16]`; weight_scale_2) in the lane layout of the module docstring: `(words int32 [E, N16, S,
    32, 4], scales uint8 [E, N16, S, 32, 2], glob fp32 [E] or [1])`, N16 the row tiles padded to whole `GROUP`s.
    Only moves nibbles; `restore` undoes it."""
    data = weight.view(torch.uint8)
    scale = weight_scale.view(torch.uint8)
    if data.dim() == 2:
        data, scale = data.unsqueeze(0), scale.unsqueeze(0)
    e, n, half_k = data.shape
    k = 2 * half_k
    n16, steps = -(-n // (ROW_TILE * GROUP)) * GROUP, -(-k // STEP_K)
    codes = torch.zeros(e, n16 * ROW_TILE, steps * STEP_K, dtype=torch.uint8, device=data.device)
    codes[:, :n, 0:k:2] = data & 0x0F
    codes[:, :n, 1:k:2] = data >> 4
    # [E, tile, h, g, step, c, t, q]: row 16 tile + 8 h + g, column 64 step + 16 c + 4 t + q
    c8 = codes.view(e, n16, 2, 8, steps, 4, TILES, 4)
    # nibble j = 4 h + q of the word of (tile, step, lane 4g + c, t): byte j // 2, the even j in its low nibble
    nib = c8.permute(0, 1, 4, 3, 5, 6, 2, 7).reshape(e, n16, steps, LANES, TILES, 4, 2)
    words = (nib[..., 0] | (nib[..., 1] << 4)).contiguous().view(torch.int32).squeeze(-1)
    scales = torch.zeros(e, n16 * ROW_TILE, steps * 4, dtype=torch.uint8, device=data.device)  # zero: padding
    scales[:, :n, :k // 16] = scale
    # [E, tile, h, g, step, c] -> [E, tile, step, g, c, h]: block 4 step + c of rows g and g + 8
    lanes = scales.view(e, n16, 2, 8, steps, 4).permute(0, 1, 4, 3, 5, 2).reshape(e, n16, steps, LANES, 2)
    glob = weight_scale_2.reshape(-1).to(torch.float32).contiguous()
    return words.contiguous(), lanes.contiguous(), glob


def restore(words: torch.Tensor, scales: torch.Tensor, glob: torch.Tensor, n: int, k: int,
            stack: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `reorder`: `(weight, weight_scale, weight_scale_2)` as stored (`[N, ...]` for a linear,
    `[E, N, ...]` for a stack), the padding dropped."""
    e, n16, steps = words.shape[:3]
    nib = words.unsqueeze(-1).view(torch.uint8).reshape(e, n16, steps, LANES, TILES, 4, 1)
    nib = torch.cat((nib & 0x0F, nib >> 4), dim=-1).reshape(e, n16, steps, 8, 4, TILES, 2, 4)
    # [E, tile, step, g, c, t, h, q] -> [E, tile, h, g, step, c, t, q]
    codes = nib.permute(0, 1, 6, 3, 2, 4, 5, 7).reshape(e, n16 * ROW_TILE, steps * STEP_K)[:, :n, :k]
    data = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scale = scales.view(e, n16, steps, 8, 4, 2).permute(0, 1, 5, 3, 2, 4).reshape(e, n16 * ROW_TILE, steps * 4)
    scale = scale[:, :n, :k // 16].view(torch.float8_e4m3fn)
    g = glob.reshape(()) if glob.numel() == 1 and not stack else glob
    if not stack:
        data, scale = data[0], scale[0]
    return data.contiguous(), scale.contiguous(), g


def emulate(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, glob: torch.Tensor, n: int) -> torch.Tensor:
    """The kernel's arithmetic on the CPU, lane by lane, with the operands placed as the PTX ISA's m16n8k16 fragment
    tables place them. A (bf16): register r of lane 4g + c holds rows g + 8 (r % 2), columns 2c + 8 (r // 2) +
    {0, 1} in its low and high halves, nibbles `FRAGMENT_NIBBLES[r]` of the lane's word as the kernel fills it.
    B: register i holds rows 2c + 8i + {0, 1} of column g. D: c0, c1 at row g, columns 2c, 2c + 1; c2, c3 at row
    g + 8. Each lane's word and scales are decoded to the reference's values (`packed.decode_reference`'s bits; the
    kernel's table lookup is tested against them on its own), x is read through the kernel's permutation, and each
    lane's accumulators are stored where the kernel stores them. Sums in fp64 (exact for these products), for the
    tests. x bf16 `[M, K]` (M <= 8); returns fp64 `[E, M, N]`."""
    from ..weights.quant import E2M1_MAGNITUDES

    e, n16, steps = words.shape[:3]
    m, k = x.shape
    xp = torch.zeros(MAX_ROWS, steps * STEP_K, dtype=torch.float64)
    xp[:m, :k] = x.double()
    values = torch.cat([E2M1_MAGNITUDES, -E2M1_MAGNITUDES]).float()
    lane = torch.arange(LANES)
    g, c = lane // 4, lane % 4
    y = torch.zeros(e, MAX_ROWS, n16 * ROW_TILE, dtype=torch.float64)
    for ent in range(e):
        gl_ = glob[ent if glob.numel() > 1 else 0].float()
        for tile in range(n16):
            for s in range(steps):
                block = scales[ent, tile, s].view(torch.float8_e4m3fn).float() * gl_  # [32 lanes, 2 rows]
                for t in range(TILES):
                    word = words[ent, tile, s, :, t].long() & 0xFFFFFFFF
                    a = torch.zeros(16, 16, dtype=torch.float64)
                    for r, nibbles in enumerate(FRAGMENT_NIBBLES):  # register r: rows g + 8 (r % 2)
                        for half, j in enumerate(nibbles):
                            code = (word >> (4 * j)) & 0xF
                            w_hat = (values[code] * block[:, r % 2]).to(torch.bfloat16).double()
                            a[g + 8 * (r % 2), 2 * c + 8 * (r // 2) + half] = w_hat
                    b = torch.zeros(16, MAX_ROWS, dtype=torch.float64)
                    for i in range(2):
                        for half in range(2):
                            b[2 * c + 8 * i + half, g] = xp[g, STEP_K * s + 16 * c + 4 * t + 2 * i + half]
                    d = a @ b
                    for h in range(2):
                        for col in range(2):
                            y[ent, 2 * c + col, ROW_TILE * tile + g + 8 * h] += d[g + 8 * h, 2 * c + col]
    return y[:, :m, :n]


if AVAILABLE:
    from torch.library import custom_op

    from .gemv import _split_and_entry
    from .grouped import _table_words

    # A block table's four words (entries t0..t7 as bf16, two a word: `grouped._table_words`) split into a low-byte
    # and a high-byte table of 8 bytes each, two words each: $0, $2 the low bytes of entries 0..3 and 4..7, $1, $3
    # their high bytes. Once a step and row: the words of a step share their rows' blocks.
    _TABLE_BYTES_ASM = gl.constexpr(" ".join((
        "prmt.b32 $0, $4, $5, 0x6420;", "prmt.b32 $1, $4, $5, 0x7531;",
        "prmt.b32 $2, $6, $7, 0x6420;", "prmt.b32 $3, $6, $7, 0x7531;")))
    # A lane's word ($4) to its four A registers through two tables (`grouped._TABLE_ASM`'s lookup, one table for
    # each half): nibbles 0..3 (row g) through $5..$8, nibbles 4..7 (row g + 8) through $9..$12 (each as
    # `_TABLE_BYTES_ASM` gives them); the codes are byte selectors, each nibble's sign bit replicated over a byte
    # flips its entry's sign, the bytes paired into bf16. $0 = nibbles (0, 1), $1 = (2, 3), $2 = (4, 5), $3 = (6, 7),
    # each the low then the high bf16 of a register. tests/test_mma_gemv.py runs this text through a model of each
    # instruction against `decode_reference`.
    _TWO_TABLE_ASM = gl.constexpr(" ".join((
        "{",
        ".reg .b32 q4, s1, s2, l1, h1, l2, h2, g1, g2;",
        "shl.b32 q4, $4, 4;",
        "and.b32 s1, $4, 0x7777;",
        "shr.u32 s2, $4, 16;",
        "and.b32 s2, s2, 0x7777;",
        "prmt.b32 l1, $5, $7, s1;",
        "prmt.b32 h1, $6, $8, s1;",
        "prmt.b32 l2, $9, $11, s2;",
        "prmt.b32 h2, $10, $12, s2;",
        "prmt.b32 g1, q4, $4, 0xD9C8;",
        "prmt.b32 g2, q4, $4, 0xFBEA;",
        "lop3.b32 h1, h1, g1, 0x80808080, 0x78;",
        "lop3.b32 h2, h2, g2, 0x80808080, 0x78;",
        "prmt.b32 $0, l1, h1, 0x5140;",
        "prmt.b32 $1, l1, h1, 0x7362;",
        "prmt.b32 $2, l2, h2, 0x5140;",
        "prmt.b32 $3, l2, h2, 0x7362;",
        "}",
    )))

    @gluon.jit
    def _table_bytes(code, glob):
        """The byte tables (`_TABLE_BYTES_ASM`) of an E4M3 block scale code (int): the reference's block scale
        fp32(e4m3) * weight_scale_2 (one rounding) as its 8-value table (`grouped._table_words`)."""
        scale = code.to(gl.uint8).to(gl.float8e4nv, bitcast=True).to(gl.float32) * glob
        t0, t1, t2, t3 = _table_words(scale, False)
        return gl.inline_asm_elementwise(_TABLE_BYTES_ASM, "=r,=r,=r,=r,r,r,r,r", [t0, t1, t2, t3],
                                         dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)

    @gluon.jit
    def _fragment(word, tg, th):
        """A lane's word decoded to its A registers 0..3 (`_TWO_TABLE_ASM`, row g's tables `tg`, row g + 8's `th`)."""
        r01, r23, r45, r67 = gl.inline_asm_elementwise(
            _TWO_TABLE_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
            [word, tg[0], tg[1], tg[2], tg[3], th[0], th[1], th[2], th[3]],
            dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
        return r01, r45, r23, r67

    @gluon.jit
    def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """One m16n8k16 MMA of the warp (bf16 A and B, fp32 accumulators): each lane passes its own fragment
        registers, every lane of the warp issues it together."""
        return gl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(gl.float32, gl.float32, gl.float32, gl.float32), is_pure=True, pack=1)

    @gluon.jit
    def _lane_words(w_tile, step, WIDE: gl.constexpr):
        """A lane's four words of a step (MMA tiles 0..3), one 16-byte load: [I, 4] split into four [I]."""
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, WIDE))
        quad = gl.load(gl.expand_dims(w_tile + step * 128, 1) + gl.expand_dims(t, 0))
        lo, hi = gl.split(gl.reshape(quad, [quad.shape[0], 2, 2]))
        w0, w2 = gl.split(lo)
        w1, w3 = gl.split(hi)
        return w0, w1, w2, w3

    @gluon.jit
    def _x_quads(x_row, step, c, K, EVEN_K: gl.constexpr, WIDE: gl.constexpr):
        """The lane's x columns of a step, 64 step + 16c + 4t .. + 3 for MMA tiles t = 0..3, as four int64 (one
        32-byte range); zeros past K."""
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, WIDE))
        quad = gl.expand_dims(step * 16 + 4 * c, 1) + gl.expand_dims(t, 0)
        if EVEN_K:
            q = gl.load(gl.expand_dims(x_row, 1) + quad)
        else:
            q = gl.load(gl.expand_dims(x_row, 1) + quad, mask=quad * 4 < K, other=0)
        lo, hi = gl.split(gl.reshape(q, [q.shape[0], 2, 2]))
        q0, q2 = gl.split(lo)
        q1, q3 = gl.split(hi)
        return q0, q1, q2, q3

    @gluon.jit
    def _tile_mma(word, quad, tg, th, acc0, acc1, acc2, acc3):
        """One MMA tile of a lane: its word decoded to the A fragment, its x quad split into the B fragment."""
        a0, a1, a2, a3 = _fragment(word, tg, th)
        return _mma(a0, a1, a2, a3, quad.to(gl.int32), (quad >> 32).to(gl.int32), acc0, acc1, acc2, acc3)

    @gluon.jit
    def _mma_gemv_kernel(x_ptr, w_ptr, s_ptr, g_ptr, sel_ptr, y_ptr,
                         M, N, K, N16, STEPS, STEPS_PER_SPLIT,
                         stride_xp, stride_xm, stride_ge, stride_ys, stride_yp, stride_ym,
                         SELECT: gl.constexpr, RT: gl.constexpr, WARPS: gl.constexpr, OUT_BF16: gl.constexpr,
                         EVEN_K: gl.constexpr):
        """y[split, p, m, n] = sum over this split's steps of x[p, m, k] * w_hat[e, n, k] (fp32), e = p (SELECT 0),
        index[p] (SELECT 1), or p with unflagged entries (active[p] == 0) read as nothing (SELECT 2). Grid: (groups
        of WARPS x RT row tiles, output entries, splits). Element i of the program's 1-D tensors belongs to warp
        i // (32 RT), lane (i // RT) % 32, its row tile i % RT: each lane holds its own fragments."""
        layout: gl.constexpr = gl.BlockedLayout([RT], [32], [WARPS], [0])
        wide: gl.constexpr = gl.BlockedLayout([RT, 4], [32, 1], [WARPS, 1], [1, 0])  # a lane's four words or quads
        pid_n = gl.program_id(0)
        p = gl.program_id(1)
        sid = gl.program_id(2)
        s_lo, s_hi, e = _split_and_entry(sel_ptr, p, sid, STEPS_PER_SPLIT, STEPS, SELECT)
        i = gl.arange(0, WARPS * RT * 32, layout=layout)
        lane = (i // RT) % 32
        tile = pid_n * (WARPS * RT) + (i // (RT * 32)) * RT + i % RT
        g = lane // 4
        c = lane % 4
        # the accumulators' places (D fragment): c0 row g column 2c, c1 row g column 2c + 1, c2 and c3 row g + 8
        n0 = tile * 16 + g
        m0 = 2 * c
        y_base = y_ptr + sid * stride_ys + p * stride_yp
        if SELECT == 2:
            # an entry no row uses: nothing read, zeros written
            if gl.load(sel_ptr + p) == 0:
                zero = gl.zeros([WARPS * RT * 32], gl.float32, layout)
                if OUT_BF16:
                    zero = zero.to(gl.bfloat16)
                for h in gl.static_range(2):
                    for col in gl.static_range(2):
                        gl.store(y_base + (m0 + col) * stride_ym + n0 + 8 * h, zero,
                                 mask=(m0 + col < M) & (n0 + 8 * h < N))
                return
        # a lane's words of a row tile and step (tile t at 4 lane + t), its 2 scale bytes (read as one int16)
        w_tile = gl.convert_layout(w_ptr + ((e * N16 + tile) * STEPS * 32 + lane) * 4, gl.SliceLayout(1, wide))
        s_tile = s_ptr.to(gl.pointer_type(gl.int16)) + (e * N16 + tile) * STEPS * 32 + lane
        # x's row g (the B fragment's column; rows past M repeat row M - 1, whose products land in columns no lane
        # stores) read as int64 quads of bf16: quad 16 step + 4c + t is the lane's two B registers for MMA tile t
        x_row = x_ptr.to(gl.pointer_type(gl.int64)) + (p * stride_xp + gl.minimum(g, M - 1) * stride_xm) // 4
        x_row = gl.convert_layout(x_row, gl.SliceLayout(1, wide))
        c_wide = gl.convert_layout(c, gl.SliceLayout(1, wide))
        glob = gl.load(g_ptr + e * stride_ge)
        acc0 = gl.zeros([WARPS * RT * 32], gl.float32, layout)
        acc1 = gl.zeros([WARPS * RT * 32], gl.float32, layout)
        acc2 = gl.zeros([WARPS * RT * 32], gl.float32, layout)
        acc3 = gl.zeros([WARPS * RT * 32], gl.float32, layout)
        # software pipelining by hand: the next step's words, scales and x are loaded before this step is decoded
        nw0, nw1, nw2, nw3 = _lane_words(w_tile, s_lo, wide)
        nq0, nq1, nq2, nq3 = _x_quads(x_row, s_lo, c_wide, K, EVEN_K, wide)
        n_codes = gl.load(s_tile + s_lo * 32)
        for step in range(s_lo, s_hi):
            w0, w1, w2, w3 = nw0, nw1, nw2, nw3
            q0, q1, q2, q3 = nq0, nq1, nq2, nq3
            codes = n_codes
            nxt = gl.minimum(step + 1, s_hi - 1)  # the last step loads its own again: no mask in the loop
            nw0, nw1, nw2, nw3 = _lane_words(w_tile, nxt, wide)
            nq0, nq1, nq2, nq3 = _x_quads(x_row, nxt, c_wide, K, EVEN_K, wide)
            n_codes = gl.load(s_tile + nxt * 32)
            tg = _table_bytes(codes & 0xFF, glob)
            th = _table_bytes((codes >> 8) & 0xFF, glob)
            acc0, acc1, acc2, acc3 = _tile_mma(gl.convert_layout(w0, layout), gl.convert_layout(q0, layout), tg, th,
                                               acc0, acc1, acc2, acc3)
            acc0, acc1, acc2, acc3 = _tile_mma(gl.convert_layout(w1, layout), gl.convert_layout(q1, layout), tg, th,
                                               acc0, acc1, acc2, acc3)
            acc0, acc1, acc2, acc3 = _tile_mma(gl.convert_layout(w2, layout), gl.convert_layout(q2, layout), tg, th,
                                               acc0, acc1, acc2, acc3)
            acc0, acc1, acc2, acc3 = _tile_mma(gl.convert_layout(w3, layout), gl.convert_layout(q3, layout), tg, th,
                                               acc0, acc1, acc2, acc3)
        accs = (acc0, acc1, acc2, acc3)
        for h in gl.static_range(2):
            for col in gl.static_range(2):
                out = accs[2 * h + col]
                if OUT_BF16:
                    out = out.to(gl.bfloat16)
                gl.store(y_base + (m0 + col) * stride_ym + n0 + 8 * h, out, mask=(m0 + col < M) & (n0 + 8 * h < N))

    @custom_op("minimax_ref::packed_mma_gemv", mutates_args=())
    def _mma_gemv_op(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, glob: torch.Tensor,
                     sel: torch.Tensor | None, select: int, outputs: int, n: int, split: int) -> torch.Tensor:
        """The launch (see `packed_product`): x bf16 `[Px, M, K]` (Px 1: shared by every output entry), words /
        scales / glob in `reorder`'s layout, sel int `[outputs]` (ids, select 1; flags, select 2) or None. Returns
        bf16 `[outputs, M, N]`."""
        m, k = x.shape[1], x.shape[2]
        e, n16, steps = words.shape[:3]
        if x.data_ptr() % 8:  # x is read as int64 quads (its rows are: K is a multiple of 16)
            x = x.clone()
        per = -(-steps // split)
        shape = (outputs, m, n) if split == 1 else (split, outputs, m, n)
        out = torch.empty(shape, dtype=torch.bfloat16 if split == 1 else torch.float32, device=x.device)
        _mma_gemv_kernel[(n16 // GROUP, outputs, split)](
            x, words, scales, glob, words if sel is None else sel, out,
            m, n, k, n16, steps, per,
            x.stride(0) if x.shape[0] > 1 else 0, x.stride(1), 1 if glob.numel() > 1 else 0,
            0 if split == 1 else out.stride(0), out.stride(-3), out.stride(-2),
            SELECT=select, RT=ROW_TILES_PER_WARP, WARPS=WARPS, OUT_BF16=split == 1, EVEN_K=k % STEP_K == 0,
            num_warps=WARPS)
        if split == 1:
            return out
        y = torch.empty((outputs, m, n), dtype=torch.bfloat16, device=x.device)
        grouped._sum_splits_kernel[(-(-y.numel() // 1024),)](out, y, y.numel(), SPLIT=split, BLOCK=1024,
                                                             EXACT_FP32=False)
        return y

    @_mma_gemv_op.register_fake
    def _(x, words, scales, glob, sel, select, outputs, n, split):
        return x.new_empty((outputs, x.shape[1], n))


def splits(programs: int, steps: int, sms: int, per_sm: int = PROGRAMS_PER_SM) -> int:
    """K splits so that `programs` (output entries times row-tile groups) times the splits reach `per_sm` programs an
    SM; at most one a step, no empty split."""
    want = -(-per_sm * sms // max(programs, 1))
    split = max(1, min(steps, want))
    return -(-steps // -(-steps // split))


def packed_product(x: torch.Tensor, n: int, words: torch.Tensor, scales: torch.Tensor, glob: torch.Tensor,
                   index: torch.Tensor | None = None, active: torch.Tensor | None = None,
                   split: int | None = None, sms: int = 1, busy: int | None = None) -> torch.Tensor:
    """`x @ w_hat^T` for an NVFP4 weight in `reorder`'s layout (N = `n` rows), one launch (two with K splits).

    x: bf16 `[M, K]` (shared by every entry) or `[P, M, K]` (one per output entry), 1 <= M <= `MAX_ROWS`, K a
    multiple of 16 (x's last dimension; its rows 8-byte aligned: read as int64 quads); index: None or an integer
    tensor `[P]` of stack entries; active: None or int32 `[E]` flags over the stack (index None): unflagged entries
    read nothing and give zero rows. Returns bf16 `[P, M, N]`. split: K splits (default `splits` for `sms` SMs,
    counting `busy` flagged entries with `active`). Contract: the module docstring. Static in the shapes: no host
    synchronisation."""
    if not AVAILABLE:
        raise RuntimeError("mma_gemv.packed_product needs triton with Gluon")
    entries, n16, steps = words.shape[:3]
    xs = x.unsqueeze(0) if x.dim() == 2 else x
    outputs = entries if index is None else index.shape[0]
    m, k = xs.shape[1], xs.shape[2]
    if (x.dtype != torch.bfloat16 or not 1 <= m <= MAX_ROWS or k % 16 or -(-k // STEP_K) != steps
            or n16 != -(-n // (ROW_TILE * GROUP)) * GROUP or xs.shape[0] not in (1, outputs)
            or (index is not None and active is not None)):
        raise ValueError(f"mma_gemv.packed_product: x {list(x.shape)} {x.dtype} against words {list(words.shape)}, "
                         f"n {n}")
    if split is None:
        working = min(outputs, busy) if busy is not None and active is not None else outputs
        split = splits(working * (n16 // GROUP), steps, sms)
    split = -(-steps // -(-steps // max(1, min(split, steps))))
    select, sel = 0, None
    if index is not None:
        select, sel = 1, index
    elif active is not None:
        select, sel = 2, active.to(torch.int32)
    return torch.ops.minimax_ref.packed_mma_gemv(xs.contiguous(), words, scales, glob, sel, select, outputs, n, split)
