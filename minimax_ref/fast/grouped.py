"""Products of packed weights with 2 to 64 rows (batch > 1 decode steps, speculative verify steps) by one Triton
kernel that decodes each weight tile once, in registers, and multiplies it by every row with tensor cores
(`FastPaths.grouped`).

Without it, a batch's or verify step's products with packed weights go through `F.linear(x, decode())`: the
whole weight decoded to bf16 and written (2 bytes an element), then read again by the GEMM, about eight times the
packed bytes (NVFP4). Here one program per (weight entry, tile of `block_n` output columns, split of K) loads the
tile's packed bytes as int32 words (8 NVFP4 or 4 MXFP8 elements a load) and its block scales, decodes them to bf16
exactly as `quant.decode_nvfp4` / `decode_mxfp8` followed by `.to(bfloat16)` do (one plane per nibble or byte of the
words, interleaved back into K order with `tl.join`), and accumulates `tl.dot(w_tile, x_tile^T)` in fp32 for all M
rows at once. Computed transposed (y^T = W x^T): the weight's rows fill the tensor core's large dimension and the
few tokens its small one (`Tiles.x_major` 1 computes y = x W^T instead, x's rows padded to the MMA's 64: a launch
choice, the same contract). Compiled for sm_90 the loop spends about 9 instructions a decoded NVFP4 element (7
through the blocks' tables) and moves each decoded tile through shared memory into the MMA's operand layout
(benchmarks/kernel_sass.py), so the decoding on the CUDA cores, not the tensor cores, bounds it below the copy
bandwidth. `Tiles.planes` 1 (x_major 0) instead multiplies each plane of the words by its own x columns (x's
columns permuted once per call, `_permute_x`): no join, so Triton converts the packed words, not the decoded tile,
to the operand layout; at the tuned tiles the decoded tile's shared-memory stores and barriers leave the loop and
it issues 6 to 13 % fewer instructions an element (benchmarks/kernel_sass.py's `-planes` cases).

* `packed_matmul_grouped(x, fmt, weight, ...)`: x `[M, K]` (or `[E, M, K]`, one per entry) against a packed linear
  `[N, K]` or a stack `[E, N, K]` (the routed experts), M <= `MAX_ROWS`. With `active` (int32 `[E]`), entries whose
  flag is 0 are not read at all and their output rows are zeros: the experts no token chose cost nothing, without a
  host synchronisation and with static shapes (a grouped GEMM over the selected experts, each multiplied by all M
  rows, since at these sizes the tensor cores idle while the weight bytes stream in).
* `swiglu_pair_grouped(x, fmt, gate, up, alpha, limit)` (`FastPaths.grouped_swiglu`): the routed experts' gate and
  up stacks multiplied by the same rows in one launch, each program decoding a tile of both and loading x's step tile
  once for the two, its SwiGLU stored instead of the two products (one K split: the activation needs whole sums).
* `table=True` (`FastPaths.nvfp4_table`): NVFP4 decoded through each block's table of its 8 values (`_TABLE_ASM`:
  byte permutes, no multiply or conversion an element; 7.2 instructions an element in the loop against 9.2,
  benchmarks/kernel_sass.py). The same bits.
* Decoded bits: the decoding needs the weight's scales in the normal range (`packed.scales_in_normal_range`: every
  fp32 intermediate is then a normal number or a placed subnormal that a plain multiply keeps) and, for MXFP8, no
  E4M3 NaN byte; `FastPackedWeight` checks both at configuration and keeps its other paths otherwise.
* Registered as the operator `minimax_ref::packed_matmul_grouped` (`torch.library.triton_op`), so `torch.compile`
  (the compiled decoder layers) launches the kernel as it is, and a CUDA graph captures it (no host read).
* Launch configurations (`Tiles`) are data: `TUNED`, keyed by GPU name, torch and triton versions, else `DEFAULT`.

Under `TRITON_INTERPRET=1` the kernel runs on CPU tensors (the tests): the interpreter's bf16 conversion truncates and
its `tl.dot` does not read bf16, so there (`exact_fp32`) the roundings to bf16 are done on the fp32 bits and the dot
multiplies bf16 values held in fp32 (exact products, fp32 sums): the same function as the GPU's bf16 tensor-core dot.

This module imports triton lazily-tolerant: where triton is missing `AVAILABLE` is False and nothing registers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..weights.checkpoint import MXFP8, NVFP4
from .launch import KernelTiles

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # the CI machine and CPU installs: the grouped path is off
    triton = None

AVAILABLE = triton is not None
# Rows of x one launch takes (the kernel's BLOCK_M, a power of two >= 16: tl.dot's smallest dimension). Decode steps
# have at most `SYNC_FREE_TOKENS` = 64 rows; more rows (prefill) amortise a decoded weight anyway.
MAX_ROWS = 64


# Whether `triton.jit` made the kernels below interpreted (`TRITON_INTERPRET=1` when this module was imported).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1` at import)."""
    return _INTERPRET


def runs_on(device: torch.device) -> bool:
    """Whether the grouped kernel runs on tensors of `device` here: CUDA with triton importable; under the interpreter
    CPU tensors instead, outside compiled regions (a compiled region cannot trace an interpreted kernel)."""
    if not AVAILABLE:
        return False
    if _INTERPRET:
        return device.type == "cpu" and not torch.compiler.is_compiling()
    return device.type == "cuda"


@dataclass(frozen=True)
class Tiles(KernelTiles):
    """One launch configuration of the grouped kernel: `block_n` output columns (weight rows) and `block_k` decoded
    elements of K per program step (powers of two, at least 32), `num_warps`, `num_stages` (software pipelining of the
    loads), `x_major` (1: the product as y = x W^T, x's rows padded to the MMA's 64-row side and the decoded tile its
    shared-memory operand; 0: as y^T = W x^T, the decoded tile the register operand), `planes` (x_major 0 only; 1:
    each K step as one product per nibble or byte position of the packed words, `_planes_step`, x's columns
    permuted to match once per call; 0: the decoded elements interleaved back into K order, one product a step).
    Every choice gives the contract of `packed_matmul_grouped`."""

    KIND = "grouped"

    block_n: int = 128
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 3
    x_major: int = 0
    planes: int = 0

    def check(self) -> None:
        if (self.block_n < 16 or self.block_k < 32 or self.x_major not in (0, 1) or self.planes not in (0, 1)
                or (self.planes and self.x_major)):
            raise ConfigError(f"grouped tiles: block_n={self.block_n} (>= 16), block_k={self.block_k} (>= 32), "
                              f"x_major={self.x_major} (0 or 1), planes={self.planes} (0 or 1; 1 with x_major 0)")


# Untuned defaults, chosen for H200 without a measurement: 128 weight rows and 64 elements of K a step with 8 warps.
# Compiled for sm_90 at 32 rows (benchmarks/kernel_sass.py): 64 to 72 registers a thread, no spills; the packed words
# reach shared memory through the compiler's pipelined asynchronous copies (`num_stages`), the block scales are
# loaded a step ahead by the loop itself. x_major 0: x_major 1 issues fewer instructions an element and waits on its
# MMAs once an iteration instead of after each, yet on an H200 it is slower (BENCHMARKS.md).
DEFAULT = {NVFP4: Tiles(128, 64, 8, 4), MXFP8: Tiles(128, 64, 8, 4)}
# Measured configurations (benchmarks/grouped_gemm.py --sweep prints entries in this form):
# (torch.cuda.get_device_name(), torch "major.minor", triton "major.minor") -> {format: Tiles}.
TUNED: dict[tuple[str, str, str], dict[str, Tiles]] = {
    # 64 weight rows by 128 elements of K with 4 warps: the least total time over the release's decode products at 32
    # rows (BENCHMARKS.md, "Decode at batch 32")
    ("NVIDIA H200", "2.11", "3.6"): {NVFP4: Tiles(64, 128, 4, 4), MXFP8: Tiles(64, 128, 4, 4)},
}


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def tiles_for(fmt: str, device: torch.device) -> Tiles:
    """The launch configuration for `fmt` on `device`: `TUNED`'s entry for this GPU and these torch and triton
    versions, else `DEFAULT`."""
    if device.type == "cuda" and AVAILABLE:
        key = (torch.cuda.get_device_name(device), _major_minor(torch.__version__), _major_minor(triton.__version__))
        entry = TUNED.get(key)
        if entry is not None and fmt in entry:
            return entry[fmt]
    return DEFAULT[fmt]


def _fit_block_k(tiles: KernelTiles, k: int) -> int:
    """The largest block_k <= `tiles.block_k` that divides K (down to 32; 0: none does); `tiles`: this kernel's or
    another packed kernel's launch configuration (`prefill_experts.Tiles`)."""
    bk = tiles.block_k
    while bk >= 32 and k % bk:
        bk //= 2
    return bk if bk >= 32 else 0


def supports(fmt: str, k: int) -> bool:
    """Whether the kernel takes a weight of format `fmt` with K decoded columns (K a multiple of 32)."""
    return fmt in (NVFP4, MXFP8) and k % 32 == 0


_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """The SM count of a CUDA `device` (1 elsewhere), read once per device."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def launch_for(fmt: str, entries: int, n: int, k: int, device: torch.device) -> tuple[Tiles, int]:
    """The launch configuration and K splits for a weight of `entries` entries (1: a linear) of `[N, K]` on `device`
    (`tiles_for`, `split_for` on its SM count). Reads device properties: call it outside compiled regions (a
    `FastPackedWeight` does at configuration) and pass the result to `packed_matmul_grouped`."""
    tiles = tiles_for(fmt, device)
    k_steps = k // _fit_block_k(tiles, k)
    return tiles, split_for(entries * -(-n // tiles.block_n), k_steps, sm_count(device))


def split_for(programs: int, k_steps: int, sms: int) -> int:
    """Splits of K so that `programs` (entries times column tiles) times the splits fill the GPU twice over (a dense
    linear with few column tiles, the k and v projections, would otherwise run on a few SMs); at most one split a
    K step. The splits' fp32 partial sums are added afterwards (`packed_matmul_grouped`)."""
    want = -(-2 * sms // max(programs, 1))
    split = max(1, min(k_steps, want))
    per = -(-k_steps // split)
    return -(-k_steps // per)  # no empty split


def _permute_x(x: torch.Tensor, block_k: int, per_word: int) -> torch.Tensor:
    """x `[Ex, M, K]` with the columns of each K step of `block_k` permuted for `_planes_step`: position p * W + j
    of a step (W = block_k / per_word) holds its element per_word * j + p, the element of nibble or byte p of word j
    (`per_word` 8 for NVFP4, 4 for MXFP8), so that each plane's x columns are contiguous. A copy of x (M rows, far
    fewer bytes than the weight), once per call."""
    ex, m, k = x.shape
    return x.view(ex, m, k // block_k, block_k // per_word, per_word).transpose(-1, -2).contiguous().view(ex, m, k)


def plane_width(fmt: str, block_k: int) -> int:
    """Words of a K step of `block_k` elements (`block_k / 8` NVFP4, `/ 4` MXFP8): the K side of each plane's product
    (`Tiles.planes`), which tl.dot needs to be at least 16."""
    return block_k // (8 if fmt == NVFP4 else 4)


if AVAILABLE:
    # fp32 bit fields the E2M1 and E4M3 codes are placed on (as `fast.packed._e2m1_nibble` / `mxfp8_word_planes`)
    _SIGN = tl.constexpr(-2147483648)  # bit 31
    _E2M1_FIELD = tl.constexpr(0x01C00000)  # bits 24..22: E2M1's e e m as exponent bits 24..23, mantissa bit 22
    _E4M3_FIELD = tl.constexpr(0x07F00000)  # bits 26..20: E4M3's e e e e m m m

    @triton.jit
    def _bf16_value(v, EXACT_FP32: tl.constexpr):
        """fp32 `v` rounded to the nearest bf16, ties to even. The GPU's conversion instruction (a bf16 tensor);
        with EXACT_FP32 (the interpreter, whose conversion truncates) integer operations on the bits
        (`fast.packed.round_to_bf16_bits`), the bf16 value held in fp32. Same value for every non-NaN v."""
        if EXACT_FP32:
            b = v.to(tl.int32, bitcast=True)
            return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        else:
            return v.to(tl.bfloat16, fp_downcast_rounding="rtne")

    @triton.jit
    def _bf16_storable(v, EXACT_FP32: tl.constexpr):
        """fp32 `v` rounded to the nearest bf16, ties to even, as a bf16 tensor (what a bf16 output stores)."""
        if EXACT_FP32:
            b = v.to(tl.int32, bitcast=True)
            r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            return v.to(tl.bfloat16, fp_downcast_rounding="rtne")

    @triton.jit
    def _x_operand(ptrs, mask, EXACT_FP32: tl.constexpr):
        """A tile of bf16 x as the dot's operand: bf16 itself, or with EXACT_FP32 widened to fp32 on the bits
        (exact)."""
        x = tl.load(ptrs, mask=mask, other=0.0)
        if EXACT_FP32:
            return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            return x

    @triton.jit
    def _e4m3_value(code, EXACT_FP32: tl.constexpr):
        """fp32 value of E4M3 bytes `code` (int32 0..255, not NaN), exactly. On the GPU the conversion instructions
        (E4M3 pairs to f16 pairs, then f32: both exact); with EXACT_FP32 (the interpreter) the bits placed so that
        fp32 reads e4m3 * 2^-120 (E4M3 subnormals as fp32 subnormals), times 2^120 (exact)."""
        if EXACT_FP32:
            bits = ((code << 24) & _SIGN) | ((code << 20) & _E4M3_FIELD)
            return bits.to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120
        else:
            return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)

    @triton.jit
    def _e4m3_byte(words, scale, B: tl.constexpr, EXACT_FP32: tl.constexpr):
        """Element 4w + B of each int32 word of E4M3 bytes (its byte B) times its scale, as bf16 (exact in range)."""
        return _bf16_value(_e4m3_value((words >> (8 * B)) & 0xFF, EXACT_FP32) * scale, EXACT_FP32)

    @triton.jit
    def _nibble(words, scale, J: tl.constexpr, EXACT_FP32: tl.constexpr):
        """Element 8w + J of each int32 word of packed NVFP4 bytes (its nibble J: sign bit 4J + 3, e e m bits
        4J..4J+2) times its block scale times 2^126 (`scale`), rounded to bf16: the nibble placed on the fp32 bits
        as e2m1 * 2^-126 (sign to bit 31, e e m to bits 24..22: `fast.packed._e2m1_nibble`), so that the one fp32
        product is the reference's e2m1 * block scale, exactly rounded (for scales in the normal range)."""
        if 22 - 4 * J >= 0:
            field = (words << (22 - 4 * J)) & _E2M1_FIELD
        else:
            field = (words >> (4 * J - 22)) & _E2M1_FIELD
        v = (((words << (28 - 4 * J)) & _SIGN) | field).to(tl.float32, bitcast=True) * scale
        return _bf16_value(v, EXACT_FP32)

    @triton.jit
    def _broadcast_blocks(s, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, PER: tl.constexpr):
        """Per-block values `s` [BLOCK_N, BLOCKS] repeated over each block's PER elements: [BLOCK_N, BLOCKS * PER]."""
        return tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCKS, PER)), (BLOCK_N, BLOCKS * PER))

    @triton.jit
    def _step_words(w_rows, ks, n_ok, WORDS: tl.constexpr):
        """K step `ks` of a tile: its int32 words of packed bytes [BLOCK_N, WORDS] (rows past N read as zeros)."""
        jw = tl.arange(0, WORDS)
        return tl.load(w_rows + ks * WORDS + jw[None, :], mask=n_ok[:, None], other=0)

    @triton.jit
    def _step_scales(s_rows, ks, ok, BLOCKS: tl.constexpr):
        """K step `ks` of a tile: its block scale codes as int32 [BLOCK_N, BLOCKS] (rows where `ok` is false read as
        zeros). Loaded apart from the words so that a loop can load the next step's early: the compiler pipelines
        the words (they feed the dot), not these few bytes a row."""
        js = tl.arange(0, BLOCKS)
        return tl.load(s_rows + ks * BLOCKS + js[None, :], mask=ok[:, None], other=0).to(tl.int32)

    @triton.jit
    def _nvfp4_tile(w_rows, sc, g, ks, n_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EXACT_FP32: tl.constexpr):
        """Step `ks` of a packed NVFP4 weight decoded: [BLOCK_N, BLOCK_K] bf16 (with EXACT_FP32, bf16 values held in
        fp32). w_rows: the tile's rows of int32 words; sc: the step's E4M3 block scale codes (`_step_scales`,
        BLOCK_K / 16 a row); g: the global scale."""
        BLOCKS: tl.constexpr = BLOCK_K // 16  # block scales a step (2 words each)
        words = _step_words(w_rows, ks, n_ok, BLOCK_K // 8)  # 8 elements a word
        # the reference's block scale fp32(e4m3) * global (one rounding), then times 2^126 (exact: |s| < 4)
        block = (_e4m3_value(sc, EXACT_FP32) * g) * 8.507059173023462e37  # 2^126
        scale = _broadcast_blocks(block, BLOCK_N, BLOCKS, 2)  # [BN, WORDS]: each word's block scale
        # nibble j of word w is element 8w + j: the eight planes interleaved back into K order (tl.join adds an
        # innermost axis: join(join(join(p0, p4), join(p2, p6)), ...) puts p_j at offset j)
        even = tl.join(tl.join(_nibble(words, scale, 0, EXACT_FP32), _nibble(words, scale, 4, EXACT_FP32)),
                       tl.join(_nibble(words, scale, 2, EXACT_FP32), _nibble(words, scale, 6, EXACT_FP32)))
        odd = tl.join(tl.join(_nibble(words, scale, 1, EXACT_FP32), _nibble(words, scale, 5, EXACT_FP32)),
                      tl.join(_nibble(words, scale, 3, EXACT_FP32), _nibble(words, scale, 7, EXACT_FP32)))
        return tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_K))

    # One int32 word of NVFP4 bytes (element 8w + j in nibble j) decoded through its block's table: with
    # A = bf16(S) and B = bf16(fp32(1.5 S)) for the block scale S (the reference's roundings), e2m1 * S rounded to
    # bf16 is, for the codes 0..7 of a nibble's e e m bits, one of {0, A/2, A, B, 2A, 2B, 4A, 4B} (powers of two
    # scale exactly) with the nibble's sign applied (an exclusive or: the table's entries carry S's sign, its zero
    # is S's signed zero). The table comes as four words of two entries each, $9..$12 = (t0 | t1 << 16), (t2 | t3 <<
    # 16), ...; `prmt` splits them into a low-byte and a high-byte table and looks both up with the codes as
    # selectors (four elements an instruction), replicates each nibble's sign bit over a byte to flip the entries'
    # signs, and pairs the bytes into bf16. $0..$7: the 8 elements (b16); $8: the word. tests/test_grouped.py runs
    # this text through a model of each instruction against `decode_reference`.
    # One line: torch.compile embeds a kernel's source, its constants by repr, in a '''-quoted string, where an escaped
    # newline would become a real one.
    _TABLE_ASM = tl.constexpr(" ".join((
        "{",
        ".reg .b32 tl0, tl1, th0, th1, q4, s1, s2, l1, h1, l2, h2, g1, g2, r0, r1, r2, r3;",
        "prmt.b32 tl0, $9, $10, 0x6420;",
        "prmt.b32 th0, $9, $10, 0x7531;",
        "prmt.b32 tl1, $11, $12, 0x6420;",
        "prmt.b32 th1, $11, $12, 0x7531;",
        "shl.b32 q4, $8, 4;",
        "and.b32 s1, $8, 0x7777;",
        "shr.u32 s2, $8, 16;",
        "and.b32 s2, s2, 0x7777;",
        "prmt.b32 l1, tl0, tl1, s1;",
        "prmt.b32 h1, th0, th1, s1;",
        "prmt.b32 l2, tl0, tl1, s2;",
        "prmt.b32 h2, th0, th1, s2;",
        "prmt.b32 g1, q4, $8, 0xD9C8;",
        "prmt.b32 g2, q4, $8, 0xFBEA;",
        "lop3.b32 h1, h1, g1, 0x80808080, 0x78;",
        "lop3.b32 h2, h2, g2, 0x80808080, 0x78;",
        "prmt.b32 r0, l1, h1, 0x5140;",
        "prmt.b32 r1, l1, h1, 0x7362;",
        "prmt.b32 r2, l2, h2, 0x5140;",
        "prmt.b32 r3, l2, h2, 0x7362;",
        "mov.b32 {$0, $1}, r0;",
        "mov.b32 {$2, $3}, r1;",
        "mov.b32 {$4, $5}, r2;",
        "mov.b32 {$6, $7}, r3;",
        "}",
    )))

    @triton.jit
    def _table_words(s, EXACT_FP32: tl.constexpr):
        """Block scales s (fp32, 0 or 2^-125 <= |s| < 4: `packed.scales_in_normal_range`) as their tables' four words
        (`_TABLE_ASM`): entries t0..t7 = (S's signed zero, A/2, A, B, 2A, 2B, 4A, 4B) as bf16 bits, two a word; for
        s = +-0 every entry s's signed zero."""
        if EXACT_FP32:  # bf16 values held in fp32: their top 16 bits
            a = (_bf16_value(s, EXACT_FP32).to(tl.int32, bitcast=True) >> 16) & 0xFFFF
            b = (_bf16_value(s * 1.5, EXACT_FP32).to(tl.int32, bitcast=True) >> 16) & 0xFFFF
        else:
            a = s.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            b = (s * 1.5).to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        ab = a | (b << 16)
        zero = (a & 0x8000) * 0x10001  # S's signed zero in both entries (every entry of a zero scale's table)
        nz = s != 0.0
        # a power of two times a bf16 normal: its exponent field plus that power (no carry into the sign or the
        # other entry: A / 2 normal, 4B finite in the range)
        w0 = tl.where(nz, ((a - 128) << 16) | (a & 0x8000), zero)
        w2 = tl.where(nz, ab + 0x00800080, zero)
        w3 = tl.where(nz, ab + 0x01000100, zero)
        return w0, ab, w2, w3

    @triton.jit
    def _table_element(words, w0, w1, w2, w3, J: tl.constexpr):
        """Element 8w + J of each word through its block's table words, by integer operations (the interpreter's form
        of `_TABLE_ASM`): entry `code` of the table, its sign flipped by the nibble's; the bf16 value held in fp32."""
        code = (words >> (4 * J)) & 7
        pair = tl.where(code < 2, w0, tl.where(code < 4, w1, tl.where(code < 6, w2, w3)))
        entry = (pair >> ((code & 1) * 16)) & 0xFFFF
        bits = entry ^ (((words >> (4 * J + 3)) & 1) << 15)
        return (bits << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _table_planes(words, w0, w1, w2, w3, EXACT_FP32: tl.constexpr):
        """The 8 elements of each int32 word of NVFP4 bytes (plane j: element 8w + j) through their block's table words
        w0..w3 (`_table_words`, one set a word): bf16 by `_TABLE_ASM`, or with EXACT_FP32 (the interpreter, which has
        no inline assembly) `_table_element`'s bf16 values held in fp32."""
        if EXACT_FP32:
            p0, p1 = _table_element(words, w0, w1, w2, w3, 0), _table_element(words, w0, w1, w2, w3, 1)
            p2, p3 = _table_element(words, w0, w1, w2, w3, 2), _table_element(words, w0, w1, w2, w3, 3)
            p4, p5 = _table_element(words, w0, w1, w2, w3, 4), _table_element(words, w0, w1, w2, w3, 5)
            p6, p7 = _table_element(words, w0, w1, w2, w3, 6), _table_element(words, w0, w1, w2, w3, 7)
        else:
            p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
                _TABLE_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", [words, w0, w1, w2, w3], dtype=(tl.bfloat16,) * 8,
                is_pure=True, pack=1)
        return p0, p1, p2, p3, p4, p5, p6, p7

    @triton.jit
    def _nvfp4_table_tile(w_rows, sc, g, ks, n_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          EXACT_FP32: tl.constexpr):
        """`_nvfp4_tile` through the blocks' tables (`_table_planes`): the same bf16 bits, no multiply or conversion an
        element."""
        BLOCKS: tl.constexpr = BLOCK_K // 16
        words = _step_words(w_rows, ks, n_ok, BLOCK_K // 8)
        w0, w1, w2, w3 = _table_words(_e4m3_value(sc, EXACT_FP32) * g, EXACT_FP32)  # the reference's block scale
        w0 = _broadcast_blocks(w0, BLOCK_N, BLOCKS, 2)  # [BN, WORDS]: each word's block
        w1 = _broadcast_blocks(w1, BLOCK_N, BLOCKS, 2)
        w2 = _broadcast_blocks(w2, BLOCK_N, BLOCKS, 2)
        w3 = _broadcast_blocks(w3, BLOCK_N, BLOCKS, 2)
        p0, p1, p2, p3, p4, p5, p6, p7 = _table_planes(words, w0, w1, w2, w3, EXACT_FP32)
        even = tl.join(tl.join(p0, p4), tl.join(p2, p6))
        odd = tl.join(tl.join(p1, p5), tl.join(p3, p7))
        return tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_K))

    @triton.jit
    def _mxfp8_tile(w_rows, sc, ks, n_ok, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EXACT_FP32: tl.constexpr):
        """Step `ks` of a packed MXFP8 weight decoded, as `_nvfp4_tile` (E8M0 scale codes, BLOCK_K / 32 a row; no
        global)."""
        BLOCKS8: tl.constexpr = BLOCK_K // 32  # E8M0 scales a step (8 words each)
        words = _step_words(w_rows, ks, n_ok, BLOCK_K // 4)  # 4 E4M3 bytes a word
        # E8M0 code c -> 2^(c - 127) on the bits (c >= 1 in the normal range), for each word
        scale = _broadcast_blocks((sc << 23).to(tl.float32, bitcast=True), BLOCK_N, BLOCKS8, 8)
        # byte i of word w is element 4w + i: exact products (an E4M3 value times a power of two in range has at most
        # 4 significant bits), interleaved back into K order as NVFP4's planes are
        return tl.reshape(tl.join(tl.join(_e4m3_byte(words, scale, 0, EXACT_FP32),
                                          _e4m3_byte(words, scale, 2, EXACT_FP32)),
                                  tl.join(_e4m3_byte(words, scale, 1, EXACT_FP32),
                                          _e4m3_byte(words, scale, 3, EXACT_FP32))), (BLOCK_N, BLOCK_K))

    @triton.jit
    def _decoded_tile(w_rows, sc, g, ks, n_ok, NVFP4_FMT: tl.constexpr, TABLE: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, EXACT_FP32: tl.constexpr):
        """Step `ks` of a packed weight decoded by its format's tile decoder (NVFP4 through the blocks' tables with
        TABLE); sc: the step's scale codes (`_step_scales`: BLOCK_K / 16 a row NVFP4, / 32 MXFP8), g: NVFP4's
        global scale (MXFP8: unread)."""
        if NVFP4_FMT and TABLE:
            return _nvfp4_table_tile(w_rows, sc, g, ks, n_ok, BLOCK_N, BLOCK_K, EXACT_FP32)
        elif NVFP4_FMT:
            return _nvfp4_tile(w_rows, sc, g, ks, n_ok, BLOCK_N, BLOCK_K, EXACT_FP32)
        else:
            return _mxfp8_tile(w_rows, sc, ks, n_ok, BLOCK_N, BLOCK_K, EXACT_FP32)

    @triton.jit
    def _plane_dot(acc, plane, x_rows, ks, P: tl.constexpr, m_ok, W: tl.constexpr, BLOCK_K: tl.constexpr,
                   EXACT_FP32: tl.constexpr):
        """acc + plane @ x's plane-P columns of step `ks`: plane [BLOCK_N, W] (element 8w + P or 4w + P of each word
        w, W = BLOCK_K / 8 or / 4), x permuted within each step so that those columns are its W contiguous ones from
        P * W (`_permute_x`)."""
        jw = tl.arange(0, W)
        b = _x_operand(x_rows + ks * BLOCK_K + P * W + jw[:, None], m_ok[None, :], EXACT_FP32)  # [W, BLOCK_M]
        if EXACT_FP32:
            return tl.dot(plane, b, acc, input_precision="ieee")
        else:
            return tl.dot(plane, b, acc)

    @triton.jit
    def _planes_step(acc, x_rows, w_rows, s_rows, g_ptr, ks, n_ok, m_ok, NVFP4_FMT: tl.constexpr, TABLE: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EXACT_FP32: tl.constexpr):
        """acc + step `ks`'s products as one dot per plane (`Tiles.planes`): plane P, the elementwise decoding of
        nibble (NVFP4) or byte (MXFP8) P of every word [BLOCK_N, W], times the x columns of those elements
        (`_plane_dot`). The same exact products as the interleaved tile, summed in another order. With no join or
        reshape between the words and the dot, Triton (3.6) converts the packed words, not the decoded bf16, to the
        MMA's register operand layout, so the decoded tile does not pass through shared memory (benchmarks/
        kernel_sass.py). That hoisting of the conversion needs every input of the decoding to be a load of the step:
        a loop-carried value or a splat of a scalar stops it, so the scales are loaded in the step (not a step
        ahead) and NVFP4's global scale is loaded as a tile."""
        if NVFP4_FMT:
            BLOCKS: tl.constexpr = BLOCK_K // 16
            W: tl.constexpr = BLOCK_K // 8
            words = _step_words(w_rows, ks, n_ok, W)
            sc = _step_scales(s_rows, ks, n_ok, BLOCKS)
            g = tl.load(g_ptr + tl.zeros((BLOCK_N, BLOCKS), dtype=tl.int32))  # every element the global scale
            s = _e4m3_value(sc, EXACT_FP32) * g  # the reference's block scale (one rounding)
            if TABLE:
                w0, w1, w2, w3 = _table_words(s, EXACT_FP32)
                w0 = _broadcast_blocks(w0, BLOCK_N, BLOCKS, 2)
                w1 = _broadcast_blocks(w1, BLOCK_N, BLOCKS, 2)
                w2 = _broadcast_blocks(w2, BLOCK_N, BLOCKS, 2)
                w3 = _broadcast_blocks(w3, BLOCK_N, BLOCKS, 2)
                p0, p1, p2, p3, p4, p5, p6, p7 = _table_planes(words, w0, w1, w2, w3, EXACT_FP32)
                acc = _plane_dot(acc, p0, x_rows, ks, 0, m_ok, W, BLOCK_K, EXACT_FP32)
                acc = _plane_dot(acc, p1, x_rows, ks, 1, m_ok, W, BLOCK_K, EXACT_FP32)
                acc = _plane_dot(acc, p2, x_rows, ks, 2, m_ok, W, BLOCK_K, EXACT_FP32)
                acc = _plane_dot(acc, p3, x_rows, ks, 3, m_ok, W, BLOCK_K, EXACT_FP32)
                acc = _plane_dot(acc, p4, x_rows, ks, 4, m_ok, W, BLOCK_K, EXACT_FP32)
                acc = _plane_dot(acc, p5, x_rows, ks, 5, m_ok, W, BLOCK_K, EXACT_FP32)
                acc = _plane_dot(acc, p6, x_rows, ks, 6, m_ok, W, BLOCK_K, EXACT_FP32)
                acc = _plane_dot(acc, p7, x_rows, ks, 7, m_ok, W, BLOCK_K, EXACT_FP32)
            else:
                scale = _broadcast_blocks(s * 8.507059173023462e37, BLOCK_N, BLOCKS, 2)  # times 2^126 (`_nibble`)
                for p in tl.static_range(8):
                    acc = _plane_dot(acc, _nibble(words, scale, p, EXACT_FP32), x_rows, ks, p, m_ok, W, BLOCK_K,
                                     EXACT_FP32)
        else:
            BLOCKS8: tl.constexpr = BLOCK_K // 32
            W: tl.constexpr = BLOCK_K // 4
            words = _step_words(w_rows, ks, n_ok, W)
            sc = _step_scales(s_rows, ks, n_ok, BLOCKS8)
            scale = _broadcast_blocks((sc << 23).to(tl.float32, bitcast=True), BLOCK_N, BLOCKS8, 8)  # 2^(c - 127)
            for p in tl.static_range(4):
                acc = _plane_dot(acc, _e4m3_byte(words, scale, p, EXACT_FP32), x_rows, ks, p, m_ok, W, BLOCK_K,
                                 EXACT_FP32)
        return acc

    @triton.jit
    def _packed_matmul_kernel(
        x_ptr, w_ptr, s_ptr, g_ptr, active_ptr, y_ptr,
        M, N, K_STEPS, STEPS_PER_SPLIT,
        stride_xe, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge,
        stride_ys, stride_ye, stride_ym,
        NVFP4_FMT: tl.constexpr, HAS_ACTIVE: tl.constexpr, OUT_BF16: tl.constexpr, EXACT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TABLE: tl.constexpr,
        X_MAJOR: tl.constexpr, PLANES: tl.constexpr,
    ):
        """y[split, e, m, n] = sum over this split's K steps of x[e, m, k] * w_hat[e, n, k] (fp32 accumulation),
        w_hat the decoded weight in bf16 (`packed_matmul_grouped`). Grid: (column tiles, entries, splits)."""
        pid_n = tl.program_id(0)
        e = tl.program_id(1).to(tl.int64)  # as `_decode_kernel`: entry offsets in int64
        sid = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        n_ok = offs_n < N
        m_ok = offs_m < M
        k_lo = sid * STEPS_PER_SPLIT
        k_hi = tl.minimum(k_lo + STEPS_PER_SPLIT, K_STEPS)
        if HAS_ACTIVE:
            # an entry no row uses reads nothing and writes zeros
            if tl.load(active_ptr + e) == 0:
                k_hi = k_lo
        w_rows = w_ptr + e * stride_we + offs_n[:, None] * stride_wn  # [BLOCK_N, 1]
        s_rows = s_ptr + e * stride_se + offs_n[:, None] * stride_sn
        jk = tl.arange(0, BLOCK_K)
        g = tl.load(g_ptr + e * stride_ge)  # NVFP4's global (MXFP8: an unread one)
        if X_MAJOR:  # y = x W^T: x's rows are the MMA's M side, the decoded tile its shared-memory operand
            x_rows = x_ptr + e * stride_xe + offs_m[:, None] * stride_xm  # [BLOCK_M, 1]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:  # y^T = W x^T: the weight's rows are the M side, the decoded tile the register operand
            x_rows = x_ptr + e * stride_xe + offs_m[None, :] * stride_xm  # [1, BLOCK_M]
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        BLOCKS: tl.constexpr = BLOCK_K // 16 if NVFP4_FMT else BLOCK_K // 32  # block scales a row a step
        if PLANES:  # one product per plane of the words (`_planes_step`; x_major 0)
            for ks in range(k_lo, k_hi):
                acc = _planes_step(acc, x_rows, w_rows, s_rows, g_ptr + e * stride_ge, ks, n_ok, m_ok, NVFP4_FMT,
                                   TABLE, BLOCK_N, BLOCK_K, EXACT_FP32)
        else:
            # the scales one step ahead (software pipelining by hand: the compiler pipelines only the words, which
            # feed the dot; a step's scales loaded at its start would make every step wait for memory before
            # decoding)
            sc_next = _step_scales(s_rows, k_lo, n_ok & (k_lo < k_hi), BLOCKS)
            for ks in range(k_lo, k_hi):
                sc = sc_next
                sc_next = _step_scales(s_rows, ks + 1, n_ok & (ks + 1 < k_hi), BLOCKS)
                w = _decoded_tile(w_rows, sc, g, ks, n_ok, NVFP4_FMT, TABLE, BLOCK_N, BLOCK_K, EXACT_FP32)
                if X_MAJOR:
                    a = _x_operand(x_rows + ks * BLOCK_K + jk[None, :], m_ok[:, None], EXACT_FP32)  # [BM, BK]
                    b = tl.trans(w)
                else:
                    a = w
                    b = _x_operand(x_rows + ks * BLOCK_K + jk[:, None], m_ok[None, :], EXACT_FP32)  # [BK, BM]
                if EXACT_FP32:
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
        if X_MAJOR:
            y_ptrs = y_ptr + sid * stride_ys + e * stride_ye + offs_m[:, None] * stride_ym + offs_n[None, :]
            mask = m_ok[:, None] & n_ok[None, :]
        else:
            y_ptrs = y_ptr + sid * stride_ys + e * stride_ye + offs_m[None, :] * stride_ym + offs_n[:, None]
            mask = n_ok[:, None] & m_ok[None, :]
        if OUT_BF16:
            tl.store(y_ptrs, _bf16_storable(acc, EXACT_FP32), mask=mask)
        else:
            tl.store(y_ptrs, acc, mask=mask)

    @triton.jit
    def _swiglu_pair_kernel(
        x_ptr, gw_ptr, gs_ptr, gg_ptr, uw_ptr, us_ptr, ug_ptr, active_ptr, h_ptr,
        M, N, K_STEPS, alpha, limit,
        stride_xm, stride_gwe, stride_gwn, stride_gse, stride_gsn, stride_gge,
        stride_uwe, stride_uwn, stride_use, stride_usn, stride_uge, stride_he, stride_hm,
        NVFP4_FMT: tl.constexpr, HAS_ACTIVE: tl.constexpr, EXACT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TABLE: tl.constexpr,
    ):
        """h[e, m, n] = swiglu(bf16(x w_gate[e]^T), bf16(x w_up[e]^T))[m, n] (`swiglu_pair_grouped`): the two
        products of a tile of output columns in one program, x's step tile loaded once for both. Grid: (column
        tiles, entries)."""
        pid_n = tl.program_id(0)
        e = tl.program_id(1).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        n_ok = offs_n < N
        m_ok = offs_m < M
        k_hi = K_STEPS
        if HAS_ACTIVE:
            if tl.load(active_ptr + e) == 0:  # no row uses the entry: nothing read, zeros written (swiglu(0, 0))
                k_hi = 0
        gw_rows = gw_ptr + e * stride_gwe + offs_n[:, None] * stride_gwn
        gs_rows = gs_ptr + e * stride_gse + offs_n[:, None] * stride_gsn
        uw_rows = uw_ptr + e * stride_uwe + offs_n[:, None] * stride_uwn
        us_rows = us_ptr + e * stride_use + offs_n[:, None] * stride_usn
        gg = tl.load(gg_ptr + e * stride_gge)
        ug = tl.load(ug_ptr + e * stride_uge)
        x_rows = x_ptr + offs_m[None, :] * stride_xm  # [1, BLOCK_M]: x^T's columns, shared by every entry
        jk = tl.arange(0, BLOCK_K)
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        BLOCKS: tl.constexpr = BLOCK_K // 16 if NVFP4_FMT else BLOCK_K // 32
        gsc_next = _step_scales(gs_rows, 0, n_ok & (0 < k_hi), BLOCKS)  # a step ahead, as `_packed_matmul_kernel`
        usc_next = _step_scales(us_rows, 0, n_ok & (0 < k_hi), BLOCKS)
        for ks in range(0, k_hi):
            gsc, usc = gsc_next, usc_next
            gsc_next = _step_scales(gs_rows, ks + 1, n_ok & (ks + 1 < k_hi), BLOCKS)
            usc_next = _step_scales(us_rows, ks + 1, n_ok & (ks + 1 < k_hi), BLOCKS)
            b = _x_operand(x_rows + ks * BLOCK_K + jk[:, None], m_ok[None, :], EXACT_FP32)  # [BK, BM]
            wg = _decoded_tile(gw_rows, gsc, gg, ks, n_ok, NVFP4_FMT, TABLE, BLOCK_N, BLOCK_K, EXACT_FP32)
            wu = _decoded_tile(uw_rows, usc, ug, ks, n_ok, NVFP4_FMT, TABLE, BLOCK_N, BLOCK_K, EXACT_FP32)
            if EXACT_FP32:
                acc_g = tl.dot(wg, b, acc_g, input_precision="ieee")
                acc_u = tl.dot(wu, b, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(wg, b, acc_g)
                acc_u = tl.dot(wu, b, acc_u)
        # the products rounded to bf16 as their own launches would store them, the activation in fp32
        gate = tl.minimum(_bf16_value(acc_g, EXACT_FP32).to(tl.float32), limit)
        up = tl.minimum(tl.maximum(_bf16_value(acc_u, EXACT_FP32).to(tl.float32), -limit), limit)
        h = (up + 1.0) * (gate * tl.sigmoid(alpha * gate))
        h_ptrs = h_ptr + e * stride_he + offs_m[None, :] * stride_hm + offs_n[:, None]
        tl.store(h_ptrs, _bf16_storable(h, EXACT_FP32), mask=n_ok[:, None] & m_ok[None, :])

    @triton.jit
    def _decode_kernel(w_ptr, s_ptr, g_ptr, y_ptr, N, stride_we, stride_wn, stride_se, stride_sn, stride_ge,
                       stride_ye, stride_yn, NVFP4_FMT: tl.constexpr, EXACT_FP32: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TABLE: tl.constexpr):
        """y[e, n, k] = w_hat[e, n, k] in bf16, one tile a program. Grid: (column tiles, entries, K steps)."""
        pid_n = tl.program_id(0)
        e = tl.program_id(1).to(tl.int64)  # a stack's entry offsets pass 2^31 elements (128 release experts)
        ks = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_rows = w_ptr + e * stride_we + offs_n[:, None] * stride_wn
        s_rows = s_ptr + e * stride_se + offs_n[:, None] * stride_sn
        BLOCKS: tl.constexpr = BLOCK_K // 16 if NVFP4_FMT else BLOCK_K // 32  # block scales a row a step
        sc = _step_scales(s_rows, ks, n_ok, BLOCKS)
        w = _decoded_tile(w_rows, sc, tl.load(g_ptr + e * stride_ge), ks, n_ok, NVFP4_FMT, TABLE, BLOCK_N, BLOCK_K,
                          EXACT_FP32)
        offs_k = ks * BLOCK_K + tl.arange(0, BLOCK_K)
        y_ptrs = y_ptr + e * stride_ye + offs_n[:, None] * stride_yn + offs_k[None, :]
        if EXACT_FP32:  # bf16 values held in fp32: their bits
            tl.store(y_ptrs, _bf16_storable(w, EXACT_FP32), mask=n_ok[:, None])
        else:
            tl.store(y_ptrs, w, mask=n_ok[:, None])

    @triton.jit
    def _sum_splits_kernel(parts_ptr, out_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                           EXACT_FP32: tl.constexpr):
        """out[i] = bf16((parts[0, i] + parts[1, i]) + ... + parts[SPLIT - 1, i]): the K splits' fp32 partial sums
        added in split order in fp32 and rounded once (nearest, ties to even). A kernel of its own, not a `sum`, so
        that eager calls and compiled regions add in the same order (inductor would reorder a reduction)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < numel
        acc = tl.load(parts_ptr + offs, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(parts_ptr + s * numel + offs, mask=ok, other=0.0)
        tl.store(out_ptr + offs, _bf16_storable(acc, EXACT_FP32), mask=ok)

    @triton_op("minimax_ref::packed_matmul_grouped", mutates_args=())
    def _grouped_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                    active: torch.Tensor | None, nvfp4: bool, n: int, block_n: int, block_k: int, num_warps: int,
                    num_stages: int, split: int, exact_fp32: bool, table: bool = False,
                    x_major: bool = False, planes: bool = False) -> torch.Tensor:
        """The launch (see `packed_matmul_grouped`): x bf16 `[Ex, M, K]` (Ex 1: shared by every entry), weight int32
        `[E, N, K/8]` (NVFP4's packed bytes as little-endian words) or `[E, N, K/4]` (MXFP8's E4M3 bytes), scale
        uint8 `[E, N, K/16 or K/32]`, scale_2 fp32 `[E]` or `[1]` (NVFP4's global; unused for MXFP8), active int32
        `[E]` or None; planes: one product per plane (`_planes_step`, x permuted here by `_permute_x`). Returns bf16
        `[E, M, N]`."""
        e, m, k = weight.shape[0], x.shape[1], x.shape[2]
        if planes:
            x = _permute_x(x, block_k, 8 if nvfp4 else 4)
        k_steps = k // block_k
        per = -(-k_steps // split)
        # one split: the kernel rounds to bf16 and stores the result; several: their fp32 partial sums
        shape = (e, m, n) if split == 1 else (split, e, m, n)
        out = torch.empty(shape, dtype=torch.bfloat16 if split == 1 else torch.float32, device=x.device)
        stride_s = 0 if split == 1 else out.stride(0)
        grid = (triton.cdiv(n, block_n), e, split)
        wrap_triton(_packed_matmul_kernel)[grid](
            x, weight, scale, scale_2, weight if active is None else active, out,
            m, n, k_steps, per,
            x.stride(0) if x.shape[0] > 1 else 0, x.stride(1), weight.stride(0), weight.stride(1), scale.stride(0),
            scale.stride(1), 1 if scale_2.numel() > 1 else 0,
            stride_s, out.stride(-3), out.stride(-2),
            NVFP4_FMT=nvfp4, HAS_ACTIVE=active is not None, OUT_BF16=split == 1, EXACT_FP32=exact_fp32,
            BLOCK_M=max(64 if x_major else 16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
            TABLE=table, X_MAJOR=x_major, PLANES=planes, num_warps=num_warps, num_stages=num_stages)
        if split == 1:
            return out
        y = torch.empty((e, m, n), dtype=torch.bfloat16, device=x.device)
        wrap_triton(_sum_splits_kernel)[(triton.cdiv(y.numel(), 1024),)](out, y, y.numel(), SPLIT=split, BLOCK=1024,
                                                                          EXACT_FP32=exact_fp32)
        return y


    @triton_op("minimax_ref::swiglu_pair_grouped", mutates_args=())
    def _swiglu_pair_op(x: torch.Tensor, gate_words: torch.Tensor, gate_scale: torch.Tensor, gate_g: torch.Tensor,
                        up_words: torch.Tensor, up_scale: torch.Tensor, up_g: torch.Tensor,
                        active: torch.Tensor | None, nvfp4: bool, n: int, alpha: float, limit: float, block_n: int,
                        block_k: int, num_warps: int, num_stages: int, exact_fp32: bool,
                        table: bool = False) -> torch.Tensor:
        """The launch (see `swiglu_pair_grouped`): x bf16 `[M, K]`, each stack as `_grouped_op` takes its weight.
        Returns bf16 `[E, M, N]`."""
        e, m, k = gate_words.shape[0], x.shape[0], x.shape[1]
        h = torch.empty((e, m, n), dtype=torch.bfloat16, device=x.device)
        wrap_triton(_swiglu_pair_kernel)[(triton.cdiv(n, block_n), e)](
            x, gate_words, gate_scale, gate_g, up_words, up_scale, up_g,
            gate_words if active is None else active, h, m, n, k // block_k, alpha, limit,
            x.stride(0), gate_words.stride(0), gate_words.stride(1), gate_scale.stride(0), gate_scale.stride(1),
            1 if gate_g.numel() > 1 else 0, up_words.stride(0), up_words.stride(1), up_scale.stride(0),
            up_scale.stride(1), 1 if up_g.numel() > 1 else 0, h.stride(0), h.stride(1),
            NVFP4_FMT=nvfp4, HAS_ACTIVE=active is not None, EXACT_FP32=exact_fp32,
            BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, TABLE=table,
            num_warps=num_warps, num_stages=num_stages)
        return h


if AVAILABLE:
    @triton_op("minimax_ref::decode_grouped", mutates_args=())
    def _decode_op(words: torch.Tensor, scale: torch.Tensor, g: torch.Tensor, k: int, nvfp4: bool, block_n: int,
                   block_k: int, num_warps: int, exact_fp32: bool, table: bool = False) -> torch.Tensor:
        """The launch (see `decode_grouped`): words int32 `[E, N, K/8 or K/4]`, scale uint8, g fp32 `[E]` or `[1]`.
        Returns bf16 `[E, N, K]`."""
        e, n = words.shape[0], words.shape[1]
        y = torch.empty((e, n, k), dtype=torch.bfloat16, device=words.device)
        grid = (triton.cdiv(n, block_n), e, k // block_k)
        wrap_triton(_decode_kernel)[grid](
            words, scale, g, y, n, words.stride(0), words.stride(1), scale.stride(0), scale.stride(1),
            1 if g.numel() > 1 else 0, y.stride(0), y.stride(1),
            NVFP4_FMT=nvfp4, EXACT_FP32=exact_fp32, BLOCK_N=block_n, BLOCK_K=block_k, TABLE=table and nvfp4,
            num_warps=num_warps)
        return y


def decode_grouped(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                   weight_scale_2: torch.Tensor | None, tiles: Tiles | None = None, table: bool = False
                   ) -> torch.Tensor:
    """`decode_reference(fmt, weight, weight_scale, weight_scale_2).to(bfloat16)`, bit for bit, by one Triton kernel
    that reads the packed bytes and scales once and writes the bf16 weight once (the tile decoding of
    `packed_matmul_grouped`). weight, weight_scale, weight_scale_2: a packed linear `[N, K]` or stack `[E, N, K]` whose
    scales pass `scales_in_normal_range` and, MXFP8, with no E4M3 NaN byte (the caller checks both once), K a multiple
    of 32. table: NVFP4 through each block's table (`_TABLE_ASM`: the same bits, fewer instructions an element).
    Returns bf16 `[N, K]` or `[E, N, K]`. Static in the shapes (no host synchronisation)."""
    if not AVAILABLE:
        raise RuntimeError("decode_grouped needs triton")
    linear, words, scale, g = _packed_operands(fmt, weight, weight_scale, weight_scale_2)
    nvfp4 = fmt == NVFP4
    k = weight.shape[-1] * (2 if nvfp4 else 1)
    if not supports(fmt, k):
        raise ValueError(f"decode_grouped: {fmt} {list(weight.shape)}")
    tiles = tiles or tiles_for(fmt, weight.device)
    y = torch.ops.minimax_ref.decode_grouped(words, scale, g, k, nvfp4, tiles.block_n, _fit_block_k(tiles, k),
                                             tiles.num_warps, _INTERPRET, table)
    return y[0] if linear else y


def _packed_operands(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2: torch.Tensor | None) -> tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed linear `[N, K]` or stack `[E, N, K]` as the kernels read it: (whether a linear, the packed bytes as
    int32 words `[E, N, K/8 or K/4]` (8 NVFP4 or 4 MXFP8 elements a load; little-endian: byte i of a word is its bits
    8i..8i+7), the block scale codes uint8 `[E, N, K/16 or K/32]`, the global scale fp32 `[E]` or `[1]` (MXFP8: an
    unread one))."""
    linear = weight.dim() == 2
    if linear:
        weight, weight_scale = weight.unsqueeze(0), weight_scale.unsqueeze(0)
    if fmt == NVFP4:
        g = weight_scale_2.reshape(-1).to(torch.float32)
    else:
        g = torch.ones(1, dtype=torch.float32, device=weight.device)
    return linear, weight.view(torch.int32), weight_scale.view(torch.uint8), g


def packed_matmul_grouped(x: torch.Tensor, fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                          weight_scale_2: torch.Tensor | None, active: torch.Tensor | None = None,
                          tiles: Tiles | None = None, split: int | None = None, table: bool = False) -> torch.Tensor:
    """`x @ w_hat^T` for a packed weight, its decoding inside the Triton kernel (one launch).

    x: bf16 `[M, K]` (shared by every entry) or `[E, M, K]` (one per entry), 1 <= M <= `MAX_ROWS`. weight,
    weight_scale, weight_scale_2: a packed linear `[N, K]` or stack `[E, N, K]` as in `packed.decode_reference`
    (NVFP4's global `()` or `[E]`), whose scales pass `scales_in_normal_range` and, MXFP8, with no E4M3 NaN byte (the
    caller checks both once). active: None, or int32 `[E]`: entries flagged 0 are not read and give zero rows.
    Returns bf16 `[M, N]` for a linear with a 2-D x, else `[E, M, N]`:

        y[e, m, n] = bf16( sum_k x[e, m, k] * w_hat[e, n, k] )

    with `w_hat = decode_reference(...).to(bfloat16)` bit for bit, every product exact in fp32 (two bf16 values), the
    sum accumulated in fp32 in an unspecified order (tensor-core blocks, then the K splits added in split order by a
    second kernel) and rounded once to bf16; eager calls and compiled regions give the same bits. Tensor cores may
    align the addends of a block by truncation, so the bound the tests use is that of fp32 summation with twice the
    unit roundoff: |y - exact| <= gamma_K(2u) * sum_k |x w_hat| before the final rounding.

    tiles: the launch configuration (default `tiles_for`); split: splits of K (default `split_for` on this GPU's SM
    count). table: NVFP4 decoded through each block's 8-value table (`_TABLE_ASM`; the same bits); MXFP8 ignores
    it. Static in the shapes: no host synchronisation, capturable in a CUDA graph, and `torch.compile` launches it
    as an opaque Triton kernel.
    """
    if not AVAILABLE:
        raise RuntimeError("packed_matmul_grouped needs triton")
    linear, words, scale, g = _packed_operands(fmt, weight, weight_scale, weight_scale_2)
    xs = x.unsqueeze(0) if x.dim() == 2 else x
    e, n = words.shape[0], words.shape[1]
    m, k = xs.shape[1], xs.shape[2]
    if x.dtype != torch.bfloat16 or not 1 <= m <= MAX_ROWS or not supports(fmt, k) or xs.shape[0] not in (1, e):
        raise ValueError(f"packed_matmul_grouped: x {list(x.shape)} {x.dtype} against {fmt} {list(weight.shape)}")
    tiles = tiles or tiles_for(fmt, x.device)
    block_k = _fit_block_k(tiles, k)
    k_steps = k // block_k
    if split is None:
        split = split_for(e * triton.cdiv(n, tiles.block_n), k_steps, sm_count(x.device))
    split = max(1, min(split, k_steps))
    split = -(-k_steps // -(-k_steps // split))  # no empty split
    # planes need 16 words a step (tl.dot's least K): otherwise (a short K) the interleaved tile, the same contract
    planes = bool(tiles.planes) and plane_width(fmt, block_k) >= 16
    y = torch.ops.minimax_ref.packed_matmul_grouped(
        xs.contiguous(), words, scale, g, None if active is None else active.to(torch.int32), fmt == NVFP4, n,
        tiles.block_n, block_k, tiles.num_warps, tiles.num_stages, split, _INTERPRET, table, bool(tiles.x_major),
        planes)
    return y[0] if linear and x.dim() == 2 else y


def swiglu_pair_grouped(x: torch.Tensor, fmt: str, gate: tuple, up: tuple, alpha: float, limit: float,
                        active: torch.Tensor | None = None, tiles: Tiles | None = None,
                        table: bool = False) -> torch.Tensor:
    """`swiglu_oai(packed_matmul_grouped(x, *gate), packed_matmul_grouped(x, *up), alpha, limit)` in one launch: each
    program multiplies x by a tile of both stacks (x's step tile loaded once for the two) and stores the activation,
    not the products.

    x: bf16 `[M, K]`, shared by every entry; gate, up: (weight, weight_scale, weight_scale_2) of two stacks `[E, N, K]`
    of format `fmt` as `packed_matmul_grouped` takes them; active: int32 `[E]` or None (unflagged entries read nothing
    and give zero rows). Returns bf16 `[E, M, N]`.

    Contract: each product is `packed_matmul_grouped`'s at one K split (fp32 sums of exact products in an unspecified
    order, rounded once to bf16: the bound of that docstring); then, in fp32 from those bf16 values, gate clamped
    above at `limit`, up to [-limit, limit], `(up + 1) * (gate * sigmoid(alpha * gate))`, rounded once to bf16: what
    the compiled step's fused SwiGLU computes from the two bf16 products (the eager reference rounds each bf16 op).
    """
    if not AVAILABLE:
        raise RuntimeError("swiglu_pair_grouped needs triton")
    _, gw, gs, gg = _packed_operands(fmt, *gate)
    _, uw, us, ug = _packed_operands(fmt, *up)
    m, k = x.shape
    n = gw.shape[1]
    if (x.dtype != torch.bfloat16 or not 1 <= m <= MAX_ROWS or not supports(fmt, k) or gate[0].dim() != 3
            or gw.shape != uw.shape or gs.shape != us.shape or gw.shape[-1] * (8 if fmt == NVFP4 else 4) != k):
        raise ValueError(f"swiglu_pair_grouped: x {list(x.shape)} {x.dtype} against {fmt} stacks "
                         f"{list(gate[0].shape)} and {list(up[0].shape)}")
    tiles = tiles or tiles_for(fmt, x.device)
    return torch.ops.minimax_ref.swiglu_pair_grouped(
        x.contiguous(), gw, gs, gg, uw, us, ug, None if active is None else active.to(torch.int32), fmt == NVFP4, n,
        float(alpha), float(limit), tiles.block_n, _fit_block_k(tiles, k), tiles.num_warps, tiles.num_stages,
        _INTERPRET, table and fmt == NVFP4)
