"""KV cache indexed by absolute position.

For every layer the cache holds K (after q/k norm and RoPE) and V, shaped [B, S_max, kv_heads, D];
sparse (MSA) layers also hold the lightning indexer's key, [B, S_max, index_dim]. Slot `p` of a
sequence holds the token at position `p`, so:

* chunked prefill, and decode of sequences with different lengths, are writes at explicit
  positions;
* slots past a sequence's length may hold stale values: causality (key position <= query
  position) hides them, and the next write overwrites them;
* rollback (speculative decoding) only needs the new lengths; `rollback` also zeroes the dropped
  slots so the cache equals one that never saw them.

`kv_cache_dtype="fp8"` (decided here): K, V and index keys are stored as float8_e4m3fn, saturating
at +-448, with a per-tensor scale of 1.0 (the release ships no KV scales); reads cast back to the
compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import TextConfig

FP8_MAX = 448.0


def kv_bytes_per_token(cfg, tp: int, kv_cache_dtype: str, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token occupies on one card at tensor parallelism `tp` (`cfg`: a `ModelConfig`): K and V of
    every layer (its kv heads split over min(tp, kv_heads) cards) and the index key of every MSA layer (replicated),
    one byte an element with "fp8", else `dtype_bytes`."""
    t = cfg.text
    elem = 1 if kv_cache_dtype == "fp8" else dtype_bytes
    kv_per_card = t.num_key_value_heads // min(tp, t.num_key_value_heads)
    per_layer = 2 * kv_per_card * t.head_dim * elem
    index = sum(t.sparse_layers) * t.sparse.index_head_dim * elem
    return t.num_hidden_layers * per_layer + index


def store_kv(x: torch.Tensor, store: torch.dtype, scale: float) -> torch.Tensor:
    """Values to their stored form: fp8 (`store` float8_e4m3fn) is `x / scale` in fp32, saturated at +-448;
    any other `store` is a cast."""
    if store == torch.float8_e4m3fn:
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return x.to(store)


@dataclass(frozen=True, eq=False)
class LayerCache:
    """One layer's part of a `KVCache` (views of its buffers): what a layer's attention reads and writes.

    k, v: [B, S_max, kv_heads, D]; index_k: [B, S_max, index_dim] on sparse layers, else None. It holds only
    the layer's tensors and the storage constants, so a layer needs no index into the whole cache.
    """

    k: torch.Tensor
    v: torch.Tensor
    index_k: torch.Tensor | None
    dtype: torch.dtype
    scale: float

    @property
    def fp8(self) -> bool:
        return self.k.dtype == torch.float8_e4m3fn

    def load(self, x: torch.Tensor) -> torch.Tensor:
        """Stored values (any part of a buffer) -> the compute dtype."""
        if self.fp8:
            return (x.float() * self.scale).to(self.dtype)
        return x

    def _write(self, buf: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        rows = torch.arange(values.shape[0], device=positions.device)[:, None]
        buf[rows, positions] = store_kv(values, buf.dtype, self.scale)

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store k, v [B, T, kv_heads, D] of the tokens at `positions` [B, T]."""
        self._write(self.k, k, positions)
        self._write(self.v, v, positions)

    def write_index(self, ik: torch.Tensor, positions: torch.Tensor) -> None:
        """Store index keys [B, T, index_dim] (sparse layers)."""
        self._write(self.index_k, ik, positions)

    def keys_values(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of slots [0, length): [B, length, kv_heads, D] in the compute dtype."""
        return self.load(self.k[:, :length]), self.load(self.v[:, :length])

    def stored_keys_values(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of slots [0, length) as stored (views, no copy; `load` converts them). MSA's fast path
        gathers its selected blocks from these and converts only those."""
        return self.k[:, :length], self.v[:, :length]

    def index_keys(self, length: int) -> torch.Tensor:
        return self.load(self.index_k[:, :length])

    def stored_index_keys(self, length: int) -> torch.Tensor:
        """Index keys of slots [0, length) as stored (a view; `load` converts them)."""
        return self.index_k[:, :length]


class KVCache:
    """Every layer's K, V (and index keys) for `batch_size` sequences of up to `max_seq_len` positions."""

    def __init__(self, cfg: TextConfig, batch_size: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", kv_cache_dtype: str = "auto", kv_heads: int | None = None):
        store = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else dtype
        kv_heads = cfg.num_key_value_heads if kv_heads is None else kv_heads
        shape = (batch_size, max_seq_len, kv_heads, cfg.head_dim)
        idx_shape = (batch_size, max_seq_len, cfg.sparse.index_head_dim)
        self._hold([torch.zeros(shape, dtype=store, device=device) for _ in range(cfg.num_hidden_layers)],
                   [torch.zeros(shape, dtype=store, device=device) for _ in range(cfg.num_hidden_layers)],
                   [torch.zeros(idx_shape, dtype=store, device=device) if sparse else None
                    for sparse in cfg.sparse_layers], dtype)

    def _hold(self, k: list[torch.Tensor], v: list[torch.Tensor], index_k: list[torch.Tensor | None],
              dtype: torch.dtype) -> None:
        self.k, self.v, self.index_k, self.dtype = k, v, index_k, dtype
        self.batch_size, self.max_seq_len = k[0].shape[0], k[0].shape[1]
        self.fp8 = k[0].dtype == torch.float8_e4m3fn
        self.scale = 1.0
        self._layers = [LayerCache(k, v, i, dtype, self.scale) for k, v, i in zip(self.k, self.v, self.index_k)]

    def rows(self, start: int, stop: int) -> KVCache:
        """Sequences start..stop-1 as a cache of their own: views of this cache's buffers, so what is written
        through it lands here (a request prefilled into its slot of a running batch)."""
        view = object.__new__(KVCache)
        view._hold([k[start:stop] for k in self.k], [v[start:stop] for v in self.v],
                   [None if i is None else i[start:stop] for i in self.index_k], self.dtype)
        return view

    def layer(self, layer: int) -> LayerCache:
        """Layer `layer`'s buffers (views; writes through it land in this cache)."""
        return self._layers[layer]

    def load(self, x: torch.Tensor) -> torch.Tensor:
        """Stored values (any part of a buffer) -> the compute dtype."""
        return self._layers[0].load(x)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store k, v [B, T, kv_heads, D] of the tokens at `positions` [B, T]."""
        self._layers[layer].write(k, v, positions)

    def write_index(self, layer: int, ik: torch.Tensor, positions: torch.Tensor) -> None:
        """Store index keys [B, T, index_dim] of a sparse layer."""
        self._layers[layer].write_index(ik, positions)

    def keys_values(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of slots [0, length): [B, length, kv_heads, D] in the compute dtype."""
        return self._layers[layer].keys_values(length)

    def stored_keys_values(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of slots [0, length) as stored (views, no copy; `load` converts them)."""
        return self._layers[layer].stored_keys_values(length)

    def index_keys(self, layer: int, length: int) -> torch.Tensor:
        return self._layers[layer].index_keys(length)

    def rollback(self, lengths: torch.Tensor | list[int]) -> None:
        """Forget every slot at or past `lengths[b]` for each sequence b (zeroes them)."""
        for b, n in enumerate(torch.as_tensor(lengths).tolist()):
            for buf in (*self.k, *self.v, *(i for i in self.index_k if i is not None)):
                buf[b, n:] = 0

    def reset(self) -> None:
        self.rollback([0] * self.batch_size)

    def nbytes(self) -> int:
        bufs = [*self.k, *self.v, *(i for i in self.index_k if i is not None)]
        return sum(b.numel() * b.element_size() for b in bufs)
