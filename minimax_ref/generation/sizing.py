"""How many requests decode together and how many prompt tokens one prefill call takes, chosen from the memory
left once the weights are loaded (what `generate` uses when `max_batch_size` / `prefill_chunk` are not given).

The rule, for one call whose KV cache holds `cache_len` positions a row:

* `free`: the device's free memory (CUDA: `torch.cuda.mem_get_info` plus what the caching allocator holds
  unused; CPU: the host's `MemAvailable`) times `UTILIZATION` (the seed's vLLM setting), less `FIXED_RESERVE`
  (CUDA graphs, sampler, allocator slack). Under tensor parallelism, the smallest over the ranks, so every rank
  chooses the same sizes.
* The prefill chunk: the largest power of two from `MIN_PREFILL_CHUNK` to the device's cap (`PREFILL_CHUNK_CAP`)
  and to `cache_len` rounded up to a power of two, whose activations (`prefill_bytes_per_token` a token, in the
  model's compute dtype) take at most `PREFILL_SHARE` of `free`. Larger chunks run the products at higher
  efficiency (fewer, larger GEMMs); the cap bounds the time one prefill call holds the decode steps back.
* The batch: as many rows of `cache_len` positions (`cache.kv_bytes_per_token` a position) as fit in what is left
  after that chunk's activations, from 1 to the device's cap (`BATCH_CAP`).

A call whose single row of KV cache does not fit `free` raises InputError naming both sizes (lower
`--max-model-len` / `max_new_tokens`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputError
from ..model.cache import kv_bytes_per_token
from ..model.config import TextConfig

GIB = 1 << 30
UTILIZATION = 0.92
FIXED_RESERVE = {"cuda": 2 * GIB, "cpu": 1 * GIB}
PREFILL_SHARE = 0.25
MIN_PREFILL_CHUNK = 256
# On a CPU the products are compute-bound at any chunk size; a GPU's gain from larger chunks levels off near 16K.
PREFILL_CHUNK_CAP = {"cuda": 16384, "cpu": 2048}
# Every slot decodes each step: a CPU's step time grows with the batch; a GPU's captured step barely does up to 64.
BATCH_CAP = {"cuda": 64, "cpu": 16}
# Activations are in the compute dtype; a prefill keeps fp32 temporaries beside some of them (softmax, norms, the
# experts' combine) and the allocator rounds block sizes up.
ACTIVATION_SAFETY = 2


@dataclass(frozen=True)
class Sizes:
    """The chosen sizes and the free memory (bytes, after `UTILIZATION` and `FIXED_RESERVE`) they came from."""

    max_batch_size: int
    prefill_chunk: int
    free_bytes: int

    def describe(self) -> str:
        return (f"batch {self.max_batch_size}, prefill chunk {self.prefill_chunk} tokens "
                f"(from {self.free_bytes / GIB:,.1f} GiB free)")


def prefill_bytes_per_token(t: TextConfig, dtype_bytes: int = 4, chunk_elements: int = 1 << 24) -> int:
    """An upper estimate of the activation bytes one prompt token takes during a prefill call, `dtype_bytes` an
    element (the compute dtype's) times `ACTIVATION_SAFETY`: one layer's temporaries are alive at a time (the
    residual, the normed input and the layer's output; queries, keys, values and the attention output; the index
    queries; the widest feed-forward's gate, up and activation and the routed experts' outputs before their weighted
    sum; the router logits). Attention and index scores are chunked to `chunk_elements` whatever the tokens, so they
    are not per token."""
    attention = (2 * t.num_attention_heads + 2 * t.num_key_value_heads) * t.head_dim
    index = t.sparse.index_heads * t.sparse.index_head_dim if any(t.sparse_layers) else 0
    routed = t.num_experts_per_tok * t.intermediate_size + t.n_shared_experts * t.shared_intermediate_size
    ffn_width = max(t.dense_intermediate_size if not all(t.moe_layers) else 0, routed if t.has_moe else 0)
    ffn = 3 * ffn_width + (t.num_experts_per_tok + 1) * t.hidden_size + t.num_local_experts
    return dtype_bytes * ACTIVATION_SAFETY * (4 * t.hidden_size + attention + index + ffn)


def free_memory(device: torch.device) -> int:
    """Bytes this process may still allocate on `device`: CUDA's free memory plus the caching allocator's reserved
    but unused blocks; on a CPU the host's MemAvailable (or free pages where /proc is absent)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def choose_sizes(model, cache_len: int, kv_cache_dtype: str) -> Sizes:
    """The batch and prefill chunk for a call of `model` whose rows hold `cache_len` positions (module docstring).
    `kv_cache_dtype`: "auto" or "fp8", as the cache is built."""
    device = model.device
    kind = "cuda" if device.type == "cuda" else "cpu"
    world = getattr(model, "world", None)
    raw = free_memory(device)
    if world is not None and world.size > 1:
        raw = min(world.gather_objects(raw))
    free = max(0, int(raw * UTILIZATION) - FIXED_RESERVE[kind])
    t = model.text
    dtype_bytes = model.dtype.itemsize
    tp = world.size if world is not None else 1
    row = kv_bytes_per_token(model.config, tp, kv_cache_dtype, dtype_bytes) * cache_len
    if row > raw:
        raise InputError(f"the KV cache of one sequence of {cache_len} positions takes {row / GIB:,.2f} GiB but "
                         f"{raw / GIB:,.2f} GiB of {device} memory is free: lower --max-model-len (max_seq_len) or "
                         "max_new_tokens, or use --kv-cache-dtype fp8")
    per_token = prefill_bytes_per_token(t, dtype_bytes)
    cap = min(PREFILL_CHUNK_CAP[kind], 1 << math.ceil(math.log2(max(cache_len, 1))))
    chunk = min(cap, max(MIN_PREFILL_CHUNK, _pow2_floor(int(free * PREFILL_SHARE) // per_token)))
    rows = (free - chunk * per_token) // row if row else BATCH_CAP[kind]
    return Sizes(max_batch_size=int(min(BATCH_CAP[kind], max(1, rows))), prefill_chunk=int(chunk), free_bytes=free)


__all__ = ["Sizes", "choose_sizes", "free_memory", "prefill_bytes_per_token"]
