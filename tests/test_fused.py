"""The fused dequantize-and-multiply of packed weights (`FastPaths(matmul="fused")`), on CPU (C++ kernels),
and on CUDA (Triton kernels) in the cases marked `gpu`: `python -m pytest -q tests/test_fused.py -m gpu`.

Contract under test (`fast.packed.packed_matmul`): y[m, n] = dtype(sum_k fp32(x[m, k]) * fp32(w_hat[n, k])) with
w_hat = `quant.dequant_*(...).to(dtype)` bit for bit, fp32 products and an fp32 sum in any order. Checks:

* bits: x = rows of the identity makes every output a decoded weight element (a sum of one product and
  zeros, exact), so the compiled kernel is compared with `quant.dequant_*` bit for bit, every element; rows
  e_k + e_k+1 check that it multiplies the weight rounded to dtype, not the fp32 decoded value;
* rounding: against float64 sums of the same decoded weights, within the worst-case bound of an fp32 inner
  product of K terms in any order, |y - exact| <= gamma_K * sum_k |x w_hat| with gamma_K = K u / (1 - K u),
  u = 2^-24 (plus one final rounding, 2^-8 |exact|, for bf16 outputs); observed about 3e-7 relative;
* fusion: the compiled graph is one kernel (C++; at most three Triton kernels: a split reduction) and
  allocates nothing of the weight's size;
* whole models: the packed tiny checkpoint with the switch equals the reference to fp32 rounding, same
  greedy tokens, and a fused decode step makes no host synchronisation.

Compiling on CPU costs seconds per graph (one graph per format, dtype and row count), so each test keeps
to a few graphs; the TP=2 and benchmark checks are marked slow.
"""

from __future__ import annotations

import math
import re
import runpy
import sys
from dataclasses import replace

import pytest
import torch
from test_packed import IDS, REPO, _bench, _HostSyncs, _rel, two_ranks  # noqa: F401 (two_ranks: the TP=2 fixture)

import minimax_ref.fast.packed as packed_mod
from minimax_ref.errors import ConfigError
from minimax_ref.fast import FastPaths, Kernels, apply
from minimax_ref.fast.packed import (
    FUSED_INDUCTOR_OPTIONS,
    FUSED_ROWS,
    decoded_planes,
    e2m1_value,
    packed_matmul,
    packed_matmul_reference,
    round_to_bf16_bits,
)
from minimax_ref.generation.generate import SamplingParams, generate_ids
from minimax_ref.model.parallel import World
from minimax_ref.weights.loader import load_model, load_synthetic
from minimax_ref.weights.packed import PackedWeight, packed_weights
from minimax_ref.weights.quant import E2M1_MAGNITUDES, dequant_mxfp8, dequant_nvfp4

U = 2.0**-24  # fp32 unit roundoff
KERNELS = Kernels()  # the compiled functions of these tests
packed_matmul_fused = KERNELS.matmul
# The compiled kernels are C++ on the CPU and Triton on CUDA: the `gpu` cases check the latter where a GPU is.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# ---------------------------------------------------------------------------------------------- operands


def _nvfp4(E: int, N: int, K: int, seed: int = 0):
    """Random NVFP4 stack [E, N, K]: every byte value occurs, block scales of both signs from 0 through the
    subnormals to 448 (never NaN), one global per expert."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    weight.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scale = torch.randint(0, 0x7F, (E, N, K // 16), generator=g, dtype=torch.uint8)  # 0x7f is NaN
    scale |= torch.randint(0, 2, scale.shape, generator=g, dtype=torch.uint8) << 7
    g2 = torch.tensor([3.7e-4, 2.0**-12, 0.75, 1.3e-3, 5.1e-2][:E], dtype=torch.float32)
    return weight, scale.view(torch.float8_e4m3fn), g2


def _mxfp8(E: int, N: int, K: int, seed: int = 0, exponents: tuple[int, int] = (0, 240)):
    """Random MXFP8 stack [E, N, K]: every finite E4M3 byte, E8M0 codes in `exponents` (the default reaches
    fp32 and bf16 subnormals at the bottom and 2^122 at the top)."""
    g = torch.Generator().manual_seed(seed)
    b = torch.arange(256, dtype=torch.uint8)
    finite = b[(b & 0x7F) != 0x7F]
    weight = finite[torch.randint(0, len(finite), (E, N, K), generator=g)]
    weight.view(-1)[: len(finite)] = finite
    scale = torch.randint(exponents[0], exponents[1] + 1, (E, N, K // 32), generator=g, dtype=torch.uint8)
    return weight.view(torch.float8_e4m3fn), scale


def _operands(fmt: str, E: int, N: int, K: int, seed: int = 0, realistic: bool = False):
    """(weight, weight_scale, weight_scale_2) of a stack [E, N, K]."""
    if fmt == "nvfp4":
        return _nvfp4(E, N, K, seed)
    return (*_mxfp8(E, N, K, seed, (112, 136) if realistic else (0, 240)), None)


def _expected(fmt: str, w, s, g, dtype) -> torch.Tensor:
    """The decoded stack [E, N, K] from `quant` (the independent decoder), in `dtype`."""
    if fmt == "nvfp4":
        return dequant_nvfp4(w, s, g).to(dtype)
    return dequant_mxfp8(w, s).to(dtype)


def _on(device: str, fn, *args):
    """fn(*args) with the tensor arguments moved to `device`; the result back on the CPU."""
    return fn(*(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)).cpu()


def _assert_within_fp32_rounding(y: torch.Tensor, x: torch.Tensor, w_hat: torch.Tensor, dtype: torch.dtype) -> None:
    """|y - exact| <= gamma_K * sum_k |x w_hat| (+ K * 2^-149 for products rounded as fp32 subnormals), and for
    bf16 outputs one more rounding: 2^-8 |exact| + (1 + 2^-8) * that. x [.., M, K], w_hat [.., N, K]."""
    K = x.shape[-1]
    xd, wd = x.double(), w_hat.double().transpose(-1, -2)
    exact = xd @ wd
    bound = K * U / (1 - K * U) * (xd.abs() @ wd.abs()) + K * 2.0**-149
    if dtype == torch.bfloat16:
        bound = 2.0**-8 * exact.abs() + (1 + 2.0**-8) * bound
    ratio = (y.double() - exact).abs() / bound
    assert bool((ratio <= 1).all()), f"error up to {float(ratio.max()):.3g} x the fp32 bound"


# ---------------------------------------------------------------------------------------------- pieces


def test_e2m1_value_is_the_table():
    codes = torch.arange(16, dtype=torch.uint8)
    want = torch.cat([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])
    got = e2m1_value(codes)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # code 8 is -0.0


def _f32(bits) -> torch.Tensor:
    """float32 values of fp32 bit patterns (Python ints, unsigned 32-bit)."""
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)


def _bf16_rounding_cases() -> tuple[torch.Tensor, torch.Tensor]:
    """(random, edges): 4M random finite fp32 bit patterns; and every finite bf16 value (sign, exponent and
    mantissa; fp32 subnormals and zeros included) with the low 16 bits just below, at and just above the tie
    (0x7FFF, 0x8000, 0x8001), zero and 0xFFFF, plus fp32 subnormals, the values that round up to inf
    (bf16 max + half an ulp, a tie on an odd mantissa, through fp32 max), +-inf and +-0."""
    gen = torch.Generator().manual_seed(5)
    random = torch.randint(-(1 << 31), 1 << 31, (1 << 22,), dtype=torch.int64, generator=gen).to(torch.int32)
    random = random.view(torch.float32)
    random = random[torch.isfinite(random)]
    upper = torch.arange(1 << 16, dtype=torch.int32)
    upper = upper[(upper & 0x7F80) != 0x7F80]  # finite bf16 patterns (exponent not all ones)
    low = torch.tensor([0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int32)
    sweep = ((upper[:, None] << 16) | low[None, :]).flatten().view(torch.float32)
    subnormals = torch.randint(1, 1 << 23, (1 << 16,), dtype=torch.int32, generator=gen)
    subnormals = torch.cat([subnormals, subnormals | (-(1 << 31))]).view(torch.float32)  # both signs
    special = _f32([0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001, 0x7F7FFFFF, 0xFF7F7FFF, 0xFF7F8000, 0xFF7FFFFF,
                    0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF,
                    0x007F8000, 0x00008000, 0x00018000, 0x3F808000, 0x3F818000])
    return random, torch.cat([sweep, subnormals, special])


@pytest.mark.parametrize("device", DEVICES)
def test_round_to_bf16_bits_is_the_cast(device):
    """`round_to_bf16_bits(v)` = `v.to(bf16).to(fp32)` bit for bit for every non-NaN v, eagerly and compiled
    (as `decoded_planes` uses it: rounding a computed product, in one kernel with FUSED_INDUCTOR_OPTIONS);
    ties go to even, fp32 values past bf16 max + half an ulp go to inf of their sign, zeros keep their sign,
    subnormals round like the rest. NaN stays NaN."""
    random, edges = _bf16_rounding_cases()

    def rounded_product(a, b):  # a * 1: a computed value, like the decoded weight, not a load
        return round_to_bf16_bits(a * b)

    compiled = torch.compile(rounded_product, fullgraph=True, dynamic=True, options=FUSED_INDUCTOR_OPTIONS)
    for v in (random, edges):
        want = v.to(torch.bfloat16).to(torch.float32).view(torch.int32)  # PyTorch's cast, on the CPU
        on = v.to(device)
        for got in (round_to_bf16_bits(on), compiled(on, torch.ones_like(on))):
            assert got.dtype == torch.float32 and got.shape == v.shape
            got = got.cpu().view(torch.int32)
            bad = (got != want).nonzero().flatten()
            if bad.numel():
                first = [f"{int(t.view(torch.int32)[bad[0]]) & 0xFFFFFFFF:#010x}" for t in (v, got, want)]
                raise AssertionError(f"{bad.numel()} differ, e.g. {first[0]} -> {first[1]}, the cast gives {first[2]}")
    # the cases named above, spelled out
    top = round_to_bf16_bits(_f32([0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000, 0xFF7FFFFF]))
    assert top.tolist() == [float(torch.finfo(torch.bfloat16).max)] + [float("inf")] * 2 + [-float("inf")] * 2
    ties = round_to_bf16_bits(_f32([0x3F808000, 0x3F818000, 0x00008000, 0x00018000])).view(torch.int32)
    assert ties.tolist() == [0x3F800000, 0x3F820000, 0x00000000, 0x00020000]  # to even: down, up, down, up
    zeros = round_to_bf16_bits(_f32([0x00000000, 0x80000000, 0x00007FFF, 0x80007FFF]))
    assert zeros.tolist() == [0.0] * 4 and torch.signbit(zeros).tolist() == [False, True, False, True]
    nans = _f32([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFF800001, 0xFFFFFFFF])
    assert bool(torch.isnan(round_to_bf16_bits(nans)).all())
    assert bool(torch.isnan(compiled(nans.to(device), torch.ones_like(nans.to(device)))).all())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decoded_planes_are_the_decoded_weight(fmt, dtype):
    """The planes, put back in K order, are `quant.dequant_*(...).to(dtype)` bit for bit (signed zeros too)."""
    w, s, g = _operands(fmt, 3, 8, 96)
    planes = decoded_planes(fmt, w, s, g, dtype)
    got = torch.stack(planes, dim=-1).reshape(3, 8, 96)  # NVFP4: even and odd k interleaved again
    want = _expected(fmt, w, s, g, dtype).float()
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


def _normal_nvfp4(E: int, N: int, K: int, lo: float, hi: float, seed: int = 1):
    """NVFP4 stack whose block scales (both signs, some exactly zero) times the globals span [lo, hi] in magnitude;
    every byte value occurs."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    weight.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    g2 = torch.full((E,), lo / 2.0**-9, dtype=torch.float32)  # the smallest e4m3 (2^-9) times g2 is lo
    ratio = torch.exp(torch.rand(E, N, K // 16, generator=g) * math.log(hi / lo))  # [1, hi / lo]
    scale = (ratio * 2.0**-9).clamp(max=448).to(torch.float8_e4m3fn)
    sign = torch.randint(0, 2, scale.shape, generator=g, dtype=torch.uint8) << 7
    scale = (scale.view(torch.uint8) | sign).view(torch.float8_e4m3fn)
    scale.view(torch.uint8).view(-1)[::97] = 0  # zero blocks
    return weight, scale, g2


def test_normal_range_planes_are_the_decoded_planes():
    """Inside `scales_in_normal_range` the cheaper planes have the reference planes' bits, at the range's edges too
    (smallest scale 2^-125, largest just under 4; MXFP8 codes 3 and 254), every byte, scales of both signs, zeros
    and -0; outside it the check says no (subnormal products, 2^126 |s| past fp32 max, MXFP8 code 2)."""
    bf16 = torch.bfloat16
    for lo, hi in ((2.0**-125, 2.0**-100), (1e-4, 1e-2), (0.25, 3.7)):
        w, s, g = _normal_nvfp4(3, 8, 256, lo, hi)
        assert packed_mod.scales_in_normal_range("nvfp4", s, g), (lo, hi)
        want = decoded_planes("nvfp4", w, s, g, bf16)
        got = packed_mod.normal_range_planes("nvfp4", w, s, g)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, want)), (lo, hi)
    w, s, g = _normal_nvfp4(3, 8, 256, 2.0**-127, 2.0**-120)
    assert not packed_mod.scales_in_normal_range("nvfp4", s, g)
    assert packed_mod.scales_in_normal_range("nvfp4", *_nvfp4(2, 16, 64)[1:])  # e4m3 subnormals: fp32 normals
    s_max = torch.full((1, 1, 1), 448.0).to(torch.float8_e4m3fn)
    assert not packed_mod.scales_in_normal_range("nvfp4", s_max, torch.tensor([2.0**128 / 6 / 448]))  # overflow
    assert not packed_mod.scales_in_normal_range("nvfp4", s_max, torch.tensor([4.0 / 448]))  # 2^126 s overflows
    edge = torch.tensor([3.999 / 448])
    assert packed_mod.scales_in_normal_range("nvfp4", s_max, edge)
    every_byte = torch.arange(256, dtype=torch.uint8).view(1, 16, 16)
    got = packed_mod.normal_range_planes("nvfp4", every_byte, s_max.expand(1, 16, 2), edge)
    want = decoded_planes("nvfp4", every_byte, s_max.expand(1, 16, 2), edge, bf16)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, want))
    for codes in ((3, 40), (100, 140), (230, 254)):
        w, s = _mxfp8(2, 8, 512, exponents=codes)
        assert packed_mod.scales_in_normal_range("mxfp8", s, None)
        for dtype in (bf16, torch.float32):
            want = decoded_planes("mxfp8", w, s, None, dtype)[0]
            assert torch.equal(packed_mod.normal_range_planes("mxfp8", w, s, None)[0].view(torch.int32),
                               want.view(torch.int32)), (codes, dtype)
    assert not packed_mod.scales_in_normal_range("mxfp8", _mxfp8(1, 8, 64, exponents=(2, 9))[1], None)


def test_nvfp4_word_planes_are_the_decoded_weight():
    """The planes read from int32 words hold, in word order, the decoded weight's bits (`decoded_planes`) for scales
    in range (its edges, both signs, zeros, every byte value); the activation's word planes are x, widened exactly;
    and the product through them reads out the decoded weight bit for bit (identity rows) and equals the byte planes'
    product to fp32 rounding, gathered experts included."""
    bf16 = torch.bfloat16
    cases = [_normal_nvfp4(3, 8, 256, lo, hi) for lo, hi in ((2.0**-125, 2.0**-100), (1e-4, 1e-2), (0.25, 3.7))]
    s_max = torch.full((1, 16, 2), 448.0).to(torch.float8_e4m3fn)
    cases.append((torch.arange(256, dtype=torch.uint8).view(1, 16, 16), s_max, torch.tensor([3.999 / 448])))
    for w, s, g in cases:
        assert packed_mod.scales_in_normal_range("nvfp4", s, g)
        want = torch.stack(decoded_planes("nvfp4", w, s, g, bf16), -1).flatten(-3)  # [E, N, K]
        got = torch.stack(packed_mod.nvfp4_word_planes(packed_mod._bytes_as_int32(w), s, g), -1).flatten(-3)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        K = want.shape[-1]
        eye = torch.eye(K).to(bf16)
        read = packed_matmul(eye, "nvfp4", w, s, g, bf16, torch.tensor([0]), True, words=True)  # [1, K, N]
        assert torch.equal(read[0].T.float(), want[0])  # as values: a sum of -0 and +0 products is +0
    x = torch.randn(2, 3, 256).to(bf16)
    for xx in (x, x.float()):
        assert torch.equal(torch.stack(packed_mod.activation_word_planes("nvfp4", xx), -1).flatten(-3), x.float())
    w, s, g = cases[1]
    ids = torch.tensor([[2, 0], [1, 2]])
    rows = torch.randn(2, 2, 1, 256).to(bf16)
    by_words = packed_matmul(rows, "nvfp4", w, s, g, bf16, ids, True, words=True)
    by_bytes = packed_matmul(rows, "nvfp4", w, s, g, bf16, ids, True)
    assert by_words.shape == (2, 2, 1, 8) and torch.allclose(by_words.float(), by_bytes.float(), rtol=1e-2, atol=1e-6)
    odd = w[:, :, 4:]  # not word-aligned: read through a copy
    assert torch.equal(packed_mod._bytes_as_int32(odd).view(torch.uint8).view(odd.shape), odd)


def test_mxfp8_word_planes_are_the_decoded_weight():
    """MXFP8's planes read from int32 words hold, in word order, the decoded weight's bits (`decoded_planes`, bf16 and
    fp32) for every finite E4M3 byte (subnormals and both zeros included) and E8M0 codes across the normal range
    (its edges 3 and 254 included); the activation's word planes are x, widened exactly; the product through them
    reads out the decoded weight bit for bit (identity rows) and equals the byte planes' product to fp32 rounding,
    gathered entries included. A weight holding an E4M3 NaN byte is found (`has_e4m3_nan`), and a PackedWeight
    holding one keeps the byte planes, which give NaN where the words would not."""
    bf16 = torch.bfloat16
    for lo, hi in ((3, 40), (100, 140), (200, 254)):
        w, s = _mxfp8(3, 8, 256, exponents=(lo, hi))
        s.view(-1)[:2] = torch.tensor([lo, hi], dtype=torch.uint8)
        assert packed_mod.scales_in_normal_range("mxfp8", s, None) and not packed_mod.has_e4m3_nan(w)
        got = torch.stack(packed_mod.mxfp8_word_planes(packed_mod._bytes_as_int32(w), s), -1).flatten(-3)
        for dtype in (bf16, torch.float32):
            want = decoded_planes("mxfp8", w, s, None, dtype)[0].flatten(-2)  # [E, N, K]
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (lo, hi, dtype)
        if hi > 140:
            continue  # values past fp32's range: an identity row's zeros times them are NaN
        K = w.shape[-1]
        read = packed_matmul(torch.eye(K).to(bf16), "mxfp8", w, s, None, bf16, torch.tensor([1]), True, words=True)
        assert torch.equal(read[0].T.float(), decoded_planes("mxfp8", w, s, None, bf16)[0].flatten(-2)[1])
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, 256, generator=gen).to(bf16)
    for xx in (x, x.float()):
        assert torch.equal(torch.stack(packed_mod.activation_word_planes("mxfp8", xx), -1).flatten(-3), x.float())
    w, s = _mxfp8(3, 8, 256, exponents=(110, 125))
    ids = torch.tensor([[2, 0], [1, 2]])
    rows = torch.randn(2, 2, 1, 256, generator=gen)
    # the two products differ only in the fp32 summation order, then each rounds once to the output dtype: at
    # most K * 2^-24 of sum |x| |w| apart before the rounding, one output ulp (2^-8 bf16, 2^-24 fp32) after it
    W = PackedWeight("mxfp8", w, s, dtype=torch.float32).decode()[ids]  # [2, 2, N, K]
    magnitude = rows.abs() @ W.abs().transpose(-1, -2)  # [2, 2, 1, N]
    for dtype, ulp in ((bf16, 2.0**-8), (torch.float32, 2.0**-24)):
        by_words = packed_matmul(rows.to(dtype), "mxfp8", w, s, None, dtype, ids, True, words=True)
        by_bytes = packed_matmul(rows.to(dtype), "mxfp8", w, s, None, dtype, ids, True)
        assert by_words.shape == (2, 2, 1, 8)
        bound = ulp * by_bytes.float().abs() + 256 * 2.0**-24 * magnitude
        assert ((by_words.float() - by_bytes.float()).abs() <= bound).all(), dtype
    nan = w.clone()
    nan.view(torch.uint8)[0, 0, 5] = 0xFF
    assert packed_mod.has_e4m3_nan(nan)
    words = FastPaths(matmul="fused", fused_rows=1, mxfp8_words=True)
    weight = PackedWeight("mxfp8", nan, s, dtype=bf16)
    apply(weight, words)
    assert not weight.words and weight.fused_tokens == 1
    assert torch.isnan(weight.matmul(torch.ones(3, 1, 256, dtype=bf16))[0]).any()
    clean = PackedWeight("mxfp8", w, s, dtype=bf16)
    apply(clean, words)
    assert clean.words
    clean.weight.view(torch.uint8)[0, 0, 5] = 0x7F  # filled in place: checked again when the paths are applied
    apply(clean, words)
    assert not clean.words


def test_packed_weight_uses_the_cheaper_planes_only_in_range(monkeypatch):
    """A PackedWeight checks its scales once; the fused matmul then takes the cheaper planes, with the same result."""
    inside = PackedWeight("nvfp4", *_normal_nvfp4(1, 16, 64, 1e-4, 1e-2), dtype=torch.bfloat16)
    outside = PackedWeight("nvfp4", *_normal_nvfp4(1, 16, 64, 2.0**-127, 2.0**-120), dtype=torch.bfloat16)
    for pw in (inside, outside):
        apply(pw, FastPaths(matmul="fused"))
    assert inside.normal_range and not outside.normal_range
    calls = []
    real = packed_mod.normal_range_planes
    monkeypatch.setattr(packed_mod, "normal_range_planes", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(Kernels, "fused", lambda self: packed_matmul)  # eager: the planes are called where used
    x = torch.randn(1, 64).to(torch.bfloat16)
    for pw, used in ((inside, 1), (outside, 0)):
        calls.clear()
        got = pw.matmul(x[None].expand(1, 1, 64), torch.tensor([0]))
        assert len(calls) == used
        assert torch.equal(got, packed_matmul(x[None], "nvfp4", *pw.parts(), torch.bfloat16, torch.tensor([0])))


def test_contract_broadcast_is_einsum():
    """`fast.attention.contract`'s broadcast form (what compiled layers run) computes the attention cores' einsums:
    exactly, on integer-valued float64 operands."""
    from minimax_ref.fast.attention import contract

    g = torch.Generator().manual_seed(0)
    for eq, sa, sb in [("bhgtd,bhld->bhgtl", (2, 3, 4, 5, 8), (2, 3, 7, 8)),
                       ("bhgtl,bhld->bhgtd", (2, 3, 4, 5, 7), (2, 3, 7, 8)),
                       ("bthd,bld->bhtl", (2, 5, 3, 8), (2, 7, 8)),
                       ("bhgtd,bhtkld->bhgtkl", (2, 3, 4, 5, 8), (2, 3, 5, 6, 7, 8)),
                       ("bhgtkl,bhtkld->bhgtd", (2, 3, 4, 5, 6, 7), (2, 3, 5, 6, 7, 8))]:
        a = torch.randint(-8, 9, sa, generator=g).double()
        b = torch.randint(-8, 9, sb, generator=g).double()
        assert torch.equal(contract(eq, a, b, broadcast=True), torch.einsum(eq, a, b)), eq


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_packed_matmul_eager_contract(fmt):
    """The pure function itself (uncompiled): every shape it is used with, against float64 sums."""
    w, s, g = _operands(fmt, 4, 12, 96, realistic=True)
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        w_hat = _expected(fmt, w, s, g, dtype)
        x = torch.randn(3, 96, generator=gen).to(dtype)
        one = packed_matmul(x, fmt, w[1], s[1], None if g is None else g[1], dtype)  # one linear, M = 3
        assert one.shape == (3, 12) and one.dtype == dtype
        _assert_within_fp32_rounding(one, x, w_hat[1], dtype)
        every = packed_matmul(x, fmt, w, s, g, dtype)  # every expert on every row: [4, 3, 12]
        _assert_within_fp32_rounding(every, x, w_hat, dtype)
        ids = torch.tensor([3, 0, 3])
        xp = torch.randn(3, 1, 96, generator=gen).to(dtype)
        pairs = packed_matmul(xp, fmt, w, s, g, dtype, index=ids)  # gathered: [3, 1, 12]
        _assert_within_fp32_rounding(pairs, xp, w_hat[ids], dtype)
        if dtype == torch.float32:
            assert _rel(pairs, packed_matmul_reference(xp, fmt, w, s, g, dtype, index=ids)) < 1e-5


# ---------------------------------------------------------------------------------------------- compiled


@pytest.mark.parametrize("fmt,K", [("nvfp4", 208), ("mxfp8", 224)])  # K: 13 / 7 blocks, no power of two
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_matmul_multiplies_the_exact_weight_bits(fmt, K, dtype, device):
    """Rows of the identity read out the decoded weight (y = w_hat^T, every element); rows e_k + e_k+1 give
    fp32(w_hat[:, k] + w_hat[:, k+1]) rounded once to dtype, which they do only if the kernel multiplied by
    the weight rounded to dtype (with the fp32 decoded value instead, one final rounding of the sum differs).
    Bit for bit, fp32 and bf16 subnormals included; in passes of FUSED_ROWS rows."""
    w, s, g = _operands(fmt, 1, 24, K, seed=2)
    w, s, g = w[0], s[0], None if g is None else g[0]
    eye = torch.eye(K)
    x = torch.cat([eye, eye + eye.roll(1, dims=1)]).to(dtype)
    on = [None if t is None else t.to(device) for t in (x, w, s, g)]
    y = packed_matmul_fused(on[0], fmt, *on[1:], dtype).cpu()
    assert y.shape == (2 * K, 24) and y.dtype == dtype
    w_hat = _expected(fmt, w, s, g, dtype)
    assert torch.equal(y[:K].T, w_hat)
    pairs = (w_hat.float() + w_hat.float().roll(-1, dims=1)).to(dtype)
    assert torch.equal(y[K:].T, pairs)


@pytest.mark.parametrize("words", [False, True], ids=["bytes", "words"])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_matmul_normal_range_planes_exact_weight_bits(device, words):
    """The same read-out through the compiled kernel with `normal_range_planes` (what PackedWeight uses for weights
    in range) or, `words`, `nvfp4_word_planes` / `mxfp8_word_planes`: identity rows give the decoded weight, pair
    rows the once-rounded pair sums, bit for bit; for one NVFP4 linear (scales of both signs, zero blocks, every byte
    value, the range's edges) and gathered experts with a global scale each, and for MXFP8 at small and large scale
    codes. The x rows are bf16, widened on the bits."""
    bf16 = torch.bfloat16
    cases = []
    for lo, hi in ((2.0**-125, 2.0**-100), (1e-4, 1e-2), (0.25, 3.7)):
        cases.append(("nvfp4", *_normal_nvfp4(3, 24, 208, lo, hi, seed=3)))
    for codes in ((3, 40), (200, 240)):
        cases.append(("mxfp8", *_mxfp8(3, 24, 224, exponents=codes), None))
    for fmt, w, s, g in cases:
        assert packed_mod.scales_in_normal_range(fmt, s, g)
        K = w.shape[-1] * (2 if fmt == "nvfp4" else 1)
        w_hat = _expected(fmt, w, s, g, bf16)
        eye = torch.eye(K)
        x = torch.cat([eye, eye + eye.roll(1, dims=1)]).to(bf16)
        one = _on(device, packed_matmul_fused, x, fmt, w[1], s[1], None if g is None else g[1], bf16, None,
                  FUSED_ROWS, True, words)
        assert torch.equal(one[:K].T, w_hat[1]), fmt
        assert torch.equal(one[K:].T, (w_hat[1].float() + w_hat[1].float().roll(-1, dims=1)).to(bf16)), fmt
        ids = torch.tensor([2, 0, 2])
        cols = torch.tensor([0, K - 1, 77])
        onehot = torch.zeros(len(ids), 1, K, dtype=bf16)
        onehot[torch.arange(len(ids)), 0, cols] = 1
        y = _on(device, packed_matmul_fused, onehot, fmt, w, s, g, bf16, ids, FUSED_ROWS, True, words)
        assert torch.equal(y[:, 0], w_hat[ids, :, cols]), fmt


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_fused_matmul_within_fp32_rounding(fmt):
    """Random rows: M = 1, 3 (one pass each) and FUSED_ROWS + 1 (two passes), fp32 compute."""
    K = 208 if fmt == "nvfp4" else 224
    w, s, g = _operands(fmt, 1, 40, K, seed=3, realistic=True)
    w, s, g = w[0], s[0], None if g is None else g[0]
    w_hat = _expected(fmt, w, s, g, torch.float32)
    gen = torch.Generator().manual_seed(4)
    for M in (1, 3, FUSED_ROWS + 1):
        x = torch.randn(M, K, generator=gen)
        y = packed_matmul_fused(x, fmt, w, s, g, torch.float32)
        _assert_within_fp32_rounding(y, x, w_hat, torch.float32)
        assert _rel(y, packed_matmul_reference(x, fmt, w, s, g, torch.float32)) < 1e-5


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_gathered_experts(fmt, device):
    """The gathered-experts form (x [P, 1, K], index [P] with repeats, a global per expert): one-hot rows read
    out the chosen experts' weights exactly, random rows are within the fp32 bound."""
    E, N, K = 5, 24, 160
    w, s, g = _operands(fmt, E, N, K, seed=5)
    dtype = torch.bfloat16
    ids = torch.tensor([3, 0, 3, 4, 1, 3])
    cols = torch.tensor([0, 17, 100, 159, 64, 31])
    onehot = torch.zeros(len(ids), 1, K, dtype=dtype)
    onehot[torch.arange(len(ids)), 0, cols] = 1
    y = _on(device, packed_matmul_fused, onehot, fmt, w, s, g, dtype, ids)
    assert y.shape == (len(ids), 1, N)
    w_hat = _expected(fmt, w, s, g, dtype)
    assert torch.equal(y[:, 0], w_hat[ids, :, cols])
    w, s, g = _operands(fmt, E, N, K, seed=6, realistic=True)
    x = torch.randn(len(ids), 1, K, generator=torch.Generator().manual_seed(7)).to(dtype)
    _assert_within_fp32_rounding(_on(device, packed_matmul_fused, x, fmt, w, s, g, dtype, ids), x,
                                 _expected(fmt, w, s, g, dtype)[ids], dtype)


def test_fused_every_local_expert():
    """The dense form of the sync-free experts: x [T, K] shared by every expert, then x [E, T, K] per expert."""
    E, N, K, T = 3, 20, 96, 5
    w, s, g = _nvfp4(E, N, K, seed=8)
    w_hat = _expected("nvfp4", w, s, g, torch.float32)
    gen = torch.Generator().manual_seed(9)
    for x in (torch.randn(T, K, generator=gen), torch.randn(E, T, K, generator=gen)):
        y = packed_matmul_fused(x, "nvfp4", w, s, g, torch.float32)
        assert y.shape == (E, T, N)
        _assert_within_fp32_rounding(y, x, w_hat, torch.float32)


def _generated_code(x, fmt, w, s, g, dtype, index=None) -> str:
    """Inductor's output code for a fresh compile of `packed_matmul` with the fused path's settings."""
    from torch._inductor.utils import run_and_get_code

    fn = torch.compile(packed_matmul, dynamic=True, fullgraph=True, options=FUSED_INDUCTOR_OPTIONS)
    with torch._inductor.config.patch(force_disable_caches=True):
        _, code = run_and_get_code(fn, x, fmt, w, s, g, dtype, index)
    assert len(code) == 1
    return code[0]


def _allocated_elements(code: str) -> list[int]:
    """Element counts of the buffers the compiled wrapper allocates, with the example sizes inductor records
    for its symbols (`get_args`)."""
    call = code[code.index("def call("):]
    symbols = dict(re.findall(r"^\s+(s\d+) = (arg\d+_1)$", call, re.M))
    values = {a: int(v) for a, v in re.findall(r"^\s+(arg\d+_1) = (\d+)$", code, re.M)}
    env = {sym: values[arg] for sym, arg in symbols.items()}
    sizes = []
    for shape in re.findall(r"empty_strided_\w+\(\(([^)]*)\)", call):
        n = 1
        for dim in filter(None, (d.strip() for d in shape.split(","))):
            n *= int(eval(dim, {}, dict(env)))  # noqa: S307 - inductor's own size expressions
        sizes.append(n)
    return sizes


@pytest.mark.parametrize("case", ["nvfp4 linear M=2", "nvfp4 gathered"])
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_graph_never_materialises_the_weight(case, device):
    """The point of the fused matmul: the compiled graph is one kernel, and every buffer it allocates is output-sized
    (rows x N per expert), none of the weight's N x K (nor N x K/2 for the NVFP4 planes). On CUDA inductor may
    split a long reduction in two kernels (and cast in a third), with partial sums of a few times the output's
    size."""
    N, K = 64, 512
    if case.startswith("nvfp4"):
        w, s, g = _nvfp4(1, N, K)
        args = (torch.randn(2, K), "nvfp4", w[0], s[0], g[0], torch.bfloat16)
        rows = 2
    else:
        w, s, g = _nvfp4(3, N, K)
        args = (torch.randn(4, 1, K), "nvfp4", w, s, g, torch.bfloat16, torch.tensor([2, 0, 2, 1]))
        rows = 4
    code = _generated_code(*(a.to(device) if isinstance(a, torch.Tensor) else a for a in args))
    kernels = re.findall(r"^(\w+) = async_compile\.(?:cpp\w*|triton)\(", code, re.M)
    sizes = _allocated_elements(code)
    if device == "cpu":
        assert len(kernels) == 1, kernels
        assert sizes and max(sizes) <= rows * N, sizes  # fp32 row sums and the output only
    else:
        assert 1 <= len(kernels) <= 3, kernels
        assert sizes and max(sizes) < N * K // 8, sizes


# ---------------------------------------------------------------------------------------------- switches


def test_fused_switch_is_explicit():
    assert FastPaths.of(True).matmul == "reference" and FastPaths.of(True).fused_tokens == 0  # fast=True unchanged
    fused = FastPaths.of("fused")
    # one pass over the weight at most: larger calls decode then multiply (measured faster at batch 32)
    assert fused == FastPaths("fast", True, True, True, matmul="fused", prefill_attention="triton",
                              block_selection="triton", graph=True)
    assert fused.fused_tokens == FUSED_ROWS == 8
    assert FastPaths.of({"matmul": "fused", "sync_free_tokens": 4}).fused_tokens == 4
    assert FastPaths.of({"matmul": "fused", "fused_rows": 16}).fused_tokens == 16
    with pytest.raises(ConfigError, match="matmul"):
        FastPaths(matmul="triton")


def test_packed_weight_routes_only_small_calls_to_the_fused_matmul(monkeypatch):
    """`fused_tokens` rows or fewer go to the fused matmul, more rows (prefill) and 0 (off) decode."""
    w, s, g = _nvfp4(1, 16, 64)
    pw = PackedWeight("nvfp4", w[0], s[0], g[0], dtype=torch.float32)
    seen = []
    monkeypatch.setattr(Kernels, "matmul", lambda self, x, *a, rows_per_pass, normal_range, words:
                        seen.append(x.shape) or packed_matmul(x, *a, normal_range=normal_range, words=words))
    x = torch.randn(2, 3, 64)
    want = torch.nn.functional.linear(x, pw.decode())
    apply(pw, FastPaths(decode="fast"))
    assert pw.fused_tokens == 0 and torch.equal(pw.linear(x), want) and seen == []  # off
    apply(pw, FastPaths(matmul="fused", fused_rows=6))
    assert pw.fused_tokens == 6 and _rel(pw.linear(x), want) < 1e-6 and seen == [(6, 64)]  # [2, 3] tokens: 6 rows
    apply(pw, FastPaths(matmul="fused", fused_rows=5))
    assert torch.equal(pw.linear(x), want) and len(seen) == 1  # 6 rows > 5: decoded


# ---------------------------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def nvfp4_ckpt(ckpt_factory):
    return ckpt_factory("tiny", "nvfp4")


def _cached_run(model, batch: int, steps: int) -> torch.Tensor:
    """A 70-token cached prefill (over the fused threshold: the reference path) and `steps` decode steps of
    `batch` sequences at different positions; all logits [batch, 70 + steps, V]."""
    dev = model.device
    with torch.no_grad():
        cache = model.new_cache(batch, 96)
        ids = IDS.repeat(2, 1)[:batch].to(dev)
        out = [model(ids[:, :70], positions=torch.arange(70, device=dev).expand(batch, -1), cache=cache)]
        pos = torch.tensor([[70], [66], [60], [69]], device=dev)[:batch]
        for t in range(steps):
            out.append(model(ids[:, 70 + t:71 + t], positions=pos + t, cache=cache))
    return torch.cat(out, dim=1).cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_fused_model_equals_reference_at_batch_1(nvfp4_ckpt, device):
    """Decode at batch 1: MXFP8 linears with one row, the chosen NVFP4 experts gathered (T*k < E). fp32 logits
    to fp32 rounding, and the same greedy tokens."""
    model = load_model(nvfp4_ckpt, dtype=torch.float32, weights="packed", device=device)
    sampling = SamplingParams(temperature=0)
    prompt = [IDS[0, :70].tolist()]
    want_tokens = generate_ids(model, prompt, max_new_tokens=4, sampling=sampling)[0][0].generated  # reference
    apply(model, True)  # the fast paths without the fused matmul: the logits differ by the switch alone
    want = _cached_run(model, 1, 3)
    apply(model, "fused")
    assert {pw.fused_tokens for _, pw in packed_weights(model)} == {FUSED_ROWS}
    got = _cached_run(model, 1, 3)
    assert torch.equal(got[:, :70], want[:, :70])  # the prefill took the reference path
    assert 0 < _rel(got, want) < 1e-5  # the decode steps did not (the sums run in another order)
    assert generate_ids(model, prompt, max_new_tokens=4, sampling=sampling)[0][0].generated == want_tokens


def test_fused_model_equals_reference_at_batch_4(nvfp4_ckpt):
    """Decode at batch 4: linears with four rows, and every local expert on every token (T*k >= E)."""
    model = load_model(nvfp4_ckpt, dtype=torch.float32, weights="packed", fast=True)
    want = _cached_run(model, 4, 2)
    apply(model, "fused")
    got = _cached_run(model, 4, 2)
    assert 0 < _rel(got, want) < 1e-5
    assert torch.equal(got[:, 70:].argmax(-1), want[:, 70:].argmax(-1))


def test_fused_decode_step_does_not_synchronise(nvfp4_ckpt, monkeypatch):
    """The fused path's operations, run eagerly (a dispatch mode sees no compiled code), read nothing back
    to the host: a decode step's only host read is the embedding's token-id range check."""
    monkeypatch.setattr(Kernels, "fused", lambda self: packed_matmul)  # the uncompiled function, not the compiled one
    calls = []
    real = Kernels.matmul
    monkeypatch.setattr(Kernels, "matmul", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    model = load_model(nvfp4_ckpt, dtype=torch.bfloat16, weights="packed", fast="fused")
    for batch in (1, 4):  # gathered experts; every local expert
        cache = model.new_cache(batch, 96, "fp8")
        ids = IDS.repeat(2, 1)[:batch]
        with torch.no_grad():
            model(ids[:, :70], positions=torch.arange(70).expand(batch, -1), cache=cache)
            guard = _HostSyncs()
            calls.clear()
            with guard:
                model(ids[:, 70:71], positions=torch.tensor([[70], [71], [72], [73]])[:batch], cache=cache)
        assert calls, "the fused matmul was not used"
        assert guard.seen == ["aten._local_scalar_dense.default"], guard.seen


def _task_fused(world: World, dtype: str) -> dict:
    model = load_synthetic("tiny", dtype=getattr(torch, dtype), tp=world, fast=True)
    want = _cached_run(model, 1, 2)
    apply(model, "fused")
    return {"err": _rel(_cached_run(model, 1, 2), want), "logits": want}


@pytest.mark.slow
def test_tp2_fused_equals_reference(two_ranks):  # noqa: F811 (the imported fixture)
    """TP=2 (two gloo ranks, each compiling): the fused path on each rank's slices equals the reference."""
    outs = two_ranks(_task_fused, dtype="float32")
    ref = _cached_run(load_synthetic("tiny", dtype=torch.float32, fast=True), 1, 2)
    for o in outs:
        assert 0 < o["err"] < 1e-5
        assert _rel(o["logits"], ref) < 1e-5


def _task_words(world: World) -> dict:
    model = load_synthetic("tiny", dtype=torch.bfloat16, tp=world, fast="fused")
    want = _cached_run(model, 1, 2).float()
    apply(model, replace(FastPaths.of("fused"), nvfp4_words=True, mxfp8_words=True))
    got = _cached_run(model, 1, 2).float()
    return {"words": sorted({pw.words for _, pw in packed_weights(model)}), "err": _rel(got, want),
            "prefill_equal": torch.equal(got[:, :70], want[:, :70])}


@pytest.mark.slow
def test_tp2_words_equal_bytes(two_ranks):  # noqa: F811 (the imported fixture)
    """TP=2 (two gloo ranks): every rank's slices of the packed weights (rows or columns of the stored tensors) are
    read as int32 words, and the decode steps agree with the byte planes' to bf16 rounding of fp32 sums."""
    for o in two_ranks(_task_words):
        assert o["words"] == [True] and o["prefill_equal"] and o["err"] < 3e-2, o


@pytest.mark.slow
def test_tp_benchmark_dry_run_fused(capsys, monkeypatch):
    """benchmarks/tp2_packed.py with a fused variant: the early check passes, the variant runs, and the traffic
    estimate has the fused path reading far fewer bytes."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = _bench("tp2_packed.py", ["--device", "cpu", "--preset", "tiny", "--prompt-len", "90", "--decode-tokens",
                                   "2", "--batches", "1,5", "--bw-gib", "0.01", "--prefill-repeats", "1",
                                   "--variants", "eager,fused,compiled"], capsys)
    check = out["fused_check"]
    assert check["ok"] and [c["exact"] for c in check["cases"].values() if "exact" in c] == [True, True]
    assert out["decode"]["fused"]["1"]["steps"] == out["decode"]["fused"]["5"]["steps"] == 2
    assert out["decode"]["compiled"]["1"]["steps"] == out["decode"]["compiled"]["5"]["steps"] == 2
    traffic = out["packed_traffic"]["1"]
    assert 0 < traffic["fused_bytes"] < traffic["unfused_bytes"] / 5


def test_benchmark_refuses_fused_without_packed_weights(capsys, monkeypatch):
    """Asking for the fused matmul where it cannot apply ends the run before anything is loaded."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    err = _bench("tp2_packed.py", ["--device", "cpu", "--preset", "tiny", "--weights", "dequant", "--fast", "fused"],
                 capsys, code=2)
    assert "needs --weights packed" in err
    err = _bench("tp2_packed.py", ["--device", "cpu", "--preset", "tiny", "--fused-rows", "0"], capsys, code=2)
    assert "--fused-rows 0: give a positive row count" in err


def test_benchmarks_keep_each_presets_fused_rows():
    """Without --fused-rows a benchmark's variant runs its preset as users get it (`compiled`: the grouped kernel
    from two rows); with it, the given rows."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        tp2 = runpy.run_path(str(REPO / "benchmarks" / "tp2_packed.py"), run_name="tp2_packed")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    on = FastPaths.of("on")
    assert tp2["variant_fast"]("compiled-graph", on, None) == FastPaths.of("compiled")
    assert tp2["variant_fast"]("compiled-graph", on, None).fused_tokens == 1
    assert tp2["variant_fast"]("fused", on, None).fused_tokens == 8
    assert tp2["variant_fast"]("compiled", on, 4).fused_rows == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("script", ["profile_decode.py", "fused_matmul.py", "fused_variants.py", "launch_configs.py"])
def test_gpu_benchmarks_refuse_a_cpu_machine(capsys, monkeypatch, script):
    """The GPU-only benchmarks end with one clear line (exit 2) where there is no CUDA, before loading anything."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    err = _bench(script, [], capsys, code=2)
    assert err.startswith("error: [rank 0]") and "CUDA" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------- compiled layers


def test_words_switches_choose_the_weights_read_as_words(nvfp4_ckpt):
    """`nvfp4_words` reads every NVFP4 weight as words, `mxfp8_words="gate_up"` only the MXFP8 gate and up
    projections (the dense MLPs' and the shared expert's), True every MXFP8 weight; a bf16 model's decode steps read
    either way agree to bf16 rounding of fp32 sums in another order."""
    model = load_model(nvfp4_ckpt, dtype=torch.bfloat16, weights="packed")
    fused = FastPaths.of("fused")
    apply(model, fused)
    want = _cached_run(model, 1, 2).float()

    def read_as_words(fast: FastPaths) -> set[str]:
        apply(model, fast)
        return {name for name, pw in packed_weights(model) if pw.words}

    names = {name: pw.fmt for name, pw in packed_weights(model)}
    nvfp4 = {n for n, fmt in names.items() if fmt == "nvfp4"}
    gate_up = {n for n, fmt in names.items() if fmt == "mxfp8" and (".gate_proj." in n or ".up_proj." in n)}
    assert nvfp4 and gate_up and len(gate_up) < len(names) - len(nvfp4)
    assert read_as_words(replace(fused, nvfp4_words=True)) == nvfp4
    assert read_as_words(replace(fused, mxfp8_words=True)) == set(names) - nvfp4
    assert read_as_words(replace(fused, nvfp4_words=True, mxfp8_words="gate_up")) == nvfp4 | gate_up
    got = _cached_run(model, 1, 2).float()
    assert torch.equal(got[:, :70], want[:, :70]) and _rel(got, want) < 3e-2
    with pytest.raises(ConfigError, match="mxfp8_words='up': give True, False or \"gate_up\""):
        FastPaths(mxfp8_words="up")


def test_compile_layers_needs_a_static_step():
    """Compiled layers need the static-shape, synchronisation-free decode step; "compiled" turns on all of it."""
    with pytest.raises(ConfigError, match="compile_layers needs moe=True and static_kv=True"):
        FastPaths(compile_layers=True)
    compiled = FastPaths.of("compiled")
    assert compiled.compile_layers and compiled.matmul == "fused" and compiled.moe and compiled.static_kv


EAGER_COMPILED = replace(FastPaths.of("compiled"), compile_layers=False)


def _layer_kinds(model) -> int:
    return len({(layer.self_attn.sparse, hasattr(layer, "block_sparse_moe")) for layer in model.layers})


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_layers_equal_reference(nvfp4_ckpt, device):
    """Decode steps with every layer compiled (`fast="compiled"`) equal the reference to fp32 rounding and give
    its greedy tokens; the prefill (over sync_free_tokens) runs eagerly, bit for bit; the layers share one
    compiled graph per kind of layer (dense + MLP, MSA + MoE), not one per layer."""
    from torch._dynamo.utils import counters

    model = load_model(nvfp4_ckpt, dtype=torch.float32, weights="packed", device=device)
    sampling = SamplingParams(temperature=0)
    prompt = [IDS[0, :70].tolist()]
    want_tokens = generate_ids(model, prompt, max_new_tokens=4, sampling=sampling)[0][0].generated  # reference
    apply(model, EAGER_COMPILED)  # the same fast paths, run eagerly
    want = _cached_run(model, 1, 3)
    apply(model, "compiled")
    graphs = counters["stats"]["unique_graphs"]
    got = _cached_run(model, 1, 3)
    assert counters["stats"]["unique_graphs"] - graphs == _layer_kinds(model) == 2
    assert torch.equal(got[:, :70], want[:, :70])
    assert _rel(got, want) < 1e-5
    assert generate_ids(model, prompt, max_new_tokens=4, sampling=sampling)[0][0].generated == want_tokens
    # the model twin sizes caches in buckets (fast.CACHE_BUCKET): another prompt length compiles nothing new
    graphs = counters["stats"]["unique_graphs"]
    generate_ids(model, [IDS[0, :50].tolist()], max_new_tokens=7, sampling=sampling)
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_layers_step_aside_for_traces_and_masks(nvfp4_ckpt, monkeypatch):
    """A decode step with a trace or an expert mask runs the layers eagerly (those read values on the host), with
    the same fast paths' exact result run eagerly; an ordinary step takes the compiled layers. (The compiled function is
    replaced by a counting eager one: this test is about the dispatch, not the compiler.)"""
    from minimax_ref.fast.compiled import run_layer
    from minimax_ref.research.trace import Trace

    model = load_model(nvfp4_ckpt, dtype=torch.float32, weights="packed", fast="compiled")
    calls = []
    monkeypatch.setattr(model, "compiled", lambda *a: calls.append(1) or run_layer(*a))
    cache = model.new_cache(1, 96)
    with torch.no_grad():
        model(IDS[:1, :70], positions=torch.arange(70)[None], cache=cache)
        assert not calls  # a prefill of 70 tokens is not a decode step
        step = dict(positions=torch.tensor([[70]]), cache=cache)
        model(IDS[:1, 70:71], **step)
        assert len(calls) == len(model.layers)
        calls.clear()
        model(IDS[:1, 70:71], trace=Trace(), **step)
        moe = model.layers[1].block_sparse_moe
        moe.gate.expert_mask = torch.arange(moe.experts.num_experts) % 2 == 0
        masked = model(IDS[:1, 70:71], **step)
        assert not calls
        apply(model, EAGER_COMPILED)
        assert torch.equal(masked, model(IDS[:1, 70:71], **step))


@pytest.mark.gpu
@pytest.mark.parametrize("fast", ["fused", "compiled"])
def test_decode_step_captures_in_a_cuda_graph(nvfp4_ckpt, fast):
    """The fused decode step, and the compiled one (bf16, fp8 cache), compiled in the untimed warm-up steps, are
    captured in a CUDA graph (`fast.graph.GraphStep`); the replay gives the same fast paths' logits run eagerly
    (fused: the same kernels, to fp32 rounding; compiled: layers fused differently, to bf16 rounding, same argmax)."""
    from minimax_ref.fast.graph import GraphStep

    model = load_model(nvfp4_ckpt, dtype=torch.bfloat16, weights="packed", device="cuda", fast=fast)
    cache = model.new_cache(1, 96, "fp8")
    ids = IDS[:1].cuda()
    with torch.no_grad():
        model(ids[:, :70], positions=torch.arange(70, device="cuda")[None], cache=cache)
        pos = torch.tensor([[70]], device="cuda")
        graph = GraphStep(model, cache, ids[:, 70:71], pos)
        replayed = graph.step(ids[:, 70:71], pos).clone()
        if fast == "compiled":
            apply(model, EAGER_COMPILED)
        eager = model(ids[:, 70:71], positions=pos, cache=cache)[:, -1]
    assert _rel(replayed, eager) < (1e-6 if fast == "fused" else 2e-2)
    assert torch.equal(replayed.argmax(-1), eager.argmax(-1))


def _task_compiled(world: World) -> dict:
    model = load_synthetic("tiny", dtype=torch.float32, tp=world, fast=EAGER_COMPILED)
    want = _cached_run(model, 1, 2)
    apply(model, "compiled")
    return {"err": _rel(_cached_run(model, 1, 2), want), "logits": want}


@pytest.mark.slow
def test_tp2_compiled_layers_equal_eager(two_ranks):  # noqa: F811 (the imported fixture)
    """TP=2 (two gloo ranks, each compiling its layers, the all-reduces inside the compiled graphs): equal to the
    same fast paths run eagerly, and to TP=1."""
    outs = two_ranks(_task_compiled)
    ref = _cached_run(load_synthetic("tiny", dtype=torch.float32, fast=EAGER_COMPILED), 1, 2)
    for o in outs:
        assert o["err"] < 1e-5
        assert _rel(o["logits"], ref) < 1e-5


def test_materialize_is_the_identity():
    """`fast.compiled.materialize` returns x eagerly (the same tensor); compiled, x's values with x's strides
    through the operator's copy, and, once its inductor lowering is registered, through no operator call at all (x
    stored once)."""
    from torch._inductor.utils import run_and_get_code

    from minimax_ref.fast.compiled import materialize, register_materialize_lowering

    x = torch.randn(3, 4).t()
    assert materialize(x) is x

    def fn(t):
        return materialize(t * 2) + 1

    torch._dynamo.reset()
    from torch._inductor.lowering import lowerings

    if torch.ops.minimax_ref.materialize.default not in lowerings:
        with torch._inductor.config.patch(force_disable_caches=True):  # the caches' keys do not cover lowerings
            y, code = run_and_get_code(torch.compile(fn, fullgraph=True), x)
        assert torch.equal(y, x * 2 + 1) and "ops.minimax_ref.materialize" in code[0]
    register_materialize_lowering()
    register_materialize_lowering()  # once is enough; again is harmless
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        y, code = run_and_get_code(torch.compile(fn, fullgraph=True), x)
    assert torch.equal(y, x * 2 + 1) and "ops.minimax_ref.materialize" not in code[0]
