"""The attention kernel (`fast.attention_kernel`; `FastPaths(prefill_attention="triton")` in every preset,
`decode_attention="triton"` in `compiled`).

Contract under test: `block_attention` computes `msa.gather_block_attention` (a block selection given; with the
indexer's own selection, `msa.msa_attention`) and `attention.causal_attention` (none) for bf16 queries over keys and
values as a cache stores them (bf16, or fp8 read as `LayerCache.load` reads it), within fp32 rounding plus the stated
split of the probabilities (2^-18 relative): |o - o_ref| <= 2e-5 of max |v| (an output is a convex combination of the
values it reads), against the reference cores computing in fp32 on the same bf16 values. Each query reads exactly its
keys: with all scores equal (zero queries) the output is the mean of the values it reads, which any key more or less
moves by about 1/keys. Geometries beyond the release's: groups that are not powers of two, head dims and block sizes
that are not, blocks of fewer keys than a tensor-core tile and of more (read as several key tiles), empty selection
slots, selected blocks past a query, query tiles of several tokens whose selections differ widely (unions capped by the
blocks in the cache, and not), the prompt not a multiple of the tile or the block, one token a tile, chunked prefill
(queries after cached keys), two sequences at different positions, dense tiles before every query of a tile (unmasked),
keys split over programs and merged (decode and verify steps). `tile_blocks` is checked against sets built in Python.

The kernel runs in Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1 python -m pytest -q
tests/test_attention_kernel.py`; skipped otherwise) and compiled on CUDA (`-m gpu`). Model tests check that a bf16
model's prefill and decode steps take the kernel (on CUDA inside compiled layers and CUDA graphs) and agree with the
gathering path (to bf16 rounding, and expert flips at ties).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from minimax_ref.fast import FastPaths, apply
from minimax_ref.fast import attention_kernel as pa
from minimax_ref.fast.grouped import AVAILABLE, interpreting
from minimax_ref.model.attention import causal_attention
from minimax_ref.model.cache import store_kv
from minimax_ref.model.msa import gather_block_attention, msa_attention

INTERP = AVAILABLE and interpreting()
interp = pytest.mark.skipif(not INTERP, reason="run with TRITON_INTERPRET=1 (Triton's interpreter on CPU tensors)")
gpu = [pytest.mark.gpu, pytest.mark.skipif(INTERP or not AVAILABLE, reason="compiled Triton kernels")]
DEVICES = [pytest.param("cpu", marks=interp), pytest.param("cuda", marks=gpu)]
BOUND = 2e-5

# (batch, queries, cached keys before them, query heads, kv heads, head dim, block size, selected blocks)
GEOMETRIES = {
    "tiny": (2, 37, 0, 8, 2, 32, 16, 4),
    "chunked": (1, 40, 25, 16, 1, 64, 16, 3),
    "odd": (2, 20, 7, 12, 4, 24, 10, 3),
    # 16 heads a kv head (8 tokens a default tile), 21 queries (not a multiple of it), blocks of 32 slots; 6 blocks in
    # the cache: every tile's union is cut at 6
    "long": (1, 21, 150, 16, 1, 32, 32, 3),
    # 39 blocks in the cache, a tile's union is up to 8 tokens x 4 blocks, not cut
    "wide": (1, 11, 600, 16, 1, 32, 16, 4),
}
# Launch configurations: the default; 32 rows over key tiles of 16 (blocks of 32 read as two tiles); one token a
# program at G = 16 (its own selection, no union)
TILES = {"default": None, "small": pa.Tiles(32, 16, 4, 1), "token": pa.Tiles(16, 16, 4, 1)}


def _operands(geometry: tuple, fp8: bool, device: str, seed: int = 0):
    B, T, L0, Hq, Hkv, D, bs, kb = geometry
    g = torch.Generator().manual_seed(seed)
    L = L0 + T
    q = torch.randn(B, T, Hq, D, generator=g).bfloat16()
    k = (2 * torch.randn(B, L, Hkv, D, generator=g)).bfloat16()
    v = torch.randn(B, L, Hkv, D, generator=g).bfloat16()
    # the second sequence's queries sit 3 positions earlier: its last cached keys are future keys
    pos = torch.stack([L0 + torch.arange(T) - 3 * (b % 2) for b in range(B)]).clamp(min=0)
    if fp8:
        ks, vs = store_kv(k, torch.float8_e4m3fn, 1.0), store_kv(v, torch.float8_e4m3fn, 1.0)
        k, v = ks.float().bfloat16(), vs.float().bfloat16()  # what LayerCache.load gives
    else:
        ks, vs = k, v
    nb = -(-L // bs)
    kb = min(kb, nb)
    # distinct random blocks (some past the query), the query's own block first, the last slot empty
    blocks = torch.stack([torch.randperm(nb, generator=g)[:kb] for _ in range(B * Hkv * T)]).view(B, Hkv, T, kb)
    own = (pos // bs)[:, None, :].expand(B, Hkv, T)
    blocks = torch.where(blocks == own[..., None], blocks[..., :1].expand_as(blocks), blocks)
    blocks[..., 0] = own
    if kb > 1:
        blocks[..., -1] = -1
    moved = [t.to(device) for t in (q, ks, vs, k, v, pos, blocks)]
    return (*moved, bs, D**-0.5)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _err(got: torch.Tensor, want: torch.Tensor, v: torch.Tensor) -> float:
    """max |got - want| over max |v|: an output row is a convex combination of the values it reads, so its rounding
    scales with them, not with the row (dense attention over thousands of random keys averages them towards 0)."""
    return float((got.float() - want.float()).abs().max() / v.float().abs().max())


# (geometry, fp8 cache, sms, tiles): every geometry, cache and split with the default tiles; the other tiles on each
# geometry once, and with an fp8 cache and splits where blocks are read as two key tiles
CASES = [(name, fp8, sms, "default") for name in sorted(GEOMETRIES) for fp8 in (False, True) for sms in (1, 1000)]
CASES += [(name, False, 1, tiles) for name in sorted(GEOMETRIES) for tiles in ("small", "token")]
CASES += [("long", True, 1000, "small")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "fp8", "sms", "tiles"), CASES,
                         ids=[f"{n}-{'fp8' if f else 'bf16'}-cache-{'split' if s > 1 else 'whole'}-{t}"
                              for n, f, s, t in CASES])
def test_kernel_equals_the_reference_cores(name, fp8, sms, tiles, device):
    """`sms` 1: one program per query tile reads all its keys; 1000: the keys are split as far as they go (one block
    or key tile per program) and merged."""
    q, ks, vs, k, v, pos, blocks, bs, scale = _operands(GEOMETRIES[name], fp8, device)
    config = TILES[tiles]
    dense = pa.block_attention(q, ks, vs, pos, scale, sms=sms, tiles=config)
    assert dense.dtype == torch.float32 and dense.shape == q.shape
    assert _err(dense, causal_attention(q, k, v, pos, scale), v) < BOUND
    sparse = pa.block_attention(q, ks, vs, pos, scale, blocks, bs, sms=sms, tiles=config)
    assert _err(sparse, gather_block_attention(q, k, v, blocks, pos, bs, scale), v) < BOUND
    # the selection matters: another selection gives another result
    assert _rel(sparse, dense) > 1e-2


# One bf16 part a probability (`split_probabilities=False`): |r| <= 2^-9 p, so an output is within 2^-9 of the sum of
# |p v| / l <= max |v| of the reference's, plus fp32 rounding
BOUND_BF16_P = 2.0**-9 + BOUND


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("sms", [1, 1000])
def test_probabilities_as_one_bf16_part(name, sms, device):
    """`split_probabilities=False` (`FastPaths(attention_probabilities="bf16")`): the value sum takes each
    probability rounded once to bf16: within 2^-9 of max |v| of the reference cores, and not the split result."""
    q, ks, vs, k, v, pos, blocks, bs, scale = _operands(GEOMETRIES[name], False, device)
    dense = pa.block_attention(q, ks, vs, pos, scale, sms=sms, split_probabilities=False)
    assert _err(dense, causal_attention(q, k, v, pos, scale), v) < BOUND_BF16_P
    sparse = pa.block_attention(q, ks, vs, pos, scale, blocks, bs, sms=sms, split_probabilities=False)
    assert _err(sparse, gather_block_attention(q, k, v, blocks, pos, bs, scale), v) < BOUND_BF16_P
    split = pa.block_attention(q, ks, vs, pos, scale, blocks, bs, sms=sms)
    assert 0 < _err(sparse, split, v) < BOUND_BF16_P


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_scale", [1.0, 0.5, 3.0])
def test_scaled_fp8_cache_read_as_the_cache_loads_it(kv_scale, device):
    """An fp8 cache read with a scale: keys and values as `LayerCache.load` gives them, bf16(fp32(e4m3) * scale)
    (the kernel multiplies only where the scale is not 1.0: `fp8_mode`), against the reference cores on those."""
    q, _, _, k, v, pos, blocks, bs, scale = _operands(GEOMETRIES["long"], False, device, seed=4)
    ks, vs = store_kv(k, torch.float8_e4m3fn, kv_scale), store_kv(v, torch.float8_e4m3fn, kv_scale)
    k, v = (ks.float() * kv_scale).bfloat16(), (vs.float() * kv_scale).bfloat16()
    got = pa.block_attention(q, ks, vs, pos, scale, blocks, bs, kv_scale=kv_scale)
    assert _err(got, gather_block_attention(q, k, v, blocks, pos, bs, scale), v) < BOUND
    got = pa.block_attention(q, ks, vs, pos, scale, kv_scale=kv_scale)
    assert _err(got, causal_attention(q, k, v, pos, scale), v) < BOUND


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_scale", [1.0, 0.5])
def test_keys_widened_before_the_kernel_give_the_same_output(kv_scale, device):
    """Prefill converts an fp8 cache's keys and values once (`fast.attention.widen_keys`) and runs the kernel on
    bf16: the same operands as the kernel's own conversion (bit for bit), so the same output within the kernel's
    fp32 rounding, MSA and dense (in the interpreter the same bits; compiled for a GPU, the two storages are
    separate kernels whose fp32 sums the compiler may order differently); every e4m3 value (all 256 bit patterns but
    NaN) widens to its exact value."""
    from minimax_ref.fast.attention import widen_keys
    from minimax_ref.model.cache import LayerCache

    q, _, _, k, v, pos, blocks, bs, scale = _operands(GEOMETRIES["long"], False, device, seed=6)
    ks, vs = store_kv(k, torch.float8_e4m3fn, kv_scale), store_kv(v, torch.float8_e4m3fn, kv_scale)
    cache = LayerCache(ks, vs, None, torch.bfloat16, kv_scale)
    kw, vw = widen_keys(cache, ks, torch.bfloat16), widen_keys(cache, vs, torch.bfloat16)
    assert kw.dtype == torch.bfloat16 and torch.equal(kw, (ks.float() * kv_scale).bfloat16())
    for sel in ((blocks, bs), ()):
        got = pa.block_attention(q, kw, vw, pos, scale, *sel)
        own = pa.block_attention(q, ks, vs, pos, scale, *sel, kv_scale=kv_scale)
        assert torch.equal(got, own) if device == "cpu" else _err(got, own, vw) < BOUND
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = ~every.float().isnan()
    one = LayerCache(every, every, None, torch.bfloat16, 1.0)
    assert torch.equal(widen_keys(one, every, torch.bfloat16)[finite].double(), every.double()[finite])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sms", [1, 1000])
def test_bf16_output_is_the_fp32_output_rounded_once(sms, device):
    """`out_dtype=bfloat16`: the fp32 result rounded to nearest (ties to even) by the kernel, or after the splits'
    merge (sms 1000), bit for bit `.to(bfloat16)` of the fp32 output; MSA and dense; other dtypes refused."""
    q, ks, vs, _, _, pos, blocks, bs, scale = _operands(GEOMETRIES["long"], True, device, seed=8)
    for sel in ((blocks, bs), ()):
        want = pa.block_attention(q, ks, vs, pos, scale, *sel, sms=sms)
        got = pa.block_attention(q, ks, vs, pos, scale, *sel, sms=sms, out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    with pytest.raises(ValueError, match="out_dtype"):
        pa.block_attention(q, ks, vs, pos, scale, out_dtype=torch.float16)


def test_widening_pays_where_tiles_would_convert_more_keys_than_the_cache_holds():
    """`widening_pays` at release geometry (16 query heads a kv head, MSA top-16 blocks of 128): an 8K prompt widens
    its cache once; 100 or 1,000 new tokens over a 131K cache convert in the kernel (fewer tiles times their blocks
    than twice the cache), 4,000 widen; dense layers' causal tiles read far more keys, so they widen."""
    from minimax_ref.fast.attention import widening_pays

    cpu = torch.device("cpu")
    assert widening_pays(8192, 8192, 16, 16 * 128, cpu)
    assert not widening_pays(100, 131072, 16, 16 * 128, cpu)
    assert not widening_pays(1000, 131072, 16, 16 * 128, cpu)
    assert widening_pays(4000, 131072, 16, 16 * 128, cpu)
    assert widening_pays(100, 131072, 16, None, cpu) and widening_pays(65, 8192, 16, None, cpu)


def test_fp8_mode():
    assert pa.fp8_mode(torch.bfloat16, 1.0) == 0 and pa.fp8_mode(torch.bfloat16, 0.5) == 0
    assert pa.fp8_mode(torch.uint8, 1.0) == 1 and pa.fp8_mode(torch.uint8, 0.5) == 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "tiles"), [("long", "default"), ("long", "small"), ("wide", "default"),
                                             ("odd", "token")])
def test_each_query_reads_exactly_its_keys(name, tiles, device):
    """Zero queries: every score 0, so each output row is the plain mean of the values its query reads; a key more
    or less (another token's block, a future key, a slot past the block) moves it by about 1/keys >> the bound."""
    q, ks, vs, k, v, pos, blocks, bs, scale = _operands(GEOMETRIES[name], False, device, seed=3)
    q = torch.zeros_like(q)
    for sms in (1, 1000):
        got = pa.block_attention(q, ks, vs, pos, scale, blocks, bs, sms=sms, tiles=TILES[tiles])
        assert _err(got, gather_block_attention(q, k, v, blocks, pos, bs, scale), v) < BOUND
        got = pa.block_attention(q, ks, vs, pos, scale, sms=sms, tiles=TILES[tiles])
        assert _err(got, causal_attention(q, k, v, pos, scale), v) < BOUND


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_kernel_with_the_indexers_selection_equals_msa_attention(fp8, device):
    """The indexer's own selection (`msa.msa_attention`: top-4 of blocks of 16, a local and an initial block forced)
    over 300 cached keys and a 70-token chunk, two sequences, the index queries drifting slowly from token to token
    as a model's do (neighbouring tokens share most of their blocks, not all)."""
    q, ks, vs, k, v, pos, _, bs, scale = _operands((2, 70, 300, 32, 2, 64, 16, 4), fp8, device, seed=9)
    g = torch.Generator().manual_seed(9)
    B, T, Hi, L = 2, 70, 2, 370
    steps = torch.randn(B, T, Hi, 32, generator=g)
    iq = (torch.randn(B, 1, Hi, 32, generator=g) + 0.3 * steps.cumsum(1)).bfloat16().to(device)
    ik = torch.randn(B, L, 32, generator=g).bfloat16().to(device)
    want, blocks = msa_attention(q, k, v, iq, ik, pos, scale, bs, 4, 1, 1)
    union = pa.tile_blocks(blocks, 8, -(-L // bs))
    distinct = (union >= 0).sum(-1).float().mean()
    assert 4 < distinct < 8 * 4  # shared blocks and differing ones within a tile
    assert _err(pa.block_attention(q, ks, vs, pos, scale, blocks, bs, sms=1), want, v) < BOUND


def test_tile_blocks_are_each_tiles_distinct_ids():
    """`tile_blocks` against sets built in Python: ragged tiles, empty slots, repeats across tokens, a cut list."""
    g = torch.Generator().manual_seed(2)
    B, H, T, kb, nb = 2, 3, 13, 4, 9
    blocks = torch.stack([torch.randperm(nb, generator=g)[:kb] for _ in range(B * H * T)]).view(B, H, T, kb)
    blocks[torch.rand(B, H, T, kb, generator=g) < 0.3] = -1
    for tokens in (1, 2, 4, 8):
        got = pa.tile_blocks(blocks, tokens, nb)
        assert got.dtype == torch.int32 and got.shape == (B, H, -(-T // tokens), min(tokens * kb, nb))
        for b in range(B):
            for h in range(H):
                for i in range(got.shape[2]):
                    ids = sorted({int(x) for x in blocks[b, h, i * tokens:(i + 1) * tokens].flatten() if x >= 0})
                    assert got[b, h, i].tolist() == ids + [-1] * (got.shape[-1] - len(ids))


def test_tiles_are_checked(monkeypatch):
    assert pa.Tiles.parse("64,32,4,3") == pa.Tiles(64, 32, 4, 3) and pa.Tiles(64, 32, 4, 3).text() == "64,32,4,3"
    from minimax_ref.errors import ConfigError

    with pytest.raises(ConfigError, match="rows=96: give a power of two"):
        pa.Tiles(96)
    with pytest.raises(ConfigError, match="keys=8"):
        pa.Tiles(keys=8)
    with pytest.raises(ConfigError, match="give ROWS,KEYS,NUM_WARPS,NUM_STAGES"):
        pa.Tiles.parse("128,64")
    assert pa.tiles_for("sparse", torch.device("cpu")) == pa.DEFAULT["sparse"]
    # a measured entry for this GPU's name, for its kind only
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(name="Some GPU"))
    monkeypatch.setitem(pa.TUNED, "Some GPU", {("dense", "bf16"): pa.Tiles(64, 128, 4, 3),
                                               ("sparse", "fp8"): pa.Tiles(64, 64, 4, 2)})
    assert pa.tiles_for("dense", torch.device("cuda")) == pa.Tiles(64, 128, 4, 3)
    assert pa.tiles_for("dense", torch.device("cuda"), "fp8") == pa.DEFAULT["dense"]
    assert pa.tiles_for("sparse", torch.device("cuda"), "fp8") == pa.Tiles(64, 64, 4, 2)
    assert pa.tiles_for("sparse", torch.device("cuda")) == pa.DEFAULT["sparse"]
    # 8 tokens of 16 heads; fewer for fewer queries; padded heads count (12 -> 16)
    assert [pa.tile_tokens(128, 16, t) for t in (1, 3, 8, 9000)] == [1, 4, 8, 8]
    assert pa.tile_tokens(128, 12, 100) == 8 and pa.tile_tokens(16, 16, 100) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_decode_shaped_calls(device):
    """One query per sequence over a long cache (a decode step), split over the keys: equal to the cores."""
    q, ks, vs, k, v, pos, blocks, bs, scale = _operands((3, 1, 300, 16, 2, 64, 32, 4), True, device, seed=5)
    assert pa.splits_for(3 * 2, 4, 132) == 4 and pa.splits_for(3 * 2, 100, 2) == 1
    assert _err(pa.block_attention(q, ks, vs, pos, scale, blocks, bs, sms=132),
                gather_block_attention(q, k, v, blocks, pos, bs, scale), v) < BOUND
    assert _err(pa.block_attention(q, ks, vs, pos, scale, sms=132), causal_attention(q, k, v, pos, scale), v) < BOUND
    # a verify step: 3 queries a sequence (one tile of 4 tokens, their union split over programs)
    q, ks, vs, k, v, pos, blocks, bs, scale = _operands((2, 3, 300, 16, 2, 64, 32, 4), False, device, seed=6)
    assert _err(pa.block_attention(q, ks, vs, pos, scale, blocks, bs, sms=132),
                gather_block_attention(q, k, v, blocks, pos, bs, scale), v) < BOUND
    assert _err(pa.block_attention(q, ks, vs, pos, scale, sms=132), causal_attention(q, k, v, pos, scale), v) < BOUND


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_split_merge_of_a_query_that_reads_no_key(out_dtype, device):
    """Decode steps split over the keys: a query whose selection is empty (every slot -1) gets 0, whole or split
    (every split's weight is then 0), and the other sequences' queries are unaffected; more splits than the merge
    loads at once."""
    q, ks, vs, k, v, pos, blocks, bs, scale = _operands((3, 1, 300, 16, 2, 64, 32, 4), True, device, seed=9)
    blocks[1] = -1
    want = gather_block_attention(q, k, v, blocks, pos, bs, scale)
    for sms in (1, 132):
        got = pa.block_attention(q, ks, vs, pos, scale, blocks, bs, sms=sms, out_dtype=out_dtype)
        assert got.dtype == out_dtype and torch.equal(got[1], torch.zeros_like(got[1]))
        keep = [0, 2]
        assert _err(got[keep], want[keep], v) < (BOUND if out_dtype == torch.float32 else 2.0**-8)
    # dense over 301 keys in tiles of 16: 19 splits, merged in more than one load of splits
    assert pa.splits_for(3 * 2, 19, 1000) == 19 > pa.MERGE_CHUNK
    got = pa.block_attention(q, ks, vs, pos, scale, sms=1000, tiles=TILES["token"], out_dtype=out_dtype)
    assert _err(got, causal_attention(q, k, v, pos, scale), v) < (BOUND if out_dtype == torch.float32 else 2.0**-8)


@pytest.mark.gpu
@pytest.mark.skipif(INTERP or not AVAILABLE, reason="compiled Triton kernels")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_kernel_at_release_geometry(fp8):
    """G = 16, 128-channel heads, blocks of 128, top-16: 1,024 queries after 1,024 cached keys (every block
    selected); 1,001 queries after 7,191 (64 blocks, random selections: unions of most of them, the last tile
    ragged); a decode step."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for seed, geometry in ((1, (1, 1024, 1024, 64, 4, 128, 128, 16)), (3, (1, 1001, 7191, 64, 4, 128, 128, 16))):
        q, ks, vs, k, v, pos, blocks, bs, scale = _operands(geometry, fp8, "cuda", seed=seed)
        assert _err(pa.block_attention(q, ks, vs, pos, scale, blocks, bs, sms=sms),
                    gather_block_attention(q, k, v, blocks, pos, bs, scale), v) < BOUND
        assert _err(pa.block_attention(q, ks, vs, pos, scale, sms=sms),
                    causal_attention(q, k, v, pos, scale), v) < BOUND
    # a decode step of 32 sequences at 8K
    q, ks, vs, k, v, pos, blocks, bs, scale = _operands((32, 1, 8191, 64, 4, 128, 128, 16), fp8, "cuda", seed=2)
    assert _err(pa.block_attention(q, ks, vs, pos, scale, blocks, bs, sms=sms),
                gather_block_attention(q, k, v, blocks, pos, bs, scale), v) < BOUND
    assert _err(pa.block_attention(q, ks, vs, pos, scale, sms=sms), causal_attention(q, k, v, pos, scale), v) < BOUND


@pytest.mark.gpu
@pytest.mark.skipif(INTERP or not AVAILABLE, reason="compiled Triton kernels")
def test_memory_does_not_grow_with_the_context_at_131k():
    """2,048 queries at the end of a 16,384- and of a 131,072-slot fp8 cache: the kernel's peak memory is the same at
    both lengths (no [Q, K] scores: 68 GB at 131K; no gathered keys: 4.3 GB), and within its fp32 output, the int32
    copy of the selection and what the launch needs per program (Triton's scratch grows with the queries)."""
    T, Hq, Hkv, D, bs, kb = 2048, 64, 4, 128, 128, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out_bytes = T * Hq * D * 4
    peaks = {}
    for L in (16384, 131072):
        g = torch.Generator(device="cuda").manual_seed(7)
        q = torch.randn(1, T, Hq, D, device="cuda", generator=g).bfloat16()
        ks = torch.randn(1, L, Hkv, D, device="cuda", generator=g).to(torch.float8_e4m3fn)
        vs = torch.randn(1, L, Hkv, D, device="cuda", generator=g).to(torch.float8_e4m3fn)
        pos = torch.arange(L - T, L, device="cuda")[None]
        blocks = torch.randint(0, L // bs, (1, Hkv, T, kb), device="cuda", generator=g)
        blocks[..., 0] = (pos // bs)[:, None]
        for name, args in (("sparse", (blocks, bs)), ("dense", ())):
            pa.block_attention(q, ks, vs, pos, D**-0.5, *args, sms=sms)  # compiled before measuring
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            o = pa.block_attention(q, ks, vs, pos, D**-0.5, *args, sms=sms)
            torch.cuda.synchronize()
            peaks[name, L] = torch.cuda.max_memory_allocated() - base
            assert torch.isfinite(o).all()
            del o
    for name in ("sparse", "dense"):
        assert abs(peaks[name, 131072] - peaks[name, 16384]) <= 1 << 20, peaks
        assert peaks[name, 131072] <= 3 * out_bytes, peaks


def test_switches_and_presets():
    """Every preset prefills through the kernel; decode steps only in `compiled`; unknown values are refused."""
    from minimax_ref.errors import ConfigError

    assert {FastPaths.of(m).prefill_attention for m in (True, "compile", "fused", "compiled")} == {"triton"}
    assert FastPaths.of(False).prefill_attention == FastPaths.of(False).decode_attention == "reference"
    assert FastPaths.of("compiled").decode_attention == "triton"
    assert {FastPaths.of(m).decode_attention for m in (True, "compile", "fused")} == {"reference"}
    with pytest.raises(ConfigError, match="prefill_attention='flex': choose one of"):
        FastPaths(prefill_attention="flex")
    with pytest.raises(ConfigError, match="decode_attention='dense': choose one of"):
        FastPaths(decode_attention="dense")
    # the probabilities: two bf16 parts by default; one in `compiled` (and the presets made from it)
    assert {FastPaths.of(m).attention_probabilities for m in (True, "compile", "fused", "split-probabilities")} == {
        "split"}
    assert {FastPaths.of(m).attention_probabilities for m in ("compiled", "prefill-experts", "gemv")} == {"bf16"}
    with pytest.raises(ConfigError, match="attention_probabilities='fp8': choose one of"):
        FastPaths(attention_probabilities="fp8")


def test_prefill_benchmark_dry_run(capsys, monkeypatch):
    """benchmarks/prefill.py on CPU (tiny preset): every variant runs and is compared with the reference."""
    from test_packed import _bench

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = _bench("prefill.py", ["--device", "cpu", "--preset", "tiny", "--layers", "0", "--experts", "0",
                                "--prompt-len", "80", "--variants", "reference,gathering,on", "--repeats", "1",
                                "--skip-transformers"], capsys)
    assert out["systems"]["on"]["fast_paths"]["prefill_attention"] == "triton"
    assert out["systems"]["gathering"]["fast_paths"]["prefill_attention"] == "reference"
    assert all(out["agreement"][f"{v}_vs_reference"]["argmax_equal"] for v in ("gathering", "on"))
    assert {"gathering_over_reference", "on_over_reference"} <= set(out["speedups"])


def test_where_the_kernel_runs():
    """bf16 models with bf16 or fp8 storage only; fp32 models keep the gathering path; a CPU only under the
    interpreter, CUDA only compiled."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    fp8 = torch.float8_e4m3fn
    assert not pa.handles(cpu if INTERP else cuda, torch.float32, torch.float32, 128)
    assert not pa.handles(cpu if INTERP else cuda, torch.bfloat16, torch.float32, 128)
    assert not pa.handles(cpu if INTERP else cuda, torch.bfloat16, torch.bfloat16, 512)
    assert pa.handles(cpu, torch.bfloat16, fp8, 128) == INTERP
    assert pa.handles(cuda, torch.bfloat16, fp8, 128) == (AVAILABLE and not INTERP)


@pytest.mark.parametrize("device", DEVICES)
def test_model_prefill_takes_the_kernel(tiny_nvfp4, device, monkeypatch):
    """A bf16 model with the `on` preset: prompts longer than `sync_free_tokens` prefill through the kernel (every
    layer), and its logits match the same preset with the gathering path, which computes the same function."""
    from minimax_ref.weights.loader import load_model

    model = load_model(tiny_nvfp4, dtype=torch.bfloat16, weights="packed", device=device)
    ids = torch.randint(0, 1000, (2, 90), generator=torch.Generator().manual_seed(4)).to(device)
    pos = torch.stack([torch.arange(90), torch.arange(90) + 5]).to(device)

    def run() -> torch.Tensor:
        with torch.no_grad():
            cache = model.new_cache(2, 128, "fp8")
            first = model(ids[:, :70], positions=pos[:, :70], cache=cache)
            return torch.cat([first, model(ids[:, 70:], positions=pos[:, 70:], cache=cache)], dim=1)

    apply(model, replace(FastPaths.of(True), prefill_attention="reference"))
    want = run()
    calls = []
    original = pa.block_attention
    monkeypatch.setattr(pa, "block_attention", lambda *a, **kw: calls.append(a[1].dtype) or original(*a, **kw))
    apply(model, True)
    got = run()
    # the 70-token call (cache length 75), its fp8 keys widened to bf16 once where `widening_pays`; the 20-token one
    # is a decode-sized call
    from minimax_ref.fast.attention import widening_pays

    def widened(attn) -> bool:
        sparse_keys = attn.geometry.topk_blocks * attn.geometry.block_size if attn.sparse else None
        return widening_pays(70, 75, attn.n_heads // attn.n_kv, sparse_keys, torch.device(device))

    prefill = [torch.bfloat16 if widened(layer.self_attn) else torch.float8_e4m3fn for layer in model.layers]
    assert torch.bfloat16 in prefill and calls == prefill
    _agree(got, want)
    calls.clear()
    apply(model, replace(FastPaths.of(True), decode_attention="triton"))
    got = run()
    # both calls; the decode-sized one reads the keys as stored
    assert calls == prefill + [torch.float8_e4m3fn] * len(model.layers)
    _agree(got, want)
    # the probabilities as one bf16 part reach every call; on this random model's near ties a few more tokens flip
    splits = []
    monkeypatch.setattr(pa, "block_attention",
                        lambda *a, **kw: splits.append(kw["split_probabilities"]) or original(*a, **kw))
    apply(model, replace(FastPaths.of(True), decode_attention="triton", attention_probabilities="bf16"))
    got = run()
    assert splits == [False] * (2 * len(model.layers))
    _agree(got, want, tokens=0.9)


def _agree(got: torch.Tensor, want: torch.Tensor, tokens: float = 0.95) -> None:
    """Logits of two bf16 runs whose attention differs by fp32 rounding (more than `tokens` of the argmaxes
    equal)."""
    # bf16 activations: an fp32-rounding difference in an attention output can round to another bf16 value, which
    # moves a logit by a bf16 step, or at a near tie flips a token's experts (a large change at that position)
    per_position = (got.float() - want.float()).abs().amax(-1) / want.float().abs().amax()
    assert per_position.median() < 1e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > tokens


@pytest.mark.gpu
@pytest.mark.skipif(INTERP or not AVAILABLE, reason="compiled Triton kernels")
def test_compiled_decode_steps_take_the_kernel(tiny_nvfp4):
    """`compiled` on CUDA: decode steps in compiled layers replayed from CUDA graphs attend through the kernel and
    generate the tokens of the same preset with the compiled gathering path. Both with the probabilities' two-part
    sum (2^-17 of the fp32 gathering path): the preset's one bf16 part (2^-9, bounded in
    `test_probabilities_as_one_bf16_part`) flips near-tied greedy tokens of a random tiny model, and each flip
    changes every later token of its sequence."""
    from minimax_ref.generation.decoding import generate_ids
    from minimax_ref.generation.sampling import SamplingParams
    from minimax_ref.weights.loader import load_model

    model = load_model(tiny_nvfp4, dtype=torch.bfloat16, weights="packed", device="cuda", kv_cache_dtype="fp8")
    prompts = [list(range(3, 90)), list(range(5, 40))]
    greedy = SamplingParams(temperature=0)
    compiled = replace(FastPaths.of("compiled"), attention_probabilities="split")
    apply(model, replace(compiled, decode_attention="reference"))
    want = [s.generated for s in generate_ids(model, prompts, max_new_tokens=12, sampling=greedy)[0]]
    apply(model, compiled)
    assert model.fast.decode_attention == "triton"
    got = [s.generated for s in generate_ids(model, prompts, max_new_tokens=12, sampling=greedy)[0]]
    assert model.captured is not None and model.captured.graphs
    agree = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    assert agree >= 0.9 * sum(len(w) for w in want)
