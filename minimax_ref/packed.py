"""Packed weights: NVFP4 / MXFP8 linears kept as stored and decoded at use (`load_model(weights="packed")`).

Decoding everything at load costs 2 bytes per weight in bf16 (544 GB for the 80-expert build); kept packed,
a weight costs what it costs on disk (0.5625 bytes in NVFP4, 1.03125 in MXFP8), and each forward decodes
the layer it is running, or only the routed experts that received tokens.

`PackedWeight` holds one linear's tensors under their checkpoint names (`weight`, `weight_scale`, and for
NVFP4 `weight_scale_2`), or a stack of them for routed experts (a leading expert dimension; one
`weight_scale_2` per expert). Under tensor parallelism they are the rank's slices, cut from the packed
bytes and their block scales together (`read_packed`), exactly as `Checkpoint.read_linear` cuts them.

Contract: `PackedWeight.decode()` returns, bit for bit, what `weights="dequant"` stores:
`quant.dequant_nvfp4/mxfp8(...)` (float32) cast to the compute dtype. Three decoders compute it:

* `decode_reference` (the default): `quant.dequant_nvfp4/mxfp8`'s float32 operations in the same order,
  without their input checks, which synchronise with the host (the loader runs the checks once instead);
* `decode_fast` (`FastPaths(decode="fast")`): two passes instead of about eight, and fewer kernels. A
  byte-to-pair lookup gives both E2M1 values of a byte (exact in bf16 and fp32; E8M0 scales come from a
  256-entry table too), and one multiplication by the fp32 block scale writes the compute dtype.
  PyTorch computes a mixed bf16 x fp32 product in fp32 and rounds it once on store, so the result is the
  reference's fp32 product rounded to the compute dtype;
* `decode_compiled` (`decode="compile"`): `torch.compile` of the reference operations, fused into one
  kernel that reads the packed bytes and writes the compute dtype.

tests/test_packed.py checks all three against `quant.dequant_*` on every code and byte value.

Fused dequantize-and-multiply (`FastPaths(matmul="fused")`, for decode-size inputs): `packed_matmul` is
`x @ w_hat^T` written so that `torch.compile` fuses the decoding into the reduction over K: one kernel reads
the packed bytes and scales and accumulates in fp32, and no decoded weight is ever written
(`packed_matmul_fused` compiles it; `packed_matmul_reference`, decode then `torch.matmul`, is what it
replaces). tests/test_fused.py checks it against float64 sums of `quant.dequant_*`. The decoding inside the sum
is `decoded_planes`, or, for weights whose scales keep every product in the normal fp32 range (checked once per
`PackedWeight`, `scales_in_normal_range`), `normal_range_planes`: the same bits in about half the operations, which
is what bounds the fused product on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import MXFP8, NVFP4, Checkpoint
from .errors import CheckpointError, QuantFormatError
from .fast import FUSED_ROWS
from .quant import E2M1_MAGNITUDES, MXFP8_BLOCK, NVFP4_BLOCK, _pow2_f32, dequant_mxfp8, dequant_nvfp4, unpack_fp4

# E2M1 value of each 4-bit code (code 8 is -0.0), and of both codes of each byte (low nibble first).
_E2M1_VALUES = torch.cat([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])
_E2M1_PAIRS = torch.stack((_E2M1_VALUES[torch.arange(256) & 0x0F], _E2M1_VALUES[torch.arange(256) >> 4]), dim=-1)

# Lookup tables live on the device they are used on, made once: copying a CPU table at every decode
# would synchronise with the host (and cannot happen inside a CUDA graph).
_TABLES: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}


# E8M0 code -> 2^(code - 127) as float32 (code 255, NaN, is refused at load and never looked up).
_E8M0_VALUES = _pow2_f32(torch.arange(256, dtype=torch.int32) - 127)


def _table(kind: str, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Lookup table `kind` ("values": E2M1 per code, "pairs": E2M1 pair per byte, "e8m0": scale per code) on
    `device` in `dtype` (exact: E2M1 values fit bf16)."""
    key = (kind, torch.device(device), dtype)
    if key not in _TABLES:
        src = {"values": _E2M1_VALUES, "pairs": _E2M1_PAIRS, "e8m0": _E8M0_VALUES}[kind]
        _TABLES[key] = src.to(device=device, dtype=dtype)
    return _TABLES[key]


def _global(scale_2: torch.Tensor, lead: list[int]) -> torch.Tensor:
    """weight_scale_2 shaped to broadcast over `[*L, N, K/16]`: `[1, 1]` for one scalar, `[*L, 1, 1]` for one
    per leading index (as `quant.dequant_nvfp4` shapes it)."""
    return scale_2.reshape(1, 1) if scale_2.dim() == 0 else scale_2.reshape(*lead, 1, 1)


# ---------------------------------------------------------------------------------------------- decoders


def decode_reference(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2: torch.Tensor | None = None) -> torch.Tensor:
    """Decode to float32, with `quant.dequant_nvfp4` / `quant.dequant_mxfp8`'s operations in their order.

    NVFP4: weight uint8 `[*L, N, K/2]`, weight_scale float8_e4m3fn `[*L, N, K/16]`, weight_scale_2 float32 `()`
    or `[*L]`. MXFP8: weight float8_e4m3fn `[*L, N, K]`, weight_scale uint8 `[*L, N, K/32]`. Returns float32
    `[*L, N, K]`. No input checks (they synchronise with the host): the loader checks every tensor once.
    """
    if fmt == NVFP4:
        *lead, n, half_k = weight.shape
        k = 2 * half_k
        block = weight_scale.to(torch.float32) * _global(weight_scale_2, lead)  # [*L, N, K/16]
        codes = unpack_fp4(weight).to(torch.int32)
        values = _table("values", weight.device)[codes].reshape(*lead, n, k // NVFP4_BLOCK, NVFP4_BLOCK)
        return (values * block.unsqueeze(-1)).reshape(*lead, n, k)
    k = weight.shape[-1]
    x = _pow2_f32(weight_scale.to(torch.int32) - 127)  # E8M0: 2^(code - 127), exact
    values = weight.to(torch.float32)
    blocks = (*weight.shape[:-1], k // MXFP8_BLOCK, MXFP8_BLOCK)
    return (values.reshape(blocks) * x.unsqueeze(-1)).reshape(weight.shape)


def decode_fast(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """`decode_reference(...).to(dtype)`, bit for bit, in two passes over the weight.

    The element values (E2M1 pairs from a 256-entry table, or E4M3 cast to `dtype`) are exact in bf16 and
    fp32; `torch.mul(values, fp32 block scale, out=<dtype>)` computes each product in fp32 and rounds it once
    to `dtype`, which is what the reference's fp32 product followed by `.to(dtype)` does.
    """
    if fmt == NVFP4:
        *lead, n, half_k = weight.shape
        k = 2 * half_k
        pairs = F.embedding(weight.to(torch.int32), _table("pairs", weight.device, dtype))  # [*L, N, K/2, 2]
        values = pairs.view(*lead, n, k // NVFP4_BLOCK, NVFP4_BLOCK)
        block = weight_scale.to(torch.float32) * _global(weight_scale_2, lead)
    else:
        k = weight.shape[-1]
        values = weight.to(dtype).view(*weight.shape[:-1], k // MXFP8_BLOCK, MXFP8_BLOCK)
        block = _table("e8m0", weight.device)[weight_scale.to(torch.int32)]  # = _pow2_f32(code - 127)
    out = torch.empty(values.shape, dtype=dtype, device=weight.device)
    torch.mul(values, block.unsqueeze(-1), out=out)
    return out.view(*values.shape[:-2], k)


def _reference_cast(fmt: str, weight, weight_scale, weight_scale_2, dtype: torch.dtype) -> torch.Tensor:
    return decode_reference(fmt, weight, weight_scale, weight_scale_2).to(dtype)


_compiled = None


def decode_compiled(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                    weight_scale_2: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """`decode_reference(...).to(dtype)` through `torch.compile` (compiled on first use, dynamic shapes)."""
    if torch.compiler.is_compiling():  # already inside a compiled region: trace the operations into it
        return _reference_cast(fmt, weight, weight_scale, weight_scale_2, dtype)
    global _compiled
    if _compiled is None:
        # one compiled graph per (format, dtype, rank of the weight, kind of global scale): room for all of them
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
        _compiled = torch.compile(_reference_cast, dynamic=True)
    _table("values", weight.device)  # made outside the compiled region
    return _compiled(fmt, weight, weight_scale, weight_scale_2, dtype)


# ---------------------------------------------------------------------------------------------- fused matmul

def e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    """float32 value of E2M1 codes (an integer tensor of values 0..15), equal to the table `_E2M1_VALUES[codes]`
    (code 8 gives -0.0). Comparisons instead of a table lookup, so that a compiled kernel computes it in
    registers: magnitudes 0, 0.5, 1, 1.5 are index / 2, then 2, 3, then 4, 6; every step is exact in fp32."""
    index = (codes & 7).to(torch.float32)
    magnitude = torch.where(index < 4, index * 0.5, torch.where(index < 6, index - 2.0, index * 2.0 - 8.0))
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def round_to_bf16_bits(v: torch.Tensor) -> torch.Tensor:
    """`v.to(torch.bfloat16).to(torch.float32)`, bit for bit, computed with integer operations on the bits.

    v: a float32 tensor (any shape, any device). Returns a float32 tensor of the same shape whose every
    element is a bfloat16 value: `v` rounded to the nearest bfloat16, ties to even mantissa, on the fp32 bit
    pattern `b`: `(b + 0x7FFF + bit 16 of b) & 0xFFFF0000`. Exact, and equal to PyTorch's cast, for every
    non-NaN input: normal and subnormal values (a carry out of the mantissa moves to the next binade, from
    the largest fp32 subnormals to the smallest normal), ties (to even), finite values of magnitude at least
    bf16 max + half an ulp (3.3961e38, up to fp32 max) to inf of their sign, +-inf to themselves, +-0 to
    themselves (sign kept). NaN gives a quiet NaN of the same sign and upper payload bits (`b | 0x00400000`
    truncated); PyTorch's CPU cast gives the canonical 0x7FC0 instead, so only "is NaN" is specified there
    (decoded weights never are: the loader refuses NaN scales and E4M3 NaN).

    Why bits and not the cast: `torch.compile`'s Triton kernels elide the downcast-upcast pair
    `.to(bfloat16).to(float32)` of a computed value, even with inductor's `emulate_precision_casts`, and
    then use the unrounded fp32 value (measured on an H200, torch 2.11: the fused NVFP4 matmul multiplied
    by the fp32 decoded weight). Integer operations are exact: a compiler may rearrange them but cannot
    change their result, so compiled and eager code round alike.
    """
    b = v.view(torch.int32)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000 as an int32
    rounded = torch.where(torch.isnan(v), (b | 0x00400000) & -65536, rounded)  # keep NaN a NaN (quiet)
    return rounded.view(torch.float32)


def _round_to(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 `v` rounded to `dtype` and widened back to float32: `v.to(dtype).to(torch.float32)`.

    bfloat16 rounds on the bits (`round_to_bf16_bits`), since compiled Triton kernels elide the cast pair.
    float32 is a no-op. Any other dtype (float16) keeps the cast pair: not measured under Triton, and
    float16 has its own exponent range and subnormals, which a bit-level rounding would have to handle.
    """
    if dtype == torch.bfloat16:
        return round_to_bf16_bits(v)
    return v.to(dtype).to(torch.float32)


# Block scale magnitudes for which `normal_range_planes` is exact: [2^-125, 4). At the low end the smallest product,
# 0.5 |s|, is an fp32 normal; at the high end 2^126 |s| (the scale of the element built as e2m1 * 2^-126) is finite.
_NVFP4_NORMAL_SCALES = (2.0**-125, 4.0)
# MXFP8 scale codes for which 2^(code - 127) is an fp32 normal and every E4M3 multiple of it is exact in bf16.
_MXFP8_NORMAL_CODES = (3, 254)


def scales_in_normal_range(fmt: str, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor | None) -> bool:
    """Whether `normal_range_planes` decodes a weight with these scales to `decoded_planes`' exact bits.

    NVFP4: every block scale s = fp32(e4m3) * weight_scale_2 is 0 or has 2^-125 <= |s| < 4 (so 2^126 s is finite
    and every product with an E2M1 value is an fp32 normal, computed exactly as the reference rounds it).
    MXFP8: every E8M0 code is in [3, 254] (2^(code - 127) is a normal fp32 power of two, and each E4M3 value times
    it has at most 4 significant bits at or above 2^-133, so it is exact in bf16 and fp32: no rounding is needed).
    Real checkpoints are far inside both ranges (block scales near 1e-4 to 1e-2; the NVFP4 recipe's largest is the
    tensor's amax / 6). Reads the scales on the host once (the loader's time, not the forward's)."""
    if fmt == NVFP4:
        a = (weight_scale.to(torch.float32) * _global(weight_scale_2, list(weight_scale.shape[:-2]))).abs()
        lo, hi = _NVFP4_NORMAL_SCALES
        return bool(((a == 0) | ((a >= lo) & (a < hi))).all())
    codes = weight_scale.view(torch.uint8)
    return bool(((codes >= _MXFP8_NORMAL_CODES[0]) & (codes <= _MXFP8_NORMAL_CODES[1])).all())


# The fp32 bits that the E2M1 and E4M3 codes are placed on: the sign; E2M1's e e m as exponent bits 24..23 and the
# mantissa's top bit 22; E4M3's e e e e m m m as exponent bits 26..23 and the mantissa's top bits 22..20 (as int32
# constants).
_FP32_SIGN = -(1 << 31)
_E2M1_FIELD = 0x01C00000
_E4M3_FIELD = 0x07F00000


def _shifted(words: torch.Tensor, shift: int) -> torch.Tensor:
    """int32 `words` shifted left by `shift` bits, or right by `-shift` (arithmetic: callers mask the bits kept)."""
    return words << shift if shift >= 0 else words >> -shift


def _e2m1_nibble(data: torch.Tensor, j: int) -> torch.Tensor:
    """Nibble j (bits 4j..4j+3) of int32 `data`, an E2M1 code s e e m, as the float32 e2m1 * 2^-126: the sign placed
    at bit 31, e e as the exponent field's two low bits and m as the mantissa's top bit. fp32 then reads
    2^(e - 127) (1 + m/2), or for e = 0 the subnormal 2^-126 (m/2): the E2M1 value 2^(e - 1) (1 + m/2) (or m/2)
    times 2^-126 for every code, -0 included. Two shifts, two masks and an or, no conversion instruction."""
    return ((_shifted(data, 28 - 4 * j) & _FP32_SIGN) | (_shifted(data, 22 - 4 * j) & _E2M1_FIELD)).view(torch.float32)


def _e2m1_times_2_pow_minus_126(data: torch.Tensor) -> list[torch.Tensor]:
    """The E2M1 codes of packed NVFP4 bytes `data` (an int32 tensor of values 0..255) as float32 values
    e2m1 * 2^-126 (`_e2m1_nibble`), the low nibbles' then the high nibbles'."""
    return [_e2m1_nibble(data, 0), _e2m1_nibble(data, 1)]


def _widen_bf16_bits(b: torch.Tensor) -> torch.Tensor:
    """bfloat16 `b` as float32, exactly, by shifting its 16 bits into place: in compiled kernels a cast would be
    emulated as a round trip through bf16, and a computed bf16 passed on as its bits keeps its rounding."""
    return (b.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _to_bf16_by_conversion(v: torch.Tensor) -> torch.Tensor:
    """float32 `v` (finite, not NaN) rounded to the nearest bfloat16, ties to even, by the conversion instruction,
    and widened back to float32 on the bits (`_widen_bf16_bits`). Passing the bfloat16 through its int16 bits is
    what keeps a compiled kernel from eliding the rounding (which it does to `.to(bfloat16).to(float32)`, see
    `round_to_bf16_bits`): one conversion, one widening and a shift instead of `round_to_bf16_bits`' five integer
    operations."""
    return _widen_bf16_bits(v.to(torch.bfloat16))


def normal_range_planes(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                        weight_scale_2: torch.Tensor | None) -> list[torch.Tensor]:
    """`decoded_planes(..., torch.bfloat16)`, bit for bit, in fewer operations per element, for weights whose scales
    pass `scales_in_normal_range` (outside it the bits may differ).

    NVFP4: e2m1 * s = (e2m1 * 2^-126) * (2^126 s), the first factor built on the bits (`_e2m1_times_2_pow_minus_126`,
    sign included; a subnormal for the codes +-0.5, hence the compiled kernels' `disable_ftz`) and 2^126 s exact, so
    the one fp32 rounding of the product is the reference's (-0 times s too); it is then rounded to bf16 by the
    conversion instruction (`_to_bf16_by_conversion`; no NaN or overflow can occur in range). MXFP8: fp32(e4m3) *
    2^(code - 127) with the power of two built from the code's bits; exact, so it is already the bf16 value. Under half
    the integer and floating-point operations of `decoded_planes` per element, which is what bounds the fused matmul
    on a GPU (measured on an H200 at 1 row: 1.3-1.7x faster for MXFP8 over two compiles, 1.6-1.9x for NVFP4)."""
    if fmt == NVFP4:
        *lead, n, half_k = weight.shape
        # (fp32(e4m3) * global) is the reference's block scale, rounded once; times 2^126 it stays exact
        s = (weight_scale.to(torch.float32) * _global(weight_scale_2, lead) * 2.0**126).unsqueeze(-1)
        data = weight.view(*lead, n, half_k // (NVFP4_BLOCK // 2), NVFP4_BLOCK // 2).to(torch.int32)
        return [_to_bf16_by_conversion(code * s) for code in _e2m1_times_2_pow_minus_126(data)]
    k = weight.shape[-1]
    scale = (weight_scale.to(torch.int32) << 23).view(torch.float32).unsqueeze(-1)  # 2^(code - 127), code >= 1
    return [weight.to(torch.float32).view(*weight.shape[:-1], k // MXFP8_BLOCK, MXFP8_BLOCK) * scale]


def nvfp4_word_planes(words: torch.Tensor, weight_scale: torch.Tensor,
                      weight_scale_2: torch.Tensor) -> list[torch.Tensor]:
    """`normal_range_planes("nvfp4", ...)`'s elements, bit for bit, from the packed bytes read as int32 words: eight
    planes `[*L, N, K/16, 2]`, plane j holding nibble j of each of a block's two words (`_bytes_as_int32`: word w of a
    block is its bytes 4w..4w+3, little-endian, so nibble j is element 8w + j of the block). Stacked on a last axis
    and flattened, the planes are the row `[*L, N, K]` in order.

    One load of a word (and one of its block scale) feeds eight elements, where the byte planes load a byte and a
    scale for two. Each nibble's bits s e e m are placed on the fp32 bits (`_e2m1_nibble`), then multiplied by 2^126 s
    and rounded to bf16 as `normal_range_planes` does. For scales that pass `scales_in_normal_range` only."""
    *lead, n, n_words = words.shape
    s = (weight_scale.to(torch.float32) * _global(weight_scale_2, lead) * 2.0**126).unsqueeze(-1)
    w = words.view(*lead, n, n_words // 2, 2)
    return [_to_bf16_by_conversion(_e2m1_nibble(w, j) * s) for j in range(8)]


def mxfp8_word_planes(words: torch.Tensor, weight_scale: torch.Tensor) -> list[torch.Tensor]:
    """`normal_range_planes("mxfp8", ...)`'s elements, bit for bit, from the E4M3 bytes read as int32 words: four
    planes `[*L, N, K/32, 8]`, plane i holding byte i of each of a block's eight words (`_bytes_as_int32`: element
    4w + i of the block). Stacked on a last axis and flattened, the planes are the row `[*L, N, K]` in order.

    Each byte's bits s e e e e m m m are placed as fp32 bits (sign at bit 31, e e e e m m m at bits 26..20) by two
    shifts, two masks and an or: fp32 then reads the E4M3 value times 2^-120 exactly (E4M3's subnormals as fp32
    subnormals, hence the compiled kernels' `disable_ftz`); times 2^120, then times 2^(code - 127), both exact in
    range, it is `normal_range_planes`' product, with no conversion instruction. For E8M0 codes that pass
    `scales_in_normal_range` and weights with no E4M3 NaN byte (0x7f, 0xff: placed on the bits they would read as
    the finite 480 * 2^-120; `has_e4m3_nan`)."""
    *lead, n, n_words = words.shape
    scale = (weight_scale.to(torch.int32) << 23).view(torch.float32).unsqueeze(-1)  # 2^(code - 127)
    w = words.view(*lead, n, n_words // (MXFP8_BLOCK // 4), MXFP8_BLOCK // 4)
    planes = []
    for i in range(4):  # byte i's s e e e e m m m: s to bit 31, e e e e m m m (bits 8i..8i+6) to bits 26..20
        bits = (_shifted(w, 24 - 8 * i) & _FP32_SIGN) | (_shifted(w, 20 - 8 * i) & _E4M3_FIELD)
        planes.append(bits.view(torch.float32) * 2.0**120 * scale)
    return planes


def has_e4m3_nan(weight: torch.Tensor) -> bool:
    """Whether an E4M3 tensor holds a NaN byte (0x7f or 0xff), which `mxfp8_word_planes` would not read as NaN."""
    return bool(((weight.view(torch.uint8) & 0x7F) == 0x7F).any())


def activation_word_planes(fmt: str, x: torch.Tensor) -> list[torch.Tensor]:
    """`x` [..., K] widened to float32 in the layout of the word planes of `fmt`: NVFP4 (`nvfp4_word_planes`) eight
    planes `[..., K/16, 2]`, plane j holding element 8w + j of each block's word w; MXFP8 (`mxfp8_word_planes`) four
    planes `[..., K/32, 8]`, plane i holding element 4w + i. A bf16 x is read as int32 pairs (`activation_planes`):
    plane 2p is pair p's low half, plane 2p + 1 its high half. Exact (a widening)."""
    *lead, k = x.shape
    block, per_word = (NVFP4_BLOCK, 8) if fmt == NVFP4 else (MXFP8_BLOCK, 4)
    if x.dtype == torch.bfloat16:
        pairs = _bf16_pairs_as_int32(x).view(*lead, k // block, block // per_word, per_word // 2)
        return [half for p in range(per_word // 2) for half in _pair_halves(pairs[..., p])]
    x = x.float().view(*lead, k // block, block // per_word, per_word)
    return [x[..., j] for j in range(per_word)]


def _bytes_as_int32(weight: torch.Tensor) -> torch.Tensor:
    """A 1-byte `weight` [..., B] (NVFP4's uint8 codes, MXFP8's E4M3 elements; B a multiple of 4) as int32
    [..., B/4], each word four consecutive bytes read little-endian (as every device torch runs on stores them). A
    view of a contiguous, word-aligned weight (a stored one is); else of a copy."""
    if not torch.compiler.is_compiling() and (not weight.is_contiguous() or weight.storage_offset() % 4):
        weight = weight.contiguous().clone()
    return weight.view(torch.int32)


def decoded_planes(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                   weight_scale_2: torch.Tensor | None, dtype: torch.dtype) -> list[torch.Tensor]:
    """The decoded weight `decode_reference(...).to(dtype)`, bit for bit, widened to float32, as planes of
    blocks along K (one block per block scale).

    NVFP4 (operands as in `decode_reference`, weight `[*L, N, K/2]`): two planes `[*L, N, K/16, 8]`, the
    elements of the low nibbles (even k) and of the high nibbles (odd k) of each block's 8 bytes, each
    `fp32(dtype(e2m1 * (float(block scale) * weight_scale_2)))` in that order, as the reference. MXFP8: one
    plane `[*L, N, K/32, 32]`, `fp32(dtype(float(e4m3) * 2^(scale - 127)))`. Elementwise in the packed bytes,
    so that a compiled caller reducing over K computes each element where it uses it; the block dimensions
    stay apart so that its indexing needs no division by a runtime K.

    The rounding to `dtype` is `_round_to`: for bfloat16 integer operations on the fp32 bits
    (`round_to_bf16_bits`), not `.to(dtype).to(float32)`, which Triton kernels compile to nothing even with
    `emulate_precision_casts` (measured on an H200: the fused NVFP4 matmul then multiplied by the unrounded
    fp32 value; MXFP8 values are exact in bf16, so it could not tell).
    """
    if fmt == NVFP4:
        *lead, n, half_k = weight.shape
        block = (weight_scale.to(torch.float32) * _global(weight_scale_2, lead)).unsqueeze(-1)  # [*L, N, K/16, 1]
        data = weight.view(*lead, n, half_k // (NVFP4_BLOCK // 2), NVFP4_BLOCK // 2)
        return [_round_to(e2m1_value(codes) * block, dtype) for codes in (data & 0x0F, data >> 4)]
    k = weight.shape[-1]
    scale = _pow2_f32(weight_scale.to(torch.int32) - 127).unsqueeze(-1)  # E8M0: 2^(code - 127), exact
    values = weight.to(torch.float32).view(*weight.shape[:-1], k // MXFP8_BLOCK, MXFP8_BLOCK)
    return [_round_to(values * scale, dtype)]


def activation_planes(fmt: str, x: torch.Tensor) -> list[torch.Tensor]:
    """`x` [..., K] widened to float32 and split like `decoded_planes`: NVFP4 [even k, odd k], each
    `[..., K/16, 8]`; MXFP8 [x as `[..., K/32, 32]`]. Exact (a widening).

    A bf16 x of an NVFP4 product is read as int32 words, each the pair (x[2j], x[2j+1]) that one packed byte
    multiplies (little-endian: x[2j] in the low half), and both halves are shifted or masked into fp32 bits: one
    load and two integer operations per byte in a compiled kernel instead of two strided bf16 loads and their
    widenings (its effect on an H200 decode step was within the spread of runs of the same code, BENCHMARKS.md)."""
    *lead, k = x.shape
    if fmt == NVFP4 and x.dtype == torch.bfloat16:
        return list(_pair_halves(_bf16_pairs_as_int32(x).view(*lead, k // NVFP4_BLOCK, NVFP4_BLOCK // 2)))
    x = _widen_bf16_bits(x) if x.dtype == torch.bfloat16 else x.float()
    if fmt == NVFP4:
        pairs = x.view(*lead, k // NVFP4_BLOCK, NVFP4_BLOCK // 2, 2)
        return [pairs[..., 0], pairs[..., 1]]
    return [x.view(*lead, k // MXFP8_BLOCK, MXFP8_BLOCK)]


def _pair_halves(pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two bf16 values of each int32 word of `_bf16_pairs_as_int32` (low half, high half) as float32, exactly."""
    return (pairs << 16).view(torch.float32), (pairs & -65536).view(torch.float32)


def _bf16_pairs_as_int32(x: torch.Tensor) -> torch.Tensor:
    """bf16 `x` [..., K] (K even) as int32 [..., K/2]: each word holds x[2j] in its low and x[2j+1] in its high 16
    bits (the bytes as stored, read little-endian, which every device torch runs on is). Copies x first unless it is
    contiguous and starts on a word (compiled, the compiler places its buffers, and a view's offset is not traced)."""
    x = x.contiguous()
    if not torch.compiler.is_compiling() and x.storage_offset() % 2:
        x = x.clone()
    return x.view(torch.int32)


def _select(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor | None,
            index: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The stacks' entries `index` (all with None); a scalar global is shared by all of them."""
    if index is None:
        return weight, weight_scale, weight_scale_2
    g = weight_scale_2 if weight_scale_2 is None or weight_scale_2.dim() == 0 else weight_scale_2[index]
    return weight[index], weight_scale[index], g


def _normal_planes_apply(fmt: str, dtype: torch.dtype, normal_range: bool) -> bool:
    """Whether `normal_range_planes` (and the word planes) give `decoded_planes`' bits: scales in the normal range
    and a bf16 compute dtype (or MXFP8 in fp32, whose values are exact there too)."""
    return normal_range and (dtype == torch.bfloat16 or (fmt == MXFP8 and dtype == torch.float32))


def _planes(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor | None,
            dtype: torch.dtype, normal_range: bool) -> list[torch.Tensor]:
    """`decoded_planes`, through `normal_range_planes` where that gives the same bits (`_normal_planes_apply`)."""
    if _normal_planes_apply(fmt, dtype, normal_range):
        return normal_range_planes(fmt, weight, weight_scale, weight_scale_2)
    return decoded_planes(fmt, weight, weight_scale, weight_scale_2, dtype)


def packed_matmul(x: torch.Tensor, fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                  weight_scale_2: torch.Tensor | None, dtype: torch.dtype,
                  index: torch.Tensor | None = None, normal_range: bool = False, words: bool = False) -> torch.Tensor:
    """`x @ w_hat^T` with the packed weight decoded inside the sum: the fused dequantize-and-multiply.

    x: `[*B, M, K]` in any float dtype; weight, weight_scale, weight_scale_2: a packed `[*L, N, K]` weight or
    stack as in `decode_reference`; index: None, or a LongTensor of stack entries (any shape `I`, repeats allowed)
    that replaces L by `I`; `*B` broadcasts against `*L` (`I`). Returns `[*broadcast(B, L), M, N]` in `dtype`:

        y[..., m, n] = dtype( sum_k fp32(x[..., m, k]) * fp32(w_hat[..., n, k]) )

    with `w_hat = decode_reference(...).to(dtype)` bit for bit (`decoded_planes`), every product rounded to
    fp32, the sum accumulated in fp32 in an unspecified order (so |y - exact| <= gamma_K * sum_k |x w_hat|
    before the one final rounding to `dtype`, gamma_K = K u / (1 - K u), u = 2^-24).

    Eagerly it materialises fp32 temporaries of the weight's size. Compiled (`packed_matmul_fused`) the
    decoding fuses into the reduction: the M rows are unrolled, so the decoded element is computed once and
    feeds M accumulators, and the kernel reads only the packed bytes, the scales and x.

    normal_range: the caller has checked `scales_in_normal_range` (PackedWeight does at construction): the planes
    come from `normal_range_planes`, the same bits in fewer operations. words (in range, bf16; MXFP8 also fp32): the
    same bits from the bytes read four at a time (`nvfp4_word_planes`, `mxfp8_word_planes`: the caller has checked
    that an MXFP8 weight holds no NaN byte, `has_e4m3_nan`), the sum in another order; with a bf16 x, the planes'
    products are added by fused multiply-adds (`torch.addcmul`, an FMA instruction in inductor's CUDA kernels): a
    product of a bf16 x and a decoded element (at most 8 significant bits) is exact in fp32, so this is the same as
    rounding it and adding, except for products under fp32's normal range (|x w| < 2^-126), added unrounded.
    """
    exact_products = False
    if words and _normal_planes_apply(fmt, dtype, normal_range):
        # the words are a view of the stored bytes taken before selecting entries, so selecting copies nothing
        w, s, g = _select(_bytes_as_int32(weight), weight_scale, weight_scale_2, index)
        planes = nvfp4_word_planes(w, s, g) if fmt == NVFP4 else mxfp8_word_planes(w, s)  # [*L, N, blocks, words]
        xs = activation_word_planes(fmt, x)
        exact_products = x.dtype == torch.bfloat16
    else:
        weight, weight_scale, weight_scale_2 = _select(weight, weight_scale, weight_scale_2, index)
        planes = _planes(fmt, weight, weight_scale, weight_scale_2, dtype, normal_range)  # [*L, N, blocks, block]
        xs = activation_planes(fmt, x)  # [*B, M, blocks, block] each
    rows = []
    for m in range(x.shape[-2]):
        terms = xs[0][..., m, None, :, :] * planes[0]
        for xp, wp in zip(xs[1:], planes[1:]):
            xm = xp[..., m, None, :, :]
            terms = torch.addcmul(terms, xm, wp) if exact_products else terms + xm * wp
        # [*, N]: one reduction over K per row, cast as it is stored (so the kernel writes the output directly)
        rows.append(terms.sum((-2, -1)).to(dtype))
    return torch.stack(rows, dim=-2)


def packed_matmul_reference(x: torch.Tensor, fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                            weight_scale_2: torch.Tensor | None, dtype: torch.dtype,
                            index: torch.Tensor | None = None) -> torch.Tensor:
    """What `packed_matmul` replaces: decode (`decode_reference(...).to(dtype)`, the selected entries), then
    `torch.matmul(x, w_hat^T)` in `dtype` (the library's accumulation). Same shapes as `packed_matmul`."""
    weight, weight_scale, weight_scale_2 = _select(weight, weight_scale, weight_scale_2, index)
    w = decode_reference(fmt, weight, weight_scale, weight_scale_2).to(dtype)
    return torch.matmul(x.to(dtype), w.transpose(-1, -2))


FUSED_INDUCTOR_OPTIONS = {"realize_opcount_threshold": 1 << 16, "realize_acc_reads_threshold": 1 << 16,
                          "realize_reads_threshold": 1 << 16,
                          "emulate_precision_casts": True, "eager_numerics.disable_ftz": True,
                          "assert_indirect_indexing": False}
_fused = None


def _compiled_packed_matmul():
    """`packed_matmul` through `torch.compile`, made on first use.

    dynamic: one graph for every N, K, stack size and gathered count (the rows M are unrolled, so each M is a
    graph of its own); fullgraph: no graph break, so the whole sum is one compiled region (and no host
    synchronisation can hide in one; past the recompile limit it raises rather than run eagerly). Inductor
    options (`FUSED_INDUCTOR_OPTIONS`): the realize thresholds keep inductor from storing the decoded planes or
    the products to memory (by default it stores a pointwise result of more than 30 operations on GPUs, 50 on
    CPUs, or one read by several rows that reads more than 4 buffers), which is the whole point;
    emulate_precision_casts asks inductor to keep a downcast followed by an upcast (which it otherwise elides,
    multiplying by the fp32 decoded value instead of the weight's bits); it is not enough: on an H200 (torch
    2.11) the Triton kernel still multiplied by the unrounded fp32 NVFP4 value, so `decoded_planes` rounds to
    bfloat16 with integer operations on the bits (`round_to_bf16_bits`), which no compiler elides, and the
    option stays for the remaining casts (float16); eager_numerics.disable_ftz keeps fp32 subnormals;
    assert_indirect_indexing off: inductor would check every gathered expert's (and every gathered key's) index
    against its bound once per loaded element, inside the loop over K, and the indices here are the engine's own
    (top-k expert ids, clamped block ids), in range by construction.
    """
    global _fused
    if _fused is None:
        # one graph per (format, dtype, rows, gathered or not, ranks of x and of the global scale)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _fused = torch.compile(packed_matmul, dynamic=True, fullgraph=True, options=FUSED_INDUCTOR_OPTIONS)
    return _fused


def packed_matmul_fused(x: torch.Tensor, fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                        weight_scale_2: torch.Tensor | None, dtype: torch.dtype, index: torch.Tensor | None = None,
                        rows_per_pass: int = FUSED_ROWS, normal_range: bool = False,
                        words: bool = False) -> torch.Tensor:
    """`packed_matmul`, compiled, in passes of `rows_per_pass` rows of x (a compiled kernel per pass, each
    reading the weight once; the passes' outputs are concatenated). Same contract as `packed_matmul`.

    Inside a region that is itself being compiled (`FastPaths.compile_layers`) the plain `packed_matmul` is
    traced instead, so the enclosing graph fuses it with its inputs' producers."""
    fn = packed_matmul if torch.compiler.is_compiling() else _compiled_packed_matmul()
    rows = x.shape[-2]
    if rows <= rows_per_pass:
        return fn(x, fmt, weight, weight_scale, weight_scale_2, dtype, index, normal_range, words)
    parts = [fn(x[..., r:r + rows_per_pass, :], fmt, weight, weight_scale, weight_scale_2, dtype, index, normal_range,
                words) for r in range(0, rows, rows_per_pass)]
    return torch.cat(parts, dim=-2)


# ---------------------------------------------------------------------------------------------- the module


class PackedWeight(nn.Module):
    """One NVFP4 or MXFP8 weight (or a stack of routed experts' weights) kept as stored.

    Buffers, named as in the checkpoint: `weight` (NVFP4: uint8 `[*L, N, K/2]`; MXFP8: float8_e4m3fn
    `[*L, N, K]`), `weight_scale` (NVFP4: float8_e4m3fn `[*L, N, K/16]`; MXFP8: uint8 E8M0 `[*L, N, K/32]`),
    `weight_scale_2` (NVFP4 only: float32 `()`, or `[E]` for an expert stack). `L` is empty for a linear
    and `[E_local]` for the experts of a layer.

    `decode(index)` returns the weight in the compute dtype `dtype`: all of it, one expert (`index` an int)
    or a batch of experts (`index` a LongTensor, repeats allowed). `mode` picks the decoder ("reference",
    "fast", "compile"); every mode returns the same bits. Indexing (`w[e]`) and `.shape` behave like the
    decoded stack, so code written for decoded weights reads packed ones too.

    `linear(x)` and `matmul(x, index)` multiply by the weight: decoded then multiplied, or, for inputs of at
    most `fused_tokens` rows (0, the default, = never; `FastPaths(matmul="fused")` sets it), through
    `packed_matmul_fused` without decoding the weight into memory, `fused_rows` rows per pass (the packed bytes
    read as int32 words with `words`: `set_words`, `FastPaths.nvfp4_words` / `mxfp8_words`).
    """

    def __init__(self, fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if fmt not in (NVFP4, MXFP8):
            raise ValueError(f"PackedWeight: format {fmt!r} is not packed (nvfp4 or mxfp8)")
        if (fmt == NVFP4) != (weight_scale_2 is not None):
            raise ValueError("PackedWeight: weight_scale_2 is given for NVFP4 and only for NVFP4")
        self.fmt, self.dtype, self.mode = fmt, dtype, "reference"
        self.fused_tokens, self.fused_rows, self._words_on = 0, FUSED_ROWS, False
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight_scale_2", weight_scale_2)
        self.check_range()

    def check_range(self) -> None:
        """Whether the fused matmul may decode through `normal_range_planes` (same bits, fewer operations), and
        whether an MXFP8 weight may be read as words: set once from the scales and bytes held (call again after
        filling the buffers in place)."""
        self.normal_range = scales_in_normal_range(self.fmt, self.weight_scale, self.weight_scale_2)
        self._nan_free = None
        self.set_words(self._words_on)

    def set_words(self, on: bool) -> None:
        """Whether the fused matmul reads the packed bytes as int32 words (`nvfp4_word_planes`, `mxfp8_word_planes`;
        the same bits). An MXFP8 weight holding an E4M3 NaN byte keeps the byte planes, which read it as NaN (checked
        once, on the first call that turns words on)."""
        if on and self.fmt == MXFP8 and self._nan_free is None:
            self._nan_free = not has_e4m3_nan(self.weight)
        self._words_on = on

    @property
    def words(self) -> bool:
        """Whether the fused matmul reads this weight as int32 words (`set_words`)."""
        return self._words_on and (self.fmt == NVFP4 or bool(self._nan_free))

    @property
    def shape(self) -> torch.Size:
        """The decoded weight's shape `[*L, N, K]`."""
        s = self.weight.shape
        return torch.Size((*s[:-1], 2 * s[-1] if self.fmt == NVFP4 else s[-1]))

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def parts(self, index: int | torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """(weight, weight_scale, weight_scale_2) of the selected experts (all with index None), packed."""
        g = self.weight_scale_2
        if index is None:
            return self.weight, self.weight_scale, g
        # a scalar global (one linear) is shared; a per-expert global is selected with its expert
        return self.weight[index], self.weight_scale[index], None if g is None else (g if g.dim() == 0 else g[index])

    def decode(self, index: int | torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The decoded weight in `dtype` (default `self.dtype`, the compute dtype): `[*L, N, K]`, `[N, K]` (an
        int index) or `[P, N, K]` (a LongTensor of P expert indices)."""
        w, s, g = self.parts(index)
        dtype = dtype or self.dtype
        if self.mode == "fast":
            return decode_fast(self.fmt, w, s, g, dtype)
        if self.mode == "compile":
            return decode_compiled(self.fmt, w, s, g, dtype)
        return decode_reference(self.fmt, w, s, g).to(dtype)

    def __getitem__(self, index: int | torch.Tensor) -> torch.Tensor:
        return self.decode(index)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """`F.linear(x, self.decode())` for one linear and `x` [..., K] -> [..., N] in the compute dtype; fused
        (`packed_matmul_fused`, equal to fp32 rounding) when x has at most `fused_tokens` rows."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if 0 < rows <= self.fused_tokens:
            y = packed_matmul_fused(x.reshape(rows, x.shape[-1]), self.fmt, *self.parts(), self.dtype,
                                    rows_per_pass=self.fused_rows, normal_range=self.normal_range, words=self.words)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return F.linear(x, self.decode())

    def matmul(self, x: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        """`torch.matmul(x, self.decode(index).transpose(-1, -2))`: x `[*B, M, K]` against the whole stack (index
        None) or the entries `index` (a LongTensor of any shape); fused when `M` is at most `fused_tokens`."""
        if 0 < x.shape[-2] <= self.fused_tokens:
            return packed_matmul_fused(x, self.fmt, *self.parts(), self.dtype, index, self.fused_rows,
                                       self.normal_range, self.words)
        return torch.matmul(x, self.decode(index).transpose(-1, -2))

    def extra_repr(self) -> str:
        fused = f", fused_tokens={self.fused_tokens}" if self.fused_tokens else ""
        return f"{self.fmt}, shape={list(self.shape)}, dtype={self.dtype}, decode={self.mode}{fused}"


# ---------------------------------------------------------------------------------------------- loading


def read_packed(ck: Checkpoint, prefix: str, rows: slice | None = None,
                cols: slice | None = None) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The packed tensors of linear `prefix` (or of the [rows, cols] part of its [out, in] weight), as
    `(fmt, weight, weight_scale, weight_scale_2)`, sliced exactly as `Checkpoint.read_linear` slices them
    (NVFP4 K-slices move K/2 bytes and K/16 scales, MXFP8 K-slices K/32 scales; `cols` must keep whole
    groups). The compressed-tensors global `weight_global_scale` is turned into `weight_scale_2 = 1 / it`
    in fp32, as `read_linear` does. Not decoded and not checked (`check_packed` checks)."""
    f = ck.formats[prefix]
    if f.fmt not in (NVFP4, MXFP8):
        raise CheckpointError(f"{prefix}: stored {f.fmt}, not packed")
    group = NVFP4_BLOCK if f.fmt == NVFP4 else MXFP8_BLOCK
    start = stop = None
    if cols is not None:
        start, stop = cols.start or 0, cols.stop
        if start % group or (stop is not None and stop % group):
            raise CheckpointError(f"{prefix}: column slice {start}:{stop} is not aligned to the {f.fmt} group "
                                  f"of {group}")

    def per(n: int) -> slice | None:  # the column slice of a tensor holding one entry per n elements
        return None if cols is None else slice(start // n, None if stop is None else stop // n)

    if f.fmt == NVFP4:
        weight = ck.read(f.weight, rows, per(2))
        scale = ck.read(f.scale, rows, per(NVFP4_BLOCK))
        g = ck.read_scalar(f.scale_2)
        if f.compressed_tensors:
            g = 1.0 / g
        return NVFP4, weight, scale, g
    return MXFP8, ck.read(f.weight, rows, cols), ck.read(f.scale, rows, per(MXFP8_BLOCK)), None


def check_packed(fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor | None,
                 name: str) -> None:
    """Run `quant.dequant_nvfp4/mxfp8`'s checks (NaN scales, E8M0 code 255, bad globals, overflow) on packed
    tensors, raising `QuantFormatError` naming `name`. The decoded result is dropped."""
    if fmt == NVFP4:
        dequant_nvfp4(weight, weight_scale, weight_scale_2, name=name)
    else:
        dequant_mxfp8(weight, weight_scale, name=name)


def packed_weights(model: nn.Module) -> Iterator[tuple[str, PackedWeight]]:
    for name, m in model.named_modules():
        if isinstance(m, PackedWeight):
            yield name, m


def model_nbytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of `model` (tied tensors counted once): its weight memory."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def dequantize(model: nn.Module) -> nn.Module:
    """Replace every `PackedWeight` of `model` by its decoded weight, in place (as `weights="dequant"` would
    have loaded it). For tools that need plain weights (the transformers oracle in benchmarks)."""
    from .linear import Linear
    from .moe import Experts

    for m in list(model.modules()):
        if isinstance(m, Linear) and m.packed is not None:
            m.unpack()
        elif isinstance(m, Experts):
            for leaf in ("w1", "w2", "w3"):
                if isinstance(getattr(m, leaf), PackedWeight):
                    m.unpack(leaf)
    return model


__all__ = ["PackedWeight", "decode_reference", "decode_fast", "decode_compiled", "packed_matmul", "packed_matmul_fused",
           "packed_matmul_reference", "e2m1_value", "round_to_bf16_bits", "decoded_planes", "activation_planes",
           "normal_range_planes", "scales_in_normal_range",
           "FUSED_ROWS", "read_packed", "check_packed", "packed_weights", "model_nbytes", "dequantize",
           "QuantFormatError"]
