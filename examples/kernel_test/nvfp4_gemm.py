"""An NVFP4 GEMM written from the golden bundle's manifest alone, in plain numpy (ml_dtypes only to round to
bf16): no minimax_ref function is used. `test_kernels.py` checks it against a bundle (`test_nvfp4_gemm`).

The layout it reads (manifest `contracts.nvfp4_linear.layouts`): `weight` uint8 [N, K/2], element 2i in the low
nibble and 2i+1 in the high one, E2M1 code bit 3 the sign; `weight_scale` E4M3 bytes [N, K/16] row-major;
`weight_scale_2` an fp32 scalar that multiplies.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1 = np.concatenate([E2M1, -E2M1])  # code bit 3 is the sign


def e4m3(codes: np.ndarray) -> np.ndarray:
    """float32 values of float8_e4m3fn bytes (bias 7, subnormals below exponent 1, 0x7F / 0xFF NaN)."""
    b = codes.astype(np.int32)
    sign = np.where(b & 0x80, -1.0, 1.0).astype(np.float32)
    exp, man = (b >> 3) & 0xF, (b & 7).astype(np.float32)
    val = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * np.exp2(exp - 7.0)).astype(np.float32)
    val = np.where((exp == 15) & (man == 7), np.nan, val)
    return sign * val


def unscaled_weight(weight: np.ndarray, weight_scale: np.ndarray) -> np.ndarray:
    """fp32 [N, K]: e2m1 code value times its block's E4M3 scale (weight_scale_2 not applied)."""
    N = weight.shape[0]
    codes = np.stack([weight & 0xF, weight >> 4], axis=-1).reshape(N, -1)
    block = np.repeat(e4m3(weight_scale.view(np.uint8)), 16, axis=1)
    return E2M1[codes] * block


def gemm_fp32(x: np.ndarray, weight: np.ndarray, weight_scale: np.ndarray, weight_scale_2: float) -> np.ndarray:
    """y = x @ W^T in fp32 with W = e2m1 * (scale * weight_scale_2), the bracketed product first."""
    N = weight.shape[0]
    codes = np.stack([weight & 0xF, weight >> 4], axis=-1).reshape(N, -1)
    factor = e4m3(weight_scale.view(np.uint8)) * np.float32(weight_scale_2)
    w = E2M1[codes] * np.repeat(factor, 16, axis=1)
    return x.astype(np.float32) @ w.T


def gemm_bf16(x: np.ndarray, weight: np.ndarray, weight_scale: np.ndarray, weight_scale_2: float) -> np.ndarray:
    """What a bf16 tensor-core kernel does: bf16 operands (e2m1 * scale is exact in bf16), fp32 accumulation,
    weight_scale_2 applied to the fp32 accumulator, one rounding to bf16. The reference instead rounds
    the weight after multiplying by weight_scale_2; the manifest's bfloat16 tolerance covers the difference."""
    xb = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    wb = unscaled_weight(weight, weight_scale).astype(ml_dtypes.bfloat16).astype(np.float32)
    acc = (xb @ wb.T) * np.float32(weight_scale_2)
    return acc.astype(ml_dtypes.bfloat16)
