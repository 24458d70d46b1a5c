"""Packed products of 1 to 32 rows (decode steps) on the tensor cores: every lane of a warp loads, as whole words,
exactly the 8 weight elements it holds in an `mma.sync.m16n8k16` (bf16 inputs, fp32 accumulators), from the weight
where the checkpoint's layout stores it (`packed_product_stored`) or from a copy reordered once at load into the
lanes' order (`reorder`, `packed_product`): no element moves between lanes or through shared memory, and decoding
its words to the four bf16x2 registers of its fragment is the whole of the per-element work. x's rows go in groups of
8 (the MMA's N, one B fragment each); each decoded A fragment is multiplied by every group's. NVFP4 and MXFP8
weights.

Layout (`reorder`). A stack `[E, N, K]` (a linear: E = 1) is cut into row tiles of 16 weight rows and K steps of
64 elements (N and K padded with zero codes and zero scales). A step of a row tile is four MMA tiles t = 0..3 of
16 x 16; lane l = 4g + c (g = l // 4, c = l % 4) of tile t holds the elements of weight rows 16 * tile + g + 8h
(h = 0, 1) and columns 64 * step + 16 c + 4 t + q (q = 0..3):

    NVFP4: one word a tile, nibble j = 4h + q (row g's four elements in its low half, row g + 8's in its high half)
    MXFP8: two words a tile, word 2t + h, byte q

The fragment's column kappa (2c + {0, 1} and 2c + 8 + {0, 1}) stands for the weight column 64 * step + 16 c + 4 t + q
with q = 2 * (kappa >= 8) + kappa % 2, so registers 0..3 of the PTX A fragment (rows g, g + 8, g, g + 8; columns
2c + {0, 1} for the first two, 2c + 8 + {0, 1} for the others) are NVFP4 nibbles (0, 1), (4, 5), (2, 3), (6, 7)
(`FRAGMENT_NIBBLES`), MXFP8 bytes (0, 1) of words 2t and 2t + 1, then bytes (2, 3) of both. x is permuted alike
(lane c of the B fragment reads x's columns 64 * step + 16 c + 4 t + 0..3 as one 8-byte load: its two registers),
so each MMA sums the same products a plain order would, in another order. The columns of a lane's row in one step,
16 c .. 16 c + 15, lie in one block (NVFP4 block 4 * step + c, MXFP8 block 2 * step + c // 2): one scale per lane
and row a step, shared by the step's words.

    words  int32 [E, N16, S, 32, W]   words of (row tile, step, lane): a lane's W words a step (W = 4 NVFP4, 8 MXFP8;
                                       16 or 32 bytes), 32 W contiguous words a warp
    scales uint8 [E, N16, S, 32, 2]   lane l's block scales (E4M3 or E8M0) in a step: row g's, then row g + 8's
    glob   fp32  [E] or [1]           NVFP4's weight_scale_2 (MXFP8: an unread 1.0)

Read in place (`packed_product_stored`, what `gemv="mma"` runs for expert stacks where `stored_supports` allows: no
copy of the weight). MXFP8: a lane's 16 columns of a row in a step are contiguous where the checkpoint stores them (16
bytes), so each lane loads row g's and row g + 8's with one load each, and the loaded int32s are `reorder`'s words; the
block scales are read a byte a row. NVFP4 goes by pair steps of 128 columns (`step_columns`, `_pair_steps`): sub-step
j (0, 1) gives lane c the columns 128 s + 32 c + 16 j + 4 t + q instead of a plain step's 64 s + 16 c + 4 t + q, so
a lane's 16 bytes of a row (low nibble the even element) and its 2 block scales of a pair step are one load each; each
sub-step's 8 bytes of rows g and g + 8 become its 4 words by a byte permute each (row g's nibbles 4t .. 4t + 3 in the
low half, row g + 8's in the high: `_STORED_WORDS_ASM`), words of `reorder`'s format, and x is read at the same
columns. The same products in another order of K (the MMAs' fp32 sums may differ from the copy's in the last bits),
the same contract; rows past N and columns past K are masked to zeros (NVFP4's x is padded with zeros to whole pair
steps on the host).

Numerics contract (`packed_product`): y[p, m, n] = bf16( sum_k x[p, m, k] * w_hat[e(p), n, k] ) with w_hat the
reference decoder's bf16 bits (`packed.decode_reference(...).to(bfloat16)`). NVFP4: looked up in the table of the 8
values of the row's block (`grouped._table_words`: A = bf16(S), B = bf16(fp32(1.5 S)) for the reference's block
scale S = fp32(e4m3) * weight_scale_2, entries {0, A/2, A, B, 2A, 2B, 4A, 4B}) by byte permutes, the nibble's sign
applied (`_TWO_TABLE_ASM`: a word's two halves through the tables of its two rows). MXFP8: each E4M3 byte widened
exactly (through f16 to fp32) and multiplied by its block's 2^(E - 127), exact in range (`_MX_WORD_ASM`). The
products are exact; the tensor cores add them in fp32 within an MMA (possibly truncating when they align addends),
the MMAs of a split accumulate in fp32, splits of K write fp32 partial sums that are added in split order and
rounded once to bf16: by the output tile's last split in the kernel (with `counters_for`'s counters: one launch), or
else by a second kernel (`grouped._sum_splits_kernel`), the same bits. Bound (tests): |y - exact| <= gamma_K(2u) *
sum_k |x w_hat| before the final rounding, u = 2^-24, as `fast.gemv`'s dot.

The decode needs the block scales in the normal range (`packed.scales_in_normal_range`) and, MXFP8, no E4M3 NaN
byte, which `FastPackedWeight.configure` checks before it gives a weight to this kernel (`FastPaths(gemv="mma")`,
the preset `gemv-mma`). x's rows past M: the lanes whose B column is past M read row M - 1, whose products
land in accumulator columns no lane stores; x's columns past K read as zeros. Launch shapes (row tiles a warp, K
splits) are data by format and row groups (`LAUNCH`), for rows sorted by entry (`RANGED_LAUNCH`) and for entries
chosen by id read in place (`STORED_IDS_LAUNCH`).

Rows sorted by entry (`ends`, an MoE step's (token, choice) pairs sorted by expert: `FastPaths.expert_ranges`): each
program reads its entry's range of rows, none for an empty range, one row group for up to 8 rows and passes of two
groups (16 rows) over its weight tiles for more, so an expert's MMAs and x loads go to its own rows only, where the
flags (`active`) multiply every flagged entry by all M rows. Each row's sums are those of its range multiplied alone.

A stack of c stacks one after the other (`copies`: a routed layer's gate and up, `fast.joint.JointStack`) takes one
selection (ids, flags or ends of one stack) for all c: output entry c' Q + q is selection entry q of stack c', each
output the bits its own stack's launch gives at the same K split count, x read once.

A Gluon kernel (`triton.experimental.gluon`: explicit layouts, so that the lane that loads a word is the lane whose
fragment it is); the MMA is issued as inline PTX, each lane passing its own registers. It runs on CUDA GPUs of
compute capability 8.9 and above (the E4M3 conversion); there is no interpreter path (`emulate` is the CPU statement
of the same lane mapping, tested against the reference)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..weights.checkpoint import MXFP8, NVFP4
from . import grouped
from .gemv import stored_parts

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # no triton, or one without Gluon
    gluon = None

AVAILABLE = gluon is not None and grouped.AVAILABLE
MAX_ROWS = 32
# rows up to which `gemv="mma"` reads an expert stack where it is stored; past them its loop waits on x's loads
# (a lane's rows of x are not contiguous) and the grouped kernel is faster (BENCHMARKS.md)
STORED_STACK_ROWS = 8
X_GROUP = 8  # the MMA's N: a row group of x's rows are the B fragment's columns
ROW_TILE = 16
STEP_K = 64
TILES = STEP_K // 16  # MMA tiles a step
LANES = 32
WARPS = 4
# the nibbles of a lane's word in registers 0..3 of the A fragment (low, high): `_fragment`'s order of its outputs
FRAGMENT_NIBBLES = ((0, 1), (4, 5), (2, 3), (6, 7))


class Launch(NamedTuple):
    """How a product is launched: row tiles a warp (each lane's A fragments of them multiply every row group's B
    fragment) and the programs an SM its K splits aim at (more than fit at once: the later ones fill the tail)."""

    row_tiles: int
    per_sm: int
    ahead: int = 1  # K steps of loads in flight while a step is decoded (1 or 2; stored NVFP4: pair steps)
    # stored NVFP4 (unmasked): a load that misses brings its row's 256-byte block (this pair step and the next three)
    # into L2, so a lane's next loads wait on L2, not memory, with no registers held for them
    prefetch: bool = False


# By format and row groups (x rows / 8, rounded up to a power of two), from products at release shapes on 1 x H100
# (benchmarks/packed_gemv.py); every launch's registers allow `RESIDENT` programs an SM (tests). Up to 32 rows: at 64
# the loop issues an MMA an element and lane, and the grouped kernel takes such products.
LAUNCH = {(NVFP4, 1): Launch(2, 8), (NVFP4, 2): Launch(2, 8), (NVFP4, 4): Launch(1, 8),
          (MXFP8, 1): Launch(2, 4), (MXFP8, 2): Launch(2, 4), (MXFP8, 4): Launch(1, 4)}
# Products over ranges of rows sorted by entry (`ends`): the kernel holds a pass of one row group and one of two, and
# at two NVFP4 row tiles a warp their registers would allow 3 programs an SM; NVFP4's rows come into L2 by 256-byte
# blocks ahead of the loads (each step's MMAs over a range's rows give the fetch time to land)
RANGED_LAUNCH = {NVFP4: Launch(1, 8, prefetch=True), MXFP8: Launch(2, 4)}
# A few entries chosen by id, read in place, up to one row group, by format and whether each entry has its own x (a
# token's experts share its row; several tokens' pairs each have theirs): one row tile a warp takes fewer registers
# (sm_90: 56 against 96), so more programs share an SM to keep these short products' loads in flight; with x an entry,
# fewer K splits and the rows' 256-byte blocks fetched into L2 ahead
STORED_IDS_LAUNCH = {(NVFP4, False): Launch(1, 8), (NVFP4, True): Launch(1, 4, prefetch=True)}
RESIDENT = 4  # programs an SM that every launch's registers allow
GROUP = WARPS * max(launch.row_tiles for launch in LAUNCH.values())  # `reorder` pads N to whole groups of row tiles
MIN_STEPS_PER_SPLIT = 4  # a split's K steps at least: tiny products (k_proj) otherwise spend more on the split sum


def row_groups(m: int) -> int:
    """x's row groups of 8 (the MMA's N) for `m` rows, rounded up to a power of two (a `LAUNCH` key)."""
    return 1 << max(0, (-(-m // X_GROUP) - 1).bit_length())


def runs_on(device: torch.device) -> bool:
    """Whether the kernel runs on tensors of `device`: a CUDA GPU of compute capability 8.9 or above (MXFP8's E4M3
    conversion; NVFP4 would run from 8.0), with Gluon, not under the Triton interpreter (which does not run Gluon
    kernels)."""
    return (AVAILABLE and device.type == "cuda" and not grouped.interpreting() and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (8, 9))


def supports(fmt: str, k: int) -> bool:
    """Whether a packed weight of format `fmt` with K decoded columns has the kernel's layout (whole blocks)."""
    return fmt in (NVFP4, MXFP8) and k % (16 if fmt == NVFP4 else 32) == 0


def reorder(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
            weight_scale_2: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed linear `[N, ...]` or stack `[E, N, ...]` (operands as in `packed.decode_reference`: NVFP4 uint8 codes
    `[.., N, K/2]`, low nibble the even element, E4M3 block scales `[.., N, K/16]`, weight_scale_2; MXFP8 E4M3
    elements `[.., N, K]`, E8M0 block scales `[.., N, K/32]`) in the lane layout of the module docstring: `(words
    int32 [E, N16, S, 32, W], scales uint8 [E, N16, S, 32, 2], glob fp32 [E] or [1])`, W = 4 (NVFP4) or 8 (MXFP8),
    N16 the row tiles padded to whole `GROUP`s. Only moves bytes and nibbles; `restore` undoes it."""
    data = weight.view(torch.uint8)
    scale = weight_scale.view(torch.uint8)
    if data.dim() == 2:
        data, scale = data.unsqueeze(0), scale.unsqueeze(0)
    e, n, row = data.shape
    k = 2 * row if fmt == NVFP4 else row
    n16, steps = -(-n // (ROW_TILE * GROUP)) * GROUP, -(-k // STEP_K)
    codes = torch.zeros(e, n16 * ROW_TILE, steps * STEP_K, dtype=torch.uint8, device=data.device)
    if fmt == NVFP4:
        codes[:, :n, 0:k:2] = data & 0x0F
        codes[:, :n, 1:k:2] = data >> 4
    else:
        codes[:, :n, :k] = data
    # [E, tile, h, g, step, c, t, q]: row 16 tile + 8 h + g, column 64 step + 16 c + 4 t + q
    c8 = codes.view(e, n16, 2, 8, steps, 4, TILES, 4)
    if fmt == NVFP4:
        # nibble j = 4 h + q of the word of (tile, step, lane 4g + c, t): byte j // 2, the even j in its low nibble
        nib = c8.permute(0, 1, 4, 3, 5, 6, 2, 7).reshape(e, n16, steps, LANES, TILES, 4, 2)
        words = (nib[..., 0] | (nib[..., 1] << 4)).contiguous().view(torch.int32).squeeze(-1)
    else:  # byte q of word 2t + h of (tile, step, lane)
        words = c8.permute(0, 1, 4, 3, 5, 6, 2, 7).contiguous().view(torch.int32).reshape(e, n16, steps, LANES, 8)
    blocks = STEP_K // (16 if fmt == NVFP4 else 32)  # a step's blocks: lane c's is block c * blocks // 4 of them
    scales = torch.zeros(e, n16 * ROW_TILE, steps * blocks, dtype=torch.uint8, device=data.device)  # zero: padding
    scales[:, :n, :scale.shape[-1]] = scale
    per_lane = scales.view(e, n16, 2, 8, steps, blocks).repeat_interleave(4 // blocks, dim=-1)
    # [E, tile, h, g, step, c] -> [E, tile, step, g, c, h]: lane c's block of rows g and g + 8
    lanes = per_lane.permute(0, 1, 4, 3, 5, 2).reshape(e, n16, steps, LANES, 2)
    if fmt == NVFP4:
        glob = weight_scale_2.reshape(-1).to(torch.float32).contiguous()
    else:
        glob = torch.ones(1, dtype=torch.float32, device=data.device)
    return words.contiguous(), lanes.contiguous(), glob


def restore(words: torch.Tensor, scales: torch.Tensor, glob: torch.Tensor, n: int, k: int,
            stack: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of `reorder` (the format read from the words a lane holds a step): `(weight, weight_scale,
    weight_scale_2)` as stored (`[N, ...]` for a linear, `[E, N, ...]` for a stack), the padding dropped;
    weight_scale_2 None for MXFP8."""
    e, n16, steps = words.shape[:3]
    nvfp4 = words.shape[-1] == 4
    if nvfp4:
        nib = words.unsqueeze(-1).view(torch.uint8).reshape(e, n16, steps, LANES, TILES, 4, 1)
        c8 = torch.cat((nib & 0x0F, nib >> 4), dim=-1).reshape(e, n16, steps, 8, 4, TILES, 2, 4)
    else:
        c8 = words.unsqueeze(-1).view(torch.uint8).reshape(e, n16, steps, 8, 4, TILES, 2, 4)
    # [E, tile, step, g, c, t, h, q] -> [E, tile, h, g, step, c, t, q]
    codes = c8.permute(0, 1, 6, 3, 2, 4, 5, 7).reshape(e, n16 * ROW_TILE, steps * STEP_K)[:, :n, :k]
    blocks = 4 if nvfp4 else 2
    lanes = scales.view(e, n16, steps, 8, 4, 2)[:, :, :, :, ::4 // blocks]  # one lane of each block
    scale = lanes.permute(0, 1, 5, 3, 2, 4).reshape(e, n16 * ROW_TILE, steps * blocks)
    scale = scale[:, :n, :k // (16 if nvfp4 else 32)]
    data = codes[..., 0::2] | (codes[..., 1::2] << 4) if nvfp4 else codes
    return stored_parts(NVFP4 if nvfp4 else MXFP8, data, scale, glob, stack)


def emulate(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, glob: torch.Tensor, n: int) -> torch.Tensor:
    """The kernel's arithmetic on the CPU, lane by lane, with the operands placed as the PTX ISA's m16n8k16 fragment
    tables place them. A (bf16): register r of lane 4g + c holds rows g + 8 (r % 2), columns 2c + 8 (r // 2) +
    {0, 1} in its low and high halves: nibbles `FRAGMENT_NIBBLES[r]` of the lane's NVFP4 word, or bytes 2 (r // 2)
    + {0, 1} of its MXFP8 word 2t + r % 2, as the kernel fills it. B: register i holds rows 2c + 8i + {0, 1} of
    column g. D: c0, c1 at row g, columns 2c, 2c + 1; c2, c3 at row g + 8. Each lane's elements and scales are
    decoded to the reference's values (`packed.decode_reference`'s bits; the kernel's decode is tested against them
    on its own), x is read through the kernel's permutation, and each lane's accumulators are stored where the kernel
    stores them; x's rows in groups of 8, each group's B fragment multiplied by the same A fragment. Sums in fp64
    (exact for these products), for the tests. x bf16 `[M, K]` (M <= `MAX_ROWS`); returns fp64 `[E, M, N]`."""
    from ..weights.quant import E2M1_MAGNITUDES

    e, n16, steps = words.shape[:3]
    m, k = x.shape
    groups = -(-m // X_GROUP)
    xp = torch.zeros(groups * X_GROUP, steps * STEP_K, dtype=torch.float64)
    xp[:m, :k] = x.double()
    values = torch.cat([E2M1_MAGNITUDES, -E2M1_MAGNITUDES]).float()
    nvfp4 = words.shape[-1] == 4
    lane = torch.arange(LANES)
    g, c = lane // 4, lane % 4
    y = torch.zeros(e, groups * X_GROUP, n16 * ROW_TILE, dtype=torch.float64)
    for ent in range(e):
        gl_ = glob[ent if glob.numel() > 1 else 0].float()
        for tile in range(n16):
            for s in range(steps):
                if nvfp4:  # [32 lanes, 2 rows]
                    block = scales[ent, tile, s].view(torch.float8_e4m3fn).float() * gl_
                else:
                    block = torch.exp2(scales[ent, tile, s].float() - 127)
                for t in range(TILES):
                    a = torch.zeros(16, 16, dtype=torch.float64)
                    for r in range(4):  # register r: rows g + 8 (r % 2)
                        for half in range(2):
                            if nvfp4:
                                word = words[ent, tile, s, :, t].long() & 0xFFFFFFFF
                                code = (word >> (4 * FRAGMENT_NIBBLES[r][half])) & 0xF
                                value = values[code]
                            else:
                                word = words[ent, tile, s, :, 2 * t + r % 2].long() & 0xFFFFFFFF
                                code = (word >> (8 * (2 * (r // 2) + half))) & 0xFF
                                value = code.to(torch.uint8).view(torch.float8_e4m3fn).float()
                            w_hat = (value * block[:, r % 2]).to(torch.bfloat16).double()
                            a[g + 8 * (r % 2), 2 * c + 8 * (r // 2) + half] = w_hat
                    for grp in range(groups):  # x's rows 8 grp + column of the B fragment
                        b = torch.zeros(16, X_GROUP, dtype=torch.float64)
                        for i in range(2):
                            for half in range(2):
                                b[2 * c + 8 * i + half, g] = xp[X_GROUP * grp + g,
                                                                STEP_K * s + 16 * c + 4 * t + 2 * i + half]
                        d = a @ b
                        for h in range(2):
                            for col in range(2):
                                y[ent, X_GROUP * grp + 2 * c + col, ROW_TILE * tile + g + 8 * h] += \
                                    d[g + 8 * h, 2 * c + col]
    return y[:, :m, :n]


if AVAILABLE:
    from torch.library import custom_op

    from .gemv import _split_and_entry

    # A block scale S ($4, fp32) as its table of 8 values split into a low-byte and a high-byte table of 8 bytes each,
    # two words each: $0, $2 the low bytes of entries 0..3 and 4..7, $1, $3 their high bytes. The entries
    # (`grouped._table_words`: S's signed zero, A/2, A, B, 2A, 2B, 4A, 4B with A = bf16(S), B = bf16(fp32(1.5 S)))
    # from one bf16 pair, B in its low half and A in its high (fp32 1.5 S and S rounded by one conversion), times
    # (0, 1/2), (2, 2) and (4, 4) by bf16x2 products, each exact (a power of two or zero; the -0 added keeps every
    # sign), so a zero S gives its signed zero everywhere. Once a step and row: the words of a step share their rows'
    # blocks.
    _SCALE_TABLE_ASM = gl.constexpr(" ".join((
        "{",
        ".reg .f32 b;",
        ".reg .b32 ba, w0, w2, w3, k, z;",
        "mul.f32 b, $4, 0f3FC00000;",
        "cvt.rn.bf16x2.f32 ba, $4, b;",
        "mov.b32 z, 0x80008000;",
        "mov.b32 k, 0x3F000000;",
        "fma.rn.bf16x2 w0, ba, k, z;",
        "mov.b32 k, 0x40004000;",
        "fma.rn.bf16x2 w2, ba, k, z;",
        "mov.b32 k, 0x40804080;",
        "fma.rn.bf16x2 w3, ba, k, z;",
        "prmt.b32 $0, w0, ba, 0x4620;",
        "prmt.b32 $1, w0, ba, 0x5731;",
        "prmt.b32 $2, w2, w3, 0x4602;",
        "prmt.b32 $3, w2, w3, 0x5713;",
        "}",
    )))
    # A lane's word ($4) to its four A registers through two tables (`grouped._TABLE_ASM`'s lookup, one table for
    # each half): nibbles 0..3 (row g) through $5..$8, nibbles 4..7 (row g + 8) through $9..$12 (each as
    # `_SCALE_TABLE_ASM` gives them); the codes are byte selectors, each nibble's sign bit replicated over a byte
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

    # Two E4M3 codes (the low 16 bits of $2: low byte, high byte) as fp32 $0, $1, exactly (E4M3 is a subset of f16),
    # by one conversion of the pair
    _E4M3_PAIR_ASM = gl.constexpr(" ".join((
        "{",
        ".reg .b16 lo, hi, p;",
        ".reg .b32 h;",
        "mov.b32 {p, hi}, $2;",
        "cvt.rn.f16x2.e4m3x2 h, p;",
        "mov.b32 {lo, hi}, h;",
        "cvt.f32.f16 $0, lo;",
        "cvt.f32.f16 $1, hi;",
        "}",
    )))

    @gluon.jit
    def _block_scales(codes, glob):
        """The reference's block scales of the two E4M3 codes of `codes` (int32: the first in its low byte, the
        second in the next), fp32(e4m3) * weight_scale_2 each (one rounding), by one conversion of the pair."""
        first, second = gl.inline_asm_elementwise(_E4M3_PAIR_ASM, "=f,=f,r", [codes], dtype=(gl.float32, gl.float32),
                                                  is_pure=True, pack=1)
        return first * glob, second * glob

    @gluon.jit
    def _table_bytes(scale):
        """The byte tables (`_SCALE_TABLE_ASM`) of a block scale (fp32, `_block_scales`) as its 8-value table."""
        return gl.inline_asm_elementwise(_SCALE_TABLE_ASM, "=r,=r,=r,=r,f", [scale],
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
    def _columns(v):
        """A [S, I, 4] tensor (a lane's four values of each of I things, in its registers) as its four columns
        [S, I]."""
        lo, hi = gl.split(gl.reshape(v, [v.shape[0], v.shape[1], 2, 2]))
        c0, c2 = gl.split(lo)
        c1, c3 = gl.split(hi)
        return c0, c1, c2, c3

    @gluon.jit
    def _lane_words(w_step, WIDE: gl.constexpr, LA: gl.constexpr):
        """Four consecutive words of each of a lane's row tiles from `w_step` [S, RT] on, one 16-byte load a tile,
        as four [S, RT] (layout LA)."""
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, WIDE)))
        w0, w1, w2, w3 = _columns(gl.load(gl.expand_dims(w_step, 2) + gl.expand_dims(gl.expand_dims(t, 0), 0)))
        return (gl.convert_layout(w0, LA), gl.convert_layout(w1, LA), gl.convert_layout(w2, LA),
                gl.convert_layout(w3, LA))

    @gluon.jit
    def _x_quads(x_rows, base, K, EVEN_K: gl.constexpr, XWIDE: gl.constexpr, L3: gl.constexpr):
        """The lane's x columns 4 (base + t) .. + 3 for MMA tiles t = 0..3 (`base` [S, 1]: the lane's first quad of
        4 columns in a step, 16 step + 4c), of each of its row groups (`x_rows` [S, NB]: int64 pointers) as four
        int64 (one 32-byte range a group), each [S, 1, NB] (layout L3: the B registers of every row tile); zeros past
        K."""
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, XWIDE)))
        quad = gl.expand_dims(base, 2) + gl.expand_dims(gl.expand_dims(t, 0), 0)  # [S, 1, 4]
        ptrs = gl.expand_dims(x_rows, 2) + quad
        if EVEN_K:
            q0, q1, q2, q3 = _columns(gl.load(ptrs))
        else:
            q0, q1, q2, q3 = _columns(gl.load(ptrs, mask=gl.broadcast(quad * 4 < K, ptrs)[0], other=0))
        LX: gl.constexpr = gl.SliceLayout(1, L3)
        return (gl.expand_dims(gl.convert_layout(q0, LX), 1), gl.expand_dims(gl.convert_layout(q1, LX), 1),
                gl.expand_dims(gl.convert_layout(q2, LX), 1), gl.expand_dims(gl.convert_layout(q3, LX), 1))

    @gluon.jit
    def _spread(a, acc):
        """A lane's A register of each row tile ([S, RT]) over its row groups ([S, RT, NB] as `acc`): every MMA of a
        row tile reads the same decoded fragment."""
        return gl.broadcast(gl.expand_dims(a, 2), acc)[0]

    @gluon.jit
    def _tile_mma(a0, a1, a2, a3, quad, acc0, acc1, acc2, acc3):
        """The MMAs of one MMA tile of a lane: its A fragment ([S, RT]) against the B fragment of each row group
        (`quad` [S, 1, NB], its two registers the low and high halves): RT x NB MMAs."""
        b0, _ = gl.broadcast(quad.to(gl.int32), acc0)
        b1, _ = gl.broadcast((quad >> 32).to(gl.int32), acc0)
        return _mma(_spread(a0, acc0), _spread(a1, acc0), _spread(a2, acc0), _spread(a3, acc0), b0, b1,
                    acc0, acc1, acc2, acc3)

    # A word of four E4M3 elements ($2) times their block's 2^(E - 127) ($3, fp32) as two bf16x2 registers: $0 bytes
    # 0, 1 and $1 bytes 2, 3 (low, high). Each byte pair widened by the hardware conversion (E4M3 is a subset of f16,
    # the lower byte to the lower half), each half to fp32, multiplied (exact: E4M3 times a power of two in range) and
    # the two rounded by one conversion (no rounding happens: the product is a bf16 value).
    _MX_WORD_ASM = gl.constexpr(" ".join((
        "{",
        ".reg .b16 p0, p1, a0, a1, b0, b1;",
        ".reg .b32 h0, h1;",
        ".reg .f32 x0, x1, y0, y1;",
        "mov.b32 {p0, p1}, $2;",
        "cvt.rn.f16x2.e4m3x2 h0, p0;",
        "cvt.rn.f16x2.e4m3x2 h1, p1;",
        "mov.b32 {a0, a1}, h0;",
        "mov.b32 {b0, b1}, h1;",
        "cvt.f32.f16 x0, a0;",
        "cvt.f32.f16 x1, a1;",
        "cvt.f32.f16 y0, b0;",
        "cvt.f32.f16 y1, b1;",
        "mul.f32 x0, x0, $3;",
        "mul.f32 x1, x1, $3;",
        "mul.f32 y0, y0, $3;",
        "mul.f32 y1, y1, $3;",
        "cvt.rn.bf16x2.f32 $0, x1, x0;",
        "cvt.rn.bf16x2.f32 $1, y1, y0;",
        "}",
    )))

    @gluon.jit
    def _mx_word(word, scale):
        """`_MX_WORD_ASM`: (bytes 0, 1; bytes 2, 3) of a word as bf16x2 registers."""
        return gl.inline_asm_elementwise(_MX_WORD_ASM, "=r,=r,r,f", [word, scale], dtype=(gl.int32, gl.int32),
                                         is_pure=True, pack=1)

    @gluon.jit
    def _mx_tile_mma(word_g, word_h, quad, sg, sh, acc0, acc1, acc2, acc3):
        """The MMAs of one MXFP8 MMA tile of a lane: row g's word and row g + 8's (bytes q = 0..3 each) decoded to
        the A fragment (registers 0..3: rows g, g + 8, g, g + 8; bytes 0, 1 then 2, 3)."""
        g01, g23 = _mx_word(word_g, sg)
        h01, h23 = _mx_word(word_h, sh)
        return _tile_mma(g01, h01, g23, h23, quad, acc0, acc1, acc2, acc3)

    # A lane's NVFP4 words of a step read from the stored layout: row g's 8 bytes of the step (16 elements) as the
    # words $4 (elements 0..7) and $5 (8..15), row g + 8's as $6, $7; MMA tile t's word is row g's nibbles 4t .. 4t + 3
    # in its low half and row g + 8's in its high half, the word `reorder` lays out.
    _STORED_WORDS_ASM = gl.constexpr(" ".join((
        "prmt.b32 $0, $4, $6, 0x5410;", "prmt.b32 $1, $4, $6, 0x7632;",
        "prmt.b32 $2, $5, $7, 0x5410;", "prmt.b32 $3, $5, $7, 0x7632;")))

    @gluon.jit
    def _nvfp4_operands(wa, sa, step, WIDE: gl.constexpr, LA: gl.constexpr):
        """A lane's 4 NVFP4 words of a step in `reorder`'s layout (MMA tile t's, [S, RT] int32: `wa` the lane's words)
        and its rows' scale codes (`sa` its scale pair read as an int16: row g's in the low byte, row g + 8's in the
        next, as an int32)."""
        w0, w1, w2, w3 = _lane_words(wa + step * 128, WIDE, LA)
        return w0, w1, w2, w3, gl.load(sa + step * 32).to(gl.int32)

    @gluon.jit
    def _prefetching_load(ptr):
        """The two int64 at each of `ptr` (16-byte aligned), by one load whose miss fetches the aligned 256 bytes
        around them into L2 (the PTX prefetch size; read-only path: the weight does not change within the launch)."""
        return gl.inline_asm_elementwise("ld.global.nc.L2::256B.v2.b64 {$0, $1}, [$2];", "=l,=l,l", [ptr],
                                         dtype=(gl.int64, gl.int64), is_pure=True, pack=1)

    @gluon.jit
    def _pair_loads(wa, wb, sa, sb, kc, step, ok_g, ok_h, KB, MASKED: gl.constexpr, PAIR: gl.constexpr,
                    PREFETCH: gl.constexpr):
        """A lane's bytes of a stored NVFP4 pair step (128 columns, `_pair_steps`), as loaded: rows g's and g + 8's 16
        bytes at byte 64 step + 16c of the row (`wa` / `wb` int64 pointers [S, RT] in PAIR's slice) as [S, RT, 2]
        int64, and their two block scales (blocks 8 step + 2c, + 1) as an int32 each, the first in its low byte
        (`sa` / `sb` byte pointers, read as an int16; byte by byte when MASKED: rows past N and columns past K read
        as zeros, `kc` the lane's byte in a pair step's 64). PREFETCH (unmasked): the rows' bytes by a load whose miss
        fetches the row's aligned 256 bytes into L2 (`ld.global.nc.L2::256B`)."""
        j = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, PAIR))), 0), 0)
        if MASKED:
            in_k0 = kc + step * 64 < KB
            in_k1 = kc + step * 64 + 8 < KB
            in_k = gl.expand_dims(kc + step * 64, 2) + 8 * j < KB
            lo = gl.load(gl.expand_dims(wa + step * 8, 2) + j, mask=gl.expand_dims(ok_g, 2) & in_k, other=0)
            hi = gl.load(gl.expand_dims(wb + step * 8, 2) + j, mask=gl.expand_dims(ok_h, 2) & in_k, other=0)
            code_g = (gl.load(sa + step * 8, mask=ok_g & in_k0, other=0).to(gl.int32)
                      | (gl.load(sa + step * 8 + 1, mask=ok_g & in_k1, other=0).to(gl.int32) << 8))
            code_h = (gl.load(sb + step * 8, mask=ok_h & in_k0, other=0).to(gl.int32)
                      | (gl.load(sb + step * 8 + 1, mask=ok_h & in_k1, other=0).to(gl.int32) << 8))
        else:
            if PREFETCH:  # a miss brings the row's 256-byte block (this pair step and the next three) into L2
                lo0, lo1 = _prefetching_load(wa + step * 8)
                hi0, hi1 = _prefetching_load(wb + step * 8)
                lo = gl.convert_layout(gl.join(lo0, lo1), PAIR)
                hi = gl.convert_layout(gl.join(hi0, hi1), PAIR)
            else:
                lo = gl.load(gl.expand_dims(wa + step * 8, 2) + j)
                hi = gl.load(gl.expand_dims(wb + step * 8, 2) + j)
            code_g = gl.load((sa + step * 8).to(gl.pointer_type(gl.int16))).to(gl.int32)
            code_h = gl.load((sb + step * 8).to(gl.pointer_type(gl.int16))).to(gl.int32)
        return lo, hi, code_g, code_h

    @gluon.jit
    def _pair_words(loads, J: gl.constexpr, LA: gl.constexpr):
        """Sub-step J's 4 words (as `_nvfp4_operands` gives a step's) from a pair step's `_pair_loads`, by
        `_STORED_WORDS_ASM` from rows g's and g + 8's 8 bytes J."""
        lo0, lo1 = gl.split(loads[0])
        hi0, hi1 = gl.split(loads[1])
        if J == 0:
            lo, hi = lo0, hi0
        else:
            lo, hi = lo1, hi1
        w0, w1, w2, w3 = gl.inline_asm_elementwise(
            _STORED_WORDS_ASM, "=r,=r,=r,=r,r,r,r,r",
            [lo.to(gl.int32), (lo >> 32).to(gl.int32), hi.to(gl.int32), (hi >> 32).to(gl.int32)],
            dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
        return (gl.convert_layout(w0, LA), gl.convert_layout(w1, LA), gl.convert_layout(w2, LA),
                gl.convert_layout(w3, LA))

    @gluon.jit
    def _mxfp8_operands(wa, wb, sa, sb, kc, step, ok_g, ok_h, KB, STORED: gl.constexpr, MASKED: gl.constexpr,
                        WIDE: gl.constexpr, LA: gl.constexpr):
        """A lane's 8 MXFP8 words of a step (word 2t + h: row g + 8h's bytes of MMA tile t; [S, RT] int32) and its
        rows' scale codes (g, g + 8: 0..255 in an integer type). STORED: from the checkpoint's layout (`wa` / `wb`:
        rows g's and g + 8's first int32 of the lane's 16 bytes, in WIDE's slice; `sa` / `sb` their block scales;
        `kc` the lane's byte in a step's 64); else from `reorder`'s (as `_nvfp4_operands`)."""
        if STORED:
            t = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, WIDE))), 0), 0)
            if MASKED:
                in_k = kc + step * 64 < KB
                okw_g = gl.broadcast(gl.expand_dims(gl.convert_layout(ok_g & in_k, gl.SliceLayout(2, WIDE)), 2), t)[0]
                okw_h = gl.broadcast(gl.expand_dims(gl.convert_layout(ok_h & in_k, gl.SliceLayout(2, WIDE)), 2), t)[0]
                g0, g1, g2, g3 = _columns(gl.load(gl.expand_dims(wa + step * 16, 2) + t, mask=okw_g, other=0))
                h0, h1, h2, h3 = _columns(gl.load(gl.expand_dims(wb + step * 16, 2) + t, mask=okw_h, other=0))
                code_g = gl.load(sa + step * 2, mask=ok_g & in_k, other=0)
                code_h = gl.load(sb + step * 2, mask=ok_h & in_k, other=0)
            else:
                g0, g1, g2, g3 = _columns(gl.load(gl.expand_dims(wa + step * 16, 2) + t))
                h0, h1, h2, h3 = _columns(gl.load(gl.expand_dims(wb + step * 16, 2) + t))
                code_g = gl.load(sa + step * 2)
                code_h = gl.load(sb + step * 2)
            w0, w2, w4, w6 = (gl.convert_layout(g0, LA), gl.convert_layout(g1, LA), gl.convert_layout(g2, LA),
                              gl.convert_layout(g3, LA))
            w1, w3, w5, w7 = (gl.convert_layout(h0, LA), gl.convert_layout(h1, LA), gl.convert_layout(h2, LA),
                              gl.convert_layout(h3, LA))
        else:
            w0, w1, w2, w3 = _lane_words(wa + step * 256, WIDE, LA)
            w4, w5, w6, w7 = _lane_words(wa + step * 256 + 4, WIDE, LA)
            codes = gl.load(sa + step * 32)
            code_g = codes & 0xFF
            code_h = (codes >> 8) & 0xFF
        return w0, w1, w2, w3, w4, w5, w6, w7, code_g, code_h

    @gluon.jit
    def _operands(wa, wb, sa, sb, kc, step, ok_g, ok_h, KB, NVFP4_FMT: gl.constexpr, STORED: gl.constexpr,
                  MASKED: gl.constexpr, WIDE: gl.constexpr, LA: gl.constexpr):
        """A step's words and scale codes of a lane (`_nvfp4_operands` or `_mxfp8_operands`)."""
        if NVFP4_FMT:  # the reordered copy (stored NVFP4 goes by pair steps: `_pair_steps`)
            ops = _nvfp4_operands(wa, sa, step, WIDE, LA)
        else:
            ops = _mxfp8_operands(wa, wb, sa, sb, kc, step, ok_g, ok_h, KB, STORED, MASKED, WIDE, LA)
        return ops

    @gluon.jit
    def _nvfp4_mmas(words, sg, sh, xq, acc):
        """An NVFP4 step's MMAs of a lane: its 4 words (one an MMA tile) decoded through the tables of its rows' block
        scales `sg` (row g) and `sh` (row g + 8) against x's quads `xq`."""
        tg = _table_bytes(sg)
        th = _table_bytes(sh)
        for t in gl.static_range(4):  # the MMA tiles of a step
            a0, a1, a2, a3 = _fragment(words[t], tg, th)
            acc = _tile_mma(a0, a1, a2, a3, xq[t], acc[0], acc[1], acc[2], acc[3])
        return acc

    @gluon.jit
    def _step_mmas(ops, xq, glob, acc, NVFP4_FMT: gl.constexpr):
        """A step's MMAs of a lane: its 4 MMA tiles decoded from `ops` (`_operands`) against x's quads `xq`."""
        if NVFP4_FMT:
            sg, sh = _block_scales(ops[4], glob)
            acc = _nvfp4_mmas(ops, sg, sh, xq, acc)
        else:
            # E8M0 code c -> 2^(c - 127) on the fp32 bits (c >= 1 in the normal range)
            sg = (ops[8].to(gl.int32) << 23).to(gl.float32, bitcast=True)
            sh = (ops[9].to(gl.int32) << 23).to(gl.float32, bitcast=True)
            for t in gl.static_range(4):
                acc = _mx_tile_mma(ops[2 * t], ops[2 * t + 1], xq[t], sg, sh, acc[0], acc[1], acc[2], acc[3])
        return acc

    @gluon.jit
    def _steps(wa, wb, sa, sb, kc, ok_g, ok_h, KB, x_rows, c_x, glob, s_lo, s_hi, K, NVFP4_FMT: gl.constexpr,
               EVEN_K: gl.constexpr, STORED: gl.constexpr, MASKED: gl.constexpr, AHEAD: gl.constexpr,
               L3: gl.constexpr, LA: gl.constexpr, WIDE: gl.constexpr, XWIDE: gl.constexpr, SHAPE: gl.constexpr):
        """The split's steps, the words, scales and x of the step AHEAD (1 or 2) steps on loaded before this step is
        decoded (software pipelining by hand: AHEAD steps of loads in flight). Returns the 4 accumulators."""
        acc = (gl.zeros(SHAPE, gl.float32, L3), gl.zeros(SHAPE, gl.float32, L3), gl.zeros(SHAPE, gl.float32, L3),
               gl.zeros(SHAPE, gl.float32, L3))
        ops1 = _operands(wa, wb, sa, sb, kc, s_lo, ok_g, ok_h, KB, NVFP4_FMT, STORED, MASKED, WIDE, LA)
        xq1 = _x_quads(x_rows, s_lo * 16 + 4 * c_x, K, EVEN_K, XWIDE, L3)
        if AHEAD == 2:
            second = gl.minimum(s_lo + 1, s_hi - 1)
            ops2 = _operands(wa, wb, sa, sb, kc, second, ok_g, ok_h, KB, NVFP4_FMT, STORED, MASKED, WIDE, LA)
            xq2 = _x_quads(x_rows, second * 16 + 4 * c_x, K, EVEN_K, XWIDE, L3)
        for step in range(s_lo, s_hi):
            ops, xq = ops1, xq1
            nxt = gl.minimum(step + AHEAD, s_hi - 1)  # the last steps load the last again: no mask in the loop
            if AHEAD == 2:
                ops1, xq1 = ops2, xq2
                ops2 = _operands(wa, wb, sa, sb, kc, nxt, ok_g, ok_h, KB, NVFP4_FMT, STORED, MASKED, WIDE, LA)
                xq2 = _x_quads(x_rows, nxt * 16 + 4 * c_x, K, EVEN_K, XWIDE, L3)
            else:
                ops1 = _operands(wa, wb, sa, sb, kc, nxt, ok_g, ok_h, KB, NVFP4_FMT, STORED, MASKED, WIDE, LA)
                xq1 = _x_quads(x_rows, nxt * 16 + 4 * c_x, K, EVEN_K, XWIDE, L3)
            acc = _step_mmas(ops, xq, glob, acc, NVFP4_FMT)
        return acc

    @gluon.jit
    def _pair_step_mmas(loads, xa, step, nxt, x_rows, c_x, glob, acc, K, EVEN_K: gl.constexpr, LA: gl.constexpr,
                        XWIDE: gl.constexpr, L3: gl.constexpr):
        """Pair step `step`'s MMAs from its `_pair_loads` and its first sub-step's x quads `xa`, loading the second
        sub-step's between them; returns the accumulators and pair step `nxt`'s first x quads."""
        xb = _x_quads(x_rows, step * 32 + 8 * c_x + 4, K, EVEN_K, XWIDE, L3)
        sg0, sg1 = _block_scales(gl.convert_layout(loads[2], LA), glob)  # row g's blocks of sub-steps 0 and 1
        sh0, sh1 = _block_scales(gl.convert_layout(loads[3], LA), glob)
        acc = _nvfp4_mmas(_pair_words(loads, 0, LA), sg0, sh0, xa, acc)
        xa = _x_quads(x_rows, nxt * 32 + 8 * c_x, K, EVEN_K, XWIDE, L3)
        acc = _nvfp4_mmas(_pair_words(loads, 1, LA), sg1, sh1, xb, acc)
        return acc, xa

    @gluon.jit
    def _pair_steps(wa, wb, sa, sb, kc, ok_g, ok_h, KB, x_rows, c_x, glob, s_lo, s_hi, K, EVEN_K: gl.constexpr,
                    MASKED: gl.constexpr, AHEAD: gl.constexpr, L3: gl.constexpr, LA: gl.constexpr,
                    PAIR: gl.constexpr, XWIDE: gl.constexpr, SHAPE: gl.constexpr, PREFETCH: gl.constexpr):
        """`_steps` for an NVFP4 weight read where it is stored, by pair steps of 128 columns: sub-step j (0, 1) of
        pair step s gives lane c the columns 128 s + 32 c + 16 j + 4 t + q (MMA tile t, q = 0..3), so a lane's 16
        bytes of a row and its 2 block scales of a pair step are one load each (`_pair_loads`). The bytes of the pair
        step AHEAD (1 or 2) on are loaded before this one's are decoded (2 AHEAD sub-steps in flight); x's quads one
        sub-step ahead; PREFETCH: the rows' 256-byte blocks into L2 (the next pair steps) with each miss. AHEAD 1 at
        one row tile a warp and up to two row groups runs two pair steps a loop iteration (an odd last one after
        it), each load issued once the registers it fills are free: no register copies from the loaded to the decoded
        pair step (with more row tiles or groups the unrolled loop takes more registers than `RESIDENT` allows). The
        same products in the same order either way."""
        acc = (gl.zeros(SHAPE, gl.float32, L3), gl.zeros(SHAPE, gl.float32, L3), gl.zeros(SHAPE, gl.float32, L3),
               gl.zeros(SHAPE, gl.float32, L3))
        loads1 = _pair_loads(wa, wb, sa, sb, kc, s_lo, ok_g, ok_h, KB, MASKED, PAIR, PREFETCH)
        if AHEAD == 2:
            loads2 = _pair_loads(wa, wb, sa, sb, kc, gl.minimum(s_lo + 1, s_hi - 1), ok_g, ok_h, KB, MASKED, PAIR,
                                 PREFETCH)
        xa = _x_quads(x_rows, s_lo * 32 + 8 * c_x, K, EVEN_K, XWIDE, L3)
        if AHEAD == 1 and SHAPE[1] == 1 and SHAPE[2] <= 2:  # two pair steps an iteration: no copies of the loads
            for step in range(s_lo, s_hi - 1, 2):
                second = _pair_loads(wa, wb, sa, sb, kc, step + 1, ok_g, ok_h, KB, MASKED, PAIR, PREFETCH)
                acc, xa = _pair_step_mmas(loads1, xa, step, step + 1, x_rows, c_x, glob, acc, K, EVEN_K, LA, XWIDE, L3)
                third = gl.minimum(step + 2, s_hi - 1)
                loads1 = _pair_loads(wa, wb, sa, sb, kc, third, ok_g, ok_h, KB, MASKED, PAIR, PREFETCH)
                acc, xa = _pair_step_mmas(second, xa, step + 1, third, x_rows, c_x, glob, acc, K, EVEN_K, LA, XWIDE,
                                          L3)
            if (s_hi - s_lo) % 2 == 1:  # the odd last pair step (its next x quads are not read)
                acc, _ = _pair_step_mmas(loads1, xa, s_hi - 1, s_hi - 1, x_rows, c_x, glob, acc, K, EVEN_K, LA, XWIDE,
                                         L3)
        else:
            for step in range(s_lo, s_hi):
                loads = loads1
                nxt = gl.minimum(step + 1, s_hi - 1)  # the last steps load the last again: no mask in the loop
                if AHEAD == 2:
                    loads1 = loads2
                    loads2 = _pair_loads(wa, wb, sa, sb, kc, gl.minimum(step + 2, s_hi - 1), ok_g, ok_h, KB, MASKED,
                                         PAIR, PREFETCH)
                else:
                    loads1 = _pair_loads(wa, wb, sa, sb, kc, nxt, ok_g, ok_h, KB, MASKED, PAIR, PREFETCH)
                acc, xa = _pair_step_mmas(loads, xa, step, nxt, x_rows, c_x, glob, acc, K, EVEN_K, LA, XWIDE, L3)
        return acc

    @gluon.jit
    def _lane_arange(S: gl.constexpr, PARENT: gl.constexpr):
        """The program's lane slots 0..S-1 (warp i // 32, lane i % 32) along dimension 0 of 2-D layout PARENT."""
        return gl.arange(0, S, layout=gl.SliceLayout(1, PARENT))

    @gluon.jit
    def _places(pid_n, RT: gl.constexpr, NB: gl.constexpr, WARPS: gl.constexpr):
        """A program's lane slots' places: each slot's row tiles `tile` and lane `lane_a` ([S, RT] and [S, 1], layout
        LA), its x row within a group `g_x` and quad `c_x` ([S, 1], LX), the row groups `group` ([1, NB], LX), and the
        accumulators' places (D fragment): weight row `n0` [S, RT, 1] (c0, c1 at row g; c2, c3 at g + 8) and x row
        `m0` [S, 1, NB] (c0 at 8b + 2c, c1 at 8b + 2c + 1)."""
        S: gl.constexpr = 32 * WARPS
        L3: gl.constexpr = gl.BlockedLayout([1, RT, NB], [32, 1, 1], [WARPS, 1, 1], [2, 1, 0])
        LA: gl.constexpr = gl.SliceLayout(2, L3)
        LX: gl.constexpr = gl.SliceLayout(1, L3)
        i_a = _lane_arange(S, LA)
        tile = (pid_n * (WARPS * RT) + gl.expand_dims((i_a // 32) * RT, 1)
                + gl.expand_dims(gl.arange(0, RT, layout=gl.SliceLayout(0, LA)), 0))
        lane_a = gl.expand_dims(i_a % 32, 1)
        i_x = _lane_arange(S, LX)
        g_x = gl.expand_dims((i_x % 32) // 4, 1)
        c_x = gl.expand_dims(i_x % 4, 1)
        group = gl.expand_dims(gl.arange(0, NB, layout=gl.SliceLayout(0, LX)), 0)
        n0 = gl.expand_dims(tile * 16 + (lane_a // 4), 2)
        m0 = gl.expand_dims(group * 8 + 2 * c_x, 1)
        return tile, lane_a, g_x, c_x, group, n0, m0

    @gluon.jit
    def _store_zeros(y_ptr, out_ptr, pid_n, p, sid, M, N, stride_ys, stride_yp, stride_ym, RT: gl.constexpr,
                     NB: gl.constexpr, WARPS: gl.constexpr, OUT_BF16: gl.constexpr, SUM_SPLITS: gl.constexpr):
        """An entry no row uses (SELECT 2): nothing read, zeros written to its output tile (SUM_SPLITS: to the
        output, by every split alike)."""
        L3: gl.constexpr = gl.BlockedLayout([1, RT, NB], [32, 1, 1], [WARPS, 1, 1], [2, 1, 0])
        _, _, _, _, _, n0, m0 = _places(pid_n, RT, NB, WARPS)
        zero = gl.zeros([32 * WARPS, RT, NB], gl.float32, L3)
        base = y_ptr + sid * stride_ys + p * stride_yp
        if OUT_BF16 or SUM_SPLITS:
            zero = zero.to(gl.bfloat16)
        if SUM_SPLITS:
            base = out_ptr + p * stride_yp
        for h in gl.static_range(2):
            for col in gl.static_range(2):
                gl.store(base + (m0 + col) * stride_ym + n0 + 8 * h, zero, mask=(m0 + col < M) & (n0 + 8 * h < N))

    @gluon.jit
    def _entry_product(x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, pid_n, sid, s_lo, s_hi, e, x_off, y_off, M, N, K, N16,
                       STEPS, stride_xm, stride_ge, stride_ys, stride_ym, stride_we, stride_wn, stride_se, stride_sn,
                       NVFP4_FMT: gl.constexpr, RT: gl.constexpr, NB: gl.constexpr, WARPS: gl.constexpr,
                       OUT_BF16: gl.constexpr, EVEN_K: gl.constexpr, STORED: gl.constexpr, MASKED: gl.constexpr,
                       AHEAD: gl.constexpr, PREFETCH: gl.constexpr):
        """One pass of a program: stack entry e's row tiles of program `pid_n` against M <= 8 NB rows of x from
        element `x_off`, K steps [s_lo, s_hi) of split `sid`, stored at y's rows from element `y_off` (see
        `_mma_gemv_kernel`)."""
        S: gl.constexpr = 32 * WARPS
        SHAPE: gl.constexpr = [S, RT, NB]
        L3: gl.constexpr = gl.BlockedLayout([1, RT, NB], [32, 1, 1], [WARPS, 1, 1], [2, 1, 0])
        LA: gl.constexpr = gl.SliceLayout(2, L3)  # [S, RT]: words, scales, A fragments
        if STORED and NVFP4_FMT:  # a row's 16 bytes of a pair step: two int64
            WIDE: gl.constexpr = gl.BlockedLayout([1, RT, 2], [32, 1, 1], [WARPS, 1, 1], [2, 1, 0])
        else:  # 4 words a tile
            WIDE: gl.constexpr = gl.BlockedLayout([1, RT, 4], [32, 1, 1], [WARPS, 1, 1], [2, 1, 0])
        XWIDE: gl.constexpr = gl.BlockedLayout([1, NB, 4], [32, 1, 1], [WARPS, 1, 1], [2, 1, 0])  # 4 quads a group
        tile, lane_a, g_x, c_x, group, n0, m0 = _places(pid_n, RT, NB, WARPS)
        if STORED:
            # rows g and g + 8 of the lane's row tile. NVFP4 by pair steps (`_pair_steps`): its 32 columns of a pair
            # step, 32c .. 32c + 31, two int64 of each row (byte 16c of the pair step's 64) and two block scales.
            # MXFP8: its 16 columns of a step, 16c .. 16c + 15, four int32 (byte 16c of 64) and one block scale.
            row = tile * 16 + lane_a // 4
            c_a = lane_a % 4
            ok_g = row < N
            ok_h = row + 8 < N
            KB = K // 2 if NVFP4_FMT else K
            if NVFP4_FMT:  # weight strides in int64s; everything a pair step loads in WIDE's slice
                PA: gl.constexpr = gl.SliceLayout(2, WIDE)
                wa = gl.convert_layout(w_ptr.to(gl.pointer_type(gl.int64)) + e * stride_we + row * stride_wn + 2 * c_a,
                                       PA)
                kc = gl.convert_layout(16 * c_a, PA)
                sa = gl.convert_layout(s_ptr + e * stride_se + row * stride_sn + 2 * c_a, PA)
                ok_g = gl.convert_layout(ok_g, PA)
                ok_h = gl.convert_layout(ok_h, PA)
            else:  # weight strides in int32s
                wa = gl.convert_layout(w_ptr.to(gl.pointer_type(gl.int32)) + e * stride_we + row * stride_wn + 4 * c_a,
                                       gl.SliceLayout(2, WIDE))
                kc = 16 * c_a
                sa = s_ptr + e * stride_se + row * stride_sn + c_a // 2
            wb = wa + 8 * stride_wn
            sb = sa + 8 * stride_sn
        else:
            # a lane's words of a row tile and step (W: 4 NVFP4, 8 MXFP8), its 2 scale bytes (read as one int16)
            W: gl.constexpr = 4 if NVFP4_FMT else 8
            wa = gl.convert_layout(w_ptr + ((e * N16 + tile) * STEPS * 32 + lane_a) * W, gl.SliceLayout(2, WIDE))
            sa = s_ptr.to(gl.pointer_type(gl.int16)) + (e * N16 + tile) * STEPS * 32 + lane_a
            wb, sb, kc, ok_g, ok_h, KB = wa, sa, lane_a, lane_a == 0, lane_a == 0, K  # unread
        # x's row 8b + g (column g of group b's B fragment; rows past M repeat row M - 1, whose products land in
        # columns no lane stores) read as int64 quads of bf16: quad 16 step + 4c + t is the lane's two B registers
        # for MMA tile t
        x_rows = x_ptr.to(gl.pointer_type(gl.int64)) + (x_off + gl.minimum(group * 8 + g_x, M - 1) * stride_xm) // 4
        x_rows = gl.convert_layout(x_rows, gl.SliceLayout(2, XWIDE))
        c_x = gl.convert_layout(c_x, gl.SliceLayout(2, XWIDE))
        glob = gl.load(g_ptr + e * stride_ge) if NVFP4_FMT else 1.0  # NVFP4's weight_scale_2
        if STORED and NVFP4_FMT:
            acc0, acc1, acc2, acc3 = _pair_steps(wa, wb, sa, sb, kc, ok_g, ok_h, KB, x_rows, c_x, glob, s_lo, s_hi, K,
                                                 EVEN_K, MASKED, AHEAD, L3, LA, WIDE, XWIDE, SHAPE, PREFETCH)
        else:
            acc0, acc1, acc2, acc3 = _steps(wa, wb, sa, sb, kc, ok_g, ok_h, KB, x_rows, c_x, glob, s_lo, s_hi, K,
                                            NVFP4_FMT, EVEN_K, STORED, MASKED, AHEAD, L3, LA, WIDE, XWIDE, SHAPE)
        accs = (acc0, acc1, acc2, acc3)
        y_base = y_ptr + sid * stride_ys + y_off
        for h in gl.static_range(2):
            for col in gl.static_range(2):
                out = accs[2 * h + col]
                if OUT_BF16:
                    out = out.to(gl.bfloat16)
                gl.store(y_base + (m0 + col) * stride_ym + n0 + 8 * h, out, mask=(m0 + col < M) & (n0 + 8 * h < N))

    @gluon.jit
    def _add_splits(y_ptr, out_ptr, cnt_ptr, pid_n, p, y_off, M, N, NSPLIT, stride_ys, stride_ym, RT: gl.constexpr,
                    NB: gl.constexpr, WARPS: gl.constexpr):
        """The in-kernel split sum (SUM_SPLITS) of a program whose partials of M rows from `y_off` are stored: its
        ticket from the output tile's counter; the tile's last split adds the NSPLIT partials of the rows in split
        order, from L2 (.cg: not this SM's L1), 8 NB rows at a time, and sets the counter back to zero."""
        gl.thread_barrier()  # every lane's partials stored before the program's ticket (released with it)
        counter = cnt_ptr + p * gl.num_programs(0) + pid_n
        if gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == NSPLIT - 1:
            _, _, _, _, _, n0, m0 = _places(pid_n, RT, NB, WARPS)
            for r0 in range(0, M, 8 * NB):
                part = y_ptr + y_off + r0 * stride_ym
                for h in gl.static_range(2):
                    for col in gl.static_range(2):
                        offs = (m0 + col) * stride_ym + n0 + 8 * h
                        ok = (m0 + col < M - r0) & (n0 + 8 * h < N)
                        total = gl.load(part + offs, mask=ok, other=0.0, cache_modifier=".cg")
                        for sp in range(1, NSPLIT):
                            total += gl.load(part + sp * stride_ys + offs, mask=ok, other=0.0, cache_modifier=".cg")
                        gl.store(out_ptr + y_off + r0 * stride_ym + offs, total.to(gl.bfloat16), mask=ok)
            gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")

    @gluon.jit
    def _whole_product(x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, out_ptr, cnt_ptr, pid_n, p, sid, s_lo, s_hi, e, x_off, M,
                       N, K, N16, STEPS, NSPLIT, stride_xm, stride_ge, stride_ys, stride_yp, stride_ym, stride_we,
                       stride_wn, stride_se, stride_sn, NVFP4_FMT: gl.constexpr, RT: gl.constexpr, NB: gl.constexpr,
                       WARPS: gl.constexpr, OUT_BF16: gl.constexpr, EVEN_K: gl.constexpr, STORED: gl.constexpr,
                       MASKED: gl.constexpr, SUM_SPLITS: gl.constexpr, AHEAD: gl.constexpr,
                       PREFETCH: gl.constexpr):
        """A program of SELECT 0 to 2: x's M rows from element `x_off` times entry e as output entry p
        (`_entry_product`), then its split sum."""
        _entry_product(x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, pid_n, sid, s_lo, s_hi, e, x_off, p * stride_yp, M,
                       N, K, N16, STEPS, stride_xm, stride_ge, stride_ys, stride_ym, stride_we, stride_wn, stride_se,
                       stride_sn, NVFP4_FMT, RT, NB, WARPS, OUT_BF16, EVEN_K, STORED, MASKED, AHEAD, PREFETCH)
        if SUM_SPLITS:
            _add_splits(y_ptr, out_ptr, cnt_ptr, pid_n, p, p * stride_yp, M, N, NSPLIT, stride_ys, stride_ym, RT, NB,
                        WARPS)

    @gluon.jit
    def _mma_gemv_kernel(x_ptr, w_ptr, s_ptr, g_ptr, sel_ptr, y_ptr, out_ptr, cnt_ptr,
                         M, N, K, N16, STEPS, STEPS_PER_SPLIT, NSPLIT, SEL_LEN, COPY_ENTRIES,
                         stride_xp, stride_xm, stride_ge, stride_ys, stride_yp, stride_ym,
                         stride_we, stride_wn, stride_se, stride_sn,
                         NVFP4_FMT: gl.constexpr, SELECT: gl.constexpr, RT: gl.constexpr, NB: gl.constexpr,
                         WARPS: gl.constexpr, OUT_BF16: gl.constexpr, EVEN_K: gl.constexpr, STORED: gl.constexpr,
                         MASKED: gl.constexpr, SUM_SPLITS: gl.constexpr, AHEAD: gl.constexpr,
                         PREFETCH: gl.constexpr, COPIES: gl.constexpr):
        """y[split, p, m, n] = sum over this split's steps of x[q, m, k] * w_hat[e, n, k] (fp32) for output entry p =
        c SEL_LEN + q: selection entry q of copy c < COPIES, whose stack entry is e = c COPY_ENTRIES + e(q) with e(q) =
        q (SELECT 0), index[q] (SELECT 1), or q with unflagged entries (active[q] == 0) read as nothing (SELECT 2); x
        is one per selection entry (or one for all: stride_xp 0), so the copies read the same rows. SELECT 3: entry
        q's rows are its range of x's rows and of copy c's output rows (one x), [ends[q - 1], ends[q]) with `sel_ptr`
        the int32 ends (the first from row 0), at most 8 NB; the program multiplies the row groups the range has (1,
        2 or NB: an empty range reads nothing), so an entry's MMAs and x loads go to its own rows only.

        Grid: (groups of WARPS x RT row tiles, output entries, splits). The program's tensors are [S, RT, NB'] (S = 32
        WARPS lane slots, RT row tiles, NB' row groups of 8 x rows), all of a slot's in its lane's registers: element
        (i, r, b) is warp i // 32's lane i % 32, its row tile r (the A fragment) and x's rows 8b .. 8b + 7 (the B
        fragment). The weight in `reorder`'s layout, or STORED in the checkpoint's (its strides in the units a lane
        loads, int64 NVFP4 and int32 MXFP8, the scales' in bytes; rows past N and columns past K masked when MASKED).

        SUM_SPLITS: the fp32 partial sums y of the NSPLIT splits are added here, not by a kernel of their own: each
        program takes a ticket from its output tile's counter (int32 `cnt_ptr[p, pid_n]`, zero before the launch)
        once its partials are stored, and the tile's last program adds the NSPLIT partials in split order (the split
        sum kernel's order, the same bits), rounds once, stores bf16 `out_ptr` (strides as y's) and sets the counter
        back to zero for the next launch (and the next replay of a CUDA graph)."""
        pid_n = gl.program_id(0)
        p = gl.program_id(1)
        sid = gl.program_id(2)
        if COPIES == 1:  # a constant: the other launches' registers stay as they were
            q, copy = p, 0
        else:
            q, copy = p % SEL_LEN, p // SEL_LEN
        s_lo, s_hi, e = _split_and_entry(sel_ptr, q, sid, STEPS_PER_SPLIT, STEPS, SELECT)
        if COPIES > 1:
            e += copy * COPY_ENTRIES
        if SELECT == 3:
            row0 = gl.load(sel_ptr + gl.maximum(q - 1, 0)) * (q > 0).to(gl.int32)
            rows = gl.load(sel_ptr + q) - row0
            y0 = copy * stride_yp
            if rows > 0:
                if rows > 8:  # passes of 16 rows (registers for more would cost every program)
                    for r0 in range(row0, row0 + rows, 16):
                        _entry_product(x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, pid_n, sid, s_lo, s_hi, e, r0 * stride_xm,
                                       y0 + r0 * stride_ym, gl.minimum(row0 + rows - r0, 16), N, K, N16, STEPS,
                                       stride_xm, stride_ge, stride_ys, stride_ym, stride_we, stride_wn, stride_se,
                                       stride_sn, NVFP4_FMT, RT, 2, WARPS, OUT_BF16, EVEN_K, STORED, MASKED, AHEAD,
                                       PREFETCH)
                else:
                    _entry_product(x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, pid_n, sid, s_lo, s_hi, e, row0 * stride_xm,
                                   y0 + row0 * stride_ym, rows, N, K, N16, STEPS, stride_xm, stride_ge, stride_ys,
                                   stride_ym, stride_we, stride_wn, stride_se, stride_sn, NVFP4_FMT, RT, 1, WARPS,
                                   OUT_BF16, EVEN_K, STORED, MASKED, AHEAD, PREFETCH)
                if SUM_SPLITS:
                    _add_splits(y_ptr, out_ptr, cnt_ptr, pid_n, p, y0 + row0 * stride_ym, rows, N, NSPLIT, stride_ys,
                                stride_ym, RT, NB, WARPS)
        elif SELECT == 2:  # x's first M rows for every entry; an unflagged entry reads nothing and gives zeros
            if gl.load(sel_ptr + q) == 0:
                _store_zeros(y_ptr, out_ptr, pid_n, p, sid, M, N, stride_ys, stride_yp, stride_ym, RT, NB, WARPS,
                             OUT_BF16, SUM_SPLITS)
            else:
                _whole_product(x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, out_ptr, cnt_ptr, pid_n, p, sid, s_lo, s_hi, e,
                               q * stride_xp, M, N, K, N16, STEPS, NSPLIT, stride_xm, stride_ge, stride_ys, stride_yp,
                               stride_ym, stride_we, stride_wn, stride_se, stride_sn, NVFP4_FMT, RT, NB, WARPS,
                               OUT_BF16, EVEN_K, STORED, MASKED, SUM_SPLITS, AHEAD, PREFETCH)
        else:  # x's first M rows for every entry
            _whole_product(x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, out_ptr, cnt_ptr, pid_n, p, sid, s_lo, s_hi, e,
                           q * stride_xp, M, N, K, N16, STEPS, NSPLIT, stride_xm, stride_ge, stride_ys, stride_yp,
                           stride_ym, stride_we, stride_wn, stride_se, stride_sn, NVFP4_FMT, RT, NB, WARPS, OUT_BF16,
                           EVEN_K, STORED, MASKED, SUM_SPLITS, AHEAD, PREFETCH)

    # `counters` is written and restored to zeros within the launch, so the operator leaves it as it found it (no
    # mutation for torch.compile to functionalise: a copy a call)
    @custom_op("minimax_ref::packed_mma_gemv", mutates_args=())
    def _mma_gemv_op(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, glob: torch.Tensor,
                     sel: torch.Tensor | None, select: int, outputs: int, n: int, split: int, nvfp4: bool,
                     stored: bool, counters: torch.Tensor | None, row_tiles: int, ahead: int, prefetch: bool,
                     copies: int) -> torch.Tensor:
        """The launch (see `packed_product`): x bf16 `[Px, M, K]` (Px 1: shared by every output entry); the weight
        in `reorder`'s layout (words, scales, glob), or `stored` in the checkpoint's (uint8 views `[E, N, K/2 or K]`
        and `[E, N, K/16 or K/32]`, glob NVFP4's weight_scale_2 `[E]` or `[1]`, MXFP8 anything: unread); sel int
        `[outputs / copies]` (ids, select 1; flags, select 2; select 3: int32 ends of the entries' ranges of x's M
        rows, and outputs = copies) or None; copies: the weight's stacks of E / copies entries each, one after the
        other, each multiplied by the selection (output entry c Q + q is selection entry q of stack c, for Q selected
        entries; x per selection entry: Px 1 or Q); counters int32 zeros (at least `programs`) for the K splits' sum
        in the kernel, or None (a second kernel adds them); row_tiles / ahead: the `Launch`'s. Returns bf16
        `[outputs, M, N]`."""
        m, k = x.shape[1], x.shape[2]
        sel_len = outputs if sel is None else sel.shape[0]  # the selection's entries (Q)
        columns = step_columns(NVFP4 if nvfp4 else MXFP8, stored)
        odd_scales = False
        if stored:
            unit = 8 if nvfp4 else 4  # the kernel's loads: int64 (NVFP4) or int32 (MXFP8) units
            align = 8 if nvfp4 else 16  # `stored_supports`'s
            if weight.data_ptr() % align or any(stride % align for stride in weight.stride()[:-1]):
                raise ValueError(f"mma_gemv: a stored {'NVFP4' if nvfp4 else 'MXFP8'} weight's rows must be "
                                 f"{align}-byte aligned (stored_supports)")
            n16, steps = -(-n // ROW_TILE), -(-k // columns)
            strides = (weight.stride(0) // unit, weight.stride(1) // unit, scales.stride(0), scales.stride(1))
            # NVFP4 reads a pair step's two scales as an int16 where they are 2-byte aligned, else byte by byte
            odd_scales = nvfp4 and bool(scales.data_ptr() % 2 or any(stride % 2 for stride in scales.stride()[:-1]))
        else:
            n16, steps = weight.shape[1:3]
            strides = (0, 0, 0, 0)
        even_k = k % columns == 0
        if stored and nvfp4 and not even_k:  # pair steps read x unmasked (registers): zeros to whole pair steps
            x, even_k = torch.nn.functional.pad(x, (0, -k % columns)), True
        if x.data_ptr() % 8:  # x is read as int64 quads (its rows are: K is a multiple of 16)
            x = x.clone()
        per = -(-steps // split)
        shape = (outputs, m, n) if split == 1 else (split, outputs, m, n)
        out = torch.empty(shape, dtype=torch.bfloat16 if split == 1 else torch.float32, device=x.device)
        tiles = WARPS * row_tiles
        grid = (-(-n16 // tiles), copies * sel_len, split)
        sum_splits = split > 1 and counters is not None and counters.numel() >= grid[0] * grid[1]
        # rows or columns past the weight's, or scales read byte by byte
        masked = stored and bool(n % (ROW_TILE * tiles) or k % columns or odd_scales)
        y = torch.empty((outputs, m, n), dtype=torch.bfloat16, device=x.device) if split > 1 else out
        _mma_gemv_kernel[grid](
            x, weight, scales, glob, weight if sel is None else sel, out, y, counters if sum_splits else out,
            m, n, k, n16, steps, per, split, sel_len, weight.shape[0] // copies,
            x.stride(0) if x.shape[0] > 1 else 0, x.stride(1), 1 if glob.numel() > 1 else 0,
            0 if split == 1 else out.stride(0), out.stride(-3), out.stride(-2), *strides,
            NVFP4_FMT=nvfp4, SELECT=select, RT=row_tiles, NB=1 if select == 3 else row_groups(m), WARPS=WARPS,
            OUT_BF16=split == 1,
            EVEN_K=even_k, STORED=stored, MASKED=masked, SUM_SPLITS=sum_splits, AHEAD=ahead, PREFETCH=prefetch,
            COPIES=copies,
            num_warps=WARPS)
        if split == 1 or sum_splits:
            return y
        grouped._sum_splits_kernel[(-(-y.numel() // 1024),)](out, y, y.numel(), SPLIT=split, BLOCK=1024,
                                                             EXACT_FP32=False)
        return y

    @_mma_gemv_op.register_fake
    def _(x, weight, scales, glob, sel, select, outputs, n, split, nvfp4, stored, counters, row_tiles, ahead, prefetch,
          copies):
        return x.new_empty((outputs, x.shape[1], n))


def counters_for(entries: int, n: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters for the in-kernel split sum of every launch over `entries` output entries of a weight of
    `n` rows (a program's output tile each, at the launch with the most; the kernel leaves them zero)."""
    tiles = WARPS * min(launch.row_tiles for launch in LAUNCH.values())
    row_tiles = -(-n // ROW_TILE)
    return torch.zeros(entries * -(-row_tiles // tiles), dtype=torch.int32, device=device)


def step_columns(fmt: str, stored: bool) -> int:
    """K columns of one of the kernel's steps (what its splits count): 128 for an NVFP4 weight read where it is
    stored (pair steps: a lane's 16 bytes of a row at once), else `STEP_K`."""
    return 2 * STEP_K if stored and fmt == NVFP4 else STEP_K


def launch_for(fmt: str, m: int) -> tuple[int, Launch]:
    """The row groups and `Launch` of a product of `m` rows of format `fmt`."""
    groups = row_groups(m)
    return groups, LAUNCH[fmt, groups]


def programs(fmt: str, entries: int, n16: int, m: int, launch: Launch | None = None) -> int:
    """The programs of one K split of a product of `m` rows over `entries` output entries of `n16` row tiles
    (`launch`: default `launch_for`'s)."""
    return entries * -(-n16 // (WARPS * (launch or launch_for(fmt, m)[1]).row_tiles))


def splits(programs: int, steps: int, sms: int, per_sm: int) -> int:
    """K splits so that `programs` (of one split) times the splits reach `per_sm` programs an SM, each split at least
    `MIN_STEPS_PER_SPLIT` steps (or all of them), no empty split."""
    want = -(-per_sm * sms // max(programs, 1))
    split = max(1, min(steps // MIN_STEPS_PER_SPLIT, want))
    return -(-steps // -(-steps // split))


def packed_product(x: torch.Tensor, n: int, words: torch.Tensor, scales: torch.Tensor, glob: torch.Tensor,
                   index: torch.Tensor | None = None, active: torch.Tensor | None = None,
                   split: int | None = None, sms: int = 1, busy: int | None = None,
                   counters: torch.Tensor | None = None, launch: Launch | None = None,
                   ends: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w_hat^T` for a weight in `reorder`'s layout (N = `n` rows; the format read from the words a lane holds a
    step), one launch (two with K splits).

    x: bf16 `[M, K]` (shared by every entry) or `[P, M, K]` (one per output entry), 1 <= M <= `MAX_ROWS`, K whole
    blocks of the format (x's last dimension; its rows 8-byte aligned: read as int64 quads); index: None or an integer
    tensor `[P]` of stack entries; active: None or int32 `[E]` flags over the stack (index None): unflagged entries
    read nothing and give zero rows. Returns bf16 `[P, M, N]`. split: K splits (default `splits` for `sms` SMs,
    counting `busy` flagged entries with `active`); counters: `counters_for`'s zeros, with which the kernel adds its
    splits itself (one launch; a launch needing more counters, or None, takes the split sum kernel: the same bits);
    launch: a `Launch` instead of `LAUNCH`'s for the format and rows (benchmarks compare them). Contract: the module
    docstring. Static in the shapes: no host synchronisation.

    ends (int32 `[E]`, on x's device; index and active None): rows sorted by stack entry instead (an MoE's (token,
    choice) pairs), x `[R, K]` with entry e's rows x[ends[e - 1]:ends[e]] (entry 0's from row 0; equal ends: none)
    and ends[E - 1] = R: returns bf16 `[R, N]`, row r the product with its own entry. Each entry's MMAs and x loads
    go to its own rows only: a range of up to 8 rows in one row group, more in passes of 16 (two groups) over the
    program's weight tiles. Each row's sums are those of the same rows multiplied alone by their entry at the same
    split."""
    entries, n16, steps = words.shape[:3]
    fmt = NVFP4 if words.shape[-1] == 4 else MXFP8
    k = x.shape[-1]
    if (-(-k // STEP_K) != steps or n16 != -(-n // (ROW_TILE * GROUP)) * GROUP or words.dim() != 5
            or words.shape[-1] not in (4, 8)):
        raise ValueError(f"mma_gemv.packed_product: x {list(x.shape)} against words {list(words.shape)}, n {n}")
    return _product(x, fmt, n, entries, words, scales, glob, False, index, active, split, sms, busy, counters,
                    launch, ends)


def stored_supports(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor, address: bool = True) -> bool:
    """Whether the kernel reads this packed weight (`[N, ...]` or `[E, N, ...]`, as `packed_product_stored` takes
    it) where it is stored: whole blocks of K, rows contiguous, and every row aligned to the loads a lane makes
    (NVFP4 8 bytes, MXFP8 16). `address`: the data pointer's alignment too (not while a compiled region is traced,
    which cannot read it; the launch checks it)."""
    k = weight.shape[-1] * (2 if fmt == NVFP4 else 1)
    align = 8 if fmt == NVFP4 else 16
    return (supports(fmt, k) and weight.element_size() == 1 and weight_scale.element_size() == 1
            and weight.stride(-1) == 1 and weight_scale.stride(-1) == 1
            and (not address or weight.data_ptr() % align == 0)
            and all(stride % align == 0 for stride in weight.stride()[:-1]))


def packed_product_stored(x: torch.Tensor, fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                          weight_scale_2: torch.Tensor | None, index: torch.Tensor | None = None,
                          active: torch.Tensor | None = None, split: int | None = None, sms: int = 1,
                          busy: int | None = None, counters: torch.Tensor | None = None,
                          launch: Launch | None = None, ends: torch.Tensor | None = None,
                          copies: int = 1) -> torch.Tensor:
    """`packed_product` reading the weight where the checkpoint's layout stores it (no reordered copy; operands as in
    `packed.decode_reference`: NVFP4 uint8 codes `[.., N, K/2]`, E4M3 block scales `[.., N, K/16]`, weight_scale_2;
    MXFP8 E4M3 elements `[.., N, K]`, E8M0 block scales `[.., N, K/32]`), which `stored_supports` must accept. Each
    lane forms words of `reorder`'s format from its rows' bytes (NVFP4 by pair steps, `_STORED_WORDS_ASM`): the
    products of `packed_product`, NVFP4's in another order of K; the same contract.

    copies: the stack `[E, ...]` is `copies` stacks of E / copies entries, one after the other (a routed layer's gate
    and up: `fast.joint.JointStack`), and `index`, `active` and `ends` select entries of one of them (ids below E /
    copies, flags and ends `[E / copies]`; `busy` counts one stack's flagged entries), the same for each: one launch
    returns each stack's product after the other's, `[copies * P, M, N]` (ids: `[P]`), `[E, M, N]` (flags) or
    `[copies * R, N]` (ranges), x read once for all of them."""
    if not stored_supports(fmt, weight, weight_scale, address=not torch.compiler.is_compiling()):
        raise ValueError(f"mma_gemv.packed_product_stored: {fmt} weight {list(weight.shape)} strides "
                         f"{list(weight.stride())} is not read in place (stored_supports)")
    w = weight.view(torch.uint8)
    s = weight_scale.view(torch.uint8)
    if w.dim() == 2:
        w, s = w.unsqueeze(0), s.unsqueeze(0)
    if fmt == NVFP4:
        glob = weight_scale_2.reshape(-1).to(torch.float32)
    else:
        glob = s  # unread
    return _product(x, fmt, w.shape[1], w.shape[0], w, s, glob, True, index, active, split, sms, busy, counters,
                    launch, ends, copies)


def _product(x: torch.Tensor, fmt: str, n: int, entries: int, weight: torch.Tensor, scales: torch.Tensor,
             glob: torch.Tensor, stored: bool, index: torch.Tensor | None, active: torch.Tensor | None,
             split: int | None, sms: int, busy: int | None, counters: torch.Tensor | None,
             launch: Launch | None, ends: torch.Tensor | None = None, copies: int = 1) -> torch.Tensor:
    """The checks and launch both layouts share."""
    if not AVAILABLE:
        raise RuntimeError("mma_gemv needs triton with Gluon")
    xs = x.unsqueeze(0) if x.dim() == 2 else x
    ranged = ends is not None
    outputs = copies * (1 if ranged else entries // copies if index is None else index.shape[0])
    chosen = outputs // copies  # the selection's output entries (what x's entries match)
    m, k = xs.shape[1], xs.shape[2]
    stored_k = weight.shape[-1] * (2 if fmt == NVFP4 else 1)
    rows_ok = (x.dim() == 2 and index is None and active is None and ends.dim() == 1 and ends.dtype == torch.int32
               and ends.device == x.device) if ranged else 1 <= m <= MAX_ROWS
    sel_ok = ((active is None or active.shape == (entries // copies,))
              and (not ranged or ends.shape[0] <= entries // copies))
    if (x.dtype != torch.bfloat16 or not rows_ok or not supports(fmt, k) or (stored and k != stored_k)
            or xs.shape[0] not in (1, chosen) or (index is not None and active is not None) or copies < 1
            or entries % copies or not sel_ok):
        raise ValueError(f"mma_gemv: x {list(x.shape)} {x.dtype} against a {fmt} weight {list(weight.shape)}, n {n}"
                         + (f", {copies} stacks" if copies > 1 else "")
                         + (f", flags {list(active.shape)}" if active is not None else "")
                         + (f", ranges {list(ends.shape)} {ends.dtype} on {ends.device}" if ranged else ""))
    steps = -(-k // step_columns(fmt, stored))
    n16 = -(-n // ROW_TILE)
    if launch is None:
        if ranged:
            launch = RANGED_LAUNCH[fmt]
        elif stored and index is not None and m <= X_GROUP and (fmt, xs.shape[0] > 1) in STORED_IDS_LAUNCH:
            launch = STORED_IDS_LAUNCH[fmt, xs.shape[0] > 1]
        else:
            launch = launch_for(fmt, m)[1]
    if launch.ahead not in (1, 2) or launch.row_tiles not in (1, 2) or GROUP % (WARPS * launch.row_tiles):
        raise ValueError(f"mma_gemv: {launch} (ahead 1 or 2 K steps, 1 or 2 row tiles a warp)")
    if split is None:
        if ranged:
            working = copies * min(ends.shape[0], m)  # entries with rows, at most
        else:
            working = copies * min(chosen, busy) if busy is not None and active is not None else outputs
        split = splits(programs(fmt, working, n16, m, launch), steps, sms, launch.per_sm)
    split = -(-steps // -(-steps // max(1, min(split, steps))))
    select, sel = 0, None
    if index is not None:
        select, sel = 1, index
    elif active is not None:
        select, sel = 2, active.to(torch.int32)
    elif ranged:
        select, sel = 3, ends
    y = torch.ops.minimax_ref.packed_mma_gemv(xs.contiguous(), weight, scales, glob, sel, select, outputs, n, split,
                                              fmt == NVFP4, stored, counters, launch.row_tiles, launch.ahead,
                                              launch.prefetch, copies)
    return y.view(copies * m, n) if ranged else y
