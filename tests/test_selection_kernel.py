"""The MSA selection kernel (`fast.selection_kernel`; `FastPaths(block_selection="triton")`, the non-user preset
`selection`).

Contract under test: `block_scores` computes `msa.block_scores(msa.index_scores(iq, ik, q_pos), ...)` for bf16 index
queries over index keys as the model holds them (bf16) or an fp8 cache stores them (read as `LayerCache.load` reads
them), within the order of the fp32 sums: each finite block score within 3.1 Di u (u = 2^-24) of the block's largest
sum_d |iq_d ik_d| over its causal keys, -inf (no causal key) and +inf (forced blocks) exactly where the reference has
them. The selection (`fast.attention.select_blocks_kernel`: torch's top-k of those scores) equals the reference's
(`msa.select_blocks_chunked`) up to ties within that bound: the same empty slots, every selected block's reference score
at least the k-th largest minus twice the bound, the same set where the k-th and (k+1)-th reference scores are further
apart, the same order where all of the top k+1 are. Geometries: several index heads, queries not a multiple of the
tile, keys not a multiple of the block, queries after cached keys (chunked prefill), two sequences at different
positions, blocks wholly in the future, scattered positions within a tile, init_blocks > 0, local_blocks > 1, block
sizes and index widths that are not powers of two, blocks read as several key tiles, fp8 index keys with a scale.

The kernel runs in Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1 python -m pytest -q
tests/test_selection_kernel.py`; skipped otherwise) and compiled on CUDA (`-m gpu`). A model test checks that a bf16
model's prefill selects through the kernel on every MSA layer and equals the reference selection.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from minimax_ref.errors import ConfigError
from minimax_ref.fast import FastPaths, apply
from minimax_ref.fast import selection_kernel as sk
from minimax_ref.fast.attention import select_blocks_kernel
from minimax_ref.fast.grouped import AVAILABLE, interpreting
from minimax_ref.model.cache import store_kv
from minimax_ref.model.msa import block_scores, index_scores, select_blocks_chunked

INTERP = AVAILABLE and interpreting()
interp = pytest.mark.skipif(not INTERP, reason="run with TRITON_INTERPRET=1 (Triton's interpreter on CPU tensors)")
gpu = [pytest.mark.gpu, pytest.mark.skipif(INTERP or not AVAILABLE, reason="compiled Triton kernels")]
DEVICES = [pytest.param("cpu", marks=interp), pytest.param("cuda", marks=gpu)]
U = 2.0**-24

# (batch, queries, cached keys before them, index heads, index dim, block size, top-k, local blocks, init blocks)
GEOMETRIES = {
    # 4 heads, 37 queries (not a multiple of a tile), 37 keys (not a multiple of a block); no forced block, so the
    # causal mask decides each query's own block (a forced block hides it)
    "heads": (1, 37, 0, 4, 32, 16, 4, 0, 0),
    # chunked prefill: 40 queries after 75 cached keys, the second sequence 9 positions earlier
    "chunked": (2, 40, 75, 2, 32, 16, 3, 1, 0),
    # blocks of 10 (one key tile of 16, partly past the block), 24 channels, two local and two initial blocks forced
    "forced": (2, 30, 100, 3, 24, 10, 5, 2, 2),
    # blocks of 32 (two key tiles of 16 with the small tiles), 64 channels, 11 blocks, three local and one initial
    "wide": (1, 50, 300, 2, 64, 32, 4, 3, 1),
}
TILES = {"default": None, "small": sk.Tiles(16, 16, 4, 1)}


def _operands(geometry: tuple, device: str, seed: int = 0, variant: str = ""):
    """Random operands; variant "scattered": random positions, "negative": every index score negative (a key slot
    that is not the block's, read as 0, would win the max)."""
    B, T, L0, Hi, Di, bs, kb, local, init = geometry
    g = torch.Generator().manual_seed(seed)
    L = L0 + T
    iq = torch.randn(B, T, Hi, Di, generator=g)
    ik = 2 * torch.randn(B, L, Di, generator=g)
    if variant == "negative":
        iq, ik = iq.abs(), -ik.abs()
    iq, ik = iq.bfloat16(), ik.bfloat16()
    if variant == "scattered":  # each query anywhere in the context: a tile's rows far apart
        pos = torch.randint(0, L, (B, T), generator=g)
    else:  # the second sequence's queries sit 9 positions earlier: its last cached keys are future keys
        pos = torch.stack([L0 + torch.arange(T) - 9 * (b % 2) for b in range(B)]).clamp(min=0)
    return iq.to(device), ik.to(device), pos.to(device), bs, kb, local, init


def _bound(iq: torch.Tensor, ik: torch.Tensor, pos: torch.Tensor, bs: int) -> torch.Tensor:
    """The contract's bound per block score: 3.1 Di u times the block's largest sum_d |iq_d ik_d| over its causal keys
    (0 where it has none)."""
    a = block_scores(index_scores(iq.abs(), ik.abs(), pos), pos, bs, local_blocks=0)
    return (3.1 * iq.shape[-1] * U * a).clamp(min=0)


def _check_scores(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    finite = torch.isfinite(want)
    assert torch.equal(got[~finite], want[~finite]) and torch.isfinite(got[finite]).all()
    assert ((got - want).abs()[finite] <= bound[finite]).all(), float(((got - want).abs() - bound)[finite].max())
    assert (want == float("-inf")).any()  # blocks wholly in the future occur


def _check_selection(ids: torch.Tensor, want_ids: torch.Tensor, want: torch.Tensor, got: torch.Tensor,
                     bound: torch.Tensor) -> float:
    """`ids` (from the kernel's scores `got`) against the reference's `want_ids` (from its scores `want`), up to ties
    within `bound`. Returns the share of rows whose ids equal the reference's exactly."""
    assert ids.shape == want_ids.shape and ids.dtype == want_ids.dtype
    k, nb = ids.shape[-1], want.shape[-1]
    valid = ids >= 0
    assert torch.equal(valid, want_ids >= 0)  # the same empty slots (left-packed)
    e = bound.amax(-1, keepdim=True)  # the largest bound of the row
    ranked = want.topk(min(k + 1, nb), dim=-1).values
    kth = ranked[..., k - 1:k]
    ref_at = want.gather(-1, ids.clamp(min=0))
    assert (ref_at[valid] > float("-inf")).all()
    assert ((ref_at >= kth - 2 * e) | ~valid).all()  # every selected block is in the top k up to ties
    # descending by the kernel's own scores
    mine = got.gather(-1, ids.clamp(min=0)).masked_fill(~valid, float("-inf"))
    assert (mine[..., :-1] >= mine[..., 1:]).all()
    # the same set where the k-th and (k+1)-th reference scores are apart, the same order where all the top k+1 are
    if nb > k:
        apart = (kth - ranked[..., k:k + 1] > 2 * e)[..., 0]
        assert torch.equal(ids.sort(-1).values[apart], want_ids.sort(-1).values[apart])
        ordered = ((ranked[..., :-1] - ranked[..., 1:]) > 2 * e).all(-1)
        assert torch.equal(ids[ordered], want_ids[ordered])
    else:
        assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    return float((ids == want_ids).all(-1).float().mean())


CASES = [(name, tiles, "") for name in sorted(GEOMETRIES) for tiles in sorted(TILES)]
CASES += [("chunked", "small", "scattered"), ("forced", "default", "scattered"), ("heads", "small", "scattered"),
          ("forced", "default", "negative"), ("wide", "small", "negative")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "tiles", "variant"), CASES, ids=["-".join(filter(None, case)) for case in CASES])
def test_block_scores_and_selection_equal_the_reference(name, tiles, variant, device):
    iq, ik, pos, bs, kb, local, init = _operands(GEOMETRIES[name], device, seed=len(name), variant=variant)
    want = block_scores(index_scores(iq, ik, pos), pos, bs, local, init)
    bound = _bound(iq, ik, pos, bs)
    got = sk.block_scores(iq, ik, pos, bs, local, init, tiles=TILES[tiles])
    _check_scores(got, want, bound)
    assert (want == float("inf")).any() == (local + init > 0)
    want_ids = select_blocks_chunked(iq, ik, pos, bs, kb, local, init, chunk=7)
    # in chunks of 16 queries (and the last chunk ragged) and whole
    for chunk in (16, iq.shape[1]):
        ids = select_blocks_kernel(iq, ik, pos, bs, kb, local, init, chunk)
        assert _check_selection(ids, want_ids, want, got, bound) > 0.9


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_fp8_index_keys_read_as_the_cache_loads_them(scale, device):
    """Index keys stored as float8_e4m3fn with a scale: the kernel reads them as `LayerCache.load` does,
    bf16(fp32(e4m3) * scale), so its scores are the reference's on the loaded keys."""
    iq, ik, pos, bs, kb, local, init = _operands(GEOMETRIES["chunked"], device, seed=5)
    stored = store_kv(ik, torch.float8_e4m3fn, scale)
    loaded = (stored.float() * scale).to(torch.bfloat16)
    want = block_scores(index_scores(iq, loaded, pos), pos, bs, local, init)
    bound = _bound(iq, loaded, pos, bs)
    got = sk.block_scores(iq, stored, pos, bs, local, init, ik_scale=scale, tiles=TILES["small"])
    _check_scores(got, want, bound)
    if scale == 1.0:  # the selection takes stored keys at the cache's unit scale
        ids = select_blocks_kernel(iq, stored, pos, bs, kb, local, init, 64)
        _check_selection(ids, select_blocks_chunked(iq, loaded, pos, bs, kb, local, init, 64), want, got, bound)


# few query rows (the decode grid): (batch, queries, cached keys, index heads, index dim, block size, top-k, local,
# init) with each sequence at a position of its own (`_decode_operands`)
DECODE_GEOMETRIES = {
    # a decode step of 4 heads over 3 sequences, 13 blocks of 16, the last ragged
    "step": (3, 1, 200, 4, 32, 16, 4, 1, 0),
    # speculative verification: 8 queries of 4 heads (32 rows), blocks of 10 read as one tile of 16, forced blocks
    "verify": (2, 8, 150, 4, 24, 10, 5, 2, 2),
    # 9 rows (3 queries of 3 heads: not a power of two), blocks of 32 read as two tiles of 16 with 64 channels
    "rows": (2, 3, 300, 3, 64, 32, 4, 1, 1),
}


def _decode_operands(geometry: tuple, device: str, seed: int):
    """Random operands for a few-row call: sequence b's T queries end at a position of its own, the first near the
    end of the cache, the others far before it (blocks after every row's position unread: -inf)."""
    B, T, L0, Hi, Di, bs, kb, local, init = geometry
    g = torch.Generator().manual_seed(seed)
    L = L0 + T
    iq = torch.randn(B, T, Hi, Di, generator=g).bfloat16()
    ik = (2 * torch.randn(B, L, Di, generator=g)).bfloat16()
    ends = [L - 1] + [int(x) for x in torch.randint(T + 2 * bs, L - bs, (B - 1,), generator=g)]
    pos = torch.stack([torch.arange(e - T + 1, e + 1) for e in ends])
    return iq.to(device), ik.to(device), pos.to(device), bs, kb, local, init


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sms", [1, 1000], ids=["long-runs", "a-block-a-program"])
@pytest.mark.parametrize("name", sorted(DECODE_GEOMETRIES))
def test_decode_grid_equals_the_reference(name, sms, device):
    """Calls of few query rows take the decode grid (a program a sequence and run of blocks): the same contract as
    the prefill grid, whether a program's run is many blocks (1 SM) or one (many SMs)."""
    iq, ik, pos, bs, kb, local, init = _decode_operands(DECODE_GEOMETRIES[name], device, seed=len(name))
    assert iq.shape[1] * iq.shape[2] <= sk.DECODE_ROWS
    want = block_scores(index_scores(iq, ik, pos), pos, bs, local, init)
    bound = _bound(iq, ik, pos, bs)
    got = sk.block_scores(iq, ik, pos, bs, local, init, sms=sms)
    _check_scores(got, want, bound)
    ids = select_blocks_kernel(iq, ik, pos, bs, kb, local, init, iq.shape[1], sms=sms)
    assert _check_selection(ids, select_blocks_chunked(iq, ik, pos, bs, kb, local, init, 4), want, got, bound) > 0.9


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_decode_grid_reads_fp8_index_keys_as_the_cache_loads_them(scale, device):
    iq, ik, pos, bs, kb, local, init = _decode_operands(DECODE_GEOMETRIES["verify"], device, seed=3)
    stored = store_kv(ik, torch.float8_e4m3fn, scale)
    loaded = (stored.float() * scale).to(torch.bfloat16)
    want = block_scores(index_scores(iq, loaded, pos), pos, bs, local, init)
    bound = _bound(iq, loaded, pos, bs)
    got = sk.block_scores(iq, stored, pos, bs, local, init, ik_scale=scale, sms=4)
    _check_scores(got, want, bound)
    ids = select_blocks_kernel(iq, stored, pos, bs, kb, local, init, 8, ik_scale=scale, sms=4)
    _check_selection(ids, select_blocks_chunked(iq, loaded, pos, bs, kb, local, init, 8), want, got, bound)


@pytest.mark.parametrize("device", DEVICES)
def test_model_decode_steps_read_the_stored_index_keys(tiny_nvfp4, device, monkeypatch):
    """Decode steps of a bf16 model with an fp8 cache and the `on` preset: each MSA layer's selection takes the
    cache's fp8 index keys as stored (no loaded copy) through the decode grid, and the greedy tokens equal those
    of the same preset selecting by the reference path (the logits within the rounding of the index scores' sums,
    bit for bit where every selection is the same)."""
    from minimax_ref.weights.loader import load_model

    model = load_model(tiny_nvfp4, dtype=torch.bfloat16, weights="packed", device=device)
    sparse = [layer.self_attn for layer in model.layers if layer.self_attn.sparse]
    ids = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(6)).to(device)

    def run() -> torch.Tensor:
        with torch.no_grad():
            cache = model.new_cache(2, 64, "fp8")
            model(ids[:, :36], positions=torch.arange(36, device=device).expand(2, 36), cache=cache)
            return torch.cat([model(ids[:, t:t + 1], positions=torch.full((2, 1), t, device=device), cache=cache)
                              for t in range(36, 40)], dim=1)

    apply(model, replace(FastPaths.of(True), block_selection="reference"))
    want = run()
    dtypes = []
    original = sk.block_scores
    monkeypatch.setattr(sk, "block_scores", lambda *a, **kw: dtypes.append((a[0].shape[1], a[1].dtype))
                        or original(*a, **kw))
    apply(model, True)
    got = run()
    steps = [d for t, d in dtypes if t == 1]
    assert steps == [torch.float8_e4m3fn] * (4 * len(sparse))
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    scale = want.float().abs().amax()
    assert ((got.float() - want.float()).abs().amax(-1) / scale).median() < 1e-2


def test_tiles_and_switches():
    assert sk.Tiles.parse("64,32,4,3") == sk.Tiles(64, 32, 4, 3) and sk.Tiles(64, 32, 4, 3).text() == "64,32,4,3"
    with pytest.raises(ConfigError, match="queries=96: give a power of two"):
        sk.Tiles(96)
    with pytest.raises(ConfigError, match="keys=8"):
        sk.Tiles(keys=8)
    with pytest.raises(ConfigError, match="give QUERIES,KEYS,NUM_WARPS,NUM_STAGES"):
        sk.Tiles.parse("128,64")
    assert sk.tiles_for(torch.device("cpu")) == sk.DEFAULT
    # every preset but the reference selects through the kernel where it runs
    assert FastPaths.of("off").block_selection == "reference"
    for name in ("on", "compile", "fused", "compiled", "gemv"):
        assert FastPaths.of(name).block_selection == "triton"
    with pytest.raises(ConfigError, match=r"block_selection='cuda': choose one of \['reference', 'triton'\]"):
        FastPaths(block_selection="cuda")


def test_where_the_kernel_runs():
    """bf16 index queries, bf16 or fp8 index keys, at most 256 channels; a CPU only under the interpreter, CUDA only
    compiled."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    here = cpu if INTERP else cuda
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    assert not sk.handles(here, torch.float32, torch.float32, 128)
    assert not sk.handles(here, bf16, torch.float32, 128)
    assert not sk.handles(here, bf16, bf16, 512)
    assert sk.handles(cpu, bf16, fp8, 128) == INTERP
    assert sk.handles(cuda, bf16, bf16, 128) == (AVAILABLE and not INTERP)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_model_prefill_selects_through_the_kernel(tiny_nvfp4, kv_cache_dtype, device, monkeypatch):
    """A bf16 model with the `on` preset (which selects through the kernel): the 70-token prefill chunk of two
    sequences at different positions and the 20-token call after it (40 query rows of 2 index heads: the decode grid)
    select through the kernel on every MSA layer, each layer's ids equal the reference's selection of the same
    operands up to ties, and the logits equal those of the same preset selecting by the reference path (bit for bit
    where every selection is the same). The hooks get the index keys as the reference gives them (loaded)."""
    from minimax_ref.weights.loader import load_model

    model = load_model(tiny_nvfp4, dtype=torch.bfloat16, weights="packed", device=device)
    ids = torch.randint(0, 1000, (2, 90), generator=torch.Generator().manual_seed(4)).to(device)
    pos = torch.stack([torch.arange(90), torch.arange(90) + 5]).to(device)
    sparse = [layer.self_attn for layer in model.layers if layer.self_attn.sparse]
    assert sparse
    records: list = []
    for attn in sparse:
        attn.selection.register_forward_hook(lambda m, args, out: records.append((m.geometry, *args[:3], out)))

    def run() -> torch.Tensor:
        with torch.no_grad():
            cache = model.new_cache(2, 128, kv_cache_dtype)
            first = model(ids[:, :70], positions=pos[:, :70], cache=cache)
            return torch.cat([first, model(ids[:, 70:], positions=pos[:, 70:], cache=cache)], dim=1)

    apply(model, replace(FastPaths.of(True), block_selection="reference"))
    want = run()
    calls = []
    original = sk.block_scores
    monkeypatch.setattr(sk, "block_scores", lambda *a, **kw: calls.append(a[0].shape[1]) or original(*a, **kw))
    records.clear()
    apply(model, True)
    got = run()
    assert calls == [70] * len(sparse) + [20] * len(sparse)  # one chunk a layer and call
    assert len(records) == 2 * len(sparse) and all(r[2].dtype == torch.bfloat16 for r in records)
    same = True
    for geometry, iq, ik, q_pos, out in records:
        g = geometry
        ref = block_scores(index_scores(iq, ik, q_pos), q_pos, g.block_size, g.local_blocks, g.init_blocks)
        mine = sk.block_scores(iq, ik, q_pos, g.block_size, g.local_blocks, g.init_blocks)
        bound = _bound(iq, ik, q_pos, g.block_size)
        _check_scores(mine, ref, bound)
        want_ids = select_blocks_chunked(iq, ik, q_pos, g.block_size, g.topk_blocks, g.local_blocks, g.init_blocks,
                                         iq.shape[1])
        _check_selection(out, want_ids, ref, mine, bound)
        same &= torch.equal(out, want_ids)
    if same:
        assert torch.equal(got, want)
    else:  # a tie chose another block: that layer's attention differs, the logits stay close
        per_position = (got.float() - want.float()).abs().amax(-1) / want.float().abs().amax()
        assert per_position.median() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(INTERP or not AVAILABLE, reason="compiled Triton kernels")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-keys", "fp8-keys"])
def test_kernel_at_release_geometry(fp8):
    """4 index heads of 128 channels, blocks of 128, top-16: 2,000 queries after 6,000 cached keys (63 blocks, the
    last ragged), two sequences at different positions; bf16 or fp8 index keys."""
    B, T, L0, Hi, Di, bs, kb = 2, 2000, 6000, 4, 128, 128, 16
    iq, ik, pos, *_ = _operands((B, T, L0, Hi, Di, bs, kb, 1, 0), "cuda", seed=11)
    if fp8:
        stored = store_kv(ik, torch.float8_e4m3fn, 1.0)
        ik = stored.float().bfloat16()
    else:
        stored = ik
    want = block_scores(index_scores(iq, ik, pos), pos, bs)
    bound = _bound(iq, ik, pos, bs)
    got = sk.block_scores(iq, stored, pos, bs)
    _check_scores(got, want, bound)
    ids = select_blocks_kernel(iq, stored, pos, bs, kb, 1, 0, T)
    assert _check_selection(ids, select_blocks_chunked(iq, ik, pos, bs, kb, 1, 0, 256), want, got, bound) > 0.9


@pytest.mark.gpu
@pytest.mark.skipif(INTERP or not AVAILABLE, reason="compiled Triton kernels")
def test_memory_does_not_grow_with_queries_times_keys():
    """2,048 queries at the end of a 131,072-slot context: the selection's peak memory is its block scores and top-k
    (4 x 2,048 x 1,024 fp32: 32 MiB), not the reference's [Hi, T, L] index scores (4 GiB)."""
    T, L, Hi, Di, bs, kb = 2048, 131072, 4, 128, 128, 16
    g = torch.Generator(device="cuda").manual_seed(7)
    iq = torch.randn(1, T, Hi, Di, device="cuda", generator=g).bfloat16()
    ik = torch.randn(1, L, Di, device="cuda", generator=g).bfloat16()
    pos = torch.arange(L - T, L, device="cuda")[None]
    select_blocks_kernel(iq, ik, pos, bs, kb, 1, 0, T)  # compiled before measuring
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ids = select_blocks_kernel(iq, ik, pos, bs, kb, 1, 0, T)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert ids.shape == (1, Hi, T, kb) and (ids >= 0).all()
    assert peak <= 3 * Hi * T * (L // bs) * 4, peak


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_benchmark_without_cuda_says_so(capsys):
    from test_packed import _bench

    err = _bench("selection_kernel.py", ["--prompt-len", "256"], capsys, code=2)
    assert "selection_kernel.py measures a CUDA kernel: run it on a machine with a GPU" in err
