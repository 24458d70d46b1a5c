"""Prefill attention as block-sparse flex_attention (`FastPaths(prefill_attention="flex")`, issue 26).

Contract under test (`fast.msa_prefill`): `FlexPrefill.msa` computes `msa.msa_attention` (same block ids; output
within fp32 rounding, 2e-6 of max |o|) and `FlexPrefill.causal` computes `attention.causal_attention`, for queries
at any positions over a longer cache. Checks:

* the cores against the reference on CPU through flex's unfused form (it applies `mask_mod` to every score, so this
  checks the mask rule): GQA ratios 1 to 16, block sizes 8 to 32, top-k 1 to 5, local and initial blocks, prompts
  that are not a multiple of the block, rows of a batch at different positions (right padding, a chunk after a
  cached prefix), query chunks;
* the BlockMask the fused kernel reads (its block lists, which the unfused form ignores): every key a query may read
  lies in a listed block, every full block (no mask applied there) is readable by every row of its query block,
  partial and full lists are disjoint, and with G = 16 each query block lists exactly its token's selected blocks;
* whole models: the tiny checkpoint with the switch equals the reference to fp32 rounding in a chunked, cached,
  batched prefill and gives its greedy tokens;
* on CUDA (`gpu`): the compiled Triton kernel at the release's geometry (G = 16, 128-channel heads, blocks of 128,
  top-16), in fp32 ("ieee", 5e-6: the GPU's exp2 is approximate) and "tf32x3" (2e-5); its peak memory over 32K
  keys (linear operands only); the tiny model through it.

The fused kernel is compiled only on CUDA: torch 2.13's CPU flex template fails to build these masks, so on CPU the
switch keeps the gathering path unless the model's `FlexPrefill(unfused_on_cpu=True)` (tests) says otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch

from minimax_ref.attention import causal_attention
from minimax_ref.errors import ConfigError
from minimax_ref.fast import FastPaths, apply
from minimax_ref.fast.msa_prefill import FlexPrefill, block_mask, causal_blocks, selected
from minimax_ref.generate import SamplingParams, generate_ids
from minimax_ref.loader import load_model
from minimax_ref.msa import msa_attention

UNFUSED = FlexPrefill(unfused_on_cpu=True)
FLEX = FastPaths(decode="fast", moe=True, static_kv=True, sdpa=True, prefill_attention="flex")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _operands(B, T, L, Hq, Hkv, D, Di=16, seed=0, device="cpu"):
    """Queries of T tokens at positions ending at L - 1 (row 1: `shift` earlier, as a shorter right-padded row)
    over L cached keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hq, D, generator=g)
    k, v = torch.randn(B, L, Hkv, D, generator=g), torch.randn(B, L, Hkv, D, generator=g)
    iq, ik = torch.randn(B, T, Hkv, Di, generator=g), torch.randn(B, L, Di, generator=g)
    shift = min(7, L - T)
    pos = torch.stack([torch.arange(L - T, L) - (shift if b else 0) for b in range(B)])
    return [t.to(device) for t in (q, k, v, iq, ik, pos)]


# B, T, L, Hq, Hkv, D, block, top-k, local, init, chunk elements
GEOMETRIES = [
    (2, 50, 130, 8, 2, 32, 16, 3, 1, 0, 1 << 12),    # tiny's G = 4, a cache longer than the chunk, 3 query chunks
    (1, 37, 200, 16, 1, 32, 8, 5, 1, 0, 1 << 20),    # G = 16: one token per query block; L not a multiple of 8
    (2, 64, 64, 4, 4, 16, 16, 2, 1, 0, 1 << 20),     # G = 1 (no GQA), a whole prompt from position 0
    (2, 45, 181, 6, 2, 16, 32, 1, 2, 1, 1 << 11),    # G = 3 (rows lcm(3, 16) = 48), two local + one initial block
    (1, 90, 90, 32, 2, 16, 8, 4, 1, 0, 1 << 20),     # G = 16, a prompt of 90 (not a multiple of 8) from 0
    (1, 60, 300, 8, 2, 16, 16, 2, 1, 0, 1 << 8),     # 10 kernel calls of 6 queries, each 6 selection chunks
]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "B{}-T{}-L{}-H{}/{}-D{}-bs{}-k{}-loc{}-init{}-c{}"
                         .format(*g))
def test_flex_msa_equals_reference(geometry):
    B, T, L, Hq, Hkv, D, bs, topk, local, init, chunk = geometry
    q, k, v, iq, ik, pos = _operands(B, T, L, Hq, Hkv, D)
    want, want_blocks = msa_attention(q, k, v, iq, ik, pos, D**-0.5, bs, topk, local, init)
    got, blocks = UNFUSED.msa(q, k, v, iq, ik, pos, D**-0.5, bs, topk, local, init, chunk)
    assert torch.equal(blocks, want_blocks)
    assert (want_blocks >= 0).sum(-1).min() < -(-L // bs)  # the selection leaves blocks out: sparsity engages
    assert got.dtype == torch.float32 and _rel(got, want) < 2e-6


@pytest.mark.parametrize("geometry", GEOMETRIES[:3], ids=["G4", "G16", "G1"])
def test_flex_causal_equals_reference(geometry):
    B, T, L, Hq, Hkv, D, *_, chunk = geometry
    q, k, v, _, _, pos = _operands(B, T, L, Hq, Hkv, D)
    got = UNFUSED.causal(q, k, v, pos, D**-0.5, chunk)
    assert _rel(got, causal_attention(q, k, v, pos, D**-0.5)) < 2e-6


def _listed(num: torch.Tensor, ids: torch.Tensor, nb: int) -> torch.Tensor:
    """A BlockMask's list (counts [B, H, nq], ids [B, H, nq, *]) as a bool [B, H, nq, nb]."""
    out = torch.zeros(*num.shape, nb + 1, dtype=torch.bool)
    used = torch.arange(ids.shape[-1]) < num[..., None]
    return out.scatter_(-1, torch.where(used, ids, nb).long(), True)[..., :nb]


@pytest.mark.parametrize("G, bs, topk", [(16, 16, 3), (4, 16, 4), (3, 8, 2)])
def test_block_mask_lists_what_the_kernel_reads(G, bs, topk):
    B, T, L, Hkv = 2, 40, 150, 2
    q, k, v, iq, ik, pos = _operands(B, T, L, Hkv * G, Hkv, 16)
    _, blocks = msa_attention(q, k, v, iq, ik, pos, 0.25, bs, topk, 1, 0)
    nb = -(-L // bs)
    rows = math.lcm(G, 16)  # as FlexPrefill.msa
    per = rows // G
    T_pad = -(-T // per) * per
    sel = selected(blocks, nb)
    sel = torch.cat([sel, sel[:, :, -1:].expand(-1, -1, T_pad - T, -1)], 2)  # as FlexPrefill pads: the last token
    pos = torch.cat([pos, pos[:, -1:].expand(-1, T_pad - T)], 1)
    mask = block_mask(sel, pos, L, bs, G, rows, None)
    assert mask.BLOCK_SIZE == (rows, bs) and mask.seq_lengths == (T_pad * G, L)
    partial = _listed(mask.kv_num_blocks, mask.kv_indices, nb)
    full = _listed(mask.full_kv_num_blocks, mask.full_kv_indices, nb)
    j = torch.arange(nb)
    readable = sel & (j * bs <= pos[:, None, :, None])  # [B, H, T, nb]: the token reads some key of block j
    whole = sel & ((j + 1) * bs - 1 <= pos[:, None, :, None])  # it reads every key of block j
    by_block = (B, Hkv, T_pad // per, per, nb)
    assert not (partial & full).any()
    assert not (readable.view(by_block).any(3) & ~(partial | full)).any()  # nothing readable is left out
    assert not (full & ~whole.view(by_block).all(3)).any()  # a full block needs no mask for any of its rows
    if per == 1:  # one token per query block: exactly its selection, nothing from neighbours
        assert torch.equal(partial | full, readable)


def test_block_lists_alone_give_msa_through_a_fused_kernel():
    """With one token per query block (G = 16) the block lists are exactly the selection: flex's fused CPU kernel,
    which visits only listed blocks, with a mask_mod that checks causality alone, computes MSA. (The fused CPU kernel
    builds this simpler mask_mod; the engine's, which also reads the selection, is CUDA's.)"""
    from torch.nn.attention.flex_attention import flex_attention

    from minimax_ref.fast.msa_prefill import fold, unfold

    B, T, L, Hq, Hkv, D, bs = 2, 40, 150, 32, 2, 16, 16
    q, k, v, iq, ik, pos = _operands(B, T, L, Hq, Hkv, D)
    want, blocks = msa_attention(q, k, v, iq, ik, pos, D**-0.5, bs, 3, 1, 0)
    mask = block_mask(selected(blocks, -(-L // bs)), pos, L, bs, 16, 16, lambda b, h, r, n: n <= pos[b, r // 16])
    kf, vf = (x.transpose(1, 2).contiguous() for x in (k, v))
    got = torch.compile(flex_attention, dynamic=False)(fold(q, Hkv), kf, vf, block_mask=mask, scale=D**-0.5)
    assert _rel(unfold(got, T), want) < 2e-6


@pytest.fixture(scope="module")
def tiny(ckpt_factory):
    return ckpt_factory("tiny", "nvfp4")


def test_fast_model_with_flex_prefill_equals_reference(tiny, monkeypatch):
    """A batched prefill in two cached chunks of more than `sync_free_tokens` (64) tokens, the second at different
    positions per row, then decode steps; the tiny model's MSA layers select 4 of up to 9 blocks of 16."""
    model = load_model(tiny, dtype=torch.float32, weights="packed")
    ids = torch.randint(0, 1000, (2, 150), generator=torch.Generator().manual_seed(1))

    def run() -> torch.Tensor:
        with torch.no_grad():
            cache = model.new_cache(2, 160)
            out = [model(ids[:, :70], positions=torch.arange(70).expand(2, -1), cache=cache)]
            pos = torch.stack([torch.arange(70, 140), torch.arange(66, 136)])
            out.append(model(ids[:, 70:140], positions=pos, cache=cache))
            for t in range(3):
                out.append(model(ids[:, 140 + t:141 + t], positions=pos[:, -1:] + 1 + t, cache=cache))
        return torch.cat(out, dim=1)

    prompts = [ids[0, :100].tolist(), ids[1, :80].tolist()]
    greedy = SamplingParams(temperature=0)
    want = run()
    want_tokens = [s.generated for s in generate_ids(model, prompts, max_new_tokens=5, sampling=greedy)[0]]
    calls = []
    for name in ("msa", "causal"):
        original = getattr(FlexPrefill, name)
        monkeypatch.setattr(FlexPrefill, name, lambda self, *a, _f=original, _n=name, **kw: calls.append(_n)
                            or _f(self, *a, **kw))
    model.prefill_kernels = UNFUSED
    apply(model, FLEX)
    got = run()
    assert sorted(set(calls)) == ["causal", "msa"] and len(calls) == 2 * len(model.layers)  # prefill chunks only
    assert _rel(got, want) < 1e-5
    assert [s.generated for s in generate_ids(model, prompts, max_new_tokens=5, sampling=greedy)[0]] == want_tokens
    apply(model, False)
    assert "prefill_kernels" not in vars(model.layers[0].self_attn)


def test_switch_values_presets_and_cpu_fallback(tiny):
    """No preset turns flex on (opt-in: every preset prefills with the Triton kernel); unknown values are refused. On
    CPU, without the test-only unfused form, the switch keeps the gathering path (bit-identical to the same paths
    without it)."""
    assert {FastPaths.of(m).prefill_attention for m in (True, "compile", "fused", "compiled")} == {"triton"}
    assert FastPaths.of(False).prefill_attention == "reference"
    with pytest.raises(ConfigError, match="prefill_attention='dense': choose one of"):
        FastPaths(prefill_attention="dense")
    assert not FlexPrefill().handles(torch.device("cpu")) and FlexPrefill().handles(torch.device("cuda"))
    with pytest.raises(ValueError, match="precision 'tf32'"):
        FlexPrefill.kernel_options(16, 128, "tf32")
    assert FlexPrefill.kernel_options(16, 128, "ieee") == {"FLOAT32_PRECISION": "'ieee'", "BLOCK_M": 16}
    assert FlexPrefill.kernel_options(48, 16, "tf32x3")["BLOCK_N"] == 16
    model = load_model(tiny, dtype=torch.float32, weights="packed", fast=True)
    ids = torch.randint(0, 1000, (1, 80), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids)
        apply(model, FLEX)
        assert torch.equal(model(ids), want)


@pytest.mark.gpu
@pytest.mark.parametrize("precision, tol", [("ieee", 5e-6), ("tf32x3", 2e-5)])
def test_compiled_flex_on_cuda_equals_reference(precision, tol):
    """The compiled Triton kernel at the release's geometry: G = 16 (one token per query block), 128 channels, blocks
    of 128, top-16 of 18 blocks; a chunk of 700 queries after a cached prefix, rows at different positions."""
    B, T, L, Hq, Hkv, D, bs = 2, 700, 2200, 32, 2, 128, 128
    q, k, v, iq, ik, pos = _operands(B, T, L, Hq, Hkv, D, Di=128, device="cuda")
    flex = FlexPrefill()
    want, want_blocks = msa_attention(q, k, v, iq, ik, pos, D**-0.5, bs, 16, 1, 0)
    got, blocks = flex.msa(q, k, v, iq, ik, pos, D**-0.5, bs, 16, 1, 0, 1 << 22, precision)
    assert torch.equal(blocks, want_blocks) and _rel(got, want) < tol
    got = flex.causal(q, k, v, pos, D**-0.5, 1 << 22, precision)
    assert _rel(got, causal_attention(q, k, v, pos, D**-0.5)) < tol
    # bf16 operands (a bf16 model's cache), read in fp32 by both
    kb, vb = k.bfloat16(), v.bfloat16()
    want, _ = msa_attention(q.bfloat16(), kb, vb, iq, ik, pos, D**-0.5, bs, 16, 1, 0)
    got, _ = flex.msa(q.bfloat16(), kb, vb, iq, ik, pos, D**-0.5, bs, 16, 1, 0, 1 << 22, precision)
    assert _rel(got, want) < tol


def test_benchmark_dry_run(capsys, monkeypatch):
    """benchmarks/prefill.py on CPU (tiny preset, flex's unfused form): every system runs and is compared."""
    from test_packed import _bench

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = _bench("prefill.py", ["--device", "cpu", "--preset", "tiny", "--layers", "0", "--experts", "0",
                                "--prompt-len", "80", "--variants", "reference,flex", "--repeats", "1"], capsys)
    assert out["model"]["flex_form"] == "unfused (CPU)" and out["systems"]["flex"]["tokens_per_s"] > 0
    assert out["systems"]["flex"]["fast_paths"]["prefill_attention"] == "flex"
    assert out["agreement"]["flex_vs_reference"]["argmax_equal"]
    assert {"flex_over_reference", "flex_over_transformers"} <= set(out["speedups"])


@pytest.mark.gpu
def test_compiled_flex_memory_is_linear_on_cuda():
    """8,192 queries at the release's widths over 32,768 cached keys: the call's peak is a few of its linear
    operands (fp32 queries and output 256 MiB each, keys and values 64 MiB each, index-score chunks), far below one
    [Q, K] score tensor (64 GiB)."""
    B, T, L, Hq, Hkv, D, bs = 1, 8192, 32768, 64, 4, 128, 128
    q, k, v, iq, ik, pos = (t.bfloat16() if t.is_floating_point() else t
                            for t in _operands(B, T, L, Hq, Hkv, D, Di=128, device="cuda"))
    flex = FlexPrefill()
    flex.msa(q[:, :256], k, v, iq[:, :256], ik, pos[:, :256], D**-0.5, bs, 16, 1, 0, 1 << 24)  # compiles
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o, _ = flex.msa(q, k, v, iq, ik, pos, D**-0.5, bs, 16, 1, 0, 1 << 24)
    torch.cuda.synchronize()
    assert o.shape == (B, T, Hq, D) and torch.isfinite(o).all()
    assert torch.cuda.max_memory_allocated() - base < 2 << 30


@pytest.mark.gpu
def test_fast_model_with_compiled_flex_equals_reference_on_cuda(tiny):
    """The tiny model on CUDA, fp32: prefill through the compiled kernel (G = 4: four tokens per query block, the
    union of their selections listed and `mask_mod` applying each token's), same logits to fp32 rounding, same
    greedy tokens."""
    model = load_model(tiny, dtype=torch.float32, weights="packed", device="cuda")
    ids = torch.randint(0, 1000, (2, 150), generator=torch.Generator().manual_seed(1)).cuda()
    prompts = [ids[0, :140].tolist(), ids[1, :90].tolist()]
    greedy = SamplingParams(temperature=0)
    with torch.no_grad():
        want = model(ids)
    want_tokens = [s.generated for s in generate_ids(model, prompts, max_new_tokens=5, sampling=greedy)[0]]
    apply(model, FLEX)
    with torch.no_grad():
        assert _rel(model(ids), want) < 1e-5
    assert [s.generated for s in generate_ids(model, prompts, max_new_tokens=5, sampling=greedy)[0]] == want_tokens


def test_causal_blocks_are_every_block_up_to_the_query():
    sel = causal_blocks(torch.tensor([[0, 15, 16, 40]]), 4, 16)
    assert sel.shape == (1, 1, 4, 4)
    assert sel[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
