"""The text model against the independent transformers implementation, and its own invariants
(cache, batching, sparse vs dense, activation emulation, memory)."""

from __future__ import annotations

import pytest
import torch
from oracle import hf_text_model, relative_max_error

from minimax_ref.generation.generate import SamplingParams, generate_ids
from minimax_ref.research.trace import Trace
from minimax_ref.weights.loader import load_model

TOL = 1e-4  # spec: fp32 logits within 1e-4 of the oracle, relative to the logit scale


def _ids(n: int, vocab: int = 1000, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def nvfp4_model(tiny_nvfp4):
    return load_model(tiny_nvfp4, dtype=torch.float32)


@pytest.fixture(scope="module")
def nvfp4_oracle(nvfp4_model):
    return hf_text_model(nvfp4_model)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "nvfp4"])
def test_logits_match_transformers(ckpt_factory, fmt):
    model = load_model(ckpt_factory("tiny", fmt), dtype=torch.float32)
    hf = hf_text_model(model)
    # 40 tokens: within the 4 x 16-token block budget (sparse == dense); 150: well past it
    for n in (40, 150):
        ids = _ids(n, seed=n, batch=2)
        with torch.no_grad():
            err = relative_max_error(model(ids), hf(ids).logits)
        assert err < TOL, (fmt, n, err)


@pytest.mark.parametrize("experts", [128, 80])
def test_logits_match_transformers_expert_counts(ckpt_factory, experts):
    model = load_model(ckpt_factory("tiny", "nvfp4", experts=experts), dtype=torch.float32)
    assert model.layers[1].block_sparse_moe.experts.w1.shape[0] == experts
    hf = hf_text_model(model)
    ids = _ids(120, seed=3)
    with torch.no_grad():
        assert relative_max_error(model(ids), hf(ids).logits) < TOL


def test_release_msa_geometry_matches_transformers(ckpt_factory):
    """128-token blocks, top-16 blocks, a context past 16 * 128 = 2048 tokens."""
    path = ckpt_factory("tiny", "bf16", layers=2, overrides={
        "sparse_block_size": 128, "sparse_topk_blocks": 16, "num_local_experts": 8})
    model = load_model(path, dtype=torch.float32)
    assert model.text.sparse.block_size == 128 and model.text.sparse.topk_blocks == 16
    hf = hf_text_model(model)
    ids = _ids(2400, seed=5)
    trace = Trace(layers=set())
    with torch.no_grad():
        ours = model(ids, trace=trace)
        theirs = hf(ids).logits
    assert relative_max_error(ours, theirs) < TOL
    blocks = trace.blocks[1]  # [B, kv_heads, T, 16]
    assert blocks.shape[-1] == 16
    # queries in the last block see 19 causal blocks but select only 16
    assert int((blocks[0, :, -1] >= 0).sum(-1).min()) == 16


def test_sparse_attention_differs_from_dense_past_threshold(ckpt_factory):
    sparse = load_model(ckpt_factory("tiny", "bf16"), dtype=torch.float32)
    dense = load_model(ckpt_factory("tiny", "bf16", overrides={"sparse_topk_blocks": 1000}), dtype=torch.float32)
    budget = sparse.text.sparse.block_size * sparse.text.sparse.topk_blocks  # 64 tokens
    ids = _ids(3 * budget, seed=7)
    with torch.no_grad():
        a, b = sparse(ids), dense(ids)
    assert torch.allclose(a[:, :budget], b[:, :budget], rtol=0, atol=1e-5)
    late = (a[:, budget + 16:] - b[:, budget + 16:]).abs().max()
    assert late > 1e-2, "MSA past its threshold must not equal dense attention"


def test_cached_decode_equals_full_forward(nvfp4_model):
    model = nvfp4_model
    ids = _ids(100, seed=11)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(1, 128)
        steps = [model(ids[:, :37], positions=torch.arange(37)[None], cache=cache)]
        for t in range(37, 100):  # token by token, crossing several MSA block boundaries
            steps.append(model(ids[:, t:t + 1], positions=torch.tensor([[t]]), cache=cache))
    assert relative_max_error(torch.cat(steps, dim=1), full) < 1e-5


def test_chunked_prefill_equals_full_forward(nvfp4_model):
    model = nvfp4_model
    ids = _ids(150, seed=12)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(1, 150)
        parts = [model(ids[:, s:s + 48], positions=torch.arange(s, min(s + 48, 150))[None], cache=cache)
                 for s in range(0, 150, 48)]
    assert relative_max_error(torch.cat(parts, dim=1), full) < 1e-5


def test_batch_of_different_lengths_equals_each_alone(nvfp4_model):
    prompts = [_ids(n, seed=n)[0].tolist() for n in (90, 23, 61)]
    greedy = SamplingParams(temperature=0)
    together, _ = generate_ids(nvfp4_model, prompts, max_new_tokens=12, sampling=greedy)
    for p, seq in zip(prompts, together):
        alone, _ = generate_ids(nvfp4_model, [p], max_new_tokens=12, sampling=greedy)
        assert alone[0].generated == seq.generated


def test_greedy_generation_equals_transformers_generate(nvfp4_model, nvfp4_oracle):
    prompt = _ids(30, seed=13)
    seqs, _ = generate_ids(nvfp4_model, [prompt[0].tolist()], max_new_tokens=40,
                           sampling=SamplingParams(temperature=0))
    with torch.no_grad():
        out = nvfp4_oracle.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
    assert seqs[0].generated == out[0, 30:].tolist()


def test_sampling_is_reproducible_and_seed_dependent(nvfp4_model):
    p = [_ids(20, seed=1)[0].tolist()]
    s = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
    a, _ = generate_ids(nvfp4_model, p, max_new_tokens=20, sampling=s, seed=1)
    b, _ = generate_ids(nvfp4_model, p, max_new_tokens=20, sampling=s, seed=1)
    c, _ = generate_ids(nvfp4_model, p, max_new_tokens=20, sampling=s, seed=2)
    assert a[0].generated == b[0].generated != c[0].generated


def test_stop_token_ends_a_sequence(nvfp4_model):
    p = [_ids(20, seed=2)[0].tolist()]
    free, _ = generate_ids(nvfp4_model, p, max_new_tokens=10, sampling=SamplingParams(temperature=0))
    stop = free[0].generated[3]
    first = free[0].generated.index(stop)
    seqs, _ = generate_ids(nvfp4_model, p, max_new_tokens=10, sampling=SamplingParams(temperature=0),
                           stop_ids=[stop])
    assert seqs[0].generated == free[0].generated[:first + 1] and seqs[0].finish_reason == "stop"
    assert free[0].finish_reason == "length"


def test_trace_records_layers_routing_and_blocks(nvfp4_model, nvfp4_oracle):
    ids = _ids(90, seed=4)
    trace = Trace()
    with torch.no_grad():
        model_logits = nvfp4_model(ids, trace=trace)
        hf_out = nvfp4_oracle(ids, output_hidden_states=True)
    t = nvfp4_model.text
    assert sorted(trace.hidden_states) == list(range(t.num_hidden_layers))
    # transformers' hidden_states[L + 1] is the output of layer L (the last one after the final norm)
    for L in range(t.num_hidden_layers - 1):
        assert relative_max_error(trace.hidden_states[L], hf_out.hidden_states[L + 1]) < 1e-5
    assert relative_max_error(model_logits, hf_out.logits) < TOL
    for L in range(t.num_hidden_layers):
        if t.moe_layers[L]:
            r = trace.routing[L]
            assert r.expert_ids.shape == (90, t.num_experts_per_tok)
            assert torch.allclose(r.weights.sum(-1), torch.ones(90))
            # independent routing from the captured layer input
            layer = nvfp4_model.layers[L]
            h_in = hf_out.hidden_states[L]
            with torch.no_grad():
                attn = h_in + layer.self_attn(layer.input_layernorm(h_in), torch.arange(90)[None],
                                              *_rope(nvfp4_model, 90))
                x = layer.post_attention_layernorm(attn)[0]
            gate = layer.block_sparse_moe.gate
            scores = torch.sigmoid(x @ gate.weight.T)
            choice = torch.topk(scores + gate.e_score_correction_bias, t.num_experts_per_tok).indices
            assert torch.equal(choice.sort(-1).values, r.expert_ids.sort(-1).values)
        if t.sparse_layers[L]:
            b = trace.blocks[L]
            assert b.shape == (1, t.num_key_value_heads, 90, t.sparse.topk_blocks)
            q_block = torch.arange(90) // t.sparse.block_size
            assert bool((b == q_block[None, None, :, None]).any(-1).all()), "local block always selected"


def _rope(model, n):
    from minimax_ref.model.rope import rope_cos_sin, rope_inv_freq

    return rope_cos_sin(torch.arange(n)[None], rope_inv_freq(model.text.rotary_dim, model.text.rope_theta))


def test_bfloat16_mode_tracks_fp32(tiny_nvfp4, nvfp4_model):
    bf = load_model(tiny_nvfp4, dtype=torch.bfloat16)
    assert bf.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert bf.layers[1].block_sparse_moe.gate.weight.dtype == torch.float32
    ids = _ids(80, seed=9)
    with torch.no_grad():
        a, b = bf(ids), nvfp4_model(ids)
    assert a.dtype == torch.float32
    # bf16 rounding can flip an MSA block choice at a few positions, so compare typical error
    scale = b.abs().max()
    assert float((a - b).abs().mean() / scale) < 0.01
    assert float((a - b).abs().median(-1).values.max() / scale) < 0.05
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


def test_fp8_kv_cache(nvfp4_model):
    ids = _ids(70, seed=10)
    with torch.no_grad():
        full = nvfp4_model(ids)
        cache = nvfp4_model.new_cache(1, 70, kv_cache_dtype="fp8")
        cached = nvfp4_model(ids, positions=torch.arange(70)[None], cache=cache)
    assert cache.k[0].dtype == torch.float8_e4m3fn and cache.index_k[1].dtype == torch.float8_e4m3fn
    # e4m3 keeps 3 mantissa bits: small typical error, and exact K/V round trips of fp8 values
    err = float((cached - full).abs().mean() / full.abs().max())
    assert 0 < err < 0.03
    assert (cached.argmax(-1) == full.argmax(-1)).float().mean() > 0.7
    k = cache.keys_values(0, 70)[0]
    assert torch.equal(k, k.to(torch.float8_e4m3fn).float())


def test_cache_rollback_zeroes_dropped_positions(nvfp4_model):
    ids = _ids(40, seed=8)
    with torch.no_grad():
        a = nvfp4_model.new_cache(1, 40)
        nvfp4_model(ids, positions=torch.arange(40)[None], cache=a)
        a.rollback([25])
        b = nvfp4_model.new_cache(1, 40)
        nvfp4_model(ids[:, :25], positions=torch.arange(25)[None], cache=b)
    # equal up to GEMM blocking differences between 40-row and 25-row matmuls; zero past the length
    pairs = list(zip(a.k + a.v, b.k + b.v)) + [(x, y) for x, y in zip(a.index_k, b.index_k) if x is not None]
    for x, y in pairs:
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)
        assert not x[:, 25:].any()


def test_expert_mask_leaving_too_few_experts_is_refused():
    from minimax_ref.errors import ConfigError
    from minimax_ref.model.moe import route

    x, gate = torch.randn(3, 8), torch.randn(6, 8)
    mask = torch.tensor([True, True, True, False, False, False])
    with pytest.raises(ConfigError, match="keeps 3 experts but routing chooses 4"):
        route(x, gate, None, 4, mask)
    assert set(route(x, gate, None, 2, mask).expert_ids.flatten().tolist()) <= {0, 1, 2}


def test_batches_larger_than_max_batch_size_run_in_groups(tiny_nvfp4):
    model = load_model(tiny_nvfp4, dtype=torch.float32, max_batch_size=2)
    prompts = [_ids(n, seed=n)[0].tolist() for n in (30, 12, 50, 7, 21)]
    greedy = SamplingParams(temperature=0)
    seqs, stats = generate_ids(model, prompts, max_new_tokens=6, sampling=greedy)
    assert len(seqs) == 5 and stats.prompt_tokens == sum(map(len, prompts))
    for p, s in zip(prompts, seqs):
        assert generate_ids(model, [p], max_new_tokens=6, sampling=greedy)[0][0].generated == s.generated


@pytest.mark.parametrize("overrides", [
    {"sparse_index_dim": 16},                                      # index heads narrower than attention heads
    {"sparse_local_block": 2},                                     # two forced local blocks
    {"sparse_block_size": 8, "sparse_topk_blocks": 3},             # another MSA geometry
    {"num_key_value_heads": 1, "sparse_num_index_heads": 1},       # one kv head for all query heads
    {"head_dim": 64, "rotary_dim": 32},                            # head_dim != hidden / heads
    {"num_local_experts": 6, "num_experts_per_tok": 2},            # other expert counts
    {"tie_word_embeddings": True},                                 # no lm_head tensor
    {"n_shared_experts": 0},                                       # no shared expert
    {"use_routing_bias": False},                                   # routing without the selection bias
    {"num_local_experts": 5, "num_experts_per_tok": 5},            # every expert chosen, an odd count
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_other_geometries_match_transformers(ckpt_factory, overrides):
    model = load_model(ckpt_factory("tiny", "nvfp4", overrides=overrides), dtype=torch.float32)
    hf = hf_text_model(model)
    ids = _ids(130, seed=1, batch=2)
    with torch.no_grad():
        assert relative_max_error(model(ids), hf(ids).logits) < TOL
