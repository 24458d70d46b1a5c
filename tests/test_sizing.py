"""Batch and prefill-chunk sizes chosen from free memory (`generation.sizing`), against the rule worked by hand on
a small geometry, and the generation progress line (`progress.GenerationProgress`) on a fake clock."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from minimax_ref.errors import InputError
from minimax_ref.generation import sizing
from minimax_ref.model.config import SparseAttentionConfig, TextConfig
from minimax_ref.progress import GenerationProgress

GIB = 1 << 30

TEXT = TextConfig(
    vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=32, shared_intermediate_size=32, dense_intermediate_size=48, num_local_experts=8,
    num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=1.0, use_routing_bias=True, rms_norm_eps=1e-6,
    rope_theta=1e4, rotary_dim=16, max_position_embeddings=1 << 20, swiglu_alpha=1.702, swiglu_limit=7.0,
    tie_word_embeddings=False, sparse_layers=(True, False), moe_layers=(True, True),
    sparse=SparseAttentionConfig(index_heads=2, index_head_dim=8))

# By hand, fp32 and times the safety factor 2: residual, normed input, output and attention residual 4 x 64; q and
# the attention output 2 x 4 x 16, k and v 2 x 2 x 16; index queries 2 x 8; the routed width 2 x 32 + 32 = 96 as
# gate, up and activation, the 2 experts' outputs and their sum 3 x 64, router logits 8.
PER_TOKEN = 4 * 2 * (256 + 192 + 16 + 3 * 96 + 192 + 8)
# K and V of 2 layers x 2 kv heads x 16 in fp32, and one index key of 8 on the sparse layer.
KV_PER_TOKEN = 2 * (2 * 2 * 16 * 4) + 8 * 4


def _model(device: str = "cpu", world=None):
    return SimpleNamespace(device=torch.device(device), text=TEXT, config=SimpleNamespace(text=TEXT),
                           dtype=torch.float32, world=world)


@pytest.fixture
def free(monkeypatch):
    box = {}
    monkeypatch.setattr(sizing, "free_memory", lambda device: box["bytes"])
    return box


def test_per_token_estimates_worked_by_hand():
    assert sizing.prefill_bytes_per_token(TEXT) == PER_TOKEN
    # a bf16 model's activations take two bytes an element
    assert sizing.prefill_bytes_per_token(TEXT, 2) == PER_TOKEN // 2
    from minimax_ref.model.cache import kv_bytes_per_token

    assert kv_bytes_per_token(SimpleNamespace(text=TEXT), 1, "auto", 4) == KV_PER_TOKEN


def test_plenty_of_memory_takes_the_caps(free):
    free["bytes"] = 10 * GIB
    s = sizing.choose_sizes(_model(), cache_len=1000, kv_cache_dtype="auto")
    # the chunk stops at the cache length rounded up to a power of two, the batch at the CPU cap
    assert (s.prefill_chunk, s.max_batch_size) == (1024, 16)
    assert s.free_bytes == int(10 * GIB * 0.92) - GIB
    s = sizing.choose_sizes(_model("cuda"), cache_len=100_000, kv_cache_dtype="auto")
    assert (s.prefill_chunk, s.max_batch_size) == (16384, 64)


def test_tight_memory_sizes_by_the_rule(free):
    free["bytes"] = int(1.2 * GIB)
    left = int(1.2 * GIB * 0.92) - GIB  # 111,669,149 bytes after the utilisation and the fixed reserve
    s = sizing.choose_sizes(_model(), cache_len=50_000, kv_cache_dtype="auto")
    # a quarter of it over PER_TOKEN is 3,665 tokens: the chunk is 2,048 (the CPU cap as well)
    assert left // 4 // PER_TOKEN == 3665 and s.prefill_chunk == 2048
    # what the chunk leaves holds (111,669,149 - 2,048 x 7,616) / (50,000 x 544) = 3.5 rows
    assert s.max_batch_size == (left - 2048 * PER_TOKEN) // (50_000 * KV_PER_TOKEN) == 3
    # fp8 stores one byte per element where fp32 stored four
    s8 = sizing.choose_sizes(_model(), cache_len=50_000, kv_cache_dtype="fp8")
    assert s8.max_batch_size == min(16, (left - 2048 * PER_TOKEN) // (50_000 * KV_PER_TOKEN // 4))


def test_a_bf16_model_prefills_twice_the_tokens_in_the_same_memory(free):
    free["bytes"] = int(2.3 * GIB)
    left = int(2.3 * GIB * 0.92) - 2 * GIB  # 124,554,051 bytes after the utilisation and CUDA's fixed reserve
    model = _model("cuda")
    s32 = sizing.choose_sizes(model, cache_len=50_000, kv_cache_dtype="auto")
    model.dtype = torch.bfloat16
    s16 = sizing.choose_sizes(model, cache_len=50_000, kv_cache_dtype="auto")
    # a quarter of `left` over PER_TOKEN is 4,088 tokens (a chunk of 2,048), over the bf16 PER_TOKEN / 2 8,177 (4,096)
    assert (left // 4 // PER_TOKEN, s32.prefill_chunk) == (4088, 2048)
    assert (left // 4 // (PER_TOKEN // 2), s16.prefill_chunk) == (8177, 4096)
    # the bf16 cache takes half of fp32's bytes a position: (124,554,051 - 4,096 x 3,808) / (50,000 x 272) = 8.0
    assert s16.max_batch_size == (left - 4096 * PER_TOKEN // 2) // (50_000 * KV_PER_TOKEN // 2) == 8


def test_a_row_that_cannot_fit_is_an_input_error(free):
    free["bytes"] = 50_000_000
    with pytest.raises(InputError, match=r"one sequence of 100000 positions.*--max-model-len"):
        sizing.choose_sizes(_model(), cache_len=100_000, kv_cache_dtype="auto")


def test_tensor_parallel_ranks_agree_on_the_smallest(free):
    free["bytes"] = int(1.2 * GIB)
    world = SimpleNamespace(size=2, gather_objects=lambda x: [x, x // 2])
    s = sizing.choose_sizes(_model(world=world), cache_len=20_000, kv_cache_dtype="auto")
    left = int((int(1.2 * GIB) // 2) * 0.92) - GIB
    assert s.free_bytes == max(0, left)
    # every rank holds one of the two kv heads: 2 layers x 1 head x 2 x 16 x 4 bytes + the index key
    per_card = 2 * (1 * 2 * 16 * 4) + 8 * 4
    assert s.max_batch_size == max(1, min(16, (max(0, left) - s.prefill_chunk * PER_TOKEN) // (20_000 * per_card)))


def test_generation_progress_on_a_pipe_writes_a_line_every_interval():
    now = [0.0]
    out = io.StringIO()
    p = GenerationProgress(4, 400, stream=out, every_s=30, clock=lambda: now[0])
    now[0] = 10.0
    p.token(50)
    now[0] = 20.0
    p.request_done(unused_tokens=60)  # stopped after 40 of its 100 tokens
    p.token(30)
    assert out.getvalue() == ""  # a short run stays quiet
    now[0] = 40.0
    p.token(20)
    line = out.getvalue()
    # 100 tokens in 40 s: 2.5 tok/s; 400 - 60 allowed, 100 taken: 240 tokens left, 96 s at that rate
    assert line == "[progress] requests 1/4, 100 tokens, 2.5 tok/s, 40 s, 96 s left at most\n"
    now[0] = 50.0
    p.token()
    assert out.getvalue() == line  # the next line comes 30 s after the last
    p.close()


def test_a_second_call_sizes_with_the_first_calls_captured_cache_freed(monkeypatch):
    """A fast model keeps the previous call's KV cache alive through its captured steps (their graphs address it);
    a call choosing its batch from free memory frees that cache first, so it does not pick a smaller batch (and
    compile a step for a new batch size) because of memory the previous call no longer needs."""
    import gc
    import weakref

    from minimax_ref.fast.graph import CapturedSteps
    from minimax_ref.generation import decoding
    from minimax_ref.weights.loader import load_synthetic

    model = load_synthetic("tiny", dtype=torch.float32, fast=True)
    cache = model.new_cache(2, 64)
    captured = CapturedSteps(cache, model.captured_shapes)
    captured.graphs[(2, 1)] = SimpleNamespace(cache=cache)  # as a GraphStep: the only strong reference to it
    model.captured, held = captured, weakref.ref(cache)
    del cache, captured
    gc.collect()
    assert held() is not None
    alive_when_sized = []
    real = decoding.choose_sizes

    def spy(m, cache_len, kv_dtype):
        gc.collect()
        alive_when_sized.append(held() is not None)
        return real(m, cache_len, kv_dtype)

    monkeypatch.setattr(decoding, "choose_sizes", spy)
    seqs, _ = decoding.generate_ids(model, [[1, 2, 3]], max_new_tokens=2)
    assert alive_when_sized == [False] and len(seqs[0].generated) == 2
