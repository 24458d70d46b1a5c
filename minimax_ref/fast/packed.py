"""The fast decoders of packed weights, each tested bit for bit against the one reference decoder
(`packed.decode_reference`, i.e. `quant.decode_nvfp4/mxfp8`).

* `decode_fast` (`FastPaths(decode="fast")`): two passes instead of about eight. A byte-to-pair lookup gives both
  E2M1 values of a byte (exact in bf16 and fp32; E8M0 scales come from a 256-entry table too), and one
  multiplication by the fp32 block scale writes the compute dtype. PyTorch computes a mixed bf16 x fp32 product in
  fp32 and rounds it once on store, so the result is the reference's fp32 product rounded to the compute dtype.
* `Kernels.decode` (`decode="compile"`): `torch.compile` of the reference operations, one fused kernel that reads
  the packed bytes and writes the compute dtype.
* `packed_matmul` (`matmul="fused"`, for decode-size inputs): `x @ w_hat^T` written so that `torch.compile` fuses the
  decoding into the reduction over K: one kernel reads the packed bytes and scales and accumulates in fp32, and no
  decoded weight is ever written (`Kernels.matmul` compiles it; `packed_matmul_reference`, decode then
  `torch.matmul`, is what it replaces). The decoding inside the sum is `decoded_planes`, or, for weights whose
  scales keep every product in the normal fp32 range (`scales_in_normal_range`), `normal_range_planes`: the same
  bits in about half the operations; or the packed bytes read as int32 words (`nvfp4_word_planes`,
  `mxfp8_word_planes`), eight or four elements per load.

`FastPackedWeight` is `packed.PackedWeight` with these decoders switched in (`fast.apply` swaps the class).
tests/test_packed.py and tests/test_fused.py check every decoder against `quant.dequant_*` on every code and byte.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..weights.checkpoint import MXFP8, NVFP4
from ..weights.packed import PackedWeight, decode_reference
from ..weights.quant import E2M1_MAGNITUDES, MXFP8_BLOCK, NVFP4_BLOCK, _pow2_f32
from . import gemv, grouped, mma_gemv, prefill_experts
from .paths import FUSED_ROWS

# E2M1 value of each 4-bit code (code 8 is -0.0), and of both codes of each byte (low nibble first).
_E2M1_VALUES = torch.cat([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])
_E2M1_PAIRS = torch.stack((_E2M1_VALUES[torch.arange(256) & 0x0F], _E2M1_VALUES[torch.arange(256) >> 4]), dim=-1)
# E8M0 code -> 2^(code - 127) as float32 (code 255, NaN, is refused at load and never looked up).
_E8M0_VALUES = _pow2_f32(torch.arange(256, dtype=torch.int32) - 127)
# Lookup tables live on the device they are used on, made once per device: copying a CPU table at every decode
# would synchronise with the host (and cannot happen inside a CUDA graph).
_TABLES: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}


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

    Why bits and not the cast: `torch.compile`'s Triton kernels can elide the downcast-upcast pair
    `.to(bfloat16).to(float32)` of a computed value, even with inductor's `emulate_precision_casts`, and
    then use the unrounded fp32 value. Integer operations are exact: a compiler may rearrange them but cannot
    change their result, so compiled and eager code round alike.
    """
    b = v.view(torch.int32)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000 as an int32
    rounded = torch.where(torch.isnan(v), (b | 0x00400000) & -65536, rounded)  # keep NaN a NaN (quiet)
    return rounded.view(torch.float32)


def _round_to(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 `v` rounded to `dtype` and widened back to float32: `v.to(dtype).to(torch.float32)`.

    bfloat16 rounds on the bits (`round_to_bf16_bits`), since compiled Triton kernels elide the cast pair.
    float32 is a no-op. Any other dtype (float16) keeps the cast pair: not checked under Triton, and
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


def widen_bf16_bits(b: torch.Tensor) -> torch.Tensor:
    """bfloat16 `b` as float32, exactly, by shifting its 16 bits into place: in compiled kernels a cast would be
    emulated as a round trip through bf16, and a computed bf16 passed on as its bits keeps its rounding."""
    return (b.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _to_bf16_by_conversion(v: torch.Tensor) -> torch.Tensor:
    """float32 `v` (finite, not NaN) rounded to the nearest bfloat16, ties to even, by the conversion instruction,
    and widened back to float32 on the bits (`widen_bf16_bits`). Passing the bfloat16 through its int16 bits is
    what keeps a compiled kernel from eliding the rounding (which it does to `.to(bfloat16).to(float32)`, see
    `round_to_bf16_bits`): one conversion, one widening and a shift instead of `round_to_bf16_bits`' five integer
    operations."""
    return widen_bf16_bits(v.to(torch.bfloat16))


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
    on a GPU."""
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
    (`round_to_bf16_bits`), not `.to(dtype).to(float32)`, which Triton kernels can compile to nothing even with
    `emulate_precision_casts` (then multiplying by the unrounded fp32 value).
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
    widenings."""
    *lead, k = x.shape
    if fmt == NVFP4 and x.dtype == torch.bfloat16:
        return list(_pair_halves(_bf16_pairs_as_int32(x).view(*lead, k // NVFP4_BLOCK, NVFP4_BLOCK // 2)))
    x = widen_bf16_bits(x) if x.dtype == torch.bfloat16 else x.float()
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
# Why each option: the realize thresholds keep inductor from storing the decoded planes or the products to memory (by
# default it stores a pointwise result of more than 30 operations on GPUs, 50 on CPUs, or one read by several rows
# that reads more than 4 buffers), which is the point of the fusion; emulate_precision_casts keeps a downcast followed
# by an upcast (the bf16 rounding itself is done on the bits, `round_to_bf16_bits`, which no compiler elides; the
# option covers float16); disable_ftz keeps fp32 subnormals; assert_indirect_indexing off: the gathered indices
# (top-k expert ids, clamped block ids) are in range by construction, and the check would run per loaded element.


def _reference_cast(fmt: str, weight, weight_scale, weight_scale_2, dtype: torch.dtype) -> torch.Tensor:
    return decode_reference(fmt, weight, weight_scale, weight_scale_2).to(dtype)


class Kernels:
    """The compiled decoders of packed weights, compiled on first use and owned by this object (`fast.apply` makes
    one per model and hands it to the model's `FastPackedWeight`s).

    `decode(...)`: `decode_reference(...).to(dtype)` through `torch.compile` (dynamic shapes), bit for bit.
    `matmul(...)`: `packed_matmul` compiled (`FUSED_INDUCTOR_OPTIONS`; dynamic: one graph for every N, K, stack size
    and gathered count, the rows M unrolled; fullgraph: no graph break, so no host synchronisation hides in it), in
    passes of `rows_per_pass` rows of x. Inside a region that is itself being compiled (the compiled decoder layers)
    both trace the plain functions, so the enclosing graph fuses them with their inputs' producers."""

    def __init__(self) -> None:
        self._decode = None
        self._fused = None

    def decode(self, fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
               weight_scale_2: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return _reference_cast(fmt, weight, weight_scale, weight_scale_2, dtype)
        if self._decode is None:
            # one graph per (format, dtype, rank of the weight, kind of global scale)
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
            self._decode = torch.compile(_reference_cast, dynamic=True)
        return self._decode(fmt, weight, weight_scale, weight_scale_2, dtype)

    def fused(self):
        """`packed_matmul` compiled (made on first use)."""
        if self._fused is None:
            # one graph per (format, dtype, rows, gathered or not, ranks of x and of the global scale)
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self._fused = torch.compile(packed_matmul, dynamic=True, fullgraph=True, options=FUSED_INDUCTOR_OPTIONS)
        return self._fused

    def matmul(self, x: torch.Tensor, fmt: str, weight: torch.Tensor, weight_scale: torch.Tensor,
               weight_scale_2: torch.Tensor | None, dtype: torch.dtype, index: torch.Tensor | None = None,
               rows_per_pass: int = FUSED_ROWS, normal_range: bool = False, words: bool = False) -> torch.Tensor:
        """`packed_matmul`, compiled, in passes of `rows_per_pass` rows of x (a kernel per pass, each reading the
        weight once; the passes' outputs concatenated). Same contract as `packed_matmul`."""
        fn = packed_matmul if torch.compiler.is_compiling() else self.fused()
        rows = x.shape[-2]
        if rows <= rows_per_pass:
            return fn(x, fmt, weight, weight_scale, weight_scale_2, dtype, index, normal_range, words)
        parts = [fn(x[..., r:r + rows_per_pass, :], fmt, weight, weight_scale, weight_scale_2, dtype, index,
                    normal_range, words) for r in range(0, rows, rows_per_pass)]
        return torch.cat(parts, dim=-2)


# The non-persistent buffers holding `fast.gemv`'s or `fast.mma_gemv`'s reordered copy of a weight and the latter's
# split counters (not in the state_dict; `fast.apply` removes them when it restores the reference)
GEMV_BUFFERS = ("gemv_words", "gemv_scales", "gemv_global", "gemv_counters")


class FastPackedWeight(PackedWeight):
    """`PackedWeight` with the fast decoders (`fast.apply` swaps the class and calls `configure`; parameter and
    buffer names are unchanged). `decode` through `mode` ("reference", "fast", "compile", "triton": the same bits;
    "triton" by `fast.grouped.decode_grouped` where its tile decoding applies, else as "fast");
    `linear(x)` / `matmul(x, index)` fused (`Kernels.matmul`, equal to fp32 rounding) for inputs of at most
    `fused_tokens` rows (0: never), `fused_rows` rows per pass, the packed bytes read as int32 words when `words`;
    inputs of more rows, up to `grouped_tokens` (0: never), through the grouped Triton kernel (`fast.grouped`, equal
    to fp32 rounding) where it applies (`takes_grouped`). Inputs of up to `gemv_tokens` rows (0: never) through
    `fast.gemv` from the weight reordered at configuration (`takes_gemv`; before the fused and grouped paths)."""

    mode: str
    fused_tokens: int
    fused_rows: int
    normal_range: bool
    words: bool
    kernels: Kernels
    grouped_tokens: int = 0
    grouped_launch: tuple  # (fast.grouped.Tiles, K splits), chosen at configuration
    decode_tiles: grouped.Tiles | None = None  # decode="triton" where the kernel decodes this weight: its launch
    gemv_tokens: int = 0
    gemv_sms: int = 1  # the device's SM count, for `fast.gemv.splits`
    # the one-to-few-row kernel: "triton" (`fast.gemv`, its copy in the buffers), "mma" (`fast.mma_gemv`, its copy in
    # the buffers) or "mma-stored" (`fast.mma_gemv` reading the stored planes: no buffers)
    gemv_kernel: str = "triton"
    table: bool = False  # the grouped and GEMV kernels decode this NVFP4 weight through its blocks' tables
    # a stack that prefill's sorted expert rows multiply through `fast.prefill_experts`: its launch (None: not)
    sorted_tiles: prefill_experts.Tiles | None = None

    def configure(self, kernels: Kernels, mode: str, fused_tokens: int, fused_rows: int, words: bool,
                  grouped_tokens: int = 0, gemv_tokens: int = 0, table: bool = False,
                  sorted_rows: bool = False, gemv_mode: str = "triton") -> None:
        """Set the decoders; reads the scales (and, for MXFP8 words, the bytes) on the host once. With `gemv_tokens`
        and a weight the kernels decode, stores `fast.gemv.reorder`'s copy as the buffers `GEMV_BUFFERS`. With
        `table`, an NVFP4 weight is decoded by the grouped and GEMV kernels through its blocks' tables. With
        `sorted_rows`, a stack the kernels decode multiplies prefill's sorted expert rows through
        `fast.prefill_experts` (`sorted_matmul`). With `gemv_mode` "mma", a weight on a GPU takes `fast.mma_gemv`
        for up to its `MAX_ROWS` rows instead, a stack read where it is stored where `mma_gemv.stored_supports` says
        so (no copy, up to `STORED_STACK_ROWS` rows), else from its reordered copy in the same buffers; with
        "mma-stored", every weight the kernel reads in place, up to `STORED_STACK_ROWS` rows, and no copy."""
        self.kernels, self.mode = kernels, mode
        self.fused_tokens, self.fused_rows = fused_tokens, fused_rows
        self.normal_range = scales_in_normal_range(self.fmt, self.weight_scale, self.weight_scale_2)
        # an MXFP8 weight holding an E4M3 NaN byte keeps the byte planes, which read it as NaN
        no_nan = self.fmt == NVFP4 or not has_e4m3_nan(self.weight)
        self.words = words and no_nan
        self.grouped_tokens = 0
        # the Triton kernels' tile decoding gives the reference's bf16 bits for scales in the normal range
        kernel_decodes = (self.normal_range and no_nan and self.dtype == torch.bfloat16 and grouped.AVAILABLE
                          and grouped.supports(self.fmt, self.shape[-1]))
        self.table = table and self.fmt == NVFP4 and kernel_decodes
        if grouped_tokens > 0 and kernel_decodes:
            self.grouped_tokens = min(grouped_tokens, grouped.MAX_ROWS)
            # chosen here, not while a compiled region is traced (it reads device properties)
            entries = self.weight.shape[0] if self.weight.dim() == 3 else 1
            self.grouped_launch = grouped.launch_for(self.fmt, entries, *self.shape[-2:], self.device)
        self.decode_tiles = grouped.tiles_for(self.fmt, self.device) if mode == "triton" and kernel_decodes else None
        stack = self.weight.dim() == 3
        self.sorted_tiles = (prefill_experts.tiles_for(self.device) if sorted_rows and kernel_decodes and stack
                             else None)
        for name in GEMV_BUFFERS:  # a configuration before this one may have made them
            self._buffers.pop(name, None)
        self.gemv_tokens, self.gemv_kernel = 0, "triton"
        # "mma" where the MMA kernel does not run (a GPU before sm_89, a K of part blocks) takes no one-to-few-row
        # kernel: the products of the paths without one, not `fast.gemv`'s copy of the weight; "mma-stored" makes no
        # copy at all, so a weight the kernel cannot read in place takes none either
        mma = gemv_mode in ("mma", "mma-stored")
        in_place = mma_gemv.stored_supports(self.fmt, self.weight, self.weight_scale)
        takes_mma = (mma and mma_gemv.supports(self.fmt, self.shape[-1]) and mma_gemv.runs_on(self.device)
                     and (gemv_mode == "mma" or in_place))
        if gemv_tokens > 0 and kernel_decodes and gemv.runs_on(self.device) and (not mma or takes_mma):
            self.gemv_sms = grouped.sm_count(self.device)
            if takes_mma:
                # expert stacks (most of the bytes) are read where they are stored, linears from their copy (faster
                # where the whole weight is read) unless "mma-stored"
                if (stack or gemv_mode == "mma-stored") and in_place:
                    self.gemv_kernel, reordered = "mma-stored", ()
                    self.gemv_tokens = min(gemv_tokens, mma_gemv.STORED_STACK_ROWS)
                else:
                    self.gemv_kernel, reordered = "mma", mma_gemv.reorder(self.fmt, *self.parts())
                    self.gemv_tokens = min(gemv_tokens, mma_gemv.MAX_ROWS)
            else:
                self.gemv_tokens = min(gemv_tokens, gemv.MAX_ROWS)
                reordered = gemv.reorder(self.fmt, *self.parts())
            for name, t in zip(GEMV_BUFFERS, reordered):
                self.register_buffer(name, t, persistent=False)
            if self.gemv_kernel != "triton":  # `fast.mma_gemv` adds its K splits in the kernel with these
                entries = self.weight.shape[0] if self.weight.dim() == 3 else 1
                self.register_buffer("gemv_counters", mma_gemv.counters_for(entries, self.shape[-2], self.device),
                                     persistent=False)

    def takes_gemv(self, x: torch.Tensor, rows: int) -> bool:
        """Whether a product of `rows` rows of `x` goes through `fast.gemv`: at most `gemv_tokens` (the weight's side
        was checked by `configure`: among it a bf16 compute dtype), x in the compute dtype, on a device the kernel
        runs on."""
        # the compute dtype read first, on every path: a compiled step saved across processes keeps only the
        # attributes its guards read, and torch saves an unread dtype attribute in a way it cannot load
        return (x.dtype == self.dtype and 0 < rows <= self.gemv_tokens and gemv.runs_on(x.device)
                and (self.gemv_kernel != "mma-stored" or self.weight.device == x.device))

    def gemv_product(self, x: torch.Tensor, index: torch.Tensor | None = None, active: torch.Tensor | None = None,
                     busy: int | None = None) -> torch.Tensor:
        """`fast.gemv.packed_product` on the reordered copy, or `fast.mma_gemv`'s on the stored weight or its copy:
        x `[M, K]` or `[P, M, K]`; bf16 `[P, M, N]`."""
        if self.gemv_kernel == "mma-stored":
            return mma_gemv.packed_product_stored(x, self.fmt, *self.parts(), index=index, active=active,
                                                  sms=self.gemv_sms, busy=busy, counters=self.gemv_counters)
        if self.gemv_kernel == "mma":
            return mma_gemv.packed_product(x, self.shape[-2], self.gemv_words, self.gemv_scales, self.gemv_global,
                                           index=index, active=active, sms=self.gemv_sms, busy=busy,
                                           counters=self.gemv_counters)
        return gemv.packed_product(x, self.fmt, self.shape[-2], self.gemv_words, self.gemv_scales, self.gemv_global,
                                   index=index, active=active, sms=self.gemv_sms, busy=busy, table=self.table)

    def takes_ranged(self, x: torch.Tensor) -> bool:
        """Whether rows of x sorted by stack entry multiply this stack by `fast.mma_gemv`'s ranges (`ranged_product`):
        a stack configured for that kernel (`gemv_mode` "mma" or "mma-stored"), x in the compute dtype on a device
        the kernel runs on, the stack's bytes there too."""
        return (x.dtype == self.dtype and self.weight.dim() == 3 and self.gemv_kernel in ("mma", "mma-stored")
                and self.gemv_tokens > 0 and gemv.runs_on(x.device) and self.weight.device == x.device)

    def ranged_product(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """x bf16 `[R, K]` sorted by entry, entry e's rows ending at ends[e] (int32 `[E]`, cumulative, ends[E - 1] =
        R), each row times its own entry (`fast.mma_gemv`'s `ends`, read in place or from the copy): bf16 `[R, N]`."""
        if self.gemv_kernel == "mma-stored":
            return mma_gemv.packed_product_stored(x, self.fmt, *self.parts(), ends=ends, sms=self.gemv_sms,
                                                  counters=self.gemv_counters)
        return mma_gemv.packed_product(x, self.shape[-2], self.gemv_words, self.gemv_scales, self.gemv_global,
                                       ends=ends, sms=self.gemv_sms, counters=self.gemv_counters)

    def takes_grouped(self, x: torch.Tensor, rows: int) -> bool:
        """Whether a product of `rows` rows of `x` goes through the grouped kernel: more rows than the fused matmul
        takes and at most `grouped_tokens`, a bf16 x, on CUDA (or under the Triton interpreter). The weight's side
        (scales in the normal range, no E4M3 NaN, bf16 compute dtype, K a multiple of 32) was checked by
        `configure`."""
        if not self.fused_tokens < rows <= self.grouped_tokens or x.dtype != torch.bfloat16:
            return False
        return grouped.runs_on(x.device)

    def takes_sorted(self, x: torch.Tensor) -> bool:
        """Whether sorted expert rows x multiply this stack through `fast.prefill_experts` (`sorted_matmul`): the
        stack was configured for it, x is bf16 on a device the kernel runs on and the stack's bytes are there too
        (an offloaded stack may sit on the host)."""
        return (self.sorted_tiles is not None and x.dtype == torch.bfloat16 and grouped.runs_on(x.device)
                and self.weight.device == x.device)

    def sorted_matmul(self, x: torch.Tensor, offs: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        """`torch._grouped_mm(x, self.decode(index).transpose(-2, -1), offs=offs)` with the stack's tiles decoded in
        the kernel's registers (`fast.prefill_experts.sorted_packed_matmul`): x bf16 `[R, K]` sorted by group,
        offs int32 `[G]` the groups' ends, index `[G]` their entries (None: group g is entry g). bf16 `[R, N]`."""
        return prefill_experts.sorted_packed_matmul(x, self.fmt, *self.parts(), offs, index, tiles=self.sorted_tiles,
                                                    table=self.table)

    def decode(self, index: int | torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        w, s, g = self.parts(index)
        dtype = dtype or self.dtype
        if self.decode_tiles is not None and dtype == torch.bfloat16 and w.dim() <= 3 and grouped.runs_on(w.device):
            return grouped.decode_grouped(self.fmt, w, s, g, tiles=self.decode_tiles, table=self.table)
        if self.mode in ("fast", "triton"):
            return decode_fast(self.fmt, w, s, g, dtype)
        if self.mode == "compile":
            return self.kernels.decode(self.fmt, w, s, g, dtype)
        return super().decode(index, dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.takes_gemv(x, rows):
            y = self.gemv_product(x.reshape(rows, x.shape[-1]))[0]
            return y.reshape(*x.shape[:-1], y.shape[-1])
        if 0 < rows <= self.fused_tokens:
            y = self.kernels.matmul(x.reshape(rows, x.shape[-1]), self.fmt, *self.parts(), self.dtype,
                                    rows_per_pass=self.fused_rows, normal_range=self.normal_range, words=self.words)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        if self.takes_grouped(x, rows):
            tiles, split = self.grouped_launch
            y = grouped.packed_matmul_grouped(x.reshape(rows, x.shape[-1]), self.fmt, *self.parts(), tiles=tiles,
                                              split=split, table=self.table)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return F.linear(x, self.decode())

    def matmul(self, x: torch.Tensor, index: torch.Tensor | None = None,
               active: torch.Tensor | None = None, busy: int | None = None) -> torch.Tensor:
        """`PackedWeight.matmul`; `active` (int32 `[E]`, only with index None): a hint that the entries flagged 0
        are not needed, whose rows the grouped kernel then leaves at zero without reading them (other paths compute
        them); `busy`: at most this many are flagged (sizes `fast.gemv`'s K splits)."""
        if self.takes_gemv(x, x.shape[-2]):
            y = self._gemv_matmul(x, index, active, busy)
            if y is not None:
                return y
        if 0 < x.shape[-2] <= self.fused_tokens:
            return self.kernels.matmul(x, self.fmt, *self.parts(), self.dtype, index, self.fused_rows,
                                       self.normal_range, self.words)
        if index is None and self._grouped_operand(x) and self.takes_grouped(x, x.shape[-2]):
            tiles, split = self.grouped_launch
            return grouped.packed_matmul_grouped(x, self.fmt, *self.parts(), active=active, tiles=tiles, split=split,
                                                 table=self.table)
        return torch.matmul(x, self.decode(index).transpose(-1, -2))

    def _gemv_matmul(self, x: torch.Tensor, index: torch.Tensor | None, active: torch.Tensor | None,
                     busy: int | None = None) -> torch.Tensor | None:
        """`matmul` through `fast.gemv` for the shapes it takes (None for others): a linear and `[M, K]`; a stack and
        `[M, K]` or `[E, M, K]` (index None, `active` flags allowed); a stack and x `[*B, M, K]` against entries
        `index` (`*B` broadcasts against its shape `I`): each (broadcast) entry reads its own expert."""
        m, k = x.shape[-2:]
        if index is None:
            entries = self.weight.shape[0] if self.weight.dim() == 3 else 0
            if x.dim() == 2 and entries:
                return self.gemv_product(x, active=active, busy=busy)
            if x.dim() == 2:
                return self.gemv_product(x)[0]
            if x.dim() == 3 and x.shape[0] == entries:
                return self.gemv_product(x, active=active, busy=busy)
            return None
        if self.weight.dim() != 3:
            return None
        shape = torch.broadcast_shapes(x.shape[:-2], index.shape)
        ids = index.expand(shape).reshape(-1)
        # a row shared by every entry is read in place; otherwise each entry's rows are laid out once
        xs = x.reshape(1, m, k) if x[..., 0, 0].numel() == 1 else x.expand(*shape, m, k).reshape(-1, m, k)
        return self.gemv_product(xs, index=ids).view(*shape, m, -1)

    def _grouped_operand(self, x: torch.Tensor) -> bool:
        """Whether x's shape is one the grouped kernel takes against this weight: `[M, K]`, or `[E, M, K]` against
        a stack of E entries."""
        stack = self.weight.dim() == 3
        return x.dim() == 2 or (x.dim() == 3 and stack and x.shape[0] == self.weight.shape[0])

    def extra_repr(self) -> str:
        fused = f", fused_tokens={self.fused_tokens}" if self.fused_tokens else ""
        grouped = f", grouped_tokens={self.grouped_tokens}" if self.grouped_tokens else ""
        gemv = f", gemv_tokens={self.gemv_tokens}" if self.gemv_tokens else ""
        return f"{super().extra_repr()}, decode={self.mode}{fused}{grouped}{gemv}"
