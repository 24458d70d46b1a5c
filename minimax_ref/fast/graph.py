"""Decode steps captured in CUDA graphs.

`record`: a call with no host synchronisation and static shapes, captured after warm-up calls (which compile what
compiles on first use: compiled layers, the fused matmul).

`GraphStep`: one decode step of a model on one KV cache, recorded once and replayed. With the fast paths `moe` and
`static_kv` (no host synchronisation, static shapes) a decode step can be recorded.

`CapturedSteps`: what `FastMiniMaxM3.step` and `step_with_hidden` replay with `FastPaths(graph=True)`: the graphs of
one KV cache, one per step shape (batch, tokens per row) and kept layers, captured on that shape's first step.
"""

from __future__ import annotations

import sys
import time
import weakref

import torch

from ..model.cache import KVCache


def record(fn, device: torch.device) -> tuple[torch.cuda.CUDAGraph, object]:
    """`fn()` (no host synchronisation, static shapes) captured in a CUDA graph: two warm-up calls on a side stream
    first (allocator pools, library handles, NCCL, compiles), then the capture. Returns the graph and what the
    captured call returned: the buffers each replay rewrites."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


class GraphStep:
    """One decode step of `model` (a fast model, `FastMiniMaxM3.sync_free_step`) on `cache` captured in a CUDA graph.
    `replay(ids, pos)` copies the inputs into the captured buffers and replays: `all_logits` then holds the logits of
    every position [B, T, V] and `hidden` the residual stream after each layer in `layers` ({layer: [B, T, H]});
    `step(ids, pos)` replays and returns the logits of the last position [B, V]. All are overwritten by the next
    replay.

    The warm-up and the capture run the step on `ids0` at `pos0`: they write K/V there, the same values the first
    replay (on the same inputs) writes again. The graph addresses the cache's buffers, so it keeps the cache."""

    def __init__(self, model, cache: KVCache, ids0: torch.Tensor, pos0: torch.Tensor, layers: tuple[int, ...] = ()):
        self.cache = cache
        self.ids, self.pos = ids0.clone(), pos0.clone()
        self.graph, (self.all_logits, self.hidden) = record(
            lambda: model.sync_free_step(self.ids, self.pos, cache, layers), ids0.device)
        self.logits = self.all_logits[:, -1]

    def replay(self, ids: torch.Tensor, pos: torch.Tensor) -> None:
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        self.graph.replay()

    def step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.replay(ids, pos)
        return self.logits


class CapturedSteps:
    """The CUDA graphs of the decode steps on one KV cache, one per step shape [B, T] and kept layers, each captured on
    its first step. The graphs keep the cache alive (they address its buffers); a new cache gets a new
    `CapturedSteps`, and dropping this one frees the graphs, their memory pool and the cache. `seen` (shared across
    caches, owned by the model) holds the shapes already captured, so only the first capture of a shape (which, for
    compiled layers, compiles) is announced on `stream`."""

    def __init__(self, cache: KVCache, seen: set, stream=None):
        self.cache = weakref.ref(cache)  # strong references only through the graphs
        self.graphs: dict[tuple, GraphStep] = {}
        self.seen = seen
        self.stream = stream or sys.stderr
        self.capture_seconds = 0.0

    def holds(self, cache: KVCache) -> bool:
        return self.cache() is cache

    def step(self, model, ids: torch.Tensor, positions: torch.Tensor,
             layers: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(logits [B, T, V], {layer: [B, T, H]}) of `model.sync_free_step(ids, positions, <this cache>, layers)`,
        replayed from its graph (captured now if this shape and these layers have none yet). Valid until the next
        step."""
        shape = tuple(ids.shape)
        key = shape if not layers else (shape, layers)  # plain steps keyed by their shape alone
        graph = self.graphs.get(key)
        if graph is None:
            cache = self.cache()
            seen = (key, cache.max_seq_len, cache.fp8)
            first = seen not in self.seen
            if first:
                compiles = model.compiles_step(positions, cache, None, step=True)
                what = "compiling and capturing it" if compiles else "capturing it"
                print(f"[fast] first decode step of {shape[0]} sequence(s) x {shape[1]} token(s), cache of "
                      f"{cache.max_seq_len} slots: {what} in a CUDA graph...", file=self.stream, flush=True)
            t0 = time.perf_counter()
            graph = self.graphs[key] = GraphStep(model, cache, ids, positions, layers)
            seconds = time.perf_counter() - t0
            self.capture_seconds += seconds
            self.seen.add(seen)
            if first:
                print(f"[fast] decode step captured in {seconds:.1f} s", file=self.stream, flush=True)
        graph.replay(ids, positions)
        return graph.all_logits, graph.hidden
