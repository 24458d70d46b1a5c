"""`fast.mma_gemv`: packed products of 1 to 32 rows on the tensor cores, each lane decoding its MMA fragments.

The lane layout (no triton): `reorder` / `restore` are inverse for NVFP4 and MXFP8, and the reordered words placed as
the PTX ISA's m16n8k16 fragment tables place them (`emulate`) multiply to the reference's product. The kernel (Gluon, no
interpreter): compiled offline for sm_90 (its loop moves nothing through shared memory, issues the MMA, spills
nothing in a loop); `python -m pytest -q -m gpu tests/test_mma_gemv.py` runs it against the reference on a GPU.
"""

from __future__ import annotations

import re

import pytest
import torch
from graph_steps import captured_step_error
from test_grouped import _bound_ok, _decoded, _operands, _ptxas, _ptxas_report, _run_ptx

import minimax_ref.fast.mma_gemv as mg
from minimax_ref.fast import FastPaths, apply
from minimax_ref.fast.joint import JointStack
from minimax_ref.fast.packed import GEMV_BUFFERS, FastPackedWeight, decode_reference, scales_in_normal_range
from minimax_ref.weights.loader import load_model
from minimax_ref.weights.packed import PackedWeight

BF16 = torch.bfloat16
INTERP = mg.grouped.interpreting()
on_gpu = pytest.mark.skipif(INTERP or not mg.AVAILABLE or not torch.cuda.is_available(),
                            reason="the Gluon kernel on a CUDA GPU (not under TRITON_INTERPRET=1)")

SHAPES = [(3, 40, 96), (2, 300, 224), (1, 128, 64)]  # rows and columns not multiples of the tiles among them
FMTS = ["nvfp4", "mxfp8"]


# ---------------------------------------------------------------------------------------------- layout (no triton)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("stack", [True, False])
def test_reorder_is_the_documented_bijection(fmt, stack):
    for E, N, K in SHAPES:
        w, s, g = _operands(fmt, E, N, K, 1)
        if not stack:
            w, s, g = w[0], s[0], (g[:1].reshape(()) if g is not None else None)
        words, scales, glob = mg.reorder(fmt, w, s, g)
        n16 = -(-N // (mg.ROW_TILE * mg.GROUP)) * mg.GROUP
        width = 4 if fmt == "nvfp4" else 8
        assert words.dtype == torch.int32 and words.shape == (E if stack else 1, n16, -(-K // mg.STEP_K), 32, width)
        assert scales.shape == (*words.shape[:3], 32, 2)
        w2, s2, g2 = mg.restore(words, scales, glob, N, K, stack)
        assert torch.equal(w2.view(torch.uint8), w.view(torch.uint8))
        assert torch.equal(s2.view(torch.uint8), s.view(torch.uint8))
        assert (g2 is None and g is None) or torch.equal(g2, g)


def test_one_lane_word_holds_its_fragment():
    """Hand-placed: the element at weight row 8 + 3 (row tile 0, g = 3, second half), column 16 * 2 + 4 * 1 + 3
    (lane c = 2, MMA tile 1, q = 3) is nibble j = 4 * half + r with r = 3 (rows g + 8, columns 2c + 8 + {0, 1}),
    half 1: nibble 7 of lane 4 * 3 + 2's word of tile 1."""
    w = torch.zeros(1, 16, 32, dtype=torch.uint8)  # [E, N, K/2]: K = 64
    col = 16 * 2 + 4 * 1 + 3
    w[0, 11, col // 2] = 0x9 << (4 * (col % 2))
    s = torch.full((1, 16, 4), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    words, _, _ = mg.reorder("nvfp4", w, s, torch.ones(1))
    lane = 4 * 3 + 2
    assert int(words[0, 0, 0, lane, 1]) & 0xFFFFFFFF == 0x9 << 28
    assert int(words.count_nonzero()) == 1


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_lane_fragments_multiply_to_the_reference_product(fmt, rows):
    """Each lane's registers as the PTX fragment tables place them, and x through the kernel's column permutation
    (x's rows in groups of 8, one B fragment each): the MMAs' product is x @ w_hat^T exactly (fp64 sums of the same
    products)."""
    for case, (E, N, K) in enumerate(SHAPES):
        w, s, g = _operands(fmt, E, N, K, case % 3)
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(case)).to(BF16)
        got = mg.emulate(x, *mg.reorder(fmt, w, s, g), N)
        want = x.double() @ _decoded(fmt, w, s, g).double().transpose(-1, -2)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-300)


def test_product_refuses_shapes_it_does_not_take():
    w, s, g = _operands("nvfp4", 2, 40, 96, 1)
    words, scales, glob = mg.reorder("nvfp4", w, s, g)
    for x in (torch.zeros(33, 96, dtype=BF16), torch.zeros(1, 96), torch.zeros(1, 48, dtype=BF16),
              torch.zeros(1, 100, dtype=BF16)):
        with pytest.raises(ValueError, match="mma_gemv"):
            mg.packed_product(x, 40, words, scales, glob)
        with pytest.raises(ValueError, match="mma_gemv"):
            mg.packed_product_stored(x, "nvfp4", w, s, g)


@pytest.mark.skipif(not mg.AVAILABLE, reason="the kernel's assembly text (triton with Gluon)")
def test_stored_nvfp4_pair_steps_assemble_fragment_words():
    """Read in place by pair steps of 128 columns: lane 4g + c's 8 bytes J of row g (byte 64 s + 16 c + 8 J) and of
    row g + 8, through `_STORED_WORDS_ASM` (run through the PTX instruction model), give MMA tile t's word with nibble
    4h + q the code of row g + 8h, column 128 s + 32 c + 16 J + 4 t + q: the word format `reorder` lays out, for the
    columns that sub-step J gives the lane (x is read at the same columns)."""
    E, N, K = 2, 32, 256
    w, _, _ = _operands("nvfp4", E, N, K, 1)
    data = w.view(torch.uint8)
    codes = torch.stack((data & 0x0F, data >> 4), dim=-1).reshape(E, N, K)  # [E, N, K]: element k's code
    for ent in range(E):
        for tile in range(N // 16):
            for step in range(K // mg.step_columns("nvfp4", True)):
                for sub in range(2):
                    for lane in range(mg.LANES):
                        gg, c = lane // 4, lane % 4
                        at = 64 * step + 16 * c + 8 * sub
                        rows = [data[ent, 16 * tile + gg + 8 * h, at:at + 8].contiguous().view(torch.int32)
                                for h in (0, 1)]
                        regs = _run_ptx(mg._STORED_WORDS_ASM.value,
                                        {f"${4 + i}": int(v) & 0xFFFFFFFF for i, v in enumerate(torch.cat(rows))})
                        for t in range(mg.TILES):
                            col = 128 * step + 32 * c + 16 * sub + 4 * t
                            want = sum(int(codes[ent, 16 * tile + gg + 8 * h, col + q]) << (4 * (4 * h + q))
                                       for h in (0, 1) for q in range(4))
                            assert regs[f"${t}"] == want, (ent, tile, step, sub, lane, t)


@pytest.mark.skipif(not mg.AVAILABLE, reason="the kernel's assembly text (triton with Gluon)")
def test_stored_mxfp8_rows_are_the_reordered_words():
    """Read in place, a lane's MXFP8 row g's 16 bytes of a step (byte 16c on) are `reorder`'s words 0, 2, 4, 6 and
    row g + 8's its words 1, 3, 5, 7."""
    E, N, K = 2, 32, 192
    w, s, g = _operands("mxfp8", E, N, K, 1)
    words = mg.reorder("mxfp8", w, s, g)[0]
    data = w.view(torch.uint8)
    for ent in range(E):
        for tile in range(N // 16):
            for step in range(K // mg.STEP_K):
                for lane in range(mg.LANES):
                    gg, c = lane // 4, lane % 4
                    at = 64 * step + 16 * c
                    rows = [data[ent, 16 * tile + gg + 8 * h, at:at + 16].contiguous().view(torch.int32)
                            for h in (0, 1)]
                    want = [int(v) & 0xFFFFFFFF for v in words[ent, tile, step, lane]]
                    assert [int(rows[i % 2][i // 2]) & 0xFFFFFFFF for i in range(8)] == want, (ent, tile, step, lane)


@pytest.mark.skipif(not mg.AVAILABLE, reason="the kernel's assembly text (triton with Gluon)")
def test_two_table_assembly_decodes_the_reference_bits():
    """The kernel's decode, its PTX text (`_SCALE_TABLE_ASM` for each row's table, then `_TWO_TABLE_ASM` for a word)
    run through a model of each instruction: registers 0..3 hold nibbles `FRAGMENT_NIBBLES` as
    `decode_reference(...).to(bf16)` bit for bit, the low half through row g's block scale and the high half
    through row g + 8's, for block scales of both signs, zeros and the normal range's ends, every code and sign."""
    codes = torch.arange(256, dtype=torch.uint8)
    value = codes.view(torch.float8_e4m3fn).float()
    words = [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567, 0x88888888, 0xF0F0F0F0, 0x0F1E2D3C, 0xFFFFFFFF]
    glob = torch.tensor(1 / 2688, dtype=torch.float32)
    block = value * glob
    keep = torch.isfinite(value) & ((block == 0) | ((block.abs() >= 2.0**-125) & (block.abs() < 4)))
    scales = codes[keep]
    pairs = [(int(a), int(b)) for a, b in zip(scales, scales.roll(7))]  # rows g and g + 8: different scales
    checked = 0
    for sg, sh in pairs:
        tables = {}
        for name, code in (("g", sg), ("h", sh)):
            scale = int(block[codes == code][0:1].view(torch.int32)) & 0xFFFFFFFF
            out = _run_ptx(mg._SCALE_TABLE_ASM.value, {"$4": scale})
            tables[name] = [out[f"${i}"] for i in range(4)]
        for word in words:
            regs = _run_ptx(mg._TWO_TABLE_ASM.value, {"$4": word, **dict(zip(("$5", "$6", "$7", "$8"), tables["g"])),
                                                      **dict(zip(("$9", "$10", "$11", "$12"), tables["h"]))})
            got = {}
            for r, out in zip((0, 2, 1, 3), ("$0", "$1", "$2", "$3")):  # `_fragment`'s order: (r01, r45, r23, r67)
                lo, hi = mg.FRAGMENT_NIBBLES[r]
                got[lo], got[hi] = regs[out] & 0xFFFF, regs[out] >> 16
            # the word's 8 elements as the first half of a 16-element block (the reference decodes whole blocks)
            data = torch.tensor([(word >> 8 * i) & 0xFF for i in range(4)] * 2, dtype=torch.uint8)[None]
            for j in range(8):
                s = torch.tensor([[sg if j < 4 else sh]], dtype=torch.uint8).view(torch.float8_e4m3fn)
                assert scales_in_normal_range("nvfp4", s, glob)
                want = decode_reference("nvfp4", data, s, glob).to(BF16)
                want_bits = int(want.view(torch.int16)[0, j]) & 0xFFFF
                assert got[j] == want_bits, (sg, sh, hex(word), j)
                checked += 1
    assert checked == 8 * len(words) * len(pairs)


@pytest.mark.skipif(not mg.AVAILABLE, reason="the kernel's assembly text (triton with Gluon)")
def test_e4m3_pair_assembly_gives_both_exact_values():
    """`_E4M3_PAIR_ASM` run through the instruction model: the low 16 bits' two E4M3 codes (low byte first) as their
    exact fp32 values, whatever the upper 16 bits hold, for every pair of finite codes."""
    codes = torch.arange(256, dtype=torch.uint8)
    value = codes.view(torch.float8_e4m3fn).float()
    finite = [int(c) for c in codes[torch.isfinite(value)]]
    bits = {c: int(value[c:c + 1].view(torch.int32)) & 0xFFFFFFFF for c in finite}
    for first in finite:
        for second in finite[first % 7::7]:
            out = _run_ptx(mg._E4M3_PAIR_ASM.value, {"$2": 0xA5C30000 | second << 8 | first})
            assert (out["$0"], out["$1"]) == (bits[first], bits[second]), (first, second)


# --------------------------------------------------------------------------------- kernel compiled for sm_90, offline


def _loop_copies(nvfp4: bool, stored: bool, ahead: int, row_tiles: int, groups: int) -> int:
    """The copies of a K step's MMAs in the kernel's code: stored NVFP4 one pair step ahead at one row tile a warp and
    up to two row groups runs two pair steps a loop iteration and an odd last one after the loop (`_pair_steps`),
    everything else one step a loop iteration."""
    return 3 if nvfp4 and stored and ahead == 1 and row_tiles == 1 and groups <= 2 else 1


def _sm90_ptx(nvfp4: bool, select: int, out_bf16: bool, even_k: bool, groups: int = 1, stored: bool = False,
              masked: bool = False, sum_splits: bool = False, ahead: int | None = None,
              row_tiles: int | None = None, copies: int = 1, prefetch: bool = False) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = mg._mma_gemv_kernel
    launch = mg.LAUNCH["nvfp4" if nvfp4 else "mxfp8", groups]
    consts = {"NVFP4_FMT": nvfp4, "SELECT": select, "RT": row_tiles or launch.row_tiles, "NB": groups,
              "WARPS": mg.WARPS,
              "OUT_BF16": out_bf16, "EVEN_K": even_k, "STORED": stored, "MASKED": masked, "SUM_SPLITS": sum_splits,
              "AHEAD": ahead or launch.ahead, "PREFETCH": prefetch, "COPIES": copies}
    pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "g_ptr": "*fp32",
                "sel_ptr": "*i64" if select == 1 else "*i32", "y_ptr": "*bf16" if out_bf16 else "*fp32",
                "out_ptr": "*bf16", "cnt_ptr": "*i32"}
    signature = {n: pointers.get(n, "constexpr" if n in consts else "i32") for n in kernel.arg_names}
    constexprs = {(i,): consts[n] for i, n in enumerate(kernel.arg_names) if n in consts}
    # as a launch specialises them: pointers, the weight's and x's strides (release widths) divisible by 16
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
               if n in pointers or n in ("stride_we", "stride_wn", "stride_xp", "stride_xm")}
    out = triton.compile(GluonASTSource(kernel, signature, constexprs, aligned), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": mg.WARPS})
    return out.asm["ptx"]


def _loop_spills(ptx: str) -> list[str]:
    """The local-memory loads and stores (spills) of `ptx` assembled for sm_90a that lie in a loop: between the
    target and the source of a backward branch of its SASS (`cuobjdump -sass`)."""
    import subprocess
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        src.write_text(ptx)
        subprocess.run([_ptxas(), "--gpu-name", "sm_90a", str(src), "-o", str(cubin)], check=True)
        sass = subprocess.run([str(Path(_ptxas()).parent / "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    branches = [(addr, re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?(0x[0-9a-f]+)", text)) for addr, text in code]
    loops = [(int(b.group(1), 16), addr) for addr, b in branches if b and int(b.group(1), 16) < addr]
    return [text for addr, text in code if re.search(r"\b(STL|LDL)\b", text)
            and any(lo <= addr <= hi for lo, hi in loops)]


def _assert_no_spill_in_loops(ptx: str) -> str:
    """ptxas's report of `ptx` (sm_90a), asserting that nothing spills, or that what spills (a value kept across the
    loops: stored before them, loaded after) is outside every loop."""
    info = _ptxas_report(ptx)
    if " 0 bytes spill stores" not in info:
        assert not _loop_spills(ptx), info
    return info


@pytest.mark.skipif(not mg.AVAILABLE or INTERP or _ptxas() is None, reason="ptxas (triton's) assembles PTX")
def test_loop_spills_finds_local_memory_in_loops_only():
    """`_loop_spills` on hand-written PTX that indexes a local array by a register (so ptxas keeps it in local
    memory): found when the accesses are in the loop, none when the same accesses come before it."""
    def kernel(in_loop: bool) -> str:
        local = "and.b32 %r3, %r2, 15; mul.wide.u32 %rd3, %r3, 4; add.u64 %rd4, %rd2, %rd3; st.local.u32 [%rd4], %r2;"
        return "\n".join((
            ".version 8.0", ".target sm_90a", ".address_size 64",
            ".visible .entry k(.param .u64 p, .param .u32 n)", "{",
            ".local .align 4 .b8 buf[64];", ".reg .b32 %r<8>;", ".reg .b64 %rd<8>;", ".reg .pred %q;",
            "ld.param.u64 %rd1, [p];", "ld.param.u32 %r1, [n];", "mov.u64 %rd2, buf;", "mov.u32 %r2, 0;",
            "" if in_loop else local,
            "LOOP:", local if in_loop else "", "add.u32 %r2, %r2, 1;", "setp.lt.u32 %q, %r2, %r1;",
            "@%q bra LOOP;",
            "ld.local.u32 %r4, [%rd4];", "cvta.to.global.u64 %rd5, %rd1;", "st.global.u32 [%rd5], %r4;",
            "ret;", "}"))

    assert _loop_spills(kernel(True))
    assert not _loop_spills(kernel(False))


def test_row_groups_launches_and_splits():
    """x's rows in groups of 8 (the MMA's N), rounded up to a launch shape; every launch's row tiles divide the
    padding `reorder` gives N; K splits fill the GPU without splits of fewer than `MIN_STEPS_PER_SPLIT` steps."""
    assert [mg.row_groups(m) for m in (1, 8, 9, 16, 17, 24, 32)] == [1, 1, 2, 2, 4, 4, 4]
    assert set(mg.LAUNCH) == {(f, mg.row_groups(m)) for f in ("nvfp4", "mxfp8") for m in range(1, mg.MAX_ROWS + 1)}
    assert all(mg.GROUP % (mg.WARPS * launch.row_tiles) == 0 for launch in mg.LAUNCH.values())
    assert mg.programs("nvfp4", 3, 16, 1) == 3 * 16 // (mg.WARPS * mg.LAUNCH["nvfp4", 1].row_tiles)
    assert mg.splits(4, 96, 132, 4) == 24  # k_proj: 4 programs, 96 steps -> 4 steps a split, not 96 of one
    assert mg.splits(96, 96, 132, 4) == 6 and mg.splits(1000, 96, 132, 4) == 1 and mg.splits(1, 3, 132, 4) == 1


COMPILE_CASES = [(True, 0, True, True, 1, False, False), (True, 1, False, True, 1, False, False),
                 (True, 2, True, False, 1, False, False), (False, 0, True, True, 1, False, False),
                 (False, 2, False, False, 1, False, False), (True, 2, True, True, 2, False, False),
                 (False, 2, True, True, 2, False, False), (True, 2, False, False, 4, False, False),
                 (False, 1, True, True, 4, False, False), (True, 2, True, True, 1, True, False),
                 (True, 0, False, True, 4, True, True), (True, 2, False, True, 2, True, True),
                 (False, 0, True, True, 1, True, False), (False, 2, True, False, 2, True, True)]


@pytest.mark.skipif(not mg.AVAILABLE or INTERP, reason="compiles the Gluon kernel (triton with Gluon, not interpreted)")
@pytest.mark.parametrize("nvfp4,select,out_bf16,even_k,groups,stored,masked,ahead,copies",
                         [(*case, 1, 1) for case in COMPILE_CASES]
                         + [(*case, 2, 1) for case in COMPILE_CASES if case[4] == 1]  # two steps ahead: one group
                         # a joint stack's flags (`fast.joint.JointStack`)
                         + [(*case, 1, 2) for case in COMPILE_CASES if case[1] == 2 and case[5] and case[4] == 1])
def test_kernel_compiles_to_register_fragments(nvfp4, select, out_bf16, even_k, groups, stored, masked, ahead,
                                               copies):
    """Every word is decoded in the lane that loads it: the kernel issues one MMA a row tile, row group, MMA tile and
    step of 64, loads a lane's 16 bytes of words at once (from the stored layout: a row's 16 NVFP4 bytes of a pair
    step, or its 16 MXFP8 bytes of a step), and has no shared memory, barrier or spill in a loop; its registers let
    `RESIDENT` programs share an SM (loads one K step ahead, or two at one row group). With the K splits added in the
    kernel, the same loop; a barrier and one acquire-release ticket a program."""
    ptx = _sm90_ptx(nvfp4, select, out_bf16, even_k, groups, stored, masked, ahead=ahead, copies=copies)
    if not out_bf16:  # a launch with K splits: the same kernel adding them itself
        summed = _sm90_ptx(nvfp4, select, out_bf16, even_k, groups, stored, masked, sum_splits=True, ahead=ahead,
                           copies=copies)
        tickets = [op for op in re.findall(r"\batom\.[\w.]+", summed) if ".add." in op]
        assert tickets and all(".gpu." in op and ".acq_rel." in op for op in tickets), tickets
        assert "ld.global.cg" in summed and "bar.sync" in summed
        info = _assert_no_spill_in_loops(summed)
        assert 65536 // (-(-int(re.search(r"Used (\d+) registers", info).group(1)) // 8) * 8 * 32 * mg.WARPS) \
            >= mg.RESIDENT
    launch = mg.LAUNCH["nvfp4" if nvfp4 else "mxfp8", groups]
    sub_steps = mg.step_columns("nvfp4" if nvfp4 else "mxfp8", stored) // mg.STEP_K  # a loop's steps of 64
    assert (ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
            == sub_steps * mg.TILES * launch.row_tiles * groups
               * _loop_copies(nvfp4, stored, ahead, launch.row_tiles, groups))
    if stored and nvfp4 and not masked:  # a row's 16 bytes and 2 scales of a pair step: one load each
        assert "ld.global.v2.b64" in ptx and "ld.global.v4.b32" not in ptx and "ld.global.b16" in ptx
    elif not stored or not nvfp4:
        assert "ld.global.v4.b32" in ptx
    assert "bar.sync" not in ptx and "st.shared" not in ptx and "ld.shared" not in ptx
    info = _assert_no_spill_in_loops(ptx)
    used = int(re.search(r"Used (\d+) registers", info).group(1))
    assert 65536 // (-(-used // 8) * 8 * 32 * mg.WARPS) >= mg.RESIDENT, used


@pytest.mark.skipif(not mg.AVAILABLE or INTERP, reason="compiles the Gluon kernel (triton with Gluon, not interpreted)")
@pytest.mark.parametrize("sum_splits", [False, True])
@pytest.mark.parametrize("copies", [1, 2])
@pytest.mark.parametrize("key", sorted(mg.STORED_IDS_LAUNCH))
def test_stored_ids_launch_compiles_to_the_same_loop(sum_splits, copies, key):
    """`STORED_IDS_LAUNCH` (a few NVFP4 entries by id read in place: one row tile a warp; of one stack, or of a joint
    stack's two): the stored loop's MMAs (one a row tile, MMA tile and step of 64), a row's 16 bytes of a pair step a
    load (with the L2 prefetch size where the launch asks for it), no spill in a loop, and registers for `RESIDENT`
    programs an SM."""
    launch = mg.STORED_IDS_LAUNCH[key]
    ptx = _sm90_ptx(True, 1, not sum_splits, True, 1, True, False, sum_splits=sum_splits, ahead=launch.ahead,
                    row_tiles=launch.row_tiles, copies=copies, prefetch=launch.prefetch)
    sub_steps = mg.step_columns("nvfp4", True) // mg.STEP_K
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == sub_steps * mg.TILES * \
        launch.row_tiles * _loop_copies(True, True, launch.ahead, launch.row_tiles, 1)
    assert ("ld.global.nc.L2::256B.v2.b64" if launch.prefetch else "ld.global.v2.b64") in ptx
    info = _assert_no_spill_in_loops(ptx)
    used = int(re.search(r"Used (\d+) registers", info).group(1))
    assert 65536 // (-(-used // 8) * 8 * 32 * mg.WARPS) >= mg.RESIDENT, used


@pytest.mark.skipif(not mg.AVAILABLE or INTERP, reason="compiles the Gluon kernel (triton with Gluon, not interpreted)")
@pytest.mark.parametrize("nvfp4,stored,sum_splits", [(True, True, False), (True, True, True), (True, False, False),
                                                     (False, True, True), (False, False, False)])
@pytest.mark.parametrize("copies", [1, 2])
def test_ranged_kernel_compiles_both_passes(nvfp4, stored, sum_splits, copies):
    """Products over ranges of rows (SELECT 3), of one stack or of a joint stack's two (`copies`, stored only): the
    kernel holds a one-row-group pass and a two-group pass (ranges of more than 8 rows), each the plain loop's MMAs
    (one a row tile, row group, MMA tile and step of 64), nothing through shared memory but the split sum's ticket,
    no spill in a loop, and registers for `RESIDENT` programs an SM at `RANGED_LAUNCH`'s row tiles."""
    if copies > 1 and not stored:
        pytest.skip("a joint stack is read in place")
    fmt = "nvfp4" if nvfp4 else "mxfp8"
    launch = mg.RANGED_LAUNCH[fmt]
    ptx = _sm90_ptx(nvfp4, 3, not sum_splits, True, 1, stored, False, sum_splits=sum_splits, ahead=launch.ahead,
                    row_tiles=launch.row_tiles, copies=copies, prefetch=launch.prefetch)
    if stored and nvfp4 and launch.prefetch:
        assert "ld.global.nc.L2::256B.v2.b64" in ptx
    sub_steps = mg.step_columns(fmt, stored) // mg.STEP_K
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == sub_steps * mg.TILES * \
        launch.row_tiles * (1 + 2) * _loop_copies(nvfp4, stored, launch.ahead, launch.row_tiles, 2)
    if sum_splits:  # the ticket's value reaches the program's threads through shared memory, after a barrier
        assert "ld.global.cg" in ptx and "bar.sync" in ptx
    else:
        assert "bar.sync" not in ptx and "st.shared" not in ptx and "ld.shared" not in ptx
    info = _assert_no_spill_in_loops(ptx)
    used = int(re.search(r"Used (\d+) registers", info).group(1))
    assert 65536 // (-(-used // 8) * 8 * 32 * mg.WARPS) >= mg.RESIDENT, used


# ------------------------------------------------------------------------------------------------ the fast paths


def test_mma_mode_falls_back_where_the_kernel_does_not_run(tiny_nvfp4):
    """`gemv="mma"` on a CPU model: no weight takes the Gluon kernel (CUDA only), nor `fast.gemv`'s copy (under the
    interpreter too, where that kernel would run); outputs are the reference's."""
    model = load_model(tiny_nvfp4, dtype=BF16, weights="packed")
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        want = model(ids)
    apply(model, FastPaths(gemv="mma"))
    weights = [m for m in model.modules() if isinstance(m, FastPackedWeight)]
    assert weights and all(m.gemv_tokens == 0 and not any(hasattr(m, b) for b in GEMV_BUFFERS) for m in weights)
    with torch.no_grad():
        got = model(ids)
    if INTERP:  # the grouped products under the interpreter: fp32 sums in another order
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(not mg.AVAILABLE, reason="triton with Gluon")
@pytest.mark.parametrize("fmt", FMTS)
def test_mma_mode_reads_aligned_stacks_in_place(fmt, monkeypatch):
    """`gemv="mma"` where the kernel runs (its device check stubbed on CPU; nothing is launched): a stack whose rows
    are aligned to a lane's loads keeps no copy (`gemv_kernel` "mma-stored" up to `STORED_STACK_ROWS` rows, only the
    split counters as buffers); a stack whose rows are not (a view starting mid-row) and a linear get the reordered
    copy (up to `MAX_ROWS` rows); the reference restored, no buffer is left."""
    monkeypatch.setattr(mg, "runs_on", lambda device: True)
    monkeypatch.setattr(mg.grouped, "runs_on", lambda device: True)
    E, N, K = 3, 40, 128
    w, s, g = _operands(fmt, E, N, K, 1)
    aligned = PackedWeight(fmt, w, s, g)
    keys = set(aligned.state_dict())
    apply(aligned, FastPaths(gemv="mma"))
    assert aligned.gemv_kernel == "mma-stored" and aligned.gemv_tokens == mg.STORED_STACK_ROWS
    assert set(dict(aligned.named_buffers())) - keys == {"gemv_counters"} and set(aligned.state_dict()) == keys
    # N = 40: 3 row tiles, one program an entry at one row tile a warp (4 a program)
    assert aligned.gemv_counters.numel() == E and not aligned.gemv_counters.any()
    apply(aligned, False)
    assert not any(hasattr(aligned, b) for b in GEMV_BUFFERS)
    row = K // 2 if fmt == "nvfp4" else K
    wide = torch.zeros(E, N, row + 4, dtype=torch.uint8)
    wide[..., 4:] = w.view(torch.uint8)
    shifted = wide[..., 4:].view(w.dtype)  # every row 4 bytes past an aligned start
    assert not mg.stored_supports(fmt, shifted, s)
    stack = PackedWeight(fmt, shifted, s, g)
    apply(stack, FastPaths(gemv="mma"))
    assert stack.gemv_kernel == "mma" and stack.gemv_words.shape[:3] == (E, mg.GROUP, K // mg.STEP_K)
    assert stack.gemv_counters.numel() > 0 and stack.gemv_tokens == mg.MAX_ROWS
    apply(stack, False)
    linear = PackedWeight(fmt, w[0], s[0], None if g is None else g[:1].reshape(()))
    assert mg.stored_supports(fmt, linear.weight, linear.weight_scale)
    apply(linear, FastPaths(gemv="mma"))
    assert linear.gemv_kernel == "mma" and linear.gemv_words.shape[:3] == (1, mg.GROUP, K // mg.STEP_K)
    apply(linear, False)


@pytest.mark.skipif(not mg.AVAILABLE, reason="triton with Gluon")
@pytest.mark.parametrize("fmt", FMTS)
def test_mma_stored_mode_keeps_no_copy(fmt, monkeypatch):
    """`gemv="mma-stored"` (device checks stubbed on CPU; nothing is launched): a linear and a stack whose rows are
    aligned are both read where they are stored (no buffer but the split counters, up to `STORED_STACK_ROWS` rows); a
    stack whose rows are not takes no one-to-few-row kernel (no copy is made)."""
    monkeypatch.setattr(mg, "runs_on", lambda device: True)
    monkeypatch.setattr(mg.grouped, "runs_on", lambda device: True)
    E, N, K = 3, 40, 128
    w, s, g = _operands(fmt, E, N, K, 1)
    for weight in (PackedWeight(fmt, w, s, g), PackedWeight(fmt, w[0], s[0], None if g is None else g[:1].reshape(()))):
        keys = set(dict(weight.named_buffers()))
        apply(weight, FastPaths(gemv="mma-stored"))
        assert weight.gemv_kernel == "mma-stored" and weight.gemv_tokens == mg.STORED_STACK_ROWS
        assert set(dict(weight.named_buffers())) - keys == {"gemv_counters"}
        apply(weight, False)
    row = K // 2 if fmt == "nvfp4" else K
    wide = torch.zeros(E, N, row + 4, dtype=torch.uint8)
    wide[..., 4:] = w.view(torch.uint8)
    shifted = PackedWeight(fmt, wide[..., 4:].view(w.dtype), s, g)
    apply(shifted, FastPaths(gemv="mma-stored"))
    assert shifted.gemv_tokens == 0 and not any(hasattr(shifted, b) for b in GEMV_BUFFERS)
    apply(shifted, False)


@pytest.mark.skipif(not mg.AVAILABLE, reason="triton with Gluon (the custom operator)")
def test_stored_product_traces_whole_in_a_compiled_region():
    """A compiled layer traces `packed_product_stored` into one graph: the data pointer's alignment, which dynamo
    cannot read, is checked at the launch instead (the backend here records the graph and runs nothing)."""
    w, s, g = _operands("nvfp4", 4, 32, 128, 1)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        outputs = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        return lambda *args: [None] * outputs

    product = torch.compile(lambda x: mg.packed_product_stored(x, "nvfp4", w, s, g), backend=record, fullgraph=True)
    product(torch.zeros(1, 128, dtype=BF16))
    ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert len(graphs) == 1 and torch.ops.minimax_ref.packed_mma_gemv in ops


def _ranges_by_reference(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """`FastPackedWeight.ranged_product`'s contract in torch: each range of x's rows times its entry's decoded bf16
    weight, fp32 sums rounded once."""
    w_hat = decode_reference(self.fmt, *self.parts()).to(BF16)
    out = torch.empty(x.shape[0], w_hat.shape[1], dtype=BF16)
    start = 0
    for e, end in enumerate(ends.tolist()):
        out[start:end] = (x[start:end].float() @ w_hat[e].float().T).to(BF16)
        start = end
    return out


@pytest.mark.skipif(not mg.AVAILABLE, reason="triton with Gluon")
def test_expert_ranges_multiply_each_expert_by_its_own_tokens(tiny_nvfp4, monkeypatch):
    """`expert_ranges` (the MMA kernel's device checks stubbed on CPU, its ranged product by its contract in torch):
    above 8 tokens `FastExperts.forward_sync_free` sorts the (token, choice) pairs by expert, gives each stack the
    gathered rows and each expert's range end, and combines the outputs to the reference `Experts.forward` within
    fp32 rounding; experts no pair chose get empty ranges; 8 tokens keep the flags over every chosen expert."""
    monkeypatch.setattr(mg, "runs_on", lambda device: True)
    monkeypatch.setattr(mg.grouped, "runs_on", lambda device: True)
    calls = []

    def ranged(self, x, ends):
        calls.append((x.clone(), ends.clone()))
        return _ranges_by_reference(self, x, ends)

    monkeypatch.setattr(FastPackedWeight, "ranged_product", ranged)
    model = load_model(tiny_nvfp4, dtype=BF16, weights="packed")
    moe = model.layers[1].block_sparse_moe
    ex = moe.experts
    E = len(ex.local_experts)
    for tokens, narrow in ((9, False), (32, False), (32, True)):
        x = torch.randn(tokens, model.text.hidden_size, generator=torch.Generator().manual_seed(tokens)).to(BF16)
        r = moe.gate(x)
        if narrow:  # every token on the same few experts: the others' ranges are empty
            r.expert_ids[:] = r.expert_ids[:1]
        apply(ex, FastPaths())
        want = ex(x, r)
        apply(ex, FastPaths(moe=True, gemv="mma", expert_ranges=True))
        ex._modules.pop("joint")  # each stack its own ranges here (gate and up as one: tests/test_joint.py)
        assert ex.takes_ranges(x)
        calls.clear()
        got = ex.forward_sync_free(x, r)
        assert len(calls) == 3
        k = r.expert_ids.shape[1]
        pairs = r.expert_ids.flatten()
        order = torch.argsort(pairs, stable=True)
        xs, ends = calls[0]
        assert torch.equal(ends, torch.bincount(pairs, minlength=E).cumsum(0).to(torch.int32))
        assert torch.equal(xs, x[order // k]) and (ends[1:] == ends[:-1]).any() == narrow
        assert torch.equal(calls[2][1], ends) and calls[2][0].shape == (tokens * k, ex.w2.shape[-1])
        torch.testing.assert_close(got, want.float(), rtol=2e-2, atol=2e-2)
    x = torch.randn(8, model.text.hidden_size).to(BF16)
    assert not ex.takes_ranges(x)
    apply(model, FastPaths())


# ------------------------------------------------------------------------------------------------------------ GPU


LAYOUTS = ["reordered", "stored"]


def _product_fn(layout: str, fmt: str, n: int, w, s, g):
    """The kernel on a weight in `reorder`'s layout (reordered once here) or read where it is stored."""
    if layout == "stored":
        return lambda x, **kw: mg.packed_product_stored(x, fmt, w, s, g, **kw)
    packed = mg.reorder(fmt, w, s, g)
    return lambda x, **kw: mg.packed_product(x, n, *packed, **kw)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 27, 32])
@pytest.mark.parametrize("case", [0, 1, 2])
@pytest.mark.parametrize("split", [None, 1, 3])
def test_kernel_on_cuda_within_the_bound(layout, fmt, rows, case, split):
    """Random x against every scale range; MXFP8's top codes (case 2) make sums past fp32's range, so that format
    takes case 2's shape with the middle codes (the top codes are read out exactly below). Shapes whose N and K are
    not whole tiles among them (the stored layout's masked loads)."""
    E, N, K = SHAPES[case]
    w, s, g = _operands(fmt, E, N, K, case if fmt == "nvfp4" else min(case, 1), device="cuda")
    x = torch.randn(rows, K, device="cuda").to(BF16)
    y = _product_fn(layout, fmt, N, w, s, g)(x, split=split, sms=132)
    ok, ratio = _bound_ok(y, x, _decoded(fmt, w, s, g))
    assert y.shape == (E, rows, N) and ok, ratio


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_on_cuda_one_hot_rows_read_out_the_decoded_weight(layout, fmt):
    """x's rows one-hot: each output is one product, exact, so the kernel reads out the reference decode bit for bit
    (every code, scales at the range's low end, middle and top)."""
    for case, (E, N, K) in enumerate(SHAPES):
        w, s, g = _operands(fmt, E, N, K, case, device="cuda")
        want = _decoded(fmt, w, s, g)  # [E, N, K]
        eye = torch.eye(K, dtype=BF16, device="cuda")
        product = _product_fn(layout, fmt, N, w, s, g)
        for k0 in range(0, K, mg.MAX_ROWS):
            got = product(eye[k0:k0 + mg.MAX_ROWS])  # [E, rows, N]
            assert torch.equal(got.transpose(-1, -2), want[..., k0:k0 + mg.MAX_ROWS]), (case, k0)


@pytest.mark.gpu
@on_gpu
def test_stored_nvfp4_rows_at_8_byte_boundaries():
    """An NVFP4 weight of K = 80 (rows of 40 bytes: 8-byte aligned, its one pair step 5/8 full) read in place: the
    one-hot rows read out the reference decode."""
    E, N, K = 2, 24, 80
    w, s, g = _operands("nvfp4", E, N, K, 1, device="cuda")
    assert mg.stored_supports("nvfp4", w, s) and w.stride(-2) % 16
    eye = torch.eye(K, dtype=BF16, device="cuda")
    want = _decoded("nvfp4", w, s, g)
    for k0 in range(0, K, mg.MAX_ROWS):
        got = mg.packed_product_stored(eye[k0:k0 + mg.MAX_ROWS], "nvfp4", w, s, g)
        assert torch.equal(got.transpose(-1, -2), want[..., k0:k0 + mg.MAX_ROWS]), k0


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
def test_loads_two_steps_ahead_give_the_same_bits(layout, fmt):
    """A launch loading two K steps ahead (`Launch.ahead` 2) issues the same MMAs in the same order: the same bits
    as one step ahead, for splits of one step, a few and none."""
    for case, (E, N, K) in enumerate(SHAPES):
        w, s, g = _operands(fmt, E, N, K, min(case, 1), device="cuda")
        product = _product_fn(layout, fmt, N, w, s, g)
        for rows in (1, 5):
            x = torch.randn(rows, K, device="cuda").to(BF16)
            one = mg.launch_for(fmt, rows)[1]._replace(ahead=1)
            for split in (1, 2, K // mg.STEP_K):
                want = product(x, split=split, launch=one)
                assert torch.equal(product(x, split=split, launch=one._replace(ahead=2)), want), (case, rows, split)


@pytest.mark.gpu
@on_gpu
def test_loads_that_prefetch_into_l2_give_the_same_bits():
    """A stored NVFP4 launch whose loads fetch their rows' 256-byte blocks into L2 (`Launch.prefetch`; unmasked: whole
    row tiles and pair steps) reads the same bytes: the same bits as plain loads, by ids (one x for all, one an
    entry), flags and ranges (empty ones too), at splits of one pair step, a few and none."""
    E, N, K = 5, 256, 1024
    w, s, g = _operands("nvfp4", E, N, K, 1, device="cuda")
    sizes = [3, 0, 9, 1, 2]
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    ids = torch.tensor([4, 0, 2], device="cuda")
    calls = {"ids, one x": dict(x=torch.randn(1, 1, K), index=ids), "ids, x an entry": dict(x=torch.randn(3, 1, K),
                                                                                              index=ids),
             "flags": dict(x=torch.randn(4, K), active=torch.tensor([1, 0, 1, 1, 0], device="cuda")),
             "ranges": dict(x=torch.randn(sum(sizes), K), ends=ends)}
    for name, kw in calls.items():
        x = kw.pop("x").to("cuda", BF16)
        for split in (1, 2, K // mg.step_columns("nvfp4", True)):
            plain = mg.Launch(1, 8)
            want = mg.packed_product_stored(x, "nvfp4", w, s, g, split=split, launch=plain, **kw)
            got = mg.packed_product_stored(x, "nvfp4", w, s, g, split=split, launch=plain._replace(prefetch=True), **kw)
            assert torch.equal(got, want), (name, split)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_adds_its_splits_to_the_same_bits(layout, fmt):
    """With `counters` the kernel adds its K splits itself (one launch): the bits of the split sum kernel's result,
    the counters zero again after every launch and every replay of a captured graph, for every entry selection; a
    launch needing more counters than given takes the split sum kernel."""
    for case, (E, N, K) in enumerate(SHAPES):
        w, s, g = _operands(fmt, E, N, K, min(case, 1), device="cuda")
        product = _product_fn(layout, fmt, N, w, s, g)
        counters = mg.counters_for(E, N, torch.device("cuda"))
        for rows in (1, 8, 32):
            x = torch.randn(rows, K, device="cuda").to(BF16)
            active = (torch.arange(E, device="cuda") % 2 == 0).to(torch.int32)
            for kw in ({}, {"active": active}, {"index": torch.tensor([E - 1, 0, E - 1], device="cuda")}):
                want = product(x, split=3, **kw)
                got = product(x, split=3, counters=counters, **kw)
                assert torch.equal(got, want), (case, rows, kw.keys())
                assert not counters.any()
        graph = torch.cuda.CUDAGraph()
        x = torch.randn(5, K, device="cuda").to(BF16)
        with torch.cuda.graph(graph):
            replayed = product(x, split=2, counters=counters)
        want = product(x, split=2)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(replayed, want) and not counters.any()
        if K >= 2 * mg.STEP_K and N > 4 * mg.ROW_TILE:  # two splits, more than one program an entry
            small = torch.zeros(E, dtype=torch.int32, device="cuda")  # fewer than the launch's programs
            assert torch.equal(product(x, split=2, counters=small), want) and not small.any()


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_on_cuda_selects_entries_and_captures(layout, fmt):
    """`index` reads the chosen entries (repeats allowed), `active` gives zero rows for unflagged entries, per-entry
    x; the same bits replayed from a CUDA graph."""
    E, N, K = 6, 384, 512
    w, s, g = _operands(fmt, E, N, K, 1, device="cuda")
    product = _product_fn(layout, fmt, N, w, s, g)
    w_hat = _decoded(fmt, w, s, g)
    x = torch.randn(3, K, device="cuda").to(BF16)
    index = torch.tensor([4, 1, 4], device="cuda")
    y = product(x, index=index)
    ok, ratio = _bound_ok(y, x, w_hat[index.cpu()])
    assert ok, ratio
    active = torch.tensor([0, 1, 0, 0, 1, 1], dtype=torch.int32, device="cuda")
    xe = torch.randn(E, 2, K, device="cuda").to(BF16)
    y = product(xe, active=active, busy=3)
    flagged = active.bool().cpu()
    assert not y[~flagged.cuda()].any()
    ok, ratio = _bound_ok(y[flagged.cuda()], xe[flagged.cuda()], w_hat[flagged])
    assert ok, ratio
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = product(xe, active=active, busy=3)
    graph.replay()
    assert torch.equal(replayed, y)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
def test_ranges_equal_each_entry_alone(layout, fmt):
    """`ends`: rows sorted by entry, each range multiplied by its own entry, bit for bit the rows of the same range
    multiplied alone by that entry (`index`) at the same K split (ranges of 0, 1 to 8, 9 to 16 and 17 to 32 rows: one
    row group, two, passes of two), within the bound of the decoded weight (the default split too); with the splits
    added in the kernel or by the split sum kernel; the same bits replayed from a CUDA graph, the counters zero
    again."""
    E = 6
    for case, (_, N, K) in enumerate(SHAPES):
        w, s, g = _operands(fmt, E, N, K, min(case, 1), device="cuda")
        w_hat = _decoded(fmt, w, s, g)
        product = _product_fn(layout, fmt, N, w, s, g)
        counters = mg.counters_for(E, N, torch.device("cuda"))
        for sizes in ([3, 0, 12, 1, 30, 8], [0, 0, 17, 0, 0, 9], [16, 5, 0, 2, 24, 32]):
            ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
            x = torch.randn(sum(sizes), K, device="cuda").to(BF16)
            starts = [sum(sizes[:e]) for e in range(E)]
            for split in (None, 1, 2, 3):
                got = product(x, ends=ends, split=split, sms=132)
                assert got.shape == (sum(sizes), N)
                for e, (start, size) in enumerate(zip(starts, sizes)):
                    if not size:
                        continue
                    rows = slice(start, start + size)
                    ok, ratio = _bound_ok(got[rows], x[rows], w_hat[e])
                    assert ok, (case, sizes, split, e, ratio)
                    if split is not None:
                        alone = product(x[rows], index=torch.tensor([e], device="cuda"), split=split)[0]
                        assert torch.equal(got[rows], alone), (case, sizes, split, e)
                if split is not None:
                    summed = product(x, ends=ends, split=split, counters=counters)
                    assert torch.equal(summed, got) and not counters.any(), (case, sizes, split)
        want = product(x, ends=ends, split=2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = product(x, ends=ends, split=2, counters=counters)
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(replayed, want) and not counters.any()


@pytest.mark.gpu
@on_gpu
def test_mma_preset_decode_step_equals_reference(tiny_nvfp4):
    """The tiny model on CUDA with the `gemv-mma` preset (compiled layers, CUDA graph, packed products of up to 32
    rows by the kernel, the expert stacks read in place, gate and up as one joint stack: at batch 1 the routed experts
    by id, at 8 by flags, at 16 and 32 each chosen expert times its own tokens): a decode step's logits against the
    reference engine's within bf16 rounding."""
    assert FastPaths.of("gemv-mma").expert_ranges
    for batch in (1, 8, 16, 32):
        err = captured_step_error(tiny_nvfp4, "gemv-mma", batch, JointStack)
        assert err < 5e-2, (batch, err)


@pytest.mark.gpu
@on_gpu
def test_mma_stored_preset_decode_step_equals_reference(tiny_nvfp4):
    """The `gemv-mma-stored` preset (every weight read in place up to 8 rows, the grouped kernel above): the captured
    decode step's logits at batch 1, 8 and 32 against the reference engine's within bf16 rounding."""
    for batch in (1, 8, 32):
        err = captured_step_error(tiny_nvfp4, "gemv-mma-stored", batch, "gemv_tokens")
        assert err < 5e-2, (batch, err)
