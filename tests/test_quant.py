"""Tests of minimax_ref.weights.quant against independent references.

The references are: hand-written tables, ml_dtypes casts and decodes (an implementation of the
OCP formats that shares no code with torch), plain-Python / numpy-float32 re-derivations of each
formula, the shared test vectors in shared/testdata/quant_vectors.json, and (when installed)
torchao. Nothing is compared against this module's own earlier output.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from minimax_ref.errors import QuantFormatError
from minimax_ref.weights.quant import (
    E2M1_MAGNITUDES,
    decode_e2m1,
    decode_e8m0,
    dequant_mxfp8,
    dequant_nvfp4,
    fake_quant_mxfp8,
    fake_quant_nvfp4,
    pack_fp4,
    quantize_activation_nvfp4,
    quantize_mxfp8,
    quantize_nvfp4,
    round_to_e2m1,
    round_to_e4m3,
    unpack_fp4,
)


def _find_vectors() -> Path | None:
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "shared" / "testdata" / "quant_vectors.json"
        if candidate.is_file():
            return candidate
    return None


_VECTORS_PATH = _find_vectors()


@pytest.fixture(scope="module")
def vectors() -> dict:
    if _VECTORS_PATH is None:
        pytest.skip("shared/testdata/quant_vectors.json not found")
    return json.loads(_VECTORS_PATH.read_text())


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit float32 equality (distinguishes -0.0 from 0.0, NaN payloads aside)."""
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def md_e4m3_round(values: np.ndarray) -> np.ndarray:
    """ml_dtypes RNE to E4M3; it does not saturate, so callers stay within [-448, 448]."""
    return np.asarray(values, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def md_e2m1_round(values: np.ndarray) -> np.ndarray:
    """ml_dtypes RNE to E2M1 (saturating at 6), as float32."""
    return np.asarray(values, dtype=np.float32).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# E2M1


E2M1_TABLE = {
    0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 3.0, 6: 4.0, 7: 6.0,
    8: -0.0, 9: -0.5, 10: -1.0, 11: -1.5, 12: -2.0, 13: -3.0, 14: -4.0, 15: -6.0,
}  # fmt: skip


def test_e2m1_magnitudes_constant():
    assert E2M1_MAGNITUDES.dtype == torch.float32
    assert E2M1_MAGNITUDES.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_decode_e2m1_all_codes_vs_hand_table_and_ml_dtypes():
    codes = torch.arange(16, dtype=torch.uint8)
    got = decode_e2m1(codes)
    assert got.dtype == torch.float32
    assert bits_equal(got, f32([E2M1_TABLE[c] for c in range(16)]))
    assert math.copysign(1.0, got[8].item()) == -1.0  # code 8 is -0.0, not +0.0
    via_ml = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert bits_equal(got, torch.from_numpy(via_ml))


def test_decode_e2m1_vs_testdata_table(vectors):
    table = vectors["e2m1_codes"]
    got = decode_e2m1(torch.arange(16, dtype=torch.uint8))
    assert bits_equal(got, f32([table[str(c)] for c in range(16)]))


def test_decode_e2m1_keeps_shape_and_rejects_5bit_codes():
    codes = torch.tensor([[7, 15], [0, 9]], dtype=torch.uint8)
    assert decode_e2m1(codes).tolist() == [[6.0, -6.0], [0.0, -0.5]]
    with pytest.raises(QuantFormatError):
        decode_e2m1(torch.tensor([16], dtype=torch.uint8))


def test_nibble_order_6_and_minus_half_is_0x97():
    codes = round_to_e2m1(f32([6.0, -0.5]))
    assert codes.tolist() == [7, 9]
    packed = pack_fp4(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [0x97]
    assert unpack_fp4(torch.tensor([0x97], dtype=torch.uint8)).tolist() == [7, 9]


def test_unpack_fp4_vs_python_and_pack_inverse():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (3, 5, 8), dtype=torch.uint8, generator=g)
    codes = unpack_fp4(packed)
    assert codes.shape == (3, 5, 16) and codes.dtype == torch.uint8
    expected = [
        [[nib for byte in row for nib in (byte & 0xF, byte >> 4)] for row in mat] for mat in packed.tolist()
    ]
    assert codes.tolist() == expected
    assert torch.equal(pack_fp4(codes), packed)
    # float4_e2m1fn_x2 storage is read as its bytes
    assert torch.equal(unpack_fp4(packed.view(torch.float4_e2m1fn_x2)), codes)


def test_pack_fp4_rejects_bad_input():
    with pytest.raises(QuantFormatError):
        pack_fp4(torch.tensor([1, 2, 3], dtype=torch.uint8))  # odd K
    with pytest.raises(QuantFormatError):
        pack_fp4(torch.tensor([1, 16], dtype=torch.uint8))  # not 4-bit


E2M1_ROUNDING = [
    # exact values
    (0.0, 0), (0.5, 1), (1.0, 2), (1.5, 3), (2.0, 4), (3.0, 5), (4.0, 6), (6.0, 7),
    # ties go to the even code
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),
    # just off the ties
    (0.2500001, 1), (0.7499999, 1), (1.2500001, 3), (4.9999995, 6), (5.01, 7),
    # saturation
    (6.5, 7), (7.0, 7), (100.0, 7), (float("inf"), 7), (3.0e38, 7),
    # negatives keep the sign bit, including values that round to zero and -0.0
    (-0.0, 8), (-0.1, 8), (-0.25, 8), (-0.75, 10), (-1.25, 10), (-1.75, 12), (-2.5, 12),
    (-3.5, 14), (-5.0, 14), (-5.01, 15), (-7.0, 15), (float("-inf"), 15), (-6.0, 15),
]  # fmt: skip


@pytest.mark.parametrize("value,code", E2M1_ROUNDING)
def test_round_to_e2m1_hand_table(value, code):
    got = round_to_e2m1(f32([value]))
    assert got.dtype == torch.uint8
    assert got.item() == code


def test_round_to_e2m1_vs_ml_dtypes_random():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4000, generator=g) * 3.0
    # add every exact tie and its float32 neighbours
    ties = f32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([x, ties, -ties, torch.nextafter(ties, f32(10.0)), torch.nextafter(ties, f32(0.0))])
    got = round_to_e2m1(x)
    expected = x.numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    assert np.array_equal(got.numpy(), expected)


def test_round_to_e2m1_nan_raises():
    with pytest.raises(QuantFormatError, match="NaN"):
        round_to_e2m1(f32([1.0, float("nan")]))


# ------------------------------------------------------------------------------------------------
# E4M3


E4M3_ROUNDING = [
    (448.0, 448.0), (460.0, 448.0), (464.0, 448.0), (1000.0, 448.0), (float("inf"), 448.0),
    (-460.0, -448.0), (float("-inf"), -448.0),
    (2.0**-10, 0.0), (3 * 2.0**-11, 2.0**-9), (3 * 2.0**-10, 2.0**-8), (2.0**-9, 2.0**-9),
    (2.0**-6, 2.0**-6), (1.0 + 1 / 16, 1.0), (1.0 + 3 / 16, 1.25), (17.0, 16.0), (19.0, 20.0),
    (240.0, 240.0), (232.0, 224.0), (248.0, 256.0), (0.0, 0.0), (-(2.0**-11), -0.0),
]  # fmt: skip


@pytest.mark.parametrize("value,expected", E4M3_ROUNDING)
def test_round_to_e4m3_hand_table(value, expected):
    got = round_to_e4m3(f32([value]))
    assert got.dtype == torch.float32
    assert bits_equal(got, f32([expected]))


def test_round_to_e4m3_nan_and_signed_zero():
    got = round_to_e4m3(f32([float("nan"), -0.0]))
    assert math.isnan(got[0].item())
    assert math.copysign(1.0, got[1].item()) == -1.0


def test_round_to_e4m3_vs_ml_dtypes_random_and_all_midpoints():
    g = torch.Generator().manual_seed(3)
    magnitude = torch.exp2(torch.empty(5000).uniform_(-12.0, math.log2(448.0), generator=g))
    sign = torch.where(torch.rand(5000, generator=g) < 0.5, -1.0, 1.0)
    x = (sign * magnitude).clamp(-448.0, 448.0)
    # every midpoint between neighbouring positive E4M3 values is an exact tie
    grid = np.arange(0, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mids = torch.from_numpy((grid[:-1] + grid[1:]) / np.float32(2))
    x = torch.cat([x, mids, -mids])
    got = round_to_e4m3(x)
    assert bits_equal(got, torch.from_numpy(md_e4m3_round(x.numpy())))


def test_round_to_e4m3_accepts_bf16():
    x = torch.tensor([1.0625, 300.0, 1000.0], dtype=torch.bfloat16)
    assert round_to_e4m3(x).tolist() == [1.0, 288.0, 448.0]


# ------------------------------------------------------------------------------------------------
# E8M0


def test_decode_e8m0_selected_codes():
    got = decode_e8m0(torch.tensor([0, 127, 128, 254, 1, 126], dtype=torch.uint8))
    assert got.dtype == torch.float32
    expected = [math.ldexp(1.0, -127), 1.0, 2.0, math.ldexp(1.0, 127), math.ldexp(1.0, -126), 0.5]
    assert got.tolist() == expected


def test_decode_e8m0_all_codes_vs_torch_native_e8m0():
    codes = torch.arange(255, dtype=torch.uint8)
    native = codes.view(torch.float8_e8m0fnu).to(torch.float32)
    assert bits_equal(decode_e8m0(codes), native)
    assert bits_equal(decode_e8m0(codes.view(torch.float8_e8m0fnu)), native)


def test_decode_e8m0_255_raises_with_name():
    with pytest.raises(QuantFormatError, match=r"model\.layers\.0\.q_proj\.weight_scale_inv"):
        decode_e8m0(
            torch.tensor([127, 255], dtype=torch.uint8), name="model.layers.0.q_proj.weight_scale_inv"
        )


# ------------------------------------------------------------------------------------------------
# dequantization of checkpoint tensors


def test_dequant_nvfp4_testdata_vectors(vectors):
    for case in vectors["nvfp4_weights"]:
        n, k = case["shape"]
        weight = torch.tensor(case["weight_u8"], dtype=torch.uint8).reshape(n, k // 2)
        scale_u8 = torch.tensor(case["weight_scale_e4m3_u8"], dtype=torch.uint8).reshape(n, k // 16)
        scale_2 = torch.tensor(case["weight_scale_2"], dtype=torch.float32)
        expected = f32(case["decoded"]).reshape(n, k)
        assert bits_equal(dequant_nvfp4(weight, scale_u8.view(torch.float8_e4m3fn), scale_2), expected)
        # raw uint8 scale bytes and a [1]-shaped global decode the same
        assert bits_equal(dequant_nvfp4(weight, scale_u8, scale_2.reshape(1)), expected)


def test_dequant_mxfp8_testdata_vectors(vectors):
    for case in vectors["mxfp8_weights"]:
        n, k = case["shape"]
        weight = torch.tensor(case["weight_e4m3_u8"], dtype=torch.uint8).reshape(n, k)
        scale = torch.tensor(case["weight_scale_inv_u8"], dtype=torch.uint8).reshape(n, k // 32)
        expected = f32(case["decoded"]).reshape(n, k)
        assert bits_equal(dequant_mxfp8(weight.view(torch.float8_e4m3fn), scale), expected)
        assert bits_equal(dequant_mxfp8(weight, scale.view(torch.float8_e8m0fnu)), expected)


def _ref_dequant_nvfp4(weight_u8: np.ndarray, scale_u8: np.ndarray, scale_2: float) -> np.ndarray:
    """numpy float32 + ml_dtypes: e2m1 * (float(scale) * scale_2)."""
    low, high = weight_u8 & 0xF, weight_u8 >> 4
    codes = np.stack([low, high], axis=-1).reshape(*weight_u8.shape[:-1], -1).astype(np.uint8)
    e2m1 = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    block = scale_u8.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(scale_2)
    return e2m1 * np.repeat(block, 16, axis=-1)


def test_dequant_nvfp4_random_vs_numpy_reference():
    rng = np.random.default_rng(4)
    weight = rng.integers(0, 256, size=(8, 32), dtype=np.uint8)
    scale = rng.integers(0, 0x7F, size=(8, 4), dtype=np.uint8)  # every non-NaN positive E4M3
    scale_2 = float(np.float32(0.0123))
    got = dequant_nvfp4(torch.from_numpy(weight), torch.from_numpy(scale), f32(scale_2))
    assert bits_equal(got, torch.from_numpy(_ref_dequant_nvfp4(weight, scale, scale_2)))


def test_dequant_nvfp4_expert_stacked_equals_per_expert():
    rng = np.random.default_rng(5)
    e, n, k = 3, 4, 64
    weight = torch.from_numpy(rng.integers(0, 256, size=(e, n, k // 2), dtype=np.uint8))
    scale = torch.from_numpy(rng.integers(0x20, 0x7F, size=(e, n, k // 16), dtype=np.uint8)).view(
        torch.float8_e4m3fn
    )
    scale_2 = f32([0.5, 0.0037, 3.25])
    per_expert = torch.stack([dequant_nvfp4(weight[i], scale[i], scale_2[i]) for i in range(e)])
    for s2 in (scale_2, scale_2.reshape(e, 1)):
        assert bits_equal(dequant_nvfp4(weight, scale, s2), per_expert)
    shared = torch.stack([dequant_nvfp4(weight[i], scale[i], scale_2[1]) for i in range(e)])
    assert bits_equal(dequant_nvfp4(weight, scale, scale_2[1].reshape(())), shared)
    with pytest.raises(QuantFormatError, match="experts.w13"):
        dequant_nvfp4(weight, scale, f32([1.0, 2.0]), name="experts.w13")


def test_dequant_mxfp8_random_vs_python_reference():
    rng = np.random.default_rng(6)
    weight = rng.integers(0, 256, size=(4, 64), dtype=np.uint8)
    weight[(weight & 0x7F) == 0x7F] = 0x01  # no NaN bytes
    scale = rng.integers(90, 170, size=(4, 2), dtype=np.uint8)
    got = dequant_mxfp8(torch.from_numpy(weight).view(torch.float8_e4m3fn), torch.from_numpy(scale))
    values = weight.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    expected = [[values[r, c] * 2.0 ** (int(scale[r, c // 32]) - 127) for c in range(64)] for r in range(4)]
    assert bits_equal(got, f32(expected))


NAME = "language_model.model.layers.3.block_sparse_moe.experts.7.w1"


def _good_nvfp4(n: int = 2, k: int = 32):
    weight = torch.zeros(n, k // 2, dtype=torch.uint8)
    scale = torch.full((n, k // 16), 0x38, dtype=torch.uint8)  # 1.0
    return weight, scale, f32(0.5)


@pytest.mark.parametrize("nan_byte", [0x7F, 0xFF])
def test_dequant_nvfp4_nan_block_scale_raises_with_name(nan_byte):
    weight, scale, scale_2 = _good_nvfp4()
    scale[1, 0] = nan_byte
    with pytest.raises(QuantFormatError, match=NAME) as info:
        dequant_nvfp4(weight, scale.view(torch.float8_e4m3fn), scale_2, name=NAME)
    assert "NaN" in str(info.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -1.0])
def test_dequant_nvfp4_bad_global_scale_raises_with_name(bad):
    weight, scale, _ = _good_nvfp4()
    with pytest.raises(QuantFormatError, match=NAME):
        dequant_nvfp4(weight, scale, f32(bad), name=NAME)


def test_dequant_nvfp4_shape_and_dtype_errors_name_the_tensor():
    weight, scale, scale_2 = _good_nvfp4()
    with pytest.raises(QuantFormatError, match=NAME):
        dequant_nvfp4(weight, scale[:, :1], scale_2, name=NAME)  # wrong scale shape
    with pytest.raises(QuantFormatError, match=NAME):
        dequant_nvfp4(weight[:1], scale, scale_2, name=NAME)  # rows disagree
    with pytest.raises(QuantFormatError, match=NAME):
        dequant_nvfp4(weight.to(torch.int32), scale, scale_2, name=NAME)  # wrong dtype
    with pytest.raises(QuantFormatError, match=NAME):
        dequant_nvfp4(weight, scale, scale_2.double(), name=NAME)  # global must be float32
    with pytest.raises(QuantFormatError, match="multiple of 16"):
        dequant_nvfp4(torch.zeros(2, 4, dtype=torch.uint8), torch.zeros(2, 0, dtype=torch.uint8), scale_2)


def test_dequant_mxfp8_errors_name_the_tensor():
    name = "language_model.model.layers.0.self_attn.q_proj"
    weight = torch.zeros(2, 64, dtype=torch.uint8)
    scale = torch.full((2, 2), 127, dtype=torch.uint8)
    bad_scale = scale.clone()
    bad_scale[1, 1] = 255
    with pytest.raises(QuantFormatError, match=name):
        dequant_mxfp8(weight, bad_scale, name=name)
    for nan_byte in (0x7F, 0xFF):
        bad_weight = weight.clone()
        bad_weight[0, 5] = nan_byte
        with pytest.raises(QuantFormatError, match=name):
            dequant_mxfp8(bad_weight.view(torch.float8_e4m3fn), scale, name=name)
    with pytest.raises(QuantFormatError, match=name):
        dequant_mxfp8(weight, scale[:, :1], name=name)
    with pytest.raises(QuantFormatError, match="multiple of 32"):
        dequant_mxfp8(torch.zeros(2, 48, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), name=name)
    big = torch.full((1, 32), 0x7E, dtype=torch.uint8)  # 448
    with pytest.raises(QuantFormatError, match=name):
        dequant_mxfp8(big, torch.tensor([[254]], dtype=torch.uint8), name=name)


# ------------------------------------------------------------------------------------------------
# activation fake-quantization


def test_fake_quant_nvfp4_testdata_vectors_bit_exact(vectors):
    for case in vectors["nvfp4_activations"]:
        x = f32(case["x"]).reshape(case["shape"])
        expected = f32(case["x_hat"]).reshape(case["shape"])
        got = fake_quant_nvfp4(x, torch.tensor(case["input_scale"], dtype=torch.float32))
        assert bits_equal(got, expected), case["input_scale"]


def test_activation_operand_nvfp4_decodes_to_the_testdata_vectors(vectors):
    """The W4A4 input operand (codes and block scales) decodes, by the layout rule e2m1(code) * (scale / g),
    g = 1 / input_scale, to the spec's fake-quantized vectors, bit for bit."""
    for case in vectors["nvfp4_activations"]:
        x = f32(case["x"]).reshape(case["shape"])
        codes, scales = quantize_activation_nvfp4(x, case["input_scale"])
        assert codes.dtype == torch.uint8 and scales.dtype == torch.float8_e4m3fn
        g = 1.0 / torch.tensor(case["input_scale"], dtype=torch.float32)
        q = decode_e2m1(unpack_fp4(codes)).reshape(*x.shape[:-1], -1, 16)
        got = (q * (scales.float() / g).unsqueeze(-1)).reshape(x.shape)
        assert bits_equal(got, f32(case["x_hat"]).reshape(case["shape"])), case["input_scale"]
    with pytest.raises(QuantFormatError, match="NaN or Inf"):
        quantize_activation_nvfp4(torch.tensor([float("nan")] * 16), 1.0)


def test_fake_quant_mxfp8_testdata_vectors_bit_exact(vectors):
    for case in vectors["mxfp8_activations"]:
        x = f32(case["x"]).reshape(case["shape"])
        assert bits_equal(fake_quant_mxfp8(x), f32(case["x_hat"]).reshape(case["shape"]))


def _ref_fake_nvfp4(x: np.ndarray, input_scale: float) -> np.ndarray:
    """numpy float32 (every operation rounded to float32) with ml_dtypes rounding, in the spec's order."""
    one, six = np.float32(1.0), np.float32(6.0)
    g = one / np.float32(input_scale)
    inv6 = one / six
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 16)
    amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
    s = md_e4m3_round(np.minimum(g * (amax * inv6), np.float32(448.0)))
    with np.errstate(divide="ignore"):
        r = np.where(s == 0, np.float32(0.0), one / (s / g)).astype(np.float32)
    q = md_e2m1_round(blocks * r)
    return (q * (s / g)).reshape(x.shape)


E2M1_TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)


def _ulp_steps(values: np.ndarray, steps: int) -> np.ndarray:
    """values moved `steps` float32 ulps away from zero (towards zero when steps < 0)."""
    out = values.astype(np.float32)
    away = np.where(out < 0, np.float32(-np.inf), np.float32(np.inf))
    for _ in range(abs(steps)):
        out = np.nextafter(out, away if steps > 0 else np.float32(0.0))
    return out


def _nvfp4_act_tie_probes(input_scale: float, rng: np.random.Generator) -> np.ndarray:
    """Rows whose elements sit on or one ulp beside E2M1 ties after scaling, and whose block amax
    sits on or beside E4M3 ties of the block scale: where the order of float32 operations shows."""
    one = np.float32(1.0)
    g = one / np.float32(input_scale)
    inv6 = one / np.float32(6.0)
    blocks = []
    for amax in np.float32(input_scale) * rng.uniform(0.05, 40.0, size=8).astype(np.float32):
        s = md_e4m3_round(np.minimum(g * (amax * inv6), np.float32(448.0)))[()]
        for steps in (-1, 0, 1):
            ties = _ulp_steps(E2M1_TIES * (s / g), steps)
            blocks.append(np.concatenate([[amax, 0.0], ties, -ties]))
    grid = np.arange(0x01, 0x7E, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mids = (grid[:-1] + grid[1:]) / np.float32(2)  # E4M3 ties of s
    shape = np.linspace(1.0, -0.3, 16, dtype=np.float32)  # keeps the block amax at element 0
    for steps in range(-4, 5):
        amaxes = _ulp_steps(mids * np.float32(6.0) / g, steps)
        blocks.extend(amaxes[:, None] * shape)
    return np.stack(blocks).astype(np.float32)


@pytest.mark.parametrize("input_scale", [1.0, 0.37, 0.0123, 3.0])
def test_fake_quant_nvfp4_random_vs_numpy_reference(input_scale):
    g = torch.Generator().manual_seed(7)
    row_scale = torch.exp2(torch.empty(6, 1).uniform_(-12, 6, generator=g))
    x = torch.randn(6, 64, generator=g) * row_scale
    x[0, 16:32] = 0.0  # a zero block
    x[1, :16] = f32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * torch.tensor(input_scale)
    got = fake_quant_nvfp4(x, f32(input_scale))
    assert bits_equal(got, torch.from_numpy(_ref_fake_nvfp4(x.numpy(), input_scale)))
    assert not got[0, 16:32].any()

    probes = _nvfp4_act_tie_probes(input_scale, np.random.default_rng(70))
    got = fake_quant_nvfp4(torch.from_numpy(probes), f32(input_scale))
    assert bits_equal(got, torch.from_numpy(_ref_fake_nvfp4(probes, input_scale)))


def _ref_rceil_exponent(amax: float) -> int:
    """Smallest e with amax <= 448 * 2^e, by search (float64 scaling by 2^e is exact)."""
    if amax == 0:
        return -127
    e = math.frexp(amax)[1] - 9
    while amax > math.ldexp(448.0, e):
        e += 1
    while e > -200 and amax <= math.ldexp(448.0, e - 1):
        e -= 1
    return max(-127, min(127, e))


def _ref_fake_mxfp8(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    for row in range(x.shape[0]):
        for start in range(0, x.shape[1], 32):
            block = x[row, start : start + 32].astype(np.float64)
            scale = math.ldexp(1.0, _ref_rceil_exponent(float(np.max(np.abs(block)))))
            scaled = np.clip(block / scale, -448.0, 448.0)
            out[row, start : start + 32] = md_e4m3_round(scaled).astype(np.float64) * scale
    return out


def test_fake_quant_mxfp8_random_vs_python_reference():
    g = torch.Generator().manual_seed(8)
    row_scale = torch.exp2(torch.empty(8, 1).uniform_(-40, 40, generator=g).round())
    x = torch.randn(8, 96, generator=g) * row_scale
    x[0, 32:64] = 0.0
    x[1, :32] = x[1, :32] / x[1, :32].abs().max() * 448.0 * 2.0**-3  # amax exactly 448 * 2^-3
    x[2, :32] = torch.nextafter(x[1, :32], f32(float("inf")) * x[1, :32].sign())  # a hair above
    x[3, :32] = torch.linspace(-1e-39, 1e-39, 32)  # subnormal amax: exponent clamps at -127
    got = fake_quant_mxfp8(x)
    assert bits_equal(got, torch.from_numpy(_ref_fake_mxfp8(x.numpy())))
    assert not got[0, 32:64].any()


def test_fake_quant_keeps_dtype_and_leading_dims():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    for fn in (lambda t: fake_quant_nvfp4(t, 0.37), fake_quant_mxfp8):
        got = fn(x)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        assert torch.equal(got, fn(x.float()).to(torch.bfloat16))
        assert torch.equal(got.reshape(6, 64), fn(x.reshape(6, 64)))


def test_fake_quant_nan_block_is_nan_and_others_untouched():
    x = torch.linspace(-3, 3, 64).reshape(1, 64)
    x_nan = x.clone()
    x_nan[0, 3] = float("nan")
    for fn, block in ((lambda t: fake_quant_nvfp4(t, 1.0), 16), (fake_quant_mxfp8, 32)):
        clean, dirty = fn(x), fn(x_nan)
        assert torch.isnan(dirty[0, :block]).all()
        assert bits_equal(dirty[0, block:], clean[0, block:])


def test_fake_quant_nvfp4_inf_saturates():
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = float("inf"), -3000.0
    got = fake_quant_nvfp4(x, 1.0)
    assert got[0, :2].tolist() == [6 * 448.0, -6 * 448.0]


def test_fake_quant_errors():
    with pytest.raises(QuantFormatError, match="multiple of 16"):
        fake_quant_nvfp4(torch.zeros(2, 24), 1.0)
    with pytest.raises(QuantFormatError, match="multiple of 32"):
        fake_quant_mxfp8(torch.zeros(2, 48))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(QuantFormatError):
            fake_quant_nvfp4(torch.zeros(1, 16), bad)


# ------------------------------------------------------------------------------------------------
# quantization round trips


def _e2m1_half_step(a: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid spacing around magnitude a (in units of the block scale)."""
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))


def test_quantize_nvfp4_round_trip_bounds():
    g = torch.Generator().manual_seed(10)
    w = torch.randn(64, 256, generator=g)
    w_before = w.clone()
    weight, scale, scale_2 = quantize_nvfp4(w)
    assert torch.equal(w, w_before)  # inputs are not modified
    assert weight.dtype == torch.uint8 and weight.shape == (64, 128)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (64, 16)
    assert scale_2.dtype == torch.float32 and scale_2.shape == ()
    assert scale_2.item() == np.float32(w.abs().max().item()) / np.float32(2688.0)

    block_factor = scale.to(torch.float32) * scale_2  # what dequant multiplies e2m1 by
    s_elem = block_factor.repeat_interleave(16, dim=-1)
    # codes are the RNE rounding of w / block_factor (ml_dtypes as the independent rounder)
    expected_codes = (w / s_elem).numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    assert np.array_equal(unpack_fp4(weight).numpy(), expected_codes)
    # block scales re-derived in numpy float32: e4m3(clamp(amax_blk / (6 * scale_2), 2^-9, 448))
    amax_np = w.reshape(64, 16, 16).abs().amax(-1).numpy()
    t = np.clip(
        amax_np / (np.float32(6.0) * np.float32(scale_2.item())), np.float32(2.0**-9), np.float32(448)
    )
    assert np.array_equal(scale.to(torch.float32).numpy(), md_e4m3_round(t))

    # E4M3 rounding of the block scale (relative half-ulp 2^-4) lets the block max reach at
    # most 6 / (1 - 2^-4) = 6.4 block units, which still saturates within one E2M1 half step.
    amax_blk = w.reshape(64, 16, 16).abs().amax(-1)
    assert (amax_blk / block_factor <= 6.4 * (1 + 2**-20)).all()
    decoded = dequant_nvfp4(weight, scale, scale_2)
    a = w.abs() / s_elem
    bound = _e2m1_half_step(a.clamp(max=6.0)) * s_elem * (1 + 2**-20)
    assert ((decoded - w).abs() <= bound).all()
    rel_rms = ((decoded - w).norm() / w.norm()).item()
    assert rel_rms < 0.12, rel_rms  # about 0.09 for Gaussian weights


def test_quantize_nvfp4_codes_at_e2m1_ties():
    """Weights on and one ulp beside E2M1 ties of their block: the division order shows here."""
    rng = np.random.default_rng(14)
    scale_2 = np.float32(10.0) / np.float32(2688.0)
    rows = []
    for amax in rng.uniform(0.01, 10.0, size=24).astype(np.float32):
        block_scale = md_e4m3_round(np.clip(amax / (np.float32(6.0) * scale_2), 2.0**-9, 448.0))[()]
        factor = block_scale * scale_2
        for steps in (-1, 0, 1):
            ties = _ulp_steps(E2M1_TIES * factor, steps)
            rows.append(np.concatenate([[amax, 0.0], ties, -ties]))
    w = np.stack(rows).astype(np.float32)
    w[0, 0] = 10.0  # the global amax
    weight, scale, got_scale_2 = quantize_nvfp4(torch.from_numpy(w))
    assert got_scale_2.item() == scale_2
    factor = scale.to(torch.float32).numpy() * scale_2
    expected = (w / factor).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    assert np.array_equal(unpack_fp4(weight).numpy(), expected)


def test_quantize_nvfp4_zero_weight_and_zero_block():
    weight, scale, scale_2 = quantize_nvfp4(torch.zeros(2, 32))
    assert scale_2.item() == 1.0
    assert scale.to(torch.float32).tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert not weight.any()
    w = torch.ones(2, 32)
    w[1, 16:] = 0.0
    weight, scale, scale_2 = quantize_nvfp4(w)
    assert scale.to(torch.float32)[1, 1].item() == 1.0
    assert bits_equal(dequant_nvfp4(weight, scale, scale_2), w)


def test_quantize_nvfp4_shared_global_amax():
    g = torch.Generator().manual_seed(11)
    w1, w3 = torch.randn(8, 64, generator=g), 3.0 * torch.randn(8, 64, generator=g)
    shared = torch.maximum(w1.abs().max(), w3.abs().max())
    _, _, s1 = quantize_nvfp4(w1, global_amax=shared)
    q3, sc3, s3 = quantize_nvfp4(w3, global_amax=shared)
    assert s1.item() == s3.item() == np.float32(shared.item()) / np.float32(2688.0)
    assert (dequant_nvfp4(q3, sc3, s3) - w3).abs().max() <= w3.abs().max() / 6.0


def test_quantize_errors():
    with pytest.raises(QuantFormatError, match="multiple of 16"):
        quantize_nvfp4(torch.zeros(2, 24))
    with pytest.raises(QuantFormatError, match="multiple of 32"):
        quantize_mxfp8(torch.zeros(2, 48))
    for fn in (quantize_nvfp4, quantize_mxfp8):
        with pytest.raises(QuantFormatError):
            fn(torch.full((1, 32), float("nan")))


def test_quantize_mxfp8_round_trip_bounds():
    g = torch.Generator().manual_seed(12)
    row_scale = torch.exp2(torch.empty(32, 1).uniform_(-30, 30, generator=g).round())
    w = torch.randn(32, 256, generator=g) * row_scale
    weight, scale = quantize_mxfp8(w)
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == (32, 256)
    assert scale.dtype == torch.uint8 and scale.shape == (32, 8)

    amax = w.reshape(32, 8, 32).abs().amax(-1)
    expected_exp = [[_ref_rceil_exponent(v) for v in row] for row in amax.tolist()]
    assert (scale.to(torch.int64) - 127).tolist() == expected_exp
    x_blk = torch.exp2(scale.to(torch.float32) - 127)
    ratio = amax / x_blk
    assert ((ratio > 224.0) & (ratio <= 448.0)).all()  # RCEIL: block max in the top binade, unsaturated

    decoded = dequant_mxfp8(weight, scale)
    x_elem = x_blk.repeat_interleave(32, dim=-1)
    err = (decoded - w).abs()
    normal = w.abs() / x_elem >= 2.0**-6
    assert (err[normal] <= 2.0**-4 * w.abs()[normal]).all()  # 3 mantissa bits: half-ulp 2^-4
    assert (err[~normal] <= 2.0**-10 * x_elem[~normal]).all()  # subnormal spacing 2^-9
    assert bits_equal(decoded, fake_quant_mxfp8(w))


@pytest.mark.parametrize("k", [-20, 0, 7, 100])
def test_quantize_mxfp8_rceil_exact_at_powers_of_two(k):
    edge = math.ldexp(448.0, k)
    for amax, exp in ((edge, k), (float(np.nextafter(np.float32(edge), np.float32(np.inf))), k + 1),
                      (float(np.nextafter(np.float32(edge), np.float32(0))), k)):  # fmt: skip
        w = torch.zeros(1, 32)
        w[0, 0] = amax
        _, scale = quantize_mxfp8(w)
        assert scale.item() - 127 == exp, (amax, exp)


def test_quantize_mxfp8_zero_block_gets_code_0():
    weight, scale = quantize_mxfp8(torch.zeros(1, 64))
    assert scale.tolist() == [[0, 0]] and not weight.to(torch.float32).any()


# ------------------------------------------------------------------------------------------------
# optional cross-check against torchao


def test_cross_check_torchao():
    pytest.importorskip("torchao")
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import (
            NVFP4Tensor,
            nvfp4_quantize,
            per_tensor_amax_to_scale,
        )
    except ImportError as exc:  # a torchao without the prototype MX formats
        pytest.skip(f"torchao mx_formats unavailable: {exc}")

    g = torch.Generator().manual_seed(13)
    w = torch.randn(32, 128, generator=g)

    scale_2 = per_tensor_amax_to_scale(w.abs().max()).to(torch.float32)
    ao_scale, ao_weight = nvfp4_quantize(w.contiguous(), 16, scale_2)
    ao_decoded = NVFP4Tensor(ao_weight, ao_scale, 16, torch.float32, per_tensor_scale=scale_2).dequantize(
        torch.float32
    )
    assert bits_equal(dequant_nvfp4(ao_weight, ao_scale, scale_2.reshape(())), ao_decoded)
    # Same convention for Gaussian weights; torchao rounds the block scale in another order,
    # so allow a rare one-step difference at an exact E4M3 tie.
    q_weight, q_scale, q_scale_2 = quantize_nvfp4(w)
    assert q_scale_2.item() == scale_2.item()
    steps = (q_scale.view(torch.uint8).to(torch.int16) - ao_scale.view(torch.uint8).to(torch.int16)).abs()
    assert steps.max() <= 1 and (steps == 0).float().mean() >= 0.99

    ao_mx_scale, ao_mx = to_mx(w.contiguous(), torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    ao_mx_decoded = to_dtype(ao_mx, ao_mx_scale.view(torch.uint8), torch.float8_e4m3fn, 32, torch.float32)
    assert bits_equal(dequant_mxfp8(ao_mx, ao_mx_scale), ao_mx_decoded)
    mx_weight, mx_scale = quantize_mxfp8(w)
    assert torch.equal(mx_scale, ao_mx_scale.view(torch.uint8))
    assert torch.equal(mx_weight.view(torch.uint8), ao_mx.view(torch.uint8))
    assert bits_equal(fake_quant_mxfp8(w), ao_mx_decoded)
