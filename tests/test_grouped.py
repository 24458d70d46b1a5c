"""The grouped dequantize-and-multiply of packed weights for batch > 1 decode steps (`FastPaths(grouped=True)`,
the switch that enables it): `fast.grouped.packed_matmul_grouped`, one Triton kernel that decodes each packed weight
tile once in registers and multiplies it by all the rows with `tl.dot`.

Where the cases run: `fast.grouped` makes its kernels interpreted or compiled when it is imported, from
`TRITON_INTERPRET`. The `interp` cases run the kernel in Triton's interpreter on CPU tensors and need the variable for
the whole run: `TRITON_INTERPRET=1 python -m pytest -q tests/test_grouped.py` (without it they are skipped). The `gpu`
cases compile it for CUDA: `python -m pytest -q -m gpu tests/test_grouped.py`. Where triton is not importable (CI)
only the pure-Python cases run (launch configuration data, the split heuristic, the switch).

Contract under test: y[e, m, n] = bf16(sum_k x[e, m, k] * w_hat[e, n, k]) with w_hat =
`quant.dequant_*(...).to(bfloat16)` bit for bit, products exact in fp32 (two bf16 values), the sum in fp32 in any order
and rounded once. Checks:

* bits: rows of the identity read every decoded element out exactly (a sum of one product and zeros), so the kernel's
  decoding is compared with the reference decoder bit for bit (as values: a sum of +-0 products is +0), on every byte
  value, scales of both signs, zero blocks, at both ends of the normal range (`scales_in_normal_range`);
* one rounding (interpreter): rows e_k + e_k+1 give bf16(fp32(w_hat[k] + w_hat[k+1])), the decoded bf16 weights added,
  not their unrounded fp32 values;
* rounding: against float64 sums of the same decoded weights, |y - exact| <= (1 + 2^-8) gamma_K(2u) sum_k |x w_hat|
  + 2^-8 |exact|, gamma_K(2u) = 2Ku / (1 - 2Ku), u = 2^-24: fp32 summation in any order with twice the unit roundoff
  (tensor cores may truncate when they align addends), then one rounding to bf16; with several K splits, per-entry x,
  partial tiles in N and M, and every row count up to `MAX_ROWS`;
* flags: inactive entries are zeros and the active ones are the unflagged call's bits;
* compiled for H200 without a GPU: the kernel as the GPU runs it compiles for sm_90 with triton's own ptxas and
  spills no register (runs wherever triton is importable and not interpreting);
* wiring: `FastPackedWeight.linear` / `matmul` and `FastExperts.forward_grouped` take the kernel above `fused_tokens`
  rows and equal the paths they replace to bf16 rounding; on CUDA, inside `torch.compile(fullgraph=True)`, inside a
  CUDA graph, and a whole compiled decode step of the tiny model at batch 16.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from graph_steps import captured_step_error
from test_fused import _mxfp8, _normal_nvfp4
from test_packed import _bench, _rel

import minimax_ref.fast.grouped as grouped
from minimax_ref.errors import ConfigError
from minimax_ref.fast import FastPaths, apply
from minimax_ref.fast.grouped import MAX_ROWS, Tiles, decode_grouped, packed_matmul_grouped, split_for, tiles_for
from minimax_ref.fast.packed import scales_in_normal_range
from minimax_ref.weights.loader import load_model
from minimax_ref.weights.packed import PackedWeight, decode_reference

U = 2.0**-24
BF16 = torch.bfloat16
INTERP = grouped.interpreting()
needs_triton = pytest.mark.skipif(not grouped.AVAILABLE, reason="triton is not importable")
interp = pytest.mark.skipif(not (grouped.AVAILABLE and INTERP),
                            reason="run with TRITON_INTERPRET=1 (Triton's interpreter on CPU tensors)")
gpu = [pytest.mark.gpu, pytest.mark.skipif(INTERP or not grouped.AVAILABLE,
                                           reason="compiled Triton kernels (not under TRITON_INTERPRET=1)")]
# The kernel's devices: the interpreter on CPU tensors, the compiled kernel on CUDA.
DEVICES = [pytest.param("cpu", marks=interp), pytest.param("cuda", marks=gpu)]
SMALL = Tiles(32, 64, 4, 1)  # partial column tiles and several K steps on tiny weights
WIDE = Tiles(16, 128, 4, 2)  # the narrowest column tiles, two K steps of 128
XMAJOR = Tiles(32, 64, 4, 2, x_major=1)  # x's rows as the MMA's row side, the decoded tile from shared memory
PLANES = Tiles(32, 128, 4, 2, planes=1)  # one product per nibble or byte position of the words, x permuted




# ---------------------------------------------------------------------------------------------- operands


def _operands(fmt: str, E: int, N: int, K: int, case: int = 1, device: str = "cpu"):
    """A packed stack [E, N, K] whose scales are in the normal range: NVFP4 block scales at the range's low end, in
    the middle and near its top (case 0, 1, 2); MXFP8 E8M0 codes likewise (products stay finite in bf16)."""
    if fmt == "nvfp4":
        lo, hi = ((2.0**-125, 2.0**-100), (1e-4, 1e-2), (0.25, 3.7))[case]
        w, s, g = _normal_nvfp4(E, N, K, lo, hi, seed=case + 1)
    else:
        w, s = _mxfp8(E, N, K, seed=case + 1, exponents=((3, 40), (100, 140), (200, 246))[case])
        g = None
    assert scales_in_normal_range(fmt, s, g)
    return [t if t is None else t.to(device) for t in (w, s, g)]


def _decoded(fmt, w, s, g) -> torch.Tensor:
    return decode_reference(fmt, w, s, g).to(BF16)


def _bound_ok(y: torch.Tensor, x: torch.Tensor, w_hat: torch.Tensor) -> tuple[bool, float]:
    """Whether bf16 y [.., M, N] is within the module docstring's bound of x [.., M, K] @ w_hat^T in float64; returns
    the worst ratio of error to bound too."""
    K = x.shape[-1]
    xd, wd = x.double().cpu(), w_hat.double().cpu()
    exact = xd @ wd.transpose(-1, -2)
    mags = xd.abs() @ wd.abs().transpose(-1, -2)
    gamma = 2 * K * U / (1 - 2 * K * U)
    bound = (1 + 2.0**-8) * gamma * mags + 2.0**-8 * exact.abs()
    err = (y.double().cpu() - exact).abs()
    ratio = float((err / bound.clamp(min=1e-300)).max())
    return bool((err <= bound).all()), ratio


# ---------------------------------------------------------------------------------------------- data (no triton)


def test_tiles_and_split_are_data():
    assert Tiles.parse("64,256,4,2") == Tiles(64, 256, 4, 2) and Tiles(64, 256, 4, 2).text() == "64,256,4,2"
    assert Tiles.parse("64,256,4,2,1") == Tiles(64, 256, 4, 2, 1) and Tiles(64, 256, 4, 2, 1).text() == "64,256,4,2,1"
    assert Tiles.parse("64,128,4,4,0,1") == Tiles(64, 128, 4, 4, planes=1)
    assert Tiles(64, 128, 4, 4, planes=1).text() == "64,128,4,4,0,1"
    for bad in ("64,256,4", "48,128,4,3", "8,128,4,3", "64,16,4,3", "64,256,4,2,2", "64,256,4,2,1,0,0",
                "64,128,4,4,1,1", "64,128,4,4,0,2"):
        with pytest.raises(ConfigError):
            Tiles.parse(bad)
    assert tiles_for("nvfp4", torch.device("cpu")) == grouped.DEFAULT["nvfp4"]
    assert grouped._fit_block_k(Tiles(block_k=128), 6144) == 128 and grouped._fit_block_k(Tiles(block_k=128), 96) == 32
    # 16 experts of 24 column tiles fill 132 SMs: no split; one linear of 4 tiles (k/v projections) splits K
    assert split_for(16 * 24, 48, 132) == 1
    s = split_for(4, 48, 132)
    assert 16 <= s <= 48 and 4 * s >= 2 * 132 or s == 48
    assert split_for(1, 3, 132) == 3 and split_for(1000, 3, 132) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_benchmarks_refuse_a_cpu_machine_and_parse_batch_lists(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    err = _bench("grouped_gemm.py", ["--rows", "32"], capsys, code=2)
    assert err.startswith("error: [rank 0]") and "CUDA" in err and "Traceback" not in err
    err = _bench("profile_decode.py", ["--batch", "1,32", "--grouped", "both"], capsys, code=2)
    assert err.startswith("error: [rank 0]") and "CUDA" in err
    assert "positive batch sizes" in _bench("profile_decode.py", ["--batch", "0,32"], capsys, code=2)
    err = _bench("routed_products.py", ["--tokens", "16"], capsys, code=2)
    assert err.startswith("error: [rank 0]") and "CUDA" in err and "Traceback" not in err
    assert "ROW_TILES,PER_SM" in _bench("routed_products.py", ["--launches", "1"], capsys, code=2)
    err = _bench("row_streams.py", [], capsys, code=2)
    assert err.startswith("error: [rank 0]") and "CUDA" in err and "Traceback" not in err


def test_grouped_switch():
    assert FastPaths.of("compiled").grouped and FastPaths.of("compiled").grouped_tokens == 64
    assert not FastPaths.of("fused").grouped and FastPaths.of("fused").grouped_tokens == 0
    assert FastPaths(grouped=True, sync_free_tokens=32).grouped_tokens == 32


# ---------------------------------------------------------------------------------------------- the kernel


def _ptxas() -> str | None:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return path if os.path.exists(path) else None


def _sm90_ptx(kernel, consts: dict, pointers: dict, **options) -> str:
    """The PTX of Triton `kernel` compiled for sm_90 (no GPU needed): `consts` its constexpr arguments, `pointers`
    the types of its pointer arguments (the rest int32), `options` num_warps / num_stages."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {n: pointers.get(n, "constexpr" if n in consts else "i32") for n in kernel.arg_names}
    constexprs = {(i,): consts[n] for i, n in enumerate(kernel.arg_names) if n in consts}
    out = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                         target=GPUTarget("cuda", 90, 32), options=options)
    return out.asm["ptx"]


def _ptxas_report(ptx: str) -> str:
    """What `ptxas -v` says of `ptx` assembled for sm_90a (registers, spills)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as fh:
            fh.write(ptx)
        return subprocess.run([_ptxas(), "--gpu-name", "sm_90a", "-v", path, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr


@pytest.mark.skipif(not grouped.AVAILABLE or INTERP, reason="compiles the CUDA kernel (triton, not interpreted)")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_kernel_compiles_for_h200_without_spills(fmt):
    """The kernel as the GPU runs it (EXACT_FP32 off: conversion instructions, bf16 tensor-core dots) compiles for
    sm_90 on any machine with triton (its ptxas), for the default tiles at 32 rows, flagged and split launches, the
    NVFP4 table decoder (its inline assembly), both orientations and one product per plane (`Tiles.planes`, at
    block_k 128: 16 words a step), with no register spills (ptxas -v)."""
    if _ptxas() is None:
        pytest.skip("triton's ptxas is not installed")
    kernel = grouped._packed_matmul_kernel
    tiles = grouped.DEFAULT[fmt]
    for has_active, out_bf16, table, x_major, planes in (
            (True, True, False, 0, 0), (False, False, False, 0, 0), (True, True, fmt == "nvfp4", 0, 0),
            (True, True, fmt == "nvfp4", 1, 0), (False, False, False, 1, 0), (True, True, False, 0, 1),
            (False, False, fmt == "nvfp4", 0, 1)):
        consts = {"NVFP4_FMT": fmt == "nvfp4", "HAS_ACTIVE": has_active, "OUT_BF16": out_bf16, "EXACT_FP32": False,
                  "BLOCK_M": 64 if x_major else 32, "BLOCK_N": tiles.block_n,
                  "BLOCK_K": max(tiles.block_k, 128) if planes else tiles.block_k, "TABLE": table,
                  "X_MAJOR": x_major, "PLANES": planes}
        pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "g_ptr": "*fp32", "active_ptr": "*i32",
                    "y_ptr": "*bf16" if out_bf16 else "*fp32"}
        ptx = _sm90_ptx(kernel, consts, pointers, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
        assert "mma" in ptx  # tensor-core products
        info = _ptxas_report(ptx)
        assert " 0 bytes spill stores" in info, info


@pytest.mark.skipif(not grouped.AVAILABLE or INTERP, reason="compiles the CUDA kernel (triton, not interpreted)")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_swiglu_pair_compiles_for_h200_without_spills(fmt):
    """`swiglu_pair_grouped`'s kernel (two accumulators, two decoded tiles a step) compiles for sm_90 at 32 rows with
    the tiles `TUNED` holds for the H200 and `DEFAULT`'s, flagged or not, NVFP4 also through the tables, with
    tensor-core products and no register spills (ptxas -v)."""
    if _ptxas() is None:
        pytest.skip("triton's ptxas is not installed")
    pointers = {"x_ptr": "*bf16", "gw_ptr": "*i32", "gs_ptr": "*u8", "gg_ptr": "*fp32", "uw_ptr": "*i32",
                "us_ptr": "*u8", "ug_ptr": "*fp32", "active_ptr": "*i32", "h_ptr": "*bf16", "alpha": "fp32",
                "limit": "fp32"}
    tuned = next(iter(grouped.TUNED.values()))[fmt]
    for tiles in (tuned, grouped.DEFAULT[fmt]):
        for has_active, table in ((True, False), (False, fmt == "nvfp4")):
            consts = {"NVFP4_FMT": fmt == "nvfp4", "HAS_ACTIVE": has_active, "EXACT_FP32": False, "BLOCK_M": 32,
                      "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "TABLE": table}
            ptx = _sm90_ptx(grouped._swiglu_pair_kernel, consts, pointers, num_warps=tiles.num_warps,
                            num_stages=tiles.num_stages)
            assert "mma" in ptx
            info = _ptxas_report(ptx)
            assert " 0 bytes spill stores" in info, (tiles, info)


@pytest.mark.skipif(not grouped.AVAILABLE or INTERP, reason="compiles the CUDA kernel (triton, not interpreted)")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_decoder_compiles_for_h200_without_spills(fmt):
    """The decoder kernel (`decode_grouped`) as the GPU runs it compiles for sm_90 with the default tiles and no
    register spills (ptxas -v)."""
    if _ptxas() is None:
        pytest.skip("triton's ptxas is not installed")
    kernel = grouped._decode_kernel
    tiles = grouped.DEFAULT[fmt]
    consts = {"NVFP4_FMT": fmt == "nvfp4", "EXACT_FP32": False, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k}
    pointers = {"w_ptr": "*i32", "s_ptr": "*u8", "g_ptr": "*fp32", "y_ptr": "*bf16"}
    info = _ptxas_report(_sm90_ptx(kernel, consts, pointers, num_warps=tiles.num_warps))
    assert " 0 bytes spill stores" in info, info


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("tiles", [SMALL, WIDE, XMAJOR, PLANES, None], ids=["small", "wide", "x_major", "planes",
                                                                           "default"])
def test_identity_rows_read_out_the_decoded_weight(device, fmt, tiles):
    E, N, K = 3, 40, 128
    for case in range(3):
        w, s, g = _operands(fmt, E, N, K, case, device)
        want = _decoded(fmt, w, s, g)  # [E, N, K]
        eye = torch.eye(K, dtype=BF16, device=device)
        for k0 in range(0, K, MAX_ROWS):
            got = packed_matmul_grouped(eye[k0:k0 + MAX_ROWS], fmt, w, s, g, tiles=tiles)  # [E, 64, N]
            assert torch.equal(got.transpose(-1, -2), want[..., k0:k0 + MAX_ROWS]), (case, k0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("fmt", "table"), [("nvfp4", False), ("nvfp4", True), ("mxfp8", False)],
                         ids=["nvfp4", "nvfp4-table", "mxfp8"])
@pytest.mark.parametrize("tiles", [SMALL, WIDE, None], ids=["small", "wide", "default"])
def test_decoder_writes_the_reference_bits(device, fmt, table, tiles):
    """`decode_grouped` (the same tile decoding, written out; NVFP4 also through the blocks' tables) is
    `decode_reference(...).to(bf16)` bit for bit: stacks at the normal range's low end, middle and top, partial
    column tiles, and a linear with a scalar global whose K (192) the default block_k does not divide."""
    for case in range(3):
        w, s, g = _operands(fmt, 3, 40, 128, case, device)
        assert torch.equal(decode_grouped(fmt, w, s, g, tiles=tiles, table=table), _decoded(fmt, w, s, g)), case
    w, s, g = _operands(fmt, 1, 72, 192, 1, device)
    w, s, g = w[0], s[0], None if g is None else g[0]
    got = decode_grouped(fmt, w, s, g, tiles=tiles, table=table)
    assert got.shape == (72, 192) and torch.equal(got, _decoded(fmt, w, s, g))


@interp
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_pairs_of_rows_add_the_rounded_weights(fmt):
    E, N, K = 2, 24, 64
    w, s, g = _operands(fmt, E, N, K, 1)
    want_w = _decoded(fmt, w, s, g).float()
    x = (torch.eye(K) + torch.eye(K).roll(1, dims=1))[: K - 1].to(BF16)  # row k: e_k + e_k+1
    want = (want_w[..., :-1] + want_w[..., 1:]).to(BF16).transpose(-1, -2)  # one fp32 add, one rounding
    for tiles in (SMALL, WIDE, XMAJOR, PLANES):  # K 64: PLANES by planes for MXFP8, interleaved for NVFP4
        assert torch.equal(packed_matmul_grouped(x, fmt, w, s, g, tiles=tiles), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_products_are_fp32_sums_of_the_decoded_weight(device, fmt):
    E, N, K = 3, 40, 256
    w, s, g = _operands(fmt, E, N, K, 1, device)
    w_hat = _decoded(fmt, w, s, g)
    gen = torch.Generator().manual_seed(7)
    rows = (1, 9, 33, 64) if device == "cuda" else (1, 9, 33)
    for M in rows:
        x = torch.randn(M, K, generator=gen).to(BF16).to(device)
        for split, tiles in ((1, SMALL), (3, SMALL), (2, WIDE), (3, XMAJOR), (2, PLANES)):
            y = packed_matmul_grouped(x, fmt, w, s, g, tiles=tiles, split=split)
            assert y.shape == (E, M, N) and y.dtype == BF16
            ok, ratio = _bound_ok(y, x.expand(E, M, K), w_hat)
            assert ok, (M, split, ratio)
    xe = torch.randn(E, 5, K, generator=gen).to(BF16).to(device)  # one x per entry
    for tiles in (SMALL, PLANES):
        ok, ratio = _bound_ok(packed_matmul_grouped(xe, fmt, w, s, g, tiles=tiles), xe, w_hat)
        assert ok, (tiles, ratio)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_inactive_entries_are_zeros_and_not_changed_otherwise(device, fmt):
    E, N, K = 4, 40, 128
    w, s, g = _operands(fmt, E, N, K, 1, device)
    x = torch.randn(12, K, generator=torch.Generator().manual_seed(3)).to(BF16).to(device)
    every = packed_matmul_grouped(x, fmt, w, s, g, tiles=SMALL)
    active = torch.tensor([1, 0, 1, 0], dtype=torch.int32, device=device)
    some = packed_matmul_grouped(x, fmt, w, s, g, active=active, tiles=SMALL)
    assert torch.equal(some[[0, 2]], every[[0, 2]]) and not some[[1, 3]].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_one_linear_with_a_scalar_global(device, fmt):
    N, K = 72, 192  # K: 192 = 3 * 64, so the default block_k of 128 falls back to 64
    w, s, g = _operands(fmt, 1, N, K, 2 if fmt == "nvfp4" else 1, device)  # MXFP8's top codes overflow sums
    w, s = w[0], s[0]
    g = None if g is None else g[0]  # a linear's global is a scalar
    x = torch.randn(20, K, generator=torch.Generator().manual_seed(4)).to(BF16).to(device)
    y = packed_matmul_grouped(x, fmt, w, s, g)
    assert y.shape == (20, N)
    ok, ratio = _bound_ok(y, x, _decoded(fmt, w, s, g))
    assert ok, ratio


# ---------------------------------------------------------------------------------------------- the table decoder


def _run_ptx(text: str, operands: dict[str, int]) -> dict[str, int]:
    """`grouped._TABLE_ASM` executed instruction by instruction on 32-bit integers, by the PTX ISA's definitions of
    each instruction it uses (prmt.b32's default mode: bytes {b, a} indexed 0..7, a selector nibble's bit 3 replicating
    the picked byte's sign bit; lop3.b32 by its truth table; mad.lo / add / shifts modulo 2^32; mov.b32 {lo, hi}
    splitting a word into halves; mul.f32 as IEEE fp32 multiplication rounded to nearest even, on the registers' bits;
    cvt.rn.bf16x2.f32 d, a, b: a rounded to bf16 in d's high half, b in its low half, to nearest even; fma.rn.bf16x2
    half by half, a * b + c rounded once to bf16; cvt.rn.f16x2.e4m3x2 byte 0 to the low half; cvt.f32.f16; mov.b32
    d, literal). Returns every register and output ($0..$7 as
    16-bit values)."""
    regs = dict(operands)

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if tok.startswith("0f"):  # a PTX fp32 literal: its bits in hexadecimal
            return int(tok[2:], 16)
        return int(tok, 0) & 0xFFFFFFFF

    def f32(bits: int) -> torch.Tensor:
        return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)

    def bf16_bits(bits: int) -> int:
        return int(f32(bits).to(BF16).view(torch.int16)) & 0xFFFF

    def bf16(bits: int) -> torch.Tensor:
        return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(BF16)

    def f16_bits(e4m3: int) -> int:
        value = torch.tensor([e4m3], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        assert torch.isfinite(value), "an E4M3 NaN is outside the model"
        return int(value.to(torch.float16).view(torch.int16)) & 0xFFFF

    def fma_bf16(a: int, b: int, c: int) -> int:
        # a * b + c exactly (fp64: a bf16 product has 16 significant bits), rounded once to bf16 through fp32, which
        # must hold the sum exactly for that to be one rounding (else this model does not cover the operands)
        exact = bf16(a).double() * bf16(b).double() + bf16(c).double()
        if exact == 0:  # IEEE: an exact zero sum is -0 only when both addends are -0
            sign = torch.signbit(bf16(a).double() * bf16(b).double()) & torch.signbit(bf16(c).double())
            exact = -exact.abs() if sign else exact.abs()
        single = exact.float()
        assert single.double() == exact, "fma.rn.bf16x2 operands outside the model"
        return int(single.to(BF16).view(torch.int16)) & 0xFFFF

    def prmt(a: int, b: int, c: int) -> int:
        src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
        out = 0
        for i in range(4):
            n = (c >> 4 * i) & 0xF
            byte = src[n & 7]
            out |= ((0xFF if byte & 0x80 else 0) if n & 8 else byte) << 8 * i
        return out

    for line in text.split(";"):
        line = line.strip().removeprefix("{").strip()
        if not line or line == "}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and "{" not in rest:  # a register set to a literal
            d, src = (t.strip() for t in rest.split(","))
            regs[d] = val(src)
            continue
        if op == "mov.b32":
            halves, src = rest.split("}")
            lo, hi = (h.strip() for h in halves.strip(" {").split(","))
            word = val(src.strip(" ,"))
            regs[lo], regs[hi] = word & 0xFFFF, word >> 16
            continue
        d, *a = (t.strip() for t in rest.split(","))
        x = [val(t) for t in a]
        if op == "mad.lo.u32":
            r = x[0] * x[1] + x[2]
        elif op == "add.u32":
            r = x[0] + x[1]
        elif op == "prmt.b32":
            r = prmt(*x)
        elif op == "shl.b32":
            r = x[0] << x[1]
        elif op == "shr.u32":
            r = x[0] >> x[1]
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "mul.f32":
            r = int((f32(x[0]) * f32(x[1])).view(torch.int32)) & 0xFFFFFFFF
        elif op == "cvt.rn.bf16x2.f32":
            r = bf16_bits(x[0]) << 16 | bf16_bits(x[1])
        elif op == "cvt.rn.f16x2.e4m3x2":  # byte 0 to the low half, byte 1 to the high half (exact)
            r = f16_bits(x[0] & 0xFF) | f16_bits(x[0] >> 8 & 0xFF) << 16
        elif op == "cvt.f32.f16":
            r = int(torch.tensor([x[0]], dtype=torch.int32).to(torch.int16).view(torch.float16).float()
                    .view(torch.int32)) & 0xFFFFFFFF
        elif op == "fma.rn.bf16x2":
            r = (fma_bf16(x[0] >> 16, x[1] >> 16, x[2] >> 16) << 16
                 | fma_bf16(x[0] & 0xFFFF, x[1] & 0xFFFF, x[2] & 0xFFFF))
        elif op == "lop3.b32":
            r = sum(((x[3] >> ((x[0] >> i & 1) << 2 | (x[1] >> i & 1) << 1 | (x[2] >> i & 1))) & 1) << i
                    for i in range(32))
        else:
            raise AssertionError(f"instruction {op} is not modelled")
        regs[d] = r & 0xFFFFFFFF
    return regs


def _table_words(s: torch.Tensor) -> list[int]:
    """The four table words of a block scale s (fp32), built as `grouped._table_words` states: entries (s's signed
    zero, A/2, A, B, 2A, 2B, 4A, 4B) as bf16 bits, A = bf16(s), B = bf16(fp32(1.5 s)); every entry s's zero for s = 0.
    Computed here from the values (halving and doubling bf16 numbers), not from the kernel's bit arithmetic."""
    a, b = s.to(BF16), (s * 1.5).to(BF16)
    if s == 0:
        entries = [a] * 8
    else:
        entries = [a * 0.0, a / 2, a, b, a * 2, b * 2, a * 4, b * 4]
    bits = [int(e.view(torch.int16)) & 0xFFFF for e in entries]
    return [bits[2 * i] | bits[2 * i + 1] << 16 for i in range(4)]


@needs_triton
def test_table_assembly_decodes_the_reference_bits():
    """The table decoder's PTX text (`grouped._TABLE_ASM`), run through a model of each instruction, gives
    `decode_reference(...).to(bf16)` bit for bit: every E4M3 block scale (negative and zero ones included) whose
    product with the global is in the normal range, globals from 1e-7 to 1/448, and words covering every code and
    sign of every nibble (signed zeros included)."""
    codes = torch.arange(256, dtype=torch.uint8)
    value = codes.view(torch.float8_e4m3fn).float()
    words = [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567, 0x88888888, 0xF0F0F0F0, 0x0F1E2D3C, 0xFFFFFFFF]
    data = torch.tensor([(w >> 8 * i) & 0xFF for w in words for i in range(4)], dtype=torch.uint8)
    checked = 0
    for g in (1 / 448, 2.0**-20 * 3, 1 / 2688, 7.77e-6, 1.3e-7):
        glob = torch.tensor(g, dtype=torch.float32)
        block = value * glob
        keep = torch.isfinite(value) & ((block == 0) | ((block.abs() >= 2.0**-125) & (block.abs() < 4)))
        s = codes[keep].view(torch.float8_e4m3fn)[:, None].expand(-1, len(words) // 2).contiguous()
        assert scales_in_normal_range("nvfp4", s, glob)
        want = decode_reference("nvfp4", data.expand(len(s), -1).contiguous(), s, glob).to(BF16)
        want = want.view(torch.int16).int() & 0xFFFF  # [scales, 8 words x 8 elements]
        for r, scale in enumerate(block[keep]):
            table = dict(zip(("$9", "$10", "$11", "$12"), _table_words(scale)))
            for w_i, word in enumerate(words):
                out = _run_ptx(grouped._TABLE_ASM.value, {"$8": word, **table})
                got = [out[f"${j}"] for j in range(8)]
                assert got == want[r, 8 * w_i:8 * w_i + 8].tolist(), (g, float(scale), hex(word))
                checked += 8
    assert checked > 5 * 200 * 64


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", [SMALL, WIDE, XMAJOR, PLANES, None], ids=["small", "wide", "x_major", "planes",
                                                                           "default"])
def test_table_decoder_reads_out_the_decoded_weight(device, tiles):
    """`packed_matmul_grouped(..., table=True)` (under the interpreter its integer form of the table, on the GPU the
    assembly): identity rows read out `decode_reference(...).to(bf16)` bit for bit at the normal range's low end, in
    the middle and near its top (block scales of both signs and zeros); products within the fp32 bound; MXFP8
    ignores the switch."""
    E, N, K = 3, 40, 128
    eye = torch.eye(K, dtype=BF16, device=device)
    for case in range(3):
        w, s, g = _operands("nvfp4", E, N, K, case, device)
        want = _decoded("nvfp4", w, s, g)
        for k0 in range(0, K, MAX_ROWS):
            got = packed_matmul_grouped(eye[k0:k0 + MAX_ROWS], "nvfp4", w, s, g, tiles=tiles, table=True)
            assert torch.equal(got.transpose(-1, -2), want[..., k0:k0 + MAX_ROWS]), (case, k0)
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(5)).to(BF16).to(device)
    w, s, g = _operands("nvfp4", E, N, K, 1, device)
    assert _bound_ok(packed_matmul_grouped(x, "nvfp4", w, s, g, tiles=tiles, split=2, table=True),
                     x.expand(E, 9, K), _decoded("nvfp4", w, s, g))[0]
    w, s, _ = _operands("mxfp8", E, N, K, 1, device)
    assert torch.equal(packed_matmul_grouped(x, "mxfp8", w, s, None, tiles=tiles, table=True),
                       packed_matmul_grouped(x, "mxfp8", w, s, None, tiles=tiles))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_multiplies_nvfp4_through_the_table(device, monkeypatch):
    """`compiled` sets `nvfp4_table`: NVFP4 weights are multiplied through the table decoder, MXFP8 weights are not,
    and `grouped=True` alone leaves it off."""
    seen = []
    real = grouped.packed_matmul_grouped
    monkeypatch.setattr(grouped, "packed_matmul_grouped",
                        lambda *a, **kw: seen.append(kw.get("table")) or real(*a, **kw))
    assert FastPaths.of("compiled").nvfp4_table
    pw = _packed_linear("nvfp4", 48, 128, device)
    want_w = pw.decode()
    apply(pw, FastPaths.of("compiled"))
    assert pw.table
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(6)).to(BF16).to(device)
    assert _bound_ok(pw.linear(x), x, want_w)[0] and seen == [True]
    mx = _packed_linear("mxfp8", 48, 128, device)
    apply(mx, FastPaths.of("compiled"))
    assert not mx.table and mx.grouped_tokens == 64
    apply(pw, FastPaths(grouped=True))
    assert not pw.table


# ---------------------------------------------------------------------------------------------- wiring


def _packed_linear(fmt: str, N: int, K: int, device: str) -> PackedWeight:
    w, s, g = _operands(fmt, 1, N, K, 1, device)
    return PackedWeight(fmt, w[0], s[0], None if g is None else g[0], dtype=BF16)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_decode_mode_decodes_through_the_kernel(device, monkeypatch):
    """`FastPaths(decode="triton")`: a bf16 weight decodes through `decode_grouped` (whole, one expert, gathered
    experts) with the reference's bits; an fp32 decode takes the two-pass decoder."""
    calls = []
    real = grouped.decode_grouped
    monkeypatch.setattr(grouped, "decode_grouped", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    for fmt in ("nvfp4", "mxfp8"):
        w, s, g = _operands(fmt, 4, 40, 128, 1, device)
        pw = PackedWeight(fmt, w, s, g, dtype=BF16)
        want = pw.decode()
        apply(pw, FastPaths(decode="triton"))
        assert pw.decode_tiles is not None
        index = torch.tensor([3, 1], device=device)
        assert torch.equal(pw.decode(), want) and torch.equal(pw.decode(2), want[2])
        assert torch.equal(pw.decode(index), want[index])
        assert len(calls) == 3
        assert torch.equal(pw.decode(dtype=torch.float32), decode_reference(fmt, w, s, g)) and len(calls) == 3
        calls.clear()
    assert FastPaths.of("compiled").decode == "triton"


@pytest.mark.parametrize("device", DEVICES)
def test_packed_weight_takes_the_kernel_above_the_fused_rows(device, monkeypatch):
    calls = []
    real = grouped.packed_matmul_grouped

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(grouped, "packed_matmul_grouped", spy)
    for fmt in ("nvfp4", "mxfp8"):
        pw = _packed_linear(fmt, 48, 128, device)
        want_w = pw.decode()
        apply(pw, FastPaths(grouped=True))
        assert pw.grouped_tokens == 64
        x = torch.randn(3, 4, 128, generator=torch.Generator().manual_seed(1)).to(BF16).to(device)
        y = pw.linear(x)  # 12 rows: more than fused_tokens (0 here), so grouped
        assert calls[-1] == (12, 128) and y.shape == (3, 4, 48)
        assert _bound_ok(y.reshape(12, 48), x.reshape(12, 128), want_w)[0]
        assert _rel(y, F.linear(x, want_w)) < 1e-2
        n = len(calls)
        pw.linear(torch.zeros(65, 128, dtype=BF16, device=device))  # past grouped_tokens: decode, then multiply
        assert len(calls) == n
        apply(pw, FastPaths())


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_rows_preset_takes_one_row(device, monkeypatch):
    """The non-user preset `grouped-rows` (`compiled` without the fused product) multiplies one-row inputs by the
    grouped kernel too; `compiled` keeps them on the fused product."""
    calls = []
    real = grouped.packed_matmul_grouped
    monkeypatch.setattr(grouped, "packed_matmul_grouped", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    pw = _packed_linear("nvfp4", 48, 128, device)
    want_w = pw.decode()
    apply(pw, FastPaths.of("grouped-rows"))
    assert pw.fused_tokens == 0 and pw.grouped_tokens == 64
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(2)).to(BF16).to(device)
    y = pw.linear(x)
    assert calls == [(1, 128)] and _bound_ok(y, x, want_w)[0]
    apply(pw, FastPaths.of("compiled"))
    assert pw.fused_tokens == 1
    apply(pw, FastPaths())


@pytest.fixture(scope="module")
def tiny(ckpt_factory):
    return ckpt_factory("tiny", "nvfp4")


def _swiglu_of(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """The SwiGLU of bf16 products in fp32, rounded once to bf16 (`swiglu_pair_grouped`'s contract)."""
    g, u = gate.float().clamp(max=limit), up.float().clamp(-limit, limit)
    return ((u + 1) * (g * torch.sigmoid(alpha * g))).to(BF16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("fmt", "table"), [("nvfp4", False), ("nvfp4", True), ("mxfp8", False)],
                         ids=["nvfp4", "nvfp4-table", "mxfp8"])
def test_swiglu_pair_is_the_activation_of_the_two_products(device, fmt, table):
    """`swiglu_pair_grouped` against the two products of `packed_matmul_grouped` at one K split (the same sums) and
    their SwiGLU in fp32: within one bf16 step of it (the sigmoid's last fp32 bit apart), most elements equal; inactive
    entries give zero rows; partial column tiles, rows across the clamp limit (x scaled up)."""
    E, N, K = 3, 40, 256
    alpha, limit = 1.702, 7.0
    w1, s1, g1 = _operands(fmt, E, N, K, 1, device)
    w3, s3, g3 = _operands(fmt, E, N, K, 2 if fmt == "nvfp4" else 1, device)
    w3 = w3.flip(1).contiguous()  # another weight of the same scale range
    gen = torch.Generator().manual_seed(11)
    for M, tiles in ((1, SMALL), (9, WIDE), (33, SMALL)):
        x = (torch.randn(M, K, generator=gen) * 30).to(BF16).to(device)
        gate = packed_matmul_grouped(x, fmt, w1, s1, g1, tiles=tiles, split=1, table=table)
        up = packed_matmul_grouped(x, fmt, w3, s3, g3, tiles=tiles, split=1, table=table)
        want = _swiglu_of(gate, up, alpha, limit)
        got = grouped.swiglu_pair_grouped(x, fmt, (w1, s1, g1), (w3, s3, g3), alpha, limit, tiles=tiles, table=table)
        assert got.shape == (E, M, N) and got.dtype == BF16
        steps = (got.float() - want.float()).abs() / want.float().abs().clamp(min=2.0**-126)
        assert float(steps.max()) <= 2.0**-7, (M, float(steps.max()))
        assert float((got == want).float().mean()) > 0.99
        assert bool((gate.float() > limit).any()) and bool((up.float().abs() > limit).any())
    active = torch.tensor([0, 1, 0], dtype=torch.int32, device=device)
    some = grouped.swiglu_pair_grouped(x, fmt, (w1, s1, g1), (w3, s3, g3), alpha, limit, active=active, tiles=SMALL)
    every = grouped.swiglu_pair_grouped(x, fmt, (w1, s1, g1), (w3, s3, g3), alpha, limit, tiles=SMALL)
    assert torch.equal(some[1], every[1]) and not some[[0, 2]].any()
    with pytest.raises(ValueError, match="swiglu_pair_grouped"):
        grouped.swiglu_pair_grouped(x, fmt, (w1, s1, g1), (w3[:2], s3[:2], g3 if g3 is None else g3[:2]), alpha,
                                    limit)


@pytest.mark.parametrize("device", DEVICES)
def test_experts_read_only_the_chosen_ones(device, tiny, monkeypatch):
    """`FastExperts.forward_grouped` equals the sync-free path it replaces (decode, then bf16 matmuls) to bf16
    rounding, and flags exactly the experts some token chose."""
    model = load_model(tiny, dtype=BF16, weights="packed", device=device)
    moe = model.layers[1].block_sparse_moe
    ex = moe.experts
    x = torch.randn(12, model.text.hidden_size, generator=torch.Generator().manual_seed(5)).to(BF16).to(device)
    r = moe.gate(x)
    apply(ex, FastPaths(moe=True))
    want = ex.forward_sync_free(x, r)
    flags = []
    real = grouped.packed_matmul_grouped

    def spy(*args, active=None, **kwargs):
        flags.append(active)
        return real(*args, active=active, **kwargs)

    monkeypatch.setattr(grouped, "packed_matmul_grouped", spy)
    apply(ex, FastPaths(moe=True, grouped=True))
    got = ex.forward_sync_free(x, r)
    chosen = torch.zeros(len(ex.local_experts), dtype=torch.int32)
    chosen[r.expert_ids.flatten().cpu()] = 1
    assert len(flags) == 3 and all(torch.equal(f.cpu(), chosen) for f in flags)
    assert _rel(got, want) < 2e-2, _rel(got, want)
    # a routing that leaves experts out: their rows are never combined
    r.expert_ids[:] = r.expert_ids[:1]
    apply(ex, FastPaths(moe=True))
    want = ex.forward_sync_free(x, r)
    apply(ex, FastPaths(moe=True, grouped=True))
    assert _rel(ex.forward_sync_free(x, r), want) < 2e-2
    apply(ex, FastPaths())


@pytest.mark.parametrize("device", DEVICES)
def test_experts_take_the_swiglu_pair(device, tiny, monkeypatch):
    """`grouped_swiglu`: `FastExperts.forward_grouped` multiplies gate and up with their SwiGLU in one launch over the
    flagged experts (w2 by the grouped kernel as before), equal to the two products and the activation to bf16
    rounding; where the two stacks' launches differ, the two products and the activation as before."""
    model = load_model(tiny, dtype=BF16, weights="packed", device=device)
    moe = model.layers[1].block_sparse_moe
    ex = moe.experts
    x = torch.randn(12, model.text.hidden_size, generator=torch.Generator().manual_seed(5)).to(BF16).to(device)
    r = moe.gate(x)
    apply(ex, FastPaths(moe=True, grouped=True))
    want = ex.forward_sync_free(x, r)
    pairs, products = [], []
    real_pair, real_product = grouped.swiglu_pair_grouped, grouped.packed_matmul_grouped
    monkeypatch.setattr(grouped, "swiglu_pair_grouped",
                        lambda *a, active=None, **k: pairs.append(active) or real_pair(*a, active=active, **k))
    monkeypatch.setattr(grouped, "packed_matmul_grouped",
                        lambda *a, **k: products.append(a[1]) or real_product(*a, **k))
    apply(ex, FastPaths(moe=True, grouped=True, grouped_swiglu=True))
    # one K split, as at release widths (a GPU's many SMs split this tiny model's products, which takes no pair)
    ex.w1.grouped_launch = ex.w3.grouped_launch = (ex.w1.grouped_launch[0], 1)
    got = ex.forward_sync_free(x, r)
    chosen = torch.zeros(len(ex.local_experts), dtype=torch.int32)
    chosen[r.expert_ids.flatten().cpu()] = 1
    assert len(pairs) == 1 and torch.equal(pairs[0].cpu(), chosen) and len(products) == 1
    assert _rel(got, want) < 2e-2, _rel(got, want)
    ex.w3.grouped_launch = (SMALL, 1) if ex.w1.grouped_launch[0] != SMALL else (WIDE, 1)  # launches that differ
    pairs.clear()
    products.clear()
    assert _rel(ex.forward_sync_free(x, r), want) < 2e-2 and not pairs and len(products) == 3
    ex.w3.grouped_launch = (ex.w1.grouped_launch[0], 2)  # K splits: no pair either
    pairs.clear()
    products.clear()
    assert _rel(ex.forward_sync_free(x, r), want) < 2e-2 and not pairs and len(products) == 3
    apply(ex, FastPaths())


@pytest.mark.gpu
@pytest.mark.skipif(INTERP or not grouped.AVAILABLE, reason="compiled Triton kernels")
def test_swiglu_pair_preset_decode_step_at_batch_16_equals_reference(tiny):
    """The `grouped-swiglu` preset's captured decode step of 16 sequences against the reference engine."""
    err = captured_step_error(tiny, "grouped-swiglu", 16, "grouped_tokens")
    assert math.isfinite(err) and err < 5e-2


@pytest.mark.gpu
@pytest.mark.skipif(INTERP or not grouped.AVAILABLE, reason="compiled Triton kernels")
def test_sort_topk_decode_step_at_batch_16_equals_reference(tiny):
    """`compiled` with and without `sort_topk` (the routing's and block selection's top-k by inductor's sort kernel,
    which `compiled` takes, or ATen's topk): the captured decode step of 16 sequences against the reference engine."""
    assert FastPaths.of("compiled").sort_topk
    err = captured_step_error(tiny, replace(FastPaths.of("compiled"), sort_topk=False), 16, "grouped_tokens")
    assert math.isfinite(err) and err < 5e-2
    err = captured_step_error(tiny, "compiled", 16, "grouped_tokens")
    assert math.isfinite(err) and err < 5e-2


@interp
def test_decode_step_of_a_batch_equals_the_paths_it_replaces(tiny, monkeypatch):
    """A cached decode step of 12 sequences with every eager fast path, grouped on and off: bf16 rounding apart; every
    packed product of the step (attention, shared and routed experts, dense MLP) takes the kernel."""
    model = load_model(tiny, dtype=BF16, weights="packed")
    calls = []
    real = grouped.packed_matmul_grouped
    monkeypatch.setattr(grouped, "packed_matmul_grouped", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    ids = torch.randint(0, 1000, (12, 9), generator=torch.Generator().manual_seed(0))

    def run() -> torch.Tensor:
        with torch.no_grad():
            cache = model.new_cache(12, 16)
            model(ids[:, :8], positions=torch.arange(8).expand(12, -1), cache=cache)
            return model(ids[:, 8:], positions=torch.full((12, 1), 8), cache=cache)

    apply(model, FastPaths.of("fused"))
    want = run()
    assert not calls
    apply(model, replace(FastPaths.of("fused"), grouped=True))
    got = run()
    packed = sum(1 for m in model.modules() if isinstance(m, PackedWeight))
    assert len(calls) >= packed, (len(calls), packed)  # the decode step's; the prefill (96 rows) decodes
    assert _rel(got, want) < 2e-2, _rel(got, want)
    apply(model, False)


@interp
def test_compiled_preset_multiplies_verify_steps_by_the_kernel(tiny, monkeypatch):
    """With `--fast compiled`'s thresholds (the fused matmul for one row, the kernel from two), every packed product
    of a verify-sized step (one sequence, 8 tokens) takes the kernel, and the step equals the eager paths' to bf16
    rounding."""
    model = load_model(tiny, dtype=BF16, weights="packed")
    calls = []
    real = grouped.packed_matmul_grouped
    monkeypatch.setattr(grouped, "packed_matmul_grouped", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(3))

    def run() -> torch.Tensor:
        with torch.no_grad():
            cache = model.new_cache(1, 16)
            model(ids[:, :4], positions=torch.arange(4)[None], cache=cache)
            calls.clear()
            return model(ids[:, 4:], positions=torch.arange(4, 12)[None], cache=cache)

    apply(model, FastPaths.of("on"))
    want = run()
    assert not calls
    compiled = FastPaths.of("compiled")
    assert (compiled.fused_tokens, compiled.grouped_tokens) == (1, 64)
    # eager layers and cached attention of the preset: the products' routing is what is under test
    apply(model, replace(compiled, compile_layers=False, graph=False, decode_attention="reference"))
    got = run()
    packed = sum(1 for m in model.modules() if isinstance(m, PackedWeight))
    assert len(calls) >= packed and all(shape[-2] == 8 for shape in calls), (len(calls), packed)
    assert _rel(got, want) < 2e-2, _rel(got, want)
    apply(model, False)


# ---------------------------------------------------------------------------------------------- CUDA only


@pytest.mark.gpu
@pytest.mark.skipif(INTERP or not grouped.AVAILABLE, reason="compiled Triton kernels")
def test_kernel_in_compiled_regions_and_cuda_graphs():
    """Through `torch.compile(fullgraph=True)` (the operator `minimax_ref::packed_matmul_grouped`) and replayed from a
    CUDA graph, the kernel gives the eager launch's bits, with K split (the splits' partial sums are added by a kernel
    of their own, in the same order in both)."""
    pw = _packed_linear("nvfp4", 256, 512, "cuda")
    apply(pw, FastPaths(grouped=True))
    assert pw.grouped_launch[1] > 1  # a few column tiles: K splits to fill the GPU
    x = torch.randn(32, 512, device="cuda").to(BF16)
    eager = pw.linear(x)
    compiled = torch.compile(pw.linear, fullgraph=True)(x)
    assert torch.equal(compiled, eager)
    static = x.clone()
    pw.linear(static)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pw.linear(static)
    static.copy_(x)
    graph.replay()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.skipif(INTERP or not grouped.AVAILABLE, reason="compiled Triton kernels")
def test_compiled_decode_step_at_batch_16_equals_reference(tiny):
    """The tiny model on CUDA: `--fast compiled` (grouped on) decode steps of 16 sequences, captured in a CUDA graph,
    against the reference engine (bf16 both): logits within bf16 rounding."""
    err = captured_step_error(tiny, "compiled", 16, "grouped_tokens")
    assert math.isfinite(err) and err < 5e-2



def test_main_loop_is_the_longest_backward_branch():
    """benchmarks/kernel_sass.py's loop finder on hand-written SASS: the instructions from the target of the
    longest backward branch to the branch (a forward branch and a shorter inner loop do not count)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    if not grouped.AVAILABLE:
        pytest.skip("kernel_sass.py needs triton")
    from kernel_sass import main_loop

    lines = [(0x00, "MOV", "MOV R1, R2 ;"), (0x10, "BRA", "@P0 BRA 0x60 ;"), (0x20, "FFMA", "FFMA R1, R2, R3, R1 ;"),
             (0x30, "LOP3", "LOP3.LUT R4, R5, 0xf, RZ, 0xc0, !PT ;"), (0x40, "BRA", "@P1 BRA 0x30 ;"),
             (0x50, "BRA", "@P2 BRA 0x20 ;"), (0x60, "EXIT", "EXIT ;")]
    assert [a for a, _, _ in main_loop(lines)] == [0x20, 0x30, 0x40, 0x50]
    assert main_loop(lines[:2]) == []


@pytest.mark.skipif(not grouped.AVAILABLE or INTERP, reason="compiles the CUDA kernel (triton, not interpreted)")
def test_kernel_sass_counts_the_gemv_loop():
    """benchmarks/kernel_sass.py on the one-row NVFP4 GEMV, compiled for sm_90 offline: the launch is intercepted
    (nothing runs), the main loop found, and it holds the CUDA-core products (one FFMA per weight element of a
    thread's iteration: 32 rows x 256 elements over 128 threads), no tensor-core instruction and no shared-memory
    traffic; the same through the blocks' tables."""
    if _ptxas() is None:
        pytest.skip("triton's ptxas is not installed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from kernel_sass import main

    for case in ("gemv-nvfp4", "gemv-nvfp4-table"):
        rows = {r["kernel"]: r for r in main(["--cases", case])}
        gemv_row = rows["_gemv_kernel"]
        assert gemv_row["elements_per_thread_iteration"] == 64
        assert gemv_row["loop_ops"]["FFMA"] == 64 and not any("MMA" in op for op in gemv_row["loop_ops"])
        assert gemv_row["loop_instructions_per_element"] > 1 and gemv_row["local_bytes"] == 0
        # words and x go from global memory to registers: nothing through shared memory, no barrier
        assert gemv_row["loop_shared"] == {"stores": 0, "loads": 0, "barriers": 0, "mma_waits": 0}, case


@pytest.mark.skipif(not grouped.AVAILABLE or INTERP, reason="compiles the CUDA kernel (triton, not interpreted)")
def test_kernel_sass_planes_keep_the_decoded_tile_out_of_shared_memory():
    """benchmarks/kernel_sass.py on the grouped kernel at the tuned tiles (64,128,4,4, 32 rows), compiled for sm_90
    offline: one product per plane (`Tiles.planes`) moves fewer values through shared memory in its loop, with fewer
    barriers, than the tile interleaved into K order (whose decoded tile goes through shared memory to the MMA's
    operand layout), and issues fewer instructions; both formats, NVFP4 also through the tables."""
    if _ptxas() is None:
        pytest.skip("triton's ptxas is not installed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from kernel_sass import main

    for base in ("grouped-nvfp4", "grouped-nvfp4-table", "grouped-mxfp8"):
        rows = {r["case"]: r for r in main(["--cases", f"{base}-tuned,{base}-planes"])}
        joined, planes = rows[f"{base}-tuned"], rows[f"{base}-planes"]
        assert planes["local_bytes"] == 0 and planes["loop_ops"].get("HGMMA", 0) > 0, base
        assert planes["loop_shared"]["stores"] < joined["loop_shared"]["stores"], base
        assert planes["loop_shared"]["barriers"] < joined["loop_shared"]["barriers"], base
        assert planes["loop_instructions_per_element"] < joined["loop_instructions_per_element"], base


@pytest.mark.skipif(not grouped.AVAILABLE or grouped.interpreting(), reason="needs triton, compiled (not interpreted)")
@pytest.mark.parametrize("module", ["grouped", "gemv", "attention_kernel", "selection_kernel"])
def test_kernels_survive_the_compilers_embedding(module):
    """torch.compile writes each Triton kernel it launches, with the functions and constants it reads, into its own
    module inside a '''-quoted string: every kernel's source must still be Python after that string is read."""
    import importlib

    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code as closure
    from triton import JITFunction

    mod = importlib.import_module(f"minimax_ref.fast.{module}")
    kernels = [v for v in vars(mod).values() if isinstance(v, JITFunction)]
    assert kernels, f"no Triton kernel in minimax_ref.fast.{module}"
    for kernel in kernels:
        embedded = eval("'''" + closure(kernel) + "'''")  # the string literal as the compiled module reads it
        compile(embedded, f"<{kernel.__name__} as torch.compile embeds it>", "exec")
