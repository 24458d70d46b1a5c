"""Exact NVFP4 and MXFP8 codecs: decoding checkpoint tensors, fake-quantizing activations, and
quantizing synthetic weights.

Every function here is pure (no state, no in-place change of its inputs) and bit-exact: its
docstring fixes the order of every float32 operation, so a kernel can be tested against it with
`torch.equal`, not a tolerance. The formats (spec `checkpoint.md`):

* E2M1 (FP4): 4-bit code, bit 3 = sign, bits 0-2 index `E2M1_MAGNITUDES`; no Inf or NaN.
  Two codes per byte, element `2i` in the low nibble.
* E4M3 (`torch.float8_e4m3fn`): max 448, NaN = byte 0x7f / 0xff, no Inf, subnormals down to 2^-9.
* E8M0: unsigned biased exponent, value 2^(code - 127); code 255 is NaN.
* NVFP4 = E2M1 elements, one E4M3 scale per 16 elements along K, one float32 global scale.
* MXFP8 = E4M3 elements, one E8M0 scale per 32 elements along K.

Blocks always run along the last dimension. Undecodable or unencodable data raises
`QuantFormatError`; the message names the tensor when the caller passed `name`.
"""

from __future__ import annotations

import torch

from ..errors import QuantFormatError

__all__ = [
    "E2M1_MAGNITUDES",
    "E4M3_MAX",
    "MXFP8_BLOCK",
    "NVFP4_BLOCK",
    "decode_e2m1",
    "decode_e8m0",
    "dequant_mxfp8",
    "dequant_nvfp4",
    "fake_quant_mxfp8",
    "fake_quant_nvfp4",
    "pack_fp4",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "round_to_e2m1",
    "round_to_e4m3",
    "unpack_fp4",
]

NVFP4_BLOCK = 16
MXFP8_BLOCK = 32
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Smallest positive E4M3 value (a subnormal); ModelOpt's floor for weight block scales.
_E4M3_MIN_SUBNORMAL = 2.0**-9
# E8M0 exponent range once the NaN code 255 is excluded: codes 0..254.
_E8M0_MIN_EXP = -127
_E8M0_MAX_EXP = 127

E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
# Indexed by the full 4-bit code; code 8 is -0.0 so the sign survives decoding.
_E2M1_VALUES = torch.cat([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])

# fp32(1/6) as the CUDA/vLLM activation quantizer uses it (0x3E2AAAAB), a correctly rounded
# float32 division rather than a float64 constant rounded a second time.
_FP32_ONE_SIXTH = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(6.0, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# helpers


def _label(name: str) -> str:
    return f"tensor '{name}'" if name else "unnamed tensor"


def _first_index(mask: torch.Tensor) -> list[int]:
    return torch.nonzero(mask)[0].tolist()


def _as_f32(x: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise QuantFormatError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise QuantFormatError(f"{what}: expected a floating-point tensor, got {x.dtype}")
    return x.to(torch.float32)


def _check_last_dim(k: int, block: int, fmt: str, label: str) -> None:
    if k % block != 0:
        raise QuantFormatError(
            f"{label}: {fmt} needs the last dimension to be a multiple of {block} "
            f"(one scale per {block} elements), got {k}"
        )


def _bytes(t: torch.Tensor, allowed: tuple[torch.dtype, ...], what: str, label: str) -> torch.Tensor:
    """Reinterpret (never convert) a storage tensor as its raw uint8 bytes."""
    if not isinstance(t, torch.Tensor):
        raise QuantFormatError(f"{label}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise QuantFormatError(f"{label}: {what} has dtype {t.dtype}, expected one of {names}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _pow2_f32(k: torch.Tensor) -> torch.Tensor:
    """2^k as float32, built from bits so it is exact for every integer k in [-149, 127]."""
    k = k.to(torch.int32)
    normal = (k + 127).clamp(min=0) << 23
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def _rceil_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Smallest integer k with amax <= 448 * 2^k, clamped to the E8M0 range [-127, 127].

    Exact integer arithmetic instead of `ceil(log2(amax / 448))` in floats: with
    amax = m * 2^e (m in [0.5, 1), from frexp) and 448 = 0.875 * 2^9, k = e - 9 when m <= 0.875,
    else e - 8. A float log2 rounds to an integer for amax a few ulps above 448 * 2^j and would
    pick a scale one binade too small. amax == 0 gets -127; amax == +inf gets 127 (the
    saturating E8M0 conversion of FlashInfer). NaN must be handled by the caller.
    """
    mantissa, exponent = torch.frexp(amax)
    k = torch.where(mantissa <= 0.875, exponent - 9, exponent - 8)
    k = torch.where(amax == 0, torch.full_like(k, _E8M0_MIN_EXP), k)
    k = torch.where(torch.isinf(amax), torch.full_like(k, _E8M0_MAX_EXP), k)
    return k.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)


def _global_scale_f32(value: torch.Tensor | float, what: str, label: str) -> torch.Tensor:
    """A scalar float32 scale that must be finite and >= 0 (returned with shape ())."""
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.float32:
            raise QuantFormatError(f"{label}: {what} has dtype {value.dtype}, expected torch.float32")
        if value.numel() != 1:
            raise QuantFormatError(
                f"{label}: {what} must hold one value (shape () or [1]), got shape {list(value.shape)}"
            )
        t = value.reshape(())
    else:
        t = torch.tensor(float(value), dtype=torch.float32)
    if not bool(torch.isfinite(t)) or bool(t < 0):
        raise QuantFormatError(f"{label}: {what} must be finite and >= 0, got {t.item()!r}")
    return t


# ---------------------------------------------------------------------------------------------
# element formats


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Decode E2M1 codes to float32.

    Args:
        codes: uint8 tensor of any shape, every value in 0..15.

    Returns:
        float32 tensor of the same shape: `(-1)^bit3 * E2M1_MAGNITUDES[code & 7]`, exact.
        Code 8 decodes to -0.0.

    Raises:
        QuantFormatError: codes is not uint8 or holds a value above 15.
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise QuantFormatError(
            f"decode_e2m1: codes must be a uint8 tensor, got {getattr(codes, 'dtype', codes)}"
        )
    bad = codes > 15
    if bool(bad.any()):
        raise QuantFormatError(
            f"decode_e2m1: E2M1 codes are 4-bit, got {int(codes.max())} at index {_first_index(bad)}"
        )
    return _e2m1_lookup(codes)


def _e2m1_lookup(codes: torch.Tensor) -> torch.Tensor:
    # For codes already known to be 4-bit (from unpack_fp4 / round_to_e2m1), skipping the range
    # check saves a full pass over every expert weight at load time.
    return _E2M1_VALUES.to(codes.device)[codes.to(torch.int32)]


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Split packed FP4 bytes into one 4-bit code per element.

    Args:
        packed: uint8 `[..., K/2]` (a `torch.float4_e2m1fn_x2` tensor is read as its bytes).

    Returns:
        uint8 `[..., K]` codes in 0..15: element `2i` is byte `i`'s low nibble, `2i+1` its high
        nibble (the ModelOpt / compressed-tensors / vLLM order).
    """
    b = _bytes(packed, (torch.uint8, torch.float4_e2m1fn_x2), "packed FP4 data", "unpack_fp4")
    if b.ndim == 0:
        raise QuantFormatError("unpack_fp4: packed FP4 data must have at least one dimension")
    pairs = torch.stack((b & 0x0F, b >> 4), dim=-1)
    return pairs.reshape(*b.shape[:-1], 2 * b.shape[-1])


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte; the inverse of `unpack_fp4`.

    Args:
        codes: uint8 `[..., K]`, K even, every value in 0..15.

    Returns:
        uint8 `[..., K/2]` with byte `i = codes[2i] | codes[2i+1] << 4`.
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise QuantFormatError(
            f"pack_fp4: codes must be a uint8 tensor, got {getattr(codes, 'dtype', codes)}"
        )
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise QuantFormatError(f"pack_fp4: last dimension must be even, got shape {list(codes.shape)}")
    if bool((codes > 15).any()):
        raise QuantFormatError(f"pack_fp4: codes must be 4-bit (0..15), got max {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value and return its 4-bit code.

    Args:
        x: floating tensor of any shape; converted to float32 first (exact for bf16/fp16).

    Returns:
        uint8 codes, same shape. The magnitude is rounded to nearest, ties to even (the even
        neighbour is the one with mantissa bit 0: 0, 1, 2, 4), and saturates at 6 (inf -> 6):
        ties 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; above 5 -> 6.
        Bit 3 is the sign bit of x, so -0.0 and negatives that round to zero give code 8
        (ModelOpt uses `x < 0` and gives code 0 for -0.0; the decoded value is zero either way).

    Raises:
        QuantFormatError: x holds NaN (E2M1 has no NaN).
    """
    x = _as_f32(x, "round_to_e2m1")
    if bool(torch.isnan(x).any()):
        raise QuantFormatError("round_to_e2m1: input holds NaN, which E2M1 cannot encode")
    a = x.abs().clamp(max=E2M1_MAX)
    # Within each binade the E2M1 grid is uniform (steps 0.5, 1, 2), so scaling by a power of two
    # (exact) and torch.round (half to even) gives RNE; the rounded value is the code directly.
    index = torch.where(
        a < 2.0,
        torch.round(a * 2.0),
        torch.where(a < 4.0, torch.round(a) + 2.0, torch.round(a * 0.5) + 4.0),
    ).to(torch.uint8)
    return index | (torch.signbit(x).to(torch.uint8) << 3)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest float8_e4m3fn value, saturating, and return it as float32.

    Args:
        x: floating tensor of any shape; converted to float32 first (exact for bf16/fp16, a
           rounding of its own for float64).

    Returns:
        float32 tensor, same shape, every value exactly representable in E4M3: x clamped to
        [-448, 448] (so +-inf -> +-448), then rounded to nearest, ties to even, subnormals
        included (2^-10 -> 0, 3*2^-10 -> 2^-8). NaN stays NaN; signs of zeros are kept.
        The clamp comes first because not every torch version saturates in the cast.
    """
    x = _as_f32(x, "round_to_e4m3")
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def decode_e8m0(codes: torch.Tensor, *, name: str = "") -> torch.Tensor:
    """Decode E8M0 scale codes to float32 powers of two.

    Args:
        codes: uint8 (or `torch.float8_e8m0fnu`, read as its bytes) of any shape.
        name: tensor name used in error messages.

    Returns:
        float32 tensor, same shape: exactly 2^(code - 127). Code 0 is 2^-127, a float32 subnormal.

    Raises:
        QuantFormatError: a code is 255 (the E8M0 NaN) or the dtype is wrong.
    """
    label = _label(name)
    c = _bytes(codes, (torch.uint8, torch.float8_e8m0fnu), "E8M0 scale", label)
    nan = c == 255
    if bool(nan.any()):
        raise QuantFormatError(
            f"{label}: E8M0 scale code 255 (NaN) at {int(nan.sum())} position(s), "
            f"first at index {_first_index(nan)}"
        )
    return _pow2_f32(c.to(torch.int32) - 127)


# ---------------------------------------------------------------------------------------------
# checkpoint decoding


def dequant_nvfp4(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    *,
    name: str = "",
) -> torch.Tensor:
    """Decode a ModelOpt NVFP4 weight to float32.

    Args:
        weight: uint8 `[*L, N, K/2]` packed E2M1 codes (low nibble = even element); L is empty
            for a linear or `[E]` for stacked experts. `float4_e2m1fn_x2` is read as bytes.
        weight_scale: float8_e4m3fn (or its raw uint8 bytes) `[*L, N, K/16]`, row-major.
        weight_scale_2: float32, shape `()` or `[1]` (one global for everything), or `L` /
            `[*L, 1]` (one global per leading index, e.g. per expert). Must be finite and >= 0.
        name: tensor name used in error messages.

    Returns:
        float32 `[*L, N, K]`,
        `out[..., n, k] = e2m1[..., n, k] * (float(weight_scale[..., n, k // 16]) * weight_scale_2[...])`,
        every product rounded to float32 in exactly that order (the bracketed product first).
        Block scales with the sign bit set are decoded as signed values, not rejected.

    Raises:
        QuantFormatError: wrong dtypes or shapes, K not a multiple of 16, an E4M3 NaN byte in
            weight_scale, a non-finite or negative weight_scale_2.
    """
    label = _label(name)
    w = _bytes(weight, (torch.uint8, torch.float4_e2m1fn_x2), "NVFP4 weight", label)
    if w.ndim < 2:
        raise QuantFormatError(f"{label}: NVFP4 weight must be [..., N, K/2], got shape {list(w.shape)}")
    *lead, n, half_k = w.shape
    k = 2 * half_k
    _check_last_dim(k, NVFP4_BLOCK, "NVFP4", label)

    s = _bytes(weight_scale, (torch.float8_e4m3fn, torch.uint8), "NVFP4 weight_scale", label)
    expected = [*lead, n, k // NVFP4_BLOCK]
    if list(s.shape) != expected:
        raise QuantFormatError(
            f"{label}: NVFP4 weight_scale has shape {list(s.shape)}, expected {expected} "
            f"for packed weight {list(w.shape)} (K = {k}, one scale per {NVFP4_BLOCK})"
        )
    nan = (s & 0x7F) == 0x7F
    if bool(nan.any()):
        raise QuantFormatError(
            f"{label}: NVFP4 weight_scale holds E4M3 NaN (byte 0x7f/0xff) at {int(nan.sum())} "
            f"position(s), first at index {_first_index(nan)}"
        )

    return decode_nvfp4(w, s.view(torch.float8_e4m3fn), _per_lead_global(weight_scale_2, lead, label))


def decode_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """`dequant_nvfp4` without its checks (they read the tensors on the host): for tensors checked once at load.

    weight uint8 `[*L, N, K/2]`, weight_scale float8_e4m3fn `[*L, N, K/16]`, weight_scale_2 float32 with one
    element, or one per leading index (`[*L]`, `[*L, 1]` or `[*L, 1, 1]`). Returns float32 `[*L, N, K]`, the
    same operations in the same order as `dequant_nvfp4`, so the same bits."""
    *lead, n, half_k = weight.shape
    k = 2 * half_k
    g2 = weight_scale_2.reshape(1, 1) if weight_scale_2.numel() == 1 else weight_scale_2.reshape(*lead, 1, 1)
    block = weight_scale.to(torch.float32) * g2  # [*L, N, K/16]
    values = _e2m1_lookup(unpack_fp4(weight)).reshape(*lead, n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    return (values * block.unsqueeze(-1)).reshape(*lead, n, k)


def _per_lead_global(value: torch.Tensor | float, lead: list[int], label: str) -> torch.Tensor:
    """weight_scale_2 as float32 shaped `[*L, 1, 1]` (or `[1, 1]`) to broadcast over `[*L, N, K/16]`."""
    what = "NVFP4 weight_scale_2"
    if not isinstance(value, torch.Tensor) or value.numel() == 1:
        return _global_scale_f32(value, what, label).reshape(1, 1)
    if value.dtype != torch.float32:
        raise QuantFormatError(f"{label}: {what} has dtype {value.dtype}, expected torch.float32")
    shape = list(value.shape)
    if not lead or shape not in (lead, [*lead, 1]):
        raise QuantFormatError(
            f"{label}: {what} has shape {shape}; expected () or [1]"
            + (f", or {lead} / {[*lead, 1]} (one per leading index)" if lead else "")
        )
    bad = ~torch.isfinite(value) | (value < 0)
    if bool(bad.any()):
        raise QuantFormatError(
            f"{label}: {what} must be finite and >= 0, got {value[bad].flatten()[0].item()!r} "
            f"at index {_first_index(bad)}"
        )
    return value.reshape(*lead, 1, 1)


def dequant_mxfp8(weight: torch.Tensor, scale: torch.Tensor, *, name: str = "") -> torch.Tensor:
    """Decode an MXFP8 weight (OCP MX, E4M3 elements, E8M0 scale per 32) to float32.

    Args:
        weight: float8_e4m3fn (or its raw uint8 bytes) `[..., N, K]`.
        scale: uint8 biased exponents (or `float8_e8m0fnu`, read as bytes) `[..., N, K/32]`:
            MiniMax's `weight_scale_inv` or ModelOpt's `weight_scale`; it multiplies.
        name: tensor name used in error messages.

    Returns:
        float32 `[..., N, K]`, `out[..., k] = float(weight[..., k]) * 2^(scale[..., k // 32] - 127)`.
        Exact: a product of an E4M3 value and a power of two is always a float32 value or an
        overflow, and overflow is an error.

    Raises:
        QuantFormatError: wrong dtypes or shapes, K not a multiple of 32, an E4M3 NaN byte
            (0x7f/0xff) in weight, a scale code 255, or a decoded value beyond float32 range.
    """
    label = _label(name)
    w = _bytes(weight, (torch.float8_e4m3fn, torch.uint8), "MXFP8 weight", label)
    if w.ndim < 1:
        raise QuantFormatError(f"{label}: MXFP8 weight must be [..., K], got a scalar")
    k = w.shape[-1]
    _check_last_dim(k, MXFP8_BLOCK, "MXFP8", label)
    s = _bytes(scale, (torch.uint8, torch.float8_e8m0fnu), "MXFP8 scale", label)
    expected = [*w.shape[:-1], k // MXFP8_BLOCK]
    if list(s.shape) != expected:
        raise QuantFormatError(
            f"{label}: MXFP8 scale has shape {list(s.shape)}, expected {expected} "
            f"for weight {list(w.shape)} (one scale per {MXFP8_BLOCK})"
        )
    nan = (w & 0x7F) == 0x7F
    if bool(nan.any()):
        raise QuantFormatError(
            f"{label}: MXFP8 weight holds E4M3 NaN (byte 0x7f/0xff) at {int(nan.sum())} "
            f"position(s), first at index {_first_index(nan)}"
        )
    decode_e8m0(s, name=name)  # refuses code 255
    out = decode_mxfp8(w.view(torch.float8_e4m3fn), s)
    inf = torch.isinf(out)
    if bool(inf.any()):
        raise QuantFormatError(
            f"{label}: MXFP8 weight decodes beyond float32 range (scale code too large) at "
            f"index {_first_index(inf)}"
        )
    return out


def decode_mxfp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`dequant_mxfp8` without its checks: weight float8_e4m3fn `[..., N, K]`, scale uint8 E8M0 `[..., N, K/32]`
    (codes below 255). Returns float32 `[..., N, K]`, `float(weight) * 2^(code - 127)`, exact."""
    k = weight.shape[-1]
    x = _pow2_f32(scale.to(torch.int32) - 127)
    values = weight.to(torch.float32)
    return (values.reshape(*weight.shape[:-1], k // MXFP8_BLOCK, MXFP8_BLOCK) * x.unsqueeze(-1)).reshape(weight.shape)


# ---------------------------------------------------------------------------------------------
# quantization (synthetic checkpoints)


def quantize_nvfp4(
    w: torch.Tensor, *, global_amax: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a weight to NVFP4 in the ModelOpt export convention (dynamic, non-calibrated).

    Args:
        w: floating `[..., K]` (normally `[N, K]`), K a multiple of 16, all finite; converted to
           float32 first.
        global_amax: overrides `amax(|w|)` for the global scale, so that w1 and w3 of one expert
            can share one `weight_scale_2` (pass the max of both). Must be finite and >= 0. If it
            is smaller than amax(|w|), block scales saturate at 448 and codes at +-6.

    Returns:
        `(weight, weight_scale, weight_scale_2)`:
        * `weight_scale_2`: float32 `()`, `amax / 2688` (2688 = 6 * 448) in float32. When amax is
          0 (an all-zero weight) it is 1.0 instead, because ModelOpt's 0/0 would make NaN scales.
        * `weight_scale`: float8_e4m3fn `[..., K/16]`: per block `t = amax_blk / (6 * weight_scale_2)`
          (the product `6 * weight_scale_2` rounded first, as ModelOpt does); `t = 1.0` where
          `t == 0`; then `clamp(t, 2^-9, 448)` and RNE to E4M3. The lower clamp keeps tiny
          blocks from a zero scale; the upper one only matters with a small `global_amax`.
        * `weight`: uint8 `[..., K/2]` packed codes of
          `round_to_e2m1(w / (float(weight_scale) * weight_scale_2))`, the bracketed product
          rounded first (ModelOpt's order).
        `dequant_nvfp4(*result)` reproduces w to within half an E2M1 step at the block scale.

    Raises:
        QuantFormatError: K not a multiple of 16, non-finite w or global_amax, or a global scale
            that underflows to 0 for a nonzero amax.
    """
    x = _as_f32(w, "quantize_nvfp4")
    if x.ndim == 0:
        raise QuantFormatError("quantize_nvfp4: w must have at least one dimension")
    k = x.shape[-1]
    _check_last_dim(k, NVFP4_BLOCK, "NVFP4", "quantize_nvfp4")
    if not bool(torch.isfinite(x).all()):
        raise QuantFormatError("quantize_nvfp4: w holds NaN or Inf")
    if global_amax is None:
        amax = x.abs().amax() if x.numel() else torch.tensor(0.0)
    else:
        amax = _global_scale_f32(global_amax, "global_amax", "quantize_nvfp4")
    scale_2 = amax / (6.0 * 448.0)
    if bool(amax == 0):
        scale_2 = torch.tensor(1.0, dtype=torch.float32)
    elif bool(scale_2 == 0):
        raise QuantFormatError(f"quantize_nvfp4: global amax {amax.item()!r} is too small (scale underflows)")
    scale_2 = scale_2.reshape(()).to(torch.float32)

    blocks = x.reshape(*x.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    t = blocks.abs().amax(-1) / (6.0 * scale_2)
    t = torch.where(t == 0, torch.ones_like(t), t)
    block_scale = t.clamp(_E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn)

    divisor = block_scale.to(torch.float32) * scale_2
    codes = round_to_e2m1(blocks / divisor.unsqueeze(-1)).reshape(x.shape)
    return pack_fp4(codes), block_scale, scale_2


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight to MXFP8 with RCEIL block exponents (the ModelOpt export convention).

    Args:
        w: floating `[..., K]` (normally `[N, K]`), K a multiple of 32, all finite; converted to
           float32 first.

    Returns:
        `(weight, scale)`: float8_e4m3fn `[..., K]` and uint8 `[..., K/32]` biased exponents.
        Per block, the exponent is the smallest integer e with `amax_blk <= 448 * 2^e` (RCEIL:
        `2^ceil(log2(amax/448))`, so the block max never saturates), computed exactly from the
        float's exponent bits, clamped to [-127, 127]; an all-zero block gets -127 (code 0), as
        ModelOpt's clamp gives. ModelOpt evaluates `ceil(log2(amax / 448))` with float32 log2,
        which can round down for amax a few ulps above `448 * 2^j`; then the block max saturates
        to 448 there, here it does not. Elements are `round_to_e4m3(w / 2^e)` (RNE, saturating;
        the division by a power of two is exact).

    Raises:
        QuantFormatError: K not a multiple of 32, or w holds NaN or Inf.
    """
    x = _as_f32(w, "quantize_mxfp8")
    if x.ndim == 0:
        raise QuantFormatError("quantize_mxfp8: w must have at least one dimension")
    k = x.shape[-1]
    _check_last_dim(k, MXFP8_BLOCK, "MXFP8", "quantize_mxfp8")
    if not bool(torch.isfinite(x).all()):
        raise QuantFormatError("quantize_mxfp8: w holds NaN or Inf")
    blocks = x.reshape(*x.shape[:-1], k // MXFP8_BLOCK, MXFP8_BLOCK)
    e = _rceil_exponent(blocks.abs().amax(-1))
    elements = round_to_e4m3(blocks / _pow2_f32(e).unsqueeze(-1))
    return elements.reshape(x.shape).to(torch.float8_e4m3fn), (e + 127).to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# activation fake-quantization (act_quant="emulate")


def fake_quant_nvfp4(x: torch.Tensor, input_scale: torch.Tensor | float) -> torch.Tensor:
    """Quantize-dequantize activations through NVFP4 as the CUDA/vLLM reference quantizer does.

    Args:
        x: floating `[..., K]`, K a multiple of 16. Blocks are 16 consecutive elements of the
           last dimension (per row).
        input_scale: the checkpoint's float32 `input_scale` (shape `()` or `[1]`, or a Python
            float, rounded to float32), positive and finite (1.0 in the M3 NVIDIA build).

    Returns:
        Same shape and dtype as x. All arithmetic is float32 on `x.to(float32)`, each operation
        rounded to float32 in this order:
            g     = 1 / input_scale
            amax  = max |x| over the block
            s     = round_to_e4m3(g * (amax * fp32(1/6)))        # fp32(1/6) = 0x3E2AAAAB
            r     = 1 / (s / g), or 0 where s == 0                # zero block
            q     = decode_e2m1(round_to_e2m1(x * r))             # RNE, saturating at 6
            x_hat = q * (s / g)
        then one rounding of x_hat to x.dtype. The spec's `q * s / g` is read as the block's
        dequantization factor `s / g` first, then the product with q; this is the order
        `shared/testdata/quant_vectors.json` was generated with (`(q * s) / g` differs by one ulp
        in some elements when input_scale != 1). Signs of zeros follow x. This is not ModelOpt's
        or torchao's fake-quant, which divide by the scale (`x / s`) and differ at exact ties.
        A block holding NaN comes out all NaN (E2M1 cannot carry it, and a forward pass should
        show the fault, not stop); +-inf saturates like the hardware's satfinite conversion.

    Raises:
        QuantFormatError: K not a multiple of 16, or input_scale not positive and finite.
    """
    xf, blocks, g = _nvfp4_activation_blocks(x, input_scale, "fake_quant_nvfp4")
    nan_block = torch.isnan(blocks.abs().amax(-1, keepdim=True))
    blocks = torch.where(nan_block, torch.zeros_like(blocks), blocks)
    codes, s = _nvfp4_activation_codes(blocks, g)
    x_hat = _e2m1_lookup(codes) * (s / g)
    x_hat = torch.where(nan_block, torch.full_like(x_hat, float("nan")), x_hat)
    return x_hat.reshape(xf.shape).to(x.dtype)


def _nvfp4_activation_blocks(x: torch.Tensor, input_scale: torch.Tensor | float, label: str
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x as fp32, its blocks of 16 [..., K/16, 16], g = 1 / input_scale in fp32), with the arguments checked."""
    xf = _as_f32(x, label)
    if xf.ndim == 0:
        raise QuantFormatError(f"{label}: x must have at least one dimension")
    k = xf.shape[-1]
    _check_last_dim(k, NVFP4_BLOCK, "NVFP4", f"{label} input")
    scale = _global_scale_f32(input_scale, "input_scale", label).to(xf.device)
    g = 1.0 / scale
    if not bool(scale > 0) or not bool(torch.isfinite(g)):
        raise QuantFormatError(f"{label}: input_scale must be positive, got {scale.item()!r}")
    return xf, xf.reshape(*xf.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK), g


def _nvfp4_activation_codes(blocks: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 codes [..., 16] and fp32 block scales s [..., 1] (E4M3 values) of finite fp32 blocks: the steps of
    `fake_quant_nvfp4`'s docstring up to q."""
    amax = blocks.abs().amax(-1, keepdim=True)
    s = round_to_e4m3(g * (amax * _FP32_ONE_SIXTH.to(blocks.device)))
    r = torch.where(s == 0, torch.zeros_like(s), 1.0 / (s / g))
    return round_to_e2m1(blocks * r), s


def quantize_activation_nvfp4(x: torch.Tensor, input_scale: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """The NVFP4 activation operand a W4A4 kernel takes, by `fake_quant_nvfp4`'s steps (same blocks, same
    roundings): `(codes, scales)` with codes uint8 `[..., K/2]` (packed E2M1, even element in the low nibble, as
    `pack_fp4`) and scales float8_e4m3fn `[..., K/16]` (the block scales `s`). With `g = 1 / input_scale` in
    fp32, `decode_e2m1(unpack_fp4(codes)) * (scales.float() / g)` is `fake_quant_nvfp4(x, input_scale)` before its
    final rounding to x.dtype. x must be finite (a kernel's operand has no NaN block)."""
    xf, blocks, g = _nvfp4_activation_blocks(x, input_scale, "quantize_activation_nvfp4")
    if not bool(torch.isfinite(xf).all()):
        raise QuantFormatError("quantize_activation_nvfp4: x holds NaN or Inf")
    codes, s = _nvfp4_activation_codes(blocks, g)
    return pack_fp4(codes.reshape(xf.shape)), s.squeeze(-1).to(torch.float8_e4m3fn)


def fake_quant_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize activations through MXFP8 with RCEIL scales (FlashInfer/cuBLAS recipe).

    Args:
        x: floating `[..., K]`, K a multiple of 32. Blocks are 32 consecutive elements of the
           last dimension.

    Returns:
        Same shape and dtype as x. On `x.to(float32)`, per block:
            X     = 2^e, e = smallest integer with amax <= 448 * 2^e, clamped to [-127, 127]
                    (exact exponent arithmetic, see `quantize_mxfp8`; amax == 0 -> e = -127)
            x_hat = round_to_e4m3(x / X) * X
        Both the division and the multiplication by a power of two are exact in float32, so the
        result is exactly an MXFP8-representable value; a zero block stays zero (signs kept).
        Then one rounding to x.dtype (exact for bf16/fp32; float16 can overflow near its max).
        A block holding NaN comes out all NaN; a block holding +-inf gets e = 127, so its inf
        elements stay inf.

    Raises:
        QuantFormatError: K not a multiple of 32.
    """
    xf = _as_f32(x, "fake_quant_mxfp8")
    if xf.ndim == 0:
        raise QuantFormatError("fake_quant_mxfp8: x must have at least one dimension")
    k = xf.shape[-1]
    _check_last_dim(k, MXFP8_BLOCK, "MXFP8", "fake_quant_mxfp8 input")
    blocks = xf.reshape(*xf.shape[:-1], k // MXFP8_BLOCK, MXFP8_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    nan_block = torch.isnan(amax)
    scale = _pow2_f32(_rceil_exponent(torch.where(nan_block, torch.zeros_like(amax), amax)))
    x_hat = round_to_e4m3(blocks / scale) * scale
    x_hat = torch.where(nan_block, torch.full_like(x_hat, float("nan")), x_hat)
    return x_hat.reshape(xf.shape).to(x.dtype)
