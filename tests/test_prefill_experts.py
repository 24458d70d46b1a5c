"""Prefill's routed experts multiplied from their packed stacks (`fast.prefill_experts`, `FastPaths(prefill_experts=
"triton")`): the row tiles laid out from the groups' ends (hand-worked, any machine); the kernel against
`torch._grouped_mm` on the reference decoder's bf16 weights within the fp32 summation bound (NVFP4 with and without
the blocks' tables, MXFP8, empty groups, chosen entries, partial tiles); and a packed `FastExperts` whose sorted rows
take the kernel in one call without a host read, equal to the decode-then-grouped-matmul path.

The kernel cases run in Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1`) and compiled on a GPU (`-m gpu`)."""

from __future__ import annotations

import pytest
import torch
from test_grouped import BF16, DEVICES, _bound_ok, _decoded, _operands

import minimax_ref.fast.prefill_experts as pe
from minimax_ref.errors import ConfigError
from minimax_ref.fast import FastPaths, apply
from minimax_ref.model.moe import Experts, Routing, route
from minimax_ref.weights.packed import PackedWeight


def test_row_tiles_number_each_groups_tiles_in_turn():
    # groups of 5, 0, 19 and 3 rows, tiles of 16 rows: 1 + 0 + 2 + 1 tiles, then the bound's spare numbers
    offs = torch.tensor([5, 5, 24, 27], dtype=torch.int32)
    group, first = pe.row_tiles(offs, 16, -(-27 // 16) + 4)
    assert group.tolist() == [0, 2, 2, 3, -1, -1]
    assert first.tolist() == [0, 5, 21, 24, 0, 0]
    # one group of exactly two tiles; no rows at all
    assert [t.tolist() for t in pe.row_tiles(torch.tensor([32], dtype=torch.int32), 16, 3)] == [[0, 0, -1],
                                                                                                 [0, 16, 0]]
    assert pe.row_tiles(torch.tensor([0, 0], dtype=torch.int32), 16, 2)[0].tolist() == [-1, -1]


def test_tiles_are_checked():
    assert pe.Tiles.parse("64,128,64,4,3") == pe.Tiles(64, 128, 64, 4, 3)
    with pytest.raises(ConfigError, match="block_k=16"):
        pe.Tiles(64, 64, 16)
    with pytest.raises(ConfigError, match="power of two"):
        pe.Tiles(48, 64, 64)
    with pytest.raises(ConfigError, match="num_warps=3"):
        pe.Tiles(64, 64, 64, 3)
    assert pe.tiles_for(torch.device("cpu")) == pe.DEFAULT


def _grouped_want(x, w_hat, offs, index=None):
    return torch._grouped_mm(x, (w_hat if index is None else w_hat[index]).transpose(-2, -1), offs=offs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt,table", [("nvfp4", False), ("nvfp4", True), ("mxfp8", False)])
def test_kernel_is_grouped_mm_on_the_decoded_weights(device, fmt, table):
    E, N, K = 4, 40, 128  # N: a partial column tile
    w, s, g = _operands(fmt, E, N, K, 1, device)
    w_hat = _decoded(fmt, w, s, g)
    gen = torch.Generator().manual_seed(2)
    counts = [5, 0, 19, 3]  # an empty group; groups of fewer and more rows than a tile
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), K, generator=gen).to(BF16).to(device)
    for tiles in (pe.Tiles(16, 16, 32, 4, 1), pe.Tiles(32, 64, 64, 4, 2)):
        got = pe.sorted_packed_matmul(x, fmt, w, s, g, offs, tiles=tiles, table=table)
        assert got.shape == (27, N) and got.dtype == BF16
        for e, (lo, hi) in enumerate(zip([0, *offs.tolist()[:-1]], offs.tolist())):
            if lo == hi:
                continue
            ok, ratio = _bound_ok(got[lo:hi], x[lo:hi], w_hat[e])
            assert ok, (tiles, e, ratio)
        assert (got.float() - _grouped_want(x, w_hat, offs).float()).abs().max() <= \
            1e-2 * _grouped_want(x, w_hat, offs).float().abs().max()
    # chosen entries (index): group g multiplies entry index[g]
    index = torch.tensor([3, 0, 2], device=device)
    offs2 = torch.tensor([4, 10, 10], dtype=torch.int32, device=device)
    got = pe.sorted_packed_matmul(x[:10], fmt, w, s, g, offs2, index=index, tiles=pe.Tiles(16, 16, 32, 4, 1))
    assert _bound_ok(got[:4], x[:4], w_hat[3])[0] and _bound_ok(got[4:10], x[4:10], w_hat[0])[0]


def test_bad_operands_are_named():
    w, s, g = _operands("nvfp4", 2, 32, 64, 1, "cpu")
    offs = torch.tensor([3, 5], dtype=torch.int32)
    if not pe.AVAILABLE:
        pytest.skip("triton is not importable")
    with pytest.raises(ValueError, match=r"x \[5, 96\]"):
        pe.sorted_packed_matmul(torch.zeros(5, 96, dtype=BF16), "nvfp4", w, s, g, offs)
    with pytest.raises(ValueError, match=r"index \[3\]"):
        pe.sorted_packed_matmul(torch.zeros(5, 64, dtype=BF16), "nvfp4", w, s, g, offs, index=torch.arange(3))


def _packed_experts(E=8, H=64, I=32, seed=0):  # noqa: E741
    ex = Experts(E, H, I, 1.702, 7.0, None, False)
    for leaf, n, k in (("w1", I, H), ("w3", I, H), ("w2", H, I)):
        w, s, g = _operands("nvfp4", E, n, k, 1, "cpu")
        delattr(ex, leaf)  # the plain parameter, replaced by the packed stack (as the loader does)
        setattr(ex, leaf, PackedWeight("nvfp4", w, s, g, dtype=BF16))
    return ex


@pytest.mark.parametrize("device", DEVICES)
def test_packed_experts_take_the_kernel_in_one_call(device, monkeypatch):
    """`FastPaths(moe=True, prefill_experts="triton")`: a packed expert stack's sorted rows go through the kernel,
    every local expert in one call with the groups' ends on the device (no host read), an expert no pair chose an
    empty group; within fp32 rounding of the decode-then-`torch._grouped_mm` path."""
    ex = _packed_experts().to(device)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(120, 64, generator=g).to(BF16).to(device)
    r = route(x.float().cpu(), torch.randn(8, 64, generator=g), None, 2)
    r = Routing(torch.where(r.expert_ids == 5, 6, r.expert_ids).to(device), r.weights.to(device), r.logits)
    apply(ex, FastPaths(moe=True))
    want = ex(x, r)
    apply(ex, FastPaths(moe=True, prefill_experts="triton"))
    assert all(getattr(ex, leaf).sorted_tiles is not None for leaf in ("w1", "w2", "w3"))
    calls = []
    real = pe.sorted_packed_matmul
    monkeypatch.setattr(pe, "sorted_packed_matmul", lambda *a, **kw: calls.append(kw.get("index", a[6] if
                                                                                         len(a) > 6 else None))
                        or real(*a, **kw))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("a host read in the sorted products"))
    got = ex(x, r)
    monkeypatch.undo()
    assert len(calls) == 3 and all(c is None for c in calls)
    assert float((got - want).norm() / want.norm()) < 1e-2
    # the reference restored: no kernel attribute left behind
    apply(ex, FastPaths())
    assert "sorted_tiles" not in vars(ex.w1)


def test_prefill_experts_preset_and_switch():
    paths = FastPaths.of("prefill-experts")
    assert paths.prefill_experts == "triton" and paths.compile_layers
    assert FastPaths.of("compiled").prefill_experts == "auto"
    # "auto": in registers below the rows-an-expert bound, decoded first from it on; "triton" always
    bound = pe.IN_REGISTERS_BELOW_ROWS_PER_EXPERT
    assert pe.multiplies_in_registers("auto", 128 * bound - 1, 128)
    assert not pe.multiplies_in_registers("auto", 128 * bound, 128)
    assert pe.multiplies_in_registers("triton", 10**9, 1) and not pe.multiplies_in_registers("reference", 1, 128)
    with pytest.raises(ConfigError, match="prefill_experts='x'"):
        FastPaths(prefill_experts="x")
    # off a device the kernel runs on (CPU without the interpreter) the stacks keep the decode-then-multiply path
    if not pe.grouped.runs_on(torch.device("cpu")):
        ex = _packed_experts()
        apply(ex, FastPaths(moe=True, prefill_experts="triton"))
        assert not ex.multiplies_sorted_packed(torch.zeros(2, 64, dtype=BF16), 2, len(ex.local_experts))


@pytest.mark.skipif(not pe.AVAILABLE or pe.grouped.interpreting(),
                    reason="compiles the CUDA kernel (triton, not interpreted)")
@pytest.mark.parametrize("fmt,table", [("nvfp4", False), ("nvfp4", True), ("mxfp8", False)])
def test_kernel_compiles_for_h200_without_spills(fmt, table):
    """The kernel as the GPU runs it (conversion instructions, bf16 tensor-core dots, the NVFP4 table's inline
    assembly) compiles for sm_90 on any machine with triton (its ptxas) at the default tiles, with no register
    spills (ptxas -v)."""
    from test_grouped import _ptxas, _ptxas_report, _sm90_ptx

    if _ptxas() is None:
        pytest.skip("triton's ptxas is not installed")
    tiles = pe.DEFAULT
    consts = {"NVFP4_FMT": fmt == "nvfp4", "HAS_INDEX": True, "EXACT_FP32": False, "TABLE": table,
              "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k}
    pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "g_ptr": "*fp32", "index_ptr": "*i64",
                "offs_ptr": "*i32", "tile_group_ptr": "*i32", "tile_row_ptr": "*i32", "y_ptr": "*bf16"}
    ptx = _sm90_ptx(pe._sorted_kernel, consts, pointers, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    assert "mma" in ptx  # tensor-core products
    info = _ptxas_report(ptx)
    assert " 0 bytes spill stores" in info, info


@pytest.fixture(scope="module")
def nvfp4_ckpt(ckpt_factory):
    return ckpt_factory("tiny", "nvfp4")


@pytest.mark.parametrize("device", DEVICES)
def test_a_models_prefill_takes_the_kernel(nvfp4_ckpt, device, monkeypatch):
    """A bf16 model with packed stacks prefills more tokens than the synchronisation-free path takes: with
    `prefill_experts="triton"` every MoE layer's three projections go through the kernel, and the logits equal the
    decode-then-`torch._grouped_mm` path's within bf16 rounding of the activations; "auto" chooses by rows an
    expert."""
    from minimax_ref.weights.loader import load_model

    model = load_model(nvfp4_ckpt, dtype=BF16, weights="packed", device=device)
    ids = torch.randint(0, model.text.vocab_size, (1, 100), generator=torch.Generator().manual_seed(9)).to(device)
    apply(model, FastPaths(moe=True))
    want = model(ids).float()
    apply(model, FastPaths(moe=True, prefill_experts="triton"))
    calls = []
    real = pe.sorted_packed_matmul
    monkeypatch.setattr(pe, "sorted_packed_matmul", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = model(ids).float()
    moe_layers = sum(1 for layer in model.layers if hasattr(layer, "block_sparse_moe"))
    assert moe_layers and len(calls) == 3 * moe_layers
    assert float((got - want).norm() / want.norm()) < 2e-2
    # "auto" takes the kernel for a call's few rows an expert, and decodes first once they pass the bound
    apply(model, FastPaths(moe=True, prefill_experts="auto"))
    calls.clear()
    assert torch.equal(model(ids).float(), got) and len(calls) == 3 * moe_layers
    rows_per_expert = ids.shape[1] * model.text.num_experts_per_tok / model.text.num_local_experts
    monkeypatch.setattr(pe, "IN_REGISTERS_BELOW_ROWS_PER_EXPERT", int(rows_per_expert))
    calls.clear()
    assert torch.equal(model(ids).float(), want) and not calls
