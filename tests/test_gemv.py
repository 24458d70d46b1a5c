"""Packed products from reordered weights (`fast.gemv`, `FastPaths(gemv="triton")`): the load-time reorder, the
split-K GEMV (one row, `GEMV_ROWS`) and the tensor-core dot (more rows) of one Triton kernel, the chosen experts.

Where the cases run: `TRITON_INTERPRET=1 python -m pytest -q tests/test_gemv.py` runs the kernel in Triton's
interpreter on CPU tensors; `python -m pytest -q -m gpu tests/test_gemv.py` compiles it for CUDA; without triton (CI)
the layout cases run (the reorder is plain torch) and the rest skip.

Contract under test (fast/gemv.py): y[p, m, n] = bf16(sum_k x[p, m, k] * w_hat[e(p), n, k]), w_hat =
`decode_reference(...).to(bfloat16)` bit for bit, products exact, fp32 sums, K splits added in split order:

* layout: `reorder` puts byte b of row r, K tile t, at the documented place, `restore` gives back every stored bit
  (a bijection onto the padded tiles), padding is zeros;
* bits: one-hot rows read every decoded element out exactly (a sum of one product and zeros), through the GEMV and
  the dot, on every FP4 byte, E4M3 block scales of both signs with subnormals and zeros at the normal range's low end,
  middle and top, and E8M0 codes at both extremes of the range (3 and 245); a weight outside it keeps its other paths;
* rounding: against float64 sums of the decoded weights, the bound of `test_grouped._bound_ok` (fp32 summation with
  twice the unit roundoff, one rounding to bf16) for K and N that are not multiples of the tiles, 1, 3 and 12 rows,
  one and several K splits, x shared and per entry; splits give the unsplit sum's bits when exact;
* chosen experts: ids (repeats allowed) and flags read only those experts (the others' scales poisoned to NaN);
* wiring: `FastPackedWeight.linear` / `matmul` and `FastExperts` take the kernel under `gemv="triton"`, equal the
  reference to bf16 rounding; the state_dict is unchanged and `apply(False)` removes the copy; on CUDA compiled,
  captured, a whole decode step of the tiny model at batches 1 and 16.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from graph_steps import captured_step_error
from test_grouped import _bound_ok, _decoded, _operands
from test_packed import _bench, _rel

import minimax_ref.fast.gemv as gemv
from minimax_ref.fast import FastPaths, apply
from minimax_ref.fast.packed import GEMV_BUFFERS, FastPackedWeight
from minimax_ref.weights.loader import load_model
from minimax_ref.weights.packed import PackedWeight

BF16 = torch.bfloat16
INTERP = gemv.grouped.interpreting()
interp = pytest.mark.skipif(not (gemv.AVAILABLE and INTERP),
                            reason="run with TRITON_INTERPRET=1 (Triton's interpreter on CPU tensors)")
gpu = [pytest.mark.gpu, pytest.mark.skipif(INTERP or not gemv.AVAILABLE,
                                           reason="compiled Triton kernels (not under TRITON_INTERPRET=1)")]
DEVICES = [pytest.param("cpu", marks=interp), pytest.param("cuda", marks=gpu)]
TABLE_CASES = [("nvfp4", False), ("nvfp4", True), ("mxfp8", False)]  # NVFP4 through its blocks' tables, or not
FMTS = ["nvfp4", "mxfp8"]


# ---------------------------------------------------------------------------------------------- layout (no triton)


@pytest.mark.parametrize("fmt", FMTS)
def test_reorder_is_the_documented_bijection(fmt):
    for stack, (E, N, K) in ((True, (3, 40, 288)), (False, (1, 72, 96))):
        w, s, g = _operands(fmt, E, N, K, 1)
        if not stack:
            w, s, g = w[0], s[0], None if g is None else g[0]
        words, scales, glob = gemv.reorder(fmt, w, s, g)
        tile_k, block = gemv.TILE_K[fmt], gemv.BLOCK[fmt]
        nt, kt = -(-N // gemv.TILE_N), -(-K // tile_k)
        assert words.shape == (E, nt, kt, gemv.TILE_N, gemv.WORDS) and words.dtype == torch.int32
        assert scales.shape == (E, nt, kt, gemv.TILE_N, tile_k // block) and scales.dtype == torch.uint8
        assert words.is_contiguous() and scales.is_contiguous()
        back = gemv.restore(fmt, words, scales, glob, N, K, stack)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(back[:2], (w, s)))
        assert back[0].dtype == w.dtype and back[1].dtype == s.dtype
        assert (back[2] is None) == (g is None) and (g is None or torch.equal(back[2], g))
        # element (e, n, k)'s byte sits in tile (n // 32, k // tile_k), row n % 32, byte of its row within the tile
        data = w.view(torch.uint8).reshape(E, N, -1)
        tiles = words.view(torch.uint8).view(E, nt, kt, gemv.TILE_N, 4 * gemv.WORDS)
        for e, n, b in ((0, 0, 0), (E - 1, N - 1, data.shape[-1] - 1), (E // 2, 33, 131 % data.shape[-1])):
            assert tiles[e, n // 32, b // 128, n % 32, b % 128] == data[e, n, b]
        # the padding is zero bytes and zero scales: every stored byte appears once, the rest are zeros
        assert int(tiles.count_nonzero()) == int(data.count_nonzero())
        assert int(scales.count_nonzero()) == int(s.view(torch.uint8).count_nonzero())


def test_gemv_switch_and_split():
    assert FastPaths(gemv="triton").gemv_tokens == 64 and FastPaths().gemv_tokens == 0
    assert FastPaths.of("gemv").gemv == "triton" and FastPaths.of("gemv").compile_layers
    assert all(FastPaths.of(name).gemv == "reference" for name in ("off", "on", "compiled"))
    with pytest.raises(Exception, match="gemv"):
        FastPaths(gemv="cuda")
    # 4 experts x 96 tile columns fill 132 SMs 4 deep with 2 splits; one small linear splits K up to its tiles
    assert gemv.splits(4 * 96, 24, 132) == 2 and gemv.splits(1, 3, 132) == 3 and gemv.splits(10_000, 24, 132) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_benchmark_refuses_a_cpu_machine(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    err = _bench("packed_gemv.py", ["--rows", "1,32", "--per-sm", "2,4"], capsys, code=2)
    assert err.startswith("error: [rank 0]") and "CUDA" in err and "Traceback" not in err
    assert "at most 64 rows" in _bench("packed_gemv.py", ["--rows", "65"], capsys, code=2)


# ---------------------------------------------------------------------------------------------- the kernel


@pytest.mark.skipif(not gemv.AVAILABLE or INTERP, reason="compiles the CUDA kernel (triton, not interpreted)")
@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_compiles_for_h200_without_spills(fmt):
    """The kernel as the GPU runs it (conversion instructions, bf16 tensor-core dots) compiles for sm_90 with
    triton's ptxas on any machine, with no register spills: the GEMV (ids and split partials, flags and bf16 out), the
    dot at 16, 32 and 64 rows (ids, flags; bf16 out, split partials); NVFP4 also through the blocks' tables."""
    import triton
    from test_grouped import _ptxas, _ptxas_report
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if _ptxas() is None:
        pytest.skip("triton's ptxas is not installed")
    kernel = gemv._gemv_kernel
    table = fmt == "nvfp4"
    registers = {}
    for block_m, select, out_bf16, tab in ((1, 1, False, False), (1, 2, True, False), (1, 2, False, False),
                                           (16, 1, True, False), (32, 2, False, False), (64, 2, True, False),
                                           (1, 1, False, table), (1, 2, True, table), (1, 2, False, table),
                                           (32, 2, False, table)):
        consts = {"NVFP4_FMT": fmt == "nvfp4", "SELECT": select, "DOT": block_m > gemv.GEMV_ROWS,
                  "OUT_BF16": out_bf16, "EXACT_FP32": False, "BLOCK_M": block_m, "TN": gemv.TILE_N,
                  "TK": gemv.TILE_K[fmt], "W": gemv.WORDS, "B": gemv.TILE_K[fmt] // gemv.BLOCK[fmt], "TABLE": tab}
        pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "g_ptr": "*fp32",
                    "sel_ptr": "*i64" if select == 1 else "*i32", "y_ptr": "*bf16" if out_bf16 else "*fp32"}
        signature = {n: pointers.get(n, "constexpr" if n in consts else "i32") for n in kernel.arg_names}
        constexprs = {(i,): consts[n] for i, n in enumerate(kernel.arg_names) if n in consts}
        # the pointers 16-byte aligned, as the launcher specialises torch's allocations
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n in pointers}
        out = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned),
                             target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": gemv.DOT_WARPS_ABOVE_32_ROWS if block_m > 32 else gemv.NUM_WARPS,
                                      "num_stages": gemv.NUM_STAGES})
        ptx = out.asm["ptx"]
        assert ("mma" in ptx) == consts["DOT"]  # tensor cores for the dot only
        # 16-byte loads of the packed words: to registers (GEMV), or pipelined through shared memory (dot)
        if consts["DOT"]:
            assert any("cp.async.cg.shared.global" in line and "0x10" in line for line in ptx.splitlines()), block_m
        else:
            # and no layout conversion through shared memory in the loop (a barrier or two in the epilogue only)
            assert "ld.global.v4.b32" in ptx and ptx.count("bar.sync") <= 2, block_m
        info = _ptxas_report(ptx)
        assert " 0 bytes spill stores" in info, (block_m, info)
        registers[block_m, select, out_bf16, tab] = int(re.search(r"Used (\d+) registers", info).group(1))
    # registers bound the one-row GEMV's programs an SM: every variant (ids or flags) lets the K splits' target of
    # programs an SM (`splits`) run at once, so that a launch is one wave (sm_90: 64 K registers an SM, allocated 8 a
    # thread at a time)
    for (block_m, *_), used in registers.items():
        if block_m == 1:
            resident = 65536 // (-(-used // 8) * 8 * 32 * gemv.NUM_WARPS)
            assert resident >= gemv.PROGRAMS_PER_SM, registers


def _read_out(fmt, tiles, n, k, rows, table=False):
    """The decoded weight [E, N, K] as the kernel multiplies it: one-hot rows, `rows` columns a launch."""
    parts = []
    for k0 in range(0, k, rows):
        m = min(rows, k - k0)
        x = torch.zeros(m, k, dtype=BF16)
        x[torch.arange(m), k0 + torch.arange(m)] = 1
        parts.append(gemv.packed_product(x, fmt, n, *tiles, table=table).transpose(-1, -2))  # [E, N, m]
    return torch.cat(parts, dim=-1)


@interp
@pytest.mark.parametrize(("fmt", "table"), TABLE_CASES)
def test_one_hot_rows_read_out_the_reference_bits(fmt, table):
    E, N, K = 2, 40, 96
    for case in range(3):
        w, s, g = _operands(fmt, E, N, K, case)
        want = _decoded(fmt, w, s, g)
        tiles = gemv.reorder(fmt, w, s, g)
        assert torch.equal(_read_out(fmt, tiles, N, K, gemv.MAX_ROWS, table), want), case  # the dot
    # the GEMV, one column a launch, on a weight of one K tile (every byte and the last case's scales' range)
    w, s, g = _operands(fmt, E, N, 32, 2)
    tiles = gemv.reorder(fmt, w, s, g)
    assert torch.equal(_read_out(fmt, tiles, N, 32, gemv.GEMV_ROWS, table), _decoded(fmt, w, s, g))


@interp
def test_e8m0_extremes_and_out_of_range_scales():
    """MXFP8 E8M0 codes 3 (the smallest the kernel decodes: E4M3 subnormals times 2^-124 are bf16 subnormals) and 245
    (448 * 2^118, near bf16's top) decode exactly; codes 0..2 are outside the range, and `configure` keeps the
    weight off the kernel (no reordered copy)."""
    w, s = _operands("mxfp8", 1, 32, 64, 1)[:2]
    for code in (3, 245):
        sc = torch.full_like(s, code)
        tiles = gemv.reorder("mxfp8", w, sc, None)
        assert torch.equal(_read_out("mxfp8", tiles, 32, 64, gemv.MAX_ROWS), _decoded("mxfp8", w, sc, None)), code
    pw = PackedWeight("mxfp8", w[0], torch.full_like(s[0], 2))
    apply(pw, FastPaths(gemv="triton"))
    assert pw.gemv_tokens == 0 and not any(hasattr(pw, b) for b in GEMV_BUFFERS)
    apply(pw, False)


@interp
@pytest.mark.parametrize(("fmt", "table"), TABLE_CASES)
def test_products_are_fp32_sums_of_the_decoded_weight(fmt, table):
    E, N, K = 3, 40, 288 if fmt == "nvfp4" else 160  # partial tiles in N and K
    w, s, g = _operands(fmt, E, N, K, 1)
    w_hat = _decoded(fmt, w, s, g)
    tiles = gemv.reorder(fmt, w, s, g)
    gen = torch.Generator().manual_seed(7)
    for M in (1, 3, 12):
        x = torch.randn(M, K, generator=gen).to(BF16)
        whole = gemv.packed_product(x, fmt, N, *tiles, split=1, table=table)
        assert whole.shape == (E, M, N) and whole.dtype == BF16
        for split in (1, 2):
            y = gemv.packed_product(x, fmt, N, *tiles, split=split, table=table)
            ok, ratio = _bound_ok(y, x.expand(E, M, K), w_hat)
            assert ok, (M, split, ratio)
    xe = torch.randn(E, 2, K, generator=gen).to(BF16)  # one x per entry
    ok, ratio = _bound_ok(gemv.packed_product(xe, fmt, N, *tiles, table=table), xe, w_hat)
    assert ok, ratio
    # small integers: every sum is exact, so the splits' partials added in order give the unsplit bits
    xi = torch.randint(-2, 3, (2, K), generator=gen).to(BF16)
    wi = torch.randint(-2, 3, (E, N, K), generator=gen).float()
    if fmt == "nvfp4":
        from minimax_ref.weights.quant import pack_fp4, round_to_e2m1

        ti = gemv.reorder(fmt, pack_fp4(round_to_e2m1(wi)), torch.ones(E, N, K // 16).to(torch.float8_e4m3fn),
                          torch.ones(E))
    else:
        ti = gemv.reorder(fmt, wi.to(torch.float8_e4m3fn), torch.full((E, N, K // 32), 127, dtype=torch.uint8), None)
    exact = (xi.float() @ wi.transpose(-1, -2)).to(BF16)
    for split in (1, 2):
        assert torch.equal(gemv.packed_product(xi, fmt, N, *ti, split=split, table=table), exact), split


@interp
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on the poisoned scales
@pytest.mark.parametrize("fmt", FMTS)
def test_chosen_experts_only(fmt):
    """ids (the router's, on the device; repeats allowed) and flags read only those experts: the others' block scales
    are poisoned (E4M3 NaN for NVFP4, the E8M0 code 255, read as inf, for MXFP8) and never show."""
    E, N, K = 4, 40, 128
    w, s, g = _operands(fmt, E, N, K, 1)
    words, scales, glob = gemv.reorder(fmt, w, s, g)
    active = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    ones = [torch.ones(m, K, dtype=BF16) for m in (1, 12)]  # the GEMV and the dot
    clean = [gemv.packed_product(xm, fmt, N, words, scales, glob) for xm in ones]
    scales[[1, 3]] = 0x7F if fmt == "nvfp4" else 255
    assert not torch.isfinite(gemv.packed_product(ones[0], fmt, N, words, scales, glob)[1].float()).all()
    x = torch.randn(3, 2, K, generator=torch.Generator().manual_seed(2)).to(BF16)
    ids = torch.tensor([2, 0, 2])
    got = gemv.packed_product(x, fmt, N, words, scales, glob, index=ids)
    assert got.shape == (3, 2, N) and torch.isfinite(got.float()).all()
    for p, e in enumerate(ids.tolist()):
        ge = glob[e:e + 1] if fmt == "nvfp4" else glob  # MXFP8's unread global is one value
        assert torch.equal(got[p], gemv.packed_product(x[p], fmt, N, words[e:e + 1], scales[e:e + 1], ge)[0])
    for xm, want in zip(ones, clean):
        some = gemv.packed_product(xm, fmt, N, words, scales, glob, active=active)
        assert not some[[1, 3]].any() and torch.equal(some[[0, 2]], want[[0, 2]])


@interp
def test_splits_count_the_busy_entries(monkeypatch):
    """With flags, the K splits are sized for `busy` entries (a step's tokens times top-k), not the whole stack (at
    one row 4 of 16 experts fill the GPU only with K split)."""
    seen = []
    real = gemv.splits
    monkeypatch.setattr(gemv, "splits", lambda programs, *a, **k: seen.append(programs) or real(programs, *a, **k))
    w, s, g = _operands("nvfp4", 4, 64, 256, 1)  # two tile columns
    tiles = gemv.reorder("nvfp4", w, s, g)
    x, active = torch.ones(1, 256, dtype=BF16), torch.tensor([0, 1, 1, 0], dtype=torch.int32)
    flagged = gemv.packed_product(x, "nvfp4", 64, *tiles, active=active, busy=2)
    assert torch.equal(flagged, gemv.packed_product(x, "nvfp4", 64, *tiles, active=active))
    assert seen == [2 * 2, 4 * 2]


# ---------------------------------------------------------------------------------------------- wiring


@interp
@pytest.mark.parametrize("fmt", FMTS)
def test_packed_weight_takes_the_kernel(fmt, monkeypatch):
    w, s, g = _operands(fmt, 4, 40, 128, 1)
    stack = PackedWeight(fmt, w, s, g)
    keys = set(stack.state_dict())
    calls = []
    real = gemv.packed_product
    monkeypatch.setattr(gemv, "packed_product", lambda *a, **k: calls.append(k.get("index")) or real(*a, **k))
    gen = torch.Generator().manual_seed(1)
    cases = [(torch.randn(1, 1, 1, 128, generator=gen).to(BF16), torch.tensor([[3, 1]])),  # a token, its k experts
             (torch.randn(1, 2, 1, 128, generator=gen).to(BF16), torch.tensor([[3, 1]])),  # a row per chosen expert
             (torch.randn(5, 128, generator=gen).to(BF16), None)]  # every expert
    want = [stack.matmul(x, index) for x, index in cases]
    # the fused matmul's and the grouped kernel's row counts: gemv takes precedence
    apply(stack, FastPaths(gemv="triton", fused_rows=1, matmul="fused", grouped=True))
    assert isinstance(stack, FastPackedWeight) and stack.gemv_tokens == 64 and set(stack.state_dict()) == keys
    got = [stack.matmul(x, index) for x, index in cases]
    assert len(calls) == 3 and calls[0].tolist() == [3, 1] and calls[2] is None
    for a, b in zip(got, want):
        assert a.shape == b.shape and _rel(a, b) < 1e-2, _rel(a, b)
    apply(stack, False)
    assert not any(hasattr(stack, b) for b in GEMV_BUFFERS) and type(stack) is PackedWeight
    lin = PackedWeight(fmt, w[0], s[0], None if g is None else g[0])
    x = torch.randn(2, 1, 128, generator=gen).to(BF16)
    want = F.linear(x, lin.decode())
    apply(lin, FastPaths(gemv="triton"))
    assert _rel(lin.linear(x), want) < 1e-2
    apply(lin, False)


@interp
@pytest.mark.parametrize("fmt", FMTS)
def test_gemv_preset_decodes_nvfp4_through_the_tables(fmt, monkeypatch):
    """The `gemv` preset (`compiled`, whose `nvfp4_table` it keeps, with `gemv="triton"`): an NVFP4 weight's GEMV
    decodes through the blocks' tables, an MXFP8 one does not; the same product either way."""
    tables = []
    real = gemv.packed_product
    monkeypatch.setattr(gemv, "packed_product", lambda *a, **k: tables.append(k.get("table")) or real(*a, **k))
    w, s, g = _operands(fmt, 1, 40, 128, 1)
    lin = PackedWeight(fmt, w[0], s[0], None if g is None else g[0])
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(3)).to(BF16)
    want = F.linear(x, lin.decode())
    assert FastPaths.of("gemv").nvfp4_table
    apply(lin, FastPaths.of("gemv"))
    assert lin.table == (fmt == "nvfp4") and tables == []
    assert _rel(lin.linear(x), want) < 1e-2 and tables == [fmt == "nvfp4"]
    apply(lin, False)


@pytest.fixture(scope="module")
def tiny(ckpt_factory):
    return ckpt_factory("tiny", "nvfp4")


@interp
@pytest.mark.parametrize("batch", [2, 4])
def test_decode_step_through_the_kernel(tiny, monkeypatch, batch):
    """A cached decode step of `batch` sequences (prefilled by the reference) with the eager fast paths and gemv on:
    every packed product of the step takes the kernel, the routed experts by the chosen ids while the step's
    (token, slot) pairs are fewer than the experts (2 x 4 of 16), else through their flags (4 x 4), and the logits
    equal the reference's to bf16 rounding."""
    model = load_model(tiny, dtype=BF16, weights="packed")
    ids = torch.randint(0, 1000, (batch, 7), generator=torch.Generator().manual_seed(0))
    calls = []
    real = gemv.packed_product
    monkeypatch.setattr(gemv, "packed_product", lambda *a, **k: calls.append(
        (k.get("active"), k.get("busy"), k.get("index"))) or real(*a, **k))
    steps = []
    for paths in (FastPaths(), FastPaths(moe=True, static_kv=True, gemv="triton")):
        apply(model, False)
        with torch.no_grad():
            cache = model.new_cache(batch, 8)
            model(ids[:, :6], positions=torch.arange(6).expand(batch, -1), cache=cache)
            apply(model, paths)
            steps.append(model(ids[:, 6:], positions=torch.full((batch, 1), 6), cache=cache))
    packed = sum(1 for m in model.modules() if isinstance(m, PackedWeight))
    assert len(calls) >= packed, (len(calls), packed)
    top_k, experts = model.text.num_experts_per_tok, model.layers[1].block_sparse_moe.experts
    pairs, count = batch * top_k, len(experts.local_experts)
    flagged = [busy for active, busy, _ in calls if active is not None]
    by_id = [len(index) for _, _, index in calls if index is not None]
    if pairs < count:  # the routed experts' three products a layer, over the step's pairs
        assert not flagged and len(by_id) >= 3 and set(by_id) == {pairs}
    else:
        assert not by_id and len(flagged) >= 3 and set(flagged) == {min(count, pairs)}
    assert _rel(steps[1], steps[0]) < 2e-2, _rel(steps[1], steps[0])
    apply(model, False)


# ---------------------------------------------------------------------------------------------- CUDA only


@pytest.mark.gpu
@pytest.mark.skipif(INTERP or not gemv.AVAILABLE, reason="compiled Triton kernels")
@pytest.mark.parametrize(("fmt", "table"), TABLE_CASES)
def test_kernel_on_cuda_compiled_and_captured(fmt, table):
    """On CUDA: the read-out bits and the bound (GEMV and dot, split and not), and through `torch.compile(fullgraph)`
    and a CUDA graph the eager launch's bits."""
    E, N, K = 3, 72, 544 if fmt == "nvfp4" else 288
    w, s, g = _operands(fmt, E, N, K, 1, "cuda")
    tiles = gemv.reorder(fmt, w, s, g)
    w_hat = _decoded(fmt, w, s, g)
    for rows in (gemv.GEMV_ROWS, gemv.MAX_ROWS):
        eye = torch.eye(K, dtype=BF16, device="cuda")
        got = torch.cat([gemv.packed_product(eye[k0:k0 + rows], fmt, N, *tiles, table=table).transpose(-1, -2)
                         for k0 in range(0, K, rows)], dim=-1)
        assert torch.equal(got, w_hat), rows
    for m in (1, 4, 32, 64):
        x = torch.randn(m, K, device="cuda").to(BF16)
        for split in (1, 3):
            ok, ratio = _bound_ok(gemv.packed_product(x, fmt, N, *tiles, split=split, table=table),
                                  x.expand(E, m, K), w_hat)
            assert ok, (m, split, ratio)
    x = torch.randn(1, K, device="cuda").to(BF16)
    # an x at an odd element offset (contiguous, its base not 8-byte aligned) gives the same bits
    odd = torch.zeros(K + 1, dtype=BF16, device="cuda")[1:].view(1, K)
    odd.copy_(x)
    assert torch.equal(gemv.packed_product(odd, fmt, N, *tiles, table=table), gemv.packed_product(x, fmt, N, *tiles,
                                                                                                    table=table))
    ids = torch.tensor([2, 0], device="cuda")

    def fn(x):
        return gemv.packed_product(x, fmt, N, *tiles, index=ids, split=3, table=table)

    eager = fn(x)
    assert torch.equal(torch.compile(fn, fullgraph=True)(x), eager)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static)
    graph.replay()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.skipif(INTERP or not gemv.AVAILABLE, reason="compiled Triton kernels")
@pytest.mark.parametrize("batch", [1, 16])
def test_gemv_preset_decode_step_equals_reference(tiny, batch):
    """The tiny model on CUDA with the `gemv` preset (compiled layers, CUDA graph, gemv on): a decode step's logits
    against the reference engine (bf16 both) within bf16 rounding."""
    err = captured_step_error(tiny, "gemv", batch, "gemv_tokens")
    assert math.isfinite(err) and err < 5e-2
